//! `pdserve worker`: one worker in its own process, serving routers over TCP.

use super::fleet::NatsArgs;
use super::http::{self, Stopped};
use super::stage::Part;
use anyhow::Context;
use pdserve_engine::batch::{EngineConfig, Objectives};
use pdserve_fleet::{Endpoints, Member, NatsConfig, NodeId, Registration, SendProbe};
use pdserve_kv_transfer::{ClusterKey, KvAddr, ListenAt, TransportKind};
use pdserve_protocol::Worker;
use pdserve_remote::WorkerServer;
use pdserve_types::Role;
use pdserve_worker::stages::RemoteStages;
use pdserve_worker::{LocalWorker, WorkerOptions};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// prefill | decode | mixed.
    #[arg(long)]
    role: Role,
    /// Address routers connect to (control messages and token streams).
    #[arg(long)]
    listen: SocketAddr,
    /// Where this worker receives KV over TCP; port 0 picks a free one. Default: the
    /// control address's host, any port. A group's later stage receives its own layers
    /// of a decode group's handoffs here.
    #[arg(long)]
    kv_listen: Option<SocketAddr>,
    /// `default`, a model `pdserve pull --list` names, or a path to a GGUF file or
    /// safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// real (the model) | sim (a simulated worker: the real worker with a timed engine
    /// whose steps take --profile's time and whose tokens are stand-ins).
    #[arg(long, default_value = "real")]
    engine: EngineKind,
    /// The profile a simulated worker follows (`pdserve profile`).
    #[arg(long, required_if_eq("engine", "sim"))]
    profile: Option<std::path::PathBuf>,
    /// Compute threads (default 1: two workers share a 2-core machine).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// KV blocks of 16 tokens [default: 1024 of f16, in bytes: see --kv-cache-gb].
    #[arg(long)]
    kv_blocks: Option<usize>,
    #[command(flatten)]
    kv_cache: super::KvCacheArgs,
    #[command(flatten)]
    tiers: super::KvTierArgs,
    #[command(flatten)]
    spec: super::SpecArgs,
    /// Keep running decodes within --slo-tpot-ms, as `serve --protect-tpot` does.
    #[arg(long)]
    protect_tpot: bool,
    /// The time-to-first-token objective by half of which --protect-tpot brings a
    /// held prompt's first token, in milliseconds.
    #[arg(long, default_value_t = 5000.0, requires = "protect_tpot")]
    slo_ttft_ms: f64,
    /// The time-per-output-token objective --protect-tpot keeps, in milliseconds.
    #[arg(long, default_value_t = 50.0, requires = "protect_tpot")]
    slo_tpot_ms: f64,
    /// Name in metrics and logs (default: ROLE@LISTEN).
    #[arg(long)]
    name: Option<String>,
    #[command(flatten)]
    security: super::Security,
    #[command(flatten)]
    nats: NatsArgs,
    /// The worker's id in the fleet (default: its name with `.`, `@`, `:` as `-`).
    #[arg(long, requires = "nats")]
    node_id: Option<NodeId>,
    /// The address other hosts reach this worker at, when it listens on 0.0.0.0 or
    /// behind NAT (default: the listen addresses).
    #[arg(long, requires = "nats")]
    advertise: Option<IpAddr>,
    /// Seconds the requests running here get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    grace_seconds: u64,
    #[command(flatten)]
    group: super::stage::GroupArgs,
}

/// KV blocks where neither --kv-blocks nor --kv-cache-gb is given: the budget is
/// what this many f16 blocks take.
const DEFAULT_KV_BLOCKS: usize = 1024;

/// What computes a worker's steps.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    Real,
    Sim,
}

/// The engine a worker runs, and what it tells the fleet about its model.
enum Compute {
    Real(pdserve_engine::loader::LoadedModel),
    Sim(Box<pdserve_twin::profile::Profile>),
}

impl Compute {
    fn load(a: &Args) -> anyhow::Result<Compute> {
        Ok(match (a.engine, &a.profile) {
            (EngineKind::Sim, Some(p)) => Compute::Sim(Box::new(pdserve_twin::profile::Profile::load(p)?)),
            (EngineKind::Sim, None) => anyhow::bail!("--engine sim needs --profile"),
            (EngineKind::Real, _) => Compute::Real(super::load_model_layers(&a.model, a.group.layers())?),
        })
    }

    fn real(&self) -> Option<&pdserve_engine::loader::LoadedModel> {
        match self {
            Compute::Real(m) => Some(m),
            Compute::Sim(_) => None,
        }
    }

    /// Checks `--kv-cache-dtype` against the model; a simulated worker's profile
    /// takes the dtype's bytes per token.
    fn with_kv_dtype(self, a: &Args) -> anyhow::Result<Compute> {
        Ok(match self {
            Compute::Real(m) => {
                a.kv_cache.dtype_for(&m.model.cfg)?;
                Compute::Real(m)
            }
            Compute::Sim(p) => Compute::Sim(Box::new(p.with_kv_dtype(a.kv_cache.kv_cache_dtype))),
        })
    }

