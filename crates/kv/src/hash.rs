//! Block ids and chained block hashes.

/// Index of a block in the engine's per-layer K/V arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

pub use pdserve_types::BlockHash;

impl BlockId {
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

/// Hash of one block, chained through `parent` so that it covers every earlier block.
///
/// The value is part of the protocol: the router compares hashes computed by the
/// frontend with hashes reported by workers, possibly in other processes and builds.
/// So it is defined here over integer values (no `std` hasher, whose output may
/// change between Rust versions), and a golden test pins it.
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32], salt: u64) -> BlockHash {
    let mut h = mix(salt ^ SEED);
    // Tag the parent's presence so `None` cannot collide with some `Some(x)`.
    h = match parent {
        None => mix(h),
        Some(p) => mix(mix(h ^ 1) ^ p.0),
    };
    h = mix(h ^ tokens.len() as u64);
    // Two tokens per round: the mixer is a bijection, so each round is collision-free
    // for a fixed state, and halving the rounds halves the cost.
    let mut pairs = tokens.chunks_exact(2);
    for pair in &mut pairs {
        h = mix(h ^ (u64::from(pair[0]) | (u64::from(pair[1]) << 32)));
    }
    if let [last] = pairs.remainder() {
        h = mix(h ^ u64::from(*last));
    }
    BlockHash(h)
}

/// Hashes of every full block of `tokens`, chained from the first.
///
/// This is what a sequence's blocks will be registered under once committed, so the
/// scheduler (and the router) can look a prompt up before computing it.
pub fn block_hashes(tokens: &[u32], block_size: usize, salt: u64) -> Vec<BlockHash> {
    let mut parent = None;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            let h = hash_block(parent, block, salt);
            parent = Some(h);
            h
        })
        .collect()
}

const SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 step: add the golden-ratio increment, then the 64-bit finalizer.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(SEED);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_values_are_stable() {
        // If these change, every deployed router and worker disagree: bump deliberately.
        let a = hash_block(None, &[1, 2, 3, 4], 0);
        let b = hash_block(Some(a), &[5, 6, 7], 42);
        assert_eq!(a, BlockHash(GOLDEN_A));
        assert_eq!(b, BlockHash(GOLDEN_B));
    }

    const GOLDEN_A: u64 = 10928958248866720029;
    const GOLDEN_B: u64 = 8240662266366408675;

    #[test]
    fn inputs_all_matter() {
        let base = hash_block(None, &[1, 2, 3, 4], 0);
        assert_ne!(base, hash_block(None, &[1, 2, 3, 5], 0));
        assert_ne!(base, hash_block(None, &[2, 1, 3, 4], 0));
        assert_ne!(base, hash_block(None, &[1, 2, 3, 4], 1));
        assert_ne!(base, hash_block(Some(BlockHash(0)), &[1, 2, 3, 4], 0));
        assert_ne!(base, hash_block(None, &[1, 2, 3, 4, 0], 0));
        assert_ne!(hash_block(None, &[], 0), hash_block(None, &[0], 0));
    }

    #[test]
    fn block_hashes_chain_and_skip_partial_block() {
        let tokens = [1, 2, 3, 4, 5, 6, 7];
        let hs = block_hashes(&tokens, 3, 9);
        assert_eq!(hs.len(), 2);
        assert_eq!(hs[0], hash_block(None, &[1, 2, 3], 9));
        assert_eq!(hs[1], hash_block(Some(hs[0]), &[4, 5, 6], 9));
    }
}
