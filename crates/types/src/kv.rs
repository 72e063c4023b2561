use serde::{Deserialize, Serialize};

/// One block of one layer of a sequence's KV cache: `n_kv_heads × block_size ×
/// head_dim` values each of K and V in the sender's stored form (`dtype`), as
/// 16-bit little-endian words (f16 bits, or GGUF blocks, whose 34 and 18 bytes are
/// whole words). The unit a prefill engine exports, a transport carries and a decode
/// engine imports.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KvFrame {
    pub layer: u32,
    /// The block's index within the sequence (position / block size).
    pub index: u32,
    pub dtype: KvDtype,
    pub k: Vec<u16>,
    pub v: Vec<u16>,
}

impl KvFrame {
    /// Bytes of K and V together.
    pub fn payload_bytes(&self) -> usize {
        2 * (self.k.len() + self.v.len())
    }
}

/// How a KV cache stores its values: f16, or GGUF's `q8_0` / `q4_0` blocks (32 values
/// sharing one f16 scale: 34 and 18 bytes), as llama.cpp's `--cache-type-k/-v` name
/// them. Quantized forms cut what the pool, the tiers and the wire carry per token to
/// 34/64 and 18/64 of f16's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    #[default]
    F16,
    Q8_0,
    Q4_0,
}

impl KvDtype {
    pub const ALL: [KvDtype; 3] = [KvDtype::F16, KvDtype::Q8_0, KvDtype::Q4_0];

    /// The code a KV frame's header carries.
    pub fn code(self) -> u8 {
        match self {
            KvDtype::F16 => 0,
            KvDtype::Q8_0 => 1,
            KvDtype::Q4_0 => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<KvDtype> {
        KvDtype::ALL.into_iter().find(|d| d.code() == code)
    }

    /// Values per quantization block (1 for f16: any row length works).
    pub fn block_values(self) -> usize {
        match self {
            KvDtype::F16 => 1,
            KvDtype::Q8_0 | KvDtype::Q4_0 => 32,
        }
    }

    /// Bytes of one block of [`KvDtype::block_values`] values.
    pub fn block_bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::Q8_0 => 34,
            KvDtype::Q4_0 => 18,
        }
    }

    /// What a row of whole blocks takes, as a share of f16's bytes (34/64, 18/64).
    pub fn share_of_f16(self) -> f64 {
        self.block_bytes() as f64 / (2 * self.block_values()) as f64
    }

    /// Bytes `values` values take, or `None` when they do not fill whole blocks.
    pub fn row_bytes(self, values: usize) -> Option<usize> {
        values.is_multiple_of(self.block_values()).then(|| values / self.block_values() * self.block_bytes())
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::Q8_0 => "q8_0",
            KvDtype::Q4_0 => "q4_0",
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KvDtype::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown KV cache dtype `{s}` (expected f16, q8_0 or q4_0)"))
    }
}

#[cfg(test)]
mod tests {
    use super::KvDtype;

    #[test]
    fn sizes_names_and_parsing() {
        // (dtype, bytes of a 64-value head row, its share of f16's)
        for (d, bytes, share) in [(KvDtype::F16, 128, 1.0), (KvDtype::Q8_0, 68, 0.531), (KvDtype::Q4_0, 36, 0.281)] {
            assert_eq!(d.row_bytes(64), Some(bytes));
            assert!((bytes as f64 / 128.0 - share).abs() < 0.001, "{d}");
            assert_eq!(d.name().parse::<KvDtype>(), Ok(d));
        }
        assert_eq!(KvDtype::Q8_0.row_bytes(48), None, "half a block");
        assert_eq!(KvDtype::F16.row_bytes(3), Some(6));
        assert!("fp8".parse::<KvDtype>().unwrap_err().contains("q8_0"));
        assert_eq!(serde_json::to_string(&KvDtype::Q4_0).unwrap(), "\"q4_0\"");
    }
}
