//! Running sums over an engine's pure decode steps (no prompt tokens in the batch),
//! enough to fit the step time as a line in the batch size: the planner's decode
//! cost, measured rather than assumed.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DecodeSteps {
    pub steps: u64,
    /// Sum of the batch sizes, and of their squares.
    pub rows: u64,
    pub rows_sq: u64,
    /// Sum of the step times, and of batch size × step time.
    pub seconds: f64,
    pub row_seconds: f64,
}

impl DecodeSteps {
    pub fn record(&mut self, batch: usize, seconds: f64) {
        let b = batch as u64;
        self.steps += 1;
        self.rows += b;
        self.rows_sq += b * b;
        self.seconds += seconds;
        self.row_seconds += b as f64 * seconds;
    }

    /// The sums of `self` less an earlier reading of the same counter.
    pub fn since(&self, earlier: &DecodeSteps) -> DecodeSteps {
        DecodeSteps {
            steps: self.steps.saturating_sub(earlier.steps),
            rows: self.rows.saturating_sub(earlier.rows),
            rows_sq: self.rows_sq.saturating_sub(earlier.rows_sq),
            seconds: (self.seconds - earlier.seconds).max(0.0),
            row_seconds: (self.row_seconds - earlier.row_seconds).max(0.0),
        }
    }

    pub fn add(&mut self, other: &DecodeSteps) {
        self.steps += other.steps;
        self.rows += other.rows;
        self.rows_sq += other.rows_sq;
        self.seconds += other.seconds;
        self.row_seconds += other.row_seconds;
    }

    /// Step time as `(fixed, per_row)` seconds by least squares; with one batch size
    /// only, the whole time is taken as per row. `None` before any step.
    pub fn fit(&self) -> Option<(f64, f64)> {
        if self.steps == 0 || self.rows == 0 {
            return None;
        }
        let n = self.steps as f64;
        let (sx, sxx, sy, sxy) = (self.rows as f64, self.rows_sq as f64, self.seconds, self.row_seconds);
        let var = n * sxx - sx * sx;
        if var <= 1e-9 * n * sxx {
            return Some((0.0, sy / sx));
        }
        let per_row = (n * sxy - sx * sy) / var;
        let fixed = (sy - per_row * sx) / n;
        // Noise may tilt the line below zero at either end: keep both parts physical.
        if per_row <= 0.0 || fixed < 0.0 {
            return Some((0.0, sy / sx));
        }
        Some((fixed, per_row))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_line_and_differences_subtract() {
        let mut s = DecodeSteps::default();
        for b in [1usize, 2, 4, 8, 16] {
            s.record(b, 0.002 + 0.0015 * b as f64);
        }
        let (a, b) = s.fit().unwrap();
        assert!((a - 0.002).abs() < 1e-9 && (b - 0.0015).abs() < 1e-9, "{a} {b}");
        let early = s;
        s.record(4, 0.01);
        let d = s.since(&early);
        assert_eq!((d.steps, d.rows), (1, 4));
        let (a, b) = d.fit().unwrap();
        assert!(a == 0.0 && (b - 0.0025).abs() < 1e-12);
        assert_eq!(DecodeSteps::default().fit(), None);
    }
}
