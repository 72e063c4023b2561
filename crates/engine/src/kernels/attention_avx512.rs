//! AVX-512 attention for heads of 64 and 128 with 16-token blocks, over a cache of
//! any [`KvDtype`].
//!
//! Query vectors are taken four at a time; their scores, softmax state and value
//! accumulators all live in registers while the loop walks the cache blocks, and K/V
//! are converted in registers as they are used: from f16, or from q8_0/q4_0 codes
//! times their scales (the product the GGUF dequantizer computes). Each vector's result depends
//! only on its own query and position, never on which vectors share its group.

#![cfg(target_arch = "x86_64")]

use super::attention::{LayerKv, Queries};
use super::kv_quant::words_as_bytes;
use pdserve_types::KvDtype;
use std::arch::x86_64::*;

const BS: usize = 16;
const MAX_GROUP: usize = 4;

/// The cache's form, as a const parameter: the kernels' loads branch on it at
/// compile time.
const F16: u8 = 0;
const Q8_0: u8 = 1;
const Q4_0: u8 = 2;
/// A quantized cache's blocks already turned into f32 (see [`Staged`]).
const F32: u8 = 3;

/// Above this many groups of vectors per KV head (a prefill chunk, or a verification
/// of several drafted tokens), a quantized head is turned into f32 once rather than
/// once per group.
const STAGE_ABOVE_GROUPS: usize = 2;

/// One KV head's visible blocks in f32, K transposed (`[block][dim][slot]`) then V
/// (`[block][slot][dim]`): the same products of code and scale the in-register path
/// computes, so a vector's result does not depend on which path ran.
#[derive(Default)]
pub(super) struct Staged {
    vals: Vec<f32>,
    ids: Vec<u32>,
}

/// Handles `head_dim` 64 and 128; returns false for other shapes (callers fall back).
pub(super) fn attend(
    kv: &LayerKv<'_>,
    g: usize,
    blocks: &[u32],
    qs: &Queries<'_>,
    out: &mut [f32],
    staged: &mut Staged,
) -> bool {
    if kv.block_size != BS || !matches!(kv.head_dim, 64 | 128) {
        return false;
    }
    let nvec = qs.pos.len() * qs.n_rep;
    assert!(qs.q.len() >= nvec * kv.head_dim && out.len() >= nvec * kv.head_dim);
    let (form, staged_kv, ids);
    let (kv, g, blocks) = if kv.dtype != KvDtype::F16 && nvec > STAGE_ABOVE_GROUPS * MAX_GROUP {
        (staged_kv, ids) = stage(kv, g, blocks, qs, staged);
        form = F32;
        (&staged_kv, 0, ids)
    } else {
        form = match kv.dtype {
            KvDtype::F16 => F16,
            KvDtype::Q8_0 => Q8_0,
            KvDtype::Q4_0 => Q4_0,
        };
        (kv, g, blocks)
    };
    let mut v0 = 0;
    while v0 < nvec {
        let n = MAX_GROUP.min(nvec - v0);
        match form {
            F16 => groups::<F16>(kv, g, blocks, qs, v0, n, out),
            Q8_0 => groups::<Q8_0>(kv, g, blocks, qs, v0, n, out),
            Q4_0 => groups::<Q4_0>(kv, g, blocks, qs, v0, n, out),
            _ => groups::<F32>(kv, g, blocks, qs, v0, n, out),
        }
        v0 += n;
    }
    true
}

