//! `pdserve serve`: frontend, router and workers in one process.

use super::http::{self, ApiArgs, Serving};
use anyhow::Context;
use pdserve_engine::batch::{EngineConfig, Objectives};
use pdserve_engine::grammar::Grammars;
use pdserve_engine::loader::LoadedModel;
use pdserve_frontend::Metrics;
use pdserve_frontend::ModelSpec;
use pdserve_kv_transfer::{ListenAt, TransportKind};
use pdserve_planner::{model::Slo, Planner, PlannerConfig};
use pdserve_protocol::{Generate, Worker};
use pdserve_router::resident::{Load, Loading, Residency};
use pdserve_router::{Mode, PolicyKind, Router};
use pdserve_types::Role;
use pdserve_worker::{LocalWorker, WorkerOptions};

/// KV blocks per worker where `--kv-blocks` is not given.
pub const KV_BLOCKS: usize = 1024;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    /// `default`, a model `pdserve pull --list` names, `hf:ORG/REPO[:QUANT]`, or a
    /// path to a GGUF file or safetensors directory. Repeat to serve several models
    /// behind one port, each with workers of its own; requests go by their `model`
    /// (the first model where they name none) [default: default].
    #[arg(long = "model")]
    models: Vec<String>,
    /// Serve every GGUF file in this directory too (one model each; split files by
    /// their first part).
    #[arg(long)]
    models_dir: Option<std::path::PathBuf>,
    /// Keep at most this many models loaded: the first loads at start, the others
    /// when first asked for, and the one asked for least recently is unloaded
    /// (once its requests in flight finish) when another needs room. Default: all
    /// loaded at start.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    models_max: Option<u64>,
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
    a.spec.check()?;
    let specs = model_specs(&a)?;
    let resident = a.models_max.map_or(specs.len(), |n| (n as usize).min(specs.len()));
    let roles = a.topology.roles();
    let threads = a.topology.threads(roles.len() * resident);
    let metrics = Metrics::new();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let per_model = if specs.len() > 1 { " per model" } else { "" };
    let banner = format!(
        "workers: {}{per_model}, {threads} thread(s) each",
        roles.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
    );
    let starts: Vec<ModelStart> = specs
        .iter()
        .map(|spec| ModelStart { spec: spec.clone(), prefix: None, threads, metrics: metrics.clone() })
        .collect();
    let a = Arc::new(a);
    let here = rt.handle().clone();
    rt.block_on(async move {
        let (models, routers) = match resident < starts.len() {
            false => all_loaded(&a, starts, &here).await?,
            true => on_demand(&a, starts, resident, &here).await?,
        };
        let river = a.nats.config("pdserve-river", None).filter(|_| a.river);
        let observer = river.clone().map(pdserve_forest::LeafObserver::start);
        let serving = Serving {
            models,
            routers,
            mode: a.topology.mode,
            observer: observer.clone().map(|o| o as Arc<dyn pdserve_frontend::observe::Observer>),
        };
        let after_bind =
            pdserve_forest::after_bind(river, observer, a.api.api_key(), a.nats.river_reply_prefix.clone());
        http::serve(serving, metrics, &a.api, &banner, after_bind).await
    })
}

/// The models to serve: every `--model`, then the GGUF files of `--models-dir`;
/// `default` where neither names any.
fn model_specs(a: &Args) -> anyhow::Result<Vec<String>> {
    let mut specs = a.models.clone();
    if let Some(dir) = &a.models_dir {
        specs.extend(gguf_files(dir)?);
    }
    if specs.is_empty() {
        specs.push("default".into());
    }
    Ok(specs)
}

/// The GGUF models in `dir`, by name: each file, or a split model's first part.
fn gguf_files(dir: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("--models-dir {}", dir.display()))?;
    let mut files: Vec<String> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "gguf"))
        .filter(|p| !later_split_part(&p.to_string_lossy()))
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    files.sort();
    if files.is_empty() {
        anyhow::bail!("--models-dir {}: no .gguf file in it", dir.display());
    }
    Ok(files)
}

/// A split GGUF's second or later part (`name-00002-of-00003.gguf`): loaded with
/// its first.
fn later_split_part(path: &str) -> bool {
    let Some(stem) = path.strip_suffix(".gguf") else { return false };
    let mut parts = stem.rsplitn(4, '-');
    let (total, of, part) = (parts.next(), parts.next(), parts.next());
    let number = |s: Option<&str>| s.filter(|s| s.len() == 5).and_then(|s| s.parse::<u32>().ok());
    of == Some("of") && number(total).is_some() && number(part).is_some_and(|n| n > 1)
}

