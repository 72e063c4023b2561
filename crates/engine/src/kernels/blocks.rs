//! GGUF quantized block layouts: a reference dequantizer per type, and the
//! decomposition of every block into 32-value pieces [`Sub`] (`value = d·code + m`)
//! that [`QuantMatrix`](super::quant::QuantMatrix) repacks for the int8 kernels.
//!
//! The layouts are ggml's (llama.cpp `ggml-common.h`); all multi-byte fields are little
//! endian and every `d`/`dmin`/`m` is an f16. The dequantizers follow llama.cpp's
//! operation order (e.g. Q4_K computes `d1 = d·sc` in f32, then `d1·q - m1`), so they give
//! the same f32 values; `crates/engine/tests/data/quant_golden.json`, made by
//! `scripts/quant_golden.py` with the `gguf` Python package, checks that.
//!
//! How each type becomes pieces of 32:
//!
//! | type             | codes                     | d              | m         | exact |
//! |------------------|---------------------------|----------------|-----------|-------|
//! | Q4_0             | nibble q                  | d              | -8 d      | yes   |
//! | Q4_1             | nibble q                  | d              | m         | yes   |
//! | Q8_0             | byte q+128                | d              | -128 d    | yes   |
//! | Q5_0 / Q5_1      | byte q (0..31)            | d              | -16 d / m | yes   |
//! | Q4_K             | nibble q                  | d·sc           | -dmin·mn  | yes   |
//! | Q5_K             | byte q (0..31)            | d·sc           | -dmin·mn  | yes   |
//! | IQ4_NL / IQ4_XS  | byte kv[q]+128            | d / d·(ls-32)  | -128 d    | yes   |
//! | Q6_K, Q3_K, Q2_K | byte, re-quantized per 32 | amax/127       | -128 d    | no    |
//!
//! Q6_K, Q3_K and Q2_K carry a scale per 16 values, which one scale per 32 cannot hold
//! exactly. Their pieces are re-quantized from the reference dequantization: symmetric
//! 8 bits per 32 values, `d = amax/127` rounded up to an f16, `code = round(v/d) + 128`,
//! `m = -128 d`, so every weight is within `d/2` of the file's value. The repacked
//! matrix stores 32 code bytes plus an f16 `d` and `m` per 32 weights: 9 bits per weight
//! for those tensors (and for every other byte-coded type), against 2.6–6.6 in the
//! file. A layout with a scale per 16 values is the planned fix for both the memory and
//! the re-quantization.
//!
//! "Exact" means `d·code + m` equals the reference value in f32. The repacked matrix
//! stores `d` and `m` as f16, which is exact for Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/IQ4_NL (an f16
//! times a power of two) but rounds the products `d·sc`, `dmin·mn` and `d·(ls-32)` of
//! the K and IQ4_XS types to nearest (relative error up to 2⁻¹¹; more for a piece whose
//! scale falls below f16's normal range, 6.1e-5, i.e. weights under about 1e-3).

use super::quant::{Codes, QBLOCK};
use crate::format::DType;
use half::f16;

/// 32 consecutive weights of one row: `weight[i] = d * codes[i] + m`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sub {
    /// One code per weight (nibble-coded types use only 0..=15).
    pub codes: [u8; QBLOCK],
    pub d: f32,
    pub m: f32,
}

impl Sub {
    pub const ZERO: Sub = Sub { codes: [0; QBLOCK], d: 0.0, m: 0.0 };

    /// The 32 weights in f32.
    pub fn values(&self) -> [f32; QBLOCK] {
        self.codes.map(|c| self.d * c as f32 + self.m)
    }
}

/// IQ4_NL / IQ4_XS: the non-linear values a 4-bit index selects.
const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// How the repacked matrix stores `dtype`'s codes; `None` for dense types.
pub fn codes_of(dtype: DType) -> Option<Codes> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => None,
        DType::Q4_0 | DType::Q4_1 | DType::Q4_K => Some(Codes::Nibble),
        _ => Some(Codes::Byte),
    }
}

