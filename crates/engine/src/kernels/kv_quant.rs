//! KV rows in their stored form ([`KvDtype`]): f16 bits, or GGUF's `q8_0` / `q4_0`
//! blocks of 32 values with one f16 scale, quantized the way llama.cpp's reference
//! quantizer does (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`), so a cache
//! written here reads back as llama.cpp's would and the GGUF dequantizer
//! ([`super::quant::dequantize_row`]) decodes it: that scalar code is the reference
//! [`read_row`]'s AVX2 and AVX-512 kernels, which attention reads the cache with, are
//! checked against bit for bit.

use super::Isa;
use crate::format::DType;
use half::f16;
use pdserve_types::KvDtype;

/// The Walsh-Hadamard rotations a quantized cache stores K and V under, as llama.cpp
/// does (its `attn_rot_k`/`attn_rot_v`): an orthonormal rotation spreads a head's few
/// outlier dimensions over all of them, so a block's one scale fits its values; for
/// q4_0 on the default model it takes the perplexity added from +15 % to +4 %. K rows
/// turn in pieces of the largest power of two dividing the head (64 or more), and the
/// queries with them (so scores are unchanged); V rows in pieces of 64, the attention
/// output turned back after (the rotation is its own inverse). `None` for f16, or a
/// head that is not a multiple of 64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    pub k: usize,
    pub v: usize,
}

impl Rotation {
    pub fn of(dtype: KvDtype, head_dim: usize) -> Option<Rotation> {
        if dtype == KvDtype::F16 || head_dim == 0 || !head_dim.is_multiple_of(64) {
            return None;
        }
        Some(Rotation { k: 1 << head_dim.trailing_zeros(), v: 64 })
    }
}

/// Turns `x` by the Sylvester Hadamard matrix of size `n` (a power of two), normalized,
/// in pieces of `n`: the fast transform, `n log n` additions per piece.
pub fn rotate(x: &mut [f32], n: usize) {
    let scale = 1.0 / (n as f32).sqrt();
    for piece in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            // Split into halves so the butterflies vectorize (no index checks).
            for pair in piece.chunks_exact_mut(2 * h) {
                let (lo, hi) = pair.split_at_mut(h);
                for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                    (*a, *b) = (*a + *b, *a - *b);
                }
            }
            h *= 2;
        }
        for v in piece.iter_mut() {
            *v *= scale;
        }
    }
}

/// The bytes of a cache's stored words (it keeps every form as little-endian words).
pub fn words_as_bytes(words: &[u16]) -> &[u8] {
    // SAFETY: u8 has no alignment or validity requirement; the length is exact.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), words.len() * 2) }
}

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

/// [`dequantize_row`] with the best kernel `isa` has; the same bits on every ISA
/// (each value is one product `code × scale`, rounded once).
pub fn read_row(isa: Isa, dtype: KvDtype, src: &[u8], dst: &mut [f32]) {
    assert_eq!(dtype.row_bytes(dst.len()), Some(src.len()), "{dtype} row of {} values", dst.len());
    match (isa, dtype) {
        // SAFETY: the ISA was detected on this CPU; lengths are asserted above.
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Vnni, KvDtype::Q8_0) => unsafe { x86::q8_0_avx512(src, dst) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Vnni, KvDtype::Q4_0) => unsafe { x86::q4_0_avx512(src, dst) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, KvDtype::Q8_0) => unsafe { x86::q8_0_avx2(src, dst) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, KvDtype::Q4_0) => unsafe { x86::q4_0_avx2(src, dst) },
        _ => dequantize_row(dtype, src, dst),
    }
}

/// A quantized K block of one head holds its 16 tokens' rows transposed, so that
/// attention computes the block's 16 scores as vectors, as it does for f16: first the
/// f16 scales `[quant block][slot]`, then the codes `[dimension][slot]`, a byte each
/// for q8_0, a nibble for q4_0 (byte `i` of a dimension holds slot `i` low and slot
/// `i + 8` high). The same bytes as 16 GGUF rows, permuted: [`put_k_row`] and
/// [`get_k_row`] move one row in and out in GGUF's form.
pub const K_SLOTS: usize = 16;

