//! One sequence's blocks, in order, and the rule that seals them as tokens are written.

use std::collections::VecDeque;
use std::fmt;

use crate::block::{ImmutableBlock, MutableBlock};
use crate::hash::{hash_block, BlockHash, BlockId};
use crate::pool::{BlockPool, PoolExhausted};

/// The blocks of one sequence: complete blocks first (adopted from the prefix cache or
/// sealed by [`commit`](Self::commit)), then the mutable blocks still being written.
/// Dropping the table releases every block.
pub struct BlockTable {
    pool: BlockPool,
    salt: u64,
    full: Vec<ImmutableBlock>,
    partial: VecDeque<MutableBlock>,
    adopted: usize,
}

impl BlockTable {
    /// An empty table drawing from `pool`; `salt` separates hash spaces (e.g. per model
    /// or LoRA adapter) so equal tokens under different salts never share blocks.
    pub fn new(pool: &BlockPool, salt: u64) -> Self {
        Self { pool: pool.clone(), salt, full: Vec::new(), partial: VecDeque::new(), adopted: 0 }
    }

    /// A table that starts with a prefix-cache hit (the result of
    /// [`BlockPool::match_prefix`]).
    pub fn with_prefix(pool: &BlockPool, salt: u64, blocks: Vec<ImmutableBlock>) -> Self {
        let mut table = Self::new(pool, salt);
        table.adopt_prefix(blocks);
        table
    }

    /// Takes over a prefix-cache hit as the table's first blocks. Only valid on an empty
    /// table; otherwise (a caller bug) the blocks are released and the table unchanged.
    pub fn adopt_prefix(&mut self, blocks: Vec<ImmutableBlock>) {
        let from_this_pool = blocks.iter().all(|b| b.pool().same(self.pool.shared()));
        debug_assert!(self.num_blocks() == 0, "adopt_prefix on a non-empty table");
        debug_assert!(from_this_pool, "adopt_prefix with blocks of another pool");
        if self.num_blocks() == 0 && from_this_pool {
            self.adopted = blocks.len();
            self.full = blocks;
        }
    }

    #[cfg(test)]
    pub(crate) fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The salt this table hashes its blocks with.
    pub fn salt(&self) -> u64 {
        self.salt
    }

    /// Blocks held, complete and mutable.
    pub fn num_blocks(&self) -> usize {
        self.full.len() + self.partial.len()
    }

    /// Complete (hashed, immutable) blocks; they come before all mutable ones.
    pub fn num_full_blocks(&self) -> usize {
        self.full.len()
    }

    /// Block ids in sequence order: what the engine's attention reads.
    pub fn block_ids(&self) -> Vec<BlockId> {
        let full = self.full.iter().map(ImmutableBlock::id);
        full.chain(self.partial.iter().map(MutableBlock::id)).collect()
    }

    /// The id of block `i`, if the table has that many blocks.
    pub fn id_at(&self, i: usize) -> Option<BlockId> {
        match self.full.get(i) {
            Some(block) => Some(block.id()),
            None => self.partial.get(i - self.full.len()).map(MutableBlock::id),
        }
    }

    /// Tokens the table's blocks can hold.
    pub fn capacity_tokens(&self) -> usize {
        self.num_blocks() * self.pool.block_size()
    }

    /// Tokens covered by blocks adopted from the prefix cache: their K/V need no compute.
    pub fn cached_prefix_tokens(&self) -> usize {
        self.adopted * self.pool.block_size()
    }

    /// Hashes of the complete blocks, in order.
    pub fn full_block_hashes(&self) -> Vec<BlockHash> {
        self.full.iter().map(ImmutableBlock::hash).collect()
    }

    /// Grows the table to hold `n_tokens`, allocating all missing blocks or none.
    pub fn ensure_capacity(&mut self, n_tokens: usize) -> Result<(), PoolExhausted> {
        let needed = n_tokens.div_ceil(self.pool.block_size());
        let missing = needed.saturating_sub(self.num_blocks());
        if missing > 0 {
            self.partial.extend(self.pool.allocate_many(missing)?);
        }
        Ok(())
    }

    /// Gives back the mutable blocks past those `n_tokens` need, last first: where a
    /// speculative step wrote drafted tokens that were rejected. Complete blocks stay
    /// (they hold committed tokens), so the table never shrinks below them.
    pub fn truncate(&mut self, n_tokens: usize) {
        let needed = n_tokens.div_ceil(self.pool.block_size());
        while self.num_blocks() > needed && self.partial.pop_back().is_some() {}
    }

    /// Records that K/V is written for every position `< tokens.len()`, where `tokens`
    /// is the sequence's full token list. Each block that is now full and still mutable
    /// is sealed with a hash chained from the block before it, which makes it findable
    /// by later requests with the same prefix.
    pub fn commit(&mut self, tokens: &[u32]) {
        let block_size = self.pool.block_size();
        let n_full = tokens.len() / block_size;
        debug_assert!(n_full <= self.num_blocks(), "commit beyond capacity");
        while self.full.len() < n_full {
            let Some(block) = self.partial.pop_front() else {
                break;
            };
            let start = self.full.len() * block_size;
            let parent = self.full.last().map(ImmutableBlock::hash);
            let hash = hash_block(parent, &tokens[start..start + block_size], self.salt);
            self.full.push(block.complete(hash, parent));
        }
    }
}

impl Drop for BlockTable {
    /// Releases the last block first, so a sequence's tail reaches the LRU before its
    /// head and is evicted first: a chain's head is what other prompts share, and
    /// without it the blocks after it can never be matched.
    fn drop(&mut self) {
        while self.partial.pop_back().is_some() {}
        while self.full.pop().is_some() {}
    }
}

impl fmt::Debug for BlockTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockTable")
            .field("salt", &self.salt)
            .field("full", &self.full.len())
            .field("adopted", &self.adopted)
            .field("block_ids", &self.block_ids())
            .finish()
    }
}

#[cfg(test)]
mod tests;
