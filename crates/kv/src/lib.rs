//! KV block bookkeeping for one worker: which block holds what, who owns it, and which
//! complete blocks can be reused as prefix cache.
//!
//! Place in the request path: under the engine's scheduler. The scheduler admits a
//! sequence by matching its prompt's block hashes against the pool
//! ([`BlockPool::match_prefix`]), then grows a [`BlockTable`] as tokens are computed.
//! The engine keeps the K/V bytes in per-layer arrays indexed by [`BlockId`]; this crate
//! never touches them. Routers follow the pool's numbered [`KvEvent`]s
//! ([`BlockPool::events_since`], resyncing from [`BlockPool::snapshot`]) to keep their
//! index of what each worker holds.
//!
//! Below the pool, optional host-RAM and disk tiers ([`BlockPool::with_tiers`]) keep
//! what it evicts; this crate tracks which hash is in which slot and tells the engine
//! which bytes to copy ([`Move`]), never touching them itself.
//!
//! Lifecycle (typestate): [`MutableBlock`] (being written) → [`ImmutableBlock`]
//! (complete, hashed, shareable) → cached (inside the pool, no handles, findable by
//! hash, evicted least-recently-used first). Handles give their block back in `Drop`
//! and there is no way to free a block by id, so leaks and double frees cannot be
//! written.

mod block;
mod event;
mod hash;
mod log;
mod lru;
mod pool;
mod state;
mod table;
mod tier;

#[cfg(test)]
mod proptests;

pub use block::{ImmutableBlock, MutableBlock};
pub use event::KvEvent;
pub use hash::{block_hashes, hash_block, BlockHash, BlockId};
pub use log::{EventGap, LoggedEvent};
pub use pool::{BlockPool, KvSnapshot, PoolExhausted, PoolStats};
pub use table::BlockTable;
pub use tier::{Move, Place, Tier, TierCounters, TierStats};
