//! The `auto` mode's cost model: predicted time to first token of prefilling a prompt
//! on the decode worker itself versus on another worker with a KV handoff, from
//! figures measured live per worker:
//!
//! - queue: prompt tokens the router has sent a worker that it has not finished
//!   prefilling yet;
//! - compute: seconds per prompt token, an moving average over finished prefills;
//! - transfer: the handoff's extra cost, seconds per prompt token (KV bytes over the
//!   link rate, measured as the time between the prefill side finishing and the
//!   decode side holding every frame) plus a fixed per-handoff cost. Where the fleet's
//!   link probe measured the link between the two workers, the router also works out
//!   what that link costs — its round trip, plus the time the prompt's KV bytes need
//!   on the wire beyond the prefill compute they stream under — and takes the larger
//!   figure, so a slow link steers handoffs to faster pairs before any is measured.
//!
//! To the time to first token the router adds what a prefill costs the sequences
//! decoding on the same worker (they wait out its compute), so a decode worker busy
//! decoding hands long prompts to an idle prefill worker, while workers that all
//! decode (mixed) keep prompts local unless one is backed up. A prompt goes remote
//! only when that is predicted clearly cheaper, so ties keep the copy-free local
//! path.

use crate::index::CachedPrefix;
use crate::snapshot::{
    BacklogView, KvView, PrefillView, QueueView, Restore, TransferView, FREED_WINDOW, PRIOR_SECONDS_PER_TOKEN,
};
pub use crate::snapshot::{Link, Queue};
use pdserve_kv::{Tier, TierCounters};
use pdserve_types::lock;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Computed tokens per prefill from which a prefill's time measures the per-token
/// pace rather than the fixed cost (four KV blocks).
const PACE_FROM_TOKENS: usize = 64;
/// Weight of the newest measurement in the moving averages.
const ALPHA: f64 = 0.2;
/// Remote must win by this fraction to be chosen.
const MARGIN: f64 = 0.15;
/// Tokens per KV block.
const BLOCK_TOKENS: usize = 16;
/// Predictions shorter than this are not used to calibrate admission: a small
/// queue's relative error is noise.
const CALIBRATED_FROM: f64 = 2.0;
/// First-token misses kept per decode worker for the calibration, and how many it
/// needs before it corrects anything.
const MISSES_KEPT: usize = 64;
const MISSES_NEEDED: usize = 8;

/// KV blocks a sequence of `tokens` tokens holds.
pub fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_TOKENS)
}

/// What the router knows about one worker's prefill side: the prompts it sent there
/// that have not had their first token ([`Drain`]), and the fixed cost and
/// per-token pace of a prefill there ([`Pace`]).
#[derive(Debug, Default)]
pub struct PrefillLoad {
    queue: Mutex<Drain>,
    pace: Mutex<Pace>,
}

impl PrefillLoad {
    /// Counts a prefill computing `tokens` as queued here until the returned ticket
    /// is dropped.
    pub fn admit(self: &Arc<Self>, tokens: usize) -> Ticket {
        lock(&self.queue).add(tokens);
        Ticket { load: self.clone(), tokens }
    }

    /// What placement reads of this worker's prefill side, now.
    pub fn view(&self) -> PrefillView {
        let pace = *lock(&self.pace);
        PrefillView { queue: lock(&self.queue).view(), per_token: pace.per_token, fixed: pace.fixed }
    }

    /// Prompt tokens queued here and not computed yet, as far as the time since the
    /// worker started on them tells.
    pub fn queued(&self) -> usize {
        self.view().queued()
    }

    /// The prefills a prompt admitted now would wait behind: those queued, less the
    /// tokens the time the worker has spent on them computed at its pace.
    pub fn ahead(&self) -> Queue {
        self.view().ahead()
    }

    /// The marginal cost of one more prompt token.
    pub fn seconds_per_token(&self) -> f64 {
        self.measured().unwrap_or(PRIOR_SECONDS_PER_TOKEN)
    }

    /// The per-token prefill pace measured here, if any long enough prompt was
    /// timed yet.
    pub fn measured(&self) -> Option<f64> {
        lock(&self.pace).per_token
    }

    /// What every prefill costs here whatever its length (0 until one short
    /// enough to tell was timed).
    pub fn fixed_seconds(&self) -> f64 {
        self.fixed_measured().unwrap_or(0.0)
    }

    /// The fixed cost measured here, if any short enough prompt was timed yet.
    pub fn fixed_measured(&self) -> Option<f64> {
        lock(&self.pace).fixed
    }

    /// A prefill of `tokens` that found `ahead` queued before it finished after
    /// `took`: the worker spent `took` on those prefills and this one at most.
    pub fn observe(&self, ahead: Queue, tokens: usize, took: Duration) {
        lock(&self.pace).observe(ahead, tokens, took.as_secs_f64(), Rise::Gently);
    }

    /// The worker's stats say `tokens` prompt tokens wait there to be computed.
    pub fn report_pending(&self, tokens: usize) {
        lock(&self.queue).reported = Some((Instant::now(), tokens));
    }

