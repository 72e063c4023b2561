//! The Llama-family decoder layer (Llama 2/3, SmolLM2, Mistral, Qwen2):
//!
//! ```text
//! x += Wo · attention(rope(Wq · norm(x)), rope(Wk · norm(x)), Wv · norm(x))
//! x += Wdown · (silu(Wgate · norm(x)) ⊙ Wup · norm(x))
//! ```
//!
//! Qwen2 adds biases to the q/k/v projections.

use super::blocks::{attend_all, gated_mlp, norm_rows, round_to_f16, store_kv, Activation, AttnSpec};
use super::forward::{ForwardScratch, Step};
use super::linear::{load_vector, Linear};
use crate::config::{Architecture, ModelConfig};
use crate::format::{FormatError, TensorSource};
use crate::kernels::ops::{add_assign, RopeTable};
use crate::kvcache::KvStorage;

pub(super) struct Layer {
    attn_norm: Vec<f32>,
    /// q | k | v fused.
    qkv: Linear,
    o: Linear,
    ffn_norm: Vec<f32>,
    /// gate | up fused.
    gate_up: Linear,
    down: Linear,
}

impl Layer {
    pub(super) fn load(src: &dyn TensorSource, cfg: &ModelConfig, l: usize) -> Result<Self, FormatError> {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let bias = cfg.arch == Architecture::Qwen2;
        let qkv = Linear::load(src, &[n("attn_q"), n("attn_k"), n("attn_v")], bias)?;
        let o = Linear::load(src, &[n("attn_output")], false)?;
        let gate_up = Linear::load(src, &[n("ffn_gate"), n("ffn_up")], false)?;
        let down = Linear::load(src, &[n("ffn_down")], false)?;
        super::expect_shapes(cfg, l, &qkv, &o, &gate_up, &down)?;
        Ok(Layer {
            attn_norm: load_vector(src, &n("attn_norm"), cfg.hidden)?,
            qkv,
            o,
            ffn_norm: load_vector(src, &n("ffn_norm"), cfg.hidden)?,
            gate_up,
            down,
        })
    }

    pub(super) fn size_bytes(&self) -> usize {
        self.qkv.size_bytes() + self.o.size_bytes() + self.gate_up.size_bytes() + self.down.size_bytes()
    }
}

/// Runs the residual stream `s.x` through every layer; `false` when `on_layer` stopped
/// the pass.
pub(super) fn run_layers(
    c: &ModelConfig,
    layers: &[Layer],
    step: &Step<'_, '_>,
    kv: &mut KvStorage,
    s: &mut ForwardScratch,
    on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
) -> bool {
    let rope = RopeTable::new(c.head_dim, c.rope_theta, step.positions);
    for (l, layer) in layers.iter().enumerate() {
        attention_block(c, step, l, layer, &rope, kv, s);
        if !on_layer(l, kv) {
            return false;
        }
        ffn_block(c, step, layer, s);
    }
    true
}

fn attention_block(
    c: &ModelConfig,
    step: &Step<'_, '_>,
    l: usize,
    layer: &Layer,
    rope: &RopeTable,
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
        rope.apply(c.rope_style, i, &mut row[..qd + kvd]);
        round_to_f16(&mut row[..qd]);
    }
    store_kv(kv, l, step.batch, &s.qkv, width, qd, kvd);
    let spec = AttnSpec { scale: 1.0 / (c.head_dim as f32).sqrt(), window: None };
    attend_all(step, c, l, kv, &s.qkv, spec, &mut s.attn);
    s.proj.resize(t * h, 0.0);
    layer.o.forward(isa, pool, &s.attn, t, &mut s.proj, &mut s.lin);
    add_assign(&mut s.x, &s.proj);
}

fn ffn_block(c: &ModelConfig, step: &Step<'_, '_>, layer: &Layer, s: &mut ForwardScratch) {
    norm_rows(step.pool, &s.x, &layer.ffn_norm, c.rms_eps, c.hidden, &mut s.h);
    gated_mlp(c, step, (&layer.gate_up, &layer.down), Activation::Silu, s);
    add_assign(&mut s.x, &s.proj);
}
