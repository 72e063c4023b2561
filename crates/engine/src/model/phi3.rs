//! The Phi-3 decoder (Phi-3 and Phi-3.5 mini and medium, Phi-4-mini's shape when its
//! RoPE covers whole heads): Llama's layer with q/k/v in one matrix and gate/up in
//! another, and the queries scaled by `1/sqrt(head_dim)` before attention:
//!
//! ```text
//! q | k | v = Wqkv · norm(x)
//! x        += Wo · attention(rope(q) / sqrt(d), rope(k), v)
//! gate | up = Wgate_up · norm(x)
//! x        += Wdown · (silu(gate) ⊙ up)
//! ```
//!
//! Long-context files (Phi-3.5) carry two sets of RoPE factors: the long ones are
//! used when the model's context is longer than the one it was trained with before the
//! extension, with the file's attention factor, as llama.cpp chooses them.

use super::blocks::{rope_with_factors, run_pre_norm, Activation, Attention, AttnSpec, GatedMlp, PreNormLayer};
use super::family::{no_extra, Family};
use super::forward::{ForwardScratch, Step};
use super::{LayerRange, Layers};
use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::format::{FormatError, TensorSource};
use crate::kernels::ops::{Rope, RopeTable};
use crate::kvcache::KvStorage;

impl Architecture {
    /// Phi-3 and Phi-3.5: fused q/k/v and gate/up projections, queries scaled before
    /// attention, optional long/short RoPE factors.
    pub const PHI3: Architecture = Architecture::named("phi3");
}

/// Phi-3.5's `longrope` factors are the `rope_factors_*` tensors.
pub(super) const PHI3: Family = Family {
    arch: Architecture::PHI3,
    rope: RopeStyle::Neox,
    rope_scalings: &["longrope"],
    extra: no_extra,
    load: |src, cfg, layers| Ok(Box::new(Phi3::load(src, cfg, layers)?)),
};

pub(super) struct Phi3 {
    rope: Rope,
    layers: Vec<PreNormLayer<GatedMlp>>,
}

impl Phi3 {
    pub(super) fn load(src: &dyn TensorSource, cfg: &ModelConfig, layers: LayerRange) -> Result<Self, FormatError> {
        let name = if cfg.context_length > cfg.rope_original_context {
            "rope_factors_long.weight"
        } else {
            "rope_factors_short.weight"
        };
        let rope = rope_with_factors(src, cfg, name)?;
        let layer = |l| {
            let attn = Attention::load(src, cfg, l, false, false)?;
            PreNormLayer::load(src, cfg, l, attn, GatedMlp::load(src, cfg, l, cfg.ffn_hidden, Activation::Silu)?)
        };
        Ok(Phi3 { rope, layers: layers.indices().map(layer).collect::<Result<_, _>>()? })
    }
}

impl Layers for Phi3 {
    fn run(
        &self,
        c: &ModelConfig,
        step: &Step<'_, '_>,
        kv: &mut KvStorage,
        s: &mut ForwardScratch,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> bool {
        let rope = RopeTable::build(c.head_dim, &self.rope, step.positions);
        let spec = AttnSpec { query_scale: 1.0 / (c.head_dim as f32).sqrt(), scale: 1.0, window: None };
        run_pre_norm(c, &self.layers, step, &rope, spec, kv, s, on_layer)
    }

    fn size_bytes(&self) -> usize {
        self.layers.iter().map(PreNormLayer::size_bytes).sum()
    }
}
