//! A worker in this process: one engine on its own OS thread, owned by a loop that
//! takes bounded commands, steps the engine and routes each token to its request's
//! stream; plus the worker's two KV ends — its receivers (inboxes, and TCP or
//! shared-memory listeners when asked) and its links to other workers' receivers.
//!
//! [`LocalWorker`] implements the router's [`Worker`] surface; a worker process
//! serves the same surface to remote routers (`pdserve-remote`). The loop checks every
//! request's stream between steps and cancels those whose client is gone, so
//! cancellation reaches the engine within one step.

mod events;
mod kv;
mod machine;
pub mod sim;
pub mod stages;
mod worker_loop;

pub use machine::{CoRun, LinkModel, Machine};
pub use sim::{SimOptions, SimWorker};

use kv::{forward, Import, SharedSink};
use pdserve_engine::batch::BLOCK_SIZE;
use pdserve_engine::batch::{Engine, EngineConfig, KvParts};
use pdserve_engine::grammar::Grammars;
use pdserve_engine::model::Model;
use pdserve_engine::tiers::TierConfig;
use pdserve_engine::timed::TimedModel;
use pdserve_kv::BlockPool;
use pdserve_kv_transfer::{
    frame, ByLayer, ClusterKey, HandoffId, HandoffToken, Inboxes, KvAddr, KvReceiver, KvSink, KvTarget, Links,
    ListenAt, Throughput, TransferError, TransportKind,
};
use pdserve_protocol::{
    DecodeHandoff, EventSender, GenerateRequest, KvCursor, KvDestination, KvEventLog, KvEvents, LinkProbe, Prefilled,
    PrefixPeer, Reply, Reserved, RoleState, RoleSwitch, ServeError, Worker, WorkerInfo, WorkerStats,
};
use pdserve_types::{lock, Assignment, Epoch, Grammar, KvFrame, RequestId, Role, StageReceiver};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use worker_loop::{Export, Exports};

/// A reservation granted: what the draft model's K/V of the prompt is worth here,
/// and the later stages that take their own layers themselves.
pub(crate) type Granted = (Option<f64>, Vec<StageReceiver>);

/// Commands queued for the loop; bounded, so a flooded worker says "overloaded".
pub(crate) enum Command {
    Generate(GenerateRequest, EventSender),
    Prefill {
        req: GenerateRequest,
        /// Leading prompt tokens whose K/V came into reservation `req.id` from a
        /// peer (0: none, the whole prompt is computed).
        imported: usize,
        /// What the draft model's K/V of the prompt is worth to the receiver
        /// ([`pdserve_protocol::Reserved::draft_worth`]).
        draft_worth: Option<f64>,
        sink: FrameSink,
        /// Where a group's later stages send their layers themselves.
        parts: Option<KvParts>,
        reply: oneshot::Sender<Result<Prefilled, ServeError>>,
        sent: tokio::time::Instant,
    },
    Reserve {
        id: RequestId,
        prompt_len: usize,
        /// Leading tokens whose blocks come from the engine's own cache.
        keep: Vec<u32>,
        /// A group's later stages may take their own layers straight from the sender
        /// (a prefill's handoff, whose sender is told of them; not a fetch).
        direct: bool,
        reply: oneshot::Sender<Result<Granted, ServeError>>,
    },
    Frame {
        id: RequestId,
        frame: KvFrame,
        recycle: Inboxes,
    },
    Decode(DecodeHandoff, EventSender),
    /// Serve the fetches of cached prefixes waiting in the loop's [`Exports`] (the
    /// loop serves them mid-step too; this wakes an idle one).
    ServeExports,
    /// Queue a request whose first `imported` prompt tokens' K/V arrived in its
    /// reservation.
    GenerateImported(GenerateRequest, usize, EventSender),
    AbortImport(RequestId),
    Stats(oneshot::Sender<WorkerStats>),
    /// End every stream here with [`ServeError::Moved`] naming `worker`; answered
    /// with how many.
    MoveOut {
        worker: String,
        reply: oneshot::Sender<usize>,
    },
}

impl Command {
    /// The grammar of a command that starts a constrained sequence.
    fn grammar(&self) -> Option<&Grammar> {
        let params = match self {
            Command::Generate(req, _) | Command::GenerateImported(req, ..) | Command::Prefill { req, .. } => {
                &req.params
            }
            Command::Decode(h, _) => &h.params,
            _ => return None,
        };
        params.grammar.as_ref()
    }
}

/// Receives a prefill's frames, layer by layer, on the engine's thread. Returning
/// `false` aborts the prefill at the next layer boundary (the receiver is gone).
pub(crate) type FrameSink = Box<dyn FnMut(KvFrame) -> bool + Send>;

