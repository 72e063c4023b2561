//! The pool's state behind its mutex: one slot per block plus the free list, the LRU of
//! cached blocks, the hash registry and the pending events.
//!
//! Every transition of a block happens here, in one place, so the invariant
//! "each block is in exactly one of free / used / cached" is checked by one audit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::event::KvEvent;
use crate::hash::{BlockHash, BlockId};
use crate::log::EventLog;
use crate::lru::Lru;
use crate::tier::{Changes, Lower, Move, Place, Tier};
pub use pdserve_types::PoolStats;

/// Not enough free or cached blocks for a request; nothing was allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("KV block pool exhausted: requested {requested} blocks, {available} available")]
pub struct PoolExhausted {
    /// Blocks asked for.
    pub requested: usize,
    /// Blocks that could have been handed out (free plus cached).
    pub available: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Free,
    /// Owned by exactly one `MutableBlock`.
    Mutable,
    /// Shared by `refs` (≥ 1) `ImmutableBlock`s. `registered` means the registry points
    /// here for `hash`; a duplicate of an already registered hash is not registered.
    Held {
        refs: u32,
        hash: BlockHash,
        parent: Option<BlockHash>,
        registered: bool,
    },
    /// No handles, still registered: reusable by hash until evicted.
    Cached {
        hash: BlockHash,
        parent: Option<BlockHash>,
    },
}

/// The pool state behind its lock, shared by the pool handle and every block handle
/// (which give their blocks back through it without knowing the pool).
#[derive(Clone)]
pub(crate) struct SharedState(Arc<Mutex<PoolState>>);

impl SharedState {
    pub(crate) fn new(num_blocks: usize) -> Self {
        Self(Arc::new(Mutex::new(PoolState::new(num_blocks))))
    }

    /// The state never panics while locked (no user code runs under the lock), so a
    /// poisoned mutex still holds consistent state: keep serving rather than cascade.
    pub(crate) fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn same(&self, other: &SharedState) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[derive(Debug)]
pub(crate) struct PoolState {
    slots: Vec<Slot>,
    free: Vec<BlockId>,
    lru: Lru,
    registry: HashMap<BlockHash, BlockId>,
    pub(crate) events: EventLog,
    used: usize,
    /// Host and disk tiers that evicted blocks go down to (none by default).
    pub(crate) lower: Lower,
    /// Where `take_events` left off.
    #[cfg(test)]
    taken: u64,
}

impl PoolState {
    pub(crate) fn new(num_blocks: usize) -> Self {
        // Reversed so that the first allocations get ids 0, 1, 2, ... (easier to read).
        let free = (0..num_blocks as u32).rev().map(BlockId).collect();
        Self {
            slots: vec![Slot::Free; num_blocks],
            free,
            lru: Lru::new(num_blocks),
            registry: HashMap::with_capacity(num_blocks),
            // Four events per block: a reader that polls every few milliseconds never
            // falls behind, even while the whole pool turns over.
            events: EventLog::new(4 * num_blocks.max(256)),
            used: 0,
            lower: Lower::default(),
            #[cfg(test)]
            taken: 0,
        }
    }

    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    pub(crate) fn stats(&self) -> PoolStats {
        PoolStats {
            total: self.slots.len(),
            free: self.free.len(),
            used: self.used,
            cached: self.lru.len(),
            ..PoolStats::default()
        }
    }

    /// Every hash the pool and its lower tiers hold, with the number of the last
    /// event they reflect.
    pub(crate) fn snapshot(&self) -> (u64, Vec<(BlockHash, Tier)>) {
        let device = self.registry.keys().map(|&h| (h, Tier::Device));
        let lower = self.lower.tiers.iter().flat_map(|t| t.entries().map(move |(h, _)| (h, t.tier)));
        (self.events.last(), device.chain(lower).collect())
    }

    /// The byte moves the engine owes for evictions so far, oldest first.
    pub(crate) fn take_moves(&mut self) -> Vec<Move> {
        std::mem::take(&mut self.lower.moves)
    }

