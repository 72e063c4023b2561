//! A sweep point: how requests are issued (closed loop at a concurrency, open loop at
//! a rate, or a trace's own timestamps) and when issuing stops.

use crate::arrivals::Arrivals;

/// How requests are issued during a point.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Issue {
    /// `concurrency` clients, each sending its next request when the previous ends.
    Closed { concurrency: usize },
    /// Requests sent at the arrival process's times, however many are in flight.
    Open { arrivals: Arrivals },
    /// Requests sent at the trace's timestamps divided by `speedup`.
    Trace { speedup: f64 },
}

/// When a point stops issuing requests. Requests in flight then finish (each bounded
/// by the request timeout).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Bounds {
    /// Never more than this many requests.
    pub max_requests: usize,
    /// Issue at least this many even past `max_seconds` (enough samples per point).
    pub min_requests: usize,
    /// Stop issuing once this much time has passed since the point began.
    pub max_seconds: f64,
}

impl Bounds {
    /// Closed loop at concurrency `c`: at least `2c` requests, at most
    /// `max(requests, 2c)`, and stop issuing after `seconds` once `2c` are out.
    pub fn closed(c: usize, requests: usize, seconds: f64) -> Self {
        let floor = 2 * c.max(1);
        Self { max_requests: requests.max(floor), min_requests: floor, max_seconds: seconds }
    }

    /// Open loop or trace: at most `requests` and `seconds`, no floor.
    pub fn open(requests: usize, seconds: f64) -> Self {
        Self { max_requests: requests, min_requests: 0, max_seconds: seconds }
    }

    /// May request `i` (0-based) be issued `elapsed` seconds into the point?
    pub fn may_issue(&self, i: usize, elapsed: f64) -> bool {
        i < self.max_requests && (i < self.min_requests || elapsed < self.max_seconds)
    }
}

/// One point of a sweep.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PointPlan {
    pub label: String,
    pub issue: Issue,
    pub bounds: Bounds,
    /// Selects this point's prompts (see `Workload::request`).
    pub seed: u64,
}

impl PointPlan {
    /// The x value of plots and crossovers: the concurrency or the rate.
    pub fn x(&self) -> Option<f64> {
        match &self.issue {
            Issue::Closed { concurrency } => Some(*concurrency as f64),
            Issue::Open { arrivals } => Some(arrivals.rate),
            Issue::Trace { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_bounds_keep_a_floor_of_two_per_client() {
        let b = Bounds::closed(8, 10, 30.0);
        assert_eq!((b.max_requests, b.min_requests), (16, 16));
        assert!(b.may_issue(15, 100.0));
        assert!(!b.may_issue(16, 0.0));
        let b = Bounds::closed(1, 10, 30.0);
        assert!(b.may_issue(5, 1.0));
        assert!(!b.may_issue(5, 31.0));
        assert!(b.may_issue(1, 31.0));
    }

    #[test]
    fn open_bounds_stop_at_either_limit() {
        let b = Bounds::open(3, 1.0);
        assert!(b.may_issue(0, 0.5));
        assert!(!b.may_issue(0, 1.5));
        assert!(!b.may_issue(3, 0.0));
    }
}
