//! The Llama-family transformer (Llama 2/3, SmolLM2, Mistral, Qwen2): weights and the
//! forward pass over a batch of sequences sharing one paged KV cache.

mod forward;
pub mod linear;

pub use forward::{ForwardScratch, Scoring, SeqBatch};

use crate::config::{Architecture, ModelConfig};
use crate::format::{DType, FormatError, TensorSource};
use crate::kernels::quant::dequantize_row;
use linear::{load_vector, Linear};

/// Token embeddings kept in the file's own encoding; rows are decoded on lookup.
struct Embedding {
    dtype: DType,
    row_bytes: usize,
    data: Vec<u8>,
}

struct Layer {
    attn_norm: Vec<f32>,
    /// q | k | v fused.
    qkv: Linear,
    o: Linear,
    ffn_norm: Vec<f32>,
    /// gate | up fused.
    gate_up: Linear,
    down: Linear,
}

pub struct Model {
    pub cfg: ModelConfig,
    embd: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
}

impl Model {
    /// Loads every weight from `src` (GGUF tensor names), repacking quantized matrices
    /// for our kernels. The source can be dropped afterwards.
    pub fn load(src: &dyn TensorSource, cfg: ModelConfig) -> Result<Self, FormatError> {
        let h = cfg.hidden;
        let embd = load_embedding(src, &cfg)?;
        let layers = (0..cfg.n_layers).map(|l| load_layer(src, &cfg, l)).collect::<Result<Vec<_>, _>>()?;
        let head_name = if src.tensor("output.weight").is_some() { "output.weight" } else { "token_embd.weight" };
        let lm_head = Linear::load(src, &[head_name.to_string()], false)?;
        if lm_head.out_features != cfg.vocab_size || lm_head.in_features != h {
            return Err(FormatError::Invalid(format!("{head_name} has the wrong shape")));
        }
        Ok(Model { embd, layers, norm: load_vector(src, "output_norm.weight", h)?, lm_head, cfg })
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.size_bytes() + l.o.size_bytes() + l.gate_up.size_bytes() + l.down.size_bytes())
            .sum();
        layers + self.lm_head.size_bytes() + self.embd.data.len()
    }

    fn embed(&self, token: u32, out: &mut [f32]) {
        let at = token as usize * self.embd.row_bytes;
        match self.embd.data.get(at..at + self.embd.row_bytes) {
            Some(row) => dequantize_row(self.embd.dtype, row, out),
            // Ids are validated upstream; an out-of-range id embeds as zeros.
            None => out.fill(0.0),
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
    Ok(Embedding { dtype: t.dtype, row_bytes, data: t.bytes.to_vec() })
}

fn load_layer(src: &dyn TensorSource, cfg: &ModelConfig, l: usize) -> Result<Layer, FormatError> {
    let n = |s: &str| format!("blk.{l}.{s}.weight");
    let bias = cfg.arch == Architecture::Qwen2;
    let qkv = Linear::load(src, &[n("attn_q"), n("attn_k"), n("attn_v")], bias)?;
    let o = Linear::load(src, &[n("attn_output")], false)?;
    let gate_up = Linear::load(src, &[n("ffn_gate"), n("ffn_up")], false)?;
    let down = Linear::load(src, &[n("ffn_down")], false)?;
    let expect = |lin: &Linear, name: &str, out: usize, inp: usize| {
        if lin.out_features == out && lin.in_features == inp {
            Ok(())
        } else {
            Err(FormatError::Invalid(format!("layer {l} {name}: shape does not match the config")))
        }
    };
    expect(&qkv, "attention q/k/v", cfg.q_dim() + 2 * cfg.kv_dim(), cfg.hidden)?;
    expect(&o, "attention output", cfg.hidden, cfg.q_dim())?;
    expect(&gate_up, "ffn gate/up", 2 * cfg.ffn_hidden, cfg.hidden)?;
    expect(&down, "ffn down", cfg.hidden, cfg.ffn_hidden)?;
    Ok(Layer {
        attn_norm: load_vector(src, &n("attn_norm"), cfg.hidden)?,
        qkv,
        o,
        ffn_norm: load_vector(src, &n("ffn_norm"), cfg.hidden)?,
        gate_up,
        down,
    })
}
