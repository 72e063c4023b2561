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
//! request whose worker is lost mid-stream to another worker.

pub mod cost;
pub mod fetch;
pub mod handoff;
pub mod index;
mod migrate;
mod mode;
pub mod planner;
pub mod policies;
mod relay;
pub mod workers;

pub use handoff::{Deadlines, Handoff};
pub use migrate::Migrating;
pub use mode::Mode;
pub use policies::{Ask, Candidate, Policy, PolicyKind};
pub use workers::{Entry, WorkerId, WorkerSet};

use cost::KvMemory;
use cost::TransferCost;
use fetch::{Fetch, FetchCtx, FetchPace};
use index::{KvIndex, PredictedHit};
use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{
    Event, Generate, GenerateRequest, KvCursor, KvEvents, NoTelemetry, PrefillRoute, ServeError, Telemetry,
    TokenStream, Worker, WorkerStats,
};
use pdserve_types::Role;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// How often a server polls its workers' stats for admission and its metrics.
pub const STATS_EVERY: Duration = Duration::from_secs(1);
/// Salt of the block hashes handed to policies: the engines' default.
const BLOCK_SALT: u64 = 0;
/// Tokens per KV block, as every engine pages its cache.
const BLOCK_SIZE: usize = 16;
/// The traffic window the planner judges by.
const SIGNALS_WINDOW: Duration = Duration::from_secs(12);
/// The longest prompt (tokens to compute) a worker with the decode role prefills
/// itself in `auto`, when the prefill workers are backed up: the engine's default
/// step budget, so its sequences wait out one step.
const DECODER_PREFILL_TOKENS: usize = 512;
/// How long `auto` waits for a full decode worker's blocks before prefilling there.
const AUTO_RESERVE: Duration = Duration::from_millis(500);

/// What a router refuses at the door (429 with `Retry-After`) rather than queue:
/// see [`Router::with_admission`], [`Router::with_slo_admission`] and
/// [`Router::with_tpot_admission`]. The default is `pdserve serve`'s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Admission {
    /// The longest predicted wait before a request's prefill starts.
    pub max_queue: Option<Duration>,
    /// The time-to-first-token objective.
    pub ttft: Option<Duration>,
    /// The time-per-output-token objective.
    pub tpot: Option<Duration>,
}

impl Admission {
    /// `serve`'s `--max-queue-seconds` unless given.
    pub const DEFAULT_MAX_QUEUE_S: f64 = 30.0;
}

