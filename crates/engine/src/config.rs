//! The model's hyper-parameters, read from GGUF metadata (`model/family.rs`, each
//! family adding its own) or a HF `config.json` (`config/hf.rs`).

use crate::format::FormatError;

mod hf;

/// A model family pdserve runs, by its GGUF `general.architecture` name. Each is
/// declared in its own file under `model/` (its constant, e.g. `Architecture::GEMMA3`,
/// with it) and registered in `model::FAMILIES`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Architecture(&'static str);

impl Architecture {
    pub(crate) const fn named(name: &'static str) -> Self {
        Architecture(name)
    }

    /// The GGUF `general.architecture` name.
    pub fn name(self) -> &'static str {
        self.0
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// How RoPE pairs up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): GGUF llama, whose converter permuted Q/K.
    Normal,
    /// Halves (i, i + d/2): HF checkpoints and GGUF qwen2.
    Neox,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn_hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub context_length: usize,
    /// Multiplies RoPE's cosines and sines, so every attention score by its square
    /// (the file's `rope.scaling.attn_factor`, Phi-3.5's long-context correction); 1
    /// for none.
    pub rope_attn_factor: f32,
    /// The context the model was trained with before any RoPE extension (the file's
    /// `rope.scaling.original_context_length`, or its context length).
    pub rope_original_context: usize,
    /// Set by the Gemma 3 family (`model/gemma3.rs`).
    pub gemma3: Option<Gemma3Config>,
    /// Set by the Qwen 3 MoE family (`model/qwen3moe.rs`).
    pub moe: Option<MoeConfig>,
}

/// A sparse mixture of experts: each token's feed-forward is the weighted sum of its
/// `used` best experts out of `experts`, weights from a softmax router renormalized
/// over the chosen ones.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    pub used: usize,
    /// Hidden width of one expert's feed-forward.
    pub expert_ffn: usize,
}

/// What Gemma 3 adds to the common hyper-parameters. `rope_theta` in [`ModelConfig`] is
/// the global layers' base.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Config {
    /// Keys a local layer's query sees, its own position included: position `p`
    /// attends to `k` when `p - k < sliding_window`.
    pub sliding_window: usize,
    /// Layer `l` (from 0) is global when `(l + 1) % global_every == 0`, local otherwise
    /// (6 in Gemma 3: five local layers, then a global one).
    pub global_every: usize,
    /// RoPE base of the local layers.
    pub rope_theta_local: f32,
    /// Linear RoPE scaling of the global layers: positions are multiplied by this.
    pub rope_scale_global: f32,
    /// Multiplies the queries before attention (which then applies no other scale).
    pub query_scale: f32,
    /// `logits = cap · tanh(logits / cap)` when set (the file's
    /// `final_logit_softcapping`; Gemma 3's own checkpoints have none).
    pub final_logit_softcap: Option<f32>,
}

impl Gemma3Config {
    pub fn is_global(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.global_every)
    }
}

impl ModelConfig {
    /// Checks the relations the forward pass relies on.
    pub fn validate(self) -> Result<Self, FormatError> {
        let bad = |why: &str| Err(FormatError::Invalid(format!("model config: {why}")));
        if self.n_layers == 0 || self.hidden == 0 || self.ffn_hidden == 0 || self.vocab_size == 0 {
            return bad("zero-sized dimension");
        }
        if self.n_heads == 0 || self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad("head count must be a positive multiple of the KV head count");
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad("head dimension must be even");
        }
        let positive = |x: f32| x.is_finite() && x > 0.0;
        if !positive(self.rms_eps) || !positive(self.rope_theta) {
            return bad("rms epsilon and rope theta must be positive");
        }
        if self.context_length == 0 {
            return bad("context length must be positive");
        }
        if let Some(g) = &self.gemma3 {
            if g.sliding_window == 0 || g.global_every == 0 {
                return bad("sliding window and layer pattern must be positive");
            }
            if !positive(g.rope_theta_local) || !positive(g.rope_scale_global) || !positive(g.query_scale) {
                return bad("local rope theta, rope scale and query scale must be positive");
            }
            if g.final_logit_softcap.is_some_and(|c| !positive(c)) {
                return bad("final logit soft-capping must be positive");
            }
        }
        if let Some(m) = &self.moe {
            if m.expert_ffn == 0 || m.used == 0 || m.used > m.experts {
                return bad("experts used must be between 1 and the expert count, expert width positive");
            }
        }
        if !positive(self.rope_attn_factor) || self.rope_original_context == 0 {
            return bad("rope attention factor and original context must be positive");
        }
        Ok(self)
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Bytes of f16 K and V per token over all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layers * self.kv_dim() * 2
    }
}
