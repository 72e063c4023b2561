//! The Gemma 3 decoder (text), as the Gemma 3 technical report describes it and
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

use super::blocks::{norm_rows, weight, Activation, Attention, AttnSpec, FeedForward, GatedMlp};
use super::family::{ArchMeta, Family};
use super::forward::{ForwardScratch, Step};
use super::linear::load_vector;
use super::{LayerRange, Layers};
use crate::config::{Architecture, Gemma3Config, ModelConfig, RopeStyle};
use crate::format::{FormatError, TensorSource};
use crate::kernels::ops::{add_assign, Rope, RopeTable};
use crate::kvcache::KvStorage;

impl Architecture {
    /// Gemma 3 (text): sandwich norms, Q/K norms, GELU, local and global attention
    /// layers.
    pub const GEMMA3: Architecture = Architecture::named("gemma3");
}

/// The larger Gemma 3 models scale the global layers' positions linearly.
pub(super) const GEMMA3: Family = Family {
    arch: Architecture::GEMMA3,
    rope: RopeStyle::Neox,
    rope_scalings: &["linear"],
    extra: read_config,
    load: |src, cfg, layers| Ok(Box::new(Gemma3::load(src, cfg, layers)?)),
};

/// Gemma 3's extra hyper-parameters.
fn read_config(meta: &ArchMeta<'_>, cfg: &mut ModelConfig) -> Result<(), FormatError> {
    // Linear scaling of the global layers' positions (the larger Gemma 3 models); the
    // 270M file has none.
    let rope_scale_global = match meta.str("rope.scaling.type") {
        None | Some("none") => 1.0,
        Some("linear") => 1.0 / meta.float("rope.scaling.factor", 1.0),
        Some(other) => return Err(FormatError::Invalid(format!("gemma3: unsupported rope scaling `{other}`"))),
    };
    // As llama.cpp (after gemma_pytorch): the 27B model (62 layers) scales queries by
    // 1/sqrt(hidden / heads), every other size by 1/sqrt(head_dim).
    let query_dim = if cfg.n_layers == 62 { cfg.hidden / cfg.n_heads.max(1) } else { cfg.head_dim };
    // As llama.cpp: without a sliding window every layer is global.
    let window = meta.int("attention.sliding_window").ok().filter(|&w| w > 0);
    let softcap = meta.float_opt("final_logit_softcapping").filter(|&c| c != 0.0);
    cfg.gemma3 = Some(Gemma3Config {
        sliding_window: window.unwrap_or(usize::MAX),
        global_every: if window.is_some() { 6 } else { 1 },
        final_logit_softcap: softcap.map(|c| c as f32),
        // llama.cpp's fixed local base, unless the file gives one.
        rope_theta_local: meta.float("rope.freq_base_swa", 10000.0),
        rope_scale_global,
        query_scale: 1.0 / (query_dim as f32).sqrt(),
    });
    Ok(())
}

pub(super) struct Gemma3 {
    g: Gemma3Config,
    layers: Vec<Layer>,
}

struct Layer {
    /// Whether this layer attends to every position (else to the sliding window).
    global: bool,
    attn_norm: Vec<f32>,
    attn: Attention,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    mlp: GatedMlp,
    post_ffn_norm: Vec<f32>,
}

impl Gemma3 {
    pub(super) fn load(src: &dyn TensorSource, cfg: &ModelConfig, layers: LayerRange) -> Result<Self, FormatError> {
        let g = cfg
            .gemma3
            .clone()
            .ok_or_else(|| FormatError::Invalid("gemma3 config without its Gemma 3 parameters".into()))?;
        let layers = layers.indices().map(|l| Layer::load(src, cfg, &g, l)).collect::<Result<_, _>>()?;
        Ok(Gemma3 { g, layers })
    }
}

impl Layer {
    fn load(src: &dyn TensorSource, cfg: &ModelConfig, g: &Gemma3Config, l: usize) -> Result<Self, FormatError> {
        let norm = |name: &str| load_vector(src, &weight(l, name), cfg.hidden);
        Ok(Layer {
            global: g.is_global(l),
            attn_norm: norm("attn_norm")?,
            attn: Attention::load(src, cfg, l, false, true)?,
            post_attn_norm: norm("post_attention_norm")?,
            ffn_norm: norm("ffn_norm")?,
            mlp: GatedMlp::load(src, cfg, l, cfg.ffn_hidden, Activation::GeluTanh)?,
            post_ffn_norm: norm("post_ffw_norm")?,
        })
    }
}

impl Layers for Gemma3 {
    fn run(
        &self,
        c: &ModelConfig,
        step: &Step<'_, '_>,
        kv: &mut KvStorage,
        s: &mut ForwardScratch,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> bool {
        let g = &self.g;
        let rope_local = RopeTable::build(c.head_dim, &Rope::plain(g.rope_theta_local), step.positions);
        let global = Rope { position_scale: g.rope_scale_global, ..Rope::plain(c.rope_theta) };
        let rope_global = RopeTable::build(c.head_dim, &global, step.positions);
        let (pool, h) = (step.pool, c.hidden);
        for (l, layer) in self.layers.iter().enumerate() {
            let (rope, window) =
                if layer.global { (&rope_global, None) } else { (&rope_local, Some(g.sliding_window)) };
            // The query scale goes in before the f16 rounding; attention itself then
            // scales by 1.
            let spec = AttnSpec { query_scale: g.query_scale, scale: 1.0, window };
            norm_rows(pool, &s.x, &layer.attn_norm, c.rms_eps, h, &mut s.h);
            layer.attn.forward(c, step, l, rope, spec, kv, s);
            norm_rows(pool, &s.proj, &layer.post_attn_norm, c.rms_eps, h, &mut s.h);
            add_assign(&mut s.x, &s.h);
            if !on_layer(l, kv) {
                return false;
            }
            norm_rows(pool, &s.x, &layer.ffn_norm, c.rms_eps, h, &mut s.h);
            layer.mlp.forward(step, s);
            norm_rows(pool, &s.proj, &layer.post_ffn_norm, c.rms_eps, h, &mut s.h);
            add_assign(&mut s.x, &s.h);
        }
        true
    }

    fn size_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.attn.size_bytes() + l.mlp.size_bytes()).sum()
    }

    fn embedding_scale(&self, c: &ModelConfig) -> f32 {
        (c.hidden as f32).sqrt()
    }
}
