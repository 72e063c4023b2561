//! KV rows in their stored form ([`KvDtype`]): f16 bits, or GGUF's `q8_0` / `q4_0`
//! blocks of 32 values with one f16 scale, quantized the way llama.cpp's reference
//! quantizer does (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`), so a cache
//! written here reads back as llama.cpp's would and the GGUF dequantizer
//! ([`super::quant::dequantize_row`]) decodes it (and is what reads it back). Scalar reference code: the
//! attention kernels that read these rows are checked against it.

use crate::format::DType;
use half::f16;
use pdserve_types::KvDtype;

/// Stores `src` in `dtype`'s form into `dst`, which holds exactly
/// `dtype.row_bytes(src.len())` bytes.
///
/// # Panics
/// When `src` does not fill whole blocks or `dst` has the wrong length: the cache's
/// shapes are fixed when it is made, so this is a bug, not bad input.
pub fn quantize_row(dtype: KvDtype, src: &[f32], dst: &mut [u8]) {
    assert_eq!(dtype.row_bytes(src.len()), Some(dst.len()), "{dtype} row of {} values", src.len());
    match dtype {
        KvDtype::F16 => {
            for (d, x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
            }
        }
        KvDtype::Q8_0 => src.chunks_exact(32).zip(dst.chunks_exact_mut(34)).for_each(|(x, b)| q8_0(x, b)),
        KvDtype::Q4_0 => src.chunks_exact(32).zip(dst.chunks_exact_mut(18)).for_each(|(x, b)| q4_0(x, b)),
    }
}

/// The values of a row stored by [`quantize_row`]: the GGUF dequantizer of the same
/// block type reads it.
pub fn dequantize_row(dtype: KvDtype, src: &[u8], dst: &mut [f32]) {
    assert_eq!(dtype.row_bytes(dst.len()), Some(src.len()), "{dtype} row of {} values", dst.len());
    let gguf = match dtype {
        KvDtype::F16 => DType::F16,
        KvDtype::Q8_0 => DType::Q8_0,
        KvDtype::Q4_0 => DType::Q4_0,
    };
    super::quant::dequantize_row(gguf, src, dst);
}

/// 32 values as signed bytes of one scale `amax / 127`, rounded half away from zero.
fn q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (q, v) in b[2..].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// 32 values as nibbles `q - 8` of one scale: the value of largest magnitude maps to
/// -8 exactly, so its sign sets the scale's (llama.cpp's choice; it keeps the extreme
/// value exact and uses the asymmetric code range where it matters most).
fn q4_0(x: &[f32], b: &mut [u8]) {
    let max = x.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    let code = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    for j in 0..16 {
        b[2 + j] = code(x[j]) | (code(x[j + 16]) << 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_types::rng::Rng;

    fn row(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        // A few outliers, as K rows of real models have.
        (0..n).map(|i| (rng.next_f64() as f32 - 0.5) * if i % 29 == 3 { 40.0 } else { 2.0 }).collect()
    }

    fn stored(dtype: KvDtype, x: &[f32]) -> Vec<u8> {
        let mut b = vec![0u8; dtype.row_bytes(x.len()).unwrap()];
        quantize_row(dtype, x, &mut b);
        b
    }

    #[test]
    fn errors_stay_within_half_a_step_or_the_clipped_range() {
        // Steps from zero to the largest magnitude, and the most on the other side
        // (q4_0's codes reach -8 but only +7 steps: a value of the other sign as large
        // as the largest is clipped to 7).
        for (dtype, steps, other) in [(KvDtype::Q8_0, 127.0, 127.0), (KvDtype::Q4_0, 8.0, 7.0)] {
            for seed in 0..20 {
                let x = row(seed, 64);
                let mut y = vec![0f32; 64];
                dequantize_row(dtype, &stored(dtype, &x), &mut y);
                for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (a, b) in xb.iter().zip(yb) {
                        // Half a step (or the clipping), plus the f16 rounding of the
                        // scale (relative 2^-11), which every code multiplies.
                        let step = amax / steps;
                        let bound = (step * 0.5).max(a.abs() - other * step) + (a.abs() + step) * 2f32.powi(-11) + 1e-6;
                        assert!((a - b).abs() <= bound, "{dtype} seed {seed}: {a} read back as {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn known_blocks() {
        // q8_0: the largest magnitude is 127 codes; ties round away from zero.
        let mut x = [0f32; 32];
        x[0] = -127.0;
        x[1] = 0.5; // half a step
        x[2] = -0.5;
        let b = stored(KvDtype::Q8_0, &x);
        assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), 1.0);
        assert_eq!((b[2] as i8, b[3] as i8, b[4] as i8, b[5] as i8), (-127, 1, -1, 0));
        // q4_0: the value of largest magnitude codes to 0 (that is, -8 · d).
        let mut x = [0f32; 32];
        x[0] = 4.0;
        x[16] = -1.0;
        let b = stored(KvDtype::Q4_0, &x);
        assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), -0.5);
        assert_eq!((b[2] & 0x0f, b[2] >> 4, b[3] & 0x0f), (0, 10, 8));
        // Zeros stay zeros.
        let mut y = [1f32; 32];
        dequantize_row(KvDtype::Q4_0, &stored(KvDtype::Q4_0, &[0.0; 32]), &mut y);
        assert_eq!(y, [0.0; 32]);
    }
}