/// Whether [`subs`] reproduces [`dequantize_block`] exactly (before the scales are
/// rounded to f16); the others are re-quantized to 8 bits per 32 values.
pub fn is_exact(dtype: DType) -> bool {
    !matches!(dtype, DType::Q2_K | DType::Q3_K | DType::Q6_K)
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes one block of a quantized `dtype` (`blk` is `block_bytes()` long, `out`
/// `block_elems()` long) with llama.cpp's formulas and operation order.
pub fn dequantize_block(dtype: DType, blk: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("{dtype:?} is not block-quantized"),
        DType::Q8_0 => dequantize_q8_0(blk, out),
        DType::Q4_0 | DType::Q4_1 => dequantize_q4_0_or_1(dtype, blk, out),
        DType::Q5_0 | DType::Q5_1 => dequantize_q5_0_or_1(dtype, blk, out),
        DType::Q4_K | DType::Q5_K => dequantize_q4_k_or_q5_k(dtype, blk, out),
        DType::Q6_K => dequantize_q6_k(blk, out),
        DType::Q3_K => dequantize_q3_k(blk, out),
        DType::Q2_K => dequantize_q2_k(blk, out),
        DType::IQ4_NL => iq4_values(f16_at(blk, 0), &blk[2..18], out),
        DType::IQ4_XS => dequantize_iq4_xs(blk, out),
    }
}

/// Q8_0: signed bytes times one scale.
fn dequantize_q8_0(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    for (o, &q) in out.iter_mut().zip(&blk[2..34]) {
        *o = d * (q as i8) as f32;
    }
}

/// Q4_0 / Q4_1: nibbles, offset by -8 (Q4_0) or plus a min (Q4_1).
fn dequantize_q4_0_or_1(dtype: DType, blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    for j in 0..16 {
        if dtype == DType::Q4_0 {
            let q = blk[2 + j];
            out[j] = ((q & 0xF) as i32 - 8) as f32 * d;
            out[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
        } else {
            let (m, q) = (f16_at(blk, 2), blk[4 + j]);
            out[j] = (q & 0xF) as f32 * d + m;
            out[j + 16] = (q >> 4) as f32 * d + m;
        }
    }
}

/// Q5_0 / Q5_1: 5-bit codes, offset by -16 (Q5_0) or plus a min (Q5_1).
fn dequantize_q5_0_or_1(dtype: DType, blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let (m, qh_at) = if dtype == DType::Q5_1 { (Some(f16_at(blk, 2)), 4) } else { (None, 2) };
    let [x0, x1] = q5_codes(blk, qh_at);
    for j in 0..16 {
        match m {
            Some(m) => {
                out[j] = x0[j] as f32 * d + m;
                out[j + 16] = x1[j] as f32 * d + m;
            }
            None => {
                out[j] = (x0[j] as i32 - 16) as f32 * d;
                out[j + 16] = (x1[j] as i32 - 16) as f32 * d;
            }
        }
    }
}

/// Q4_K / Q5_K: 8 sub-blocks of 32, a 6-bit scale and min each; Q5_K adds a fifth bit
/// per code.
fn dequantize_q4_k_or_q5_k(dtype: DType, blk: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let sm = k_scale_min(&blk[4..16]);
    let (qh, qs) = if dtype == DType::Q5_K { (Some(&blk[16..48]), &blk[48..176]) } else { (None, &blk[16..144]) };
    for c in 0..4 {
        let ql = &qs[32 * c..32 * c + 32];
        for half in 0..2 {
            let (sc, mn) = sm[2 * c + half];
            let (d1, m1) = (d * sc as f32, dmin * mn as f32);
            for l in 0..32 {
                let mut q = if half == 0 { ql[l] & 0xF } else { ql[l] >> 4 };
                if qh.is_some_and(|qh| qh[l] & (1 << (2 * c + half)) != 0) {
                    q += 16;
                }
                out[64 * c + 32 * half + l] = d1 * q as f32 - m1;
            }
        }
    }
}

/// Q6_K: 6-bit codes minus 32, a signed 8-bit scale per 16 values.
fn dequantize_q6_k(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 208);
    for h in 0..2 {
        let (ql, qh) = (&blk[64 * h..64 * h + 64], &blk[128 + 32 * h..128 + 32 * h + 32]);
        let sc = |i: usize| (blk[192 + 8 * h + i] as i8) as f32;
        let y = &mut out[128 * h..128 * h + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * sc(is) * q1 as f32;
            y[l + 32] = d * sc(is + 2) * q2 as f32;
            y[l + 64] = d * sc(is + 4) * q3 as f32;
            y[l + 96] = d * sc(is + 6) * q4 as f32;
        }
    }
}

/// Q3_K: 2 low bits plus a high-bit mask per code, a 6-bit scale per 16 values.
fn dequantize_q3_k(blk: &[u8], out: &mut [f32]) {
    let (hmask, qs, d) = (&blk[0..32], &blk[32..96], f16_at(blk, 108));
    let scales = q3k_scales(&blk[96..108]);
    let (mut is, mut m, mut y) = (0, 1u8, 0);
    for h in 0..2 {
        let q = &qs[32 * h..32 * h + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * scales[is + part] as f32;
                for l in 16 * part..16 * part + 16 {
                    let lo = ((q[l] >> shift) & 3) as i32;
                    let sub = if hmask[l] & m != 0 { 0 } else { 4 };
                    out[y] = dl * (lo - sub) as f32;
                    y += 1;
                }
            }
            is += 2;
            m <<= 1;
        }
    }
}

