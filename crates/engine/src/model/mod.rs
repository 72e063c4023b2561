//! The transformer: token embeddings, a stack of decoder layers, the final norm and the
//! output projection, with the forward pass over a batch of sequences sharing one paged
//! KV cache. Each architecture lives in its own file, built from the shared blocks
//! (`blocks.rs`, `moe.rs`): its layers and its [`family::Family`] (name, RoPE pairing,
//! extra hyper-parameters, loader), registered in [`FAMILIES`]: `llama.rs` (Llama 2/3,
//! SmolLM2, Mistral, Qwen2), `qwen3.rs`, `qwen3moe.rs`, `phi3.rs` and `gemma3.rs`.

mod blocks;
mod family;
mod forward;
mod gemma3;
pub mod linear;
mod llama;
mod moe;
mod phi3;
mod qwen3;
mod qwen3moe;

pub use family::supported_architectures;
pub use forward::{ForwardScratch, Pool, Pooled, Scoring, SeqBatch};

use crate::config::ModelConfig;
use crate::format::{DType, FormatError, TensorSource};
use crate::kernels::quant::dequantize_row;
use crate::kvcache::KvStorage;
use forward::Step;
use linear::{load_vector, Linear};

/// One architecture's decoder layers: everything between the embedding and the final
/// norm.
trait Layers: Send + Sync {
    /// Runs the residual stream `s.x` through every layer; `false` when `on_layer`
    /// stopped the pass.
    fn run(
        &self,
        c: &ModelConfig,
        step: &Step<'_, '_>,
        kv: &mut KvStorage,
        s: &mut ForwardScratch,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> bool;

    /// Bytes of the layers' weight matrices.
    fn size_bytes(&self) -> usize;

    /// Multiplies every embedding row before the first layer.
    fn embedding_scale(&self, _c: &ModelConfig) -> f32 {
        1.0
    }
}

/// The architectures: adding one is its file plus its line here (and its `mod`).
const FAMILIES: &[&family::Family] =
    &[&llama::LLAMA, &llama::QWEN2, &qwen3::QWEN3, &qwen3moe::QWEN3MOE, &phi3::PHI3, &gemma3::GEMMA3];

fn load_layers(src: &dyn TensorSource, cfg: &ModelConfig) -> Result<Box<dyn Layers>, FormatError> {
    (family::of(cfg.arch)?.load)(src, cfg)
}

/// Token embeddings kept in the file's own encoding; rows are decoded on lookup.
struct Embedding {
    dtype: DType,
    row_bytes: usize,
    data: Vec<u8>,
    /// Multiplies every decoded row (Gemma's `sqrt(hidden)`; 1 for Llama).
    scale: f32,
}

pub struct Model {
    pub cfg: ModelConfig,
    embd: Embedding,
    body: Box<dyn Layers>,
    norm: Vec<f32>,
    lm_head: Linear,
}

impl Model {
    /// Loads every weight from `src` (GGUF tensor names), repacking quantized matrices
    /// for our kernels. The source can be dropped afterwards.
    pub fn load(src: &dyn TensorSource, cfg: ModelConfig) -> Result<Self, FormatError> {
        let h = cfg.hidden;
        let mut embd = load_embedding(src, &cfg)?;
        let body = load_layers(src, &cfg)?;
        embd.scale = body.embedding_scale(&cfg);
        let head_name = if src.tensor("output.weight").is_some() { "output.weight" } else { "token_embd.weight" };
        let lm_head = Linear::load(src, &[head_name.to_string()], false)?;
        if lm_head.out_features != cfg.vocab_size || lm_head.in_features != h {
            return Err(FormatError::Invalid(format!("{head_name} has the wrong shape")));
        }
        Ok(Model { embd, body, norm: load_vector(src, "output_norm.weight", h)?, lm_head, cfg })
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        self.body.size_bytes() + self.lm_head.size_bytes() + self.embd.data.len()
    }

    fn embed(&self, token: u32, out: &mut [f32]) {
        let at = token as usize * self.embd.row_bytes;
        match self.embd.data.get(at..at + self.embd.row_bytes) {
            Some(row) => dequantize_row(self.embd.dtype, row, out),
            // Ids are validated upstream; an out-of-range id embeds as zeros.
            None => out.fill(0.0),
        }
        if self.embd.scale != 1.0 {
            for x in out {
                *x *= self.embd.scale;
            }
        }
    }
}

fn load_embedding(src: &dyn TensorSource, cfg: &ModelConfig) -> Result<Embedding, FormatError> {
    let t = src.tensor("token_embd.weight").ok_or_else(|| FormatError::Missing("tensor token_embd.weight".into()))?;
    if t.shape != [cfg.vocab_size, cfg.hidden] {
        return Err(FormatError::Invalid(format!(
            "token_embd.weight has shape {:?}, expected [{}, {}]",
            t.shape, cfg.vocab_size, cfg.hidden
        )));
    }
    let row_bytes = t.bytes.len() / cfg.vocab_size;
    Ok(Embedding { dtype: t.dtype, row_bytes, data: t.bytes.to_vec(), scale: 1.0 })
}
