//! `pdserve frontend`: the OpenAI API and the router in front of worker processes.
//!
//! Workers come from `--workers` (a fixed list) or `--nats` (the fleet bucket), or
//! both. A listed worker is kept connected for the life of the process: one that is
//! down is waited for (and said so in the log), one that dies leaves the router's set
//! and is reconnected when it comes back. A fleet worker is followed while its record
//! is in the bucket: connected when it appears, dropped when it leaves, its reported
//! load and probed links handed to the router. While no worker can decode, requests get 503; the
//! process only exits on a signal.

use super::fleet::NatsArgs;
use super::http::{self, ApiArgs, Serving};
use pdserve_engine::loader::ModelMeta;
use pdserve_fleet::{Change, NatsConfig, NodeId, NodeRecord};
use pdserve_frontend::Metrics;
use pdserve_frontend::ModelSpec;
use pdserve_kv_transfer::{ClusterKey, TransportKind};
use pdserve_protocol::Worker;
use pdserve_remote::RemoteWorker;
use pdserve_router::cost::Link;
use pdserve_router::{Mode, PolicyKind, Router};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long start-up waits for the listed workers before serving without them.
const CONNECT_PATIENCE: Duration = Duration::from_secs(60);

#[derive(clap::Args)]
pub struct Args {
    /// Worker control addresses (`pdserve worker --listen`), comma separated.
    #[arg(long, value_delimiter = ',', required_unless_present = "nats")]
    workers: Vec<SocketAddr>,
    #[command(flatten)]
    nats: NatsArgs,
    /// Also take inference requests from a NimsForest River (JetStream stream RIVER,
    /// subjects river.infer.>) and answer them with Leaves (docs/nimsforest.md).
    #[arg(long, requires = "nats")]
    river: bool,
    /// The model the workers serve (the frontend loads only its tokenizer). Repeat
    /// for several: each model's workers are routed apart, and requests go by their
    /// `model` (the first where they name none) [default: default].
    #[arg(long = "model")]
    models: Vec<String>,
    /// aggregated | disaggregated | auto.
    #[arg(long, default_value = "auto")]
    mode: Mode,
    /// How to pick among workers of one role: kv-aware (the default: the soonest
    /// predicted first token, counting each worker's cached prefix) | least-loaded |
    /// round-robin.
    #[arg(long, default_value = "kv-aware")]
    policy: PolicyKind,
    /// How prefill workers send KV to decode workers: tcp (the default) | shm (same host).
    #[arg(long)]
    kv_transport: Option<TransportKind>,
    /// Never fetch a prefix another worker caches: recompute it (by default a worker
    /// lacking it takes the blocks from the holder where that is predicted sooner).
    #[arg(long)]
    no_kv_fetch: bool,
    #[command(flatten)]
    api: ApiArgs,
    #[command(flatten)]
    security: super::Security,
}

/// The transport a frontend's handoffs take: any that leaves the process, TCP unless
/// told.
fn transport(a: &Args) -> anyhow::Result<TransportKind> {
    Ok(match (a.mode, a.kv_transport) {
        (_, Some(TransportKind::Inproc)) => {
            anyhow::bail!("--kv-transport inproc needs workers in this process (use `pdserve serve`); pick tcp or shm")
        }
        (Mode::Aggregated, Some(_)) => anyhow::bail!("--kv-transport needs --mode disaggregated or auto"),
        (_, via) => via.unwrap_or(TransportKind::Tcp),
    })
}

/// The start-up line's list of workers. A fleet's workers join over NATS after the
/// frontend starts.
fn banner(targets: &Targets) -> String {
    let snapshot = |t: &Target| t.router.workers().snapshot();
    let workers: Vec<String> =
        targets.iter().flat_map(snapshot).map(|e| format!("{} ({})", e.name(), e.role())).collect();
    match workers.is_empty() {
        true => "no workers yet".to_string(),
        false => format!("workers: {}", workers.join(", ")),
    }
}

