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
//! walk down its hashes.

use pdserve_kv::{BlockHash, KvEvent};
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
    blocks: HashMap<BlockHash, Slots>,
    /// Indexed workers by name: their slot and where their events stand.
    workers: HashMap<String, (usize, KvCursor)>,
}

/// See the module docs.
#[derive(Default)]
pub struct KvIndex {
    state: RwLock<State>,
}

/// What one round of reading taught the index, for the metrics.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Applied {
    /// Seconds each applied event had waited since it happened.
    pub lags: Vec<f64>,
    pub resyncs: usize,
}

impl KvIndex {
    /// Distinct block hashes indexed.
    pub fn len(&self) -> usize {
        self.read().blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Cached blocks at the start of `hashes` on each named worker (0 for a worker
    /// not indexed).
    pub fn prefix_blocks(&self, hashes: &[BlockHash], workers: &[&str]) -> Vec<usize> {
        let s = self.read();
        let slots: Vec<Option<usize>> = workers.iter().map(|w| s.workers.get(*w).map(|(slot, _)| *slot)).collect();
        let mut alive: Slots = slots.iter().flatten().fold(0, |m, &i| m | 1 << i);
        let mut found = vec![hashes.len(); workers.len()];
        for (i, h) in hashes.iter().enumerate() {
            let held = s.blocks.get(h).copied().unwrap_or(0);
            let dropped = alive & !held;
            if dropped != 0 {
                for (n, slot) in found.iter_mut().zip(&slots) {
                    if slot.is_some_and(|sl| dropped & (1 << sl) != 0) {
                        *n = i;
                    }
                }
            }
            alive &= held;
            if alive == 0 {
                break;
            }
        }
        found.iter().zip(&slots).map(|(&n, slot)| if slot.is_some() { n } else { 0 }).collect()
    }

    /// Whether the index says `worker` holds every one of `hashes`.
    pub fn holds_all(&self, worker: &str, hashes: &[BlockHash]) -> bool {
        let s = self.read();
        let Some(&(slot, _)) = s.workers.get(worker) else { return false };
        hashes.iter().all(|h| s.blocks.get(h).is_some_and(|m| m & (1 << slot) != 0))
    }

    /// Where the index stands with `worker`'s events (a fresh cursor if unknown).
    fn cursor(&self, worker: &str) -> KvCursor {
        self.read().workers.get(worker).map(|(_, c)| *c).unwrap_or_default()
    }

    /// Applies what `worker` answered, `rtt` after asking. `None` if the index has no
    /// slot left for it.
    pub fn apply(&self, worker: &str, got: KvEvents, rtt: Duration) -> Option<Applied> {
        let mut s = self.write();
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
            for h in hashes {
                *s.blocks.entry(h).or_default() |= bit;
            }
            applied.resyncs = 1;
        }
        let half_trip = rtt.as_secs_f64() / 2.0;
        for (event, age) in got.events {
            match event {
                KvEvent::Stored { hash, .. } => *s.blocks.entry(hash).or_default() |= bit,
                KvEvent::Removed { hash } => s.unset(hash, bit),
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
        }
    }

    /// Reads `worker`'s events once and applies them.
    pub async fn sync(&self, name: &str, worker: &dyn Worker) -> Option<Applied> {
        let asked = Instant::now();
        let got = tokio::time::timeout(PATIENCE, worker.kv_events(self.cursor(name))).await.ok()?.ok()?;
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
    fn unset(&mut self, hash: BlockHash, bit: Slots) {
        if let Some(m) = self.blocks.get_mut(&hash) {
            *m &= !bit;
            if *m == 0 {
                self.blocks.remove(&hash);
            }
        }
    }

    fn clear(&mut self, bit: Slots) {
        self.blocks.retain(|_, m| {
            *m &= !bit;
            *m != 0
        });
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

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u64) -> BlockHash {
        BlockHash(x)
    }

    fn stored(x: u64) -> (KvEvent, f32) {
        (KvEvent::Stored { hash: h(x), parent: None }, 0.0)
    }

    fn batch(snapshot: Option<Vec<u64>>, events: Vec<(KvEvent, f32)>, seq: u64) -> KvEvents {
        KvEvents {
            snapshot: snapshot.map(|v| v.into_iter().map(h).collect()),
            events,
            cursor: KvCursor { instance: 1, seq },
        }
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
        ix.apply("a", batch(None, vec![(KvEvent::Removed { hash: h(2) }, 0.0)], 3), Duration::ZERO);
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