/// Every model loaded now, each with its workers.
async fn all_loaded(
    a: &Arc<Args>,
    starts: Vec<ModelStart>,
    rt: &tokio::runtime::Handle,
) -> anyhow::Result<(Vec<ModelSpec>, Vec<Arc<Router>>)> {
    let several = starts.len() > 1;
    let (mut models, mut routers) = (Vec::new(), Vec::new());
    for mut start in starts {
        let m = super::load_model(&start.spec)?;
        start.prefix = several.then(|| worker_prefix(&m.name));
        let grammars = super::grammars(&m.tokenizer);
        let started = start.start(a, &m, &grammars, rt).await?;
        routers.push(started.router.clone());
        models.push(ModelSpec {
            grammars,
            tokenizer: m.tokenizer.clone(),
            chat: m.chat.clone(),
            names: vec![m.name.clone()],
            context_length: m.model.cfg.context_length,
            generate: Arc::new(started),
        });
    }
    unique_names(&models)?;
    Ok((models, routers))
}

/// The first model loaded now, the others when first asked for, at most `max` at a
/// time. What validation needs of each (tokenizer, template) is read now.
async fn on_demand(
    a: &Arc<Args>,
    starts: Vec<ModelStart>,
    max: usize,
    rt: &tokio::runtime::Handle,
) -> anyhow::Result<(Vec<ModelSpec>, Vec<Arc<Router>>)> {
    let pool = Residency::new(max, a.api.deadlines().client_stall, rt.clone());
    let (mut models, mut first) = (Vec::new(), None);
    for mut start in starts {
        let meta = super::load_meta(&start.spec)?;
        start.prefix = Some(worker_prefix(&meta.name));
        let grammars = super::grammars(&meta.tokenizer);
        let load = OnDemand { a: a.clone(), start, grammars: grammars.clone(), rt: rt.clone() };
        let resident = Arc::new(pool.add(&meta.name, Arc::new(load)));
        first.get_or_insert_with(|| resident.clone());
        models.push(ModelSpec {
            grammars,
            tokenizer: meta.tokenizer,
            chat: meta.chat,
            names: vec![meta.name],
            context_length: meta.context_length,
            generate: resident,
        });
    }
    unique_names(&models)?;
    // The first model is the one a request naming none gets: loaded before serving.
    first.context("no model")?.preload().await?;
    Ok((models, Vec::new()))
}

/// Two models of one name could not be told apart by a request.
fn unique_names(models: &[ModelSpec]) -> anyhow::Result<()> {
    for (i, m) in models.iter().enumerate() {
        if models[..i].iter().any(|o| o.names == m.names) {
            anyhow::bail!("two models are named {}: serve copies under different file names", m.names.join(", "));
        }
    }
    Ok(())
}

/// The prefix of a model's worker names where a server has several: its file name
/// without `.gguf`.
fn worker_prefix(name: &str) -> String {
    name.strip_suffix(".gguf").unwrap_or(name).to_string()
}

/// What starts one model's workers.
#[derive(Clone)]
struct ModelStart {
    spec: String,
    /// Put before the workers' names (`{prefix}.{role}-{i}`) where a server has
    /// several models.
    prefix: Option<String>,
    threads: usize,
    metrics: Metrics,
}

/// A model loaded when first asked for ([`pdserve_router::resident`]).
struct OnDemand {
    a: Arc<Args>,
    start: ModelStart,
    grammars: Option<Arc<Grammars>>,
    rt: tokio::runtime::Handle,
}

impl Load for OnDemand {
    fn load(&self) -> Loading {
        let (a, start, grammars, rt) = (self.a.clone(), self.start.clone(), self.grammars.clone(), self.rt.clone());
        let spec = start.spec.clone();
        Box::pin(async move {
            let m = tokio::task::spawn_blocking(move || super::load_model(&spec))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("{e:#}"))?;
            let started = start.start(&a, &m, &grammars, &rt).await.map_err(|e| format!("{e:#}"))?;
            Ok(Arc::new(started) as Arc<dyn Generate>)
        })
    }
}

