//! Where disaggregation overtakes replication.
//!
//! For one workload and one metric, at each sweep point take the best value over the
//! disaggregated topologies and the best over the replicated ones. The crossover is
//! the smallest point at which disaggregated is strictly better *and stays better at
//! every higher point of the sweep*; if there is none, "none in range". A point where
//! one family has no value (every request failed) counts for the family that has one.

use super::metric::Metric;

/// The crossover of one workload × metric.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Crossover {
    pub workload: String,
    pub metric: Metric,
    /// The sweep value (concurrency or rate) where disaggregated takes over for good.
    pub at: Option<f64>,
}

/// `points`: (x, best disaggregated, best replicated), in any order.
pub fn crossover(metric: Metric, points: &[(f64, Option<f64>, Option<f64>)]) -> Option<f64> {
    let mut sorted = points.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut at = None;
    for &(x, d, r) in sorted.iter().rev() {
        if !metric.better(d, r) {
            break;
        }
        at = Some(x);
    }
    at
}

impl Crossover {
    /// "C=8" / "rate=2" or "none in range".
    pub fn describe(&self, x_name: &str) -> String {
        match self.at {
            Some(x) => format!("{x_name}={x}"),
            None => "none in range".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_point_from_which_disaggregated_stays_better() {
        // Goodput: replicated wins at 1 and 2, disaggregated from 4 on.
        let pts = [
            (1.0, Some(1.0), Some(2.0)),
            (2.0, Some(1.5), Some(2.0)),
            (4.0, Some(3.0), Some(2.0)),
            (8.0, Some(3.0), Some(1.0)),
        ];
        assert_eq!(crossover(Metric::Goodput, &pts), Some(4.0));
        // Order of the input does not matter.
        let mut shuffled = pts;
        shuffled.reverse();
        assert_eq!(crossover(Metric::Goodput, &shuffled), Some(4.0));
    }

    #[test]
    fn a_lead_lost_again_is_no_crossover() {
        let pts = [(1.0, Some(5.0), Some(9.0)), (2.0, Some(10.0), Some(9.0)), (4.0, Some(10.0), Some(9.0))];
        // Lower is better for TTFT: disaggregated better at 1 only, then worse.
        assert_eq!(crossover(Metric::TtftP99, &pts), None);
        // Higher is better for throughput: better from 2 on.
        assert_eq!(crossover(Metric::Throughput, &pts), Some(2.0));
        // Better everywhere: the first point.
        assert_eq!(
            crossover(Metric::Throughput, &[(1.0, Some(2.0), Some(1.0)), (2.0, Some(2.0), Some(1.0))]),
            Some(1.0)
        );
        // Ties are not "better".
        assert_eq!(crossover(Metric::ItlP99, &[(1.0, Some(2.0), Some(2.0))]), None);
        assert_eq!(crossover(Metric::ItlP99, &[]), None);
    }

    #[test]
    fn missing_values_count_for_the_family_that_has_one() {
        let pts = [(1.0, Some(5.0), Some(4.0)), (2.0, Some(5.0), None), (4.0, None, Some(1.0))];
        assert_eq!(crossover(Metric::ItlP99, &pts), None);
        let pts = [(1.0, Some(5.0), Some(4.0)), (2.0, Some(5.0), None)];
        assert_eq!(crossover(Metric::ItlP99, &pts), Some(2.0));
        let c = Crossover { workload: "w".into(), metric: Metric::ItlP99, at: Some(2.0) };
        assert_eq!(c.describe("C"), "C=2");
        assert_eq!(Crossover { at: None, ..c }.describe("C"), "none in range");
    }
}
