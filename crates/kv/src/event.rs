//! Events for the router's prefix index.

use crate::hash::BlockHash;

/// A change in the set of block hashes this pool can serve from its prefix cache.
///
/// `Stored` is emitted once per hash when a block is first registered; `Removed` when
/// that block is evicted. Duplicates of an already registered hash emit nothing, so a
/// consumer that applies the events in order holds exactly the pool's registered set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum KvEvent {
    /// A complete block with this hash became findable.
    Stored {
        /// The block's chained hash.
        hash: BlockHash,
        /// The previous block's hash; `None` for a sequence's first block.
        parent: Option<BlockHash>,
    },
    /// The block with this hash was evicted; its id now holds other data.
    Removed {
        /// The evicted block's hash.
        hash: BlockHash,
    },
}