    /// Bytes of one KV block of the model (all layers), in `dtype` and in f16.
    fn block_bytes(&self, dtype: pdserve_types::KvDtype) -> (usize, usize) {
        let block = pdserve_engine::batch::BLOCK_SIZE;
        match self {
            Compute::Real(m) => {
                let bytes = |d| pdserve_engine::kvcache::block_bytes(&m.model.cfg, block, d);
                (bytes(dtype), bytes(pdserve_types::KvDtype::F16))
            }
            // A simulated worker accounts the model's bytes, not its scaled frames'.
            Compute::Sim(p) => (p.block_bytes(), (p.block_bytes() as f64 / dtype.share_of_f16()) as usize),
        }
    }

    /// Blocks of the pool, from --kv-blocks or the byte budget.
    fn pool_blocks(&self, a: &Args) -> anyhow::Result<usize> {
        let (block, f16) = self.block_bytes(a.kv_cache.kv_cache_dtype);
        a.kv_cache.blocks(a.kv_blocks, DEFAULT_KV_BLOCKS, f16 as f64, block as f64)
    }

    fn model_name(&self) -> String {
        match self {
            Compute::Real(m) => m.name.clone(),
            Compute::Sim(p) => p.model.name.clone(),
        }
    }

    fn spawn(
        &self,
        mut opts: WorkerOptions,
        stages: Option<RemoteStages>,
        rt: tokio::runtime::Handle,
    ) -> std::io::Result<LocalWorker> {
        match self {
            Compute::Real(m) => {
                opts.eog = m.tokenizer.eog_ids().to_vec();
                opts.grammars = super::grammars(&m.tokenizer);
                match stages {
                    Some(s) => LocalWorker::spawn_head(opts, m.model.clone(), Box::new(s), rt),
                    None => LocalWorker::spawn(opts, m.model.clone(), rt),
                }
            }
            Compute::Sim(p) => {
                let timed = p.timed(opts.engine.threads, pdserve_engine::timed::Clock::Wall);
                let kv = pdserve_worker::SimKv {
                    bytes_per_token: p.model.kv_bytes_per_token,
                    layers: p.model.n_layers,
                    links: p.links(),
                };
                LocalWorker::spawn_timed(opts, timed, kv, rt)
            }
        }
    }
}

impl Args {
    fn objectives(&self) -> Option<Objectives> {
        self.protect_tpot.then_some(Objectives::from_ms(self.slo_ttft_ms, self.slo_tpot_ms))
    }

    fn check_objectives(&self) -> anyhow::Result<()> {
        if self.protect_tpot && !(self.slo_ttft_ms > 0.0 && self.slo_tpot_ms > 0.0) {
            anyhow::bail!("--slo-ttft-ms and --slo-tpot-ms must be positive");
        }
        Ok(())
    }

    fn engine(&self, num_blocks: usize, speculation: Option<pdserve_engine::batch::SpecConfig>) -> EngineConfig {
        EngineConfig {
            threads: self.threads.max(1),
            num_blocks,
            kv_dtype: self.kv_cache.kv_cache_dtype,
            objectives: self.objectives(),
            speculation,
            ..Default::default()
        }
    }
}

pub fn run(a: Args) -> anyhow::Result<Stopped> {
    a.check_objectives()?;
    let key = a.security.key()?;
    a.spec.check()?;
    let m = Compute::load(&a)?.with_kv_dtype(&a)?;
    let speculation = a.spec.config(m.real())?;
    let tiers = a.tiers.config(m.block_bytes(a.kv_cache.kv_cache_dtype).0)?;
    // Every stage of a group counts blocks of the whole model, so all have as many.
    let blocks = m.pool_blocks(&a)?;
    let stages = match group_part(&a, &m, blocks, &key, tiers.host_blocks + tiers.disk_blocks > 0)? {
        Part::Later(stopped) => return Ok(stopped),
        Part::Head(stages) => Some(*stages),
        Part::Whole => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("cannot listen on {}", a.listen))?;
        // Named by the address it actually listens on (port 0 picks one).
        let name = a.name.clone().unwrap_or(format!("{}@{}", a.role, listener.local_addr()?));
        let opts = WorkerOptions {
            name: name.clone(),
            role: a.role,
            model_name: m.model_name(),
            engine: a.engine(blocks, speculation),
            eog: Vec::new(),
            key: key.clone(),
            grammars: None,
            tiers,
        };
        let stages = stages.map(|s| a.group.find(s, in_fleet(&a, &key, &name).as_ref(), &m.model_name()));
        let worker = m
            .spawn(opts, stages, tokio::runtime::Handle::current())
            .with_context(|| format!("starting worker {name}"))?;
        let kv = listen_everywhere(&a, &worker).await?;
        let control = listener.local_addr()?;
        let fleet = match a.nats.config(&name, Some(&key)) {
            None => None,
            Some(cfg) => Some(join_fleet(&a, cfg, &name, &key, Endpoints { control, kv }, worker.clone(), blocks)?),
        };
        let worker = Arc::new(worker) as Arc<dyn Worker>;
        // On SIGINT/SIGTERM the fleet record goes first, so frontends stop sending
        // work; the server takes no new router, and what runs here finishes.
        let signal = http::signal();
        let stop = async move {
            signal.await;
            if let Some(reg) = fleet {
                reg.deregister().await;
            }
        };
        tracing::info!(
            "pdserve worker: {name} ({} role, {} thread(s), {blocks} KV blocks of {}) listening on {}, KV on tcp port {}",
            a.role,
            a.threads.max(1),
            a.kv_cache.kv_cache_dtype,
            control,
            kv.port()
        );
        let server = WorkerServer::new(worker.clone(), key);
        server.clone().serve(listener, stop).await;
        let stopped = drain(worker.as_ref(), &server, Duration::from_secs(a.grace_seconds)).await;
        tracing::info!("pdserve worker: stopped");
        Ok(stopped)
    })
}

