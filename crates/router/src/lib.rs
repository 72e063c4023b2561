//! The router: for each request, where it prefills and where it decodes.
//!
//! Sits between the frontend (which calls [`Router::generate`] through the
//! [`Generate`] trait) and a live [`WorkerSet`] of workers behind the one
//! [`Worker`](pdserve_protocol::Worker) surface, in this process or others.
//! Aggregated requests go to one worker; disaggregated ones run the [`handoff`]:
//! reserve on a decode worker, prefill on a prefill worker streaming K/V into the
//! reservation, first token to the client, decode continues — each state with a
//! deadline and a cleanup path. `auto` decides per request with [`cost`]; which
//! worker of a role gets a request is the [`policies`]' call. [`Migrating`] moves a
//! request whose worker is lost mid-stream to another worker. With more models than
//! room, [`resident`] loads each when asked for and unloads the least recently used.

pub mod cost;
mod execute;
pub mod fetch;
pub mod handoff;
pub mod index;
mod migrate;
mod mode;
pub mod place;
mod planning;
pub mod policies;
mod relay;
pub mod resident;
pub mod snapshot;
pub mod workers;

pub use execute::Ending;
pub use handoff::{Deadlines, Handoff};
pub use migrate::Migrating;
pub use mode::Mode;
pub use place::Admission;
pub use policies::{Ask, Candidate, Policy, PolicyKind};
pub use workers::{Entry, WorkerId, WorkerSet};

use cost::TransferCost;
use fetch::FetchPace;
use index::KvIndex;
use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{Generate, GenerateRequest, NoTelemetry, ServeError, Telemetry, TokenStream, Worker};
use pdserve_types::Role;
use place::Refusal;
use snapshot::Snapshot;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often a server polls its workers' stats for admission and its metrics.
pub const STATS_EVERY: Duration = Duration::from_secs(1);
/// Salt of the block hashes handed to policies: the engines' default.
const BLOCK_SALT: u64 = 0;
/// Tokens per KV block, as every engine pages its cache.
const BLOCK_SIZE: usize = 16;
/// The traffic window the planner judges by.
const SIGNALS_WINDOW: Duration = Duration::from_secs(12);

pub struct Router {
    workers: WorkerSet,
    transfer: Arc<TransferCost>,
    mode: Mode,
    policy: Box<dyn Policy>,
    deadlines: Deadlines,
    runtime: tokio::runtime::Handle,
    draining: AtomicBool,
    telemetry: Arc<dyn Telemetry>,
    /// How prefill workers send KV to decode workers.
    via: TransportKind,
    /// What is refused at the door rather than queued.
    admission: Admission,
    /// What each worker's prefix cache holds, from their KV events.
    index: Arc<KvIndex>,
    /// Requests refused by admission, to spread their `Retry-After`.
    refusals: AtomicU64,
    /// The traffic as clients see it, for the planner.
    pub signals: Arc<pdserve_planner::signals::Signals>,
    /// Whether a worker missing a prefix a peer caches may fetch it
    /// ([`fetch`]); with it, how long fetches take.
    fetch: Option<Arc<FetchPace>>,
}

impl Router {
    /// A router over `workers`; `runtime` runs the handoff tasks. KV goes in-process
    /// until [`Router::with_transport`] says otherwise.
    pub fn new(
        workers: impl IntoIterator<Item = Arc<dyn Worker>>,
        mode: Mode,
        deadlines: Deadlines,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        let set = WorkerSet::default();
        for w in workers {
            set.add(w);
        }
        Router {
            workers: set,
            transfer: Arc::default(),
            mode,
            policy: PolicyKind::default().build(),
            deadlines,
            runtime,
            draining: AtomicBool::new(false),
            telemetry: Arc::new(NoTelemetry),
            via: TransportKind::Inproc,
            admission: Admission { max_queue: None, ttft: None, tpot: None },
            index: Arc::default(),
            refusals: AtomicU64::new(0),
            signals: Arc::new(pdserve_planner::signals::Signals::new(SIGNALS_WINDOW)),
            fetch: Some(Arc::default()),
        }
    }