/// Bytes of the scales at the head of a K block of `hd` values per row.
fn k_scales_bytes(hd: usize) -> usize {
    hd / 32 * K_SLOTS * 2
}

/// Writes `row` (one token's head in GGUF blocks) into slot `slot` of `block`.
pub fn put_k_row(dtype: KvDtype, block: &mut [u8], slot: usize, hd: usize, row: &[u8]) {
    let (bb, sb) = (dtype.block_bytes(), k_scales_bytes(hd));
    let (scales, codes) = block.split_at_mut(sb);
    for (b, blk) in row.chunks_exact(bb).enumerate() {
        scales[(b * K_SLOTS + slot) * 2..][..2].copy_from_slice(&blk[..2]);
        for i in 0..32 {
            let d = b * 32 + i;
            match dtype {
                KvDtype::Q8_0 => codes[d * K_SLOTS + slot] = blk[2 + i],
                _ => {
                    let code = if i < 16 { blk[2 + i] & 0x0f } else { blk[2 + i - 16] >> 4 };
                    let byte = &mut codes[d * 8 + slot % 8];
                    *byte = if slot < 8 { (*byte & 0xf0) | code } else { (*byte & 0x0f) | (code << 4) };
                }
            }
        }
    }
}

/// The GGUF row of slot `slot` of `block` (the inverse of [`put_k_row`]).
pub fn get_k_row(dtype: KvDtype, block: &[u8], slot: usize, hd: usize, row: &mut [u8]) {
    let (bb, sb) = (dtype.block_bytes(), k_scales_bytes(hd));
    let (scales, codes) = block.split_at(sb);
    for (b, blk) in row.chunks_exact_mut(bb).enumerate() {
        blk[..2].copy_from_slice(&scales[(b * K_SLOTS + slot) * 2..][..2]);
        for i in 0..32 {
            let d = b * 32 + i;
            match dtype {
                KvDtype::Q8_0 => blk[2 + i] = codes[d * K_SLOTS + slot],
                _ => {
                    let byte = codes[d * 8 + slot % 8];
                    let code = if slot < 8 { byte & 0x0f } else { byte >> 4 };
                    let j = 2 + i % 16;
                    blk[j] = if i < 16 { (blk[j] & 0xf0) | code } else { (blk[j] & 0x0f) | (code << 4) };
                }
            }
        }
    }
}

/// A quantized K block's values, transposed: `dst[d * 16 + slot]`, each the product
/// of its code and its row's scale as the GGUF dequantizer computes it. The same bits
/// on every ISA.
pub fn read_k_block(isa: Isa, dtype: KvDtype, src: &[u8], hd: usize, dst: &mut [f32]) {
    assert_eq!(Some(src.len()), dtype.row_bytes(hd).map(|r| r * K_SLOTS), "{dtype} K block of {hd}");
    assert_eq!(dst.len(), hd * K_SLOTS);
    let (scales, codes) = src.split_at(k_scales_bytes(hd));
    for (b, sc) in scales.chunks_exact(K_SLOTS * 2).enumerate() {
        let sc: [f32; K_SLOTS] = std::array::from_fn(|j| f16::from_le_bytes([sc[2 * j], sc[2 * j + 1]]).to_f32());
        let out = &mut dst[b * 32 * K_SLOTS..(b + 1) * 32 * K_SLOTS];
        match (isa, dtype) {
            // SAFETY: the ISA was detected on this CPU; lengths are asserted above.
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512Vnni, KvDtype::Q8_0) => unsafe { x86::k_q8_0_avx512(&codes[b * 512..][..512], &sc, out) },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512Vnni, KvDtype::Q4_0) => unsafe { x86::k_q4_0_avx512(&codes[b * 256..][..256], &sc, out) },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, KvDtype::Q8_0) => unsafe { x86::k_q8_0_avx2(&codes[b * 512..][..512], &sc, out) },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, KvDtype::Q4_0) => unsafe { x86::k_q4_0_avx2(&codes[b * 256..][..256], &sc, out) },
            (_, KvDtype::Q8_0) => k_q8_0(&codes[b * 512..][..512], &sc, out),
            _ => k_q4_0(&codes[b * 256..][..256], &sc, out),
        }
    }
}