impl Default for Admission {
    fn default() -> Self {
        Admission { max_queue: Some(Duration::from_secs_f64(Self::DEFAULT_MAX_QUEUE_S)), ttft: None, tpot: None }
    }
}

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
    /// Refuse requests predicted to wait longer than this to start.
    max_queue: Option<Duration>,
    /// Refuse requests whose first token is predicted later than this.
    slo_ttft: Option<Duration>,
    /// Refuse requests whose decode worker's step is predicted longer than this
    /// with them in its batch.
    slo_tpot: Option<Duration>,
    /// What each worker's prefix cache holds, from their KV events.
    index: Arc<KvIndex>,
    /// Requests refused by admission, to spread their `Retry-After`.
    refusals: AtomicU64,
    /// The traffic as clients see it, for the planner.
    pub signals: Arc<planner::signals::Signals>,
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
            max_queue: None,
            slo_ttft: None,
            slo_tpot: None,
            index: Arc::default(),
            refusals: AtomicU64::new(0),
            signals: Arc::new(planner::signals::Signals::new(SIGNALS_WINDOW)),
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
        let now = e.worker.set_role(e.assignment().switch(role)).await?;
        e.learn(now);
        self.note_role(e, now.role);
        Ok(now)
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

    /// Takes KV events worker `name` pushed (a fleet worker's, over NATS), following
    /// `from`. Events that do not continue the index are dropped (those of a worker
    /// not in the set too: the index holds no cursor for it), and polling catches
    /// the worker up.
    pub fn take_pushed_kv_events(&self, name: &str, from: KvCursor, got: KvEvents) {
        if let Some(a) = self.index.apply_pushed(name, from, got) {
            self.telemetry.kv_index(&a.lags, a.resyncs, self.index.len());
            self.telemetry.kv_events_pushed(a.lags.len());
        }
    }

    /// Starts following every worker's KV events into the router's index, on its
    /// runtime, for as long as the router lives.
    pub fn follow_kv_events(self: &Arc<Self>) {
        let router = Arc::downgrade(self);
        self.runtime.spawn(async move {
            let mut busy = true;
            loop {
                // Quickly while events flow; an idle fleet is asked less often.
                tokio::time::sleep(if busy { index::POLL } else { index::IDLE_POLL }).await;
                let Some(r) = router.upgrade() else { return };
                let all = r.workers.snapshot();
                let names: Vec<&str> = all.iter().map(|e| e.name()).collect();
                r.index.retain(&names);
                busy = false;
                // A worker whose own events arrive pushed (a fleet's, over NATS) is
                // asked only when they stop or skip.
                for e in all.iter().filter(|e| e.worker.is_alive() && !r.index.pushed_recently(e.name())) {
                    if let Some(a) = r.index.sync(e.name(), e.worker.as_ref()).await {
                        busy |= !a.lags.is_empty() || a.resyncs > 0;
                        r.telemetry.kv_index(&a.lags, a.resyncs, r.index.len());
                    }
                }
            }
        });
    }

    /// Admission: a request predicted to wait longer than `limit` before its prefill
    /// starts is refused at once (429 with `Retry-After`) rather than queued.
    pub fn with_admission(mut self, limit: Option<Duration>) -> Self {
        self.max_queue = limit;
        self
    }

    /// SLO admission: a request whose first token is predicted later than `slo`
    /// (its wait, as [`Router::with_admission`] predicts it, plus its own prefill) is
    /// refused at once (429 with `Retry-After`), before any of it is computed.
    pub fn with_slo_admission(mut self, slo: Option<Duration>) -> Self {
        self.slo_ttft = slo;
        self
    }

    /// TPOT admission: a request whose decode worker, with it added to its batch, is
    /// predicted to take longer than `slo` per step (every sequence's time per output
    /// token there) is refused at once (429 with `Retry-After`). The step is the
    /// worker's own fit of its decode steps ([`pdserve_types::StepFit`]) over the
    /// sequences it runs and the tokens its blocks hold, as its stats last said;
    /// a worker without a fit yet is not judged.
    pub fn with_tpot_admission(mut self, slo: Option<Duration>) -> Self {
        self.slo_tpot = slo;
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

    /// Polls every worker's stats every [`STATS_EVERY`] from now on, as long as the
    /// runtime runs, handing each round to `sink` (a server's metrics).
    pub fn spawn_stats_poll(
        self: &Arc<Self>,
        sink: impl Fn(Vec<(Arc<Entry>, Option<WorkerStats>)>) + Send + Sync + 'static,
    ) {
        let router = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(STATS_EVERY);
            loop {
                tick.tick().await;
                sink(router.poll_stats().await);
            }
        });
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

    /// Usable workers of `all` whose current role is one of `roles`, except `not`.
    fn with_role(all: &[Arc<Entry>], roles: &[Role], not: Option<&Entry>) -> Vec<Arc<Entry>> {
        all.iter()
            .filter(|e| e.usable() && roles.contains(&e.role()) && not.is_none_or(|n| n.id != e.id))
            .cloned()
            .collect()
    }

    /// The policy's choice among `entries`.
    fn pick(&self, ask: &Ask<'_>, entries: &[Arc<Entry>]) -> Option<Arc<Entry>> {
        self.pick_where(ask, entries, |_| true, None).map(|(e, _)| e)
    }

    /// The policy's choice of the decode worker. A worker that will not prefill the
    /// request (any decoder in disaggregated mode, one the planner made a decoder in
    /// auto) is offered as a prefill elsewhere would serve it: nothing cached, nothing
    /// queued, the fastest pace among `entries`. The whole prompt's KV reaches it
    /// from a prefill worker, so a prefix it holds would save nothing (and would draw
    /// every repeated prompt to it, away from a decoder that joined later); among
    /// such workers the choice falls to their load.
    /// With it, the fetch of a peer's cached prefix that serves the choice sooner
    /// than recomputing, if any.
    fn pick_decoder(&self, ask: &Ask<'_>, entries: &[Arc<Entry>]) -> Option<(Arc<Entry>, Option<Fetch>)> {
        self.pick_where(
            ask,
            entries,
            |e| match self.mode {
                Mode::Aggregated => true,
                Mode::Disaggregated => false,
                Mode::Auto => e.role() != Role::Decode,
            },
            Some(&[]),
        )
    }

    /// The policy's choice among `entries`, where only those `prefills_there` are
    /// offered with their cached prefix, or, `fetching` (from `entries` or the
    /// `others` named), with the longer one they could fetch from a peer where that
    /// is predicted sooner (the fetch is returned with the choice).
    fn pick_where(
        &self,
        ask: &Ask<'_>,
        entries: &[Arc<Entry>],
        prefills_there: impl Fn(&Entry) -> bool,
        fetching: Option<&[Arc<Entry>]>,
    ) -> Option<(Arc<Entry>, Option<Fetch>)> {
        let names: Vec<&str> = entries.iter().map(|e| e.name()).collect();
        let cached = self.index.prefix(ask.block_hashes, &names);
        let paces = Paces::of(entries);
        let (pace, fixed) = (|e: &Entry| paces.per_token(e), |e: &Entry| paces.fixed(e));
        let fastest = entries.iter().map(|e| pace(e)).fold(f64::INFINITY, f64::min);
        let others = fetching.unwrap_or_default();
        let names: Vec<&str> = others.iter().map(|e| e.name()).collect();
        let theirs = match names.is_empty() {
            true => Vec::new(),
            false => self.index.prefix(ask.block_hashes, &names),
        };
        let holders = entries.iter().zip(&cached).chain(others.iter().zip(&theirs));
        let source = fetching.and_then(|_| self.fetch_source(holders));
        let mut fetches: Vec<Option<Fetch>> = vec![None; entries.len()];
        let candidates: Vec<Candidate<'_>> = entries
            .iter()
            .zip(&cached)
            .zip(&mut fetches)
            .map(|((e, prefix), fetch)| {
                let own = Candidate {
                    name: e.name(),
                    role: e.role(),
                    load: e.worker.load() + e.backlog.routed(),
                    queued_seconds: e.prefill.queued_seconds_at((fixed(e), pace(e))),
                    cached_tokens: prefix.blocks() * BLOCK_SIZE,
                    restore_seconds: e.restore.seconds(prefix),
                    seconds_per_token: pace(e),
                    fixed_seconds: fixed(e),
                };
                match prefills_there(e) {
                    true => match self.fetched(ask, e, &own, source) {
                        Some((f, c)) => {
                            *fetch = Some(f);
                            c
                        }
                        None => own,
                    },
                    false => Candidate {
                        queued_seconds: 0.0,
                        cached_tokens: 0,
                        restore_seconds: 0.0,
                        seconds_per_token: fastest,
                        fixed_seconds: 0.0,
                        ..own
                    },
                }
            })
            .collect();
        let i = self.policy.pick(ask, &candidates)?;
        Some((entries.get(i)?.clone(), fetches.get_mut(i)?.take()))
    }

    /// The holder whose cache holds the longest prefix of the request, in blocks,
    /// among those that can export it: where a fetch would come from.
    fn fetch_source<'e>(
        &self,
        holders: impl Iterator<Item = (&'e Arc<Entry>, &'e index::CachedPrefix)>,
    ) -> Option<(&'e Arc<Entry>, &'e index::CachedPrefix)> {
        self.fetch.as_ref()?;
        holders
            .filter(|(e, p)| p.blocks() > 0 && e.worker.is_alive() && e.worker.fetches_prefixes())
            .max_by_key(|(_, p)| p.blocks())
    }

    /// `own` (worker `e` as it is) with the source's longer prefix fetched instead,
    /// and the fetch, if that is predicted to give the first token sooner.
    fn fetched<'c>(
        &self,
        ask: &Ask<'_>,
        e: &Arc<Entry>,
        own: &Candidate<'c>,
        source: Option<(&Arc<Entry>, &index::CachedPrefix)>,
    ) -> Option<(Fetch, Candidate<'c>)> {
        let (from, prefix) = source?;
        let pace = self.fetch.as_ref()?;
        let tokens = prefix.blocks() * BLOCK_SIZE;
        let reachable = e.worker.fetches_prefixes() && e.worker.kv_target(self.via).is_some();
        if from.id == e.id || tokens <= own.cached_tokens || !reachable {
            return None;
        }
        // Only what `e` lacks moves: the prefix it caches stays.
        let keep = own.cached_tokens;
        let seconds = pace.predict(from.restore.seconds(prefix), tokens - keep);
        let c = Candidate { cached_tokens: tokens, restore_seconds: own.restore_seconds + seconds, ..own.clone() };
        let sooner = policies::kv_aware::predicted_ttft(ask, &c) < policies::kv_aware::predicted_ttft(ask, own);
        sooner.then(|| (Fetch { from: from.clone(), tokens, keep, seconds }, c))
    }

    /// Prompt tokens of `ask` cached on `e`, as indexed.
    fn cached_on(&self, ask: &Ask<'_>, e: &Entry) -> usize {
        self.index.prefix_blocks(ask.block_hashes, &[e.name()])[0] * BLOCK_SIZE
    }

    /// The predicted cache hit of `ask` prefilled on `e` with `cached` prompt tokens
    /// found there, to check when it ends.
    fn predict_hit(&self, ask: &Ask<'_>, e: &Entry, cached: usize) -> PredictedHit {
        let blocks = (cached / BLOCK_SIZE).min(ask.block_hashes.len());
        let hashes = &ask.block_hashes[..blocks];
        PredictedHit::new(self.index.clone(), e.name(), hashes, BLOCK_SIZE, self.telemetry.clone())
    }

    /// Worker `name`, where it can prefill for `d`: a usable prefill or mixed worker
    /// other than `d`.
    fn pinned(all: &[Arc<Entry>], d: &Entry, name: &str) -> Option<Arc<Entry>> {
        Self::with_role(all, &[Role::Prefill, Role::Mixed], Some(d)).into_iter().find(|e| e.name() == name)
    }

    /// The prefill worker for a request decoding on `d`, or `None` to prefill there;
    /// with it, in disaggregated mode, the fetch of a prefix a peer (a decode
    /// worker holding an earlier turn's answer) caches, where that is sooner.
    fn remote_prefill(
        &self,
        all: &[Arc<Entry>],
        (d, d_fetch): (&Entry, Option<&Fetch>),
        ask: &Ask<'_>,
    ) -> Option<(Arc<Entry>, Option<Fetch>)> {
        let no_fetch = |p: Option<Arc<Entry>>| p.map(|p| (p, None));
        match self.mode {
            Mode::Aggregated => None,
            Mode::Disaggregated => {
                let others = Self::with_role(all, &[Role::Decode, Role::Mixed], None);
                self.pick_where(ask, &Self::with_role(all, &[Role::Prefill], None), |_| true, Some(&others))
            }
            Mode::Auto => {
                let n = ask.prompt_len;
                let paces = Paces::of(&Self::with_role(all, &[Role::Prefill, Role::Mixed], None));
                // Only the part of the prompt a worker's cache lacks is computed there.
                let cost = |e: &Entry, cached: usize| {
                    let todo = n - cached.min(n);
                    paces.predict(e, todo) + interference(e, todo as f64 * paces.per_token(e))
                };
                // `d` computes what is left once it fetched the prefix it was
                // picked with, if any.
                let local = match d_fetch {
                    Some(f) => f.seconds + cost(d, f.tokens),
                    None => cost(d, self.cached_on(ask, d)),
                };
                let remote = |e: &Entry| {
                    let compute = n as f64 * paces.per_token(e);
                    cost(e, self.cached_on(ask, e)) + self.transfer.predict(n, e.link_to(d), compute)
                };
                if d.role() == Role::Decode {
                    // A worker given the decode role prefills only a short prompt
                    // (one step's worth: its sequences wait one step) while the
                    // prefill worker is backed up, and only where that is clearly
                    // sooner with the delay to its own decodes counted: a short
                    // prompt behind a long one, not the interference the split
                    // removes.
                    let p = self.pick(ask, &Self::with_role(all, &[Role::Prefill, Role::Mixed], Some(d)))?;
                    let short = n - self.cached_on(ask, d).min(n) <= DECODER_PREFILL_TOKENS;
                    let backed_up = p.slots.available_permits() == 0 || p.prefill.queued() > 0;
                    let stay = short && backed_up && cost::decoder_prefills(local, remote(&p));
                    tracing::debug!(decode = d.name(), peer = p.name(), local = stay, "decoder's prefill placed");
                    return no_fetch((!stay).then_some(p));
                }
                // Only a worker that can start now: a prompt queued there would reach
                // `d` behind prompts that arrived after it (which went straight to
                // `d`'s own queue), and find `d`'s blocks taken.
                // Each candidate is costed once (the cost reads the KV index).
                let (best_s, best) = Self::with_role(all, &[Role::Prefill, Role::Mixed], Some(d))
                    .into_iter()
                    .filter(|e| e.slots.available_permits() > 0)
                    .map(|e| (remote(&e), e))
                    .min_by(|a, b| a.0.total_cmp(&b.0))?;
                let go = cost::prefer_remote(local, best_s);
                tracing::debug!(
                    decode = d.name(),
                    local_s = local,
                    remote_s = best_s,
                    peer = best.name(),
                    remote = go,
                    "prefill placed"
                );
                no_fetch(go.then_some(best))
            }
        }
    }

    /// Refuses a request predicted to start later than the admission limit: behind
    /// `queued_s` seconds of prompts on its prefill worker, behind the backlog of
    /// decode worker `d`, or until `d` has free the KV blocks its waiting requests and
    /// this prompt need, whichever is longest; or, under SLO admission, one whose
    /// first token, `own_s` of prefill after that, is predicted past the objective;
    /// or, under TPOT admission, one with which `d`'s decode step would be.
    /// The prediction is scaled by how late first tokens came against it lately
    /// ([`cost::Backlog::correction`]). Admitted, the raw prediction is returned.
    /// A request moving mid-stream (`moved`) was admitted when it came: it is never
    /// refused.
    fn admit(&self, d: &Entry, (queued_s, own_s): (f64, f64), life: usize, moved: bool) -> Result<f64, ServeError> {
        let need = d.backlog.pending_blocks() + cost::blocks_for(life);
        let raw = queued_s.max(d.backlog.predict()).max(d.kv.wait_for(need));
        if moved {
            return Ok(raw);
        }
        let correction = d.backlog.correction();
        let (wait, first) = (raw * correction, (raw + own_s) * correction);
        if let Some(limit) = self.max_queue.filter(|l| wait > l.as_secs_f64()) {
            tracing::debug!(
                worker = d.name(),
                queued_s,
                backlog_s = d.backlog.predict(),
                blocks_s = d.kv.wait_for(need),
                need,
                correction,
                "refused: the wait is over the admission limit"
            );
            let retry_s = self.retry_after(wait - limit.as_secs_f64(), wait);
            let wait_s = wait.min(1e6).ceil() as u64;
            return Err(ServeError::QueueFull { wait_s, limit_s: limit.as_secs(), retry_s });
        }
        if let Some(slo) = self.slo_ttft.filter(|s| first > s.as_secs_f64()) {
            let retry_s = self.retry_after(first - slo.as_secs_f64(), first);
            let (predicted_ms, slo_ms) = ((first.min(1e6) * 1e3) as u64, slo.as_millis() as u64);
            return Err(ServeError::SloInfeasible { predicted_ms, slo_ms, retry_s });
        }
        let tpot = self.slo_tpot.and_then(|s| Some((s, d.predict_step(life)?)));
        if let Some((slo, step)) = tpot.filter(|(s, t)| *t > s.as_secs_f64()) {
            // A batch shrinks as its sequences finish: a second, spread, is a fair wait.
            let retry_s = self.retry_after(1.0, 1.5);
            let (predicted_ms, slo_ms) = ((step.min(1e6) * 1e3).ceil() as u64, slo.as_millis() as u64);
            return Err(ServeError::TpotInfeasible { predicted_ms, slo_ms, retry_s });
        }
        Ok(raw)
    }

    /// Predicted seconds of the request's own prefill on `e` with `cached` prompt
    /// tokens found there, which SLO admission adds to the wait; 0 without it.
    fn own_prefill(&self, ask: &Ask<'_>, e: &Entry, cached: usize) -> f64 {
        match self.slo_ttft {
            Some(_) => e.prefill.compute(ask.prompt_len - cached.min(ask.prompt_len)),
            None => 0.0,
        }
    }

    /// Seconds a refused client should wait ([`cost::retry_after`]), the refusals'
    /// order spreading a burst of them.
    fn retry_after(&self, excess_s: f64, wait_s: f64) -> u64 {
        cost::retry_after(excess_s, wait_s, self.refusals.fetch_add(1, Ordering::Relaxed))
    }

    /// Prefill and decode on worker `d`, `cached` prompt tokens predicted found in
    /// its cache (or fetched first, with `fetch`). The first token is watched so
    /// `d`'s prompt queue and prefill rate stay measured (admission and `auto` read
    /// them): both count the tokens it computes.
    fn local(
        &self,
        d: &Arc<Entry>,
        mut req: GenerateRequest,
        end: Ending,
        (predicted, cached): (f64, usize),
        fetch: Option<Fetch>,
    ) -> Result<TokenStream, ServeError> {
        req.fence = Some(d.epoch());
        let (client, stream) = TokenStream::channel(req.params.max_tokens as usize + 4);
        let (inner_tx, inner) = TokenStream::channel(req.params.max_tokens as usize + 4);
        let (load, n) = (d.prefill.clone(), req.prompt.len());
        let todo = n - cached.min(n);
        let ahead = load.ahead();
        let ticket = load.admit(todo);
        let waiting = d.backlog.enter(n, n + req.params.max_tokens as usize).predicted(predicted);
        match (fetch, self.fetch.clone()) {
            (Some(f), Some(pace)) => {
                let ctx = FetchCtx { via: self.via, pace, telemetry: self.telemetry.clone() };
                self.runtime.spawn(fetch::run(f, d.clone(), req, inner_tx, ctx));
            }
            _ => d.worker.generate(req, inner_tx).map_err(|e| d.noted(e))?,
        }
        let started = Instant::now();
        let holder = end.holder();
        let on_first = move |first: &Event| {
            if matches!(first, Event::Token(_)) {
                load.observe(ahead, todo, started.elapsed());
                holder.keep(waiting.started());
            }
            drop(ticket);
        };
        relay::relay(&self.runtime, inner, client, self.deadlines.client_stall, on_first, move |out, cached| {
            end.ended(out, cached)
        });
        Ok(stream)
    }

    fn handoff(
        &self,
        all: &[Arc<Entry>],
        (p, fetch): (Arc<Entry>, Option<Fetch>),
        d: Arc<Entry>,
        ask: &Ask<'_>,
        cached: usize,
    ) -> Handoff {
        // In disaggregated mode a second prefill worker stands by; in auto the
        // decode worker itself is the fallback.
        let spare = match self.mode {
            Mode::Disaggregated => self.pick(ask, &Self::with_role(all, &[Role::Prefill], Some(&p))),
            _ => None,
        };
        // In auto a mixed worker out of blocks is not waited for: its own queue is
        // where the request would end up anyway, and joining it now keeps arrival
        // order (and frees the prefill slot for a handoff that can land). A worker
        // the planner made a decoder is waited for as in disaggregated mode: a long
        // prompt prefilled there would stall every sequence it decodes.
        let reserve = match self.mode {
            Mode::Auto if d.role() != Role::Decode => self.deadlines.reserve.min(AUTO_RESERVE),
            _ => self.deadlines.reserve,
        };
        Handoff {
            prefill: p,
            decode: d,
            spare,
            via: self.via,
            transfer: self.transfer.clone(),
            deadlines: Deadlines { reserve, ..self.deadlines },
            telemetry: self.telemetry.clone(),
            fetch: fetch.zip(self.fetch.clone()),
            cached,
        }
    }
}