    /// Takes a pace measured elsewhere (a frontend's, for a fleet planner that routes
    /// nothing itself).
    pub fn adopt(&self, seconds_per_token: f64) {
        if seconds_per_token.is_finite() && seconds_per_token > 0.0 {
            ewma(&mut lock(&self.pace).per_token, seconds_per_token);
        }
    }

    /// Predicted seconds of one prefill computing `tokens`, once it runs.
    pub fn compute(&self, tokens: usize) -> f64 {
        self.view().compute(tokens)
    }

    /// Predicted seconds until the prefills queued here are done.
    pub fn queued_seconds(&self) -> f64 {
        self.view().queued_seconds()
    }

    /// Predicted seconds until a prompt computing `tokens` sent now has its first
    /// token.
    pub fn predict(&self, tokens: usize) -> f64 {
        self.view().predict(tokens)
    }

    /// [`PrefillLoad::queued_seconds`] at a pace given as `(fixed_seconds,
    /// seconds_per_token)` (a worker not timed yet is taken to be as fast as its
    /// peers).
    pub fn queued_seconds_at(&self, at: (f64, f64)) -> f64 {
        lock(&self.queue).view().seconds(at)
    }
}

/// How the per-token pace takes a measurement above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rise {
    /// As any other: a moving average.
    Gently,
    /// At once: admission that admits too much costs every accepted request its
    /// deadline, refusing a little too much costs a few retries.
    AtOnce,
}

/// A fixed cost per prefill plus a pace per computed token. The two are told apart
/// by the prefill's size: one that computed at least [`PACE_FROM_TOKENS`] tokens
/// (per prefill, the queue it waited behind included) times the pace, its fixed
/// cost taken off; a shorter one times the fixed cost, its tokens taken off at the
/// pace. A single per-token figure learned from prefills that hit their cache and
/// computed a dozen tokens would carry their fixed cost into every token of a long
/// prompt (a warm-up request made one 3,000-token prompt look like a minute).
#[derive(Debug, Default, Clone, Copy)]
struct Pace {
    per_token: Option<f64>,
    fixed: Option<f64>,
}

impl Pace {
    /// `(fixed, per token)`, the prior standing in for what was not measured.
    fn at(&self) -> (f64, f64) {
        (self.fixed.unwrap_or(0.0), self.per_token.unwrap_or(PRIOR_SECONDS_PER_TOKEN))
    }

    /// `tokens` that found `ahead` queued before them were done after `took` seconds.
    fn observe(&mut self, ahead: Queue, tokens: usize, took: f64, rise: Rise) {
        let (fixed, per_token) = self.at();
        let (n, t) = (ahead.prefills + 1, ahead.tokens + tokens);
        if t >= PACE_FROM_TOKENS * n {
            let rate = (took - n as f64 * fixed).max(0.0) / t as f64;
            match self.per_token {
                Some(old) if rise == Rise::AtOnce && rate > old => self.per_token = Some(rate),
                _ => ewma(&mut self.per_token, rate),
            }
        } else {
            ewma(&mut self.fixed, (took - t as f64 * per_token).max(0.0) / n as f64);
        }
    }
}

/// Work queued on one worker, served in order as time passes: what a new arrival
/// finds is what was queued less what the worker has done since it started on it.
/// Without the time served, a long prompt counted in full until its last token
/// was computed, and everyone arriving meanwhile was refused for a wait that had
/// mostly passed. Where the worker reports the prompt tokens it has not computed
/// (its stats, every second), the queue is at least what that report leaves now: a
/// pace guessed too fast would otherwise count a long prompt done while it runs.
#[derive(Debug, Default)]
struct Drain {
    queue: Queue,
    /// Since when the worker has been working on the queue, less the time the
    /// entries that left took of it.
    busy_since: Option<Instant>,
    /// The worker's own count of prompt tokens not computed yet, and when.
    reported: Option<(Instant, usize)>,
}

impl Drain {
    fn add(&mut self, tokens: usize) {
        if self.queue.prefills == 0 {
            self.busy_since = Some(Instant::now());
        }
        self.queue.tokens += tokens;
        self.queue.prefills += 1;
    }

    /// An entry of `tokens` left (done or abandoned), having cost at most `cost_s`
    /// of the time served.
    fn remove(&mut self, tokens: usize, cost_s: f64) {
        self.queue.tokens = self.queue.tokens.saturating_sub(tokens);
        self.queue.prefills = self.queue.prefills.saturating_sub(1);
        match (self.queue.prefills, self.busy_since.as_mut()) {
            (0, _) => self.busy_since = None,
            (_, Some(since)) => *since += since.elapsed().min(Duration::from_secs_f64(cost_s.clamp(0.0, 1e6))),
            (_, None) => {}
        }
    }

    /// Seconds spent on the queue as it is.
    fn served(&self) -> f64 {
        self.busy_since.map_or(0.0, |s| s.elapsed().as_secs_f64())
    }

