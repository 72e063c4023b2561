//! RAII handles for blocks: the only way to hold one, and the only way to give it back.

use std::fmt;

use crate::hash::{BlockHash, BlockId};
use crate::state::SharedState;

/// A block being written. Exactly one handle exists per mutable block (not `Clone`);
/// dropping it returns the block to the free list.
pub struct MutableBlock {
    id: BlockId,
    /// `Some` for the handle's whole life; `complete` takes it so `Drop` does nothing.
    pool: Option<SharedState>,
}

impl MutableBlock {
    pub(crate) fn new(pool: SharedState, id: BlockId) -> Self {
        Self { id, pool: Some(pool) }
    }

    /// Where the engine writes this block's K/V.
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// Seals the block: its K/V is written and will not change. Registers `hash` for
    /// prefix matching (and emits `Stored`) unless another block already holds that
    /// hash, in which case this copy stays unregistered and is freed, not cached,
    /// when its last reference drops.
    pub fn complete(mut self, hash: BlockHash, parent: Option<BlockHash>) -> ImmutableBlock {
        let Some(pool) = self.pool.take() else {
            unreachable!("a MutableBlock always holds its pool until completed");
        };
        pool.lock().complete(self.id, hash, parent);
        ImmutableBlock::new(pool, self.id, hash)
    }
}

impl Drop for MutableBlock {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.lock().release_mutable(self.id);
        }
    }
}

impl fmt::Debug for MutableBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("MutableBlock").field(&self.id).finish()
    }
}

/// A reference to a complete block. Clones share the block; when the last reference
/// drops, a registered block becomes cached and an unregistered one free.
pub struct ImmutableBlock {
    id: BlockId,
    hash: BlockHash,
    pool: SharedState,
}

impl ImmutableBlock {
    /// Wraps a reference the pool state has already counted.
    pub(crate) fn new(pool: SharedState, id: BlockId, hash: BlockHash) -> Self {
        Self { id, hash, pool }
    }

    /// Where the engine reads this block's K/V.
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// The chained hash this block was completed with.
    pub fn hash(&self) -> BlockHash {
        self.hash
    }

    /// The state of the pool this block belongs to.
    pub(crate) fn pool(&self) -> &SharedState {
        &self.pool
    }
}

impl Clone for ImmutableBlock {
    fn clone(&self) -> Self {
        self.pool.lock().add_ref(self.id);
        Self::new(self.pool.clone(), self.id, self.hash)
    }
}

impl Drop for ImmutableBlock {
    fn drop(&mut self) {
        self.pool.lock().release_ref(self.id);
    }
}

impl fmt::Debug for ImmutableBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImmutableBlock").field("id", &self.id).field("hash", &self.hash).finish()
    }
}
