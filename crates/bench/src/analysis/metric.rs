//! The metrics that are compared and plotted, and which direction is better.

use crate::metrics::Summary;

/// A per-point metric read from a [`Summary`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Metric {
    /// Output tokens per second.
    Throughput,
    /// Requests per second meeting both SLOs.
    Goodput,
    TtftP50,
    TtftP99,
    TpotP50,
    TpotP99,
    ItlP99,
}

impl Metric {
    /// The metrics the crossover is computed for.
    pub const CROSSOVER: [Metric; 5] = [Self::Throughput, Self::Goodput, Self::TtftP99, Self::TpotP99, Self::ItlP99];
    /// The metrics that get a plot.
    pub const PLOTTED: [Metric; 6] =
        [Self::Throughput, Self::TtftP50, Self::TtftP99, Self::TpotP50, Self::TpotP99, Self::Goodput];

    pub fn value(self, s: &Summary) -> Option<f64> {
        let v = match self {
            Self::Throughput => Some(s.output_token_throughput),
            Self::Goodput => Some(s.goodput),
            Self::TtftP50 => s.ttft_ms.p50,
            Self::TtftP99 => s.ttft_ms.p99,
            Self::TpotP50 => s.tpot_ms.p50,
            Self::TpotP99 => s.tpot_ms.p99,
            Self::ItlP99 => s.itl_ms.p99,
        };
        // Latencies of a point where nothing succeeded do not exist; throughputs are 0.
        v.filter(|x| x.is_finite())
    }

    pub fn higher_is_better(self) -> bool {
        matches!(self, Self::Throughput | Self::Goodput)
    }

    /// File-name form.
    pub fn slug(self) -> &'static str {
        match self {
            Self::Throughput => "throughput",
            Self::Goodput => "goodput",
            Self::TtftP50 => "ttft-p50",
            Self::TtftP99 => "ttft-p99",
            Self::TpotP50 => "tpot-p50",
            Self::TpotP99 => "tpot-p99",
            Self::ItlP99 => "itl-p99",
        }
    }

    /// Axis label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Throughput => "output tokens/s",
            Self::Goodput => "goodput (requests/s within SLO)",
            Self::TtftP50 => "TTFT p50 (ms)",
            Self::TtftP99 => "TTFT p99 (ms)",
            Self::TpotP50 => "TPOT p50 (ms)",
            Self::TpotP99 => "TPOT p99 (ms)",
            Self::ItlP99 => "ITL p99 (ms)",
        }
    }

    /// Is `a` strictly better than `b`? A value beats a missing one.
    pub fn better(self, a: Option<f64>, b: Option<f64>) -> bool {
        match (a, b) {
            (Some(a), Some(b)) if self.higher_is_better() => a > b,
            (Some(a), Some(b)) => a < b,
            (Some(_), None) => true,
            _ => false,
        }
    }

    /// The best of several values (missing ones ignored).
    pub fn best(self, values: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
        values.into_iter().flatten().reduce(|a, b| if self.better(Some(b), Some(a)) { b } else { a })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direction_and_best() {
        assert!(Metric::Goodput.better(Some(2.0), Some(1.0)));
        assert!(Metric::TtftP99.better(Some(1.0), Some(2.0)));
        assert!(!Metric::TtftP99.better(Some(2.0), Some(2.0)));
        assert!(Metric::ItlP99.better(Some(9.0), None));
        assert!(!Metric::ItlP99.better(None, Some(9.0)));
        assert_eq!(Metric::Throughput.best([Some(1.0), None, Some(3.0)]), Some(3.0));
        assert_eq!(Metric::TpotP99.best([Some(1.0), None, Some(3.0)]), Some(1.0));
        assert_eq!(Metric::TpotP99.best([None, None]), None);
    }
}
