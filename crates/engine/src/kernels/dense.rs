//! Matmul for weights kept in f32 (F32, F16 and BF16 checkpoints): one f32 dot product
//! per output element, grouped 16 rows at a time like the quantized kernel.

use super::ops::dot;
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
    matmul_impl(m, x, tokens, groups, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn matmul_avx2(m: &DenseMatrix, x: &[f32], tokens: usize, groups: std::ops::Range<usize>, out: &OutRows<'_>) {
    matmul_impl(m, x, tokens, groups, out)
}

#[inline(always)]
fn matmul_impl(m: &DenseMatrix, x: &[f32], tokens: usize, groups: std::ops::Range<usize>, out: &OutRows<'_>) {
    let c = m.cols;
    for g in groups {
        for t in 0..tokens {
            let xr = &x[t * c..(t + 1) * c];
            let mut vals = [0f32; GROUP];
            for (i, v) in vals.iter_mut().enumerate() {
                let r = g * GROUP + i;
                if r < m.rows {
                    *v = dot(&m.w[r * c..(r + 1) * c], xr);
                }
            }
            out.write16(t, g, &vals);
        }
    }
}