/// What this worker is in a stage group (`tiers`: whether it keeps K/V tiers); a
/// later stage is served here until it stops.
fn group_part(a: &Args, m: &Compute, blocks: usize, key: &ClusterKey, tiers: bool) -> anyhow::Result<Part> {
    a.group.check(tiers, a.nats.nats.is_some())?;
    let how = (blocks, a.threads.max(1), a.kv_cache.kv_cache_dtype);
    let fleet = in_fleet(a, key, &format!("stage@{}", a.listen));
    a.group.part(m.real(), (a.listen, a.kv_listen), how, key, fleet)
}

/// Where a stage of a group meets the fleet, when this worker is in one.
fn in_fleet(a: &Args, key: &ClusterKey, name: &str) -> Option<super::stage::InFleet> {
    let cfg = a.nats.config(name, Some(key))?;
    Some(super::stage::InFleet { cfg, advertise: a.advertise, node_id: a.node_id.clone() })
}

/// Binds a receiver of every transport: any worker receives KV, since its role may
/// change to decode at run time. Answers the TCP receiver's address, the one peers
/// probe (the handshake names them all).
async fn listen_everywhere(a: &Args, worker: &LocalWorker) -> anyhow::Result<SocketAddr> {
    let at =
        ListenAt { net: a.kv_listen.unwrap_or(SocketAddr::new(a.listen.ip(), 0)), socket: super::socket_path("kv")? };
    let mut kv = at.net;
    for via in TransportKind::ALL {
        if let Some(KvAddr::Tcp(bound)) = worker.listen(via, &at).await.with_context(|| format!("{via} KV receiver"))? {
            kv = bound;
        }
    }
    Ok(kv)
}

/// Joins the fleet at `cfg` with the endpoints others reach, `here` as `--advertise`
/// rewrites them.
fn join_fleet(
    a: &Args,
    cfg: NatsConfig,
    name: &str,
    key: &ClusterKey,
    here: Endpoints,
    local: LocalWorker,
    blocks: usize,
) -> anyhow::Result<Registration> {
    let at = |addr: SocketAddr| a.advertise.map_or(addr, |ip| SocketAddr::new(ip, addr.port()));
    if a.advertise.is_none() && here.control.ip().is_unspecified() {
        anyhow::bail!("a worker listening on {} must say where others reach it: add --advertise IP", here.control);
    }
    let prober = local.clone();
    let send_probe: SendProbe = Arc::new(move |to, id, token, bytes| {
        let w = prober.clone();
        Box::pin(async move { w.probe(to, id, token, bytes).await })
    });
    Ok(pdserve_fleet::join(
        cfg,
        Member {
            id: a.node_id.clone().unwrap_or_else(|| NodeId::sanitized(name)),
            worker: Arc::new(local),
            endpoints: Endpoints { control: at(here.control), kv: at(here.kv) },
            threads: a.threads.max(1),
            blocks,
            send_probe,
            key: key.clone(),
        },
    ))
}

/// Waits until nothing waits, runs or is being received here and every frame owed
/// to a router is written, for at most `grace` (or until a second signal); what is
/// left then is cut when the process exits.
async fn drain(worker: &dyn Worker, server: &WorkerServer, grace: Duration) -> Stopped {
    let busy = |s: &pdserve_protocol::WorkerStats| s.waiting + s.running + s.importing;
    let idle = async {
        loop {
            match worker.stats().await {
                Ok(s) if busy(&s) == 0 && server.owed() == 0 => return,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    };
    if let Ok(s) = worker.stats().await {
        tracing::info!("pdserve worker: finishing {} request(s) (grace {grace:?})", busy(&s));
    }
    let why = tokio::select! {
        _ = idle => return Stopped::Drained,
        _ = tokio::time::sleep(grace) => "grace period over",
        _ = http::signal() => "second signal",
    };
    let left = worker.stats().await.map_or(0, |s| busy(&s));
    // Calls the engine let go whose last frames a router has not taken yet.
    let unsent = server.owed();
    tracing::warn!("pdserve worker: {why}, cutting {left} request(s) ({unsent} call(s) or frame(s) unsent)");
    Stopped::Cut(left)
}
