//! Causal attention over the paged KV cache, in any of its [`KvDtype`]s.
//!
//! Work is split by (sequence, KV head, tile of query tokens). The tile converts each
//! cache block to f32 once (f16 by F16C, q8_0 and q4_0 by [`kv_quant::read_row`]: a
//! 16-token tile in scratch, never a widened copy of the cache) and reuses it for all
//! its queries and for the query heads sharing the KV head (GQA). Each query keeps its own online-softmax state and visits
//! blocks in order 0, 1, 2, …, so its result is the same whether it is decoded alone or
//! prefilled in a chunk with others.

use super::kv_quant::{self, words_as_bytes};
use super::ops::fast_exp;
use super::Isa;
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use pdserve_types::KvDtype;

/// One layer's K and V pools as the KV cache stores them: in f16, K
/// `[block][kv_head][head_dim][slot]` and V `[block][kv_head][slot][head_dim]`;
/// quantized, both `[block][kv_head][slot][row]`.
pub struct LayerKv<'a> {
    pub k: &'a [u16],
    pub v: &'a [u16],
    pub dtype: KvDtype,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Words of one token's row of one head.
    pub row_words: usize,
}

impl LayerKv<'_> {
    fn head_block<'b>(&self, pool: &'b [u16], block: u32, g: usize) -> &'b [u16] {
        let per_head = self.block_size * self.row_words;
        let start = (block as usize * self.n_kv_heads + g) * per_head;
        &pool[start..start + per_head]
    }

    /// An f16 cache's block, as f16.
    fn head_block_f16<'b>(&self, pool: &'b [u16], block: u32, g: usize) -> &'b [f16] {
        self.head_block(pool, block, g).reinterpret_cast()
    }
}

/// The queries of one work item.
pub struct Queries<'a> {
    /// `n × n_rep × head_dim`, already rotated.
    pub q: &'a [f32],
    /// Absolute position of each query token; it sees positions `0..=pos`, or only
    /// the last `window` of them.
    pub pos: &'a [usize],
    /// Query heads per KV head.
    pub n_rep: usize,
    pub scale: f32,
    /// Sliding window: a query at `p` sees key `k` only when `p - k < window`.
    pub window: Option<usize>,
}

impl Queries<'_> {
    /// The first position a query at `p` sees.
    pub fn first_visible(&self, p: usize) -> usize {
        self.window.map_or(0, |w| (p + 1).saturating_sub(w))
    }

    /// The slots `from..to` of the cache block starting at `base` that a query at `p`
    /// sees; `None` when it sees none of them.
    #[inline(always)]
    pub fn visible_in_block(&self, p: usize, base: usize, bs: usize) -> Option<(usize, usize)> {
        let lo = self.first_visible(p);
        if base > p || base + bs <= lo {
            return None;
        }
        Some((lo.saturating_sub(base), bs.min(p + 1 - base)))
    }
}

/// Reused buffers, one per thread.
#[derive(Default)]
pub struct AttnScratch {
    kf: Vec<f32>,
    vf: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
    #[cfg(target_arch = "x86_64")]
    staged: super::attention_avx512::Staged,
}