    /// Whether a worker that lacks a prefix a peer caches may fetch the blocks
    /// instead of recomputing them, where that is predicted sooner (on by default;
    /// only between workers that both support it).
    pub fn with_prefix_fetch(mut self, on: bool) -> Self {
        self.fetch = on.then(Arc::default);
        self
    }

    /// Switches worker `e` to `role` at its next epoch; answers with what it holds
    /// afterwards. The router routes by the new role from the moment it is known.
    pub async fn switch_role(&self, e: &Entry, role: Role) -> Result<pdserve_types::Assignment, ServeError> {
        self.assign(e, e.assignment().switch(role)).await
    }

    /// Records that worker `e` holds `role` now (a switch made through the fleet, or
    /// here). Set first, look second: a worker that left the set while the switch
    /// ran keeps no role series.
    pub fn note_role(&self, e: &Entry, role: Role) {
        self.telemetry.role(e.name(), role);
        if e.is_draining() {
            self.telemetry.role_gone(e.name());
        }
    }

    /// Admission: a request predicted to wait longer than `limit` before its prefill
    /// starts is refused at once (429 with `Retry-After`) rather than queued.
    pub fn with_admission(mut self, limit: Option<Duration>) -> Self {
        self.admission.max_queue = limit;
        self
    }

    /// SLO admission: a request whose first token is predicted later than `slo`
    /// (its wait, as [`Router::with_admission`] predicts it, plus its own prefill) is
    /// refused at once (429 with `Retry-After`), before any of it is computed.
    pub fn with_slo_admission(mut self, slo: Option<Duration>) -> Self {
        self.admission.ttft = slo;
        self
    }

    /// TPOT admission: a request whose decode worker, with it added to its batch, is
    /// predicted to take longer than `slo` per step (every sequence's time per output
    /// token there) is refused at once (429 with `Retry-After`). The step is the
    /// worker's own fit of its decode steps ([`pdserve_types::StepFit`]) over the
    /// sequences it runs and the tokens its blocks hold, as its stats last said;
    /// a worker without a fit yet is not judged.
    pub fn with_tpot_admission(mut self, slo: Option<Duration>) -> Self {
        self.admission.tpot = slo;
        self
    }

    /// All three admission checks at once, as `serve`'s flags set them.
    pub fn with_limits(self, a: Admission) -> Self {
        self.with_admission(a.max_queue).with_slo_admission(a.ttft).with_tpot_admission(a.tpot)
    }

    /// How prefill workers send KV to decode workers.
    pub fn with_transport(mut self, via: TransportKind) -> Self {
        self.via = via;
        self
    }

    pub fn with_policy(mut self, policy: Box<dyn Policy>) -> Self {
        self.policy = policy;
        self
    }

    /// Reports routing decisions, phase times and transfer bytes to `t`.
    pub fn with_telemetry(mut self, t: Arc<dyn Telemetry>) -> Self {
        self.telemetry = t;
        self
    }

    /// The live worker set: add and remove workers while requests flow.
    pub fn workers(&self) -> &WorkerSet {
        &self.workers
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Refuse new requests (shutdown); requests in flight continue.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Requests in flight on all workers.
    pub fn in_flight(&self) -> usize {
        self.workers.snapshot().iter().map(|e| e.worker.load()).sum()
    }
}

impl Generate for Router {
    fn generate(&self, req: GenerateRequest) -> Result<TokenStream, ServeError> {
        self.route(req, None)
    }