pub fn run(a: Args) -> anyhow::Result<super::Stopped> {
    let via = transport(&a)?;
    let key = a.security.key()?;
    let metas = model_specs(&a.models).iter().map(|m| super::load_meta(m)).collect::<anyhow::Result<Vec<_>>>()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let metrics = Metrics::new();
        let router = || {
            let r = Router::new([], a.mode, a.api.deadlines(), tokio::runtime::Handle::current())
                .with_policy(a.policy.build())
                .with_limits(a.api.admission.limits())
                .with_transport(via)
                .with_prefix_fetch(!a.no_kv_fetch)
                .with_telemetry(Arc::new(metrics.clone()));
            Arc::new(r)
        };
        let targets: Targets = metas
            .iter()
            .map(|m| Target { key: key.clone(), router: router(), metrics: metrics.clone(), model: m.name.clone() })
            .collect::<Vec<_>>()
            .into();
        for t in targets.iter() {
            t.router.follow_kv_events();
        }
        let mut first = Vec::new();
        for &addr in &a.workers {
            let (tx, rx) = tokio::sync::oneshot::channel();
            first.push(rx);
            tokio::spawn(supervise(addr, targets.clone(), Some(tx), None));
        }
        if let Some(cfg) = a.nats.config("pdserve-frontend", Some(&key)) {
            tokio::spawn(follow_fleet(cfg.clone(), targets.clone(), Arc::default()));
            tokio::spawn(take_pushed_kv_events(cfg.clone(), targets.clone()));
            for t in targets.iter() {
                publish_traffic(cfg.clone(), &t.router, &t.model);
            }
        }
        // Serve as soon as every listed worker answered once, or after the patience.
        let _ = tokio::time::timeout(CONNECT_PATIENCE, futures_join(first)).await;
        let banner = banner(&targets);
        let river = a.nats.config("pdserve-river", Some(&key)).filter(|_| a.river);
        let observer = river.clone().map(pdserve_forest::LeafObserver::start);
        let models = served(metas, &targets, &a.api, &metrics).await;
        let serving = Serving {
            models,
            routers: targets.iter().map(|t| t.router.clone()).collect(),
            mode: a.mode,
            observer: observer.clone().map(|o| o as Arc<dyn pdserve_frontend::observe::Observer>),
        };
        let after_bind =
            pdserve_forest::after_bind(river, observer, a.api.api_key(), a.nats.river_reply_prefix.clone());
        http::serve(serving, metrics, &a.api, &banner, after_bind).await
    })
}

/// Each model as the API serves it: through its router, its workers' stats watched.
async fn served(metas: Vec<ModelMeta>, targets: &Targets, api: &ApiArgs, metrics: &Metrics) -> Vec<ModelSpec> {
    let mut models = Vec::new();
    for (meta, t) in metas.into_iter().zip(targets.iter()) {
        http::watch_stats(&t.router, metrics).await;
        models.push(ModelSpec {
            grammars: super::grammars(&meta.tokenizer),
            tokenizer: meta.tokenizer,
            chat: meta.chat,
            names: vec![meta.name],
            context_length: meta.context_length,
            generate: http::migrating(&t.router, api),
        });
    }
    models
}

/// The `--model`s given, `default` where none is.
pub(super) fn model_specs(models: &[String]) -> Vec<String> {
    match models.is_empty() {
        true => vec!["default".to_string()],
        false => models.to_vec(),
    }
}

async fn futures_join(rxs: Vec<tokio::sync::oneshot::Receiver<()>>) {
    for rx in rxs {
        let _ = rx.await;
    }
}

/// Where workers that join go, and what they must serve.
#[derive(Clone)]
pub(super) struct Target {
    pub key: ClusterKey,
    pub router: Arc<Router>,
    pub metrics: Metrics,
    pub model: String,
}

/// A router per model served: a worker joins the one of its model.
#[derive(Clone)]
pub(super) struct Targets(Arc<[Target]>);

impl From<Vec<Target>> for Targets {
    fn from(t: Vec<Target>) -> Targets {
        Targets(t.into())
    }
}

