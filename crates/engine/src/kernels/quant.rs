//! Quantized weights repacked for integer dot products, and 8-bit activations.
//!
//! Layout of a [`QuantMatrix`]: rows are taken 16 at a time (a *group*); for each group
//! and each 32-column block we store the 16 rows' weight codes interleaved 4 bytes per
//! row (so one 64-byte vector holds 4 codes of every row and an integer dot product
//! instruction yields 16 per-row partial sums), followed by the 16 rows' scale `d` and
//! offset `m` as f16. A weight is `d * code + m`:
//!
//! | codes  | payload of one row's 32 weights                     |
//! |--------|-----------------------------------------------------|
//! | Nibble | 16 bytes, byte j holds weights j and j+16 (GGUF's order) |
//! | Byte   | 32 unsigned bytes                                   |
//!
//! Every GGUF block type is first split into 32-value pieces with one `d` and `m`
//! ([`blocks`](super::blocks)): Q4_0, Q4_1 and Q4_K become nibbles (Q4_0 with
//! `m = -8d`), the rest bytes (Q8_0 as code+128 with `m = -128d`). Only the types with
//! a scale per 16 values (Q2_K, Q3_K, Q6_K) are re-quantized; see that module. With
//! activations quantized per block as `x ≈ da * q` and `sa = da * Σq`, one block
//! contributes
//! `d·da·Σ code·q + m·sa` to the dot product.

use super::blocks::{self, Sub};
use super::Isa;
use crate::format::DType;
use half::f16;

pub const GROUP: usize = 16;
pub const QBLOCK: usize = 32;
const SCALES_BYTES: usize = GROUP * 2 * 2;

/// Code width of a repacked matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codes {
    Nibble,
    Byte,
}

impl Codes {
    pub(crate) fn payload_bytes(self) -> usize {
        match self {
            Codes::Nibble => GROUP * QBLOCK / 2,
            Codes::Byte => GROUP * QBLOCK,
        }
    }

    pub(crate) fn block_stride(self) -> usize {
        self.payload_bytes() + SCALES_BYTES
    }
}

/// A weight matrix `[rows, cols]` in the repacked layout described above.
pub struct QuantMatrix {
    pub rows: usize,
    pub cols: usize,
    pub codes: Codes,
    data: Vec<u8>,
}

/// Why a tensor could not be repacked.
#[derive(Debug, thiserror::Error)]
pub enum RepackError {
    #[error("{0:?} weights cannot be used by the quantized matmul")]
    NotQuantized(DType),
    #[error("column count {cols} is not a multiple of the {block}-value block")]
    Cols { cols: usize, block: usize },
    #[error("expected {expected} bytes of weights, got {got}")]
    Size { expected: usize, got: usize },
    #[error("a block scale is out of f16 range after folding its offset")]
    ScaleRange,
}

impl QuantMatrix {
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    pub fn blocks(&self) -> usize {
        self.cols / QBLOCK
    }

    pub(crate) fn group_data(&self, g: usize) -> &[u8] {
        let stride = self.blocks() * self.codes.block_stride();
        &self.data[g * stride..(g + 1) * stride]
    }

    /// Bytes the repacked weights occupy.
    pub fn size_bytes(&self) -> usize {
        self.data.len()
    }

