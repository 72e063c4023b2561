//! The model's hyper-parameters, read from GGUF metadata or a HF `config.json`.

use crate::format::gguf::GgufHeader;
use crate::format::FormatError;

mod hf;

/// Which model families pdserve runs; each has its own file under `model/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3, SmolLM2, Mistral.
    Llama,
    /// Llama plus biases on q/k/v.
    Qwen2,
    /// Qwen 3: Llama with per-head RMSNorm of queries and keys, no biases.
    Qwen3,
    /// Qwen 3's attention with a sparse mixture-of-experts feed-forward; its expert
    /// counts are in [`MoeConfig`].
    Qwen3Moe,
    /// Phi-3 and Phi-3.5: fused q/k/v and gate/up projections, queries scaled before
    /// attention, optional long/short RoPE factors.
    Phi3,
    /// Gemma 3 (text): sandwich norms, Q/K norms, GELU, local and global attention
    /// layers; its extra hyper-parameters are in [`Gemma3Config`].
    Gemma3,
}

impl Architecture {
    /// The GGUF `general.architecture` names pdserve loads, for error messages.
    pub const SUPPORTED: &'static str = "llama, qwen2, qwen3, qwen3moe, phi3, gemma3";
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
    /// Set exactly when `arch` is [`Architecture::Gemma3`].
    pub gemma3: Option<Gemma3Config>,
    /// Set exactly when `arch` is [`Architecture::Qwen3Moe`].
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
        match (&self.gemma3, self.arch) {
            (Some(g), Architecture::Gemma3) => {
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
            (None, _) if self.arch != Architecture::Gemma3 => {}
            _ => return bad("Gemma 3 parameters must be given for gemma3 and only for it"),
        }
        match (&self.moe, self.arch) {
            (Some(m), Architecture::Qwen3Moe) => {
                if m.expert_ffn == 0 || m.used == 0 || m.used > m.experts {
                    return bad("experts used must be between 1 and the expert count, expert width positive");
                }
            }
            (None, _) if self.arch != Architecture::Qwen3Moe => {}
            _ => return bad("expert counts must be given for qwen3moe and only for it"),
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

    pub fn from_gguf(h: &GgufHeader) -> Result<Self, FormatError> {
        let arch_name = h
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| FormatError::Missing("metadata general.architecture".into()))?;
        let (arch, rope_style) = architecture(arch_name)?;
        let meta = ArchMeta { h, arch_name };
        let hidden = meta.int("embedding_length")?;
        let n_heads = meta.int("attention.head_count")?;
        let n_kv_heads = meta.int("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = meta.int("attention.key_length").unwrap_or(hidden.checked_div(n_heads).unwrap_or(0));
        meta.check_full_rotary(head_dim)?;
        let vocab_size = vocab_size(h)?;
        let n_layers = meta.int("block_count")?;
        let gemma3 = match arch {
            Architecture::Gemma3 => Some(meta.gemma3(n_layers, hidden, n_heads, head_dim)?),
            _ => None,
        };
        let moe = match arch {
            Architecture::Qwen3Moe => Some(meta.moe()?),
            _ => None,
        };
        let context_length = meta.int("context_length").unwrap_or(4096);
        meta.check_rope_scaling(arch)?;
        ModelConfig {
            arch,
            n_layers,
            hidden,
            // A mixture of experts may have no dense width; its experts' stands in.
            ffn_hidden: meta.int("feed_forward_length").or_else(|e| moe.as_ref().map(|m| m.expert_ffn).ok_or(e))?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            rms_eps: meta.float("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta: meta.float("rope.freq_base", 10000.0),
            rope_style,
            context_length,
            rope_attn_factor: meta.float("rope.scaling.attn_factor", 1.0),
            rope_original_context: meta.int("rope.scaling.original_context_length").unwrap_or(context_length),
            gemma3,
            moe,
        }
        .validate()
    }
}

/// The family and RoPE pairing of a GGUF `general.architecture` name.
fn architecture(arch_name: &str) -> Result<(Architecture, RopeStyle), FormatError> {
    Ok(match arch_name {
        "llama" => (Architecture::Llama, RopeStyle::Normal),
        "qwen2" => (Architecture::Qwen2, RopeStyle::Neox),
        "qwen3" => (Architecture::Qwen3, RopeStyle::Neox),
        "qwen3moe" => (Architecture::Qwen3Moe, RopeStyle::Neox),
        "phi3" => (Architecture::Phi3, RopeStyle::Neox),
        "gemma3" => (Architecture::Gemma3, RopeStyle::Neox),
        other => {
            let supported = Architecture::SUPPORTED;
            return Err(FormatError::UnsupportedArchitecture { name: other.to_string(), supported });
        }
    })
}

/// The tokenizer's vocabulary size, or the embedding's row count when the file has no
/// token list.
fn vocab_size(h: &GgufHeader) -> Result<usize, FormatError> {
    Ok(match h.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
        Some(tokens) => tokens.len(),
        None => h
            .tensor("token_embd.weight")
            .map(|t| t.shape[0])
            .ok_or_else(|| FormatError::Missing("tensor token_embd.weight".into()))?,
    })
}

/// The metadata of one GGUF file under its architecture's prefix (`<arch>.<key>`).
struct ArchMeta<'a> {
    h: &'a GgufHeader,
    arch_name: &'a str,
}

impl ArchMeta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch_name)
    }

    /// A required integer; missing (or not an integer) is an error naming the key.
    fn int(&self, k: &str) -> Result<usize, FormatError> {
        self.h
            .get(&self.key(k))
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .ok_or_else(|| FormatError::Missing(format!("metadata {}", self.key(k))))
    }

    /// A float, `default` when missing.
    fn float(&self, k: &str, default: f64) -> f32 {
        self.h.get(&self.key(k)).and_then(|v| v.as_f64()).unwrap_or(default) as f32
    }

    fn str(&self, k: &str) -> Option<&str> {
        self.h.get(&self.key(k)).and_then(|v| v.as_str())
    }

    /// Refuses partial rotary embeddings: RoPE must cover each head's dimensions.
    fn check_full_rotary(&self, head_dim: usize) -> Result<(), FormatError> {
        if let Ok(rotated) = self.int("rope.dimension_count") {
            if rotated != head_dim {
                return Err(FormatError::Invalid(format!(
                    "{}: RoPE over {rotated} of each head's {head_dim} dimensions (partial rotary) is not supported",
                    self.arch_name
                )));
            }
        }
        Ok(())
    }

    /// Gemma 3's extra hyper-parameters.
    fn gemma3(
        &self,
        n_layers: usize,
        hidden: usize,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<Gemma3Config, FormatError> {
        // Linear scaling of the global layers' positions (the larger Gemma 3
        // models); the 270M file has none.
        let rope_scale_global = match self.str("rope.scaling.type") {
            None | Some("none") => 1.0,
            Some("linear") => 1.0 / self.float("rope.scaling.factor", 1.0),
            Some(other) => return Err(FormatError::Invalid(format!("gemma3: unsupported rope scaling `{other}`"))),
        };
        // As llama.cpp (after gemma_pytorch): the 27B model (62 layers) scales
        // queries by 1/sqrt(hidden / heads), every other size by
        // 1/sqrt(head_dim).
        let query_dim = if n_layers == 62 { hidden / n_heads.max(1) } else { head_dim };
        // As llama.cpp: without a sliding window every layer is global.
        let window = self.int("attention.sliding_window").ok().filter(|&w| w > 0);
        let softcap = self.h.get(&self.key("final_logit_softcapping")).and_then(|v| v.as_f64()).filter(|&c| c != 0.0);
        Ok(Gemma3Config {
            sliding_window: window.unwrap_or(usize::MAX),
            global_every: if window.is_some() { 6 } else { 1 },
            final_logit_softcap: softcap.map(|c| c as f32),
            // llama.cpp's fixed local base, unless the file gives one.
            rope_theta_local: self.float("rope.freq_base_swa", 10000.0),
            rope_scale_global,
            query_scale: 1.0 / (query_dim as f32).sqrt(),
        })
    }

    /// Qwen 3 MoE's expert counts, all required.
    fn moe(&self) -> Result<MoeConfig, FormatError> {
        Ok(MoeConfig {
            experts: self.int("expert_count")?,
            used: self.int("expert_used_count")?,
            expert_ffn: self.int("expert_feed_forward_length")?,
        })
    }

    /// Refuses a RoPE scaling the architecture's forward pass does not apply.
    fn check_rope_scaling(&self, arch: Architecture) -> Result<(), FormatError> {
        if let Some(kind) = self.str("rope.scaling.type") {
            // Gemma 3's linear scaling is read by `gemma3`; Llama 3's factors are the
            // `rope_freqs` tensor and Phi-3.5's the `rope_factors_*` ones.
            let known = match arch {
                Architecture::Gemma3 => matches!(kind, "none" | "linear"),
                Architecture::Phi3 => matches!(kind, "none" | "longrope"),
                _ => kind == "none",
            };
            if !known {
                return Err(FormatError::Invalid(format!(
                    "{}: RoPE scaling `{kind}` is not supported",
                    self.arch_name
                )));
            }
        }
        Ok(())
    }
}
