//! Durations as logs and records show them.

use std::time::Duration;

/// `d` in milliseconds, to the hundredth: a log line reads `1571.4`, not
/// `1571.3950049999999`.
pub fn millis(d: Duration) -> f64 {
    round_ms(d.as_secs_f64())
}

/// `seconds` in milliseconds, to the hundredth.
pub fn round_ms(seconds: f64) -> f64 {
    (seconds * 1e5).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milliseconds_are_rounded_to_the_hundredth() {
        assert_eq!(millis(Duration::from_nanos(1_571_395_004_999)), 1_571_395.0);
        assert_eq!(round_ms(1.571_395_004_999_999_9), 1571.4);
        assert_eq!(round_ms(0.000_012_3), 0.01);
        assert_eq!(round_ms(0.0), 0.0);
    }
}
