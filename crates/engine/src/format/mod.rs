//! Model file formats: GGUF (llama.cpp) and Hugging Face safetensors directories.
//!
//! Both produce the same thing: named tensors with a [`DType`], a shape and a byte
//! range, plus the metadata the model config and tokenizer are built from.

pub mod gguf;
pub mod gguf_write;

use thiserror::Error;

/// Element types pdserve can load. Quantized types store blocks of 32 or 256 elements;
/// their layouts are described in [`crate::kernels::blocks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
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
    /// 32 × 5-bit with one f16 scale, values offset by 16.
    Q5_0,
    /// 32 × 5-bit with an f16 scale and an f16 minimum.
    Q5_1,
    /// 256 × 2-bit: 16 sub-blocks of 16 with 4-bit scales and mins.
    Q2_K,
    /// 256 × 3-bit: 16 sub-blocks of 16 with 6-bit scales.
    Q3_K,
    /// 256 × 4-bit: 8 sub-blocks of 32 with 6-bit scales and mins.
    Q4_K,
    /// 256 × 5-bit: 8 sub-blocks of 32 with 6-bit scales and mins.
    Q5_K,
    /// 256 × 6-bit: 16 sub-blocks of 16 with 8-bit scales.
    Q6_K,
    /// 32 × 4-bit indices into a fixed non-linear table, one f16 scale.
    IQ4_NL,
    /// 256 × IQ4_NL-style indices: 8 sub-blocks of 32 with 6-bit scales.
    IQ4_XS,
}

impl DType {
    /// Every type pdserve loads, in ggml id order.
    pub const ALL: [DType; 15] = [
        DType::F32,
        DType::F16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_NL,
        DType::IQ4_XS,
        DType::BF16,
    ];

    pub fn from_ggml(id: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// The type's id in ggml's `ggml_type` enum (what GGUF stores).
    pub fn ggml_id(self) -> u32 {
        self.info().0
    }

    /// The type's name as llama.cpp spells it.
    pub fn name(self) -> &'static str {
        self.info().1
    }

    /// Elements per storage block.
    pub fn block_elems(self) -> usize {
        self.info().2
    }

    /// Bytes per storage block.
    pub fn block_bytes(self) -> usize {
        self.info().3
    }

    /// Whether the type is stored in blocks with scales (anything but F32/F16/BF16).
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// (ggml id, name, elements per block, bytes per block).
    #[rustfmt::skip]
    fn info(self) -> (u32, &'static str, usize, usize) {
        match self {
            DType::F32 =>    (0, "F32", 1, 4),
            DType::F16 =>    (1, "F16", 1, 2),
            DType::Q4_0 =>   (2, "Q4_0", 32, 18),
            DType::Q4_1 =>   (3, "Q4_1", 32, 20),
            DType::Q5_0 =>   (6, "Q5_0", 32, 22),
            DType::Q5_1 =>   (7, "Q5_1", 32, 24),
            DType::Q8_0 =>   (8, "Q8_0", 32, 34),
            DType::Q2_K =>   (10, "Q2_K", 256, 84),
            DType::Q3_K =>   (11, "Q3_K", 256, 110),
            DType::Q4_K =>   (12, "Q4_K", 256, 144),
            DType::Q5_K =>   (13, "Q5_K", 256, 176),
            DType::Q6_K =>   (14, "Q6_K", 256, 210),
            DType::IQ4_NL => (20, "IQ4_NL", 32, 18),
            DType::IQ4_XS => (23, "IQ4_XS", 256, 136),
            DType::BF16 =>   (30, "BF16", 1, 2),
        }
    }

    /// The names of [`DType::ALL`], comma-separated, for error messages.
    pub fn supported_names() -> String {
        DType::ALL.map(DType::name).join(", ")
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
    #[error(
        "tensor `{tensor}` has ggml type {ggml_type}, which pdserve does not support (supported: {})",
        DType::supported_names()
    )]
    UnsupportedTensorType { tensor: String, ggml_type: u32 },
    #[error("unsupported architecture `{name}` (supported: {supported})")]
    UnsupportedArchitecture { name: String, supported: String },
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
