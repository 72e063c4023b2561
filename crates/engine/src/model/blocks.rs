//! Building blocks every architecture's layer is made of: row-wise RMSNorm,
//! self-attention of a whole batch over the paged cache (optional per-head Q/K norms,
//! sliding window, query scaling) and the gated feed-forward network. Each works row by
//! row in a fixed order, so a token's result never depends on its batch.

use super::forward::{ForwardScratch, SeqBatch, Step};
use super::linear::{load_vector, Linear, LinearScratch};
use crate::config::ModelConfig;
use crate::format::{FormatError, TensorSource};
use crate::kernels::attention::{self, AttnScratch, Queries};
use crate::kernels::ops::{add_assign, gelu_tanh_f16_mul, rms_norm, silu_mul, RopeTable};
use crate::kernels::{fit, kv_quant};
use crate::kvcache::KvStorage;
use crate::threadpool::{DisjointMut, ThreadPool};
use std::cell::RefCell;

/// `blk.{l}.{name}.weight`, GGUF's name of layer `l`'s tensor.
pub(super) fn weight(l: usize, name: &str) -> String {
    format!("blk.{l}.{name}.weight")
}

/// The model's RoPE with the per-pair factors of tensor `factors` where the file has
/// it (Llama 3's `rope_freqs`, Phi-3.5's long or short factors) and its attention
/// factor.
pub(super) fn rope_with_factors(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    factors: &str,
) -> Result<crate::kernels::ops::Rope, FormatError> {
    let factors = match src.tensor(factors) {
        Some(_) => load_vector(src, factors, cfg.head_dim / 2)?,
        None => Vec::new(),
    };
    let plain = crate::kernels::ops::Rope::plain(cfg.rope_theta);
    Ok(crate::kernels::ops::Rope { factors, attn_factor: cfg.rope_attn_factor, ..plain })
}

/// An error naming layer `l`'s projection whose shape does not fit the config.
fn shape_error(l: usize, what: &str) -> FormatError {
    FormatError::Invalid(format!("layer {l} {what}: shape does not match the config"))
}

/// Self-attention: the q/k/v projection (fused in one matrix, whether the file holds
/// one or three), per-head RMSNorm of queries and keys where the model has it, RoPE,
/// the paged cache and the output projection.
pub(super) struct Attention {
    /// q | k | v fused.
    qkv: Linear,
    /// Per-head RMSNorm weights of the queries and keys (`head_dim` each).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    o: Linear,
}

impl Attention {
    /// Loads layer `l`'s attention: `attn_qkv` or `attn_q`/`attn_k`/`attn_v` (with
    /// their biases when `bias`), `attn_output`, and `attn_q_norm`/`attn_k_norm` when
    /// `qk_norm`.
    pub(super) fn load(
        src: &dyn TensorSource,
        cfg: &ModelConfig,
        l: usize,
        bias: bool,
        qk_norm: bool,
    ) -> Result<Self, FormatError> {
        let n = |s: &str| weight(l, s);
        let names = if src.tensor(&n("attn_qkv")).is_some() {
            vec![n("attn_qkv")]
        } else {
            vec![n("attn_q"), n("attn_k"), n("attn_v")]
        };
        let qkv = Linear::load(src, &names, bias)?;
        let o = Linear::load(src, &[n("attn_output")], false)?;
        if (qkv.out_features, qkv.in_features) != (cfg.q_dim() + 2 * cfg.kv_dim(), cfg.hidden) {
            return Err(shape_error(l, "attention q/k/v"));
        }
        if (o.out_features, o.in_features) != (cfg.hidden, cfg.q_dim()) {
            return Err(shape_error(l, "attention output"));
        }
        let qk_norm = if qk_norm {
            let hd = cfg.head_dim;
            Some((load_vector(src, &n("attn_q_norm"), hd)?, load_vector(src, &n("attn_k_norm"), hd)?))
        } else {
            None
        };
        Ok(Attention { qkv, qk_norm, o })
    }

    pub(super) fn size_bytes(&self) -> usize {
        self.qkv.size_bytes() + self.o.size_bytes()
    }

