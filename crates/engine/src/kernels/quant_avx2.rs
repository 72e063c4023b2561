//! AVX2 + FMA version of [`super::quant::matmul_scalar`]: each group of 16 rows is two
//! 8-lane halves; integer dot products use `maddubs` (exact for these code ranges).
//!
//! Tokens go four at a time ([`tile`]): each weight vector is loaded and unpacked once
//! for four tokens, and the block's scales converted once. Every token's float
//! accumulation is the single-token one, operation for operation, so a token's
//! result does not depend on how many others share its step.

#![cfg(target_arch = "x86_64")]

use super::quant::{Codes, OutRows, QuantActs, QuantMatrix, GROUP, QBLOCK};
use std::arch::x86_64::*;
use std::ops::Range;

pub(super) fn matmul(w: &QuantMatrix, acts: &QuantActs, groups: Range<usize>, out: &OutRows<'_>) {
    assert!(acts.cols == w.cols && acts.rows <= out.rows() && groups.end <= w.groups());
    assert!(acts.q.len() >= acts.rows * acts.cols && acts.qsum.len() >= acts.rows * acts.blocks());
    assert!(acts.d.len() >= acts.rows * acts.blocks() && acts.s.len() >= acts.rows * acts.blocks());
    for g in groups {
        let mut t = 0;
        while t + TILE <= acts.rows {
            // SAFETY: dispatched only on CPUs with AVX2, FMA and F16C; sizes asserted.
            unsafe { tile(w, acts, g, t, out) };
            t += TILE;
        }
        for t in t..acts.rows {
            // SAFETY: as above.
            unsafe { row(w, acts, g, t, out) };
        }
    }
}

/// Tokens per tile: four tokens' accumulators and the unpacked weights fill the 16
/// vector registers.
const TILE: usize = 4;

/// [`row`] for tokens `t0..t0 + TILE` at once.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile(w: &QuantMatrix, acts: &QuantActs, g: usize, t0: usize, out: &OutRows<'_>) {
    let nb = w.blocks();
    let stride = w.codes.block_stride();
    let payload = w.codes.payload_bytes();
    let gd = w.group_data(g).as_ptr();
    let mut acc = [[_mm256_setzero_ps(); 2]; TILE];
    for b in 0..nb {
        let idx: [usize; TILE] = std::array::from_fn(|k| (t0 + k) * nb + b);
        // SAFETY (whole block): offsets stay inside the group's and the activations'
        // buffers, as asserted by the caller.
        let blk = unsafe { gd.add(b * stride) };
        let a: [*const i8; TILE] = std::array::from_fn(|k| unsafe { acts.q.as_ptr().add(idx[k] * QBLOCK) });
        let mut isum = match w.codes {
            Codes::Nibble => unsafe { isums_nibble_tile(blk, a) },
            Codes::Byte => unsafe { isums_byte_tile(blk, a) },
        };
        if w.codes == Codes::Byte {
            for (k, s) in isum.iter_mut().enumerate() {
                // SAFETY: `idx[k]` is below rows × blocks, as asserted by the caller.
                let fix = _mm256_set1_epi32(128 * unsafe { *acts.qsum.get_unchecked(idx[k]) });
                *s = [_mm256_add_epi32(s[0], fix), _mm256_add_epi32(s[1], fix)];
            }
        }
        // SAFETY: 16 f16 scales then 16 f16 offsets follow the payload.
        let (dw, mw) = unsafe {
            let at = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(blk.add(payload + o).cast()));
            ([at(0), at(16)], [at(32), at(48)])
        };
        for k in 0..TILE {
            // SAFETY: as above.
            let (da, sa) = unsafe { (*acts.d.get_unchecked(idx[k]), *acts.s.get_unchecked(idx[k])) };
            let (da, sa) = (_mm256_set1_ps(da), _mm256_set1_ps(sa));
            for h in 0..2 {
                acc[k][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[k][h]), _mm256_mul_ps(dw[h], da), acc[k][h]);
                acc[k][h] = _mm256_fmadd_ps(mw[h], sa, acc[k][h]);
            }
        }
    }
    for (k, acc) in acc.iter().enumerate() {
        let mut vals = [0f32; GROUP];
        // SAFETY: `vals` holds 16 f32s.
        unsafe {
            _mm256_storeu_ps(vals.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(vals.as_mut_ptr().add(8), acc[1]);
        }
        out.write16(t0 + k, g, &vals);
    }
}

