//! `pdserve serve`: frontend, router and workers in one process.

use super::http::{self, ApiArgs, Served};
use anyhow::Context;
use pdserve_engine::batch::{EngineConfig, Objectives};
use pdserve_engine::grammar::Grammars;
use pdserve_engine::loader::LoadedModel;
use pdserve_frontend::Metrics;
use pdserve_kv_transfer::{ListenAt, TransportKind};
use pdserve_planner::{model::Slo, Planner, PlannerConfig};
use pdserve_protocol::Worker;
use pdserve_router::{Mode, PolicyKind, Router};
use pdserve_types::Role;
use pdserve_worker::{LocalWorker, WorkerOptions};

/// KV blocks per worker where `--kv-blocks` is not given.
pub const KV_BLOCKS: usize = 1024;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    /// `default`, a model `pdserve pull --list` names, or a path to a GGUF file or
    /// safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// The NATS of a NimsForest forest, for --river (this process's own workers do
    /// not join a fleet).
    #[command(flatten)]
    nats: super::fleet::NatsArgs,
    /// Also take inference requests from the forest's River and Wind and answer them
    /// with Leaves (docs/nimsforest.md).
    #[arg(long, requires = "nats")]
    river: bool,
    #[command(flatten)]
    topology: TopologyArgs,
    #[command(flatten)]
    spec: super::SpecArgs,
    /// The time-to-first-token objective the planner plans for, and by half of
    /// which --protect-tpot brings a held prompt's first token, in milliseconds
    /// [default: 5000].
    #[arg(long)]
    slo_ttft_ms: Option<f64>,
    /// The time-per-output-token objective the planner plans for and --protect-tpot
    /// keeps, in milliseconds [default: 50].
    #[arg(long)]
    slo_tpot_ms: Option<f64>,
    #[command(flatten)]
    api: ApiArgs,
}

/// The workers and how requests are routed among them (`serve`, and `sim`).
#[derive(clap::Args)]
pub struct TopologyArgs {
    /// aggregated | disaggregated | auto (per request, from live measurements: prefill
    /// on the decode worker or on another worker, whichever gives the first token sooner).
    #[arg(long, default_value = "auto")]
    pub mode: Mode,
    /// How to pick among workers of one role: kv-aware (the default: the soonest
    /// predicted first token, counting each worker's cached prefix) | least-loaded |
    /// round-robin.
    #[arg(long, default_value = "kv-aware")]
    pub policy: PolicyKind,
    /// Prefill workers (disaggregated and auto; default 1).
    #[arg(long)]
    pub prefill: Option<usize>,
    /// Decode workers (disaggregated and auto; default 1).
    #[arg(long)]
    pub decode: Option<usize>,
    /// Mixed workers (aggregated, or auto over mixed workers; default 1).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Compute threads per worker (default: the cores divided among the workers).
    #[arg(long)]
    pub threads_per_worker: Option<usize>,
    /// KV blocks of 16 tokens per worker [default: 1024; `pdserve sim`: the
    /// profile's, which states what the profiled hardware holds].
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    #[command(flatten)]
    pub kv_cache: super::KvCacheArgs,
    #[command(flatten)]
    pub tiers: super::KvTierArgs,
    /// How KV moves from prefill to decode workers: inproc (hand over the frames; the
    /// default), tcp (loopback socket) or shm (shared-memory ring); tcp and shm exercise
    /// the transports a multi-process deployment uses.
    #[arg(long)]
    pub kv_transport: Option<TransportKind>,
    /// Never fetch a prefix another worker caches: recompute it (by default a worker
    /// lacking it takes the blocks from the holder where that is predicted sooner).
    #[arg(long)]
    pub no_kv_fetch: bool,
    /// Let the planner give each worker its role (prefill, decode or mixed) from the
    /// traffic, switching them in place (needs --mode auto; e.g. --workers 2).
    #[arg(long)]
    pub planner: bool,
    /// Keep running decodes within the TPOT objective (--slo-tpot-ms): a worker's
    /// step computes beside them only the prompt tokens their slack pays for, or
    /// the pace a queued prompt needs for its first token by half --slo-ttft-ms.
    #[arg(long)]
    pub protect_tpot: bool,
}

