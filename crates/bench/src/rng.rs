//! Reproducible randomness for workloads: the project's seeded generator
//! ([`pdserve_types::rng`]) and [`mix`], which derives independent sub-stream seeds
//! from the user's `--seed`.

pub use pdserve_types::rng::{splitmix64, Rng};

/// Hashes several values into one seed, so sub-streams (per point, per request, per
/// prefix) are independent yet fully determined by the user's seed.
///
/// Each part goes through the full splitmix64 finalizer before it meets the running
/// hash, and the running hash is finalized again after every part: a XOR-and-add
/// fold lets `(point 0, request 1)` and `(point 1, request 0)` land on the same seed,
/// so sweep points would resend each other's prompts.
pub fn mix(parts: &[u64]) -> u64 {
    let mut h = finalize(0x5eed ^ parts.len() as u64);
    for (i, &p) in parts.iter().enumerate() {
        let part = finalize(p ^ (i as u64).wrapping_mul(0xa076_1d64_78bd_642f));
        h = finalize(h.rotate_left(23) ^ part);
    }
    h
}

/// splitmix64's output function: a bijection that spreads every input bit.
fn finalize(x: u64) -> u64 {
    let mut s = x.wrapping_sub(0x9e37_79b9_7f4a_7c15);
    splitmix64(&mut s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn mix_depends_on_every_part() {
        assert_ne!(mix(&[1, 2, 3]), mix(&[1, 2, 4]));
        assert_ne!(mix(&[1, 2]), mix(&[2, 1]));
        assert_ne!(mix(&[0, 1, 0]), mix(&[0, 0, 1]));
        assert_eq!(mix(&[5, 6]), mix(&[5, 6]));
    }

    #[test]
    fn neighbouring_points_and_requests_never_share_a_seed() {
        let mut seen = HashSet::new();
        for seed in [0, 1, 42] {
            for point in 0..64 {
                for index in 0..256 {
                    assert!(seen.insert(mix(&[seed, point, index])), "({seed}, {point}, {index})");
                }
            }
        }
    }
}