impl Targets {
    pub(super) fn iter(&self) -> std::slice::Iter<'_, Target> {
        self.0.iter()
    }

    /// The target of workers serving `model`.
    pub(super) fn of(&self, model: &str) -> Option<&Target> {
        self.0.iter().find(|t| t.model == model)
    }

    /// The models served, for messages.
    fn models(&self) -> String {
        self.0.iter().map(|t| t.model.as_str()).collect::<Vec<_>>().join(", ")
    }
}

/// What a fleet node reports about itself that the router uses: its load, and its
/// probed links by receiving worker's name.
#[derive(Clone, Default)]
struct Reported {
    load: usize,
    links: HashMap<String, Link>,
}

/// Keeps the worker at `addr` in the router's set while it is connected; `load`
/// carries what it reports through the fleet, if it is in one.
async fn supervise(
    addr: SocketAddr,
    to: Targets,
    mut first: Option<tokio::sync::oneshot::Sender<()>>,
    load: Option<watch::Receiver<Reported>>,
) {
    let key = to.0[0].key.clone();
    pdserve_remote::keep_connected(addr, key, |w: RemoteWorker| {
        let (to, announce, load) = (to.clone(), first.take(), load.clone());
        async move {
            // Announced once it is in the set (or refused), so the server that waits
            // for it never serves a first request without it.
            let announce = move || {
                if let Some(tx) = announce {
                    let _ = tx.send(());
                }
            };
            let info = w.info().clone();
            let added = match to.of(&info.model) {
                Some(to) => InSet::add(to, &w),
                None => Err(format!("it serves {}, this frontend {}", info.model, to.models())),
            };
            let in_set = match added {
                Ok(in_set) => in_set,
                Err(why) => {
                    tracing::error!(%addr, "worker not used: {why}");
                    announce();
                    drop(w);
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    return;
                }
            };
            announce();
            match load {
                Some(load) => report(&w, &in_set, load).await,
                None => w.lost().await,
            }
        }
    })
    .await
}

/// Hands what the worker reports to its handle and entry until the worker is lost.
async fn report(w: &RemoteWorker, at: &InSet, mut load: watch::Receiver<Reported>) {
    loop {
        let now = load.borrow_and_update().clone();
        w.report_load(now.load);
        if let Some(e) = at.to.router.workers().get(at.id) {
            for (to, link) in &now.links {
                at.to.metrics.set_link(e.name(), to, link.bytes_per_s, link.round_trip_s);
            }
            e.set_links(now.links);
        }
        tokio::select! {
            _ = w.lost() => return,
            changed = load.changed() => if changed.is_err() { return w.lost().await },
        }
    }
}

/// A worker's place in the router's set, given up when dropped (the worker was
/// lost, or its supervisor was stopped because it left the fleet).
struct InSet {
    to: Target,
    id: pdserve_router::WorkerId,
    name: String,
}

impl InSet {
    /// Refused where the worker cannot hand requests to and from those in the set.
    fn add(to: &Target, w: &RemoteWorker) -> Result<InSet, String> {
        let info = w.info();
        let id = to.router.workers().try_add(Arc::new(w.clone()) as Arc<dyn Worker>)?;
        to.metrics.set_role(&info.name, info.role);
        to.metrics.set_worker_up(&info.name, true);
        Ok(InSet { to: to.clone(), id, name: info.name.clone() })
    }
}

impl Drop for InSet {
    fn drop(&mut self) {
        self.to.router.workers().remove(self.id);
        self.to.metrics.forget_worker(&self.name);
    }
}

