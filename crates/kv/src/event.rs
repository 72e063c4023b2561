//! Events for the router's prefix index.

use crate::hash::BlockHash;
use crate::tier::Tier;

/// A change in the set of block hashes this worker can serve a prefix from, in one
/// tier.
///
/// `Stored` is emitted once per hash and tier when a block becomes findable there;
/// `Removed` when it is evicted from that tier. Duplicates of an already registered
/// hash emit nothing, so a consumer that applies the events in order holds exactly
/// the worker's registered set of each tier. A hash may be held in several tiers at
/// once (a block copied back into the pool stays in the tier it came from).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum KvEvent {
    /// A complete block with this hash became findable in `tier`.
    Stored {
        /// The block's chained hash.
        hash: BlockHash,
        /// The previous block's hash; `None` for a sequence's first block.
        parent: Option<BlockHash>,
        tier: Tier,
    },
    /// The block with this hash left `tier` (evicted or moved down).
    Removed {
        /// The evicted block's hash.
        hash: BlockHash,
        tier: Tier,
    },
}
