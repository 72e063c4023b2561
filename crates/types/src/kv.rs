use serde::{Deserialize, Serialize};

/// One block of one layer of a sequence's KV cache: `n_kv_heads × block_size ×
/// head_dim` f16 values each of K and V, as raw bits. The unit a prefill engine
/// exports, a transport carries and a decode engine imports.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KvFrame {
    pub layer: u32,
    /// The block's index within the sequence (position / block size).
    pub index: u32,
    pub k: Vec<u16>,
    pub v: Vec<u16>,
}

impl KvFrame {
    /// Bytes of K and V together.
    pub fn payload_bytes(&self) -> usize {
        2 * (self.k.len() + self.v.len())
    }
}
