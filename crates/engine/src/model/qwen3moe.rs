//! The Qwen 3 mixture-of-experts decoder (Qwen3-30B-A3B and its kin): Qwen 3's
//! attention, and a sparse mixture of experts in place of the dense feed-forward:
//!
//! ```text
//! x += Wo · attention(rope(norm_q(q)), rope(norm_k(k)), v)       as in Qwen 3
//! x += Σ_{e ∈ top-k(router · norm(x))} w_e · Wdown_e · (silu(Wgate_e · norm(x)) ⊙ Wup_e · norm(x))
//! ```
//!
//! The weights `w_e` are the router's softmax over all experts, renormalized over the
//! chosen ones (`norm_topk_prob`).

use super::blocks::{run_pre_norm, PreNormLayer};
use super::family::{ArchMeta, Family};
use super::forward::{ForwardScratch, Step};
use super::moe::Moe;
use super::qwen3::{attention, rope_and_spec};
use super::{LayerRange, Layers};
use crate::config::{Architecture, ModelConfig, MoeConfig, RopeStyle};
use crate::format::{FormatError, TensorSource};
use crate::kvcache::KvStorage;

impl Architecture {
    /// Qwen 3's attention with a sparse mixture-of-experts feed-forward.
    pub const QWEN3MOE: Architecture = Architecture::named("qwen3moe");
}

pub(super) const QWEN3MOE: Family = Family {
    arch: Architecture::QWEN3MOE,
    rope: RopeStyle::Neox,
    rope_scalings: &[],
    extra: expert_counts,
    load: |src, cfg, layers| Ok(Box::new(Qwen3Moe::load(src, cfg, layers)?)),
};

/// The expert counts, all required. A mixture of experts may have no dense width;
/// its experts' stands in.
fn expert_counts(meta: &ArchMeta<'_>, cfg: &mut ModelConfig) -> Result<(), FormatError> {
    let m = MoeConfig {
        experts: meta.int("expert_count")?,
        used: meta.int("expert_used_count")?,
        expert_ffn: meta.int("expert_feed_forward_length")?,
    };
    if cfg.ffn_hidden == 0 {
        cfg.ffn_hidden = m.expert_ffn;
    }
    cfg.moe = Some(m);
    Ok(())
}

pub(super) struct Qwen3Moe {
    layers: Vec<PreNormLayer<Moe>>,
}

impl Qwen3Moe {
    pub(super) fn load(src: &dyn TensorSource, cfg: &ModelConfig, layers: LayerRange) -> Result<Self, FormatError> {
        let m =
            cfg.moe.as_ref().ok_or_else(|| FormatError::Invalid("qwen3moe config without its expert counts".into()))?;
        let layer = |l| PreNormLayer::load(src, cfg, l, attention(src, cfg, l)?, Moe::load(src, cfg, m, l)?);
        Ok(Qwen3Moe { layers: layers.indices().map(layer).collect::<Result<_, _>>()? })
    }
}

impl Layers for Qwen3Moe {
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
