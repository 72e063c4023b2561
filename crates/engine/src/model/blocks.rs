//! Building blocks every architecture's layer is made of: row-wise RMSNorm, attention
//! of a whole batch over the paged cache, and the gated feed-forward activation. Each
//! works row by row in a fixed order, so a token's result never depends on its batch.

use super::forward::{ForwardScratch, SeqBatch, Step};
use super::linear::Linear;
use crate::config::ModelConfig;
use crate::kernels::attention::{self, AttnScratch, Queries};
use crate::kernels::ops::{gelu_tanh_f16_mul, rms_norm, silu_mul};
use crate::kvcache::KvStorage;
use crate::threadpool::{DisjointMut, ThreadPool};
use std::cell::RefCell;

/// RMS-normalizes every row of `x` into `out`, rows split over the pool.
pub(super) fn norm_rows(pool: &ThreadPool, x: &[f32], w: &[f32], eps: f32, h: usize, out: &mut Vec<f32>) {
    let t = x.len() / h;
    out.resize(x.len(), 0.0);
    let dst = DisjointMut::new(out);
    pool.for_ranges(t, pool.threads().min(t), &|r| {
        for i in r {
            // SAFETY: each task owns its rows.
            rms_norm(&x[i * h..(i + 1) * h], w, eps, unsafe { dst.part(i * h..(i + 1) * h) });
        }
    });
}

/// RMS-normalizes each `w.len()`-wide piece of `x` in place (per-head Q/K norms).
pub(super) fn norm_heads(x: &mut [f32], w: &[f32], eps: f32, tmp: &mut Vec<f32>) {
    tmp.resize(w.len(), 0.0);
    for head in x.chunks_exact_mut(w.len()) {
        tmp.copy_from_slice(head);
        rms_norm(tmp, w, eps, head);
    }
}

/// Rounds queries to f16: they meet f16 keys at f16 precision, as in llama.cpp.
pub(super) fn round_to_f16(x: &mut [f32]) {
    for v in x {
        *v = half::f16::from_f32(*v).to_f32();
    }
}

