//! The prefix cache's lower tiers: a cached block that the pool evicts is kept in a
//! bounded host-RAM store (tier 2) and, evicted from there, in a bounded store on
//! local disk (tier 3). A later prompt that misses the pool but finds its next blocks
//! there copies them back instead of recomputing them.
//!
//! This module keeps only the bookkeeping: which hash sits in which slot of which
//! tier, and the recency order each tier evicts by. The engine owns the bytes; every
//! eviction the pool makes becomes a [`Move`] it must carry out, in order, before it
//! writes into the blocks it was handed (the evicted block's bytes are still intact
//! until then). Tiers are inclusive: a block copied back into the pool stays in the
//! tier it came from, so evicting it again costs no copy.

use std::collections::HashMap;

use crate::hash::{BlockHash, BlockId};
use crate::lru::Lru;
pub use pdserve_types::{Tier, TierCounters, TierStats};

/// A block's bytes in one tier: a pool block, or a slot of a lower tier's store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    Device(BlockId),
    Host(u32),
    Disk(u32),
}

impl Place {
    fn of(tier: Tier, slot: u32) -> Place {
        match tier {
            Tier::Device => Place::Device(BlockId(slot)),
            Tier::Host => Place::Host(slot),
            Tier::Disk => Place::Disk(slot),
        }
    }
}

/// Copy one block's bytes from `from` to `to`. Moves are made in the order given:
/// a slot's old contents move down before new ones arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub from: Place,
    pub to: Place,
}

/// A block in a lower tier: its hash and its parent's.
type Entry = (BlockHash, Option<BlockHash>);

/// One lower tier's slots, hash registry and recency order.
#[derive(Debug)]
pub(crate) struct TierIndex {
    pub(crate) tier: Tier,
    slots: Vec<Option<Entry>>,
    map: HashMap<BlockHash, u32>,
    /// Over slot numbers; every used slot is linked.
    lru: Lru,
    free: Vec<u32>,
}

impl TierIndex {
    pub(crate) fn new(tier: Tier, capacity: usize) -> Self {
        Self {
            tier,
            slots: vec![None; capacity],
            map: HashMap::with_capacity(capacity.min(1 << 20)),
            lru: Lru::new(capacity),
            free: (0..capacity as u32).rev().collect(),
        }
    }

    pub(crate) fn stats(&self) -> TierStats {
        TierStats { capacity: self.slots.len(), used: self.map.len() }
    }

    pub(crate) fn get(&self, hash: BlockHash) -> Option<u32> {
        self.map.get(&hash).copied()
    }

    /// Marks `hash` most recently used; whether the tier holds it.
    pub(crate) fn touch(&mut self, hash: BlockHash) -> bool {
        let Some(&slot) = self.map.get(&hash) else { return false };
        self.lru.remove(BlockId(slot));
        self.lru.push_back(BlockId(slot));
        true
    }

    /// A slot for `hash` (not yet held), and what its previous holder was when the
    /// tier was full and the least recently used block had to go.
    pub(crate) fn insert(&mut self, hash: BlockHash, parent: Option<BlockHash>) -> Option<(u32, Option<Entry>)> {
        let (slot, evicted) = match self.free.pop() {
            Some(slot) => (slot, None),
            None => {
                let slot = self.lru.pop_front()?.0;
                let old = self.slots[slot as usize].take();
                if let Some((h, _)) = old {
                    self.map.remove(&h);
                }
                (slot, old)
            }
        };
        self.slots[slot as usize] = Some((hash, parent));
        self.map.insert(hash, slot);
        self.lru.push_back(BlockId(slot));
        Some((slot, evicted))
    }

    /// Empties `slot`; what it held.
    fn remove(&mut self, slot: u32) -> Option<Entry> {
        let entry = self.slots.get_mut(slot as usize)?.take()?;
        self.map.remove(&entry.0);
        self.lru.remove(BlockId(slot));
        self.free.push(slot);
        Some(entry)
    }