    /// Repacks GGUF blocks (`rows` rows of `cols` values each, row-major).
    pub fn from_gguf(dtype: DType, rows: usize, cols: usize, bytes: &[u8]) -> Result<Self, RepackError> {
        let codes = blocks::codes_of(dtype).ok_or(RepackError::NotQuantized(dtype))?;
        let (elems, block_bytes) = (dtype.block_elems(), dtype.block_bytes());
        if !cols.is_multiple_of(elems) {
            return Err(RepackError::Cols { cols, block: elems });
        }
        let expected = rows * (cols / elems) * block_bytes;
        if bytes.len() != expected {
            return Err(RepackError::Size { expected, got: bytes.len() });
        }
        let (blocks, groups) = (cols / QBLOCK, rows.div_ceil(GROUP));
        let mut m = QuantMatrix { rows, cols, codes, data: vec![0u8; groups * blocks * codes.block_stride()] };
        let mut subs = vec![Sub::ZERO; elems / QBLOCK];
        for (r, row) in bytes.chunks_exact((cols / elems * block_bytes).max(1)).take(rows).enumerate() {
            for (i, blk) in row.chunks_exact(block_bytes).enumerate() {
                blocks::subs(dtype, blk, &mut subs);
                for (k, sub) in subs.iter().enumerate() {
                    m.put_sub(r, i * subs.len() + k, sub)?;
                }
            }
        }
        Ok(m)
    }

    /// Stores one 32-value piece of row `r` at block column `b`.
    fn put_sub(&mut self, r: usize, b: usize, sub: &Sub) -> Result<(), RepackError> {
        let (d, m) = (f16::from_f32(sub.d), f16::from_f32(sub.m));
        if !m.is_finite() || !d.is_finite() {
            return Err(RepackError::ScaleRange);
        }
        let mut payload = [0u8; QBLOCK];
        let payload = match self.codes {
            Codes::Nibble => {
                // Byte j holds weights j (low nibble) and j + 16 (high nibble).
                let (lo, hi) = sub.codes.split_at(QBLOCK / 2);
                for ((p, &l), &h) in payload.iter_mut().zip(lo).zip(hi) {
                    *p = (l & 0xF) | (h << 4);
                }
                &payload[..QBLOCK / 2]
            }
            Codes::Byte => &sub.codes[..],
        };
        let (g, lane) = (r / GROUP, r % GROUP);
        let stride = self.codes.block_stride();
        let base = (g * self.blocks() + b) * stride;
        for (j, chunk) in payload.chunks_exact(4).enumerate() {
            let at = base + j * GROUP * 4 + lane * 4;
            self.data[at..at + 4].copy_from_slice(chunk);
        }
        let scales = base + self.codes.payload_bytes();
        self.data[scales + lane * 2..scales + lane * 2 + 2].copy_from_slice(&d.to_le_bytes());
        let ms = scales + GROUP * 2 + lane * 2;
        self.data[ms..ms + 2].copy_from_slice(&m.to_le_bytes());
        Ok(())
    }
}

/// Rows of activations quantized to 8 bits per 32-element block.
#[derive(Default)]
pub struct QuantActs {
    pub rows: usize,
    pub cols: usize,
    pub q: Vec<i8>,
    /// Per row and block: the scale `da`.
    pub d: Vec<f32>,
    /// Per row and block: `da * Σq`.
    pub s: Vec<f32>,
    /// Per row and block: `Σq` (the AVX2 byte kernel needs it).
    pub qsum: Vec<i32>,
}

impl QuantActs {
    /// Quantizes `x` (`rows × cols`, row-major), reusing this buffer's allocations.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize) {
        self.resize(rows, cols);
        let (q, d, s, qsum) = self.parts_mut();
        quantize_rows(x, q, d, s, qsum);
    }

    /// Sizes the buffers for `rows × cols` (contents unspecified until quantized).
    pub fn resize(&mut self, rows: usize, cols: usize) {
        debug_assert_eq!(cols % QBLOCK, 0);
        let nb = rows * cols / QBLOCK;
        self.rows = rows;
        self.cols = cols;
        super::fit(&mut self.q, rows * cols);
        super::fit(&mut self.d, nb);
        super::fit(&mut self.s, nb);
        super::fit(&mut self.qsum, nb);
    }

    /// The four buffers, for filling them in parallel.
    pub fn parts_mut(&mut self) -> (&mut [i8], &mut [f32], &mut [f32], &mut [i32]) {
        (&mut self.q, &mut self.d, &mut self.s, &mut self.qsum)
    }

    pub(crate) fn blocks(&self) -> usize {
        self.cols / QBLOCK
    }
}

