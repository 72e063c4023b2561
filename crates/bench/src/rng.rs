//! Reproducible randomness for workloads: the project's seeded generator
//! ([`pdserve_types::rng`]) and [`mix`], which derives independent sub-stream seeds
//! from the user's `--seed`.

pub use pdserve_types::rng::{splitmix64, Rng};

/// Mixes several values into one seed, so sub-streams (per point, per request, per
/// prefix) are independent yet fully determined by the user's seed.
pub fn mix(parts: &[u64]) -> u64 {
    let mut s = 0x5eed_u64;
    let mut out = 0;
    for &p in parts {
        s ^= p;
        out = splitmix64(&mut s);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_depends_on_every_part() {
        assert_ne!(mix(&[1, 2, 3]), mix(&[1, 2, 4]));
        assert_ne!(mix(&[1, 2]), mix(&[2, 1]));
        assert_eq!(mix(&[5, 6]), mix(&[5, 6]));
    }
}
