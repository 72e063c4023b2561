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
pub mod stage;

pub use family::supported_architectures;
pub use forward::{logit_rows, returned_rows, step_bytes, ForwardScratch, Pool, Pooled, Scoring, SeqBatch, StageOut};
pub use stage::LayerRange;

use crate::config::ModelConfig;
use crate::format::{DType, FormatError, TensorSource};
use crate::kernels::quant::dequantize_row;
use crate::kvcache::KvStorage;
use forward::Step;
use linear::{load_vector, Linear};
use pdserve_types::KvDtype;

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

fn load_layers(src: &dyn TensorSource, cfg: &ModelConfig, layers: LayerRange) -> Result<Box<dyn Layers>, FormatError> {
    (family::of(cfg.arch)?.load)(src, cfg, layers)
}

/// Token embeddings kept in the file's own encoding; rows are decoded on lookup.
struct Embedding {
    dtype: DType,
    row_bytes: usize,
    data: Vec<u8>,
    /// Multiplies every decoded row (Gemma's `sqrt(hidden)`; 1 for Llama).
    scale: f32,
}

/// The final norm and the output projection: the first stage's, beside the
/// embeddings (see [`Model::load_stage`]).
struct Head {
    norm: Vec<f32>,
    lm_head: Linear,
}

/// A model, or one pipeline stage's part of it ([`LayerRange`]): `cfg` is always the
/// whole model's, and the K/V this part writes is that of its own layers only.
pub struct Model {
    pub cfg: ModelConfig,
    layers: LayerRange,
    embd: Option<Embedding>,
    body: Box<dyn Layers>,
    head: Option<Head>,
}

impl Model {
    /// Loads every weight from `src` (GGUF tensor names), repacking quantized matrices
    /// for our kernels. The source can be dropped afterwards.
    pub fn load(src: &dyn TensorSource, cfg: ModelConfig) -> Result<Self, FormatError> {
        let layers = LayerRange::whole(cfg.n_layers);
        Model::load_stage(src, cfg, layers)
    }

    /// Loads the weights of `layers` only: a pipeline stage. The first stage also
    /// holds the embeddings and the output head (norm and projection), so the last one
    /// hands back its final residual rows (`hidden` values a token) and the first
    /// computes the logits (`vocabulary` values a token, 20 to 60 times more to send).
    pub fn load_stage(src: &dyn TensorSource, cfg: ModelConfig, layers: LayerRange) -> Result<Self, FormatError> {
        let layers = layers.within(cfg.n_layers)?;
        let body = load_layers(src, &cfg, layers)?;
        let (embd, head) = match layers.embeds() {
            true => {
                let embd = Embedding { scale: body.embedding_scale(&cfg), ..load_embedding(src, &cfg)? };
                (Some(embd), Some(load_head(src, &cfg)?))
            }
            false => (None, None),
        };
        Ok(Model { embd, body, head, layers, cfg })
    }

    /// The layers this model holds ([`LayerRange::whole`] unless it is a stage).
    pub fn layers(&self) -> LayerRange {
        self.layers
    }

    /// A K/V cache for the layers this model holds.
    pub fn kv_storage(&self, num_blocks: usize, block_size: usize, dtype: KvDtype) -> KvStorage {
        KvStorage::for_layers(&self.cfg, self.layers.count(), num_blocks, block_size, dtype)
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        self.body.size_bytes()
            + self.head.as_ref().map_or(0, |h| h.lm_head.size_bytes())
            + self.embd.as_ref().map_or(0, |e| e.data.len())
    }
}

impl Embedding {
    fn row(&self, token: u32, out: &mut [f32]) {
        let at = token as usize * self.row_bytes;
        match self.data.get(at..at + self.row_bytes) {
            Some(row) => dequantize_row(self.dtype, row, out),
            // Ids are validated upstream; an out-of-range id embeds as zeros.
            None => out.fill(0.0),
        }
        if self.scale != 1.0 {
            for x in out {
                *x *= self.scale;
            }
        }
    }
}

fn load_head(src: &dyn TensorSource, cfg: &ModelConfig) -> Result<Head, FormatError> {
    let h = cfg.hidden;
    let head_name = if src.tensor("output.weight").is_some() { "output.weight" } else { "token_embd.weight" };
    let lm_head = Linear::load(src, &[head_name.to_string()], false)?;
    if lm_head.out_features != cfg.vocab_size || lm_head.in_features != h {
        return Err(FormatError::Invalid(format!("{head_name} has the wrong shape")));
    }
    Ok(Head { norm: load_vector(src, "output_norm.weight", h)?, lm_head })
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
