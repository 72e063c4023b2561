//! AVX-512 VNNI version of [`super::quant::matmul_scalar`]: the same operations, 16 rows
//! per vector lane set, up to four token rows per weight pass.

#![cfg(target_arch = "x86_64")]

use super::quant::{Codes, OutRows, QuantActs, QuantMatrix, GROUP, QBLOCK};
use std::arch::x86_64::*;
use std::ops::Range;

/// Token rows computed per pass over a group's weights; unpacking is shared by them.
const TILE: usize = 4;

pub(super) fn matmul(w: &QuantMatrix, acts: &QuantActs, groups: Range<usize>, out: &OutRows<'_>) {
    assert!(acts.cols == w.cols && acts.rows <= out.rows() && groups.end <= w.groups());
    assert!(acts.q.len() >= acts.rows * acts.cols && acts.d.len() >= acts.rows * acts.blocks());
    for g in groups {
        let mut t = 0;
        while t < acts.rows {
            let n = TILE.min(acts.rows - t);
            // SAFETY: the dispatcher only selects this kernel when the CPU has
            // AVX-512 F/BW/VL/VNNI and F16C; buffer sizes are asserted above.
            unsafe {
                match n {
                    4 => tile::<4>(w, acts, g, t, out),
                    3 => tile::<3>(w, acts, g, t, out),
                    2 => tile::<2>(w, acts, g, t, out),
                    _ => tile::<1>(w, acts, g, t, out),
                }
            }
            t += n;
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
unsafe fn tile<const R: usize>(w: &QuantMatrix, acts: &QuantActs, g: usize, t0: usize, out: &OutRows<'_>) {
    let nb = w.blocks();
    let stride = w.codes.block_stride();
    let payload = w.codes.payload_bytes();
    let gd = w.group_data(g).as_ptr();
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY (whole block): offsets stay inside the group's `nb * stride` bytes and
        // inside the activations' `rows * cols` bytes, as asserted by the caller.
        let blk = unsafe { gd.add(b * stride) };
        let a: [*const i8; R] = std::array::from_fn(|r| unsafe { acts.q.as_ptr().add(((t0 + r) * nb + b) * QBLOCK) });
        let isum = match w.codes {
            Codes::Nibble => unsafe { isums_nibble::<R>(blk, &a) },
            Codes::Byte => unsafe { isums_byte::<R>(blk, &a) },
        };
        let dw = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(payload).cast())) };
        let mw = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(payload + 32).cast())) };
        for r in 0..R {
            let i = (t0 + r) * nb + b;
            let da = _mm512_set1_ps(acts.d[i]);
            let sa = _mm512_set1_ps(acts.s[i]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, da), acc[r]);
            acc[r] = _mm512_fmadd_ps(mw, sa, acc[r]);
        }
    }
    for (r, v) in acc.iter().enumerate() {
        let mut vals = [0f32; GROUP];
        // SAFETY: `vals` is 16 f32s.
        unsafe { _mm512_storeu_ps(vals.as_mut_ptr(), *v) };
        out.write16(t0 + r, g, &vals);
    }
}

/// Four activation bytes broadcast to every lane.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bcast4(p: *const i8) -> __m512i {
    // SAFETY: caller guarantees 4 readable bytes.
    _mm512_set1_epi32(unsafe { p.cast::<i32>().read_unaligned() })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn isums_nibble<const R: usize>(blk: *const u8, a: &[*const i8; R]) -> [__m512i; R] {
    let low = _mm512_set1_epi8(0x0f);
    let mut isum = [_mm512_setzero_si512(); R];
    for j in 0..4 {
        // SAFETY: 4 chunks of 64 bytes form the nibble payload.
        let p = unsafe { _mm512_loadu_si512(blk.add(j * 64).cast()) };
        let lo = _mm512_and_si512(p, low);
        let hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
        for r in 0..R {
            // SAFETY: a[r] points at 32 activation bytes.
            let (alo, ahi) = unsafe { (bcast4(a[r].add(4 * j)), bcast4(a[r].add(16 + 4 * j))) };
            isum[r] = _mm512_dpbusd_epi32(isum[r], lo, alo);
            isum[r] = _mm512_dpbusd_epi32(isum[r], hi, ahi);
        }
    }
    isum
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn isums_byte<const R: usize>(blk: *const u8, a: &[*const i8; R]) -> [__m512i; R] {
    let mut isum = [_mm512_setzero_si512(); R];
    for j in 0..8 {
        // SAFETY: 8 chunks of 64 bytes form the byte payload.
        let p = unsafe { _mm512_loadu_si512(blk.add(j * 64).cast()) };
        for r in 0..R {
            // SAFETY: a[r] points at 32 activation bytes.
            let av = unsafe { bcast4(a[r].add(4 * j)) };
            isum[r] = _mm512_dpbusd_epi32(isum[r], p, av);
        }
    }
    isum
}
