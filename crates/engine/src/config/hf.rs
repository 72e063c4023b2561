//! A Hugging Face `config.json` as the model's hyper-parameters. HF checkpoints keep
//! Q and K in the half-split RoPE layout, hence [`RopeStyle::Neox`] for every
//! architecture here.

use super::{Architecture, ModelConfig, RopeStyle};
use crate::format::safetensors::HfConfig;
use crate::format::FormatError;

impl ModelConfig {
    pub fn from_hf(hf: &HfConfig) -> Result<Self, FormatError> {
        let arch = architecture(hf)?;
        let heads = hf.num_attention_heads;
        // Transformers' own defaults for fields older configs leave out.
        let default_context = match arch {
            Architecture::LLAMA => 2048,
            // Not produced from config.json: the other architectures load from GGUF.
            _ => 32768,
        };
        let context_length = hf.max_position_embeddings.unwrap_or(default_context);
        ModelConfig {
            arch,
            n_layers: hf.num_hidden_layers,
            hidden: hf.hidden_size,
            ffn_hidden: hf.intermediate_size,
            n_heads: heads,
            n_kv_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf.head_dim.or(hf.hidden_size.checked_div(heads)).unwrap_or(0),
            vocab_size: hf.vocab_size,
            rms_eps: hf.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: hf.rope_theta.unwrap_or(10000.0) as f32,
            rope_style: RopeStyle::Neox,
            context_length,
            rope_attn_factor: 1.0,
            rope_original_context: context_length,
            gemma3: None,
            moe: None,
        }
        .validate()
    }
}

/// The family a checkpoint names, by `model_type` or else by its class names.
fn architecture(hf: &HfConfig) -> Result<Architecture, FormatError> {
    let unsupported = |name: &str| FormatError::UnsupportedArchitecture {
        name: name.to_string(),
        supported: "llama, mistral, qwen2 (safetensors checkpoints; GGUF files load more)".to_string(),
    };
    if let Some(t) = &hf.model_type {
        return match t.as_str() {
            "llama" | "mistral" => Ok(Architecture::LLAMA),
            "qwen2" => Ok(Architecture::QWEN2),
            other => Err(unsupported(other)),
        };
    }
    let names = hf.architectures.as_deref().unwrap_or_default();
    for name in names {
        match name.as_str() {
            "LlamaForCausalLM" | "MistralForCausalLM" => return Ok(Architecture::LLAMA),
            "Qwen2ForCausalLM" => return Ok(Architecture::QWEN2),
            _ => {}
        }
    }
    Err(unsupported(names.first().map_or("none given", String::as_str)))
}
