//! Which prompt blocks a run has already sent, so that prefix-cache reuse in a
//! benchmark is always visible: a point whose prompts repeat earlier ones measures
//! the cache, not the server.
//!
//! Blocks are 16 ids, chained (a block's key covers every id before it), like a
//! server's prefix cache: a block counts as reused only when the whole prompt up to
//! its end was sent before.

pub use crate::metrics::BlockReuse;
use crate::record::RequestRecord;
use crate::rng::mix;
use crate::workload::Workload;
use std::collections::HashSet;

/// Tokens per block, pdserve's and vLLM's default KV block size.
pub const BLOCK: usize = 16;

/// Every block sent so far in one run (one server).
#[derive(Debug, Default)]
pub struct SentBlocks {
    seen: HashSet<u64>,
}

impl SentBlocks {
    /// Counts `ids`'s full blocks and those sent before, then remembers them all.
    pub fn record(&mut self, ids: &[u32]) -> BlockReuse {
        let mut r = BlockReuse::default();
        let mut key = 0u64;
        for block in ids.chunks_exact(BLOCK) {
            let mut parts = Vec::with_capacity(BLOCK + 1);
            parts.push(key);
            parts.extend(block.iter().map(|&t| u64::from(t)));
            key = mix(&parts);
            r.blocks += 1;
            r.reused += usize::from(!self.seen.insert(key));
        }
        r
    }

    /// [`SentBlocks::record`] of the prompt `r` sent, request `r.index` of `w`'s
    /// point `seed`: as the workload makes it, unless the record kept it (a prompt
    /// made of generated replies).
    pub fn record_sent(&mut self, w: &Workload, seed: u64, r: &RequestRecord) -> BlockReuse {
        match r.prompt_ids.is_empty() {
            true => self.record(&w.request(seed, r.index).prompt.ids()),
            false => self.record(&r.prompt_ids),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_prefix_counts_only_its_full_blocks() {
        let mut s = SentBlocks::default();
        let a: Vec<u32> = (0..40).collect();
        assert_eq!(s.record(&a), BlockReuse { blocks: 2, reused: 0 });
        let mut b: Vec<u32> = (0..32).collect();
        b.extend(100..120);
        assert_eq!(s.record(&b), BlockReuse { blocks: 3, reused: 2 });
        // The same block after a different history is a different block.
        let c: Vec<u32> = (16..48).collect();
        assert_eq!(s.record(&c), BlockReuse { blocks: 2, reused: 0 });
    }
}
