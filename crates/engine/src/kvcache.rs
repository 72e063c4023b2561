//! The K/V bytes behind the block ids that `pdserve-kv` hands out, per layer one K
//! pool and one V pool, in the cache's [`KvDtype`]:
//!
//! - f16: K laid out `[block][kv_head][head_dim][slot]` (transposed inside a block, so
//!   that attention computes a block's 16 scores as one vector) and V
//!   `[block][kv_head][slot][head_dim]`.
//! - q8_0 / q4_0: each token's head quantized as it is written, in GGUF blocks of 32
//!   values (never widened back into the pool). V is laid out
//!   `[block][kv_head][slot][row]`; K `[block][kv_head]` with each head's 16 rows
//!   transposed as [`kv_quant::put_k_row`] describes, for the same reason as f16's.
//!
//! Every form is kept as 16-bit little-endian words (GGUF's 34- and 18-byte blocks
//! are whole words), so exports, tiers and transports move any dtype the same way.

use crate::config::ModelConfig;
use crate::kernels::attention::LayerKv;
use crate::kernels::kv_quant::{self, words_as_bytes, Rotation};
use half::f16;
use pdserve_types::KvDtype;

// Quantized rows are read as bytes from the words that hold them.
#[cfg(not(target_endian = "little"))]
compile_error!("the KV cache keeps quantized rows as little-endian words");

/// Bytes one block of `block_size` tokens takes across every layer, K and V.
pub fn block_bytes(cfg: &ModelConfig, block_size: usize, dtype: KvDtype) -> usize {
    bytes_per_token(cfg, dtype) * block_size
}

/// Bytes one token's K and V take over all layers in `dtype` (f16 when the head does
/// not fill whole quantization blocks: such a cache is refused by [`check_dtype`]).
pub fn bytes_per_token(cfg: &ModelConfig, dtype: KvDtype) -> usize {
    let row = dtype.row_bytes(cfg.head_dim).unwrap_or(2 * cfg.head_dim);
    cfg.n_layers * 2 * cfg.n_kv_heads * row
}

/// Whether a cache of `dtype` fits the model's heads: quantized rows are whole
/// blocks of 32 values.
pub fn check_dtype(cfg: &ModelConfig, dtype: KvDtype) -> Result<(), String> {
    match dtype.row_bytes(cfg.head_dim) {
        Some(_) if dtype != KvDtype::F16 && cfg.head_dim > MAX_HEAD => {
            Err(format!("a {dtype} KV cache takes heads of at most {MAX_HEAD}; this model's are {}", cfg.head_dim))
        }
        Some(_) => Ok(()),
        None => Err(format!(
            "a {dtype} KV cache needs a head size that is a multiple of {}; this model's is {}",
            dtype.block_values(),
            cfg.head_dim
        )),
    }
}

pub struct KvStorage {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: KvDtype,
    /// The rotation K and V are stored under, if any.
    pub rotation: Option<Rotation>,
    /// Words of one token's row of one head.
    row_words: usize,
    /// Zeroed allocation so untouched blocks cost no resident memory.
    k: Vec<Vec<u16>>,
    v: Vec<Vec<u16>>,
}