/// [`isums_nibble`] of TILE tokens' activations against one block.
#[target_feature(enable = "avx2")]
unsafe fn isums_nibble_tile(blk: *const u8, a: [*const i8; TILE]) -> [[__m256i; 2]; TILE] {
    let low = _mm256_set1_epi8(0x0f);
    let mut s16 = [[_mm256_setzero_si256(); 2]; TILE];
    for j in 0..4 {
        // SAFETY: the payload is 4 chunks of 64 bytes; each `a[k]` has 32 bytes.
        let (p0, p1) =
            unsafe { (_mm256_loadu_si256(blk.add(j * 64).cast()), _mm256_loadu_si256(blk.add(j * 64 + 32).cast())) };
        let lo = [_mm256_and_si256(p0, low), _mm256_and_si256(p1, low)];
        let hi = [_mm256_and_si256(_mm256_srli_epi16(p0, 4), low), _mm256_and_si256(_mm256_srli_epi16(p1, 4), low)];
        for (k, s) in s16.iter_mut().enumerate() {
            let (alo, ahi) = unsafe { (bcast4(a[k].add(4 * j)), bcast4(a[k].add(16 + 4 * j))) };
            for h in 0..2 {
                let pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], alo), _mm256_maddubs_epi16(hi[h], ahi));
                s[h] = _mm256_add_epi16(s[h], pair);
            }
        }
    }
    s16.map(|s| [widen(s[0]), widen(s[1])])
}