    /// The queue as it stands now, in plain numbers.
    fn view(&self) -> QueueView {
        QueueView {
            queue: self.queue,
            served_s: self.served(),
            reported: self.reported.map(|(at, tokens)| (at.elapsed().as_secs_f64(), tokens)),
        }
    }
}

/// A prompt counted in a worker's queue; dropping it (prefill done or abandoned)
/// takes it out.
pub struct Ticket {
    load: Arc<PrefillLoad>,
    tokens: usize,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let cost = self.load.compute(self.tokens);
        lock(&self.load.queue).remove(self.tokens, cost);
    }
}

/// A decode worker's requests that have not had their first token yet, and how long
/// requests took to get it for the backlog they found: admission's second signal.
/// A prefill queue sees compute only; this sees whatever holds requests back
/// (prefill, KV blocks freed only as other sequences finish, transfers, a queue
/// served out of order), measured on real first tokens rather than modelled.
#[derive(Debug, Default)]
pub struct Backlog {
    /// The requests waiting, by prompt tokens.
    pending: Mutex<Drain>,
    /// KV blocks the waiting requests still need on the worker over their life
    /// (prompt and output; a handoff's reservation, once granted, holds the prompt's
    /// already).
    pending_blocks: AtomicUsize,
    /// Prompt blocks requests hold that the worker's last free count did not show.
    taken: Mutex<Taken>,
    /// Requests handed off toward this worker that have not reached it yet (their
    /// prefill runs elsewhere): load the worker cannot report, so the policies add it.
    routed: AtomicUsize,
    /// Time to first token for the prompts waiting at arrival (the request's own
    /// included), as a fixed cost per request and a pace per token; the pace rises
    /// at once.
    pace: Mutex<Pace>,
    /// Measured over predicted time to first token of the latest requests that
    /// were predicted to wait (see [`Backlog::correction`]).
    misses: Mutex<VecDeque<f64>>,
}

impl Backlog {
    /// Counts a request of `tokens` prompt tokens, which may grow to `life` tokens,
    /// as waiting until the guard goes.
    pub fn enter(self: &Arc<Self>, tokens: usize, life: usize) -> Waiting {
        let at = lock(&self.pace).at();
        let ahead = {
            let mut pending = lock(&self.pending);
            let ahead = pending.view().left(at);
            pending.add(tokens);
            ahead
        };
        let blocks = blocks_for(life.max(tokens));
        self.pending_blocks.fetch_add(blocks, Ordering::Relaxed);
        Waiting {
            backlog: self.clone(),
            tokens,
            blocks,
            ahead,
            since: Instant::now(),
            routed: false,
            predicted: None,
            held: None,
        }
    }

    /// What admission's raw prediction is to be multiplied by: the 95th percentile
    /// of measured over predicted first-token times of the latest requests predicted
    /// to wait at least [`CALIBRATED_FROM`], within 0.5..4; 1 before 8 of them
    /// started. The prediction's terms each model one cause of waiting, and their
    /// error changes with the load (a queue of long prompts behind a full KV pool is
    /// slower than its parts). Scaling by the error measured on real first tokens
    /// keeps accepted requests within the admission limit whatever the model misses,
    /// without feeding back on itself: the ratio is to the raw prediction.
    pub fn correction(&self) -> f64 {
        let misses = lock(&self.misses);
        if misses.len() < MISSES_NEEDED {
            return 1.0;
        }
        let mut sorted: Vec<f64> = misses.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        sorted[(sorted.len() * 95 / 100).min(sorted.len() - 1)].clamp(0.5, 4.0)
    }

    /// [`Backlog::enter`] for a request prefilled elsewhere: also counted as routed
    /// here until its first token.
    pub fn enter_routed(self: &Arc<Self>, tokens: usize, life: usize) -> Waiting {
        let mut w = self.enter(tokens, life);
        self.routed.fetch_add(1, Ordering::Relaxed);
        w.routed = true;
        w
    }

    /// Requests routed here and still prefilling elsewhere.
    pub fn routed(&self) -> usize {
        self.routed.load(Ordering::Relaxed)
    }

    /// KV blocks the waiting requests still need, and those taken that the worker's
    /// last free count does not show.
    pub fn pending_blocks(&self) -> usize {
        self.pending_blocks.load(Ordering::Relaxed) + lock(&self.taken).total()
    }

    /// Call before asking for the worker's free count; pass the mark to
    /// [`Backlog::counted`] once that count arrives.
    pub fn taken_mark(&self) -> u64 {
        lock(&self.taken).mark()
    }

    /// A free count asked for at `mark` arrived: it shows the blocks taken before.
    pub fn counted(&self, mark: u64) {
        lock(&self.taken).counted(mark);
    }

    fn take(self: &Arc<Self>, blocks: usize) -> Held {
        let epoch = lock(&self.taken).take(blocks);
        Held { backlog: self.clone(), epoch, blocks }
    }

    /// Seconds a request arriving now waits for those ahead of it to start: what is
    /// left of them, less the time already spent on them. Until measured, the
    /// prefill prior stands in for the pace.
    pub fn predict(&self) -> f64 {
        let at = lock(&self.pace).at();
        lock(&self.pending).view().seconds(at)
    }

