//! The K/V bytes behind the block ids that `pdserve-kv` hands out: per layer, one K
//! pool laid out `[block][kv_head][head_dim][slot]` and one V pool laid out
//! `[block][kv_head][slot][head_dim]`, in f16. K is transposed inside a block so that
//! attention computes a block's 16 scores as one vector.

use crate::config::ModelConfig;
use crate::kernels::attention::LayerKv;
use half::f16;
use half::slice::HalfBitsSliceExt;

/// Bytes one block of `block_size` tokens takes across every layer, K and V (f16).
pub fn block_bytes(cfg: &ModelConfig, block_size: usize) -> usize {
    cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * block_size * 2
}

pub struct KvStorage {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Raw f16 bits; zeroed allocation so untouched blocks cost no resident memory.
    k: Vec<Vec<u16>>,
    v: Vec<Vec<u16>>,
}

impl KvStorage {
    pub fn new(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Self {
        KvStorage::shaped(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, num_blocks, block_size)
    }

    /// Storage of `values` K (and V) values per token and layer, as one head: a timed
    /// engine's scaled-down stand-in for a model's cache.
    pub fn with_dims(n_layers: usize, values: usize, num_blocks: usize, block_size: usize) -> Self {
        KvStorage::shaped(n_layers, 1, values.max(1), num_blocks, block_size)
    }

    fn shaped(n_layers: usize, n_kv_heads: usize, head_dim: usize, num_blocks: usize, block_size: usize) -> Self {
        let per_layer = num_blocks * n_kv_heads * block_size * head_dim;
        KvStorage {
            n_layers,
            n_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            k: (0..n_layers).map(|_| vec![0u16; per_layer]).collect(),
            v: (0..n_layers).map(|_| vec![0u16; per_layer]).collect(),
        }
    }

    /// Values one block holds for one layer (K or V).
    pub fn block_elems(&self) -> usize {
        self.n_kv_heads * self.block_size * self.head_dim
    }

    pub fn layer(&self, l: usize) -> LayerKv<'_> {
        LayerKv {
            k: self.k[l].reinterpret_cast(),
            v: self.v[l].reinterpret_cast(),
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
        }
    }

    /// Stores token `pos`'s K and V rows (`n_kv_heads × head_dim` each) for layer `l`.
    pub fn write(&mut self, l: usize, blocks: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let (bs, hd) = (self.block_size, self.head_dim);
        let block = blocks[pos / bs] as usize;
        let slot = pos % bs;
        for g in 0..self.n_kv_heads {
            let head = (block * self.n_kv_heads + g) * bs * hd;
            for (i, x) in k[g * hd..(g + 1) * hd].iter().enumerate() {
                self.k[l][head + i * bs + slot] = f16::from_f32(*x).to_bits();
            }
            let at = head + slot * hd;
            for (d, x) in self.v[l][at..at + hd].iter_mut().zip(&v[g * hd..(g + 1) * hd]) {
                *d = f16::from_f32(*x).to_bits();
            }
        }
    }

    /// One block's K and V for layer `l`, as raw f16 bits (for export).
    pub fn block(&self, l: usize, block: u32) -> (&[u16], &[u16]) {
        let n = self.block_elems();
        let at = block as usize * n;
        (&self.k[l][at..at + n], &self.v[l][at..at + n])
    }

    /// Overwrites one block's K and V for layer `l` (for import).
    pub fn set_block(&mut self, l: usize, block: u32, k: &[u16], v: &[u16]) {
        let n = self.block_elems();
        let at = block as usize * n;
        self.k[l][at..at + n].copy_from_slice(k);
        self.v[l][at..at + n].copy_from_slice(v);
    }
}