impl KvStorage {
    /// An f16 cache.
    pub fn new(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Self {
        KvStorage::with_dtype(cfg, num_blocks, block_size, KvDtype::F16)
    }

    /// # Panics
    /// When [`check_dtype`] refuses `dtype` for this model (callers check first).
    pub fn with_dtype(cfg: &ModelConfig, num_blocks: usize, block_size: usize, dtype: KvDtype) -> Self {
        KvStorage::for_layers(cfg, cfg.n_layers, num_blocks, block_size, dtype)
    }

    /// [`KvStorage::with_dtype`] for `n_layers` of the model's layers (a pipeline
    /// stage's own).
    pub fn for_layers(
        cfg: &ModelConfig,
        n_layers: usize,
        num_blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Self {
        KvStorage::shaped(n_layers, cfg.n_kv_heads, cfg.head_dim, num_blocks, block_size, dtype)
    }

    /// Storage of `values` K (and V) values per token and layer, as one head: a timed
    /// engine's scaled-down stand-in for a model's cache.
    pub fn with_dims(n_layers: usize, values: usize, num_blocks: usize, block_size: usize) -> Self {
        KvStorage::shaped(n_layers, 1, values.max(1), num_blocks, block_size, KvDtype::F16)
    }

    fn shaped(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        num_blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Self {
        let row_bytes = dtype.row_bytes(head_dim).unwrap_or_else(|| panic!("{dtype} cache with head size {head_dim}"));
        assert!(dtype == KvDtype::F16 || block_size == kv_quant::K_SLOTS, "quantized K blocks hold 16 tokens");
        assert!(dtype == KvDtype::F16 || head_dim <= MAX_HEAD, "quantized heads of at most {MAX_HEAD}");
        let row_words = row_bytes / 2;
        let per_layer = num_blocks * n_kv_heads * block_size * row_words;
        KvStorage {
            n_layers,
            n_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            dtype,
            rotation: Rotation::of(dtype, head_dim),
            row_words,
            k: (0..n_layers).map(|_| vec![0u16; per_layer]).collect(),
            v: (0..n_layers).map(|_| vec![0u16; per_layer]).collect(),
        }
    }

    /// Words one block holds for one layer (K or V).
    pub fn block_words(&self) -> usize {
        self.n_kv_heads * self.block_size * self.row_words
    }

    pub fn layer(&self, l: usize) -> LayerKv<'_> {
        LayerKv {
            k: &self.k[l],
            v: &self.v[l],
            dtype: self.dtype,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            row_words: self.row_words,
        }
    }

    /// Stores token `pos`'s K and V rows (`n_kv_heads × head_dim` each) for layer `l`.
    pub fn write(&mut self, l: usize, blocks: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let (bs, hd, rw) = (self.block_size, self.head_dim, self.row_words);
        let block = blocks[pos / bs] as usize;
        let slot = pos % bs;
        for g in 0..self.n_kv_heads {
            let (kh, vh) = (&k[g * hd..(g + 1) * hd], &v[g * hd..(g + 1) * hd]);
            let head = (block * self.n_kv_heads + g) * bs * rw;
            if self.dtype == KvDtype::F16 {
                for (i, x) in kh.iter().enumerate() {
                    self.k[l][head + i * bs + slot] = f16::from_f32(*x).to_bits();
                }
                store_row(self.dtype, vh, &mut self.v[l][head + slot * rw..head + (slot + 1) * rw]);
            } else {
                self.write_quantized(l, head, slot, kh, vh);
            }
        }
    }

    /// One head's K and V rows of a quantized cache, turned by its rotation first; the
    /// head's block starts at word `head`. Staged on the stack, apart from the f16 path.
    fn write_quantized(&mut self, l: usize, head: usize, slot: usize, kh: &[f32], vh: &[f32]) {
        let (bs, hd, rw) = (self.block_size, self.head_dim, self.row_words);
        let mut turned = [[0f32; MAX_HEAD]; 2];
        let [tk, tv] = &mut turned;
        let (tk, tv) = (&mut tk[..hd], &mut tv[..hd]);
        tk.copy_from_slice(kh);
        tv.copy_from_slice(vh);
        if let Some(r) = self.rotation {
            kv_quant::rotate(tk, r.k);
            kv_quant::rotate(tv, r.v);
        }
        let mut row = [0u8; MAX_ROW_BYTES];
        let row = &mut row[..2 * rw];
        kv_quant::quantize_row(self.dtype, tk, row);
        let block = bytes_mut(&mut self.k[l][head..head + bs * rw]);
        kv_quant::put_k_row(self.dtype, block, slot, hd, row);
        store_row(self.dtype, tv, &mut self.v[l][head + slot * rw..head + (slot + 1) * rw]);
    }

    /// One block's K and V for layer `l`, as stored (for export).
    pub fn block(&self, l: usize, block: u32) -> (&[u16], &[u16]) {
        let n = self.block_words();
        let at = block as usize * n;
        (&self.k[l][at..at + n], &self.v[l][at..at + n])
    }

    /// Overwrites one block's K and V for layer `l` with words in this cache's form
    /// (for import).
    pub fn set_block(&mut self, l: usize, block: u32, k: &[u16], v: &[u16]) {
        let n = self.block_words();
        let at = block as usize * n;
        self.k[l][at..at + n].copy_from_slice(k);
        self.v[l][at..at + n].copy_from_slice(v);
    }

    /// The shape of one block of one layer, for [`convert_block`].
    pub fn block_shape(&self) -> BlockShape {
        BlockShape { n_kv_heads: self.n_kv_heads, block_size: self.block_size, head_dim: self.head_dim }
    }
}

/// The largest head a write of a quantized cache stages on the stack.
const MAX_HEAD: usize = 1024;
/// Its bytes in q8_0.
const MAX_ROW_BYTES: usize = MAX_HEAD / 32 * 34;

/// Quantizes one row into `dst`, `dtype.row_bytes(src.len())` bytes held as words.
fn store_row(dtype: KvDtype, src: &[f32], dst: &mut [u16]) {
    kv_quant::quantize_row(dtype, src, bytes_mut(dst));
}

/// The bytes of stored words, to write (little-endian, checked above).
fn bytes_mut(words: &mut [u16]) -> &mut [u8] {
    // SAFETY: u8 has no alignment or validity requirement; the length is exact.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), words.len() * 2) }
}

/// The dimensions of one block of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockShape {
    pub n_kv_heads: usize,
    pub block_size: usize,
    pub head_dim: usize,
}

impl BlockShape {
    /// Words K (or V) of a block take in `dtype`; `None` when the head does not fit it.
    pub fn words(&self, dtype: KvDtype) -> Option<usize> {
        dtype.row_bytes(self.head_dim).map(|b| self.n_kv_heads * self.block_size * b / 2)
    }
}

/// One block's K and V, stored as `from`, rewritten as `to`: every row read back to
/// f32 and stored again. A decode worker uses it when a peer's cache has another
/// dtype. `None` when the lengths do not fit `shape` in `from` or the head does not
/// fit `to`.
pub fn convert_block(
    shape: BlockShape,
    from: KvDtype,
    to: KvDtype,
    k: &[u16],
    v: &[u16],
) -> Option<(Vec<u16>, Vec<u16>)> {
    let (n_in, n_out) = (shape.words(from)?, shape.words(to)?);
    if k.len() != n_in || v.len() != n_in {
        return None;
    }
    if from == to {
        return Some((k.to_vec(), v.to_vec()));
    }
    let (mut k_rows, mut v_rows) = (read_rows(shape, from, k, true), read_rows(shape, from, v, false));
    // Out of `from`'s rotation, into `to`'s (each is its own inverse).
    for r in [Rotation::of(from, shape.head_dim), Rotation::of(to, shape.head_dim)].into_iter().flatten() {
        kv_quant::rotate(&mut k_rows, r.k);
        kv_quant::rotate(&mut v_rows, r.v);
    }
    let (mut k_out, mut v_out) = (vec![0u16; n_out], vec![0u16; n_out]);
    write_rows(shape, to, &k_rows, &mut k_out, true);
    write_rows(shape, to, &v_rows, &mut v_out, false);
    Some((k_out, v_out))
}

/// A block's rows in f32, `[head][slot][head_dim]`, from its stored form (still under
/// the dtype's [`Rotation`]); `is_k` says whether it is K (held transposed).
pub(crate) fn read_rows(shape: BlockShape, dtype: KvDtype, words: &[u16], is_k: bool) -> Vec<f32> {
    let BlockShape { n_kv_heads, block_size: bs, head_dim: hd } = shape;
    let mut rows = vec![0f32; n_kv_heads * bs * hd];
    let rw = words.len() / (n_kv_heads * bs);
    match (dtype, is_k) {
        (KvDtype::F16, true) => {
            for (h, head) in rows.chunks_exact_mut(bs * hd).enumerate() {
                for (i, x) in head.iter_mut().enumerate() {
                    let (slot, d) = (i / hd, i % hd);
                    *x = f16::from_bits(words[h * bs * hd + d * bs + slot]).to_f32();
                }
            }
            return rows;
        }
        (_, true) => {
            let mut row = vec![0u8; 2 * rw];
            for (h, head) in rows.chunks_exact_mut(bs * hd).enumerate() {
                let block = words_as_bytes(&words[h * bs * rw..(h + 1) * bs * rw]);
                for (slot, dst) in head.chunks_exact_mut(hd).enumerate() {
                    kv_quant::get_k_row(dtype, block, slot, hd, &mut row);
                    kv_quant::dequantize_row(dtype, &row, dst);
                }
            }
            return rows;
        }
        _ => {}
    }
    for (row, src) in rows.chunks_exact_mut(hd).zip(words.chunks_exact(rw)) {
        kv_quant::dequantize_row(dtype, words_as_bytes(src), row);
    }
    rows
}

fn write_rows(shape: BlockShape, dtype: KvDtype, rows: &[f32], words: &mut [u16], is_k: bool) {
    let BlockShape { n_kv_heads, block_size: bs, head_dim: hd } = shape;
    let rw = words.len() / (n_kv_heads * bs);
    match (dtype, is_k) {
        (KvDtype::F16, true) => {
            for (h, head) in rows.chunks_exact(bs * hd).enumerate() {
                for (i, x) in head.iter().enumerate() {
                    let (slot, d) = (i / hd, i % hd);
                    words[h * bs * hd + d * bs + slot] = f16::from_f32(*x).to_bits();
                }
            }
            return;
        }
        (_, true) => {
            let mut row = vec![0u8; 2 * rw];
            for (h, head) in rows.chunks_exact(bs * hd).enumerate() {
                let block = bytes_mut(&mut words[h * bs * rw..(h + 1) * bs * rw]);
                for (slot, src) in head.chunks_exact(hd).enumerate() {
                    kv_quant::quantize_row(dtype, src, &mut row);
                    kv_quant::put_k_row(dtype, block, slot, hd, &row);
                }
            }
            return;
        }
        _ => {}
    }
    for (row, dst) in rows.chunks_exact(hd).zip(words.chunks_exact_mut(rw)) {
        store_row(dtype, row, dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = pdserve_types::rng::Rng::new(seed);
        (0..n).map(|_| (rng.next_f64() * 4.0 - 2.0) as f32).collect()
    }

    #[test]
    fn conversions_keep_values_within_the_target_rounding() {
        let shape = BlockShape { n_kv_heads: 2, block_size: 16, head_dim: 64 };
        let all = [KvDtype::F16, KvDtype::Q8_0, KvDtype::Q4_0];
        let (k, v) = (rows(2 * 16 * 64, 1), rows(2 * 16 * 64, 2));
        for from in all {
            let (mut kw, mut vw) = (vec![0u16; shape.words(from).unwrap()], vec![0u16; shape.words(from).unwrap()]);
            write_rows(shape, from, &k, &mut kw, true);
            write_rows(shape, from, &v, &mut vw, false);
            for to in all {
                let (k2, v2) = convert_block(shape, from, to, &kw, &vw).unwrap();
                // Converting to the same form changes nothing; to another, the result
                // is what storing the first form's values afresh gives, each form
                // under its own rotation.
                let mut want_k = read_rows(shape, from, &kw, true);
                for r in [Rotation::of(from, 64), Rotation::of(to, 64)].into_iter().flatten() {
                    kv_quant::rotate(&mut want_k, r.k);
                }
                let mut direct = vec![0u16; shape.words(to).unwrap()];
                write_rows(shape, to, &want_k, &mut direct, true);
                assert_eq!(k2, direct, "{from} -> {to}");
                if from == to {
                    assert_eq!((&k2, &v2), (&kw, &vw), "{from}");
                }
            }
        }
        assert!(convert_block(shape, KvDtype::F16, KvDtype::Q8_0, &[0; 3], &[0; 3]).is_none());
        let odd = BlockShape { head_dim: 48, ..shape };
        assert!(convert_block(odd, KvDtype::F16, KvDtype::Q4_0, &[0; 1536], &[0; 1536]).is_none());
    }

    #[test]
    fn written_rows_read_back_in_every_form() {
        let cfg = crate::testing::random_llama_config_256();
        for dtype in [KvDtype::F16, KvDtype::Q8_0, KvDtype::Q4_0] {
            let mut kv = KvStorage::with_dtype(&cfg, 4, 16, dtype);
            let kvd = cfg.kv_dim();
            let (k, v) = (rows(kvd, 3), rows(kvd, 4));
            kv.write(1, &[3, 1], 17, &k, &v);
            let (kw, vw) = kv.block(1, 1);
            let shape = kv.block_shape();
            let (mut kr, mut vr) = (read_rows(shape, dtype, kw, true), read_rows(shape, dtype, vw, false));
            if let Some(r) = kv.rotation {
                kv_quant::rotate(&mut kr, r.k);
                kv_quant::rotate(&mut vr, r.v);
            }
            // Rows read back within the form's step (half of it at most per value
            // where nothing is rotated; under a rotation the same error in the root
            // mean square, its orthonormal turn spreading it over the row).
            let step = match dtype {
                KvDtype::F16 => 2e-3,
                KvDtype::Q8_0 => 2.0 / 127.0,
                KvDtype::Q4_0 => 2.0 / 7.0,
            };
            let hd = cfg.head_dim;
            for g in 0..cfg.n_kv_heads {
                let at = (g * 16 + 1) * hd;
                for (name, got, want) in [("K", &kr, &k), ("V", &vr, &v)] {
                    let err: Vec<f32> = (0..hd).map(|d| got[at + d] - want[g * hd + d]).collect();
                    let rms = (err.iter().map(|e| e * e).sum::<f32>() / hd as f32).sqrt();
                    let max = err.iter().fold(0f32, |m, e| m.max(e.abs()));
                    assert!(
                        rms <= step / 2.0 && (kv.rotation.is_some() || max <= step / 2.0),
                        "{dtype} {name}: {rms} {max}"
                    );
                }
            }
        }
    }
}