/// Commands a worker queues before refusing more.
const QUEUE: usize = 4096;
/// Frames a handoff's inbox buffers before its sender waits.
const INBOX_FRAMES: usize = 256;
/// How long a decode waits for a transfer's last frames after the prefill side said
/// it sent them all (they are normally already here).
const FRAMES_GRACE: Duration = Duration::from_secs(10);
/// How long a stats call waits for the engine thread before answering with its last
/// figures: a long prefill holds the thread for seconds, and the fleet heartbeat must
/// not wait that long.
const STATS_PATIENCE: Duration = Duration::from_millis(100);
/// A link probe's inbox closes after this long, whether or not its frames came.
const PROBE_TTL: Duration = Duration::from_secs(30);

/// What a worker is, before it starts.
pub struct WorkerOptions {
    pub name: String,
    pub role: Role,
    pub model_name: String,
    pub engine: EngineConfig,
    /// End-of-generation token ids (from the tokenizer).
    pub eog: Vec<u32>,
    /// The cluster's secret: what this worker's KV receivers ask of senders, and what
    /// its links prove to other workers' receivers.
    pub key: ClusterKey,
    /// Compiles constrained requests' grammars; without it they are refused.
    pub grammars: Option<Arc<Grammars>>,
    /// Host-RAM and disk tiers below the engine's KV pool (none by default).
    pub tiers: TierConfig,
}

/// A cheap handle to a worker in this process.
#[derive(Clone)]
pub struct LocalWorker {
    inner: Arc<Inner>,
}

struct Inner {
    info: WorkerInfo,
    /// The role it serves in now, and since which epoch (see [`RoleSwitch::set_role`]).
    role: RoleState,
    tx: SyncSender<Command>,
    /// Requests queued or admitted and not finished: the router's load signal.
    active: Arc<AtomicUsize>,
    /// Prompt tokens of prefills sent here (for a KV handoff) and not answered yet:
    /// they wait in the command queue or run, outside the engine's own queue.
    prefill_tokens: Arc<AtomicUsize>,
    /// The engine's last answer to a stats call.
    last_stats: Mutex<WorkerStats>,
    /// Where transfers into this worker land, from any transport.
    inboxes: Inboxes,
    receivers: Mutex<Receivers>,
    /// Connections to other workers' receivers, for prefills sent there.
    links: Links,
    /// Values per K (and per V) in one frame: a block of one layer.
    frame_elems: usize,
    /// Transfers into this worker, by request.
    imports: Mutex<HashMap<RequestId, Import>>,
    /// Releases still waiting for room in the command queue: a new reservation of
    /// the same request waits for its release to be queued first.
    aborting: Mutex<HashSet<RequestId>>,
    /// Runs the tasks that feed transferred frames into the engine.
    rt: tokio::runtime::Handle,
    /// The engine's block pool: its event log is read here, off the engine thread.
    pool: BlockPool,
    /// A simulated worker's accounting of its transfers (see [`SimKv`]).
    sim_kv: Option<SimKv>,
    /// Compiles constrained requests' grammars before the engine thread sees them.
    grammars: Option<Arc<Grammars>>,
    /// Peers' fetches waiting for the engine.
    exports: Exports,
}

/// What a simulated worker (a timed engine) accounts for a KV transfer. Its frames
/// carry scaled-down values, so the bytes it moves and the time they take are not the
/// model's: it reports the model's bytes, and answers once the profile's link would
/// have delivered them.
#[derive(Debug, Clone)]
pub struct SimKv {
    /// The model's KV bytes per token, all layers.
    pub bytes_per_token: f64,
    pub layers: usize,
    /// The profile's links; a transport it lacks is accounted as moved.
    pub links: Vec<(TransportKind, LinkModel)>,
}

impl SimKv {
    /// Seconds the profile's link over `via` takes to deliver `tokens`' KV after
    /// `prefill_s` of compute it streams under; none for a transport it lacks.
    fn tail(&self, tokens: usize, via: TransportKind, prefill_s: f64) -> Option<f64> {
        let (_, link) = self.links.iter().find(|(k, _)| *k == via)?;
        Some(link.tail(tokens as f64 * self.bytes_per_token, self.layers, prefill_s))
    }

    /// Waits out what the profile's link takes to deliver `tokens`' KV over `via`
    /// beyond the `took` seconds the scaled-down frames took (an export computes
    /// nothing, so no layer's share is hidden).
    async fn account_export(&self, tokens: usize, via: TransportKind, took: f64) {
        if let Some(tail) = self.tail(tokens, via, 0.0).filter(|&t| t > took) {
            tokio::time::sleep(Duration::from_secs_f64(tail - took)).await;
        }
    }

    /// Reports `tokens`' KV as the model's bytes over `via`, waiting out what the
    /// profile's link takes beyond the transfer's own time.
    async fn account(&self, first: &mut Prefilled, tokens: usize, via: TransportKind) {
        first.kv_bytes = (tokens as f64 * self.bytes_per_token) as u64;
        if let Some(tail) = self.tail(tokens, via, first.prefill_seconds).filter(|&t| t > first.transfer_seconds) {
            tokio::time::sleep(Duration::from_secs_f64(tail - first.transfer_seconds)).await;
            first.transfer_seconds = tail;
        }
    }
}