    /// Hands a block leaving the pool (or a lower tier) to the tiers below, logging
    /// what each registry gained and lost.
    fn demote(&mut self, level: usize, from: Place, hash: BlockHash, parent: Option<BlockHash>) {
        let mut changes = Changes::new();
        self.lower.demote(level, from, hash, parent, &mut changes);
        for (hash, parent, tier, stored) in changes {
            self.events.push(match stored {
                true => KvEvent::Stored { hash, parent, tier },
                false => KvEvent::Removed { hash, tier },
            });
        }
    }

    /// Drops every lower-tier block and the copies still owed to the tiers, logging
    /// each hash's removal.
    pub(crate) fn forget_lower_all(&mut self) {
        self.lower.moves.clear();
        for place in self.lower.held() {
            self.forget_lower(place);
        }
    }

    /// Drops the lower-tier block at `place` (its bytes were lost), logging it.
    pub(crate) fn forget_lower(&mut self, place: Place) {
        if let Some((hash, tier)) = self.lower.forget(place) {
            self.events.push(KvEvent::Removed { hash, tier });
        }
    }

    /// Takes `n` blocks for writing, all or none. Free blocks go first; only then are
    /// cached blocks evicted, oldest first, since they may still save a prefill.
    pub(crate) fn take_mutable(&mut self, n: usize) -> Result<Vec<BlockId>, PoolExhausted> {
        let available = self.available();
        if n > available {
            return Err(PoolExhausted { requested: n, available });
        }
        let ids: Vec<BlockId> = (0..n).filter_map(|_| self.take_one()).collect();
        debug_assert_eq!(ids.len(), n);
        for &id in &ids {
            self.slots[id.index()] = Slot::Mutable;
        }
        self.used += ids.len();
        Ok(ids)
    }

    fn take_one(&mut self) -> Option<BlockId> {
        self.free.pop().or_else(|| self.evict_oldest())
    }

    /// Unregisters the least recently used cached block; the caller decides its new state.
    fn evict_oldest(&mut self) -> Option<BlockId> {
        let id = self.lru.pop_front()?;
        if let Slot::Cached { hash, parent } = self.slots[id.index()] {
            self.registry.remove(&hash);
            self.events.push(KvEvent::Removed { hash, tier: Tier::Device });
            if !self.lower.is_empty() {
                self.demote(0, Place::Device(id), hash, parent);
            }
        }
        self.slots[id.index()] = Slot::Free;
        Some(id)
    }

    /// Evicts every cached block to the free list.
    pub(crate) fn clear_cache(&mut self) {
        while let Some(id) = self.evict_oldest() {
            self.free.push(id);
        }
    }

    pub(crate) fn release_mutable(&mut self, id: BlockId) {
        debug_assert_eq!(self.slots[id.index()], Slot::Mutable);
        self.slots[id.index()] = Slot::Free;
        self.free.push(id);
        self.used -= 1;
    }

    /// Turns a mutable block into a shared one with a single reference. Registers it
    /// under `hash` unless another block already is: the first copy stays the one that
    /// prefix matches find, and the router has already been told about it.
    pub(crate) fn complete(&mut self, id: BlockId, hash: BlockHash, parent: Option<BlockHash>) {
        debug_assert_eq!(self.slots[id.index()], Slot::Mutable);
        let registered = !self.registry.contains_key(&hash);
        if registered {
            self.registry.insert(hash, id);
            self.events.push(KvEvent::Stored { hash, parent, tier: Tier::Device });
        }
        self.slots[id.index()] = Slot::Held { refs: 1, hash, parent, registered };
    }

    pub(crate) fn add_ref(&mut self, id: BlockId) {
        let slot = &mut self.slots[id.index()];
        debug_assert!(matches!(slot, Slot::Held { .. }), "add_ref on unheld {id:?}");
        if let Slot::Held { refs, .. } = slot {
            *refs += 1;
        }
    }