/// [`isums_byte`] of TILE tokens' activations against one block.
#[target_feature(enable = "avx2")]
unsafe fn isums_byte_tile(blk: *const u8, a: [*const i8; TILE]) -> [[__m256i; 2]; TILE] {
    let flip = _mm256_set1_epi8(-128);
    let mut isum = [[_mm256_setzero_si256(); 2]; TILE];
    for j in 0..8 {
        // SAFETY: the payload is 8 chunks of 64 bytes; each `a[k]` has 32 bytes.
        let wv = unsafe {
            [
                _mm256_xor_si256(_mm256_loadu_si256(blk.add(j * 64).cast()), flip),
                _mm256_xor_si256(_mm256_loadu_si256(blk.add(j * 64 + 32).cast()), flip),
            ]
        };
        let wabs = [_mm256_abs_epi8(wv[0]), _mm256_abs_epi8(wv[1])];
        for (k, s) in isum.iter_mut().enumerate() {
            let av = unsafe { bcast4(a[k].add(4 * j)) };
            for h in 0..2 {
                s[h] = _mm256_add_epi32(s[h], dot4(wabs[h], _mm256_sign_epi8(av, wv[h])));
            }
        }
    }
    isum
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row(w: &QuantMatrix, acts: &QuantActs, g: usize, t: usize, out: &OutRows<'_>) {
    let nb = w.blocks();
    let stride = w.codes.block_stride();
    let payload = w.codes.payload_bytes();
    let gd = w.group_data(g).as_ptr();
    let mut acc = [_mm256_setzero_ps(); 2];
    for b in 0..nb {
        let i = t * nb + b;
        // SAFETY (whole block): offsets stay inside the group's and the activations'
        // buffers, as asserted by the caller.
        let blk = unsafe { gd.add(b * stride) };
        let a = unsafe { acts.q.as_ptr().add(i * QBLOCK) };
        let mut isum = match w.codes {
            Codes::Nibble => unsafe { isums_nibble(blk, a) },
            Codes::Byte => unsafe { isums_byte(blk, a) },
        };
        if w.codes == Codes::Byte {
            // Codes are w + 128; the signed kernel computed Σ w·q, so add 128·Σq.
            let fix = _mm256_set1_epi32(128 * acts.qsum[i]);
            isum = [_mm256_add_epi32(isum[0], fix), _mm256_add_epi32(isum[1], fix)];
        }
        let da = _mm256_set1_ps(acts.d[i]);
        let sa = _mm256_set1_ps(acts.s[i]);
        for h in 0..2 {
            // SAFETY: 16 f16 scales then 16 f16 offsets follow the payload.
            let (dw, mw) = unsafe {
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.add(payload + 16 * h).cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.add(payload + 32 + 16 * h).cast())),
                )
            };
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h]), _mm256_mul_ps(dw, da), acc[h]);
            acc[h] = _mm256_fmadd_ps(mw, sa, acc[h]);
        }
    }
    let mut vals = [0f32; GROUP];
    // SAFETY: `vals` holds 16 f32s.
    unsafe {
        _mm256_storeu_ps(vals.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(vals.as_mut_ptr().add(8), acc[1]);
    }
    out.write16(t, g, &vals);
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bcast4(p: *const i8) -> __m256i {
    // SAFETY: caller guarantees 4 readable bytes.
    _mm256_set1_epi32(unsafe { p.cast::<i32>().read_unaligned() })
}

/// Sums of 4 u8×i8 products per i32 lane.
#[inline]
#[target_feature(enable = "avx2")]
fn dot4(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// Per-row sums of one block's nibble codes times the activations. A pair of
/// products is at most 2·15·127 = 3,810, so all 8 `maddubs` results of a block add up
/// in 16 bits (at most 30,480) before one widening `madd`.
#[target_feature(enable = "avx2")]
unsafe fn isums_nibble(blk: *const u8, a: *const i8) -> [__m256i; 2] {
    let low = _mm256_set1_epi8(0x0f);
    let mut s16 = [_mm256_setzero_si256(); 2];
    for j in 0..4 {
        // SAFETY: the payload is 4 chunks of 64 bytes; `a` has 32 bytes.
        let (alo, ahi) = unsafe { (bcast4(a.add(4 * j)), bcast4(a.add(16 + 4 * j))) };
        for (h, s) in s16.iter_mut().enumerate() {
            let p = unsafe { _mm256_loadu_si256(blk.add(j * 64 + h * 32).cast()) };
            let lo = _mm256_and_si256(p, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
            let pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi));
            *s = _mm256_add_epi16(*s, pair);
        }
    }
    [widen(s16[0]), widen(s16[1])]
}

/// Pairs of i16 lanes summed into i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn widen(s: __m256i) -> __m256i {
    _mm256_madd_epi16(s, _mm256_set1_epi16(1))
}

#[target_feature(enable = "avx2")]
unsafe fn isums_byte(blk: *const u8, a: *const i8) -> [__m256i; 2] {
    let flip = _mm256_set1_epi8(-128);
    let mut isum = [_mm256_setzero_si256(); 2];
    for j in 0..8 {
        // SAFETY: the payload is 8 chunks of 64 bytes; `a` has 32 bytes.
        let av = unsafe { bcast4(a.add(4 * j)) };
        for (h, s) in isum.iter_mut().enumerate() {
            let p = unsafe { _mm256_loadu_si256(blk.add(j * 64 + h * 32).cast()) };
            let wv = _mm256_xor_si256(p, flip); // back to signed weights
                                                // |w| ≤ 128 and |q| ≤ 127 keep maddubs' pair sums below i16 saturation.
            let prod = dot4(_mm256_abs_epi8(wv), _mm256_sign_epi8(av, wv));
            *s = _mm256_add_epi32(*s, prod);
        }
    }
    isum
}