/// Turns head `g`'s blocks that any of `qs` sees into f32 in `staged`, and returns a
/// one-head cache over them with the block list that maps each logical block to its
/// place there.
fn stage<'s>(
    kv: &LayerKv<'_>,
    g: usize,
    blocks: &[u32],
    qs: &Queries<'_>,
    staged: &'s mut Staged,
) -> (LayerKv<'s>, &'s [u32]) {
    let hd = kv.head_dim;
    let tile = BS * hd;
    let last = qs.pos.iter().copied().max().unwrap_or(0) / BS;
    let first = qs.pos.iter().map(|&p| qs.first_visible(p)).min().unwrap_or(0) / BS;
    let n = last + 1 - first;
    staged.vals.resize(2 * n * tile, 0.0);
    let (ks, vs) = staged.vals.split_at_mut(n * tile);
    let per_head = BS * kv.row_words;
    for (i, &block) in blocks[first..=last].iter().enumerate() {
        let start = (block as usize * kv.n_kv_heads + g) * per_head;
        let (k, v) = (&kv.k[start..start + per_head], &kv.v[start..start + per_head]);
        let isa = super::Isa::Avx512Vnni;
        super::kv_quant::read_k_block(isa, kv.dtype, words_as_bytes(k), hd, &mut ks[i * tile..(i + 1) * tile]);
        super::kv_quant::read_row(isa, kv.dtype, words_as_bytes(v), &mut vs[i * tile..(i + 1) * tile]);
    }
    staged.ids.clear();
    staged.ids.extend((0..=last).map(|bi| bi.saturating_sub(first) as u32));
    let (k, v) = staged.vals.split_at(n * tile);
    (LayerKv { k: f32_words(k), v: f32_words(v), n_kv_heads: 1, row_words: 2 * hd, ..*kv }, &staged.ids)
}

/// f32 values as the little-endian words a [`LayerKv`] holds.
fn f32_words(x: &[f32]) -> &[u16] {
    // SAFETY: u16 has weaker alignment than f32 and no invalid values; the length is exact.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len() * 2) }
}

/// Runs the group of `n` vectors from `v0` in form `F`, for a head of 64 or 128.
fn groups<const F: u8>(
    kv: &LayerKv<'_>,
    g: usize,
    blocks: &[u32],
    qs: &Queries<'_>,
    v0: usize,
    n: usize,
    out: &mut [f32],
) {
    // SAFETY: `attend` is dispatched here on a CPU with AVX-512F and F16C; it asserts
    // the slice bounds and the head size, and block ids are checked against the pools.
    unsafe {
        match (kv.head_dim, n) {
            (64, 4) => group::<4, 4, F>(kv, g, blocks, qs, v0, out),
            (64, 3) => group::<4, 3, F>(kv, g, blocks, qs, v0, out),
            (64, 2) => group::<4, 2, F>(kv, g, blocks, qs, v0, out),
            (64, _) => group::<4, 1, F>(kv, g, blocks, qs, v0, out),
            (_, 4) => group::<8, 4, F>(kv, g, blocks, qs, v0, out),
            (_, 3) => group::<8, 3, F>(kv, g, blocks, qs, v0, out),
            (_, 2) => group::<8, 2, F>(kv, g, blocks, qs, v0, out),
            _ => group::<8, 1, F>(kv, g, blocks, qs, v0, out),
        }
    }
}

/// Vectors `v0..v0 + G` (vector `v` is query token `v / n_rep`, head `v % n_rep`),
/// head size `16 * C`, cache form `F`.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma,avx2")]
unsafe fn group<const C: usize, const G: usize, const F: u8>(
    kv: &LayerKv<'_>,
    g: usize,
    blocks: &[u32],
    qs: &Queries<'_>,
    v0: usize,
    out: &mut [f32],
) {
    let hd = 16 * C;
    let pos: [usize; G] = std::array::from_fn(|k| qs.pos[(v0 + k) / qs.n_rep]);
    let q: [&[f32]; G] = std::array::from_fn(|k| &qs.q[(v0 + k) * hd..(v0 + k + 1) * hd]);
    let mut m = [f32::NEG_INFINITY; G];
    let mut l = [0f32; G];
    let mut acc = [[_mm512_setzero_ps(); C]; G];
    let last = pos.iter().copied().max().unwrap_or(0) / BS;
    let first = pos.iter().map(|&p| qs.first_visible(p)).min().unwrap_or(0) / BS;
    // Words of one head's block, K or V.
    let per_head = BS * kv.row_words;
    for (bi, &block) in blocks.iter().enumerate().take(last + 1).skip(first) {
        let start = (block as usize * kv.n_kv_heads + g) * per_head;
        let (kt, vb) = (&kv.k[start..start + per_head], &kv.v[start..start + per_head]);
        let kt = kt.as_ptr().cast::<u8>();
        let vb = vb.as_ptr().cast::<u8>();
        // SAFETY: `kt` holds the head's block of K in form `F`.
        let s = unsafe { block_scores::<C, G, F>(kt, &q) };
        let base = bi * BS;
        let mut p = [_mm512_setzero_ps(); G];
        let mut corr = [_mm512_set1_ps(1.0); G];
        for k in 0..G {
            let Some((from, valid)) = qs.visible_in_block(pos[k], base, BS) else { continue };
            (p[k], corr[k]) = softmax_step(s[k], from, valid, qs.scale, &mut m[k], &mut l[k]);
        }
        // SAFETY: `vb` holds the head's block of V in form `F`.
        unsafe { accumulate_values::<C, G, F>(&mut acc, &p, &corr, vb) };
    }
    store_results(&acc, &l, v0, out);
}