/// Quantizes whole rows: `x` and `q` hold the same number of values, `d`, `s` and
/// `qsum` one entry per 32 of them. Every ISA rounds the same way (ties to even), so the
/// codes are identical everywhere; the SIMD builds only let the compiler vectorize.
pub fn quantize_rows(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], qsum: &mut [i32]) {
    match Isa::detect() {
        // SAFETY: the ISA was detected on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { quantize_rows_avx512(x, q, d, s, qsum) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { quantize_rows_avx2(x, q, d, s, qsum) },
        _ => quantize_rows_impl(x, q, d, s, qsum),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,sse4.1")]
unsafe fn quantize_rows_avx512(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], qsum: &mut [i32]) {
    quantize_rows_impl(x, q, d, s, qsum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,sse4.1")]
unsafe fn quantize_rows_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], qsum: &mut [i32]) {
    quantize_rows_impl(x, q, d, s, qsum)
}

#[inline(always)]
fn quantize_rows_impl(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], qsum: &mut [i32]) {
    for (i, (xb, qb)) in x.chunks_exact(QBLOCK).zip(q.chunks_exact_mut(QBLOCK)).enumerate() {
        let (di, sum) = quantize_block(xb, qb);
        d[i] = f16::from_f32(di).to_f32();
        qsum[i] = sum;
        s[i] = f16::from_f32(di * sum as f32).to_f32();
    }
}