/// The receivers it listens on, at most one per transport kind.
#[derive(Default)]
struct Receivers(Vec<Box<dyn KvReceiver>>);

impl Receivers {
    /// Listens with `rx` too, instead of any receiver of its kind before.
    fn add(&mut self, rx: Box<dyn KvReceiver>) {
        let kind = rx.addr().kind();
        self.0.retain(|r| r.addr().kind() != kind);
        self.0.push(rx);
    }

    fn addr(&self, via: TransportKind) -> Option<KvAddr> {
        self.0.iter().map(|r| r.addr()).find(|a| a.kind() == via)
    }
}

/// The values of one K/V frame of `c`: one block of one layer, K and V of every KV
/// head, at most f16's words whatever the sender's dtype.
pub fn frame_values(c: &pdserve_engine::config::ModelConfig) -> usize {
    c.n_kv_heads * BLOCK_SIZE * c.head_dim
}

impl LocalWorker {
    /// Starts the engine thread; `rt` runs the worker's KV tasks.
    pub fn spawn(opts: WorkerOptions, model: Arc<Model>, rt: tokio::runtime::Handle) -> std::io::Result<LocalWorker> {
        let c = &model.cfg;
        let frame_elems = frame_values(c);
        let per_token = pdserve_engine::kvcache::bytes_per_token(c, opts.engine.kv_dtype) as u64;
        LocalWorker::start(opts, frame_elems, per_token, None, rt, move |cfg, eog| Engine::new(model, cfg, eog))
    }

    /// The head of a stage group: `model` is the first stage, `stages` the later
    /// ones; its requests end (for the router to move) when a stage is lost, and it
    /// takes none while the group is not whole.
    pub fn spawn_head(
        opts: WorkerOptions,
        model: Arc<Model>,
        stages: Box<dyn pdserve_engine::batch::NextStages>,
        rt: tokio::runtime::Handle,
    ) -> std::io::Result<LocalWorker> {
        let c = &model.cfg;
        let frame_elems = frame_values(c);
        let per_token = pdserve_engine::kvcache::bytes_per_token(c, opts.engine.kv_dtype) as u64;
        LocalWorker::start(opts, frame_elems, per_token, None, rt, move |cfg, eog| {
            Engine::new(model, cfg, eog).with_next_stages(stages)
        })
    }

    /// A simulated worker process's worker: a timed engine (on the wall clock) whose
    /// steps take a profile's time; its K/V frames carry `timed.kv_values` values per
    /// token, the real model's divided by the factor its caller states.
    pub fn spawn_timed(
        opts: WorkerOptions,
        timed: TimedModel,
        kv: SimKv,
        rt: tokio::runtime::Handle,
    ) -> std::io::Result<LocalWorker> {
        let frame_elems = BLOCK_SIZE * timed.kv_values.max(1);
        let per_token = kv.bytes_per_token as u64;
        let build = move |cfg, eog| Engine::timed(timed, cfg, eog);
        LocalWorker::start(opts, frame_elems, per_token, Some(kv), rt, build)
    }

    fn start(
        opts: WorkerOptions,
        frame_elems: usize,
        kv_bytes_per_token: u64,
        sim_kv: Option<SimKv>,
        rt: tokio::runtime::Handle,
        build: impl FnOnce(EngineConfig, Vec<u32>) -> Engine + Send + 'static,
    ) -> std::io::Result<LocalWorker> {
        let (tx, rx) = sync_channel(QUEUE);
        let active = Arc::new(AtomicUsize::new(0));
        let counter = active.clone();
        let draft = opts.engine.speculation.as_ref().and_then(|s| s.draft.as_ref());
        // A prefill worker's draft K/V frames come too.
        let largest = frame_elems.max(draft.map_or(0, |d| d.block_values(BLOCK_SIZE)));
        let frame_bytes = frame::encoded_len_for(largest);
        let info = WorkerInfo::new(&opts.name, &opts.model_name, opts.role)
            .with_kv(opts.engine.kv_dtype, kv_bytes_per_token)
            .with_draft(draft.map(|d| d.signature()));
        let inboxes = Inboxes::guarded(INBOX_FRAMES, opts.key.clone(), frame_bytes);
        let links = Links::new(opts.key);
        let (cfg, eog, grammars, tiers) = (opts.engine, opts.eog, opts.grammars.clone(), opts.tiers);
        let (pool_tx, pool_rx) = sync_channel(1);
        let exports = Exports::default();
        let served = exports.clone();
        std::thread::Builder::new().name(format!("pdserve-{}", opts.name)).spawn(move || {
            // Built on its own thread: the engine's pool belongs to it.
            let engine = build(cfg, eog);
            let engine = match grammars {
                Some(g) => engine.with_grammars(g),
                None => engine,
            };
            let engine = match engine.with_tiers(&tiers) {
                Ok(e) => e,
                Err(e) => return drop(pool_tx.send(Err(e.to_string()))),
            };
            let _ = pool_tx.send(Ok(engine.block_pool().clone()));
            worker_loop::run(engine, rx, counter, served)
        })?;
        let pool = pool_rx
            .recv()
            .map_err(|_| std::io::Error::other("the engine thread died while starting"))?
            .map_err(std::io::Error::other)?;
        let inner = Inner {
            role: RoleState::new(info.role),
            info,
            tx,
            active,
            prefill_tokens: Arc::default(),
            last_stats: Mutex::default(),
            inboxes,
            receivers: Mutex::default(),
            links,
            frame_elems,
            imports: Mutex::default(),
            aborting: Mutex::default(),
            rt,
            pool,
            sim_kv,
            grammars: opts.grammars,
            exports,
        };
        Ok(LocalWorker { inner: Arc::new(inner) })
    }