/// One block's scores, `s[k][j] = q_k · K[:, j]`. `kt` must hold the block's keys of
/// this head transposed, in form `F` (see [`super::kv_quant::put_k_row`]).
// Register-blocked loops index several arrays by the same counters; iterators would
// obscure which registers pair up.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,f16c,fma,avx2")]
unsafe fn block_scores<const C: usize, const G: usize, const F: u8>(kt: *const u8, q: &[&[f32]; G]) -> [__m512; G] {
    let hd = 16 * C;
    // Quantized: the 16 slots' scales of each 32 dimensions, then the codes.
    let codes = unsafe { kt.add(hd / 32 * BS * 2) };
    let mut scale = _mm512_setzero_ps();
    // Scores: s[k][j] = q_k · K[:, j].
    let mut s = [_mm512_setzero_ps(); G];
    for d in 0..hd {
        if matches!(F, Q8_0 | Q4_0) && d % 32 == 0 {
            // SAFETY: the block starts with `hd / 32` runs of 16 f16 scales.
            scale = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(kt.add(d / 32 * BS * 2).cast())) };
        }
        // SAFETY: `kt` holds `hd × 16` values in form `F`.
        let kcol = unsafe {
            match F {
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(kt.add(d * BS * 2).cast())),
                F32 => _mm512_loadu_ps(kt.add(d * BS * 4).cast()),
                Q8_0 => _mm512_mul_ps(scale, bytes16(_mm_loadu_si128(codes.add(d * BS).cast()))),
                _ => _mm512_mul_ps(scale, bytes16(nibbles16(codes.add(d * 8)))),
            }
        };
        for k in 0..G {
            s[k] = _mm512_fmadd_ps(_mm512_set1_ps(q[k][d]), kcol, s[k]);
        }
    }
    s
}

/// One vector's online softmax over a block: its scores `s` scaled and masked to the
/// slots `from..valid` it sees, its running max `m` and sum `l` moved on. Returns the
/// block's probabilities and the factor its accumulators are rescaled by.
#[inline]
#[target_feature(enable = "avx512f,f16c,fma")]
fn softmax_step(s: __m512, from: usize, valid: usize, scale: f32, m: &mut f32, l: &mut f32) -> (__m512, __m512) {
    // Bits `from..valid`.
    let mask = (((1u32 << valid) - 1) & !((1u32 << from) - 1)) as __mmask16;
    let sk = _mm512_mask_mov_ps(_mm512_set1_ps(f32::NEG_INFINITY), mask, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
    let m_new = m.max(_mm512_reduce_max_ps(sk));
    let c = super::ops::fast_exp(*m - m_new);
    let p = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(sk, _mm512_set1_ps(m_new))));
    *l = *l * c + _mm512_reduce_add_ps(p);
    *m = m_new;
    (p, _mm512_set1_ps(c))
}

/// Sixteen signed bytes as floats.
#[inline]
#[target_feature(enable = "avx512f")]
fn bytes16(q: __m128i) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))
}

/// Sixteen nibble codes in 8 bytes (slot `i` low, `i + 8` high), minus 8.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles16(c: *const u8) -> __m128i {
    // SAFETY: the caller passes 8 readable bytes.
    let raw = unsafe { _mm_loadl_epi64(c.cast()) };
    let low = _mm_set1_epi8(0x0f);
    let (lo, hi) = (_mm_and_si128(raw, low), _mm_and_si128(_mm_srli_epi16(raw, 4), low));
    _mm_sub_epi8(_mm_unpacklo_epi64(lo, hi), _mm_set1_epi8(8))
}