    /// Every hash held, with its parent.
    pub(crate) fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        self.slots.iter().flatten().copied()
    }

    /// Checks the slots, registry, free list and recency order agree.
    #[cfg(test)]
    pub(crate) fn audit(&self) -> Result<(), String> {
        let used = self.slots.iter().filter(|s| s.is_some()).count();
        let agree = self.map.iter().all(|(h, &s)| self.slots[s as usize].is_some_and(|(x, _)| x == *h));
        let free_empty = self.free.iter().all(|&s| self.slots[s as usize].is_none());
        let ok = used == self.map.len() && used == self.lru.len() && used + self.free.len() == self.slots.len();
        (ok && agree && free_empty).then_some(()).ok_or_else(|| format!("{:?} tier inconsistent", self.tier))
    }
}

/// The lower tiers below one pool, and the moves they still owe the engine.
#[derive(Debug, Default)]
pub(crate) struct Lower {
    /// Configured tiers only, top first (host, then disk).
    pub(crate) tiers: Vec<TierIndex>,
    pub(crate) moves: Vec<Move>,
}

/// What a demotion changed in the registries, for the event log.
pub(crate) type Changes = Vec<(BlockHash, Option<BlockHash>, Tier, bool)>;

impl Lower {
    pub(crate) fn new(host_blocks: usize, disk_blocks: usize) -> Self {
        let tiers = [(Tier::Host, host_blocks), (Tier::Disk, disk_blocks)]
            .into_iter()
            .filter(|&(_, n)| n > 0)
            .map(|(t, n)| TierIndex::new(t, n))
            .collect();
        Self { tiers, moves: Vec::new() }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.tiers.is_empty()
    }

    /// Keeps a block leaving `from` in tier `level` or below; records each registry
    /// change (hash, parent, tier, stored?) in `changes`.
    pub(crate) fn demote(
        &mut self,
        level: usize,
        from: Place,
        hash: BlockHash,
        parent: Option<BlockHash>,
        changes: &mut Changes,
    ) {
        let Some(t) = self.tiers.get_mut(level) else { return };
        if t.touch(hash) {
            return;
        }
        let tier = t.tier;
        let Some((slot, evicted)) = t.insert(hash, parent) else { return };
        if let Some((old, old_parent)) = evicted {
            changes.push((old, old_parent, tier, false));
            // The slot's old block moves down before the new one overwrites it.
            self.demote(level + 1, Place::of(tier, slot), old, old_parent, changes);
        }
        self.moves.push(Move { from, to: Place::of(tier, slot) });
        changes.push((hash, parent, tier, true));
    }

    /// The tier (top first) that holds `hash`, and where.
    pub(crate) fn locate(&self, hash: BlockHash) -> Option<(Tier, Place)> {
        self.tiers.iter().find_map(|t| t.get(hash).map(|s| (t.tier, Place::of(t.tier, s))))
    }

    /// How many of `hashes`, from the first, some lower tier holds; each is marked
    /// recently used in the tier found.
    pub(crate) fn prefix(&mut self, hashes: &[BlockHash]) -> Vec<Tier> {
        let mut found = Vec::new();
        for &hash in hashes {
            match self.tiers.iter_mut().find(|t| t.get(hash).is_some()) {
                Some(t) => {
                    t.touch(hash);
                    found.push(t.tier);
                }
                None => break,
            }
        }
        found
    }

    /// Drops the block at `place`, whose bytes were lost; its hash and tier.
    pub(crate) fn forget(&mut self, place: Place) -> Option<(BlockHash, Tier)> {
        let (tier, slot) = match place {
            Place::Host(s) => (Tier::Host, s),
            Place::Disk(s) => (Tier::Disk, s),
            Place::Device(_) => return None,
        };
        let t = self.tiers.iter_mut().find(|t| t.tier == tier)?;
        t.remove(slot).map(|(hash, _)| (hash, tier))
    }

    pub(crate) fn stats(&self, tier: Tier) -> TierStats {
        self.tiers.iter().find(|t| t.tier == tier).map(TierIndex::stats).unwrap_or_default()
    }