/// 32 dimensions of 16 slots' byte codes times their slots' scales.
fn k_q8_0(codes: &[u8], sc: &[f32; K_SLOTS], out: &mut [f32]) {
    for (c, o) in codes.chunks_exact(K_SLOTS).zip(out.chunks_exact_mut(K_SLOTS)) {
        for j in 0..K_SLOTS {
            o[j] = sc[j] * (c[j] as i8) as f32;
        }
    }
}

/// 32 dimensions of 16 slots' nibble codes (minus 8) times their slots' scales.
fn k_q4_0(codes: &[u8], sc: &[f32; K_SLOTS], out: &mut [f32]) {
    for (c, o) in codes.chunks_exact(8).zip(out.chunks_exact_mut(K_SLOTS)) {
        for j in 0..K_SLOTS {
            let code = if j < 8 { c[j] & 0x0f } else { c[j - 8] >> 4 };
            o[j] = (code as i32 - 8) as f32 * sc[j];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    fn scale(b: &[u8]) -> f32 {
        f16::from_le_bytes([b[0], b[1]]).to_f32()
    }

    /// 16 nibble codes minus 8 as signed bytes: the low nibbles (values 0..16 of the
    /// block) and the high ones (16..32).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q4_codes(b: &[u8]) -> (__m128i, __m128i) {
        // SAFETY: a q4_0 block holds 16 code bytes after its scale.
        let raw = unsafe { _mm_loadu_si128(b[2..18].as_ptr().cast()) };
        let (low, eight) = (_mm_set1_epi8(0x0f), _mm_set1_epi8(8));
        let lo = _mm_sub_epi8(_mm_and_si128(raw, low), eight);
        let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), low), eight);
        (lo, hi)
    }

    /// Eight signed bytes (the low half of `q`) times `d`, stored at `out`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store8(q: __m128i, d: __m256, out: &mut [f32]) {
        let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        // SAFETY: `out` holds 8 values (callers pass chunks of 8).
        unsafe { _mm256_storeu_ps(out[..8].as_mut_ptr(), _mm256_mul_ps(x, d)) };
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q8_0_avx2(src: &[u8], dst: &mut [f32]) {
        for (b, out) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
            let d = _mm256_set1_ps(scale(b));
            for (i, o) in out.chunks_exact_mut(8).enumerate() {
                // SAFETY: 8 of the block's 32 code bytes.
                let q = unsafe { _mm_loadl_epi64(b[2 + 8 * i..10 + 8 * i].as_ptr().cast()) };
                unsafe { store8(q, d, o) };
            }
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q4_0_avx2(src: &[u8], dst: &mut [f32]) {
        for (b, out) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
            let d = _mm256_set1_ps(scale(b));
            let (lo, hi) = unsafe { q4_codes(b) };
            let (first, second) = out.split_at_mut(16);
            for (q, o) in [(lo, first), (hi, second)] {
                let (a, c) = o.split_at_mut(8);
                unsafe { store8(q, d, a) };
                unsafe { store8(_mm_srli_si128(q, 8), d, c) };
            }
        }
    }

    /// Sixteen signed bytes times `d`, stored at `out`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store16(q: __m128i, d: __m512, out: &mut [f32]) {
        let x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
        // SAFETY: `out` holds 16 values (callers pass chunks of 16).
        unsafe { _mm512_storeu_ps(out[..16].as_mut_ptr(), _mm512_mul_ps(x, d)) };
    }

    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn q8_0_avx512(src: &[u8], dst: &mut [f32]) {
        for (b, out) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
            let d = _mm512_set1_ps(scale(b));
            for (i, o) in out.chunks_exact_mut(16).enumerate() {
                // SAFETY: 16 of the block's 32 code bytes.
                let q = unsafe { _mm_loadu_si128(b[2 + 16 * i..18 + 16 * i].as_ptr().cast()) };
                unsafe { store16(q, d, o) };
            }
        }
    }

    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn q4_0_avx512(src: &[u8], dst: &mut [f32]) {
        for (b, out) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
            let d = _mm512_set1_ps(scale(b));
            let (lo, hi) = unsafe { q4_codes(b) };
            let (first, second) = out.split_at_mut(16);
            unsafe { store16(lo, d, first) };
            unsafe { store16(hi, d, second) };
        }
    }
    /// Sixteen slots' codes (signed bytes in `q`) times their scales, stored.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scaled16(q: __m128i, sc: __m512, out: &mut [f32]) {
        let x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
        // SAFETY: `out` holds 16 values.
        unsafe { _mm512_storeu_ps(out[..16].as_mut_ptr(), _mm512_mul_ps(sc, x)) };
    }

    /// A dimension's 16 nibble codes (8 bytes), minus 8, as signed bytes in slot order.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles16(c: &[u8]) -> __m128i {
        // SAFETY: `c` holds 8 bytes.
        let raw = unsafe { _mm_loadl_epi64(c[..8].as_ptr().cast()) };
        let low = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(raw, low);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        _mm_sub_epi8(_mm_unpacklo_epi64(lo, hi), _mm_set1_epi8(8))
    }

    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn k_q8_0_avx512(codes: &[u8], sc: &[f32; 16], out: &mut [f32]) {
        // SAFETY: 16 scales.
        let s = unsafe { _mm512_loadu_ps(sc.as_ptr()) };
        for (c, o) in codes.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            // SAFETY: 16 code bytes.
            unsafe { scaled16(_mm_loadu_si128(c.as_ptr().cast()), s, o) };
        }
    }

    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn k_q4_0_avx512(codes: &[u8], sc: &[f32; 16], out: &mut [f32]) {
        // SAFETY: 16 scales.
        let s = unsafe { _mm512_loadu_ps(sc.as_ptr()) };
        for (c, o) in codes.chunks_exact(8).zip(out.chunks_exact_mut(16)) {
            unsafe { scaled16(nibbles16(c), s, o) };
        }
    }

    /// Sixteen slots' codes times their scales, as two halves of eight.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scaled8x2(q: __m128i, s: [__m256; 2], out: &mut [f32]) {
        let (a, b) = out.split_at_mut(8);
        for (half, (sh, o)) in [q, _mm_srli_si128(q, 8)].into_iter().zip(s.into_iter().zip([a, b])) {
            let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half));
            // SAFETY: each half of `out` holds 8 values.
            unsafe { _mm256_storeu_ps(o[..8].as_mut_ptr(), _mm256_mul_ps(sh, x)) };
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn k_q8_0_avx2(codes: &[u8], sc: &[f32; 16], out: &mut [f32]) {
        // SAFETY: 16 scales.
        let s = unsafe { [_mm256_loadu_ps(sc.as_ptr()), _mm256_loadu_ps(sc[8..].as_ptr())] };
        for (c, o) in codes.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            // SAFETY: 16 code bytes.
            unsafe { scaled8x2(_mm_loadu_si128(c.as_ptr().cast()), s, o) };
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn k_q4_0_avx2(codes: &[u8], sc: &[f32; 16], out: &mut [f32]) {
        // SAFETY: 16 scales.
        let s = unsafe { [_mm256_loadu_ps(sc.as_ptr()), _mm256_loadu_ps(sc[8..].as_ptr())] };
        for (c, o) in codes.chunks_exact(8).zip(out.chunks_exact_mut(16)) {
            unsafe { scaled8x2(nibbles16(c), s, o) };
        }
    }
}

