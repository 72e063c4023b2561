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

/// GELU in its tanh form, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, in f32.
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
}

/// GeGLU: `out[i] = gelu(gate[i]) * up[i]`, with GELU evaluated the way llama.cpp's
/// CPU backend does: 0 at or below -10, the identity at or above 10, and in between
/// the input rounded to f16 and looked up in a table of f16 results.
pub fn gelu_tanh_f16_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| half::f16::from_f32(gelu_tanh(half::f16::from_bits(bits).to_f32())).to_f32())
            .collect()
    });
    for ((o, &g), u) in out.iter_mut().zip(gate).zip(up) {
        let a = if g <= -10.0 {
            0.0
        } else if g >= 10.0 {
            g
        } else {
            table[usize::from(half::f16::from_f32(g).to_bits())]
        };
        *o = a * u;
    }
}

/// Cos/sin of every rotation angle for a set of positions, computed once per forward
/// pass and shared by all layers.
pub struct RopeTable {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// How a model turns positions into RoPE angles, beyond the head size.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// The base: pair `i` of a head turns at `theta^(-2i / head_dim)` per position.
    pub theta: f32,
    /// Multiplies positions (linear scaling; 1 for none).
    pub position_scale: f32,
    /// Divides pair `i`'s frequency by `factors[i]` (Llama 3's `rope_freqs`, Phi-3's
    /// long/short factors); empty for none.
    pub factors: Vec<f32>,
    /// Multiplies cosines and sines (1 for none).
    pub attn_factor: f32,
}

impl Rope {
    pub fn plain(theta: f32) -> Self {
        Rope { theta, position_scale: 1.0, factors: Vec::new(), attn_factor: 1.0 }
    }
}

impl RopeTable {
    pub fn new(head_dim: usize, theta: f32, positions: &[usize]) -> Self {
        RopeTable::build(head_dim, &Rope::plain(theta), positions)
    }

    /// Angles for `positions` as `rope` computes them.
    pub fn build(head_dim: usize, rope: &Rope, positions: &[usize]) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for i in 0..half {
                let inv_freq = rope.theta.powf(-((2 * i) as f32) / head_dim as f32);
                let factor = rope.factors.get(i).copied().unwrap_or(1.0);
                let (s, c) = (p as f32 * inv_freq / factor * rope.position_scale).sin_cos();
                cos.push(c * rope.attn_factor);
                sin.push(s * rope.attn_factor);
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
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            lanes[l] += x[l] * y[l];
        }
    }
    dot_sum(&lanes, ta, tb)
}

/// A [`dot`]'s end: the products of the columns past the last whole 16 (`ta`, `tb`),
/// then its 16 lanes added in order. Whatever else computes a dot product lane by lane
/// as `dot` does and ends with this gets `dot`'s bits.
#[inline(always)]
pub fn dot_sum(lanes: &[f32; 16], ta: &[f32], tb: &[f32]) -> f32 {
    let tail: f32 = ta.iter().zip(tb).map(|(x, y)| x * y).sum();
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
    fn gelu_matches_its_definition_within_f16_rounding() {
        for i in -1200..1200 {
            let x = i as f32 * 0.01;
            let mut o = [0f32];
            gelu_tanh_f16_mul(&[x], &[2.0], &mut o);
            let want = 2.0
                * 0.5
                * x as f64
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x as f64 + 0.044715 * (x as f64).powi(3))).tanh());
            assert!((o[0] as f64 - want).abs() <= 2e-3 * want.abs().max(0.5), "{x}: {} vs {want}", o[0]);
        }
        let mut o = [0f32; 2];
        gelu_tanh_f16_mul(&[-10.0, 12.5], &[1.0, 1.0], &mut o);
        assert_eq!(o, [0.0, 12.5]);
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
