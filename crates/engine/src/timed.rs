//! A stand-in for the forward pass, for simulated workers and the twin: a step takes
//! the time a fitted cost model predicts for its shape, and each sampled token depends
//! only on the sequence before it. Everything else — the scheduler, chunked prefill,
//! the block pool, the prefix cache, preemption, KV export and import — is the engine's
//! own code, so a simulated worker batches and runs out of blocks exactly as a real one.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The work of one step, in the terms the cost model is linear in.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    /// Tokens computed (prompt chunks and decode tokens).
    pub tokens: f64,
    /// Attention pairs of prompt chunks: for each computed token, the positions it
    /// attends to.
    pub pairs: f64,
    /// Attention pairs of single-token (decode) rows, which read the cache once per
    /// token instead of sharing the reads across a chunk.
    pub decode_pairs: f64,
    /// Rows of logits computed and sampled.
    pub logits: f64,
}

impl StepShape {
    /// A sequence's share: `n` tokens from position `start`, sampled or not.
    pub fn chunk(start: usize, n: usize, logits: bool) -> StepShape {
        let logits = f64::from(u8::from(logits));
        let (s, k) = (start as f64, n as f64);
        // Token j (0-based) attends to start + j + 1 positions.
        let pairs = k * s + k * (k + 1.0) / 2.0;
        match n {
            1 => StepShape { tokens: 1.0, pairs: 0.0, decode_pairs: pairs, logits },
            _ => StepShape { tokens: k, pairs, decode_pairs: 0.0, logits },
        }
    }

    /// A decode step of `batch` sequences, each at `context` positions.
    pub fn decode(batch: usize, context: usize) -> StepShape {
        (0..batch).map(|_| StepShape::chunk(context, 1, true)).sum()
    }

    /// A lone prefill chunk of `n` tokens after `context` computed ones, sampled at its end.
    pub fn prefill(context: usize, n: usize) -> StepShape {
        StepShape::chunk(context, n, true)
    }
}

impl std::ops::Add for StepShape {
    type Output = StepShape;

    fn add(self, o: StepShape) -> StepShape {
        StepShape {
            tokens: self.tokens + o.tokens,
            pairs: self.pairs + o.pairs,
            decode_pairs: self.decode_pairs + o.decode_pairs,
            logits: self.logits + o.logits,
        }
    }
}

impl std::iter::Sum for StepShape {
    fn sum<I: Iterator<Item = StepShape>>(iter: I) -> StepShape {
        iter.fold(StepShape::default(), |a, b| a + b)
    }
}

/// Seconds a step takes: a fixed part (reading the weights, launching the step) plus
/// parts linear in its tokens, attention pairs (of chunks and of decode rows) and
/// logits rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepCost {
    pub fixed_s: f64,
    pub token_s: f64,
    pub pair_s: f64,
    pub decode_pair_s: f64,
    pub logits_s: f64,
}

impl StepCost {
    pub fn seconds(&self, s: &StepShape) -> f64 {
        let linear = self.token_s * s.tokens
            + self.pair_s * s.pairs
            + self.decode_pair_s * s.decode_pairs
            + self.logits_s * s.logits;
        (self.fixed_s + linear).max(0.0)
    }

    /// The coefficients in the order [`StepShape::terms`] lists the shape's parts.
    pub fn coefficients(&self) -> [f64; 5] {
        [self.fixed_s, self.token_s, self.pair_s, self.decode_pair_s, self.logits_s]
    }

    pub fn from_coefficients(c: [f64; 5]) -> StepCost {
        StepCost { fixed_s: c[0], token_s: c[1], pair_s: c[2], decode_pair_s: c[3], logits_s: c[4] }
    }
}

impl StepShape {
    /// 1 (for the fixed part), then tokens, chunk pairs, decode pairs, logits rows.
    pub fn terms(&self) -> [f64; 5] {
        [1.0, self.tokens, self.pairs, self.decode_pairs, self.logits]
    }
}

