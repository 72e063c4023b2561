//! The prefix cache's vocabulary every hop shares: a block's chained hash, the
//! tiers a block can sit in, and the events and counters a worker reports of them.
//! The bookkeeping behind them is the `kv` crate's.

/// Identity of a complete block's contents together with everything before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct BlockHash(pub u64);

/// Where a block's K/V can be found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// The engine's KV pool: attention reads it directly.
    Device,
    /// Host RAM beside the pool (`--kv-host-gb`).
    Host,
    /// Local disk (`--kv-disk-dir`, `--kv-disk-gb`).
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    /// The label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// Block counts of one lower tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TierStats {
    /// Slots the tier has.
    pub capacity: usize,
    /// Slots holding a block.
    pub used: usize,
}

/// A KV pool's blocks by state; `free + used + cached == total` always holds (for
/// the pool; the lower tiers hold only reusable blocks, nothing runs from them, and
/// count their own slots). The engine counts them; a worker's stats carry them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolStats {
    /// Blocks in the pool (absent from workers that predate it: 0).
    #[serde(default)]
    pub total: usize,
    /// Hold no data anyone can find.
    pub free: usize,
    /// Held by at least one handle (mutable or immutable).
    pub used: usize,
    /// Registered complete blocks with no handle: reusable by hash, evictable.
    pub cached: usize,
    /// Host-RAM tier (tier 2); all zero when there is none.
    #[serde(default)]
    pub host: TierStats,
    /// Disk tier (tier 3); all zero when there is none.
    #[serde(default)]
    pub disk: TierStats,
}

/// What an engine's lower tiers did since it started, for its stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TierCounters {
    /// Blocks copied down into the host tier / the disk tier.
    pub stored_host: u64,
    pub stored_disk: u64,
    /// Blocks copied back into the pool from each tier, and the seconds it took.
    pub restored_host: u64,
    pub restored_disk: u64,
    pub restore_seconds_host: f64,
    pub restore_seconds_disk: f64,
    /// Disk writes that failed (a full disk, say): their blocks leave the tier.
    #[serde(default)]
    pub disk_write_failures: u64,
    /// Disk blocks that could not be read back or failed their checksum: they leave
    /// the tier and are computed again.
    #[serde(default)]
    pub disk_corrupt: u64,
}

impl TierCounters {
    /// Records a restore of one block from `tier`.
    pub fn restored(&mut self, tier: Tier, seconds: f64) {
        let (blocks, secs) = match tier {
            Tier::Host => (&mut self.restored_host, &mut self.restore_seconds_host),
            Tier::Disk => (&mut self.restored_disk, &mut self.restore_seconds_disk),
            Tier::Device => return,
        };
        *blocks += 1;
        *secs += seconds;
    }

    /// Measured seconds to copy one block back from `tier`, once any was.
    pub fn seconds_per_block(&self, tier: Tier) -> Option<f64> {
        let (blocks, secs) = match tier {
            Tier::Host => (self.restored_host, self.restore_seconds_host),
            Tier::Disk => (self.restored_disk, self.restore_seconds_disk),
            Tier::Device => return Some(0.0),
        };
        (blocks > 0).then(|| secs / blocks as f64)
    }
}

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
