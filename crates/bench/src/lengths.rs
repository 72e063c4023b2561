//! Input and output lengths: fixed, or drawn per request.
//!
//! Spec strings (flags `--input-len`, `--output-len`):
//! - `512`        exactly 512
//! - `256..768`   uniform over 256..=768
//! - `512~64`     normal with mean 512 and standard deviation 64, rounded, at least 1

use crate::arrivals::standard_normal;
use crate::error::BenchError;
use crate::rng::Rng;
use std::fmt;
use std::str::FromStr;

/// How long a prompt or an answer is, in tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LengthSpec {
    Fixed(u32),
    Uniform { min: u32, max: u32 },
    Normal { mean: f64, std: f64 },
}

impl LengthSpec {
    /// One length, at least 1 token.
    pub fn sample(&self, rng: &mut Rng) -> u32 {
        match *self {
            Self::Fixed(n) => n,
            Self::Uniform { min, max } => rng.range(u64::from(min), u64::from(max) + 1) as u32,
            Self::Normal { mean, std } => (mean + std * standard_normal(rng)).round().max(1.0) as u32,
        }
    }

    /// The mean length, for labels and sizing.
    pub fn mean(&self) -> f64 {
        match *self {
            Self::Fixed(n) => f64::from(n),
            Self::Uniform { min, max } => (f64::from(min) + f64::from(max)) / 2.0,
            Self::Normal { mean, .. } => mean,
        }
    }
}

impl fmt::Display for LengthSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fixed(n) => write!(f, "{n}"),
            Self::Uniform { min, max } => write!(f, "{min}..{max}"),
            Self::Normal { mean, std } => write!(f, "{mean}~{std}"),
        }
    }
}

impl serde::Serialize for LengthSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

fn positive(s: &str, whole: &str) -> Result<u32, BenchError> {
    match s.trim().parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(BenchError::BadFlag(format!("bad length {whole:?}: {s:?} is not a positive integer"))),
    }
}

impl FromStr for LengthSpec {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some((a, b)) = s.split_once("..") {
            let (min, max) = (positive(a, s)?, positive(b, s)?);
            if min > max {
                return Err(BenchError::BadFlag(format!("bad length {s:?}: minimum above maximum")));
            }
            return Ok(Self::Uniform { min, max });
        }
        if let Some((a, b)) = s.split_once('~') {
            let mean = f64::from(positive(a, s)?);
            let std = b.trim().parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0);
            let std = std.ok_or_else(|| BenchError::BadFlag(format!("bad length {s:?}: bad standard deviation")))?;
            return Ok(Self::Normal { mean, std });
        }
        positive(s, s).map(Self::Fixed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print_back() {
        for s in ["512", "256..768", "512~64"] {
            assert_eq!(s.parse::<LengthSpec>().unwrap().to_string(), s);
        }
        for bad in ["", "0", "-3", "9..2", "a..b", "512~x", "1.5"] {
            assert!(bad.parse::<LengthSpec>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn samples_stay_in_their_distribution() {
        let mut r = Rng::new(1);
        let u = "10..12".parse::<LengthSpec>().unwrap();
        let xs: Vec<u32> = (0..3000).map(|_| u.sample(&mut r)).collect();
        assert!(xs.iter().all(|x| (10..=12).contains(x)));
        assert!(xs.contains(&10) && xs.contains(&12));
        let n = "100~10".parse::<LengthSpec>().unwrap();
        let mean = (0..20_000).map(|_| f64::from(n.sample(&mut r))).sum::<f64>() / 20_000.0;
        assert!((mean - 100.0).abs() < 1.0);
        assert_eq!(LengthSpec::Fixed(7).sample(&mut r), 7);
        assert!(LengthSpec::Normal { mean: 1.0, std: 50.0 }.sample(&mut r) >= 1);
    }
}