/// How a timed engine spends a step's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// Sleeps it: a worker process that must look real to its peers.
    Wall,
    /// Only counts it ([`crate::batch::Engine::take_charged`]); the caller advances a
    /// virtual clock.
    Virtual,
}

/// What a timed engine stands in for.
#[derive(Debug, Clone)]
pub struct TimedModel {
    pub vocab_size: usize,
    pub context_length: usize,
    /// Layers: a prefill exports its K/V one layer at a time, as a real one does.
    pub n_layers: usize,
    /// K (and V) values per token per layer that the stand-in stores and sends; the
    /// real model's figure divided by the scale the worker states.
    pub kv_values: usize,
    pub cost: StepCost,
    /// What copying a block back from a lower tier costs (none without tiers).
    pub restore: RestoreCost,
    pub clock: Clock,
}

/// Seconds a timed engine charges to copy one block (every layer's K and V, at the
/// real model's size) back into its pool from each lower tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RestoreCost {
    pub host_block_s: f64,
    pub disk_block_s: f64,
}

impl RestoreCost {
    pub fn seconds(&self, from: pdserve_kv::Place) -> f64 {
        match from {
            pdserve_kv::Place::Host(_) => self.host_block_s,
            pdserve_kv::Place::Disk(_) => self.disk_block_s,
            pdserve_kv::Place::Device(_) => 0.0,
        }
    }
}

/// Ordinary tokens of the usual vocabularies start about here (ids below are special
/// or byte tokens, which a frontend may print as nothing).
const FIRST_TOKEN: u32 = 1000;
const TOKEN_SPAN: u32 = 1000;

/// The token a timed engine samples after `tokens`: a function of the last token and
/// the position alone, so a request replayed elsewhere continues the same way.
pub fn next_token(tokens: &[u32], vocab: usize) -> u32 {
    let last = u64::from(tokens.last().copied().unwrap_or(0));
    let mut x = last.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (tokens.len() as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    let span = u64::from(TOKEN_SPAN);
    let vocab = vocab.max(1) as u64;
    let first = if vocab > u64::from(FIRST_TOKEN) + span { u64::from(FIRST_TOKEN) } else { 0 };
    ((first + x % span) % vocab) as u32
}

/// Sleeps `seconds` on the calling thread (wall clock only).
pub(crate) fn spend(clock: Clock, seconds: f64) {
    if clock == Clock::Wall && seconds > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(seconds));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_count_attention_pairs() {
        // Three tokens from scratch attend to 1, 2 and 3 positions.
        assert_eq!(StepShape::prefill(0, 3), StepShape { tokens: 3.0, pairs: 6.0, decode_pairs: 0.0, logits: 1.0 });
        // One decode token at 10 computed positions attends to 11.
        assert_eq!(StepShape::decode(2, 10), StepShape { tokens: 2.0, pairs: 0.0, decode_pairs: 22.0, logits: 2.0 });
    }

    #[test]
    fn cost_is_linear_in_the_shape() {
        let c = StepCost { fixed_s: 1.0, token_s: 2.0, pair_s: 3.0, decode_pair_s: 5.0, logits_s: 4.0 };
        let s = StepShape { tokens: 1.0, pairs: 1.0, decode_pairs: 1.0, logits: 1.0 };
        assert_eq!(c.seconds(&s), 15.0);
        assert_eq!(c.seconds(&StepShape::default()), 1.0);
    }

    #[test]
    fn tokens_depend_on_the_sequence_and_stay_in_range() {
        let a = next_token(&[5, 6, 7], 49152);
        assert_eq!(a, next_token(&[9, 6, 7], 49152), "only the last token and the length count");
        assert!((1000..2000).contains(&a));
        let spread: std::collections::HashSet<u32> = (0..100).map(|i| next_token(&[i], 49152)).collect();
        assert!(spread.len() > 50, "tokens vary: {}", spread.len());
        assert!(next_token(&[1], 300) < 300);
    }
}