/// 32 values as signed bytes of one scale `amax / 127`, rounded half away from zero.
fn q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (q, v) in b[2..].iter_mut().zip(x) {
        *q = round_half_away(v * id) as i8 as u8;
    }
}

/// `y.round()` (halves away from zero) as an integer, saturated to i8's range, without
/// the libm call `round` is on baseline x86-64: `y - trunc(y)` is exact.
#[inline(always)]
fn round_half_away(y: f32) -> i32 {
    let t = y as i32;
    let up = (y - t as f32).abs() >= 0.5;
    (t + if up {
        if y < 0.0 {
            -1
        } else {
            1
        }
    } else {
        0
    })
    .clamp(-128, 127)
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

    #[test]
    fn rounding_is_rounds() {
        let mut rng = Rng::new(7);
        let halves = (-260..=260).map(|i| i as f32 * 0.5);
        let near = [0.499_999_97, -0.499_999_97, 0.500_000_06, 126.5, -127.5, 127.49, f32::NAN, 1e9, -1e9];
        let random = (0..10_000).map(|_| (rng.next_f64() as f32 - 0.5) * 300.0);
        for y in halves.chain(near).chain(random) {
            assert_eq!(round_half_away(y), y.round() as i8 as i32, "{y}");
        }
    }

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
    fn every_isa_reads_the_same_bits() {
        for dtype in [KvDtype::Q8_0, KvDtype::Q4_0] {
            for n in [32, 64, 256] {
                let b = stored(dtype, &row(n as u64, n));
                let mut want = vec![0f32; n];
                dequantize_row(dtype, &b, &mut want);
                for isa in Isa::available() {
                    let mut got = vec![f32::NAN; n];
                    read_row(isa, dtype, &b, &mut got);
                    assert_eq!(
                        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "{dtype} {isa} {n}"
                    );
                }
            }
        }
    }

    #[test]
    fn k_blocks_hold_gguf_rows_and_every_isa_reads_them_alike() {
        for dtype in [KvDtype::Q8_0, KvDtype::Q4_0] {
            for hd in [32, 64, 256] {
                let rows: Vec<Vec<u8>> =
                    (0..K_SLOTS).map(|j| stored(dtype, &row(j as u64 * 7 + hd as u64, hd))).collect();
                let mut block = vec![0u8; rows[0].len() * K_SLOTS];
                for (j, r) in rows.iter().enumerate() {
                    put_k_row(dtype, &mut block, j, hd, r);
                }
                // Each row reads back as written, and its values sit transposed.
                let mut want = vec![0f32; hd * K_SLOTS];
                for (j, r) in rows.iter().enumerate() {
                    let mut back = vec![0u8; r.len()];
                    get_k_row(dtype, &block, j, hd, &mut back);
                    assert_eq!(&back, r, "{dtype} {hd} slot {j}");
                    let mut vals = vec![0f32; hd];
                    dequantize_row(dtype, r, &mut vals);
                    for (d, v) in vals.iter().enumerate() {
                        want[d * K_SLOTS + j] = *v;
                    }
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for isa in Isa::available() {
                    let mut got = vec![f32::NAN; hd * K_SLOTS];
                    read_k_block(isa, dtype, &block, hd, &mut got);
                    assert_eq!(bits(&got), bits(&want), "{dtype} {isa} {hd}");
                }
            }
        }
    }

    #[test]
    fn the_rotation_is_the_hadamard_matrix_and_its_own_inverse() {
        // Row i of the Sylvester matrix: (-1)^popcount(i & j) / sqrt(n).
        let n = 64;
        let x = row(3, 2 * n);
        let mut y = x.clone();
        rotate(&mut y, n);
        for (p, (xs, ys)) in x.chunks(n).zip(y.chunks(n)).enumerate() {
            for (i, got) in ys.iter().enumerate() {
                let want: f64 = xs
                    .iter()
                    .enumerate()
                    .map(|(j, v)| if (i & j).count_ones() % 2 == 0 { *v as f64 } else { -*v as f64 })
                    .sum::<f64>()
                    / (n as f64).sqrt();
                assert!((*got as f64 - want).abs() < 1e-4, "piece {p} row {i}");
            }
        }
        rotate(&mut y, n);
        assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1e-5));
        let r = |d, hd| Rotation::of(d, hd);
        assert_eq!(r(KvDtype::Q8_0, 64), Some(Rotation { k: 64, v: 64 }));
        assert_eq!(r(KvDtype::Q4_0, 256), Some(Rotation { k: 256, v: 64 }));
        assert_eq!(r(KvDtype::Q4_0, 192), Some(Rotation { k: 64, v: 64 }));
        assert_eq!((r(KvDtype::Q8_0, 96), r(KvDtype::F16, 128)), (None, None));
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