    fn ready(&self) -> bool {
        self.ready_now()
    }
}

impl Router {
    /// Routes `req`: a snapshot of the workers, one placement over it, then its
    /// execution. With `prefill_on`, its prompt is prefilled on that worker wherever
    /// it can prefill (a moved request: its KV is cached there).
    pub(crate) fn route(&self, req: GenerateRequest, prefill_on: Option<&str>) -> Result<TokenStream, ServeError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ServeError::ShuttingDown);
        }
        let hashes = prompt_blocks(&req);
        let ask = Ask { prompt_len: req.prompt.len(), block_hashes: &hashes };
        let entries = self.workers.snapshot();
        let snap = self.snapshot(&entries, &ask);
        // Blocks the request holds at its longest: prompt and every output token.
        let life = req.prompt.len() + req.params.max_tokens as usize;
        let placed = place::place(self.mode, &self.admission, &snap, &ask, self.policy.as_ref(), prefill_on, life);
        let decode = placed.as_ref().map_or_else(Refusal::decode, |p| Some(p.decode));
        if let Some(d) = decode.map(|i| entries[i].name()) {
            tracing::Span::current().record("decode", d);
            req.trace.update(|t| t.decode = Some(d.to_string()));
        }
        let plan = placed.map_err(|r| self.refused(r))?;
        self.execute(plan, &entries, req, &ask)
    }

    /// The workers as placement reads them, with what each caches of `ask`.
    fn snapshot(&self, entries: &[Arc<Entry>], ask: &Ask<'_>) -> Snapshot {
        let names: Vec<&str> = entries.iter().map(|e| e.name()).collect();
        let cached = self.index.prefix(ask.block_hashes, &names);
        Snapshot {
            views: entries.iter().zip(cached).map(|(e, c)| e.view(c, self.via)).collect(),
            transfer: self.transfer.view(),
            fetch_per_token: self.fetch.as_ref().map(|f| f.per_token()),
        }
    }

    /// The error a refusal answers with; the refusals' order spreads the
    /// `Retry-After` of a burst of them ([`cost::retry_after`]).
    fn refused(&self, r: Refusal) -> ServeError {
        let retry = |excess_s: f64, wait_s: f64| {
            cost::retry_after(excess_s, wait_s, self.refusals.fetch_add(1, Ordering::Relaxed))
        };
        match r {
            Refusal::NoWorker => ServeError::NoWorker("no live decode or mixed worker".into()),
            Refusal::Queue { wait_s, limit, .. } => ServeError::QueueFull {
                wait_s: wait_s.min(1e6).ceil() as u64,
                limit_s: limit.as_secs(),
                retry_s: retry(wait_s - limit.as_secs_f64(), wait_s),
            },
            Refusal::Ttft { first_s, slo, .. } => ServeError::SloInfeasible {
                predicted_ms: (first_s.min(1e6) * 1e3) as u64,
                slo_ms: slo.as_millis() as u64,
                retry_s: retry(first_s - slo.as_secs_f64(), first_s),
            },
            // A batch shrinks as its sequences finish: a second, spread, is a fair wait.
            Refusal::Tpot { step_s, slo, .. } => ServeError::TpotInfeasible {
                predicted_ms: (step_s.min(1e6) * 1e3).ceil() as u64,
                slo_ms: slo.as_millis() as u64,
                retry_s: retry(1.0, 1.5),
            },
        }
    }

    fn ready_now(&self) -> bool {
        let decodes = |e: &Arc<Entry>| e.usable() && matches!(e.role(), Role::Decode | Role::Mixed);
        !self.draining.load(Ordering::SeqCst) && self.workers.snapshot().iter().any(decodes)
    }
}

/// The prompt's full blocks as the engines hash them, as far as an engine may take
/// them from its cache: it leaves at least one prompt token to compute (for the
/// logits), and computes a prompt in full when asked for its logprobs or embedding.
fn prompt_blocks(req: &GenerateRequest) -> Vec<pdserve_kv::BlockHash> {
    let mut hashes = pdserve_kv::block_hashes(&req.prompt, BLOCK_SIZE, BLOCK_SALT);
    let cacheable = match req.params.whole_prompt() {
        true => 0,
        false => req.prompt.len().saturating_sub(1) / BLOCK_SIZE,
    };
    hashes.truncate(cacheable);
    hashes
}