    /// Drops one reference; the last one parks a registered block in the cache (most
    /// recently used end) and frees an unregistered one.
    pub(crate) fn release_ref(&mut self, id: BlockId) {
        let slot = &mut self.slots[id.index()];
        debug_assert!(matches!(slot, Slot::Held { .. }), "release_ref on unheld {id:?}");
        let Slot::Held { refs, hash, parent, registered } = slot else {
            return;
        };
        *refs -= 1;
        if *refs > 0 {
            return;
        }
        if *registered {
            *slot = Slot::Cached { hash: *hash, parent: *parent };
            self.lru.push_back(id);
        } else {
            *slot = Slot::Free;
            self.free.push(id);
        }
        self.used -= 1;
    }

    /// Takes a reference to each block of the longest registered prefix of `hashes`,
    /// reviving cached ones out of the LRU.
    pub(crate) fn match_prefix(&mut self, hashes: &[BlockHash]) -> Vec<(BlockId, BlockHash)> {
        let mut hits = Vec::new();
        for &hash in hashes {
            let Some(&id) = self.registry.get(&hash) else {
                break;
            };
            match self.slots[id.index()] {
                Slot::Cached { parent, .. } => {
                    self.lru.remove(id);
                    self.slots[id.index()] = Slot::Held { refs: 1, hash, parent, registered: true };
                    self.used += 1;
                }
                _ => self.add_ref(id),
            }
            hits.push((id, hash));
        }
        hits
    }
}

#[cfg(test)]
impl PoolState {
    /// The events since the last call, for tests that follow one reader.
    pub(crate) fn take_events(&mut self) -> Vec<KvEvent> {
        let got = self.events.since(self.events.instance(), self.taken).expect("tests keep up");
        self.taken = self.events.last();
        got.into_iter().map(|e| e.event).collect()
    }

    /// Checks every cross-structure invariant; used after each step of the property test.
    pub(crate) fn audit(&self) -> Result<(), String> {
        let count = |pred: fn(&Slot) -> bool| self.slots.iter().filter(|s| pred(s)).count();
        let n_free = count(|s| matches!(s, Slot::Free));
        let n_used = count(|s| matches!(s, Slot::Mutable | Slot::Held { .. }));
        let n_cached = count(|s| matches!(s, Slot::Cached { .. }));
        let n_registered_held = count(|s| matches!(s, Slot::Held { registered: true, .. }));
        let checks = [
            (self.free.len() == n_free, "free list length"),
            (self.lru.len() == n_cached, "lru length"),
            (self.used == n_used, "used counter"),
            (n_free + n_used + n_cached == self.slots.len(), "state sum"),
            (self.registry.len() == n_registered_held + n_cached, "registry size"),
            (self.free.iter().all(|id| self.slots[id.index()] == Slot::Free), "free ids"),
            (self.lru.iter().all(|id| self.is_cached(id)), "lru ids"),
            (self.registry.iter().all(|(h, id)| self.registered_as(*id, *h)), "registry ids"),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, what)) => Err(format!("{what} inconsistent: {self:?}")),
            None => self.lower.tiers.iter().try_for_each(crate::tier::TierIndex::audit),
        }
    }

    /// Reference count of a held block, 0 otherwise.
    pub(crate) fn refs(&self, id: BlockId) -> u32 {
        match self.slots[id.index()] {
            Slot::Held { refs, .. } => refs,
            _ => 0,
        }
    }

    pub(crate) fn registered_hashes(&self) -> std::collections::HashSet<BlockHash> {
        self.registry.keys().copied().collect()
    }

    /// Ids of cached blocks, least recently used first.
    pub(crate) fn lru_order(&self) -> Vec<BlockId> {
        self.lru.iter().collect()
    }

    fn is_cached(&self, id: BlockId) -> bool {
        matches!(self.slots[id.index()], Slot::Cached { .. })
    }

    fn registered_as(&self, id: BlockId, h: BlockHash) -> bool {
        match self.slots[id.index()] {
            Slot::Cached { hash, .. } => hash == h,
            Slot::Held { hash, registered, .. } => registered && hash == h,
            _ => false,
        }
    }
}
