//! Matmul for weights kept in f32 (F32, F16 and BF16 checkpoints): one f32 dot product
//! per output element, grouped 16 rows at a time like the quantized kernel.

use super::ops::{dot, dot_sum};
use super::quant::{OutRows, GROUP};
use super::Isa;

/// `[rows, cols]` row-major f32 weights.
pub struct DenseMatrix {
    pub rows: usize,
    pub cols: usize,
    pub w: Vec<f32>,
}

impl DenseMatrix {
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }
}

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` for the row groups `groups`.
pub fn matmul(isa: Isa, m: &DenseMatrix, x: &[f32], tokens: usize, groups: std::ops::Range<usize>, out: &OutRows<'_>) {
    match isa {
        // SAFETY: the ISA was detected on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { matmul_avx512(m, x, tokens, groups, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { matmul_avx2(m, x, tokens, groups, out) },
        _ => matmul_impl(m, x, tokens, groups, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,fma")]
unsafe fn matmul_avx512(m: &DenseMatrix, x: &[f32], tokens: usize, groups: std::ops::Range<usize>, out: &OutRows<'_>) {
    // 32 vector registers: 16 dots of 4 rows by 4 tokens, and their operands.
    matmul_tiled::<Avx512, 4, 4>(m, x, tokens, groups, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn matmul_avx2(m: &DenseMatrix, x: &[f32], tokens: usize, groups: std::ops::Range<usize>, out: &OutRows<'_>) {
    // 16 registers of 8 lanes: 4 dots of 2 rows by 2 tokens (two registers each).
    matmul_tiled::<Avx2, 2, 2>(m, x, tokens, groups, out)
}

fn matmul_impl(m: &DenseMatrix, x: &[f32], tokens: usize, groups: std::ops::Range<usize>, out: &OutRows<'_>) {
    matmul_tiled::<Lanes, 1, 1>(m, x, tokens, groups, out)
}

/// The matmul in tiles of `R` weight rows by `T` tokens: each weight chunk loaded
/// serves `T` tokens and each token chunk `R` rows, and the tile's `R × T` dots add up
/// independently, where one dot at a time waits on its own additions. Each dot keeps
/// its own 16 lanes and ends as [`dot`] ends ([`dot_sum`]), so an output is the same
/// bits whichever tile, or none, computed it: a row's result does not depend on its
/// batch.
#[inline(always)]
fn matmul_tiled<K: Tiles, const R: usize, const T: usize>(
    m: &DenseMatrix,
    x: &[f32],
    tokens: usize,
    groups: std::ops::Range<usize>,
    out: &OutRows<'_>,
) {
    let c = m.cols;
    let token = |t: usize| &x[t * c..(t + 1) * c];
    let mut vals = vec![[0f32; GROUP]; tokens];
    for g in groups {
        let rows = GROUP.min(m.rows - g * GROUP);
        let row = |i: usize| &m.w[(g * GROUP + i) * c..(g * GROUP + i + 1) * c];
        let whole_tiles = if rows == GROUP { GROUP / R * R } else { 0 };
        for i in (0..whole_tiles).step_by(R) {
            let w: [&[f32]; R] = std::array::from_fn(|r| row(i + r));
            let mut t = 0;
            while t + T <= tokens {
                let d = K::tile::<R, T>(&w, &std::array::from_fn(|j| token(t + j)));
                (0..R).for_each(|r| (0..T).for_each(|j| vals[t + j][i + r] = d[r][j]));
                t += T;
            }
            for (t, v) in vals.iter_mut().enumerate().skip(t) {
                let d = K::tile::<R, 1>(&w, &[token(t)]);
                (0..R).for_each(|r| v[i + r] = d[r][0]);
            }
        }
        for (t, v) in vals.iter_mut().enumerate() {
            for (i, v) in v.iter_mut().enumerate().take(rows).skip(whole_tiles) {
                *v = dot(row(i), token(t));
            }
        }
        for (t, v) in vals.iter().enumerate() {
            out.write16(t, g, v);
        }
    }
}

/// The dots of `R` weight rows with `T` token rows of equal length, each as [`dot`]
/// computes it: 16 lanes, each a product then a sum, then [`dot_sum`].
trait Tiles {
    fn tile<const R: usize, const T: usize>(w: &[&[f32]; R], x: &[&[f32]; T]) -> [[f32; T]; R];
}

/// Portable: `dot` itself, dot by dot.
struct Lanes;

impl Tiles for Lanes {
    #[inline(always)]
    fn tile<const R: usize, const T: usize>(w: &[&[f32]; R], x: &[&[f32]; T]) -> [[f32; T]; R] {
        std::array::from_fn(|r| std::array::from_fn(|j| dot(w[r], x[j])))
    }
}

/// The columns of `w` and `x` in whole chunks of 16; every row of both has as many.
fn whole_chunks<const R: usize, const T: usize>(w: &[&[f32]; R], x: &[&[f32]; T]) -> usize {
    let c = x[0].len();
    assert!(w.iter().chain(x).all(|v| v.len() == c), "rows of one length");
    c / 16 * 16
}

#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Tiles for Avx512 {
    #[inline(always)]
    fn tile<const R: usize, const T: usize>(w: &[&[f32]; R], x: &[&[f32]; T]) -> [[f32; T]; R] {
        // SAFETY: chosen only where the CPU has AVX-512 (`Isa::Avx512Vnni`).
        unsafe { tile_avx512(w, x) }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const R: usize, const T: usize>(w: &[&[f32]; R], x: &[&[f32]; T]) -> [[f32; T]; R] {
    use std::arch::x86_64::{
        __m512, _mm512_add_ps, _mm512_loadu_ps, _mm512_mul_ps, _mm512_setzero_ps, _mm512_storeu_ps,
    };
    let whole = whole_chunks(w, x);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let (mut wk, mut xk) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); T]);
    for k in (0..whole).step_by(16) {
        // SAFETY: `k + 16 <= whole`, within every row (`whole_chunks`).
        for r in 0..R {
            wk[r] = unsafe { _mm512_loadu_ps(w[r].as_ptr().add(k)) };
        }
        for j in 0..T {
            xk[j] = unsafe { _mm512_loadu_ps(x[j].as_ptr().add(k)) };
        }
        for r in 0..R {
            for j in 0..T {
                acc[r][j] = _mm512_add_ps(acc[r][j], _mm512_mul_ps(wk[r], xk[j]));
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for j in 0..T {
            let v: __m512 = acc[r][j];
            let mut lanes = [0f32; 16];
            // SAFETY: 16 lanes into 16 floats.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), v) };
            out[r][j] = dot_sum(&lanes, &w[r][whole..], &x[j][whole..]);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Tiles for Avx2 {
    #[inline(always)]
    fn tile<const R: usize, const T: usize>(w: &[&[f32]; R], x: &[&[f32]; T]) -> [[f32; T]; R] {
        // SAFETY: chosen only where the CPU has AVX2 (`Isa::Avx2` or better).
        unsafe { tile_avx2(w, x) }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn tile_avx2<const R: usize, const T: usize>(w: &[&[f32]; R], x: &[&[f32]; T]) -> [[f32; T]; R] {
    use std::arch::x86_64::{_mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps, _mm256_storeu_ps};
    let whole = whole_chunks(w, x);
    // Each dot's 16 lanes in two registers: lanes 0..8 and 8..16.
    let zero = _mm256_setzero_ps();
    let mut acc = [[[zero; 2]; T]; R];
    let (mut wk, mut xk) = ([[zero; 2]; R], [[zero; 2]; T]);
    for k in (0..whole).step_by(16) {
        for h in 0..2 {
            // SAFETY: `k + 16 <= whole`, within every row (`whole_chunks`).
            for r in 0..R {
                wk[r][h] = unsafe { _mm256_loadu_ps(w[r].as_ptr().add(k + 8 * h)) };
            }
            for j in 0..T {
                xk[j][h] = unsafe { _mm256_loadu_ps(x[j].as_ptr().add(k + 8 * h)) };
            }
        }
        for r in 0..R {
            for j in 0..T {
                for h in 0..2 {
                    acc[r][j][h] = _mm256_add_ps(acc[r][j][h], _mm256_mul_ps(wk[r][h], xk[j][h]));
                }
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for j in 0..T {
            let mut lanes = [0f32; 16];
            // SAFETY: two registers of 8 lanes into 16 floats.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][j][0]);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[r][j][1]);
            }
            out[r][j] = dot_sum(&lanes, &w[r][whole..], &x[j][whole..]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::OutRows;

    /// Every output of a batch is the bits [`dot`] gives its row and token alone,
    /// whatever the ISA's tile, with rows and columns past whole tiles and chunks.
    #[test]
    fn a_batchs_outputs_are_each_rows_dot_bit_for_bit() {
        for (rows, cols) in [(64, 576), (40, 100), (16, 16), (5, 37)] {
            let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1013) as f32 / 506.0 - 1.0) * 0.37).collect();
            let m = DenseMatrix { rows, cols, w };
            for tokens in [1, 2, 3, 5, 9] {
                let x: Vec<f32> =
                    (0..tokens * cols).map(|i| ((i * 104_729 % 997) as f32 / 498.0 - 1.0) * 1.3).collect();
                // Each ISA this CPU has (the best caps what is tried).
                let best = Isa::detect();
                for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni].into_iter().filter(|&i| i <= best) {
                    let mut got = vec![f32::NAN; tokens * rows];
                    let out = OutRows::new(&mut got, tokens, rows);
                    matmul(isa, &m, &x, tokens, 0..m.groups(), &out);
                    for t in 0..tokens {
                        for r in 0..rows {
                            let want = dot(&m.w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                            let at = format!("{isa:?}, {rows}x{cols}, {tokens} tokens: [{t}][{r}]");
                            assert_eq!(got[t * rows + r].to_bits(), want.to_bits(), "{at}");
                        }
                    }
                }
            }
        }
    }
}
