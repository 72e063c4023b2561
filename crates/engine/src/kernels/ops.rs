//! Element-wise and per-row operations of the forward pass. Each works on one row at a
//! time with a fixed operation order, so a row's result never depends on its batch.

use crate::config::RopeStyle;

/// `out = x / rms(x) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut lanes = [0f32; 8];
    for c in x.chunks_exact(8) {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    let tail: f32 = x.chunks_exact(8).remainder().iter().map(|v| v * v).sum();
    let ss = lanes.iter().sum::<f32>() + tail;
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// SwiGLU: `out[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + fast_exp(-g)) * u;
    }
}

/// Cos/sin of every rotation angle for a set of positions, computed once per forward
/// pass and shared by all layers.
pub struct RopeTable {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(head_dim: usize, theta: f32, positions: &[usize]) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for i in 0..half {
                let inv_freq = theta.powf(-((2 * i) as f32) / head_dim as f32);
                let (s, c) = (p as f32 * inv_freq).sin_cos();
                cos.push(c);
                sin.push(s);
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Rotates every head of `x` (one token row: `n_heads * head_dim`) for token `t`.
    pub fn apply(&self, style: RopeStyle, t: usize, x: &mut [f32]) {
        let (cos, sin) = (&self.cos[t * self.half..(t + 1) * self.half], &self.sin[t * self.half..(t + 1) * self.half]);
        for head in x.chunks_exact_mut(2 * self.half) {
            for i in 0..self.half {
                let (a, b) = match style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + self.half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

/// A branch-free exp for softmax: range reduction by powers of two and a degree-7
/// Taylor polynomial (relative error below 1e-6). Vectorizes where `f32::exp` would
/// call libm for every element.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let k = (x * std::f32::consts::LOG2_E).round();
    let r = x - k * 0.693_145_75 - k * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let bits = ((k as i32 + 127) as u32) << 23;
    p * f32::from_bits(bits)
}

/// Dot product with 16 independent lanes summed in a fixed order: vectorizes without
/// reassociation, and gives the same result for the same inputs everywhere it runs.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut s = tail;
    for l in lanes {
        s += l;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate() {
        for i in -800..800 {
            let x = i as f32 * 0.1;
            let (a, b) = (fast_exp(x), x.exp());
            assert!((a - b).abs() <= 1e-6 * b.max(1e-30), "{x}: {a} vs {b}");
        }
        assert_eq!(fast_exp(-1000.0), fast_exp(-87.0));
    }

    #[test]
    fn rope_styles_rotate_pairs() {
        let t = RopeTable::new(4, 10000.0, &[1]);
        let mut n = vec![1.0, 0.0, 1.0, 0.0];
        t.apply(RopeStyle::Normal, 0, &mut n);
        assert!((n[0] - 1f32.cos()).abs() < 1e-6 && (n[1] - 1f32.sin()).abs() < 1e-6);
        let mut x = vec![1.0, 1.0, 0.0, 0.0];
        t.apply(RopeStyle::Neox, 0, &mut x);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn rms_norm_unit_scale() {
        let x = [3.0, 4.0];
        let mut o = [0.0; 2];
        rms_norm(&x, &[1.0, 1.0], 0.0, &mut o);
        let rms = (12.5f32).sqrt();
        assert!((o[0] - 3.0 / rms).abs() < 1e-6);
    }
}
