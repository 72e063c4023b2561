//! The ratios the issue asks for, per workload and sweep point:
//!
//! - disaggregated vs replicated (best of each family) p99 ITL and goodput, at
//!   points from `min_x` on (C ≥ 8 in the report);
//! - `auto` as a percentage of the best of replicated and disaggregated, for output
//!   throughput and goodput (100 % = auto matches the better family).

/// Disaggregated ÷ replicated at one point.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct FamilyRatio {
    pub workload: String,
    pub x: f64,
    /// < 1: disaggregated has the lower (better) p99 ITL.
    pub itl_p99_ratio: Option<f64>,
    /// > 1: disaggregated has the higher goodput.
    pub goodput_ratio: Option<f64>,
}

/// Auto, and auto under the planner, as percentages of the best family at one point.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AutoVsBest {
    pub workload: String,
    pub x: f64,
    pub throughput_pct: Option<f64>,
    pub goodput_pct: Option<f64>,
    pub planner_throughput_pct: Option<f64>,
    pub planner_goodput_pct: Option<f64>,
}

/// `a / b` when both exist and `b` is not zero.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 => Some(a / b),
        _ => None,
    }
}

/// 100 × auto / best, where best is the larger of the two families' values.
pub fn auto_pct(auto: Option<f64>, replicated: Option<f64>, disaggregated: Option<f64>) -> Option<f64> {
    let best = match (replicated, disaggregated) {
        (Some(r), Some(d)) => Some(r.max(d)),
        (r, d) => r.or(d),
    };
    ratio(auto, best).map(|r| 100.0 * r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_and_percentages() {
        assert_eq!(ratio(Some(1.0), Some(4.0)), Some(0.25));
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(1.0)), None);
        assert_eq!(auto_pct(Some(90.0), Some(100.0), Some(50.0)), Some(90.0));
        assert_eq!(auto_pct(Some(60.0), None, Some(50.0)), Some(120.0));
        assert_eq!(auto_pct(Some(1.0), None, None), None);
    }
}
