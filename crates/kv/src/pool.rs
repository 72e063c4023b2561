//! The shared block pool handle and its public operations.

use std::fmt;
use std::sync::MutexGuard;

use crate::block::{ImmutableBlock, MutableBlock};
use crate::hash::BlockHash;
use crate::log::{EventGap, LoggedEvent};
pub use crate::state::{PoolExhausted, PoolStats};
use crate::state::{PoolState, SharedState};
use crate::tier::{Lower, Move, Place, Tier};

/// The registries at one event number: where a reader of the event log starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSnapshot {
    pub instance: u64,
    pub seq: u64,
    /// Every hash held, with the tier it is in (a hash may appear once per tier).
    pub hashes: Vec<(BlockHash, Tier)>,
}

/// One worker's KV blocks. Cloning is cheap and shares the pool.
#[derive(Clone)]
pub struct BlockPool {
    state: SharedState,
    block_size: usize,
    num_blocks: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens each, all free.
    ///
    /// # Panics
    /// If `block_size` is 0 or `num_blocks` does not fit a `u32` block id: both are
    /// configuration errors that no later call could recover from.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        assert!(u32::try_from(num_blocks).is_ok_and(|n| n < u32::MAX), "too many blocks");
        Self { state: SharedState::new(num_blocks), block_size, num_blocks }
    }

    /// A pool whose evicted blocks go down to a host-RAM tier of `host_blocks` and
    /// then a disk tier of `disk_blocks` (either may be 0: no such tier). The engine
    /// must carry out [`BlockPool::take_moves`] before writing into blocks it was
    /// handed, since those may be what was just evicted.
    pub fn with_tiers(num_blocks: usize, block_size: usize, host_blocks: usize, disk_blocks: usize) -> Self {
        let pool = Self::new(num_blocks, block_size);
        pool.lock().lower = Lower::new(host_blocks, disk_blocks);
        pool
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool, in every state.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// One block to write into. Evicts the least recently used cached block when no
    /// block is free.
    pub fn allocate(&self) -> Result<MutableBlock, PoolExhausted> {
        let mut blocks = self.allocate_many(1)?;
        blocks.pop().ok_or(PoolExhausted { requested: 1, available: 0 })
    }

    /// `n` blocks to write into, or none at all.
    pub fn allocate_many(&self, n: usize) -> Result<Vec<MutableBlock>, PoolExhausted> {
        let ids = self.lock().take_mutable(n)?;
        // Handles are built after the lock is released: their `Drop` takes it.
        Ok(ids.into_iter().map(|id| MutableBlock::new(self.state.clone(), id)).collect())
    }

    /// Blocks `allocate` can still hand out: free plus cached.
    pub fn available(&self) -> usize {
        self.lock().available()
    }

    /// References to the blocks of the longest prefix of `hashes` this pool holds,
    /// whether in use by another sequence or cached. Cached ones leave the LRU.
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> Vec<ImmutableBlock> {
        let hits = self.lock().match_prefix(hashes);
        hits.into_iter().map(|(id, hash)| ImmutableBlock::new(self.state.clone(), id, hash)).collect()
    }

    /// Block counts by state, for the `pdserve_kv_blocks` gauge and admission.
    pub fn stats(&self) -> PoolStats {
        let state = self.lock();
        PoolStats { host: state.lower.stats(Tier::Host), disk: state.lower.stats(Tier::Disk), ..state.stats() }
    }

    /// Whether evicted blocks go down to a lower tier.
    pub fn has_lower_tiers(&self) -> bool {
        !self.lock().lower.is_empty()
    }

    /// The byte copies owed for evictions since the last call, to be made in order.
    pub fn take_moves(&self) -> Vec<Move> {
        self.lock().take_moves()
    }

    /// How many of `hashes`, from the first, a lower tier holds, and which tier each
    /// is in; each is marked recently used there. Meant for the hashes right after a
    /// [`BlockPool::match_prefix`] hit.
    pub fn lower_prefix(&self, hashes: &[BlockHash]) -> Vec<Tier> {
        self.lock().lower.prefix(hashes)
    }

    /// Where a lower tier holds `hash` now (moves made since a lookup may have sent
    /// it further down, or out).
    pub fn locate_lower(&self, hash: BlockHash) -> Option<(Tier, Place)> {
        self.lock().lower.locate(hash)
    }

    /// Drops the block a lower tier holds at `place` because its bytes were lost (a
    /// failed disk write, a bad read): the slot is free again, and readers of the
    /// event log see the hash go.
    pub fn forget_lower(&self, place: Place) {
        self.lock().forget_lower(place);
    }

    /// Drops every block the lower tiers hold, and the copies still owed to them:
    /// their bytes can no longer be trusted (a stage group's later stage came back,
    /// its tiers perhaps empty).
    pub fn forget_lower_all(&self) {
        self.lock().forget_lower_all();
    }

    /// The events after number `after` of log `instance`, oldest first, or a gap:
    /// the reader must start over from [`BlockPool::snapshot`].
    pub fn events_since(&self, instance: u64, after: u64) -> Result<Vec<LoggedEvent>, EventGap> {
        self.lock().events.since(instance, after)
    }

    /// Every hash the pool can serve from, taken with the event number it reflects:
    /// a reader applies the events after that number on top.
    pub fn snapshot(&self) -> KvSnapshot {
        let state = self.lock();
        let (seq, hashes) = state.snapshot();
        KvSnapshot { instance: state.events.instance(), seq, hashes }
    }

    /// The events since the last call (tests follow one reader).
    #[cfg(test)]
    pub(crate) fn take_events(&self) -> Vec<crate::event::KvEvent> {
        self.lock().take_events()
    }

    /// Evicts every cached block (emitting `Removed` for each); blocks in use stay.
    pub fn clear_cache(&self) {
        self.lock().clear_cache();
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock()
    }

    pub(crate) fn shared(&self) -> &SharedState {
        &self.state
    }
}

impl fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockPool").field("block_size", &self.block_size).field("stats", &self.stats()).finish()
    }
}

#[cfg(test)]
mod tests;