/// Attention of `qs` against KV head `g` of a sequence whose blocks are `blocks`;
/// writes `n × n_rep × head_dim` into `out`.
pub fn attend(
    isa: Isa,
    kv: &LayerKv<'_>,
    g: usize,
    blocks: &[u32],
    qs: &Queries<'_>,
    out: &mut [f32],
    s: &mut AttnScratch,
) {
    match isa {
        // SAFETY: the ISA was detected on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => {
            if !super::attention_avx512::attend(kv, g, blocks, qs, out, &mut s.staged) {
                unsafe { attend_avx512(kv, g, blocks, qs, out, s) }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { attend_avx2(kv, g, blocks, qs, out, s) },
        _ => attend_tiles(Isa::Scalar, kv, g, blocks, qs, out, s),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn attend_avx512(
    kv: &LayerKv<'_>,
    g: usize,
    blocks: &[u32],
    qs: &Queries<'_>,
    out: &mut [f32],
    s: &mut AttnScratch,
) {
    attend_tiles(Isa::Avx512Vnni, kv, g, blocks, qs, out, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(
    kv: &LayerKv<'_>,
    g: usize,
    blocks: &[u32],
    qs: &Queries<'_>,
    out: &mut [f32],
    s: &mut AttnScratch,
) {
    attend_tiles(Isa::Avx2, kv, g, blocks, qs, out, s)
}

/// The tile kernels, compiled into each ISA's wrapper: each cache block turned into
/// f32 once (f16 by F16C where `isa` has it; quantized K and V by
/// [`kv_quant::read_k_block`] and [`kv_quant::read_row`]), then the same arithmetic.
#[inline(always)]
fn attend_tiles(
    isa: Isa,
    kv: &LayerKv<'_>,
    g: usize,
    blocks: &[u32],
    qs: &Queries<'_>,
    out: &mut [f32],
    s: &mut AttnScratch,
) {
    match (kv.dtype, isa) {
        #[cfg(target_arch = "x86_64")]
        (KvDtype::F16, Isa::Avx2 | Isa::Avx512Vnni) => attend_with(kv, g, blocks, qs, out, s, f16c::to_f32),
        (KvDtype::F16, _) => attend_with(kv, g, blocks, qs, out, s, |src, dst| src.convert_to_f32_slice(dst)),
        _ => attend_rows(isa, kv, g, blocks, qs, out, s),
    }
}

/// Quantized blocks' tiles: K transposed, as f16's, and V rows.
#[inline(always)]
fn attend_rows(
    isa: Isa,
    kv: &LayerKv<'_>,
    g: usize,
    blocks: &[u32],
    qs: &Queries<'_>,
    out: &mut [f32],
    s: &mut AttnScratch,
) {
    let hd = kv.head_dim;
    // A head's 16 V rows lie one after another, whole quantization blocks each: one
    // read of the run fills the tile. K comes transposed, as f16's does.
    let read = |pool: &[u16], block: u32, tile: &mut [f32]| {
        kv_quant::read_row(isa, kv.dtype, words_as_bytes(kv.head_block(pool, block, g)), tile)
    };
    let read_k = |block: u32, tile: &mut [f32]| {
        kv_quant::read_k_block(isa, kv.dtype, words_as_bytes(kv.head_block(kv.k, block, g)), hd, tile)
    };
    walk_blocks(
        kv,
        blocks,
        qs,
        out,
        s,
        |block, kf, vf| {
            read_k(block, kf);
            read(kv.v, block, vf);
        },
        transposed_scores,
    )
}

/// F16C conversion, eight values per instruction.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use half::f16;
    use std::arch::x86_64::*;

    pub fn to_f32(src: &[f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        let n8 = src.len() / 8 * 8;
        // SAFETY: only reached from kernels dispatched on CPUs with F16C; indices stay
        // below `n8 <= len` for both slices.
        unsafe { convert(src.as_ptr().cast(), dst.as_mut_ptr(), n8) };
        for (d, s) in dst[n8..].iter_mut().zip(&src[n8..]) {
            *d = s.to_f32();
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    unsafe fn convert(src: *const u16, dst: *mut f32, n8: usize) {
        for i in (0..n8).step_by(8) {
            // SAFETY: the caller guarantees `n8` readable and writable elements.
            unsafe { _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(_mm_loadu_si128(src.add(i).cast()))) };
        }
    }
}

#[inline(always)]
fn attend_with(
    kv: &LayerKv<'_>,
    g: usize,
    blocks: &[u32],
    qs: &Queries<'_>,
    out: &mut [f32],
    s: &mut AttnScratch,
    to_f32: impl Fn(&[f16], &mut [f32]),
) {
    walk_blocks(
        kv,
        blocks,
        qs,
        out,
        s,
        |block, kf, vf| {
            to_f32(kv.head_block_f16(kv.k, block, g), kf);
            to_f32(kv.head_block_f16(kv.v, block, g), vf);
        },
        transposed_scores,
    )
}

/// The loop every portable kernel shares: each visible block read into the tile by
/// `read` (K into `kf`, V into `vf`: `16 × head_dim`, K in whatever layout `scores`
/// takes), then folded into each query vector's online softmax.
#[inline(always)]
fn walk_blocks(
    kv: &LayerKv<'_>,
    blocks: &[u32],
    qs: &Queries<'_>,
    out: &mut [f32],
    s: &mut AttnScratch,
    read: impl Fn(u32, &mut [f32], &mut [f32]),
    scores: impl Fn(&[f32], &[f32]) -> [f32; BS],
) {
    let (hd, bs) = (kv.head_dim, kv.block_size);
    assert_eq!(bs, BS, "attention is written for blocks of 16 tokens");
    let nvec = qs.pos.len() * qs.n_rep;
    s.m.clear();
    s.m.resize(nvec, f32::NEG_INFINITY);
    s.l.clear();
    s.l.resize(nvec, 0.0);
    s.acc.clear();
    s.acc.resize(nvec * hd, 0.0);
    s.kf.resize(bs * hd, 0.0);
    s.vf.resize(bs * hd, 0.0);
    let max_pos = qs.pos.iter().copied().max().unwrap_or(0);
    let first_block = qs.pos.iter().map(|&p| qs.first_visible(p)).min().unwrap_or(0) / bs;
    for (bi, &block) in blocks.iter().enumerate().take(max_pos / bs + 1).skip(first_block) {
        read(block, &mut s.kf, &mut s.vf);
        let base = bi * bs;
        for (i, &p) in qs.pos.iter().enumerate() {
            let Some((from, to)) = qs.visible_in_block(p, base, bs) else { continue };
            for r in 0..qs.n_rep {
                let v = i * qs.n_rep + r;
                let q = &qs.q[v * hd..(v + 1) * hd];
                let st = OnlineSoftmax { m: &mut s.m[v], l: &mut s.l[v], acc: &mut s.acc[v * hd..(v + 1) * hd] };
                st.update(scores(q, &s.kf), &s.vf, from, to, qs.scale);
            }
        }
    }
    for v in 0..nvec {
        let inv = if s.l[v] > 0.0 { 1.0 / s.l[v] } else { 0.0 };
        for (o, a) in out[v * hd..(v + 1) * hd].iter_mut().zip(&s.acc[v * hd..(v + 1) * hd]) {
            *o = a * inv;
        }
    }
}

/// A block's 16 scores from K transposed (`head_dim × 16`).
#[inline(always)]
fn transposed_scores(q: &[f32], kt: &[f32]) -> [f32; BS] {
    let mut s = [0f32; BS];
    for (d, &qd) in q.iter().enumerate() {
        let col = &kt[d * BS..(d + 1) * BS];
        for j in 0..BS {
            s[j] += qd * col[j];
        }
    }
    s
}

/// Cache block size the vectorized score loop is written for.
const BS: usize = 16;

/// One query's running max, normalizer and weighted value sum.
struct OnlineSoftmax<'a> {
    m: &'a mut f32,
    l: &'a mut f32,
    acc: &'a mut [f32],
}

impl OnlineSoftmax<'_> {
    /// Folds in one block: `s` holds its 16 unscaled scores, `v` is `16 × head_dim`,
    /// of which the slots `from..valid` are visible to this query.
    #[inline(always)]
    fn update(self, mut s: [f32; BS], v: &[f32], from: usize, valid: usize, scale: f32) {
        let hd = self.acc.len();
        let mut bmax = f32::NEG_INFINITY;
        for (j, x) in s.iter_mut().enumerate() {
            *x = if (from..valid).contains(&j) { *x * scale } else { f32::NEG_INFINITY };
            bmax = bmax.max(*x);
        }
        let m_new = self.m.max(bmax);
        let corr = fast_exp(*self.m - m_new);
        let mut p = [0f32; BS];
        let mut psum = 0.0;
        for j in 0..BS {
            p[j] = if (from..valid).contains(&j) { fast_exp(s[j] - m_new) } else { 0.0 };
            psum += p[j];
        }
        *self.l = *self.l * corr + psum;
        for a in self.acc.iter_mut() {
            *a *= corr;
        }
        for (j, &pj) in p.iter().enumerate().take(valid).skip(from) {
            for (a, x) in self.acc.iter_mut().zip(&v[j * hd..(j + 1) * hd]) {
                *a += pj * x;
            }
        }
        *self.m = m_new;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ops::dot;

    /// Plain softmax attention in f64 over dequantized K/V.
    /// Keys `from..=upto` are visible.
    fn reference(k: &[f32], v: &[f32], q: &[f32], (from, upto): (usize, usize), hd: usize, scale: f32) -> Vec<f32> {
        let sc: Vec<f64> = (from..=upto).map(|p| (dot(q, &k[p * hd..(p + 1) * hd]) * scale) as f64).collect();
        let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
        let z: f64 = e.iter().sum();
        (0..hd).map(|d| (from..=upto).map(|p| e[p - from] / z * v[p * hd + d] as f64).sum::<f64>() as f32).collect()
    }

    #[test]
    fn matches_reference_and_is_tile_invariant() {
        // f16 with 64 and 128 takes the AVX-512 register kernel, 16 and 256 the
        // portable one; quantized caches (whole blocks of 32) their row kernels.
        // Windows: none, one key, within a block, a block, across blocks, all keys.
        for (dtype, hds) in [
            (KvDtype::F16, &[16, 64, 128, 256][..]),
            (KvDtype::Q8_0, &[64, 128, 256][..]),
            (KvDtype::Q4_0, &[64, 256][..]),
        ] {
            for &hd in hds {
                for window in [None, Some(1), Some(5), Some(16), Some(19), Some(21), Some(100)] {
                    check_head_dim(dtype, hd, window);
                }
            }
        }
    }

    fn check_head_dim(dtype: KvDtype, hd: usize, window: Option<usize>) {
        let (bs, nkv, n_rep, ctx) = (16, 2, 3, 40);
        let nblocks = ctx / bs + 1;
        let mut rng = pdserve_types::rng::Rng::new(1);
        let mut rnd = || (rng.next_f64() * 2.0 - 1.0) as f32;
        let cfg = crate::config::ModelConfig {
            n_layers: 1,
            n_kv_heads: nkv,
            head_dim: hd,
            ..crate::testing::random_llama_config()
        };
        let mut cache = crate::kvcache::KvStorage::with_dtype(&cfg, nblocks, bs, dtype);
        // Blocks stored out of order, as a paged cache does.
        let order: Vec<u32> = vec![2, 0, 1];
        for p in 0..ctx {
            let (k, v): (Vec<f32>, Vec<f32>) = (0..nkv * hd).map(|_| (rnd(), rnd())).unzip();
            cache.write(0, &order, p, &k, &v);
        }
        let kv = cache.layer(0);
        let g = 1;
        // What the cache holds, read back by the scalar reference.
        let shape = cache.block_shape();
        let logical = |is_k: bool| -> Vec<f32> {
            (0..ctx)
                .flat_map(|p| {
                    let (k, v) = cache.block(0, order[p / bs]);
                    let rows = crate::kvcache::read_rows(shape, dtype, if is_k { k } else { v }, is_k);
                    rows[(g * bs + p % bs) * hd..(g * bs + p % bs + 1) * hd].to_vec()
                })
                .collect()
        };
        let (kl, vl) = (logical(true), logical(false));
        let pos: Vec<usize> = (20..ctx).collect();
        let q: Vec<f32> = (0..pos.len() * n_rep * hd).map(|_| rnd()).collect();
        for isa in Isa::available() {
            let mut all = vec![0f32; q.len()];
            let qs = Queries { q: &q, pos: &pos, n_rep, scale: 0.25, window };
            attend(isa, &kv, g, &order, &qs, &mut all, &mut AttnScratch::default());
            for (i, &p) in pos.iter().enumerate() {
                let one_q = &q[i * n_rep * hd..(i + 1) * n_rep * hd];
                let mut one = vec![0f32; n_rep * hd];
                let qs1 = Queries { q: one_q, pos: &[p], n_rep, scale: 0.25, window };
                attend(isa, &kv, g, &order, &qs1, &mut one, &mut AttnScratch::default());
                assert_eq!(one, all[i * n_rep * hd..(i + 1) * n_rep * hd], "tile changed the result");
                for r in 0..n_rep {
                    let seen = (qs1.first_visible(p), p);
                    let want = reference(&kl, &vl, &one_q[r * hd..(r + 1) * hd], seen, hd, 0.25);
                    for (a, b) in one[r * hd..(r + 1) * hd].iter().zip(&want) {
                        assert!((a - b).abs() < 1e-4, "{dtype} {isa} window {window:?}: {a} vs {b}");
                    }
                }
            }
        }
    }
}