    /// What admission reads of this backlog, now.
    pub fn view(&self) -> BacklogView {
        BacklogView { wait_s: self.predict(), pending_blocks: self.pending_blocks(), correction: self.correction() }
    }

    /// Predicted seconds of a request of `tokens` once those ahead have started.
    fn cost(&self, tokens: usize) -> f64 {
        let (fixed, per_token) = lock(&self.pace).at();
        fixed + tokens as f64 * per_token
    }
}

/// A request in a [`Backlog`]; dropped without [`Waiting::started`], it failed or
/// left before its first token.
pub struct Waiting {
    backlog: Arc<Backlog>,
    tokens: usize,
    /// Blocks it still counts as needed.
    blocks: usize,
    /// What was waiting when it arrived.
    ahead: Queue,
    since: Instant,
    /// Counted in [`Backlog::routed`].
    routed: bool,
    /// Admission's raw prediction of its time to first token.
    predicted: Option<f64>,
    /// Its prompt's blocks, counted as taken by [`Waiting::holds_blocks`].
    held: Option<Held>,
}

impl Waiting {
    /// Admission predicted its first token `seconds` from now (before correction).
    pub fn predicted(mut self, seconds: f64) -> Self {
        self.predicted = Some(seconds);
        self
    }

    /// Its prompt's blocks are reserved on the worker: taken, no longer needed.
    pub fn holds_blocks(&mut self) {
        let held = blocks_for(self.tokens).min(self.blocks);
        self.blocks -= held;
        self.backlog.pending_blocks.fetch_sub(held, Ordering::Relaxed);
        self.held = Some(self.backlog.take(held));
    }

    /// Its first token is out (its prompt's blocks are held now). The blocks stay
    /// counted as taken while the answer lives, until a free count shows them.
    pub fn started(mut self) -> Held {
        let held = match self.held.take() {
            Some(h) => h,
            None => self.backlog.take(blocks_for(self.tokens).min(self.blocks)),
        };
        let took = self.since.elapsed().as_secs_f64();
        if let Some(p) = self.predicted.filter(|&p| p >= CALIBRATED_FROM) {
            let mut misses = lock(&self.backlog.misses);
            if misses.len() == MISSES_KEPT {
                misses.pop_front();
            }
            misses.push_back(took / p);
        }
        lock(&self.backlog.pace).observe(self.ahead, self.tokens, took, Rise::AtOnce);
        held
    }
}

/// Prompt blocks a started request holds on its worker, counted as taken until a
/// free count shows them or, if the request ends first, until it ends (its blocks
/// are back in the pool then: counting them on would refuse requests for blocks that
/// are free, as back-to-back short requests on a small pool showed).
#[must_use]
pub struct Held {
    backlog: Arc<Backlog>,
    epoch: u64,
    blocks: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        lock(&self.backlog.taken).give_back(self.epoch, self.blocks);
    }
}

/// Where a request's held blocks stay until it ends.
#[derive(Clone, Default)]
pub struct HeldSlot(Arc<Mutex<Option<Held>>>);

impl HeldSlot {
    pub fn keep(&self, held: Held) {
        *lock(&self.0) = Some(held);
    }

    /// The request ended: its blocks are back in the pool.
    pub fn release(&self) {
        lock(&self.0).take();
    }
}

/// Blocks taken, by which free count of the worker will show them: those taken
/// since its last ask, and those of each ask not answered yet.
#[derive(Debug, Default)]
struct Taken {
    epoch: u64,
    current: usize,
    asked: VecDeque<(u64, usize)>,
}

impl Taken {
    fn total(&self) -> usize {
        self.current + self.asked.iter().map(|a| a.1).sum::<usize>()
    }

    /// Counts `n` blocks; the epoch they were counted in.
    fn take(&mut self, n: usize) -> u64 {
        self.current += n;
        self.epoch
    }

    /// The request that took `n` blocks in `epoch` ended; no-op once a count showed them.
    fn give_back(&mut self, epoch: u64, n: usize) {
        if epoch == self.epoch {
            self.current = self.current.saturating_sub(n);
        } else if let Some(b) = self.asked.iter_mut().find(|b| b.0 == epoch) {
            b.1 = b.1.saturating_sub(n);
        }
    }

    /// A count is being asked for: what was taken so far waits for its answer.
    fn mark(&mut self) -> u64 {
        let e = self.epoch;
        self.asked.push_back((e, std::mem::take(&mut self.current)));
        self.epoch += 1;
        e
    }