/// What a routed request settles when it ends: the KV blocks it gives back on its
/// decode worker, and the cache hit predicted where it is prefilled.
pub struct Ending {
    kv: Arc<KvMemory>,
    prompt: usize,
    hit: Option<PredictedHit>,
    /// The prompt blocks it holds on its decode worker, counted by admission as
    /// taken until the request ends (or a block count shows them).
    held: cost::HeldSlot,
}

impl Ending {
    /// The prefill moved to a worker the prediction was not made for.
    pub(crate) fn unpredicted(self) -> Self {
        Ending { hit: None, ..self }
    }

    /// Where the request's held blocks go once its first token is out.
    pub(crate) fn holder(&self) -> cost::HeldSlot {
        self.held.clone()
    }

    /// Over after `out` output tokens; `cached` prompt tokens were reused if it finished.
    pub(crate) fn ended(self, out: usize, cached: Option<usize>) {
        self.held.release();
        self.kv.finished(self.prompt + out);
        if let (Some(hit), Some(cached)) = (self.hit, cached) {
            hit.check(cached);
        }
    }
}

/// The mean of `values`, if there are any.
fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// What a prefill computing for `compute_s` on worker `e` costs the sequences
/// decoding there: each waits it out (chunked prefill shares their steps).
fn interference(e: &Entry, compute_s: f64) -> f64 {
    policies::kv_aware::decode_delay(e.role(), e.worker.load(), compute_s)
}