    /// Times one handoff of `bytes` to the probe inbox `id` a peer opened at `to`
    /// (under `token`), over the link a prefill sent there would use.
    pub async fn probe(
        &self,
        to: KvAddr,
        id: RequestId,
        token: HandoffToken,
        bytes: usize,
    ) -> Result<Throughput, ServeError> {
        let inner = self.inner.clone();
        let target = KvTarget::Remote(to);
        tokio::task::spawn_blocking(move || {
            let hid = HandoffId::from(id);
            pdserve_kv_transfer::probe(&inner.links, &target, hid, token, bytes, inner.frame_elems)
                .map_err(|e| kv_error(&target, &e))
        })
        .await
        .map_err(|e| ServeError::Internal(format!("link probe: {e}")))?
    }

    pub fn name(&self) -> &str {
        &self.inner.info.name
    }

    /// Also receives KV over transport `kind` where `at` says; answers where senders
    /// reach it (in-process needs no receiver: `None`).
    pub async fn listen(&self, kind: TransportKind, at: &ListenAt) -> std::io::Result<Option<KvAddr>> {
        let Some(rx) = pdserve_kv_transfer::bind(kind, at, self.inner.inboxes.clone()).await? else {
            return Ok(None);
        };
        let addr = rx.addr();
        lock(&self.inner.receivers).add(rx);
        Ok(Some(addr))
    }
}

impl Worker for LocalWorker {
    fn info(&self) -> &WorkerInfo {
        &self.inner.info
    }

    fn load(&self) -> usize {
        self.inner.active.load(Ordering::Relaxed)
    }

    fn is_alive(&self) -> bool {
        true
    }

    fn generate(&self, req: GenerateRequest, events: EventSender) -> Result<(), ServeError> {
        self.inner.fence(req.fence, Role::decodes)?;
        if self.inner.is_compiled(req.params.grammar.as_ref()) {
            return self.inner.send_counted(Command::Generate(req, events));
        }
        let inner = self.inner.clone();
        self.inner.rt.spawn(async move {
            let queued = inner.compiled(req.params.grammar.as_ref()).await;
            if let Err(e) = queued.and_then(|()| inner.send_counted(Command::Generate(req, events.clone()))) {
                let _ = events.send(pdserve_protocol::Event::Failed(e));
            }
        });
        Ok(())
    }

    fn kv_target(&self, via: TransportKind) -> Option<KvTarget> {
        match via {
            TransportKind::Inproc => Some(pdserve_kv_transfer::in_proc(self.inner.inboxes.clone())),
            via => lock(&self.inner.receivers).addr(via).map(KvTarget::Remote),
        }
    }