/// Q2_K: 2-bit codes, a 4-bit scale and min per 16 values.
fn dequantize_q2_k(blk: &[u8], out: &mut [f32]) {
    let (scales, qs, d, dmin) = (&blk[0..16], &blk[16..80], f16_at(blk, 80), f16_at(blk, 82));
    let (mut is, mut y) = (0, 0);
    for h in 0..2 {
        let q = &qs[32 * h..32 * h + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is + part];
                let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
                for &ql in &q[16 * part..16 * part + 16] {
                    out[y] = dl * ((ql >> shift) & 3) as f32 - ml;
                    y += 1;
                }
            }
            is += 2;
        }
    }
}

/// IQ4_XS: IQ4_NL values with a 6-bit scale per sub-block of 32.
fn dequantize_iq4_xs(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    for ib in 0..8 {
        let dl = d * (iq4xs_scale(blk, ib) - 32) as f32;
        iq4_values(dl, &blk[8 + 16 * ib..8 + 16 * ib + 16], &mut out[32 * ib..32 * ib + 32]);
    }
}

/// Q5_0 / Q5_1: the 5-bit codes of values `j` and `j + 16`; `qh` (u32) sits at
/// `qh_at`, the 16 nibble bytes right after it.
fn q5_codes(blk: &[u8], qh_at: usize) -> [[u8; 16]; 2] {
    let qh = u32::from_le_bytes([blk[qh_at], blk[qh_at + 1], blk[qh_at + 2], blk[qh_at + 3]]);
    let qs = &blk[qh_at + 4..qh_at + 20];
    let mut x = [[0u8; 16]; 2];
    for j in 0..16 {
        x[0][j] = (qs[j] & 0xF) | ((((qh >> j) << 4) & 0x10) as u8);
        x[1][j] = (qs[j] >> 4) | (((qh >> (j + 12)) & 0x10) as u8);
    }
    x
}

/// Q4_K / Q5_K: the 6-bit (scale, min) of each of the 8 sub-blocks from 12 bytes.
fn k_scale_min(q: &[u8]) -> [(u8, u8); 8] {
    std::array::from_fn(|j| {
        if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
        }
    })
}

