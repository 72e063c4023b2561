//! The Llama-family decoder (Llama 2 and 3.x, SmolLM2, Mistral, Qwen2):
//!
//! ```text
//! x += Wo · attention(rope(Wq · norm(x)), rope(Wk · norm(x)), Wv · norm(x))
//! x += Wdown · (silu(Wgate · norm(x)) ⊙ Wup · norm(x))
//! ```
//!
//! Qwen2 adds biases to the q/k/v projections. Llama 3.1 and 3.2 files carry
//! `rope_freqs`, per-pair factors that slow RoPE's low frequencies down for long
//! contexts.

use super::blocks::{rope_with_factors, run_pre_norm, Activation, Attention, AttnSpec, GatedMlp, PreNormLayer};
use super::family::{no_extra, Family};
use super::forward::{ForwardScratch, Step};
use super::{LayerRange, Layers};
use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::format::{FormatError, TensorSource};
use crate::kernels::ops::{Rope, RopeTable};
use crate::kvcache::KvStorage;

impl Architecture {
    /// Llama 2/3.x, SmolLM2, Mistral (GGUF `llama`).
    pub const LLAMA: Architecture = Architecture::named("llama");
    /// Llama plus biases on q/k/v (GGUF `qwen2`).
    pub const QWEN2: Architecture = Architecture::named("qwen2");
}

/// Llama's GGUF files hold Q and K permuted to adjacent RoPE pairs; its RoPE factors
/// (Llama 3.1's) are the `rope_freqs` tensor, not a scaling type.
pub(super) const LLAMA: Family = Family {
    arch: Architecture::LLAMA,
    rope: RopeStyle::Normal,
    rope_scalings: &[],
    extra: no_extra,
    load: |src, cfg, layers| Ok(Box::new(Llama::load(src, cfg, layers)?)),
};

pub(super) const QWEN2: Family = Family { arch: Architecture::QWEN2, rope: RopeStyle::Neox, ..LLAMA };

pub(super) struct Llama {
    rope: Rope,
    layers: Vec<PreNormLayer<GatedMlp>>,
}

impl Llama {
    pub(super) fn load(src: &dyn TensorSource, cfg: &ModelConfig, layers: LayerRange) -> Result<Self, FormatError> {
        let rope = rope_with_factors(src, cfg, "rope_freqs.weight")?;
        let bias = cfg.arch == Architecture::QWEN2;
        let layer = |l| {
            let attn = Attention::load(src, cfg, l, bias, false)?;
            PreNormLayer::load(src, cfg, l, attn, GatedMlp::load(src, cfg, l, cfg.ffn_hidden, Activation::Silu)?)
        };
        Ok(Llama { rope, layers: layers.indices().map(layer).collect::<Result<_, _>>()? })
    }
}

impl Layers for Llama {
    fn run(
        &self,
        c: &ModelConfig,
        step: &Step<'_, '_>,
        kv: &mut KvStorage,
        s: &mut ForwardScratch,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> bool {
        let rope = RopeTable::build(c.head_dim, &self.rope, step.positions);
        let spec = AttnSpec { query_scale: 1.0, scale: 1.0 / (c.head_dim as f32).sqrt(), window: None };
        run_pre_norm(c, &self.layers, step, &rope, spec, kv, s, on_layer)
    }

    fn size_bytes(&self) -> usize {
        self.layers.iter().map(PreNormLayer::size_bytes).sum()
    }
}