    fn reserve(&self, id: RequestId, prompt_len: usize, fence: Option<Epoch>) -> Reply<'_, Reserved> {
        let inner = self.inner.clone();
        Box::pin(async move {
            inner.fence(fence, Role::decodes)?;
            inner.reserve(id, prompt_len, Vec::new(), true).await
        })
    }

    fn prefill(&self, req: GenerateRequest, to: KvDestination) -> Reply<'static, Prefilled> {
        let inner = self.inner.clone();
        Box::pin(async move {
            inner.fence(req.fence, Role::prefills)?;
            inner.compiled(req.params.grammar.as_ref()).await?;
            inner.prefill(req, 0, to).await
        })
    }

    fn decode(&self, handoff: DecodeHandoff, events: EventSender) -> Result<(), ServeError> {
        let id = handoff.id;
        self.inner.when_imported(id, events.clone(), Command::Decode(handoff, events))
    }

    fn release(&self, id: RequestId) {
        self.inner.release(id);
    }

    fn stats(&self) -> Reply<'_, WorkerStats> {
        Box::pin(async move {
            let (reply, rx) = oneshot::channel();
            self.inner.send(Command::Stats(reply))?;
            let mut s = match tokio::time::timeout(STATS_PATIENCE, rx).await {
                Ok(answer) => {
                    let s = answer.map_err(|_| self.inner.stopped())?;
                    *lock(&self.inner.last_stats) = s.clone();
                    s
                }
                // Mid-step (a long prefill): what the engine said last.
                Err(_) => lock(&self.inner.last_stats).clone(),
            };
            s.queued_prompt_tokens += self.inner.prefill_tokens.load(Ordering::Relaxed);
            s.assignment = Some(self.inner.role.get());
            Ok(s)
        })
    }

    fn prefix_peer(&self) -> Option<&dyn PrefixPeer> {
        Some(self)
    }

    fn kv_event_log(&self) -> Option<&dyn KvEventLog> {
        Some(self)
    }

    fn role_switch(&self) -> Option<&dyn RoleSwitch> {
        Some(self as &dyn RoleSwitch)
    }

    fn link_probe(&self) -> Option<&dyn LinkProbe> {
        Some(self)
    }
}

impl PrefixPeer for LocalWorker {
    fn reserve_after(
        &self,
        id: RequestId,
        prompt_len: usize,
        keep: Vec<u32>,
        fence: Option<Epoch>,
    ) -> Reply<'_, pdserve_kv_transfer::HandoffToken> {
        let inner = self.inner.clone();
        Box::pin(async move {
            inner.fence(fence, Role::decodes)?;
            Ok(inner.reserve(id, prompt_len, keep, false).await?.token)
        })
    }

    fn prefill_imported(&self, req: GenerateRequest, imported: usize, to: KvDestination) -> Reply<'static, Prefilled> {
        let (inner, id) = (self.inner.clone(), req.id);
        // Once the prefill runs the engine owns the reservation's blocks: a release
        // after that finds nothing.
        let release = {
            let inner = inner.clone();
            move || inner.release(id)
        };
        Box::pin(or_release(release, async move {
            inner.fence(req.fence, Role::prefills)?;
            inner.imported(id).await?;
            inner.compiled(req.params.grammar.as_ref()).await?;
            inner.prefill(req, imported, to).await
        }))
    }

    fn export_prefix(&self, id: RequestId, tokens: Vec<u32>, skip: usize, to: KvDestination) -> Reply<'static, usize> {
        Box::pin(self.inner.clone().export(id, tokens, skip, to))
    }

    fn generate_imported(&self, req: GenerateRequest, imported: usize, events: EventSender) -> Result<(), ServeError> {
        let id = req.id;
        // Refused (a role switch overtook the fetch): the reservation goes too.
        self.inner.fence(req.fence, Role::decodes).inspect_err(|_| self.inner.release(id))?;
        self.inner.when_imported(id, events.clone(), Command::GenerateImported(req, imported, events))
    }
}

impl KvEventLog for LocalWorker {
    fn kv_events(&self, after: KvCursor) -> Reply<'_, KvEvents> {
        let events = events::since(&self.inner.pool, after);
        Box::pin(async move { Ok(events) })
    }
}

impl RoleSwitch for LocalWorker {
    fn set_role(&self, to: Assignment) -> Reply<'_, Assignment> {
        let (before, now) = self.inner.role.switch(to);
        if before != now {
            tracing::info!(worker = %self.inner.info.name, from = %before, to = %now, "role switched");
        }
        Box::pin(async move { Ok(now) })
    }

    fn move_decodes(&self) -> Reply<'_, usize> {
        let (command, rx) = move_out(&self.inner.role, &self.inner.info.name);
        let asked = command.map_or(Ok(()), |c| self.inner.send(c));
        Box::pin(async move {
            asked?;
            let n = rx.await.map_err(|_| self.inner.stopped())?;
            if n > 0 {
                tracing::info!(worker = %self.inner.info.name, sequences = n, "handed back decodes after a role switch");
            }
            Ok(n)
        })
    }
}

impl LinkProbe for LocalWorker {
    fn probe_inbox(&self, id: RequestId) -> Reply<'_, HandoffToken> {
        let hid = HandoffId::from(id);
        let opened = self.inner.inboxes.expect(hid).map_err(|e| ServeError::Invalid(format!("link probe: {e}")));
        Box::pin(async move {
            let mut inbox = opened?;
            let token = inbox.token();
            let inboxes = self.inner.inboxes.clone();
            self.inner.rt.spawn(async move {
                let drain = async {
                    while let Ok(Some(f)) = inbox.recv().await {
                        inboxes.recycle(f.k, f.v);
                    }
                };
                if tokio::time::timeout(PROBE_TTL, drain).await.is_err() {
                    inboxes.forget(hid);
                }
            });
            Ok(token)
        })
    }
}

