//! The Qwen 3 decoder (dense): Llama's layer with every query and key head
//! RMS-normalized before RoPE, and no biases:
//!
//! ```text
//! q, k, v = Wq · norm(x), Wk · norm(x), Wv · norm(x)
//! x      += Wo · attention(rope(norm_q(q)), rope(norm_k(k)), v)
//! x      += Wdown · (silu(Wgate · norm(x)) ⊙ Wup · norm(x))
//! ```

use super::blocks::{run_pre_norm, Activation, Attention, AttnSpec, GatedMlp, PreNormLayer};
use super::family::{no_extra, Family};
use super::forward::{ForwardScratch, Step};
use super::{LayerRange, Layers};
use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::format::{FormatError, TensorSource};
use crate::kernels::ops::{Rope, RopeTable};
use crate::kvcache::KvStorage;

impl Architecture {
    /// Qwen 3: Llama with per-head RMSNorm of queries and keys, no biases.
    pub const QWEN3: Architecture = Architecture::named("qwen3");
}

pub(super) const QWEN3: Family = Family {
    arch: Architecture::QWEN3,
    rope: RopeStyle::Neox,
    rope_scalings: &[],
    extra: no_extra,
    load: |src, cfg, layers| Ok(Box::new(Qwen3::load(src, cfg, layers)?)),
};

pub(super) struct Qwen3 {
    layers: Vec<PreNormLayer<GatedMlp>>,
}

impl Qwen3 {
    pub(super) fn load(src: &dyn TensorSource, cfg: &ModelConfig, layers: LayerRange) -> Result<Self, FormatError> {
        let layer = |l| {
            let mlp = GatedMlp::load(src, cfg, l, cfg.ffn_hidden, Activation::Silu)?;
            PreNormLayer::load(src, cfg, l, attention(src, cfg, l)?, mlp)
        };
        Ok(Qwen3 { layers: layers.indices().map(layer).collect::<Result<_, _>>()? })
    }
}

/// Qwen 3's attention (per-head Q/K norms, no biases), shared with its
/// mixture-of-experts sibling.
pub(super) fn attention(src: &dyn TensorSource, cfg: &ModelConfig, l: usize) -> Result<Attention, FormatError> {
    Attention::load(src, cfg, l, false, true)
}

/// Qwen 3's rotation and scores, shared with its mixture-of-experts sibling.
pub(super) fn rope_and_spec(c: &ModelConfig, step: &Step<'_, '_>) -> (RopeTable, AttnSpec) {
    let rope = RopeTable::build(c.head_dim, &Rope::plain(c.rope_theta), step.positions);
    (rope, AttnSpec { query_scale: 1.0, scale: 1.0 / (c.head_dim as f32).sqrt(), window: None })
}

impl Layers for Qwen3 {
    fn run(
        &self,
        c: &ModelConfig,
        step: &Step<'_, '_>,
        kv: &mut KvStorage,
        s: &mut ForwardScratch,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> bool {
        let (rope, spec) = rope_and_spec(c, step);
        run_pre_norm(c, &self.layers, step, &rope, spec, kv, s, on_layer)
    }

    fn size_bytes(&self) -> usize {
        self.layers.iter().map(PreNormLayer::size_bytes).sum()
    }
}
