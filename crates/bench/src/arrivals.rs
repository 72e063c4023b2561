//! Open-loop arrival processes: the gaps between request sends.
//!
//! Poisson arrivals have exponential gaps. Gamma arrivals have gamma-distributed gaps
//! with shape `k` (the "burstiness") and the same mean `1/rate`: `k = 1` is Poisson,
//! `k < 1` burstier, `k > 1` more regular. Samplers are written here (inverse CDF for
//! the exponential, Marsaglia–Tsang for the gamma) to keep the crate dependency-free.

use crate::error::BenchError;
use crate::rng::Rng;
use std::str::FromStr;

/// Which distribution the inter-arrival gaps follow.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ArrivalKind {
    Poisson,
    Gamma,
}

impl FromStr for ArrivalKind {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "poisson" => Ok(Self::Poisson),
            "gamma" => Ok(Self::Gamma),
            _ => Err(BenchError::BadFlag(format!("unknown arrival process {s:?}: expected poisson or gamma"))),
        }
    }
}

/// An arrival process at a given mean rate (requests per second).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Arrivals {
    pub kind: ArrivalKind,
    pub rate: f64,
    /// Gamma shape; ignored for Poisson.
    pub burstiness: f64,
}

impl Arrivals {
    pub fn new(kind: ArrivalKind, rate: f64, burstiness: f64) -> Result<Self, BenchError> {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(BenchError::BadFlag(format!("request rate must be positive, got {rate}")));
        }
        if kind == ArrivalKind::Gamma && !(burstiness.is_finite() && burstiness > 0.0) {
            return Err(BenchError::BadFlag(format!("burstiness must be positive, got {burstiness}")));
        }
        Ok(Self { kind, rate, burstiness })
    }

    /// The next gap in seconds.
    pub fn next_gap(&self, rng: &mut Rng) -> f64 {
        match self.kind {
            ArrivalKind::Poisson => exponential(rng, self.rate),
            ArrivalKind::Gamma => gamma(rng, self.burstiness, 1.0 / (self.rate * self.burstiness)),
        }
    }
}

/// Exponential with the given rate (mean `1/rate`), by inverting the CDF.
pub fn exponential(rng: &mut Rng, rate: f64) -> f64 {
    -rng.next_f64_open().ln() / rate
}

/// Standard normal, Box–Muller (one of the pair is dropped: simplicity over speed).
pub fn standard_normal(rng: &mut Rng) -> f64 {
    let u1 = rng.next_f64_open();
    let u2 = rng.next_f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Gamma with shape `k` and scale `theta` (mean `k * theta`).
///
/// Marsaglia & Tsang (2000) for `k >= 1`; for `k < 1` the boost
/// `Gamma(k) = Gamma(k + 1) * U^(1/k)`.
pub fn gamma(rng: &mut Rng, k: f64, theta: f64) -> f64 {
    if k < 1.0 {
        let u = rng.next_f64_open();
        return gamma(rng, k + 1.0, theta) * u.powf(1.0 / k);
    }
    let d = k - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = standard_normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = rng.next_f64_open();
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v * theta;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean_and_var(xs: &[f64]) -> (f64, f64) {
        let n = xs.len() as f64;
        let m = xs.iter().sum::<f64>() / n;
        (m, xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n)
    }

    #[test]
    fn exponential_mean_is_one_over_rate() {
        let mut r = Rng::new(42);
        let xs: Vec<f64> = (0..200_000).map(|_| exponential(&mut r, 4.0)).collect();
        let (m, v) = mean_and_var(&xs);
        assert!((m - 0.25).abs() < 0.005, "mean {m}");
        assert!((v - 0.0625).abs() < 0.003, "variance {v}");
        assert!(xs.iter().all(|&x| x >= 0.0 && x.is_finite()));
    }

    #[test]
    fn gamma_mean_and_variance_match_shape_and_scale() {
        for &(k, theta) in &[(0.5, 2.0), (1.0, 1.0), (2.5, 0.4), (9.0, 0.1)] {
            let mut r = Rng::new(7);
            let xs: Vec<f64> = (0..200_000).map(|_| gamma(&mut r, k, theta)).collect();
            let (m, v) = mean_and_var(&xs);
            let (em, ev) = (k * theta, k * theta * theta);
            assert!((m - em).abs() < 0.02 * em, "k={k}: mean {m} vs {em}");
            assert!((v - ev).abs() < 0.05 * ev, "k={k}: variance {v} vs {ev}");
            assert!(xs.iter().all(|&x| x > 0.0 && x.is_finite()));
        }
    }

    #[test]
    fn arrival_gaps_average_one_over_rate_whatever_the_burstiness() {
        for arrivals in [
            Arrivals::new(ArrivalKind::Poisson, 8.0, 1.0),
            Arrivals::new(ArrivalKind::Gamma, 8.0, 0.25),
            Arrivals::new(ArrivalKind::Gamma, 8.0, 4.0),
        ] {
            let a = arrivals.unwrap();
            let mut r = Rng::new(11);
            let xs: Vec<f64> = (0..100_000).map(|_| a.next_gap(&mut r)).collect();
            let (m, _) = mean_and_var(&xs);
            assert!((m - 0.125).abs() < 0.004, "{a:?}: mean {m}");
        }
    }

    #[test]
    fn lower_burstiness_means_more_variable_gaps() {
        let var = |k: f64| {
            let a = Arrivals::new(ArrivalKind::Gamma, 1.0, k).unwrap();
            let mut r = Rng::new(5);
            mean_and_var(&(0..50_000).map(|_| a.next_gap(&mut r)).collect::<Vec<_>>()).1
        };
        assert!(var(0.5) > var(1.0) && var(1.0) > var(4.0));
    }

    #[test]
    fn bad_rates_and_names_are_refused() {
        assert!(Arrivals::new(ArrivalKind::Poisson, 0.0, 1.0).is_err());
        assert!(Arrivals::new(ArrivalKind::Gamma, 1.0, -1.0).is_err());
        assert!("weibull".parse::<ArrivalKind>().is_err());
        assert_eq!("gamma".parse::<ArrivalKind>().unwrap(), ArrivalKind::Gamma);
    }
}
