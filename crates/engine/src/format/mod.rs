//! Model file formats: GGUF (llama.cpp) and Hugging Face safetensors directories.
//!
//! Both produce the same thing: named tensors with a [`DType`], a shape and a byte
//! range, plus the metadata the model config and tokenizer are built from.

pub mod gguf;
pub mod gguf_write;

use thiserror::Error;

/// Element types pdserve can load. Quantized types store blocks of 32 elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// 32 × i8 with one f16 scale.
    Q8_0,
    /// 32 × 4-bit with one f16 scale, values offset by 8.
    Q4_0,
    /// 32 × 4-bit with an f16 scale and an f16 minimum.
    Q4_1,
}

impl DType {
    pub fn from_ggml(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            8 => DType::Q8_0,
            30 => DType::BF16,
            _ => return None,
        })
    }

    pub fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q8_0 => 8,
            DType::BF16 => 30,
        }
    }

    /// Elements per storage block.
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 32,
        }
    }

    /// Bytes per storage block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
        }
    }

    /// Bytes a tensor of `shape` (outermost first) occupies, or `None` when the
    /// innermost dimension is not a whole number of blocks or the size overflows.
    pub fn storage_bytes(self, shape: &[usize]) -> Option<usize> {
        let inner = *shape.last()?;
        if inner % self.block_elems() != 0 {
            return None;
        }
        let elems = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
        (elems / self.block_elems()).checked_mul(self.block_bytes())
    }
}

/// A tensor's bytes in the file's own layout.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub dtype: DType,
    /// Outermost dimension first.
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

/// Anything the model loader can read weights from. Tensor names follow GGUF's
/// convention (`blk.N.attn_q.weight`); other formats translate theirs.
pub trait TensorSource {
    fn tensor(&self, name: &str) -> Option<TensorView<'_>>;
}

/// Where one tensor's bytes lie in its file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    /// Outermost dimension first: a weight matrix is `[out_features, in_features]`.
    pub shape: Vec<usize>,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

/// Why a model file could not be read. Messages name the file's problem, not ours.
#[derive(Debug, Error)]
pub enum FormatError {
    #[error("not a GGUF file (bad magic bytes)")]
    BadMagic,
    #[error("GGUF version {0} is not supported (expected 2 or 3)")]
    UnsupportedVersion(u32),
    #[error("file is truncated: {0}")]
    Truncated(String),
    #[error("file is corrupt: {0}")]
    Corrupt(String),
    #[error("tensor `{tensor}` has ggml type {ggml_type}, which pdserve does not support (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)")]
    UnsupportedTensorType { tensor: String, ggml_type: u32 },
    #[error("unsupported architecture `{0}` (supported: llama, qwen2)")]
    UnsupportedArchitecture(String),
    #[error("missing {0}")]
    Missing(String),
    #[error("{0}")]
    Invalid(String),
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

pub mod safetensors;
#[cfg(test)]
mod tests;