    /// Attention of the normed rows in `s.h` through layer `l` of the cache, into
    /// `s.proj` (`tokens × hidden`), each token's K and V written to the cache first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        c: &ModelConfig,
        step: &Step<'_, '_>,
        l: usize,
        rope: &RopeTable,
        spec: AttnSpec,
        kv: &mut KvStorage,
        s: &mut ForwardScratch,
    ) {
        let (isa, pool) = (step.isa, step.pool);
        let (t, qd, kvd) = (step.positions.len(), c.q_dim(), c.kv_dim());
        let width = qd + 2 * kvd;
        fit(&mut s.qkv, t * width);
        self.qkv.forward(isa, pool, &s.h, t, &mut s.qkv, &mut s.lin);
        for (i, row) in s.qkv.chunks_exact_mut(width).enumerate() {
            if let Some((q_norm, k_norm)) = &self.qk_norm {
                let (q, k) = row[..qd + kvd].split_at_mut(qd);
                norm_heads(q, q_norm, c.rms_eps, &mut s.head);
                norm_heads(k, k_norm, c.rms_eps, &mut s.head);
            }
            rope.apply(c.rope_style, i, &mut row[..qd + kvd]);
            // A query scale goes in before the f16 rounding, as in llama.cpp.
            if spec.query_scale != 1.0 {
                for x in &mut row[..qd] {
                    *x *= spec.query_scale;
                }
            }
            round_to_f16(&mut row[..qd]);
        }
        store_kv(kv, l, step.batch, &s.qkv, width, qd, kvd);
        attend_all(step, c, l, kv, &s.qkv, spec, &mut s.attn);
        fit(&mut s.proj, t * c.hidden);
        self.o.forward(isa, pool, &s.attn, t, &mut s.proj, &mut s.lin);
    }
}

/// Buffers of a gated feed-forward pass.
#[derive(Default)]
pub(super) struct MlpScratch {
    gu: Vec<f32>,
    act: Vec<f32>,
}

impl MlpScratch {
    /// Bytes its buffers hold.
    pub(super) fn bytes(&self) -> usize {
        4 * (self.gu.capacity() + self.act.capacity())
    }
}

/// The gated feed-forward network, `down(act(gate · x) ⊙ up · x)`, with gate and up
/// fused in one matrix (whether the file holds one, as Phi-3, or two).
pub(super) struct GatedMlp {
    gate_up: Linear,
    down: Linear,
    act: Activation,
}

impl GatedMlp {
    /// Layer `l`'s `ffn_gate` and `ffn_up` (or `ffn_up` alone, gate then up) and
    /// `ffn_down`, `width` wide inside.
    pub(super) fn load(
        src: &dyn TensorSource,
        cfg: &ModelConfig,
        l: usize,
        width: usize,
        act: Activation,
    ) -> Result<Self, FormatError> {
        let n = |s: &str| weight(l, s);
        let names =
            if src.tensor(&n("ffn_gate")).is_some() { vec![n("ffn_gate"), n("ffn_up")] } else { vec![n("ffn_up")] };
        let gate_up = Linear::load(src, &names, false)?;
        let mlp = GatedMlp { gate_up, down: Linear::load(src, &[n("ffn_down")], false)?, act };
        mlp.check(cfg, l, width)?;
        Ok(mlp)
    }

    /// One SwiGLU expert from expert `e` of layer `l`'s 3-D expert tensors.
    pub(super) fn load_expert(
        src: &dyn TensorSource,
        cfg: &ModelConfig,
        l: usize,
        e: usize,
        width: usize,
    ) -> Result<Self, FormatError> {
        let n = |s: &str| weight(l, s);
        let gate_up = Linear::load_expert(src, &[n("ffn_gate_exps"), n("ffn_up_exps")], e)?;
        let down = Linear::load_expert(src, &[n("ffn_down_exps")], e)?;
        let mlp = GatedMlp { gate_up, down, act: Activation::Silu };
        mlp.check(cfg, l, width)?;
        Ok(mlp)
    }

    fn check(&self, cfg: &ModelConfig, l: usize, width: usize) -> Result<(), FormatError> {
        if (self.gate_up.out_features, self.gate_up.in_features) != (2 * width, cfg.hidden) {
            return Err(shape_error(l, "ffn gate/up"));
        }
        if (self.down.out_features, self.down.in_features) != (cfg.hidden, width) {
            return Err(shape_error(l, "ffn down"));
        }
        Ok(())
    }