/// The command that ends worker `name`'s streams, unless its role still decodes (a
/// switch back overtook the call): then nothing moves, and the answer is 0 already.
pub(crate) fn move_out(role: &RoleState, name: &str) -> (Option<Command>, oneshot::Receiver<usize>) {
    let (reply, rx) = oneshot::channel();
    if role.get().role.decodes() {
        let _ = reply.send(0);
        return (None, rx);
    }
    (Some(Command::MoveOut { worker: name.to_string(), reply }), rx)
}

impl Inner {
    fn is_compiled(&self, grammar: Option<&Grammar>) -> bool {
        match (&self.grammars, grammar) {
            (Some(gs), Some(g)) => gs.is_compiled(&g.spec),
            _ => true,
        }
    }

    /// Waits until the request's grammar is compiled, on the grammar thread: the
    /// engine thread then only copies its start state, and stalls no one.
    async fn compiled(&self, grammar: Option<&Grammar>) -> Result<(), ServeError> {
        if self.is_compiled(grammar) {
            return Ok(());
        }
        let (Some(gs), Some(g)) = (&self.grammars, grammar) else { return Ok(()) };
        let (done, wait) = oneshot::channel();
        gs.compile_then(
            &g.spec,
            Box::new(move || {
                let _ = done.send(());
            }),
        )
        .map_err(|e| ServeError::Overloaded(e.to_string()))?;
        wait.await.map_err(|_| self.stopped())
    }

