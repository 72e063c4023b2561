//! Round robin: each request to the next worker in turn, whatever their load.

use super::{Ask, Candidate, Policy};
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Default)]
pub struct RoundRobin {
    turn: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn pick(&self, _: &Ask<'_>, candidates: &[Candidate<'_>]) -> Option<usize> {
        if candidates.is_empty() {
            return None;
        }
        Some(self.turn.fetch_add(1, Ordering::Relaxed) % candidates.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_support::{ask, cand};

    #[test]
    fn takes_turns_whatever_the_load() {
        let p = RoundRobin::default();
        let c = [cand("a", 9), cand("b", 0), cand("c", 5)];
        let picks: Vec<_> = (0..6).map(|_| p.pick(&ask(), &c)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2].map(Some));
        assert_eq!(p.pick(&ask(), &[]), None);
    }
}
