//! The few full-vocabulary loops the sampler runs every step, written so the compiler
//! vectorizes them: eight independent lanes for reductions (floating-point sums are
//! not reassociated otherwise), selects instead of branches, and an `exp` built from
//! basic IEEE operations so results are bit-identical on every platform.

const LANES: usize = 8;

/// `e^x` from basic IEEE operations only: libm's `expf` may differ in the last bit
/// between platforms, which could flip a seeded draw; this cannot. Relative error is a
/// few ulp; inputs below -87 give 0, above 88 give infinity, NaN stays NaN.
#[inline(always)]
pub(super) fn exp_det(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to an integer (ties to even), leaving it in the low
    // mantissa bits: n without a float-to-int conversion, which would not vectorize.
    const ROUND: f32 = 12_582_912.0;
    // ln 2 split so that n * LN2_HI is exact for the n that occur here (LN2_HI is
    // 355/512 exactly).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO; // |r| <= ln2 / 2
                                          // Taylor to degree 7: the remainder is below 1e-8 for |r| <= 0.35.
    let mut p = 1.0 / 5040.0;
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p * r + c;
    }
    // n is in [-126, 127], so 2^n is a normal float; wrapping ops keep NaN inputs
    // (whose bits are arbitrary here) from tripping overflow checks.
    let n_int = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits((n_int.wrapping_add(127) << 23) as u32);
    let y = if x < -87.0 { 0.0 } else { p * scale };
    if x > 88.0 {
        f32::INFINITY
    } else {
        y
    }
}

/// Largest value, NaN ignored; `-inf` for an empty or all-NaN slice.
pub(super) fn max_value(xs: &[f32]) -> f32 {
    let larger = |m: f32, x: f32| if x > m { x } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = larger(*m, x);
        }
    }
    let m = rest.iter().fold(f32::NEG_INFINITY, |m, &x| larger(m, x));
    lanes.iter().fold(m, |m, &x| larger(m, x))
}

/// Index of the largest value, ties to the lowest index; NaN never wins, and an
/// all-NaN or all-`-inf` slice gives 0.
pub(super) fn argmax(xs: &[f32]) -> usize {
    let max = max_value(xs);
    xs.iter().position(|&x| x == max).unwrap_or(0)
}

/// `exp((x - max) * scale)`, with NaN and `-inf` weighing nothing. `max` must be
/// finite and at least every `x`.
#[inline(always)]
pub(super) fn weight(x: f32, max: f32, scale: f32) -> f32 {
    let w = exp_det((x - max) * scale);
    if x > f32::NEG_INFINITY {
        w
    } else {
        0.0
    }
}

/// Sum in eight lanes, combined in a fixed order.
pub(super) fn lane_sum(xs: &[f32]) -> f64 {
    let mut lanes = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest: f64 = chunks.remainder().iter().map(|&x| f64::from(x)).sum();
    for chunk in chunks {
        for (s, &x) in lanes.iter_mut().zip(chunk) {
            *s += x;
        }
    }
    lanes.iter().map(|&s| f64::from(s)).sum::<f64>() + rest
}

/// `Σ weight(x, max, scale)` without materializing the weights.
fn sum_weights(xs: &[f32], max: f32, scale: f32) -> f64 {
    let mut lanes = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest: f64 = chunks.remainder().iter().map(|&x| f64::from(weight(x, max, scale))).sum();
    for chunk in chunks {
        for (s, &x) in lanes.iter_mut().zip(chunk) {
            *s += weight(x, max, scale);
        }
    }
    lanes.iter().map(|&s| f64::from(s)).sum::<f64>() + rest
}

/// The log-softmax normalizer of one logits vector, with the degenerate cases (an
/// infinite logit, nothing finite) defined instead of producing NaN.
#[derive(Debug, Clone, Copy)]
pub(super) struct LogSoftmax {
    max: f32,
    log_z: f32,
    /// How many logits equal `max` when it is `+inf`.
    n_inf: usize,
    n: usize,
}

impl LogSoftmax {
    pub(super) fn of(logits: &[f32]) -> Self {
        let max = max_value(logits);
        let n_inf = if max == f32::INFINITY { logits.iter().filter(|&&x| x == f32::INFINITY).count() } else { 0 };
        let z = if max.is_finite() { sum_weights(logits, max, 1.0) } else { 0.0 };
        LogSoftmax { max, log_z: z.ln() as f32, n_inf, n: logits.len() }
    }

    pub(super) fn logprob(&self, x: f32) -> f32 {
        if self.max == f32::INFINITY {
            return if x == f32::INFINITY { -(self.n_inf as f32).ln() } else { f32::NEG_INFINITY };
        }
        if self.max == f32::NEG_INFINITY {
            return -(self.n.max(1) as f32).ln(); // nothing to prefer: uniform
        }
        if x.is_nan() {
            return f32::NEG_INFINITY;
        }
        x - self.max - self.log_z
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_det_matches_std() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp_det(x), x.exp());
            assert!(((got - want) / want).abs() < 4e-7, "{x}: {got} vs {want}");
            x += 0.0137;
        }
        assert_eq!(exp_det(0.0), 1.0);
        assert_eq!(exp_det(-87.5), 0.0);
        assert_eq!(exp_det(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_det(88.5), f32::INFINITY);
        assert!(exp_det(f32::NAN).is_nan());
    }

    #[test]
    fn reductions_ignore_nan_and_handle_short_slices() {
        let xs = [1.0, f32::NAN, 3.0, -2.0, 3.0, 0.0, 0.5, 0.25, 2.0, f32::NAN, 1.5];
        assert_eq!(max_value(&xs), 3.0);
        assert_eq!(argmax(&xs), 2);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(max_value(&[]), f32::NEG_INFINITY);
        let ones = [1.0f32; 19];
        assert_eq!(lane_sum(&ones), 19.0);
        let z = sum_weights(&xs, 3.0, 1.0);
        let want: f64 = xs.iter().filter(|x| !x.is_nan()).map(|&x| f64::from(x - 3.0).exp()).sum();
        assert!((z - want).abs() < 1e-6, "{z} vs {want}");
    }

    #[test]
    fn log_softmax_sums_to_one_and_survives_degenerate_input() {
        let xs: Vec<f32> = (0..1000).map(|i| (i % 37) as f32 * 0.3 - 4.0).collect();
        let lsm = LogSoftmax::of(&xs);
        let total: f64 = xs.iter().map(|&x| f64::from(lsm.logprob(x)).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
        let inf = LogSoftmax::of(&[1.0, f32::INFINITY, f32::INFINITY]);
        assert_eq!(inf.logprob(f32::INFINITY), -(2.0f32).ln());
        assert_eq!(inf.logprob(1.0), f32::NEG_INFINITY);
        let none = LogSoftmax::of(&[f32::NAN, f32::NEG_INFINITY]);
        assert_eq!(none.logprob(f32::NAN), -(2.0f32).ln());
        assert_eq!(LogSoftmax::of(&[]).logprob(0.0), 0.0);
    }
}