    /// Queues a command, waiting while the queue is full (frames of a transfer: the
    /// wait backs up into the link, which slows the sender down).
    async fn send_waiting(&self, mut c: Command) -> Result<(), ServeError> {
        loop {
            match self.tx.try_send(c) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Full(back)) => {
                    c = back;
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
                Err(TrySendError::Disconnected(_)) => return Err(self.stopped()),
            }
        }
    }

    fn send(&self, c: Command) -> Result<(), ServeError> {
        self.tx.try_send(c).map_err(|e| match e {
            TrySendError::Full(_) => ServeError::Overloaded(format!("worker {} queue is full", self.info.name)),
            TrySendError::Disconnected(_) => self.stopped(),
        })
    }

    /// Queues a command that counts toward the load from now until the loop is done
    /// with it, so requests routed in a burst see each other.
    fn send_counted(&self, c: Command) -> Result<(), ServeError> {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.send(c).inspect_err(|_| {
            self.active.fetch_sub(1, Ordering::Relaxed);
        })
    }

    /// Refuses work fenced for another epoch, before anything is queued or computed.
    fn fence(&self, fence: Option<Epoch>, take: fn(Role) -> bool) -> Result<(), ServeError> {
        self.role.fence(&self.info.name, fence, take)
    }

    fn stopped(&self) -> ServeError {
        ServeError::WorkerLost(format!("worker {} stopped", self.info.name))
    }

    async fn reserve(
        self: Arc<Self>,
        id: RequestId,
        prompt_len: usize,
        keep: Vec<u32>,
        direct: bool,
    ) -> Result<Reserved, ServeError> {
        if lock(&self.imports).insert(id, Import::Reserving).is_some() {
            return Err(ServeError::Invalid(format!("{id} already has a reservation")));
        }
        // From here every way out but success releases the blocks (a dropped future too).
        let guard = Defer::new({
            let inner = self.clone();
            move || {
                lock(&inner.imports).remove(&id);
                inner.release(id);
            }
        });
        // A release of this request that found the queue full (the spare-worker
        // retry of a handoff reserves again at once) goes in before this reservation,
        // or it would undo it.
        while lock(&self.aborting).contains(&id) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::Reserve { id, prompt_len, keep, direct, reply })?;
        let (draft_worth, stages) = rx.await.map_err(|_| self.stopped())??;
        let inbox =
            self.inboxes.expect(HandoffId::from(id)).map_err(|e| ServeError::Internal(format!("KV receiver: {e}")))?;
        let token = inbox.token();
        let mut imports = lock(&self.imports);
        // Released while the engine reserved: the guard gives the blocks back.
        if !matches!(imports.get(&id), Some(Import::Reserving)) {
            return Err(ServeError::Internal(format!("the reservation of {id} was released")));
        }
        let task = self.rt.spawn(forward(inbox, self.clone(), id));
        imports.insert(id, Import::Receiving(task));
        drop(imports);
        guard.disarm();
        Ok(Reserved { token, draft_worth, stages })
    }

    /// Opens the sending end of handoff `hid` to `to` (the main sink: a group's
    /// later stages may send theirs beside it, [`kv_parts`]); where a decode group's
    /// stages take their own layers, each layer's frames go to its stage.
    async fn open_sink(self: &Arc<Self>, to: &KvDestination, hid: HandoffId) -> Result<SharedSink, ServeError> {
        let sink = match &to.target {
            KvTarget::InProc(_) if to.stages.is_empty() => self.links.open(&to.target, hid, to.token),
            // Connecting blocks: off the async workers.
            _ => {
                let me = self.clone();
                let to = to.clone();
                tokio::task::spawn_blocking(move || me.open_by_layer(&to, hid))
                    .await
                    .map_err(|e| ServeError::Internal(format!("opening a KV link: {e}")))?
            }
        }
        .map_err(|e| kv_error(&to.target, &e))?;
        Ok(SharedSink::new(sink))
    }

    /// The sink of handoff `hid` to `to` and to each of its stages; blocks.
    fn open_by_layer(&self, to: &KvDestination, hid: HandoffId) -> Result<Box<dyn KvSink>, TransferError> {
        let main = self.links.open(&to.target, hid, to.token)?;
        if to.stages.is_empty() {
            return Ok(main);
        }
        let mut stages = Vec::with_capacity(to.stages.len());
        for s in &to.stages {
            // A sink dropped unfinished aborts its part of the handoff.
            stages.push((s.first..=s.last, self.links.open(&KvTarget::Remote(s.to.clone()), hid, s.token)?));
        }
        Ok(Box::new(ByLayer::new(main, stages)))
    }

    /// Ends a transfer whose frames all went into `sink`: once the receiver holds
    /// every one. A broken link is forgotten, so the next transfer reconnects.
    async fn finish_sink(&self, sink: &SharedSink, to: &KvDestination, broken: &AtomicBool) -> Result<(), ServeError> {
        if broken.load(Ordering::SeqCst) || !sink.finish().await {
            if let KvTarget::Remote(addr) = &to.target {
                self.links.forget(addr);
            }
            to.stages.iter().for_each(|s| self.links.forget(&s.to));
            return Err(ServeError::Internal(format!("the KV transfer to {:?} failed", to.target)));
        }
        Ok(())
    }

    async fn prefill(
        self: Arc<Self>,
        req: GenerateRequest,
        imported: usize,
        to: KvDestination,
    ) -> Result<Prefilled, ServeError> {
        let hid = HandoffId::from(req.id);
        let sink = self.open_sink(&to, hid).await?;
        // Set when this future is dropped: the engine stops at the next layer.
        let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
        let (broken, bytes) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let frames = sink.frame_sink(hid, stop.0.clone(), broken.clone(), bytes.clone());
        let (reply, rx) = oneshot::channel();
        let tokens = req.prompt.len();
        // Queued are the tokens to compute; all of them move.
        let _queued = Counted::add(&self.prefill_tokens, tokens - imported.min(tokens));
        let draft_worth = to.draft_worth;
        let sent = tokio::time::Instant::now();
        let parts = kv_parts(&to, hid);
        self.send_counted(Command::Prefill { req, imported, draft_worth, sink: frames, parts, reply, sent })?;
        let mut first = rx.await.map_err(|_| self.stopped())??;
        let tail = std::time::Instant::now();
        self.finish_sink(&sink, &to, &broken).await?;
        first.kv_bytes = bytes.load(Ordering::Relaxed);
        first.transfer_seconds = tail.elapsed().as_secs_f64();
        if let Some(kv) = &self.sim_kv {
            kv.account(&mut first, tokens, to.target.kind()).await;
        }
        Ok(first)
    }

    /// Sends the cached prefix of `tokens`, less its first `skip`, to `to` between
    /// engine steps; the tokens sent once the receiver holds them all.
    async fn export(
        self: Arc<Self>,
        id: RequestId,
        tokens: Vec<u32>,
        skip: usize,
        to: KvDestination,
    ) -> Result<usize, ServeError> {
        let hid = HandoffId::from(id);
        let sink = self.open_sink(&to, hid).await?;
        let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
        let (broken, bytes) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let frames = sink.frame_sink(hid, stop.0.clone(), broken.clone(), bytes.clone());
        let started = std::time::Instant::now();
        let (reply, rx) = oneshot::channel();
        self.exports.push(Export { tokens, skip, sink: frames, parts: kv_parts(&to, hid), reply });
        // A full queue means a busy loop, which serves the fetch at its next layer.
        if let Err(TrySendError::Disconnected(_)) = self.tx.try_send(Command::ServeExports) {
            return Err(self.stopped());
        }
        let sent = rx.await.map_err(|_| self.stopped())??;
        self.finish_sink(&sink, &to, &broken).await?;
        if let Some(kv) = &self.sim_kv {
            kv.account_export(sent, to.target.kind(), started.elapsed().as_secs_f64()).await;
        }
        Ok(sent)
    }

    /// Returns once the transfer into reservation `id` is complete, which is then
    /// the caller's to use; fails if it does not complete in time.
    async fn imported(&self, id: RequestId) -> Result<(), ServeError> {
        let Some(Import::Receiving(task)) = lock(&self.imports).remove(&id) else {
            return Err(no_transfer(id));
        };
        match tokio::time::timeout(FRAMES_GRACE, task).await {
            Ok(Ok(true)) => Ok(()),
            _ => Err(transfer_late(id)),
        }
    }

    /// Queues `command` (a decode or a generate that continues transfer `id`) once
    /// the transfer's last frame is in; a transfer that does not complete fails
    /// `events` and releases the reservation.
    fn when_imported(self: &Arc<Self>, id: RequestId, events: EventSender, command: Command) -> Result<(), ServeError> {
        let Some(Import::Receiving(task)) = lock(&self.imports).remove(&id) else {
            return Err(no_transfer(id));
        };
        // Counted now: the sequence is this worker's load while its last frames land.
        self.active.fetch_add(1, Ordering::Relaxed);
        let inner = self.clone();
        self.rt.spawn(async move {
            let mut task = task;
            let delivered = matches!(tokio::time::timeout(FRAMES_GRACE, &mut task).await, Ok(Ok(true)));
            if !delivered {
                // Out of the map already, so `release` cannot stop it: stop taking
                // frames for a reservation about to go.
                task.abort();
                inner.inboxes.forget(HandoffId::from(id));
            }
            let queued = match delivered {
                true => match inner.compiled(command.grammar()).await {
                    Ok(()) => inner.send(command),
                    Err(e) => Err(e),
                },
                false => Err(transfer_late(id)),
            };
            if let Err(e) = queued {
                inner.active.fetch_sub(1, Ordering::Relaxed);
                inner.release(id);
                let _ = events.send(pdserve_protocol::Event::Failed(e));
            }
        });
        Ok(())
    }

    fn release(self: &Arc<Self>, id: RequestId) {
        if let Some(Import::Receiving(task)) = lock(&self.imports).remove(&id) {
            task.abort();
            self.inboxes.forget(HandoffId::from(id));
        }
        // Through the command queue, so it lands after the reservation it undoes; when
        // the queue is full, a task waits for room (a release is never dropped).
        if let Err(TrySendError::Full(c)) = self.tx.try_send(Command::AbortImport(id)) {
            lock(&self.aborting).insert(id);
            let inner = self.clone();
            self.rt.spawn(async move {
                let mut c = c;
                while let Err(TrySendError::Full(back)) = inner.tx.try_send(c) {
                    c = back;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                lock(&inner.aborting).remove(&id);
            });
        }
    }
}