impl TopologyArgs {
    /// Refuses flags that mean nothing in the chosen mode, before anything loads.
    pub fn check(&self) -> anyhow::Result<()> {
        let a = self;
        let split = a.prefill.is_some() || a.decode.is_some();
        match a.mode {
            Mode::Aggregated if split => anyhow::bail!("--prefill and --decode need --mode disaggregated or auto"),
            Mode::Aggregated if a.kv_transport.is_some() => {
                anyhow::bail!("--kv-transport needs --mode disaggregated or auto (aggregated moves no KV)")
            }
            Mode::Disaggregated if a.workers.is_some() => {
                anyhow::bail!("--workers (mixed workers) does not fit --mode disaggregated: use --prefill and --decode")
            }
            Mode::Auto if split && a.workers.is_some() => {
                anyhow::bail!("--workers (mixed workers) and --prefill/--decode exclude each other")
            }
            Mode::Aggregated | Mode::Disaggregated if a.planner => {
                anyhow::bail!("--planner needs --mode auto (the planner routes by the roles it gives)")
            }
            _ => Ok(()),
        }
    }

    /// Which workers to start, from the mode and the counts given.
    pub fn roles(&self) -> Vec<Role> {
        let a = self;
        match a.mode {
            Mode::Aggregated => vec![Role::Mixed; a.workers.unwrap_or(1).max(1)],
            // Auto over mixed workers: any of them may prefill for another.
            Mode::Auto if a.workers.is_some() => vec![Role::Mixed; a.workers.unwrap_or(1).max(1)],
            _ => {
                let mut r = vec![Role::Prefill; a.prefill.unwrap_or(1)];
                r.extend(vec![Role::Decode; a.decode.unwrap_or(1).max(1)]);
                r
            }
        }
    }

    /// Compute threads per worker: as given, or the cores shared among the workers.
    pub fn threads(&self, workers: usize) -> usize {
        let cores = super::generate::default_threads();
        self.threads_per_worker.unwrap_or_else(|| (cores / workers.max(1)).max(1))
    }
}

fn check(a: &Args) -> anyhow::Result<()> {
    a.topology.check()?;
    let given = a.slo_ttft_ms.is_some() || a.slo_tpot_ms.is_some();
    if given && !(a.topology.planner || a.topology.protect_tpot) {
        anyhow::bail!("--slo-ttft-ms and --slo-tpot-ms need --planner or --protect-tpot");
    }
    let (ttft, tpot) = objectives_ms(a);
    if !(ttft > 0.0 && tpot > 0.0) {
        anyhow::bail!("--slo-ttft-ms and --slo-tpot-ms must be positive");
    }
    Ok(())
}

/// The TTFT and TPOT objectives in milliseconds, defaults filled in.
fn objectives_ms(a: &Args) -> (f64, f64) {
    (a.slo_ttft_ms.unwrap_or(5000.0), a.slo_tpot_ms.unwrap_or(50.0))
}