/// A fleet node this frontend follows.
struct Follower {
    control: SocketAddr,
    load: watch::Sender<Reported>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Keeps each model's router's set equal to the fleet's nodes serving that model: a
/// node that registers is connected, one that leaves is dropped (its requests in
/// flight finish or fail over), one whose control address changed is connected anew.
pub(super) async fn follow_fleet(cfg: NatsConfig, to: Targets, names: Arc<FleetNames>) {
    let mut changes = pdserve_fleet::follow(cfg);
    let mut nodes: HashMap<NodeId, Follower> = HashMap::new();
    let mut other_model: HashSet<NodeId> = HashSet::new();
    while let Some(change) = changes.recv().await {
        match change {
            Change::Up(rec) if to.of(&rec.model).is_none() => {
                if other_model.insert(rec.node_id.clone()) {
                    tracing::warn!(node = %rec.node_id, theirs = %rec.model, ours = %to.models(), "fleet node serves another model; not used");
                }
            }
            Change::Up(rec) => {
                names.insert(&rec.node_id, &rec.name);
                let load = reported(&rec, &names);
                match nodes.get(&rec.node_id) {
                    Some(f) if f.control == rec.endpoints.control => {
                        let _ = f.load.send(load);
                    }
                    _ => {
                        tracing::info!(node = %rec.node_id, control = %rec.endpoints.control, role = %rec.role, "fleet node joined");
                        let (tx, rx) = watch::channel(load);
                        let task = tokio::spawn(supervise(rec.endpoints.control, to.clone(), None, Some(rx)));
                        nodes.insert(rec.node_id, Follower { control: rec.endpoints.control, load: tx, task });
                    }
                }
            }
            Change::Down(id) => {
                other_model.remove(&id);
                names.remove(&id);
                if nodes.remove(&id).is_some() {
                    tracing::info!(node = %id, "fleet node left");
                }
            }
        }
    }
}

/// Feeds the KV events fleet workers push into the index of the router whose set
/// holds the worker.
async fn take_pushed_kv_events(cfg: NatsConfig, to: Targets) {
    let mut batches = pdserve_fleet::follow_kv_events(cfg);
    while let Some(b) = batches.recv().await {
        let holds = |t: &&Target| t.router.workers().snapshot().iter().any(|e| e.name() == b.worker);
        let Some(t) = to.iter().find(holds).or_else(|| to.iter().next()) else { continue };
        t.router.take_pushed_kv_events(&b.worker, b.from, b.events);
    }
}

/// Publishes this frontend's traffic of `model` and its workers' measured prefill
/// paces for a fleet planner (`pdserve planner`), if one listens.
fn publish_traffic(cfg: NatsConfig, router: &Arc<Router>, model: &str) {
    let frontend = format!("{}-{}", cfg.client_name, std::process::id());
    let samples = router.signals.tap(TRAFFIC_TAP);
    let r = router.clone();
    let paces =
        move || r.workers().snapshot().iter().filter_map(|e| Some((e.name().to_string(), e.prefill_pace()?))).collect();
    pdserve_fleet::publish_traffic(cfg, frontend, model.to_string(), samples, paces);
}

/// Request records a frontend holds for its next traffic batch at most.
const TRAFFIC_TAP: usize = 8192;

/// Worker names by node id, for the fleet nodes a follower serves: a record's links
/// name peers by node id, the router by worker name (and a fleet planner writes
/// roles by node id).
#[derive(Default)]
pub(super) struct FleetNames(std::sync::Mutex<HashMap<NodeId, String>>);

impl FleetNames {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, String>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn insert(&self, id: &NodeId, name: &str) {
        self.lock().insert(id.clone(), name.to_string());
    }

    fn remove(&self, id: &NodeId) {
        self.lock().remove(id);
    }

    fn name_of(&self, id: &NodeId) -> Option<String> {
        self.lock().get(id).cloned()
    }

    /// The node id of the worker named `name`.
    pub(super) fn id_of(&self, name: &str) -> Option<NodeId> {
        self.lock().iter().find(|(_, n)| n.as_str() == name).map(|(id, _)| id.clone())
    }

    pub(super) fn holds(&self, id: &NodeId) -> bool {
        self.lock().contains_key(id)
    }
}

/// The load and links of `rec`, its links' peers named as the router names them.
fn reported(rec: &NodeRecord, names: &FleetNames) -> Reported {
    let links = rec
        .links
        .iter()
        .filter_map(|l| {
            let link = Link { bytes_per_s: l.gb_per_s * 1e9, round_trip_s: l.latency_ms / 1e3 };
            Some((names.name_of(&l.to)?, link))
        })
        .collect();
    Reported { load: rec.load.requests(), links }
}
