//! The transformer: token embeddings, a stack of decoder layers, the final norm and the
//! output projection, with the forward pass over a batch of sequences sharing one paged
//! KV cache. Each architecture's layer lives in its own file, built from the shared
//! blocks: `llama.rs` (Llama 2/3, SmolLM2, Mistral, Qwen2) and `gemma3.rs` (Gemma 3).

mod blocks;
mod forward;
mod gemma3;
pub mod linear;
mod llama;

pub use forward::{ForwardScratch, Scoring, SeqBatch};

use crate::config::{Architecture, Gemma3Config, ModelConfig};
use crate::format::{DType, FormatError, TensorSource};
use crate::kernels::quant::dequantize_row;
use linear::{load_vector, Linear};

/// Token embeddings kept in the file's own encoding; rows are decoded on lookup.
struct Embedding {
    dtype: DType,
    row_bytes: usize,
    data: Vec<u8>,
    /// Multiplies every decoded row (Gemma's `sqrt(hidden)`; 1 for Llama).
    scale: f32,
}

/// The decoder layers, by architecture.
enum Body {
    Llama(Vec<llama::Layer>),
    Gemma3(Gemma3Config, Vec<gemma3::Layer>),
}

pub struct Model {
    pub cfg: ModelConfig,
    embd: Embedding,
    body: Body,
    norm: Vec<f32>,
    lm_head: Linear,
}

impl Model {
    /// Loads every weight from `src` (GGUF tensor names), repacking quantized matrices
    /// for our kernels. The source can be dropped afterwards.
    pub fn load(src: &dyn TensorSource, cfg: ModelConfig) -> Result<Self, FormatError> {
        let h = cfg.hidden;
        let mut embd = load_embedding(src, &cfg)?;
        let body = match (cfg.arch, &cfg.gemma3) {
            (Architecture::Llama | Architecture::Qwen2, _) => {
                Body::Llama((0..cfg.n_layers).map(|l| llama::Layer::load(src, &cfg, l)).collect::<Result<_, _>>()?)
            }
            (Architecture::Gemma3, Some(g)) => {
                embd.scale = gemma3::embedding_scale(&cfg);
                let layers = (0..cfg.n_layers).map(|l| gemma3::Layer::load(src, &cfg, g, l));
                Body::Gemma3(g.clone(), layers.collect::<Result<_, _>>()?)
            }
            (Architecture::Gemma3, None) => {
                return Err(FormatError::Invalid("gemma3 model config without its Gemma 3 parameters".into()))
            }
        };
        let head_name = if src.tensor("output.weight").is_some() { "output.weight" } else { "token_embd.weight" };
        let lm_head = Linear::load(src, &[head_name.to_string()], false)?;
        if lm_head.out_features != cfg.vocab_size || lm_head.in_features != h {
            return Err(FormatError::Invalid(format!("{head_name} has the wrong shape")));
        }
        Ok(Model { embd, body, norm: load_vector(src, "output_norm.weight", h)?, lm_head, cfg })
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = match &self.body {
            Body::Llama(layers) => layers.iter().map(llama::Layer::size_bytes).sum(),
            Body::Gemma3(_, layers) => layers.iter().map(gemma3::Layer::size_bytes).sum(),
        };
        layers + self.lm_head.size_bytes() + self.embd.data.len()
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

/// Checks a layer's projections against the config: fused q/k/v, output, fused
/// gate/up and down.
fn expect_shapes(
    cfg: &ModelConfig,
    l: usize,
    qkv: &Linear,
    o: &Linear,
    gate_up: &Linear,
    down: &Linear,
) -> Result<(), FormatError> {
    let expect = |lin: &Linear, name: &str, out: usize, inp: usize| {
        if lin.out_features == out && lin.in_features == inp {
            Ok(())
        } else {
            Err(FormatError::Invalid(format!("layer {l} {name}: shape does not match the config")))
        }
    };
    expect(qkv, "attention q/k/v", cfg.q_dim() + 2 * cfg.kv_dim(), cfg.hidden)?;
    expect(o, "attention output", cfg.hidden, cfg.q_dim())?;
    expect(gate_up, "ffn gate/up", 2 * cfg.ffn_hidden, cfg.hidden)?;
    expect(down, "ffn down", cfg.hidden, cfg.ffn_hidden)?;
    Ok(())
}
