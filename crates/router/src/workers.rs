//! The router's live set of workers. Workers join and leave while requests flow;
//! each entry carries the worker's current `(role, epoch)`, read at routing time, and
//! what the router measures about it.
//!
//! Removing a worker drains it: it takes no new work, and requests already on it
//! keep their entry (an `Arc`) until they finish or fail over.

use crate::cost::{Backlog, KvMemory, Link, PrefillLoad, RestorePace};
use crate::index::CachedPrefix;
use crate::snapshot::View;
use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{ServeError, Worker, WorkerStats};
use pdserve_types::{Assignment, DecodeSteps, Epoch, Role, StepFit};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use tokio::sync::Semaphore;

/// Handoffs one prefill worker runs at once: one prefilling and one reserving its
/// blocks, so the worker never idles between prompts; the rest wait in the router
/// (holding nothing on any worker) in arrival order.
pub const PREFILL_SLOTS: usize = 2;

/// How long a worker's stats may take before a poll goes on without them: a hung
/// worker must not hold up the others' figures, nor keep its own.
pub(crate) const STATS_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Names a worker within one router, for as long as the router runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u64);

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}", self.0)
    }
}

/// One worker and what the router knows about it.
pub struct Entry {
    pub id: WorkerId,
    pub worker: Arc<dyn Worker>,
    state: Mutex<(Role, Epoch)>,
    /// Taken out of the set.
    draining: AtomicBool,
    /// The worker said it is stopping (it finishes its work, and gets no more), or
    /// that its stage group is not whole.
    stopping: AtomicBool,
    /// Prompt tokens queued here and the measured prefill rate (`auto`'s cost model).
    pub(crate) prefill: Arc<PrefillLoad>,
    /// Handoffs it may be prefilling at once (see [`PREFILL_SLOTS`]).
    pub(crate) slots: Arc<Semaphore>,
    /// Requests it will decode still waiting for their first token (admission).
    pub(crate) backlog: Arc<Backlog>,
    /// Its free KV blocks and the pace at which they free up (admission).
    pub(crate) kv: Arc<KvMemory>,
    /// What copying blocks back from its host and disk tiers costs.
    pub(crate) restore: RestorePace,
    /// Its probed KV links to other workers, by their names.
    links: Mutex<HashMap<String, Link>>,
    /// Its decode step fit and the tokens its blocks held, as its stats last said
    /// (TPOT admission).
    decode: Mutex<Option<(StepFit, usize)>>,
}

impl Entry {
    pub fn name(&self) -> &str {
        &self.worker.info().name
    }

    pub fn role(&self) -> Role {
        self.state().0
    }

    pub fn epoch(&self) -> Epoch {
        self.state().1
    }

    pub fn assignment(&self) -> Assignment {
        let (role, epoch) = self.state();
        Assignment::new(role, epoch)
    }