pub fn run(a: Args) -> anyhow::Result<super::Stopped> {
    check(&a)?;
    if a.nats.nats.is_some() && !a.river {
        anyhow::bail!(
            "serve uses --nats only with --river (its workers do not join a fleet; use `pdserve worker --nats`)"
        );
    }
    let t = &a.topology;
    let via = t.kv_transport.unwrap_or(TransportKind::Inproc);
    a.spec.check()?;
    let m = super::load_model(&a.model)?;
    let roles = t.roles();
    let threads = t.threads(roles.len());
    let metrics = Metrics::new();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let grammars = super::grammars(&m.tokenizer);
    let (ttft_ms, tpot_ms) = objectives_ms(&a);
    let workers = spawn_workers(&a, &m, &grammars, &metrics, rt.handle())?;
    let banner = format!(
        "workers: {}, {threads} thread(s) each",
        roles.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
    );
    let here = rt.handle().clone();
    rt.block_on(async move {
        // The loopback transports need a receiver on each worker that may decode
        // (under the planner, any worker may come to).
        for w in workers.iter().filter(|w| t.planner || w.info().role.decodes()) {
            listen(w, via).await?;
        }
        let router = Arc::new(
            Router::new(workers.into_iter().map(|w| Arc::new(w) as Arc<dyn Worker>), t.mode, a.api.deadlines(), here)
                .with_policy(t.policy.build())
                .with_limits(a.api.admission.limits())
                .with_transport(via)
                .with_prefix_fetch(!t.no_kv_fetch)
                .with_telemetry(Arc::new(metrics.clone())),
        );
        router.follow_kv_events();
        if t.planner {
            let slo = Slo::from_ms(ttft_ms, tpot_ms);
            Planner::spawn(router.clone(), PlannerConfig::new(slo));
        }
        let river = a.nats.config("pdserve-river", None).filter(|_| a.river);
        let observer = river.clone().map(pdserve_forest::LeafObserver::start);
        let model = Served {
            observer: observer.clone().map(|o| o as Arc<dyn pdserve_frontend::observe::Observer>),
            grammars: grammars.clone(),
            tokenizer: m.tokenizer.clone(),
            chat: m.chat.clone(),
            name: m.name.clone(),
            context_length: m.model.cfg.context_length,
        };
        http::serve(
            router,
            metrics,
            model,
            &a.api,
            &banner,
            pdserve_forest::after_bind(river, observer, a.api.api_key(), a.nats.river_reply_prefix.clone()),
        )
        .await
    })
}

/// Starts one worker per role of the topology, all over the one copy of the model's
/// weights, each named `{role}-{i}`.
fn spawn_workers(
    a: &Args,
    m: &LoadedModel,
    grammars: &Option<Arc<Grammars>>,
    metrics: &Metrics,
    rt: &tokio::runtime::Handle,
) -> anyhow::Result<Vec<LocalWorker>> {
    let t = &a.topology;
    let roles = t.roles();
    // Both ends of every KV link are in this process: a key of its own.
    let key = pdserve_kv_transfer::ClusterKey::random();
    let cfg = &m.model.cfg;
    let kv_dtype = t.kv_cache.dtype_for(cfg)?;
    let tiers =
        t.tiers.config(pdserve_engine::kvcache::block_bytes(cfg, pdserve_engine::batch::BLOCK_SIZE, kv_dtype))?;
    let (ttft_ms, tpot_ms) = objectives_ms(a);
    let objectives = t.protect_tpot.then_some(Objectives::from_ms(ttft_ms, tpot_ms));
    let engine = EngineConfig {
        threads: t.threads(roles.len()),
        num_blocks: t.kv_cache.model_blocks(cfg, t.kv_blocks, KV_BLOCKS)?,
        kv_dtype,
        objectives,
        speculation: a.spec.config(Some(m))?,
        ..Default::default()
    };
    let mut workers = Vec::new();
    for (i, role) in roles.iter().enumerate() {
        let name = format!("{role}-{i}");
        let opts = WorkerOptions {
            name: name.clone(),
            role: *role,
            model_name: m.name.clone(),
            engine: engine.clone(),
            eog: m.tokenizer.eog_ids().to_vec(),
            key: key.clone(),
            grammars: grammars.clone(),
            tiers: tiers.clone(),
        };
        let w =
            LocalWorker::spawn(opts, m.model.clone(), rt.clone()).with_context(|| format!("starting worker {name}"))?;
        metrics.set_role(&name, *role);
        metrics.set_worker_up(&name, true);
        workers.push(w);
    }
    Ok(workers)
}

/// Binds `w`'s receiver for `via` on loopback (in-process needs none).
pub(super) async fn listen(w: &LocalWorker, via: TransportKind) -> anyhow::Result<()> {
    let at = ListenAt {
        net: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        socket: super::socket_path(&format!("kv-{}", w.name()))?,
    };
    w.listen(via, &at).await.with_context(|| format!("{via} KV receiver"))?;
    Ok(())
}
