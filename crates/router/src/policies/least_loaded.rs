//! Least loaded: the worker with the fewest requests in flight; ties go to the first.

use super::{Ask, Candidate, Policy};

pub struct LeastLoaded;

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn pick(&self, _: &Ask<'_>, candidates: &[Candidate<'_>]) -> Option<usize> {
        (0..candidates.len()).min_by_key(|&i| candidates[i].load)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_support::{ask, cand};

    #[test]
    fn picks_the_fewest_in_flight_and_the_first_on_a_tie() {
        let p = LeastLoaded;
        assert_eq!(p.pick(&ask(), &[cand("a", 3), cand("b", 1), cand("c", 2)]), Some(1));
        assert_eq!(p.pick(&ask(), &[cand("a", 2), cand("b", 2)]), Some(0));
        assert_eq!(p.pick(&ask(), &[]), None);
    }
}