    /// The network over `t` rows of `x` into `out` (`t × hidden`).
    pub(super) fn forward_rows(
        &self,
        step: &Step<'_, '_>,
        x: &[f32],
        t: usize,
        out: &mut Vec<f32>,
        m: &mut MlpScratch,
        lin: &mut LinearScratch,
    ) {
        let (isa, pool, f) = (step.isa, step.pool, self.down.in_features);
        fit(&mut m.gu, t * 2 * f);
        self.gate_up.forward(isa, pool, x, t, &mut m.gu, lin);
        gated_activation(pool, &m.gu, f, self.act, &mut m.act);
        fit(out, t * self.down.out_features);
        self.down.forward(isa, pool, &m.act, t, out, lin);
    }
}

/// RMS-normalizes every row of `x` into `out`, rows split over the pool.
pub(super) fn norm_rows(pool: &ThreadPool, x: &[f32], w: &[f32], eps: f32, h: usize, out: &mut Vec<f32>) {
    let t = x.len() / h;
    fit(out, x.len());
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
    /// Multiplies the queries before they are rounded to f16 (1 for none).
    pub query_scale: f32,
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
    fit(out, positions.len() * qd);
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
            // A cache stored under a rotation meets queries turned alike, and its
            // values come out turned: turned back here (see `Rotation`).
            if let Some(r) = kv.rotation {
                kv_quant::rotate(q, r.k);
            }
            let qs = Queries { q, pos: &positions[t0..t0 + n], n_rep, scale: spec.scale, window: spec.window };
            attention::attend(step.isa, &layer_kv, g, batch[si].blocks, &qs, o, scr);
            if let Some(r) = kv.rotation {
                kv_quant::rotate(o, r.v);
            }
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
    fit(out, t * f);
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

/// A layer's feed-forward part: from the normed rows in `s.h` into `s.proj`.
pub(super) trait FeedForward {
    fn forward(&self, step: &Step<'_, '_>, s: &mut ForwardScratch);
    fn size_bytes(&self) -> usize;
}

impl FeedForward for GatedMlp {
    fn forward(&self, step: &Step<'_, '_>, s: &mut ForwardScratch) {
        self.forward_rows(step, &s.h, step.positions.len(), &mut s.proj, &mut s.mlp, &mut s.lin);
    }

    fn size_bytes(&self) -> usize {
        self.gate_up.size_bytes() + self.down.size_bytes()
    }
}

/// The pre-norm residual layer most decoders share (Llama, Qwen, Phi, Mistral):
///
/// ```text
/// x += attention(norm(x))
/// x += ffn(norm(x))
/// ```
pub(super) struct PreNormLayer<F> {
    attn_norm: Vec<f32>,
    attn: Attention,
    ffn_norm: Vec<f32>,
    ffn: F,
}

impl<F: FeedForward> PreNormLayer<F> {
    /// Layer `l`'s two norms around `attn` and `ffn`.
    pub(super) fn load(
        src: &dyn TensorSource,
        cfg: &ModelConfig,
        l: usize,
        attn: Attention,
        ffn: F,
    ) -> Result<Self, FormatError> {
        let attn_norm = load_vector(src, &weight(l, "attn_norm"), cfg.hidden)?;
        Ok(PreNormLayer { attn_norm, attn, ffn_norm: load_vector(src, &weight(l, "ffn_norm"), cfg.hidden)?, ffn })
    }

    pub(super) fn size_bytes(&self) -> usize {
        self.attn.size_bytes() + self.ffn.size_bytes()
    }
}

/// Runs the residual stream `s.x` through `layers`, all rotated by `rope` and scored
/// by `spec`; `false` when `on_layer` stopped the pass.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_pre_norm<F: FeedForward>(
    c: &ModelConfig,
    layers: &[PreNormLayer<F>],
    step: &Step<'_, '_>,
    rope: &RopeTable,
    spec: AttnSpec,
    kv: &mut KvStorage,
    s: &mut ForwardScratch,
    on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
) -> bool {
    for (l, layer) in layers.iter().enumerate() {
        norm_rows(step.pool, &s.x, &layer.attn_norm, c.rms_eps, c.hidden, &mut s.h);
        layer.attn.forward(c, step, l, rope, spec, kv, s);
        add_assign(&mut s.x, &s.proj);
        if !on_layer(l, kv) {
            return false;
        }
        norm_rows(step.pool, &s.x, &layer.ffn_norm, c.rms_eps, c.hidden, &mut s.h);
        layer.ffn.forward(step, s);
        add_assign(&mut s.x, &s.proj);
    }
    true
}