    /// Every place a block is held in, in any tier.
    pub(crate) fn held(&self) -> Vec<Place> {
        let held = |t: &TierIndex| t.map.values().map(|&s| Place::of(t.tier, s)).collect::<Vec<_>>();
        self.tiers.iter().flat_map(held).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> BlockHash {
        BlockHash(n)
    }

    #[test]
    fn a_full_host_tier_moves_its_oldest_block_to_disk_before_reusing_the_slot() {
        let mut lower = Lower::new(2, 2);
        let mut changes = Changes::new();
        for i in 0..3 {
            lower.demote(0, Place::Device(BlockId(i)), h(10 + u64::from(i)), None, &mut changes);
        }
        // Block 10 went to disk first, then block 12 took its host slot.
        assert_eq!(
            lower.moves,
            [
                Move { from: Place::Device(BlockId(0)), to: Place::Host(0) },
                Move { from: Place::Device(BlockId(1)), to: Place::Host(1) },
                Move { from: Place::Host(0), to: Place::Disk(0) },
                Move { from: Place::Device(BlockId(2)), to: Place::Host(0) },
            ]
        );
        assert_eq!(lower.locate(h(10)), Some((Tier::Disk, Place::Disk(0))));
        assert_eq!(lower.locate(h(12)), Some((Tier::Host, Place::Host(0))));
        assert!(changes.contains(&(h(10), None, Tier::Host, false)));
        assert!(changes.contains(&(h(10), None, Tier::Disk, true)));
        for t in &lower.tiers {
            t.audit().unwrap();
        }
    }

    #[test]
    fn a_block_the_tier_holds_is_touched_not_copied_again() {
        let mut lower = Lower::new(2, 0);
        let mut changes = Changes::new();
        lower.demote(0, Place::Device(BlockId(0)), h(1), None, &mut changes);
        lower.demote(0, Place::Device(BlockId(1)), h(2), None, &mut changes);
        lower.demote(0, Place::Device(BlockId(5)), h(1), None, &mut changes);
        assert_eq!(lower.moves.len(), 2);
        // 1 is now the most recent: 2 goes first, and with no disk it is gone.
        lower.demote(0, Place::Device(BlockId(3)), h(3), None, &mut changes);
        assert_eq!(lower.locate(h(2)), None);
        assert!(lower.locate(h(1)).is_some());
        assert_eq!(lower.stats(Tier::Host), TierStats { capacity: 2, used: 2 });
        assert_eq!(lower.stats(Tier::Disk), TierStats::default());
    }

    #[test]
    fn a_prefix_runs_through_both_tiers_and_stops_at_the_first_miss() {
        let mut lower = Lower::new(1, 4);
        let mut changes = Changes::new();
        for i in 1..=3 {
            lower.demote(0, Place::Device(BlockId(i)), h(u64::from(i)), None, &mut changes);
        }
        assert_eq!(lower.prefix(&[h(1), h(2), h(3), h(9), h(1)]), [Tier::Disk, Tier::Disk, Tier::Host]);
        assert!(lower.prefix(&[h(9)]).is_empty());
    }

    #[test]
    fn a_forgotten_slot_is_free_again_and_its_hash_gone() {
        let mut lower = Lower::new(0, 2);
        let mut changes = Changes::new();
        lower.demote(0, Place::Device(BlockId(0)), h(1), None, &mut changes);
        lower.demote(0, Place::Device(BlockId(1)), h(2), None, &mut changes);
        assert_eq!(lower.forget(Place::Disk(0)), Some((h(1), Tier::Disk)));
        assert_eq!(lower.forget(Place::Disk(0)), None);
        assert_eq!(lower.locate(h(1)), None);
        assert_eq!(lower.stats(Tier::Disk).used, 1);
        // The freed slot is taken before the full tier evicts anything.
        lower.demote(0, Place::Device(BlockId(2)), h(3), None, &mut changes);
        assert_eq!(lower.locate(h(3)), Some((Tier::Disk, Place::Disk(0))));
        assert!(lower.locate(h(2)).is_some());
        lower.tiers[0].audit().unwrap();
    }
}