/// A decode or prefill asked to continue a transfer this worker does not hold
/// (never reserved here, released, or expired).
pub(crate) fn no_transfer(id: RequestId) -> ServeError {
    ServeError::KvLost(format!("no transfer into this worker for {id}"))
}

/// A transfer whose last frames did not arrive within [`FRAMES_GRACE`].
fn transfer_late(id: RequestId) -> ServeError {
    ServeError::KvLost(format!("the transfer of {id} did not complete in time"))
}

/// Runs `work`; a failure, or dropping it unfinished, calls `release` (gives back
/// a reservation the work was to use).
pub(crate) async fn or_release<T>(
    release: impl FnOnce(),
    work: impl std::future::Future<Output = Result<T, ServeError>>,
) -> Result<T, ServeError> {
    let guard = Defer::new(release);
    let done = work.await?;
    guard.disarm();
    Ok(done)
}

/// Runs its action when dropped unless disarmed: the cleanup of a call that may be
/// abandoned half-way (a reservation whose future is dropped).
pub(crate) struct Defer<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Defer<F> {
    pub(crate) fn new(action: F) -> Defer<F> {
        Defer(Some(action))
    }

    pub(crate) fn disarm(mut self) {
        self.0 = None;
    }
}

impl<F: FnOnce()> Drop for Defer<F> {
    fn drop(&mut self) {
        if let Some(action) = self.0.take() {
            action();
        }
    }
}

/// Adds to a counter for as long as it lives.
struct Counted(Arc<AtomicUsize>, usize);

impl Counted {
    fn add(counter: &Arc<AtomicUsize>, n: usize) -> Counted {
        counter.fetch_add(n, Ordering::Relaxed);
        Counted(counter.clone(), n)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// Raises the flag a running prefill checks between layers when the prefill's
/// future is dropped (its caller gave up).
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Where a group's later stages may send their own layers of handoff `hid` to `to`:
/// a receiver in another process (one in this process is reached through the head).
fn kv_parts(to: &KvDestination, hid: HandoffId) -> Option<KvParts> {
    match &to.target {
        KvTarget::Remote(addr) => {
            Some(KvParts { to: addr.clone(), handoff: hid.0, token: to.token, stages: to.stages.clone() })
        }
        KvTarget::InProc(_) => None,
    }
}

fn kv_error(target: &KvTarget, e: &TransferError) -> ServeError {
    ServeError::Internal(format!("KV transfer to {target:?}: {e}"))
}
