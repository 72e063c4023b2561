//! The Gemma 3 decoder layer (text), as the Gemma 3 technical report describes it and
//! llama.cpp runs it:
//!
//! ```text
//! x = embed(token) · sqrt(hidden)
//! per layer:
//!   q, k, v = Wq · norm(x), Wk · norm(x), Wv · norm(x)
//!   q, k    = rope(norm_q(q)), rope(norm_k(k))          per-head RMSNorm, NEOX pairs
//!   x      += norm(Wo · attention(q · query_scale, k, v))
//!   x      += norm(Wdown · (gelu(Wgate · norm(x)) ⊙ Wup · norm(x)))
//! ```
//!
//! Every norm is an RMSNorm with its own weights (GGUF files hold Gemma's `1 + w`
//! already folded in). Five local layers alternate with one global layer: a local
//! layer attends to the last `sliding_window` positions and rotates with the local
//! RoPE base, a global layer attends to every position with the global base. A local
//! layer keeps every cache block of its sequence, as a global one does: the simplest
//! correct choice, so export, import and prefix caching need no special case.

use super::blocks::{attend_all, gated_mlp, norm_heads, norm_rows, round_to_f16, store_kv, Activation, AttnSpec};
use super::forward::{ForwardScratch, Step};
use super::linear::{load_vector, Linear};
use crate::config::{Gemma3Config, ModelConfig};
use crate::format::{FormatError, TensorSource};
use crate::kernels::ops::{add_assign, RopeTable};
use crate::kvcache::KvStorage;

pub(super) struct Layer {
    /// Whether this layer attends to every position (else to the sliding window).
    global: bool,
    attn_norm: Vec<f32>,
    /// q | k | v fused.
    qkv: Linear,
    /// Per-head RMSNorm weights of the queries and keys (`head_dim` each).
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    o: Linear,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    /// gate | up fused.
    gate_up: Linear,
    down: Linear,
    post_ffn_norm: Vec<f32>,
}

impl Layer {
    pub(super) fn load(
        src: &dyn TensorSource,
        cfg: &ModelConfig,
        g: &Gemma3Config,
        l: usize,
    ) -> Result<Self, FormatError> {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let qkv = Linear::load(src, &[n("attn_q"), n("attn_k"), n("attn_v")], false)?;
        let o = Linear::load(src, &[n("attn_output")], false)?;
        let gate_up = Linear::load(src, &[n("ffn_gate"), n("ffn_up")], false)?;
        let down = Linear::load(src, &[n("ffn_down")], false)?;
        super::expect_shapes(cfg, l, &qkv, &o, &gate_up, &down)?;
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        Ok(Layer {
            global: g.is_global(l),
            attn_norm: load_vector(src, &n("attn_norm"), h)?,
            qkv,
            q_norm: load_vector(src, &n("attn_q_norm"), hd)?,
            k_norm: load_vector(src, &n("attn_k_norm"), hd)?,
            o,
            post_attn_norm: load_vector(src, &n("post_attention_norm"), h)?,
            ffn_norm: load_vector(src, &n("ffn_norm"), h)?,
            gate_up,
            down,
            post_ffn_norm: load_vector(src, &n("post_ffw_norm"), h)?,
        })
    }

    pub(super) fn size_bytes(&self) -> usize {
        self.qkv.size_bytes() + self.o.size_bytes() + self.gate_up.size_bytes() + self.down.size_bytes()
    }
}

/// The scale Gemma applies to its embeddings before the first layer.
pub(super) fn embedding_scale(cfg: &ModelConfig) -> f32 {
    (cfg.hidden as f32).sqrt()
}

/// Runs the residual stream `s.x` through every layer; `false` when `on_layer` stopped
/// the pass.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_layers(
    c: &ModelConfig,
    g: &Gemma3Config,
    layers: &[Layer],
    step: &Step<'_, '_>,
    kv: &mut KvStorage,
    s: &mut ForwardScratch,
    on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
) -> bool {
    let rope_local = RopeTable::new(c.head_dim, g.rope_theta_local, step.positions);
    let rope_global = RopeTable::scaled(c.head_dim, c.rope_theta, g.rope_scale_global, step.positions);
    for (l, layer) in layers.iter().enumerate() {
        let (rope, window) = if layer.global { (&rope_global, None) } else { (&rope_local, Some(g.sliding_window)) };
        attention_block(c, g, step, l, layer, rope, window, kv, s);
        if !on_layer(l, kv) {
            return false;
        }
        ffn_block(c, step, layer, s);
    }
    true
}

#[allow(clippy::too_many_arguments)]
fn attention_block(
    c: &ModelConfig,
    g: &Gemma3Config,
    step: &Step<'_, '_>,
    l: usize,
    layer: &Layer,
    rope: &RopeTable,
    window: Option<usize>,
    kv: &mut KvStorage,
    s: &mut ForwardScratch,
) {
    let (isa, pool) = (step.isa, step.pool);
    let (t, h, qd, kvd) = (step.positions.len(), c.hidden, c.q_dim(), c.kv_dim());
    let width = qd + 2 * kvd;
    norm_rows(pool, &s.x, &layer.attn_norm, c.rms_eps, h, &mut s.h);
    s.qkv.resize(t * width, 0.0);
    layer.qkv.forward(isa, pool, &s.h, t, &mut s.qkv, &mut s.lin);
    for (i, row) in s.qkv.chunks_exact_mut(width).enumerate() {
        let (q, k) = row[..qd + kvd].split_at_mut(qd);
        norm_heads(q, &layer.q_norm, c.rms_eps, &mut s.head);
        norm_heads(k, &layer.k_norm, c.rms_eps, &mut s.head);
        rope.apply(c.rope_style, i, &mut row[..qd + kvd]);
        // The query scale goes in before the f16 rounding, as in llama.cpp; attention
        // itself then scales by 1.
        for x in &mut row[..qd] {
            *x *= g.query_scale;
        }
        round_to_f16(&mut row[..qd]);
    }
    store_kv(kv, l, step.batch, &s.qkv, width, qd, kvd);
    attend_all(step, c, l, kv, &s.qkv, AttnSpec { scale: 1.0, window }, &mut s.attn);
    s.proj.resize(t * h, 0.0);
    layer.o.forward(isa, pool, &s.attn, t, &mut s.proj, &mut s.lin);
    norm_rows(pool, &s.proj, &layer.post_attn_norm, c.rms_eps, h, &mut s.h);
    add_assign(&mut s.x, &s.h);
}

fn ffn_block(c: &ModelConfig, step: &Step<'_, '_>, layer: &Layer, s: &mut ForwardScratch) {
    let (pool, h) = (step.pool, c.hidden);
    norm_rows(pool, &s.x, &layer.ffn_norm, c.rms_eps, h, &mut s.h);
    gated_mlp(c, step, (&layer.gate_up, &layer.down), Activation::GeluTanh, s);
    norm_rows(pool, &s.proj, &layer.post_ffn_norm, c.rms_eps, h, &mut s.h);
    add_assign(&mut s.x, &s.h);
}