/// Prefill paces for comparing workers: a worker not timed yet is taken to be as
/// fast as its timed peers, since the fixed prior would make it look faster or
/// slower than it is (a slow machine's untimed worker looked idle and quick).
struct Paces {
    per_token: Option<f64>,
    fixed: Option<f64>,
}

impl Paces {
    fn of(entries: &[Arc<Entry>]) -> Self {
        Paces {
            per_token: mean(entries.iter().filter_map(|e| e.prefill.measured())),
            fixed: mean(entries.iter().filter_map(|e| e.prefill.fixed_measured())),
        }
    }

    fn per_token(&self, e: &Entry) -> f64 {
        e.prefill.measured().or(self.per_token).unwrap_or_else(|| e.prefill.seconds_per_token())
    }

    fn fixed(&self, e: &Entry) -> f64 {
        e.prefill.fixed_measured().or(self.fixed).unwrap_or(0.0)
    }

    /// Predicted seconds until a prompt computing `tokens` sent to `e` now has its
    /// first token.
    fn predict(&self, e: &Entry, tokens: usize) -> f64 {
        e.prefill.predict_at(tokens, (self.fixed(e), self.per_token(e)))
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
    /// Routes `req`; with `prefill_on`, its prompt is prefilled on that worker
    /// wherever it can prefill (a moved request: its KV is cached there).
    pub(crate) fn route(&self, req: GenerateRequest, prefill_on: Option<&str>) -> Result<TokenStream, ServeError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ServeError::ShuttingDown);
        }
        let mut hashes = pdserve_kv::block_hashes(&req.prompt, BLOCK_SIZE, BLOCK_SALT);
        // An engine leaves at least one prompt token to compute (for the logits), and
        // scores a prompt in full when asked for its logprobs.
        let cacheable = match req.params.prompt_logprobs {
            Some(_) => 0,
            None => req.prompt.len().saturating_sub(1) / BLOCK_SIZE,
        };
        hashes.truncate(cacheable);
        let ask = Ask { prompt_len: req.prompt.len(), block_hashes: &hashes };
        let all = self.workers.snapshot();
        let decoders = Self::with_role(&all, &[Role::Decode, Role::Mixed], None);
        let (d, fetch) = self
            .pick_decoder(&ask, &decoders)
            .ok_or_else(|| ServeError::NoWorker("no live decode or mixed worker".into()))?;
        let span = tracing::Span::current();
        span.record("decode", d.name());
        req.trace.update(|t| t.decode = Some(d.name().to_string()));
        // Blocks the request holds at its longest: prompt and every output token.
        let life = req.prompt.len() + req.params.max_tokens as usize;
        let pinned = prefill_on.and_then(|name| Self::pinned(&all, &d, name)).map(|p| (p, None));
        match pinned.or_else(|| self.remote_prefill(&all, (&d, fetch.as_ref()), &ask)) {
            None => {
                let cached = fetch.as_ref().map_or_else(|| self.cached_on(&ask, &d), |f| f.tokens);
                let queued = d.prefill.queued_seconds();
                let own = self.own_prefill(&ask, &d, cached);
                let predicted = self.admit(&d, (queued, own), life, prefill_on.is_some())?;
                span.record("route", "local");
                req.trace.update(|t| t.route = Some(PrefillRoute::Local));
                self.telemetry.route(PrefillRoute::Local);
                let hit = Some(self.predict_hit(&ask, &d, cached));
                let end = Ending { kv: d.kv.clone(), prompt: req.prompt.len(), hit, held: Default::default() };
                self.local(&d, req, end, (predicted, cached), fetch)
            }
            Some((p, p_fetch)) => {
                let cached = p_fetch.as_ref().map_or_else(|| self.cached_on(&ask, &p), |f| f.tokens);
                let queued = p.prefill.queued_seconds();
                let own = self.own_prefill(&ask, &p, cached);
                let predicted = self.admit(&d, (queued, own), life, prefill_on.is_some())?;
                span.record("route", "remote");
                span.record("prefill", p.name());
                req.trace.update(|t| (t.route, t.prefill) = (Some(PrefillRoute::Remote), Some(p.name().to_string())));
                self.telemetry.route(PrefillRoute::Remote);
                let hit = Some(self.predict_hit(&ask, &p, cached));
                let end = Ending { kv: d.kv.clone(), prompt: req.prompt.len(), hit, held: Default::default() };
                let waiting = d.backlog.enter_routed(req.prompt.len(), life).predicted(predicted);
                let h = self.handoff(&all, (p, p_fetch), d, &ask, cached);
                Ok(handoff::start(&self.runtime, h, req, waiting, end))
            }
        }
    }

    fn ready_now(&self) -> bool {
        !self.draining.load(Ordering::SeqCst)
            && !Self::with_role(&self.workers.snapshot(), &[Role::Decode, Role::Mixed], None).is_empty()
    }
}
