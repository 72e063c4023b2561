//! AVX2 + FMA version of [`super::quant::matmul_scalar`]: each group of 16 rows is two
//! 8-lane halves; integer dot products use `maddubs` (exact for these code ranges).

#![cfg(target_arch = "x86_64")]

use super::quant::{Codes, OutRows, QuantActs, QuantMatrix, GROUP, QBLOCK};
use std::arch::x86_64::*;
use std::ops::Range;

pub(super) fn matmul(w: &QuantMatrix, acts: &QuantActs, groups: Range<usize>, out: &OutRows<'_>) {
    assert!(acts.cols == w.cols && acts.rows <= out.rows() && groups.end <= w.groups());
    assert!(acts.q.len() >= acts.rows * acts.cols && acts.qsum.len() >= acts.rows * acts.blocks());
    for g in groups {
        for t in 0..acts.rows {
            // SAFETY: dispatched only on CPUs with AVX2, FMA and F16C; sizes asserted.
            unsafe { row(w, acts, g, t, out) };
        }
    }
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

#[target_feature(enable = "avx2")]
unsafe fn isums_nibble(blk: *const u8, a: *const i8) -> [__m256i; 2] {
    let low = _mm256_set1_epi8(0x0f);
    let mut isum = [_mm256_setzero_si256(); 2];
    for j in 0..4 {
        // SAFETY: the payload is 4 chunks of 64 bytes; `a` has 32 bytes.
        let (alo, ahi) = unsafe { (bcast4(a.add(4 * j)), bcast4(a.add(16 + 4 * j))) };
        for (h, s) in isum.iter_mut().enumerate() {
            let p = unsafe { _mm256_loadu_si256(blk.add(j * 64 + h * 32).cast()) };
            let lo = _mm256_and_si256(p, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
            *s = _mm256_add_epi32(*s, _mm256_add_epi32(dot4(lo, alo), dot4(hi, ahi)));
        }
    }
    isum
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
