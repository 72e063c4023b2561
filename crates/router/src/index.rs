//! The router's global KV index: for each block hash, the workers whose prefix cache
//! holds it, kept from the workers' own numbered events.
//!
//! Each worker's engine logs the blocks its pool registers and evicts, numbered in
//! order. A task reads every worker's events after the cursor it holds; a worker that
//! cannot continue from that cursor (it restarted, or the router fell further behind
//! than its log reaches) answers with a snapshot, which replaces everything known of
//! it. So the index converges to what each pool holds, and how far behind it is, is
//! measured: each event's age when applied is the index lag.
//!
//! A hash maps to a bit set of worker slots, so the index costs one map entry per
//! distinct block, and a prompt's longest cached prefix on every worker at once is one
//! walk down its hashes. Blocks in a worker's host-RAM or disk tier are kept in a
//! second map (most blocks are only in the pool), and a prefix counts each block in
//! the best tier that holds it: the pool's cost nothing, the others a copy back.

use pdserve_kv::{BlockHash, KvEvent, Tier};
use pdserve_protocol::{KvCursor, KvEvents, Telemetry, Worker};
use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;
use tokio::time::Instant;

/// Workers the index can tell apart; more are routed without their cache known.
pub const MAX_INDEXED: usize = 128;
/// How often every worker is asked for its events while they flow, and when the
/// last round brought none.
pub(crate) const POLL: Duration = Duration::from_millis(20);
pub(crate) const IDLE_POLL: Duration = Duration::from_millis(100);
/// A worker that does not answer in this long is skipped until the next round.
const PATIENCE: Duration = Duration::from_millis(500);

type Slots = u128;

#[derive(Default)]
struct State {
    /// Blocks in the workers' pools.
    blocks: HashMap<BlockHash, Slots>,
    /// Blocks in their host (`[0]`) and disk (`[1]`) tiers.
    lower: HashMap<BlockHash, [Slots; 2]>,
    /// Indexed workers by name: their slot and where their events stand.
    workers: HashMap<String, (usize, KvCursor)>,
    /// When each worker's own pushed events last continued the index: polling skips
    /// those pushed within [`PUSH_TRUST`].
    pushed: HashMap<String, Instant>,
}

/// How long pushed events stand in for polling a worker; a publisher sends at least
/// every half of this, events or not.
pub const PUSH_TRUST: Duration = Duration::from_secs(1);

/// See the module docs.
#[derive(Default)]
pub struct KvIndex {
    state: RwLock<State>,
}

/// The blocks at the start of a prompt that one worker holds, by the best tier each
/// is in (the chain ends at the first block it holds in no tier).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CachedPrefix {
    pub device: usize,
    pub host: usize,
    pub disk: usize,
}

impl CachedPrefix {
    /// Blocks held in any tier: what the engine will not compute.
    pub fn blocks(&self) -> usize {
        self.device + self.host + self.disk
    }
}

/// What one round of reading taught the index, for the metrics.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Applied {
    /// Seconds each applied event had waited since it happened.
    pub lags: Vec<f64>,
    pub resyncs: usize,
}