    /// The count asked at `mark` arrived (and so did any older one's effect).
    fn counted(&mut self, mark: u64) {
        self.asked.retain(|b| b.0 > mark);
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let cost = self.backlog.cost(self.tokens);
        lock(&self.backlog.pending).remove(self.tokens, cost);
        self.backlog.pending_blocks.fetch_sub(self.blocks, Ordering::Relaxed);
        if self.routed {
            self.backlog.routed.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// What admission knows of a decode worker's KV memory: the blocks it could give a
/// new sequence as last reported (free, or held only by its prefix cache, which
/// evicts them on demand), and the pace at which its sequences gave blocks back as
/// they finished.
/// A first-token pace learned while the cache was empty says nothing of a full one;
/// this does.
#[derive(Debug)]
pub struct KvMemory {
    free: Mutex<Option<usize>>,
    /// Blocks freed by sequences that ended within [`FREED_WINDOW`], by end time.
    freed: Mutex<VecDeque<(Instant, usize)>>,
    since: Instant,
}

impl Default for KvMemory {
    fn default() -> Self {
        KvMemory { free: Mutex::default(), freed: Mutex::default(), since: Instant::now() }
    }
}

impl KvMemory {
    /// The worker's free blocks now (its stats, polled).
    pub fn report_free(&self, blocks: usize) {
        *lock(&self.free) = Some(blocks);
    }

    /// A sequence of `tokens` tokens (prompt and output) ended here.
    pub fn finished(&self, tokens: usize) {
        let mut freed = lock(&self.freed);
        freed.push_back((Instant::now(), blocks_for(tokens)));
        prune(&mut freed);
    }

    /// Seconds until `need` blocks are free here: none while they are free now (or
    /// before anything was reported); else the missing blocks at the pace blocks were
    /// freed lately. Until `PACE_FROM` sequences ended within [`FREED_WINDOW`], the
    /// blocks they freed count as spread over the whole window, however recent the
    /// worker: a few requests that ran alone, such as a benchmark's warm-up, would
    /// otherwise promise a pace no full pool keeps, while a pool that is turning over
    /// (a fleet's first seconds under load) still shows the blocks coming back. With
    /// none ended, full and no pace to go by: twice the window.
    pub fn wait_for(&self, need: usize) -> f64 {
        self.view().wait_for(need)
    }

    /// What admission reads of this worker's memory, now.
    pub fn view(&self) -> KvView {
        let mut freed = lock(&self.freed);
        prune(&mut freed);
        KvView {
            free: *lock(&self.free),
            freed_blocks: freed.iter().map(|&(_, b)| b).sum(),
            ended: freed.len(),
            counting_s: self.since.elapsed().as_secs_f64(),
        }
    }
}

fn prune(freed: &mut VecDeque<(Instant, usize)>) {
    while freed.front().is_some_and(|(t, _)| t.elapsed() > FREED_WINDOW) {
        freed.pop_front();
    }
}

/// What copying a cached prefix back from a worker's host or disk tier costs: its
/// own measured seconds per block once it restored any, else a guess.
#[derive(Debug, Default)]
pub struct RestorePace(Mutex<Restore>);

impl RestorePace {
    /// The worker's tier counters (totals since it started).
    pub fn report(&self, c: &TierCounters) {
        let mut pace = lock(&self.0);
        if let Some(s) = c.seconds_per_block(Tier::Host) {
            pace.host = s;
        }
        if let Some(s) = c.seconds_per_block(Tier::Disk) {
            pace.disk = s;
        }
    }

    pub fn view(&self) -> Restore {
        *lock(&self.0)
    }

    /// Seconds to bring `p`'s host and disk blocks back into the pool.
    pub fn seconds(&self, p: &CachedPrefix) -> f64 {
        self.view().seconds(p)
    }
}

/// The extra cost of a handoff, measured on the handoffs made.
#[derive(Debug, Default)]
pub struct TransferCost {
    seconds_per_token: Mutex<Option<f64>>,
    /// KV payload per prompt token, from the handoffs made.
    bytes_per_token: Mutex<Option<f64>>,
}

impl TransferCost {
    pub fn observe(&self, tokens: usize, took: Duration, kv_bytes: u64) {
        if tokens > 0 {
            ewma(&mut lock(&self.seconds_per_token), took.as_secs_f64() / tokens as f64);
            if kv_bytes > 0 {
                ewma(&mut lock(&self.bytes_per_token), kv_bytes as f64 / tokens as f64);
            }
        }
    }

    pub fn view(&self) -> TransferView {
        TransferView {
            seconds_per_token: *lock(&self.seconds_per_token),
            bytes_per_token: *lock(&self.bytes_per_token),
        }
    }

    /// The extra cost of handing off `tokens` prompt tokens whose prefill computes
    /// for `compute_s`, over `link` if it was probed.
    pub fn predict(&self, tokens: usize, link: Option<Link>, compute_s: f64) -> f64 {
        self.view().predict(tokens, link, compute_s, None)
    }
}

/// Whether a remote prefill predicted at `remote` seconds beats `local` seconds.
pub fn prefer_remote(local: f64, remote: f64) -> bool {
    remote < local * (1.0 - MARGIN)
}

/// Whether a decode worker prefills a prompt itself, `local` seconds (its decodes'
/// delay counted), rather than send it to a busy prefill worker, `remote`: only
/// when that is clearly sooner, since the split exists to keep prefills off it.
pub fn decoder_prefills(local: f64, remote: f64) -> bool {
    local < remote * (1.0 - MARGIN)
}

/// Seconds the `n`th refused client should wait before it retries: until the
/// `excess_s` of predicted wait over the limit has drained, spread over up to half
/// as long again so that clients refused in one burst do not all return in the same
/// second, and never past `wait_s`, the whole wait predicted (by then what it
/// waited behind is predicted done).
pub fn retry_after(excess_s: f64, wait_s: f64, n: u64) -> u64 {
    let spread = 1.0 + 0.5 * (n as f64 * 0.618_033_988_75).fract();
    (excess_s * spread).min(wait_s).clamp(1.0, 1e6).ceil() as u64
}

fn ewma(slot: &mut Option<f64>, x: f64) {
    *slot = Some(match *slot {
        None => x,
        Some(old) => old + ALPHA * (x - old),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::HANDOFF_FIXED;

    #[test]
    fn a_probed_slow_link_raises_the_transfer_cost_and_a_fast_one_does_not() {
        let t = TransferCost::default();
        let fast = Link { bytes_per_s: 2e9, round_trip_s: 1e-4 };
        let slow = Link { bytes_per_s: 1e6, round_trip_s: 5e-3 };
        // Nothing learned yet about bytes per token: the link cannot be costed.
        assert_eq!(t.predict(1000, Some(slow), 1.0), t.predict(1000, None, 1.0));
        t.observe(1000, Duration::from_millis(20), 23_040_000);
        let learned = t.predict(1000, None, 1.0);
        assert!((learned - (HANDOFF_FIXED + 0.02)).abs() < 1e-9);
        assert_eq!(t.predict(1000, Some(fast), 1.0), learned);
        // 23 MB at 1 MB/s is 23 s on the wire, 22 of them past a 1 s prefill.
        let over_slow = t.predict(1000, Some(slow), 1.0);
        assert!((over_slow - (HANDOFF_FIXED + 5e-3 + 22.04)).abs() < 1e-6, "{over_slow}");
        // A sender that announced what its tokens take is costed by that: a q8_0
        // cache's 34/64 of f16's bytes spend 12.24 s on the wire.
        let q8 = t.view().predict(1000, Some(slow), 1.0, Some(23_040.0 * 34.0 / 64.0));
        assert!((q8 - (HANDOFF_FIXED + 5e-3 + 11.24)).abs() < 1e-6, "{q8}");
    }

    #[test]
    fn memory_waits_for_missing_blocks_at_the_pace_they_were_freed() {
        let m = KvMemory::default();
        assert_eq!(m.wait_for(500), 0.0, "nothing reported: no opinion");
        m.report_free(100);
        assert_eq!(m.wait_for(100), 0.0, "fits now");
        assert_eq!(m.wait_for(101), 60.0, "full and nothing ended lately: refuse");
        // Fewer than 8 ended: their 120 blocks count as freed over the whole 30 s
        // window (4 a second), not over the first second the worker was up.
        for _ in 0..3 {
            m.finished(640);
        }
        assert!((m.wait_for(101) - 0.25).abs() < 1e-9, "{}", m.wait_for(101));
        assert!((m.wait_for(260) - 40.0).abs() < 1e-9, "{}", m.wait_for(260));
        // 8 sequences of 640 tokens (40 blocks each) ended within the first second:
        // 320 blocks a second; 160 missing blocks are half a second away.
        for _ in 0..5 {
            m.finished(640);
        }
        assert!((m.wait_for(260) - 0.5).abs() < 1e-9, "{}", m.wait_for(260));
    }

    #[test]
    fn a_backlog_counts_the_blocks_its_requests_still_need() {
        let b = Arc::new(Backlog::default());
        let mut w1 = b.enter(100, 132);
        let _w2 = b.enter(16, 16);
        assert_eq!(b.pending_blocks(), 9 + 1);
        let mark = b.taken_mark();
        w1.holds_blocks();
        assert_eq!(b.pending_blocks(), 2 + 7 + 1, "taken, and not yet in a free count");
        b.counted(mark);
        assert_eq!(b.pending_blocks(), 2 + 7 + 1, "that count was asked for before");
        b.counted(b.taken_mark());
        assert_eq!(b.pending_blocks(), 2 + 1, "the output's blocks are still to come");
        drop(w1);
        assert_eq!(b.pending_blocks(), 1);
        let w3 = b.enter_routed(16, 16);
        assert_eq!(b.routed(), 1);
        drop(w3.started());
        assert_eq!(b.routed(), 0);
    }

    #[test]
    fn a_request_that_ends_before_a_block_count_gives_its_blocks_back() {
        let b = Arc::new(Backlog::default());
        // Short requests back to back on a small pool: each ends before the next
        // count, and none may stay counted as holding its blocks.
        for _ in 0..10 {
            let held = b.enter(1024, 1040).started();
            assert_eq!(b.pending_blocks(), 64);
            drop(held);
            assert_eq!(b.pending_blocks(), 0);
        }
        // One still running when a count is asked for: that count shows it, so its
        // end gives nothing back twice.
        let held = b.enter(160, 160).started();
        let mark = b.taken_mark();
        let later = b.enter(32, 32).started();
        assert_eq!(b.pending_blocks(), 12);
        b.counted(mark);
        assert_eq!(b.pending_blocks(), 2);
        drop(held);
        assert_eq!(b.pending_blocks(), 2);
        drop(later);
        assert_eq!(b.pending_blocks(), 0);
    }

    #[test]
    fn admission_is_calibrated_by_how_late_first_tokens_came() {
        let b = Arc::new(Backlog::default());
        assert_eq!(b.correction(), 1.0);
        // Started at once against predictions of 2.5 s: predicted far too long, but
        // only 8 samples move it, and it never goes below half.
        for i in 0..8 {
            assert_eq!(b.correction(), 1.0, "{i} samples");
            drop(b.enter(10, 10).predicted(2.5).started());
        }
        assert_eq!(b.correction(), 0.5);
        // Short predictions say nothing.
        drop(b.enter(10, 10).predicted(0.01).started());
        assert_eq!(lock(&b.misses).len(), 8);
    }

    #[tokio::test(start_paused = true)]
    async fn queue_and_rate_shape_the_prediction() {
        let l = Arc::new(PrefillLoad::default());
        l.observe(Queue::default(), 1000, Duration::from_millis(500));
        assert!((l.predict(100) - 0.05).abs() < 1e-9);
        let t = l.admit(900);
        assert!((l.predict(100) - 0.5).abs() < 1e-9);
        drop(t);
        assert_eq!(l.ahead(), Queue::default());
    }

    #[tokio::test(start_paused = true)]
    async fn short_prefills_time_the_fixed_cost_and_leave_the_pace_alone() {
        let l = Arc::new(PrefillLoad::default());
        l.observe(Queue::default(), 1000, Duration::from_millis(1000));
        // Prompts that hit their cache and computed 12 tokens, 300 ms each: a
        // per-token figure would say 25 ms/token.
        for _ in 0..30 {
            l.observe(Queue::default(), 12, Duration::from_millis(300));
        }
        assert!((l.seconds_per_token() - 1e-3).abs() < 1e-9);
        assert!((l.fixed_seconds() - 0.288).abs() < 1e-3, "{}", l.fixed_seconds());
        // A long prompt costs its tokens at the pace plus one fixed cost.
        assert!((l.predict(1000) - 1.288).abs() < 1e-3, "{}", l.predict(1000));
        // Behind two queued prefills: their tokens and two more fixed costs.
        let _queued = (l.admit(500), l.admit(10));
        assert!((l.predict(1000) - (1.288 + 0.51 + 2.0 * 0.288)).abs() < 1e-3);
        // A long prefill's time is its tokens' once the fixed cost is off.
        let ahead = l.ahead();
        l.observe(ahead, 490, Duration::from_secs_f64(3.0 * 0.288 + 1000.0 * 2e-3));
        assert!((l.seconds_per_token() - 1.2e-3).abs() < 1e-6, "{}", l.seconds_per_token());
    }

    #[tokio::test(start_paused = true)]
    async fn a_backlog_predicts_from_the_pace_of_first_tokens_while_others_wait() {
        let b = Arc::new(Backlog::default());
        let waiting: Vec<Waiting> = (0..4).map(|_| b.enter(100, 100)).collect();
        // Unmeasured: the prior pace.
        assert!((b.predict() - 400.0 * PRIOR_SECONDS_PER_TOKEN).abs() < 1e-9);
        let mut waiting = waiting.into_iter();
        // The first request found none ahead and started after 100 ms: 1 ms/token.
        tokio::time::advance(Duration::from_millis(100)).await;
        drop(waiting.next().unwrap().started());
        let p = b.predict();
        assert!((p - 0.3).abs() < 1e-9, "300 tokens at 1 ms each: {p}");
        // A request that fails leaves the backlog without counting as a start.
        drop(waiting);
        assert_eq!(b.predict(), 0.0);
    }

    #[test]
    fn a_backlog_pace_rises_at_once_and_falls_gently() {
        let b = Arc::new(Backlog::default());
        lock(&b.pace).per_token = Some(1e-4);
        // A request that waited 100 ms behind 100 tokens: 1 ms/token, taken at once.
        let w = b.enter(100, 100);
        std::thread::sleep(Duration::from_millis(100));
        drop(w.started());
        let slow = lock(&b.pace).per_token.unwrap();
        assert!(slow >= 9e-4, "{slow}");
        // One fast start moves it only part of the way back.
        drop(b.enter(1_000_000, 1_000_000).started());
        let eased = lock(&b.pace).per_token.unwrap();
        assert!(eased < slow && eased > 0.5 * slow, "{slow} -> {eased}");
    }

    /// The over-shedding a security probe found: after a warm-up request, one
    /// 3,000-token prompt made every request arriving while it prefilled wait
    /// "57 s" (a short prompt's first-token time spread over its few tokens, charged
    /// for each of the 3,000), and the figure never fell while the prompt ran.
    #[tokio::test(start_paused = true)]
    async fn a_warm_up_request_times_the_fixed_cost_and_a_long_prompt_drains_as_it_runs() {
        let b = Arc::new(Backlog::default());
        let warm_up = b.enter(10, 12);
        tokio::time::advance(Duration::from_millis(200)).await;
        drop(warm_up.started());
        assert_eq!(b.predict(), 0.0);
        let long = b.enter(3000, 3001);
        let at_start = b.predict();
        // The fixed cost once and the prior pace per token, not 20 ms per token.
        assert!((at_start - (0.19 + 3.0)).abs() < 1e-6, "{at_start}");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!((b.predict() - 1.19).abs() < 1e-6, "2 s served: {}", b.predict());
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(b.predict(), 0.0, "past its prediction it is not counted twice");
        drop(long);
        assert_eq!(b.predict(), 0.0);
    }

    /// A pace guessed too fast (the prior, 1 ms a token, for a 3,000-token prompt
    /// that takes 15 s) counts the prompt done after 3 s; the worker's own count of
    /// the tokens it has left keeps it queued.
    #[tokio::test(start_paused = true)]
    async fn the_workers_count_of_tokens_left_holds_a_queue_the_clock_calls_done() {
        let l = Arc::new(PrefillLoad::default());
        let _long = l.admit(3000);
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(l.queued_seconds(), 0.0, "by the clock alone");
        l.report_pending(2200);
        assert!((l.queued_seconds() - 2.2).abs() < 1e-9, "{}", l.queued_seconds());
        assert_eq!(l.ahead(), Queue { tokens: 2200, prefills: 1 });
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!((l.queued_seconds() - 1.7).abs() < 1e-6, "the report ages at the pace: {}", l.queued_seconds());
        // A report of less than the clock leaves changes nothing.
        let fresh = Arc::new(PrefillLoad::default());
        let _queued = fresh.admit(1000);
        fresh.report_pending(10);
        assert!((fresh.queued_seconds() - 1.0).abs() < 1e-9);
    }

    #[tokio::test(start_paused = true)]
    async fn a_prefill_queue_drains_as_the_worker_computes_it() {
        let l = Arc::new(PrefillLoad::default());
        l.observe(Queue::default(), 1000, Duration::from_secs(1));
        let first = l.admit(1000);
        let second = l.admit(500);
        assert!((l.queued_seconds() - 1.5).abs() < 1e-9);
        tokio::time::advance(Duration::from_millis(600)).await;
        assert!((l.queued_seconds() - 0.9).abs() < 1e-6, "{}", l.queued_seconds());
        assert_eq!(l.ahead(), Queue { tokens: 900, prefills: 2 });
        // The first leaves after 1.2 s, having taken 1 s of it: the 0.2 s left were
        // spent on the second.
        tokio::time::advance(Duration::from_millis(600)).await;
        drop(first);
        assert!((l.queued_seconds() - 0.3).abs() < 1e-6, "{}", l.queued_seconds());
        drop(second);
        assert_eq!((l.queued_seconds(), l.ahead()), (0.0, Queue::default()));
        // A queue that emptied starts its clock again with the next prompt.
        let _third = l.admit(100);
        assert!((l.queued_seconds() - 0.1).abs() < 1e-9);
    }

    #[test]
    fn a_decoder_prefills_only_what_is_clearly_sooner_there() {
        // (local, remote) → prefilled on the decoder
        let cases = [((0.05, 15.0), true), ((1.0, 1.1), false), ((1.0, 1.0), false), ((0.8, 1.0), true)];
        for ((local, remote), want) in cases {
            assert_eq!(decoder_prefills(local, remote), want, "{local} {remote}");
        }
    }

    #[test]
    fn retry_after_drains_the_excess_spread_but_never_past_the_whole_wait() {
        // (excess over the limit, whole predicted wait, refusal number) → seconds
        let cases = [
            ((10.0, 40.0, 0), 10),
            ((10.0, 40.0, 1), 14), // 10 × 1.31
            ((27.0, 57.0, 1), 36), // the probe's figures: 27 × 1.31 = 35.3
            ((27.0, 30.0, 1), 30), // bounded by the wait predicted
            ((0.2, 30.2, 0), 1),   // at least a second
            ((f64::INFINITY, f64::INFINITY, 3), 1_000_000),
            ((-1.0, 0.5, 0), 1),
        ];
        for ((excess, wait, n), want) in cases {
            assert_eq!(retry_after(excess, wait, n), want, "{excess} {wait} {n}");
        }
    }

    #[test]
    fn a_busy_decode_worker_sends_long_prompts_away() {
        let (d, p) = (Arc::new(PrefillLoad::default()), PrefillLoad::default());
        let _busy = d.admit(4000);
        let x = TransferCost::default();
        assert!(prefer_remote(d.predict(512), p.predict(512) + x.predict(512, None, 0.0)));
        // Idle on both sides: the local path is cheaper, no handoff.
        drop(_busy);
        assert!(!prefer_remote(d.predict(512), p.predict(512) + x.predict(512, None, 0.0)));
    }
}