/// Symmetric 8-bit quantization of one block; ties round to even so every ISA agrees.
/// The scale and the block sum are rounded through f16 as llama.cpp stores them, so
/// both engines make the same rounding decisions on the same activations and their
/// outputs differ less than two independent quantizations would.
#[inline(always)]
fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let mut amax = 0.0f32;
    for v in x {
        amax = amax.max(v.abs());
    }
    let d = amax / 127.0;
    let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (qi, &v) in q.iter_mut().zip(x) {
        let r = (v * id).round_ties_even().clamp(-127.0, 127.0) as i32;
        *qi = r as i8;
        sum += r;
    }
    (d, sum)
}

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` for token rows `tokens` and row groups `groups`.
/// `out` holds `acts.rows` rows of stride `out_stride`; only the named part is written.
pub fn matmul(isa: Isa, w: &QuantMatrix, acts: &QuantActs, groups: std::ops::Range<usize>, out: &OutRows<'_>) {
    debug_assert_eq!(w.cols, acts.cols);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => super::quant_avx512::matmul(w, acts, groups, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => super::quant_avx2::matmul(w, acts, groups, out),
        _ => matmul_scalar(w, acts, groups, out),
    }
}

/// A raw view of an output matrix that several threads write disjoint column ranges of.
pub struct OutRows<'a> {
    ptr: *mut f32,
    rows: usize,
    stride: usize,
    /// The window `col0..col0 + cols` of each row that this matrix's outputs fill.
    col0: usize,
    cols: usize,
    _life: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: `OutRows` is only handed to threads that write disjoint row groups (column
// ranges); see `write16`.
unsafe impl Send for OutRows<'_> {}
unsafe impl Sync for OutRows<'_> {}

impl<'a> OutRows<'a> {
    pub fn new(out: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self::window(out, rows, cols, 0, cols)
    }

    /// Rows of `stride` values of which columns `col0..col0 + cols` are written: how
    /// fused projections (q|k|v, gate|up) share one output matrix.
    pub fn window(out: &'a mut [f32], rows: usize, stride: usize, col0: usize, cols: usize) -> Self {
        assert!(col0 + cols <= stride && out.len() >= rows * stride, "output buffer too small");
        OutRows { ptr: out.as_mut_ptr(), rows, stride, col0, cols, _life: std::marker::PhantomData }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The columns `col0..col0 + cols` of this window, for one part of a fused matmul.
    pub fn sub(&self, col0: usize, cols: usize) -> OutRows<'_> {
        assert!(col0 + cols <= self.cols, "sub-window outside the window");
        OutRows { col0: self.col0 + col0, cols, _life: std::marker::PhantomData, ..*self }
    }

    /// Writes up to 16 values of token row `t` starting at column `g * 16`, clipped to
    /// the matrix width (the last group may be partial).
    ///
    /// Callers on different threads must use different groups `g`.
    #[inline]
    pub fn write16(&self, t: usize, g: usize, vals: &[f32; GROUP]) {
        let c0 = g * GROUP;
        let n = GROUP.min(self.cols.saturating_sub(c0));
        assert!(t < self.rows && n > 0, "write outside the output matrix");
        // SAFETY: bounds checked above; disjointness of groups across threads is the
        // caller's contract, so no two threads write the same element.
        unsafe {
            std::ptr::copy_nonoverlapping(vals.as_ptr(), self.ptr.add(t * self.stride + self.col0 + c0), n);
        }
    }
}

/// Reads the 16 f16 values at `bytes[..32]` as f32.
pub(crate) fn f16x16(bytes: &[u8]) -> [f32; GROUP] {
    let mut out = [0f32; GROUP];
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
    }
    out
}

/// The reference: the exact operation order the SIMD kernels reproduce per lane.
pub fn matmul_scalar(w: &QuantMatrix, acts: &QuantActs, groups: std::ops::Range<usize>, out: &OutRows<'_>) {
    let nb = w.blocks();
    let stride = w.codes.block_stride();
    for g in groups {
        let gd = w.group_data(g);
        for t in 0..acts.rows {
            let mut acc = [0f32; GROUP];
            for b in 0..nb {
                let blk = &gd[b * stride..(b + 1) * stride];
                let a = &acts.q[(t * nb + b) * QBLOCK..(t * nb + b + 1) * QBLOCK];
                let isum = block_isums(w.codes, blk, a);
                let dw = f16x16(&blk[w.codes.payload_bytes()..]);
                let mw = f16x16(&blk[w.codes.payload_bytes() + 32..]);
                let (da, sa) = (acts.d[t * nb + b], acts.s[t * nb + b]);
                for r in 0..GROUP {
                    acc[r] = (isum[r] as f32).mul_add(dw[r] * da, acc[r]);
                    acc[r] = mw[r].mul_add(sa, acc[r]);
                }
            }
            out.write16(t, g, &acc);
        }
    }
}

/// Per-row integer dot products of one block.
fn block_isums(codes: Codes, blk: &[u8], a: &[i8]) -> [i32; GROUP] {
    let mut isum = [0i32; GROUP];
    for (r, s) in isum.iter_mut().enumerate() {
        for j in 0..QBLOCK / 4 {
            for k in 0..4 {
                let (code, ai) = match codes {
                    // Chunk j < 4 holds bytes 4j..4j+4: low nibbles are values 4j+k,
                    // high nibbles values 16+4j+k.
                    Codes::Nibble if j < 4 => (blk[j * 64 + r * 4 + k] & 15, 4 * j + k),
                    Codes::Nibble => (blk[(j - 4) * 64 + r * 4 + k] >> 4, 4 * j + k),
                    Codes::Byte => (blk[j * 64 + r * 4 + k], 4 * j + k),
                };
                *s += code as i32 * a[ai] as i32;
            }
        }
    }
    isum
}

/// Dequantizes one GGUF tensor row-major into f32 (reference and embedding lookups).
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            let (elems, bb) = (dtype.block_elems(), dtype.block_bytes());
            for (ob, blk) in out.chunks_exact_mut(elems).zip(bytes.chunks_exact(bb)) {
                blocks::dequantize_block(dtype, blk, ob);
            }
        }
    }
}

#[cfg(test)]
#[path = "quant_tests.rs"]
mod tests;