/// Values `16 c..16 c + 16` of V row `j` in form `F`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,f16c,fma,avx2")]
unsafe fn v_chunk<const F: u8>(vb: *const u8, hd: usize, j: usize, c: usize) -> __m512 {
    // A quantized row is GGUF blocks of 32: chunk `c` is half `c % 2` of block `c / 2`.
    let block = |bytes: usize| unsafe { vb.add(j * (hd / 32) * bytes + c / 2 * bytes) };
    let scale = |b: *const u8| _mm512_set1_ps(half::f16::from_le_bytes(unsafe { [*b, *b.add(1)] }).to_f32());
    // SAFETY: the caller passes V rows of `hd` values in form `F`.
    unsafe {
        match F {
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(vb.add((j * hd + c * 16) * 2).cast())),
            F32 => _mm512_loadu_ps(vb.add((j * hd + c * 16) * 4).cast()),
            Q8_0 => {
                let b = block(34);
                _mm512_mul_ps(scale(b), bytes16(_mm_loadu_si128(b.add(2 + c % 2 * 16).cast())))
            }
            _ => {
                let b = block(18);
                let raw = _mm_loadu_si128(b.add(2).cast());
                let low = _mm_set1_epi8(0x0f);
                let nib = if c.is_multiple_of(2) { raw } else { _mm_srli_epi16(raw, 4) };
                let q = _mm_sub_epi8(_mm_and_si128(nib, low), _mm_set1_epi8(8));
                _mm512_mul_ps(scale(b), bytes16(q))
            }
        }
    }
}

/// Rescales each vector's accumulators by `corr`, then adds the block's values
/// weighted by `p`. `vb` must hold the block's values of this head: 16 rows of
/// `16 * C` values in form `F`.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,f16c,fma,avx2")]
unsafe fn accumulate_values<const C: usize, const G: usize, const F: u8>(
    acc: &mut [[__m512; C]; G],
    p: &[__m512; G],
    corr: &[__m512; G],
    vb: *const u8,
) {
    let hd = 16 * C;
    for k in 0..G {
        for a in acc[k].iter_mut() {
            *a = _mm512_mul_ps(*a, corr[k]);
        }
    }
    // Values: acc[k] += Σ_j p[k][j] · V[j, :].
    let mut pj = [[0f32; BS]; G];
    for k in 0..G {
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(pj[k].as_mut_ptr(), p[k]) };
    }
    for j in 0..BS {
        for c in 0..C {
            // SAFETY: `vb` holds `16 × hd` values in form `F`.
            let vrow = unsafe { v_chunk::<F>(vb, hd, j, c) };
            for k in 0..G {
                acc[k][c] = _mm512_fmadd_ps(_mm512_set1_ps(pj[k][j]), vrow, acc[k][c]);
            }
        }
    }
}

/// Each vector's result, its accumulators over its softmax sum `l` (zero when it
/// saw no key), into its place in `out`.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,f16c,fma")]
fn store_results<const C: usize, const G: usize>(acc: &[[__m512; C]; G], l: &[f32; G], v0: usize, out: &mut [f32]) {
    let hd = 16 * C;
    for k in 0..G {
        let inv = _mm512_set1_ps(if l[k] > 0.0 { 1.0 / l[k] } else { 0.0 });
        let o = &mut out[(v0 + k) * hd..(v0 + k + 1) * hd];
        for c in 0..C {
            // SAFETY: `o` holds `hd` floats.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(c * 16), _mm512_mul_ps(acc[k][c], inv)) };
        }
    }
}

/// `fast_exp` on 16 lanes: the same reduction and polynomial, with `scalef` for 2^k.
#[target_feature(enable = "avx512f,fma")]
fn exp512(x: __m512) -> __m512 {
    let x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0)), _mm512_set1_ps(-87.0));
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm512_set1_ps(1.0 / 5040.0);
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, k)
}