impl KvIndex {
    /// Distinct block hashes indexed (in pools; the same hash in a lower tier of
    /// some worker is not counted twice).
    pub fn len(&self) -> usize {
        let s = self.read();
        s.blocks.len() + s.lower.keys().filter(|h| !s.blocks.contains_key(h)).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Cached blocks at the start of `hashes` on each named worker (0 for a worker
    /// not indexed), counting every tier.
    pub fn prefix_blocks(&self, hashes: &[BlockHash], workers: &[&str]) -> Vec<usize> {
        self.prefix(hashes, workers).iter().map(CachedPrefix::blocks).collect()
    }

    /// The blocks at the start of `hashes` that each named worker holds, by tier
    /// (nothing for a worker not indexed).
    pub fn prefix(&self, hashes: &[BlockHash], workers: &[&str]) -> Vec<CachedPrefix> {
        let s = self.read();
        let slots: Vec<Option<usize>> = workers.iter().map(|w| s.workers.get(*w).map(|(slot, _)| *slot)).collect();
        let mut alive: Slots = slots.iter().flatten().fold(0, |m, &i| m | 1 << i);
        // Per slot: the blocks held (any tier), and those only in host or disk. Most
        // blocks are in pools alone, so per-worker work happens only where a chain
        // ends or passes through a lower tier.
        let mut length = [hashes.len(); MAX_INDEXED];
        let mut lower = [(0usize, 0usize); MAX_INDEXED];
        for (i, h) in hashes.iter().enumerate() {
            let [device, host, disk] = s.tiers(*h);
            let held = alive & (device | host | disk);
            for_each_bit(alive & !held, |slot| length[slot] = i);
            for_each_bit(held & !device & host, |slot| lower[slot].0 += 1);
            for_each_bit(held & !device & !host, |slot| lower[slot].1 += 1);
            alive = held;
            if alive == 0 {
                break;
            }
        }
        let of = |slot: usize| {
            let (host, disk) = lower[slot];
            CachedPrefix { device: length[slot] - host - disk, host, disk }
        };
        slots.iter().map(|slot| slot.map(of).unwrap_or_default()).collect()
    }

    /// Whether the index says `worker` holds every one of `hashes`, in any tier.
    pub fn holds_all(&self, worker: &str, hashes: &[BlockHash]) -> bool {
        let s = self.read();
        let Some(&(slot, _)) = s.workers.get(worker) else { return false };
        hashes.iter().all(|h| s.tiers(*h).iter().any(|m| m & (1 << slot) != 0))
    }

    /// Where the index stands with `worker`'s events (a fresh cursor if unknown).
    fn cursor(&self, worker: &str) -> KvCursor {
        self.read().workers.get(worker).map(|(_, c)| *c).unwrap_or_default()
    }

    /// Applies what `worker` answered, `rtt` after asking. `None` if the index has no
    /// slot left for it.
    pub fn apply(&self, worker: &str, got: KvEvents, rtt: Duration) -> Option<Applied> {
        Self::apply_to(&mut self.write(), worker, got, rtt)
    }

    /// Applies events `worker` pushed (over NATS): the events after `from`, numbered
    /// on from it. Those the index already has are skipped; a batch that starts past
    /// where the index stands with the worker (events were missed, or the worker is
    /// new here or restarted) is dropped, and polling takes the worker up at once.
    pub fn apply_pushed(&self, worker: &str, from: KvCursor, mut got: KvEvents) -> Option<Applied> {
        let mut s = self.write();
        let at = s.workers.get(worker).map(|w| w.1);
        let skip = match at {
            Some(at) if at.instance == from.instance && from.seq <= at.seq && got.snapshot.is_none() => {
                (at.seq - from.seq) as usize
            }
            _ => {
                s.pushed.remove(worker);
                return None;
            }
        };
        s.pushed.insert(worker.to_string(), Instant::now());
        if skip >= got.events.len() && at.is_some_and(|a| a.seq >= got.cursor.seq) {
            return Some(Applied::default());
        }
        got.events.drain(..skip.min(got.events.len()));
        Self::apply_to(&mut s, worker, got, Duration::ZERO)
    }

    /// Whether `worker`'s pushed events kept the index current lately.
    pub fn pushed_recently(&self, worker: &str) -> bool {
        self.read().pushed.get(worker).is_some_and(|t| t.elapsed() < PUSH_TRUST)
    }

    fn apply_to(s: &mut State, worker: &str, got: KvEvents, rtt: Duration) -> Option<Applied> {
        let slot = match s.workers.get(worker) {
            Some(&(slot, _)) => slot,
            None => {
                let used: Slots = s.workers.values().fold(0, |m, (i, _)| m | 1 << i);
                let slot = (0..MAX_INDEXED).find(|i| used & (1 << i) == 0)?;
                s.workers.insert(worker.to_string(), (slot, KvCursor::default()));
                slot
            }
        };
        let bit: Slots = 1 << slot;
        let mut applied = Applied::default();
        if let Some(hashes) = got.snapshot {
            s.clear(bit);
            for (h, tier) in hashes {
                s.set(h, tier, bit);
            }
            applied.resyncs = 1;
        }
        let half_trip = rtt.as_secs_f64() / 2.0;
        for (event, age) in got.events {
            match event {
                KvEvent::Stored { hash, tier, .. } => s.set(hash, tier, bit),
                KvEvent::Removed { hash, tier } => s.unset(hash, tier, bit),
            }
            applied.lags.push(f64::from(age) + half_trip);
        }
        if let Some(w) = s.workers.get_mut(worker) {
            w.1 = got.cursor;
        }
        Some(applied)
    }

    /// Forgets every worker not named in `keep`.
    pub fn retain(&self, keep: &[&str]) {
        let mut s = self.write();
        let gone: Vec<(String, usize)> =
            s.workers.iter().filter(|(n, _)| !keep.contains(&n.as_str())).map(|(n, (i, _))| (n.clone(), *i)).collect();
        for (name, slot) in gone {
            s.clear(1 << slot);
            s.workers.remove(&name);
            s.pushed.remove(&name);
        }
    }

    /// Reads `worker`'s events once and applies them.
    pub async fn sync(&self, name: &str, worker: &dyn Worker) -> Option<Applied> {
        let asked = Instant::now();
        let log = worker.kv_event_log()?;
        let got = tokio::time::timeout(PATIENCE, log.kv_events(self.cursor(name))).await.ok()?.ok()?;
        self.apply(name, got, asked.elapsed())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    /// Who holds `hash` in the pool, the host tier and the disk tier.
    fn tiers(&self, hash: BlockHash) -> [Slots; 3] {
        let device = self.blocks.get(&hash).copied().unwrap_or(0);
        let [host, disk] = self.lower.get(&hash).copied().unwrap_or_default();
        [device, host, disk]
    }

    fn set(&mut self, hash: BlockHash, tier: Tier, bit: Slots) {
        match tier {
            Tier::Device => *self.blocks.entry(hash).or_default() |= bit,
            Tier::Host => self.lower.entry(hash).or_default()[0] |= bit,
            Tier::Disk => self.lower.entry(hash).or_default()[1] |= bit,
        }
    }

    fn unset(&mut self, hash: BlockHash, tier: Tier, bit: Slots) {
        match tier {
            Tier::Device => {
                if let Some(m) = self.blocks.get_mut(&hash) {
                    *m &= !bit;
                    if *m == 0 {
                        self.blocks.remove(&hash);
                    }
                }
            }
            Tier::Host | Tier::Disk => {
                let i = usize::from(tier == Tier::Disk);
                if let Some(m) = self.lower.get_mut(&hash) {
                    m[i] &= !bit;
                    if *m == [0, 0] {
                        self.lower.remove(&hash);
                    }
                }
            }
        }
    }

    fn clear(&mut self, bit: Slots) {
        self.blocks.retain(|_, m| {
            *m &= !bit;
            *m != 0
        });
        self.lower.retain(|_, m| {
            m.iter_mut().for_each(|x| *x &= !bit);
            *m != [0, 0]
        });
    }
}

/// Calls `f` with the number of every set bit of `m`.
fn for_each_bit(mut m: Slots, mut f: impl FnMut(usize)) {
    while m != 0 {
        f(m.trailing_zeros() as usize);
        m &= m - 1;
    }
}

/// The prompt blocks the router predicted a request would find cached on the worker
/// that prefills it, checked when the request ends against what that engine reused.
pub struct PredictedHit {
    index: Arc<KvIndex>,
    worker: String,
    /// The predicted prefix's hashes.
    hashes: Vec<BlockHash>,
    block_size: usize,
    telemetry: Arc<dyn Telemetry>,
}

impl PredictedHit {
    pub fn new(
        index: Arc<KvIndex>,
        worker: &str,
        hashes: &[BlockHash],
        block_size: usize,
        telemetry: Arc<dyn Telemetry>,
    ) -> Self {
        PredictedHit { index, worker: worker.to_string(), hashes: hashes.to_vec(), block_size, telemetry }
    }

    pub fn tokens(&self) -> usize {
        self.hashes.len() * self.block_size
    }

    /// The engine reused `realized` prompt tokens: records both, and why they differ.
    /// Fewer than predicted: blocks the index still lists point to a hash mismatch,
    /// blocks it no longer lists were evicted after routing. More: the index had not
    /// seen them yet.
    pub fn check(self, realized: usize) {
        let predicted = self.tokens();
        let cause = match realized.cmp(&predicted) {
            std::cmp::Ordering::Equal => None,
            std::cmp::Ordering::Greater => Some("index_lag"),
            std::cmp::Ordering::Less => {
                let missed = &self.hashes[realized / self.block_size..];
                Some(if self.index.holds_all(&self.worker, missed) { "hash_mismatch" } else { "evicted" })
            }
        };
        self.telemetry.prefix_hit(predicted, realized, cause);
    }
}

/// The router's index follows its workers' KV events.
impl crate::Router {
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
                tokio::time::sleep(if busy { POLL } else { IDLE_POLL }).await;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u64) -> BlockHash {
        BlockHash(x)
    }

    fn stored(x: u64) -> (KvEvent, f32) {
        (KvEvent::Stored { hash: h(x), parent: None, tier: Tier::Device }, 0.0)
    }

    fn batch(snapshot: Option<Vec<u64>>, events: Vec<(KvEvent, f32)>, seq: u64) -> KvEvents {
        KvEvents {
            snapshot: snapshot.map(|v| v.into_iter().map(|x| (h(x), Tier::Device)).collect()),
            events,
            cursor: KvCursor { instance: 1, seq },
        }
    }

    #[test]
    fn pushed_events_continue_the_index_where_it_stands_and_nowhere_else() {
        let ix = KvIndex::default();
        let at = |seq| KvCursor { instance: 1, seq };
        // A worker the index has not polled yet: its pushes wait for the poll.
        assert!(ix.apply_pushed("a", at(0), batch(None, vec![stored(1)], 1)).is_none());
        ix.apply("a", batch(Some(vec![1]), vec![], 1), Duration::ZERO);
        // A batch that overlaps what the poll brought applies only what is new.
        let a = ix.apply_pushed("a", at(0), batch(None, vec![stored(1), stored(2)], 2)).unwrap();
        assert_eq!(a.lags.len(), 1);
        assert!(ix.pushed_recently("a"));
        assert_eq!(ix.prefix_blocks(&[h(1), h(2)], &["a"]), [2]);
        // A heartbeat at the same place changes nothing and keeps the push trusted.
        assert_eq!(ix.apply_pushed("a", at(2), batch(None, vec![], 2)).unwrap().lags.len(), 0);
        // A batch after a missed one is dropped, and the poll is asked to catch up.
        assert!(ix.apply_pushed("a", at(3), batch(None, vec![stored(4)], 4)).is_none());
        assert!(!ix.pushed_recently("a"));
        assert_eq!(ix.prefix_blocks(&[h(1), h(2), h(3), h(4)], &["a"]), [2]);
        // So is one from another instance of the worker (it restarted).
        let other = KvCursor { instance: 2, seq: 2 };
        assert!(ix.apply_pushed("a", other, batch(None, vec![stored(3)], 3)).is_none());
    }

    #[test]
    fn the_longest_cached_prefix_on_each_worker() {
        let ix = KvIndex::default();
        ix.apply("a", batch(Some(vec![1, 2, 3]), vec![], 3), Duration::ZERO);
        ix.apply("b", batch(Some(vec![1]), vec![stored(2)], 4), Duration::ZERO);
        let prompt = [h(1), h(2), h(3), h(4)];
        assert_eq!(ix.prefix_blocks(&prompt, &["a", "b", "c"]), [3, 2, 0]);
        // A hole ends the prefix, whatever follows it.
        assert_eq!(ix.prefix_blocks(&[h(9), h(1)], &["a"]), [0]);
        assert_eq!(ix.prefix_blocks(&prompt[..2], &["a", "b"]), [2, 2]);
    }

    #[test]
    fn removals_snapshots_and_departures_forget_blocks() {
        let ix = KvIndex::default();
        ix.apply("a", batch(Some(vec![1, 2]), vec![], 2), Duration::ZERO);
        ix.apply("b", batch(Some(vec![1, 2]), vec![], 2), Duration::ZERO);
        ix.apply("a", batch(None, vec![(KvEvent::Removed { hash: h(2), tier: Tier::Device }, 0.0)], 3), Duration::ZERO);
        assert_eq!(ix.prefix_blocks(&[h(1), h(2)], &["a", "b"]), [1, 2]);
        assert!(ix.holds_all("b", &[h(1), h(2)]) && !ix.holds_all("a", &[h(2)]));
        // A restarted `b` resyncs from a snapshot that holds nothing.
        let applied = ix.apply("b", batch(Some(vec![]), vec![], 0), Duration::ZERO).unwrap();
        assert_eq!(applied.resyncs, 1);
        assert_eq!(ix.prefix_blocks(&[h(1)], &["a", "b"]), [1, 0]);
        ix.retain(&["b"]);
        assert!(ix.is_empty(), "a's blocks leave with it");
        assert_eq!(ix.cursor("a"), KvCursor::default());
    }

    #[test]
    fn a_prefix_counts_each_block_in_the_best_tier_that_holds_it() {
        let ix = KvIndex::default();
        let at = |x: u64, tier| (KvEvent::Stored { hash: h(x), parent: None, tier }, 0.0);
        let events =
            vec![at(1, Tier::Device), at(2, Tier::Host), at(2, Tier::Disk), at(3, Tier::Disk), at(5, Tier::Host)];
        ix.apply("a", batch(Some(vec![]), events, 5), Duration::ZERO);
        let prompt = [h(1), h(2), h(3), h(4), h(5)];
        let got = ix.prefix(&prompt, &["a"])[0];
        assert_eq!(got, CachedPrefix { device: 1, host: 1, disk: 1 }, "the chain stops at 4");
        assert_eq!(ix.prefix_blocks(&prompt, &["a"]), [3]);
        assert!(ix.holds_all("a", &[h(2), h(3)]));
        // Leaving the host tier for disk alone keeps the block, one tier lower.
        ix.apply("a", batch(None, vec![(KvEvent::Removed { hash: h(2), tier: Tier::Host }, 0.0)], 6), Duration::ZERO);
        assert_eq!(ix.prefix(&prompt, &["a"])[0], CachedPrefix { device: 1, host: 0, disk: 2 });
        ix.retain(&[]);
        assert!(ix.is_empty());
    }

    #[test]
    fn lag_is_the_event_age_plus_half_the_round_trip() {
        let ix = KvIndex::default();
        let applied = ix.apply("a", batch(None, vec![(stored(1).0, 0.25)], 1), Duration::from_millis(10)).unwrap();
        assert!((applied.lags[0] - 0.255).abs() < 1e-6, "{:?}", applied.lags);
        assert_eq!(ix.cursor("a").seq, 1);
    }

    #[test]
    fn a_million_indexed_blocks_still_match_prefixes() {
        let ix = KvIndex::default();
        let hashes: Vec<u64> = (0..1_000_000).collect();
        ix.apply("a", batch(Some(hashes), vec![], 1), Duration::ZERO);
        assert_eq!(ix.len(), 1_000_000);
        let prompt: Vec<BlockHash> = (0..128).map(h).collect();
        assert_eq!(ix.prefix_blocks(&prompt, &["a", "b"]), [128, 0]);
    }
}