/// Q3_K: the 16 signed scales (6 bits minus 32) packed in 12 bytes.
fn q3k_scales(b: &[u8]) -> [i8; 16] {
    let word = |i: usize| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
    let (a0, a1, a2) = (word(0), word(1), word(2));
    let (km1, km2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let s = [
        (a0 & km2) | ((a2 & km1) << 4),
        (a1 & km2) | (((a2 >> 2) & km1) << 4),
        ((a0 >> 4) & km2) | (((a2 >> 4) & km1) << 4),
        ((a1 >> 4) & km2) | (((a2 >> 6) & km1) << 4),
    ];
    std::array::from_fn(|i| (s[i / 4].to_le_bytes()[i % 4] as i8).wrapping_sub(32))
}

/// IQ4_XS: the 6-bit scale of sub-block `ib` (before subtracting 32).
fn iq4xs_scale(blk: &[u8], ib: usize) -> i32 {
    let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
    let lo = (blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
    (lo | ((((scales_h >> (2 * ib)) & 3) as u8) << 4)) as i32
}

/// IQ4_NL-style: 16 index bytes (values `j`, `j + 16`) times `d`.
fn iq4_values(d: f32, qs: &[u8], out: &mut [f32]) {
    for j in 0..16 {
        out[j] = d * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
        out[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
    }
}

/// Splits one block of `dtype` into its `block_elems() / 32` pieces, in order.
pub fn subs(dtype: DType, blk: &[u8], out: &mut [Sub]) {
    debug_assert_eq!(out.len() * QBLOCK, dtype.block_elems());
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("{dtype:?} is not block-quantized"),
        DType::Q4_0 | DType::Q4_1 => {
            let d = f16_at(blk, 0);
            let (m, qs) = if dtype == DType::Q4_1 { (f16_at(blk, 2), &blk[4..20]) } else { (-8.0 * d, &blk[2..18]) };
            out[0] = Sub { codes: nibbles(qs), d, m };
        }
        DType::Q8_0 => {
            let d = f16_at(blk, 0);
            out[0] = Sub { codes: std::array::from_fn(|i| blk[2 + i] ^ 0x80), d, m: -128.0 * d };
        }
        DType::Q5_0 | DType::Q5_1 => {
            let d = f16_at(blk, 0);
            let (m, qh_at) = if dtype == DType::Q5_1 { (f16_at(blk, 2), 4) } else { (-16.0 * d, 2) };
            let [x0, x1] = q5_codes(blk, qh_at);
            out[0] = Sub { codes: std::array::from_fn(|i| if i < 16 { x0[i] } else { x1[i - 16] }), d, m };
        }
        DType::Q4_K | DType::Q5_K => {
            let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
            let sm = k_scale_min(&blk[4..16]);
            let (qh, qs) =
                if dtype == DType::Q5_K { (Some(&blk[16..48]), &blk[48..176]) } else { (None, &blk[16..144]) };
            for (j, (o, &(sc, mn))) in out.iter_mut().zip(&sm).enumerate() {
                let (c, half) = (j / 2, j % 2);
                let ql = &qs[32 * c..32 * c + 32];
                let codes = std::array::from_fn(|l| {
                    let q = if half == 0 { ql[l] & 0xF } else { ql[l] >> 4 };
                    let high = qh.is_some_and(|qh| qh[l] & (1 << j) != 0);
                    q + if high { 16 } else { 0 }
                });
                *o = Sub { codes, d: d * sc as f32, m: -(dmin * mn as f32) };
            }
        }
        DType::IQ4_NL => out[0] = iq4_sub(f16_at(blk, 0), &blk[2..18]),
        DType::IQ4_XS => {
            let d = f16_at(blk, 0);
            for (ib, o) in out.iter_mut().enumerate() {
                *o = iq4_sub(d * (iq4xs_scale(blk, ib) - 32) as f32, &blk[8 + 16 * ib..8 + 16 * ib + 16]);
            }
        }
        DType::Q2_K | DType::Q3_K | DType::Q6_K => {
            let mut values = [0f32; 256];
            dequantize_block(dtype, blk, &mut values);
            for (o, v) in out.iter_mut().zip(values.chunks_exact(QBLOCK)) {
                *o = requantize(v);
            }
        }
    }
}

/// 16 bytes holding values `j` (low nibble) and `j + 16` (high nibble) as 32 codes.
fn nibbles(qs: &[u8]) -> [u8; QBLOCK] {
    std::array::from_fn(|i| if i < 16 { qs[i] & 0xF } else { qs[i - 16] >> 4 })
}

/// IQ4_NL-style indices as byte codes `kv + 128` with `m = -128 d`.
fn iq4_sub(d: f32, qs: &[u8]) -> Sub {
    let codes = nibbles(qs).map(|i| (KVALUES_IQ4NL[i as usize] as i32 + 128) as u8);
    Sub { codes, d, m: -128.0 * d }
}

/// Symmetric 8-bit re-quantization of 32 values. `d` is rounded *up* to an f16 before
/// the codes are chosen, so no code needs clamping and the stored `d·code + m` is within
/// `d/2` of each value, also where `d` is an f16 subnormal (blocks with amax < 0.008).
fn requantize(v: &[f32]) -> Sub {
    let amax = v.iter().fold(0f32, |a, x| a.max(x.abs()));
    let mut d16 = f16::from_f32(amax / 127.0);
    if d16.to_f32() < amax / 127.0 {
        d16 = f16::from_bits(d16.to_bits() + 1);
    }
    let d = d16.to_f32();
    let codes = std::array::from_fn(|i| {
        let q = if d > 0.0 { (v[i] / d).round_ties_even().clamp(-127.0, 127.0) as i32 } else { 0 };
        (q + 128) as u8
    });
    Sub { codes, d, m: -128.0 * d }
}

#[cfg(test)]
#[path = "blocks_tests.rs"]
mod tests;
