//! The model's hyper-parameters, read from GGUF metadata or a HF `config.json`.

use crate::format::gguf::GgufHeader;
use crate::format::FormatError;

/// Which families of the Llama lineage pdserve runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3, SmolLM2, Mistral.
    Llama,
    /// Llama plus biases on q/k/v.
    Qwen2,
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
        let (arch, rope_style) = match arch_name {
            "llama" => (Architecture::Llama, RopeStyle::Normal),
            "qwen2" => (Architecture::Qwen2, RopeStyle::Neox),
            other => return Err(FormatError::UnsupportedArchitecture(other.to_string())),
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let int = |k: &str| -> Result<usize, FormatError> {
            h.get(&key(k))
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| FormatError::Missing(format!("metadata {}", key(k))))
        };
        let float =
            |k: &str, default: f64| -> f32 { h.get(&key(k)).and_then(|v| v.as_f64()).unwrap_or(default) as f32 };
        let hidden = int("embedding_length")?;
        let n_heads = int("attention.head_count")?;
        let n_kv_heads = int("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = int("attention.key_length").or_else(|_| int("rope.dimension_count"));
        let head_dim = head_dim.unwrap_or(hidden.checked_div(n_heads).unwrap_or(0));
        let vocab_size = match h.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
            Some(tokens) => tokens.len(),
            None => h
                .tensor("token_embd.weight")
                .map(|t| t.shape[0])
                .ok_or_else(|| FormatError::Missing("tensor token_embd.weight".into()))?,
        };
        ModelConfig {
            arch,
            n_layers: int("block_count")?,
            hidden,
            ffn_hidden: int("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            rms_eps: float("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta: float("rope.freq_base", 10000.0),
            rope_style,
            context_length: int("context_length").unwrap_or(4096),
        }
        .validate()
    }
}
