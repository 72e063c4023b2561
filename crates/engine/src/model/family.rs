//! What makes an architecture: its GGUF name, how its files pair RoPE dimensions,
//! which RoPE scalings its forward pass applies, the hyper-parameters it reads beyond
//! the common ones, and how its layers load. Each architecture's file declares one
//! [`Family`]; `model::FAMILIES` lists them, and a GGUF file's config is read here.

use super::{LayerRange, Layers};
use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::format::gguf::GgufHeader;
use crate::format::{FormatError, TensorSource};

/// Loads a family's layers from a file's tensors.
type LoadLayers = fn(&dyn TensorSource, &ModelConfig, LayerRange) -> Result<Box<dyn Layers>, FormatError>;

pub(super) struct Family {
    pub(super) arch: Architecture,
    /// How RoPE pairs a head's dimensions in this family's GGUF files.
    pub(super) rope: RopeStyle,
    /// The `rope.scaling.type` values its forward pass applies besides `none`.
    pub(super) rope_scalings: &'static [&'static str],
    /// Reads what this family adds to the common hyper-parameters.
    pub(super) extra: fn(&ArchMeta<'_>, &mut ModelConfig) -> Result<(), FormatError>,
    pub(super) load: LoadLayers,
}

/// For families that read nothing beyond the common hyper-parameters.
pub(super) fn no_extra(_: &ArchMeta<'_>, _: &mut ModelConfig) -> Result<(), FormatError> {
    Ok(())
}

/// The registered family of `arch`.
pub(super) fn of(arch: Architecture) -> Result<&'static Family, FormatError> {
    named(arch.name())
}

fn named(name: &str) -> Result<&'static Family, FormatError> {
    super::FAMILIES.iter().copied().find(|f| f.arch.name() == name).ok_or_else(|| {
        FormatError::UnsupportedArchitecture { name: name.to_string(), supported: supported_architectures() }
    })
}

/// The GGUF `general.architecture` names pdserve loads, as a list for messages.
pub fn supported_architectures() -> String {
    super::FAMILIES.iter().map(|f| f.arch.name()).collect::<Vec<_>>().join(", ")
}

impl ModelConfig {
    pub fn from_gguf(h: &GgufHeader) -> Result<Self, FormatError> {
        let arch_name = h
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| FormatError::Missing("metadata general.architecture".into()))?;
        let family = named(arch_name)?;
        let meta = ArchMeta { h, arch_name };
        let hidden = meta.int("embedding_length")?;
        let n_heads = meta.int("attention.head_count")?;
        let head_dim = meta.int("attention.key_length").unwrap_or(hidden.checked_div(n_heads).unwrap_or(0));
        meta.check_full_rotary(head_dim)?;
        let vocab_size = vocab_size(h)?;
        let n_layers = meta.int("block_count")?;
        let ffn = meta.int("feed_forward_length");
        let context_length = meta.int("context_length").unwrap_or(4096);
        let mut cfg = ModelConfig {
            arch: family.arch,
            n_layers,
            hidden,
            ffn_hidden: *ffn.as_ref().unwrap_or(&0),
            n_heads,
            n_kv_heads: meta.int("attention.head_count_kv").unwrap_or(n_heads),
            head_dim,
            vocab_size,
            rms_eps: meta.float("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta: meta.float("rope.freq_base", 10000.0),
            rope_style: family.rope,
            context_length,
            rope_attn_factor: meta.float("rope.scaling.attn_factor", 1.0),
            rope_original_context: meta.int("rope.scaling.original_context_length").unwrap_or(context_length),
            gemma3: None,
            moe: None,
        };
        (family.extra)(&meta, &mut cfg)?;
        if cfg.ffn_hidden == 0 {
            // Missing and not supplied by the family (a mixture of experts may do).
            ffn?;
        }
        meta.check_rope_scaling(family)?;
        cfg.validate()
    }
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
pub(super) struct ArchMeta<'a> {
    h: &'a GgufHeader,
    arch_name: &'a str,
}

impl ArchMeta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch_name)
    }

    /// A required integer; missing (or not an integer) is an error naming the key.
    pub(super) fn int(&self, k: &str) -> Result<usize, FormatError> {
        self.h
            .get(&self.key(k))
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .ok_or_else(|| FormatError::Missing(format!("metadata {}", self.key(k))))
    }

    /// A float, `default` when missing.
    pub(super) fn float(&self, k: &str, default: f64) -> f32 {
        self.h.get(&self.key(k)).and_then(|v| v.as_f64()).unwrap_or(default) as f32
    }

    /// A float, `None` when missing.
    pub(super) fn float_opt(&self, k: &str) -> Option<f64> {
        self.h.get(&self.key(k)).and_then(|v| v.as_f64())
    }

    pub(super) fn str(&self, k: &str) -> Option<&str> {
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

    /// Refuses a RoPE scaling the family's forward pass does not apply.
    fn check_rope_scaling(&self, family: &Family) -> Result<(), FormatError> {
        match self.str("rope.scaling.type") {
            Some(kind) if kind != "none" && !family.rope_scalings.contains(&kind) => {
                Err(FormatError::Invalid(format!("{}: RoPE scaling `{kind}` is not supported", self.arch_name)))
            }
            _ => Ok(()),
        }
    }
}