impl ModelStart {
    /// Starts the model's workers over `m`'s weights, its router and (with
    /// --planner) its planner.
    async fn start(
        &self,
        a: &Args,
        m: &LoadedModel,
        grammars: &Option<Arc<Grammars>>,
        rt: &tokio::runtime::Handle,
    ) -> anyhow::Result<Started> {
        let t = &a.topology;
        let via = t.kv_transport.unwrap_or(TransportKind::Inproc);
        let workers = self.spawn_workers(a, m, grammars, rt)?;
        let names = workers.iter().map(|w| w.name().to_string()).collect();
        // The loopback transports need a receiver on each worker that may decode
        // (under the planner, any worker may come to).
        for w in workers.iter().filter(|w| t.planner || w.info().role.decodes()) {
            listen(w, via).await?;
        }
        let router = Arc::new(
            Router::new(
                workers.into_iter().map(|w| Arc::new(w) as Arc<dyn Worker>),
                t.mode,
                a.api.deadlines(),
                rt.clone(),
            )
            .with_policy(t.policy.build())
            .with_limits(a.api.admission.limits())
            .with_transport(via)
            .with_prefix_fetch(!t.no_kv_fetch)
            .with_telemetry(Arc::new(self.metrics.clone())),
        );
        router.follow_kv_events();
        http::watch_stats(&router, &self.metrics).await;
        let planner = t.planner.then(|| {
            let (ttft_ms, tpot_ms) = objectives_ms(a);
            let cfg = PlannerConfig::new(Slo::from_ms(ttft_ms, tpot_ms));
            Planner::spawn_with(router.clone(), cfg, Arc::new(pdserve_planner::Direct))
        });
        let generate = http::migrating(&router, &a.api);
        Ok(Started { router, generate, planner, workers: names, metrics: self.metrics.clone() })
    }

    /// Starts one worker per role of the topology, all over the one copy of the
    /// model's weights, each named `{role}-{i}` (after the prefix, if any).
    fn spawn_workers(
        &self,
        a: &Args,
        m: &LoadedModel,
        grammars: &Option<Arc<Grammars>>,
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
            threads: self.threads,
            num_blocks: t.kv_cache.model_blocks(cfg, t.kv_blocks, KV_BLOCKS)?,
            kv_dtype,
            objectives,
            speculation: a.spec.config(Some(m))?,
            ..Default::default()
        };
        let mut workers = Vec::new();
        for (i, role) in roles.iter().enumerate() {
            let name = match &self.prefix {
                Some(p) => format!("{p}.{role}-{i}"),
                None => format!("{role}-{i}"),
            };
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
            let w = LocalWorker::spawn(opts, m.model.clone(), rt.clone())
                .with_context(|| format!("starting worker {name}"))?;
            self.metrics.set_role(&name, *role);
            self.metrics.set_worker_up(&name, true);
            workers.push(w);
        }
        Ok(workers)
    }
}

/// One model's workers, router and planner, running. Dropped (the model unloaded),
/// the planner stops and the router with its workers goes: each engine thread ends
/// once the last handle to its worker does.
struct Started {
    router: Arc<Router>,
    generate: Arc<dyn Generate>,
    planner: Option<tokio::task::JoinHandle<()>>,
    workers: Vec<String>,
    metrics: Metrics,
}

impl Generate for Started {
    fn generate(
        &self,
        req: pdserve_protocol::GenerateRequest,
    ) -> Result<pdserve_protocol::TokenStream, pdserve_protocol::ServeError> {
        self.generate.generate(req)
    }

    fn ready(&self) -> bool {
        self.generate.ready()
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if let Some(p) = &self.planner {
            p.abort();
        }
        self.router.drain();
        for w in &self.workers {
            self.metrics.forget_worker(w);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::later_split_part;

    #[test]
    fn a_models_directory_skips_only_later_parts_of_split_files() {
        let cases = [
            ("m.gguf", false),
            ("m-00001-of-00003.gguf", false),
            ("m-00002-of-00003.gguf", true),
            ("dir/Llama-3-70B-Q4_K_M-00003-of-00003.gguf", true),
            ("m-2-of-3.gguf", false),
            ("m-00002-0f-00003.gguf", false),
            ("m-00002-of-00003.bin", false),
        ];
        for (path, later) in cases {
            assert_eq!(later_split_part(path), later, "{path}");
        }
    }
}