/// Writes every token's K and V (columns `qd..qd + kvd` and `qd + kvd..` of its row of
/// `qkv`, `width` wide) into layer `l` of the cache.
pub(super) fn store_kv(
    kv: &mut KvStorage,
    l: usize,
    batch: &[SeqBatch<'_>],
    qkv: &[f32],
    width: usize,
    qd: usize,
    kvd: usize,
) {
    let mut rows = qkv.chunks_exact(width);
    for b in batch {
        for (j, row) in rows.by_ref().take(b.tokens.len()).enumerate() {
            kv.write(l, b.blocks, b.start_pos + j, &row[qd..qd + kvd], &row[qd + kvd..]);
        }
    }
}

/// How a layer's queries meet its keys.
#[derive(Clone, Copy)]
pub(super) struct AttnSpec {
    /// Multiplies every score.
    pub scale: f32,
    /// Sliding window (see [`Queries::window`]); `None` for full causal attention.
    pub window: Option<usize>,
}

/// Query tokens per attention work item: enough to reuse each converted cache block.
const ATTN_TILE: usize = 16;

thread_local! {
    static ATTN: RefCell<(AttnScratch, Vec<f32>, Vec<f32>)> = RefCell::default();
}

/// Attention of every token's queries (columns `..q_dim` of its `qkv` row, already
/// rotated) against layer `l` of the cache, into `out` (`tokens × q_dim`).
pub(super) fn attend_all(
    step: &Step<'_, '_>,
    c: &ModelConfig,
    l: usize,
    kv: &KvStorage,
    qkv: &[f32],
    spec: AttnSpec,
    out: &mut Vec<f32>,
) {
    let (batch, positions) = (step.batch, step.positions);
    let (qd, hd, n_rep) = (c.q_dim(), c.head_dim, c.n_heads / c.n_kv_heads);
    let width = qd + 2 * c.kv_dim();
    out.resize(positions.len() * qd, 0.0);
    // Work items: (first token index, token count, seq index, kv head).
    let mut items = Vec::new();
    let mut first = 0;
    for (si, b) in batch.iter().enumerate() {
        for start in (0..b.tokens.len()).step_by(ATTN_TILE) {
            let n = ATTN_TILE.min(b.tokens.len() - start);
            items.extend((0..c.n_kv_heads).map(|g| (first + start, n, si, g)));
        }
        first += b.tokens.len();
    }
    let layer_kv = kv.layer(l);
    let out = DisjointMut::new(out);
    step.pool.run(items.len(), &|i| {
        let (t0, n, si, g) = items[i];
        ATTN.with_borrow_mut(|(scr, q, o)| {
            let span = n_rep * hd;
            q.clear();
            for t in t0..t0 + n {
                q.extend_from_slice(&qkv[t * width + g * span..t * width + (g + 1) * span]);
            }
            o.resize(n * span, 0.0);
            let qs = Queries { q, pos: &positions[t0..t0 + n], n_rep, scale: spec.scale, window: spec.window };
            attention::attend(step.isa, &layer_kv, g, batch[si].blocks, &qs, o, scr);
            for (k, t) in (t0..t0 + n).enumerate() {
                // SAFETY: items own distinct (token, kv head) pairs, so these
                // ranges never overlap.
                let dst = unsafe { out.part(t * qd + g * span..t * qd + (g + 1) * span) };
                dst.copy_from_slice(&o[k * span..(k + 1) * span]);
            }
        });
    });
}

/// The activation of a gated feed-forward network.
#[derive(Clone, Copy)]
pub(super) enum Activation {
    /// SwiGLU (Llama): `silu(gate) * up`.
    Silu,
    /// GeGLU (Gemma): `gelu(gate) * up`, GELU's tanh form rounded through f16 as
    /// llama.cpp's CPU backend computes it.
    GeluTanh,
}

/// `out[i] = act(gate[i]) * up[i]` for every row of `gu` (`tokens × 2f`, gate then up),
/// into `out` (`tokens × f`).
pub(super) fn gated_activation(pool: &ThreadPool, gu: &[f32], f: usize, act: Activation, out: &mut Vec<f32>) {
    let t = gu.len() / (2 * f);
    out.resize(t * f, 0.0);
    let dst = DisjointMut::new(out);
    pool.for_ranges(t, pool.threads().min(t), &|r| {
        for i in r {
            // SAFETY: each task owns its rows.
            let o = unsafe { dst.part(i * f..(i + 1) * f) };
            let (gate, up) = (&gu[i * 2 * f..i * 2 * f + f], &gu[i * 2 * f + f..(i + 1) * 2 * f]);
            match act {
                Activation::Silu => silu_mul(gate, up, o),
                Activation::GeluTanh => gelu_tanh_f16_mul(gate, up, o),
            }
        }
    });
}

/// The gated feed-forward, `down(act(gate · x) ⊙ up · x)`, of the normed rows in `s.h`
/// into `s.proj`; `gate_up` holds gate and up fused.
pub(super) fn gated_mlp(
    c: &ModelConfig,
    step: &Step<'_, '_>,
    (gate_up, down): (&Linear, &Linear),
    act: Activation,
    s: &mut ForwardScratch,
) {
    let (isa, pool) = (step.isa, step.pool);
    let (t, h, f) = (step.positions.len(), c.hidden, c.ffn_hidden);
    s.gu.resize(t * 2 * f, 0.0);
    gate_up.forward(isa, pool, &s.h, t, &mut s.gu, &mut s.lin);
    gated_activation(pool, &s.gu, f, act, &mut s.act);
    s.proj.resize(t * h, 0.0);
    down.forward(isa, pool, &s.act, t, &mut s.proj, &mut s.lin);
}