    /// Records the worker's assignment if it is newer than the one known (from its
    /// stats, its fleet record, a refusal, or a switch this process made). Answers
    /// whether it was.
    pub fn learn(&self, now: Assignment) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let newer = now.epoch > state.1;
        if newer {
            *state = (now.role, now.epoch);
        }
        newer
    }

    /// The worker, still connected, ended a request as lost (a stage group that lost a
    /// stage): it gets no new work until its stats say it can take some.
    pub fn lost_one(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// Learns from `e` if it is a refusal for a stale epoch, or takes the worker out
    /// if it answered as lost; gives `e` back.
    pub fn noted(&self, e: ServeError) -> ServeError {
        match &e {
            ServeError::StaleEpoch { now, .. } => {
                self.learn(*now);
            }
            ServeError::WorkerLost(_) => self.lost_one(),
            _ => {}
        }
        e
    }

    /// The KV blocks the worker could give a new sequence (free or only cached), as its
    /// stats just said, asked for at `mark` ([`Entry::taken_mark`]).
    pub fn report_free_blocks(&self, blocks: usize, mark: u64) {
        self.kv.report_free(blocks);
        self.backlog.counted(mark);
    }

    /// The worker's decode steps so far and its used blocks, as its stats just said.
    pub fn report_decode(&self, steps: &DecodeSteps, used_blocks: usize) {
        let held = used_blocks * crate::BLOCK_SIZE;
        *self.decode.lock().unwrap_or_else(PoisonError::into_inner) = steps.fit().map(|f| (f, held));
    }

    /// The worker as placement reads it now, `cached` being what its prefix cache
    /// holds of the request placed; `via`, the router's transport.
    pub(crate) fn view(&self, cached: CachedPrefix, via: TransportKind) -> View {
        let peers = self.worker.prefix_peer().is_some();
        View {
            name: self.name().to_string(),
            role: self.role(),
            usable: self.usable(),
            alive: self.worker.is_alive(),
            peers,
            receives: peers && self.worker.kv_target(via).is_some(),
            load: self.worker.load(),
            routed: self.backlog.routed(),
            free_slots: self.slots.available_permits(),
            prefill: self.prefill.view(),
            backlog: self.backlog.view(),
            kv: self.kv.view(),
            step: *self.decode.lock().unwrap_or_else(PoisonError::into_inner),
            restore: self.restore.view(),
            links: self.links.lock().unwrap_or_else(PoisonError::into_inner).clone(),
            cached,
            kv_bytes_per_token: Some(self.worker.info().kv_bytes_per_token as f64).filter(|&b| b > 0.0),
        }
    }

    /// The worker's lower-tier counters, as its stats just said.
    pub fn report_tiers(&self, c: &pdserve_kv::TierCounters) {
        self.restore.report(c);
    }

    /// Asks the worker for its stats and takes in what routing and admission learn
    /// from them: blocks free, decode steps, tier counters, a role another process
    /// switched. `None`: no answer within [`STATS_WAIT`].
    pub async fn poll_stats(&self) -> Option<WorkerStats> {
        self.read_stats().await.ok()
    }

    /// [`Entry::poll_stats`], saying why there are none: the worker's error, or a
    /// [`ServeError::Timeout`] past [`STATS_WAIT`].
    pub async fn read_stats(&self) -> Result<WorkerStats, ServeError> {
        let mark = self.taken_mark();
        let late =
            || ServeError::Timeout(format!("{} sent no stats within {} ms", self.name(), STATS_WAIT.as_millis()));
        let s = tokio::time::timeout(STATS_WAIT, self.worker.stats()).await.map_err(|_| late())??;
        // Blocks only the prefix cache holds are given up on demand.
        self.report_free_blocks(s.blocks.free + s.blocks.cached, mark);
        self.report_tiers(&s.tiers);
        self.report_decode(&s.decode_steps, s.blocks.used);
        self.prefill.report_pending(s.queued_prompt_tokens);
        if let Some(now) = s.assignment {
            self.learn(now);
        }
        self.stopping.store(s.stopping || s.incomplete, Ordering::SeqCst);
        Ok(s)
    }

    /// Where the count of blocks taken by admitted requests stands, before its stats
    /// are asked for.
    pub fn taken_mark(&self) -> u64 {
        self.backlog.taken_mark()
    }

    /// The prefill pace measured for this worker (seconds per prompt token), if any.
    pub fn prefill_pace(&self) -> Option<f64> {
        self.prefill.measured()
    }

    /// Takes a prefill pace another router measured for this worker.
    pub fn adopt_prefill_pace(&self, seconds_per_token: f64) {
        self.prefill.adopt(seconds_per_token);
    }

    /// Replaces what is known of this worker's links, by receiving worker's name.
    pub fn set_links(&self, links: HashMap<String, Link>) {
        *self.links.lock().unwrap_or_else(PoisonError::into_inner) = links;
    }

    /// The probed link from this worker to `to`, if any.
    pub fn link_to(&self, to: &Entry) -> Option<Link> {
        self.links.lock().unwrap_or_else(PoisonError::into_inner).get(to.name()).copied()
    }

    fn state(&self) -> (Role, Epoch) {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether new work may go here: reachable, in the set, and not stopping.
    pub fn usable(&self) -> bool {
        self.worker.is_alive() && !self.draining.load(Ordering::SeqCst) && !self.stopping.load(Ordering::SeqCst)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Resolves once nothing runs on the worker any more.
    pub async fn drained(&self) {
        while self.worker.load() > 0 && self.worker.is_alive() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

/// The workers a router routes to.
#[derive(Default)]
pub struct WorkerSet {
    entries: RwLock<Vec<Arc<Entry>>>,
    next: AtomicU64,
}

impl WorkerSet {
    /// Adds a worker in the role it announced; it is routed to from the next request.
    pub fn add(&self, worker: Arc<dyn Worker>) -> WorkerId {
        let entry = self.entry(worker);
        let id = entry.id;
        self.write().push(Arc::new(entry));
        id
    }

    /// [`WorkerSet::add`] of a worker that can hand requests to and from every
    /// worker already here; else why not (see
    /// [`WorkerInfo::mismatch`](pdserve_protocol::WorkerInfo::mismatch)).
    pub fn try_add(&self, worker: Arc<dyn Worker>) -> Result<WorkerId, String> {
        let mut entries = self.write();
        if let Some(why) = entries.iter().find_map(|e| worker.info().mismatch(e.worker.info())) {
            return Err(why);
        }
        let entry = self.entry(worker);
        let id = entry.id;
        entries.push(Arc::new(entry));
        Ok(id)
    }

    fn entry(&self, worker: Arc<dyn Worker>) -> Entry {
        let id = WorkerId(self.next.fetch_add(1, Ordering::Relaxed));
        let role = worker.info().role;
        Entry {
            id,
            worker,
            state: Mutex::new((role, Epoch::default())),
            draining: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            prefill: Arc::default(),
            slots: Arc::new(Semaphore::new(PREFILL_SLOTS)),
            backlog: Arc::default(),
            kv: Arc::default(),
            restore: RestorePace::default(),
            links: Mutex::default(),
            decode: Mutex::default(),
        }
    }

    /// Takes a worker out: no new work goes there; requests on it go on (await
    /// [`Entry::drained`] on the returned entry to know when they are done).
    pub fn remove(&self, id: WorkerId) -> Option<Arc<Entry>> {
        let mut entries = self.write();
        let at = entries.iter().position(|e| e.id == id)?;
        let entry = entries.remove(at);
        entry.draining.store(true, Ordering::SeqCst);
        Some(entry)
    }

    pub fn get(&self, id: WorkerId) -> Option<Arc<Entry>> {
        self.read().iter().find(|e| e.id == id).cloned()
    }

    /// Every worker now in the set, in the order they joined.
    pub fn snapshot(&self) -> Vec<Arc<Entry>> {
        self.read().clone()
    }

    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Entry>>> {
        self.entries.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Arc<Entry>>> {
        self.entries.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The router polls its workers' stats.
impl crate::Router {
    /// Polls every worker's stats once ([`Entry::poll_stats`]); `None` where a worker
    /// did not answer in time.
    pub async fn poll_stats(&self) -> Vec<(Arc<Entry>, Option<WorkerStats>)> {
        let mut out = Vec::new();
        for e in self.workers.snapshot() {
            let stats = e.poll_stats().await;
            out.push((e, stats));
        }
        out
    }

    /// Polls every worker's stats every [`crate::STATS_EVERY`] from now on, as long as the
    /// runtime runs, handing each round to `sink` (a server's metrics).
    pub fn spawn_stats_poll(
        self: &Arc<Self>,
        sink: impl Fn(Vec<(Arc<Entry>, Option<WorkerStats>)>) + Send + Sync + 'static,
    ) {
        // Held weakly: the poll ends with the router (a model unloaded).
        let router = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(crate::STATS_EVERY);
            loop {
                tick.tick().await;
                let Some(r) = router.upgrade() else { return };
                sink(r.poll_stats().await);
            }
        });
    }
}
