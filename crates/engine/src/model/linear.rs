//! Projection layers: a weight matrix in the form its kernel wants, plus optional bias.
//! Several projections that read the same input (q|k|v, gate|up) are fused into one
//! [`Linear`] with concatenated outputs, so the input is quantized once and one
//! parallel job covers all of them.

use crate::format::{DType, FormatError, TensorSource};
use crate::kernels::dense::{self, DenseMatrix};
use crate::kernels::quant::{self, OutRows, QuantActs, QuantMatrix, GROUP};
use crate::kernels::Isa;
use crate::threadpool::{DisjointMut, ThreadPool};

enum Weights {
    Quant(QuantMatrix),
    Dense(DenseMatrix),
}

impl Weights {
    fn groups(&self) -> usize {
        match self {
            Weights::Quant(m) => m.groups(),
            Weights::Dense(m) => m.groups(),
        }
    }

    fn rows(&self) -> usize {
        match self {
            Weights::Quant(m) => m.rows,
            Weights::Dense(m) => m.rows,
        }
    }
}

struct Part {
    w: Weights,
    bias: Option<Vec<f32>>,
    /// First output column of this part.
    col0: usize,
}

/// `y = x Wᵀ (+ b)` for one or several fused weight matrices with the same input width.
pub struct Linear {
    parts: Vec<Part>,
    pub in_features: usize,
    pub out_features: usize,
}

/// One matrix of a file, `rows × cols` of `dtype`, to be fused.
struct Matrix<'a> {
    name: &'a str,
    dtype: DType,
    rows: usize,
    cols: usize,
    bytes: &'a [u8],
    bias: Option<Vec<f32>>,
}

/// Per-thread-of-control scratch for matmul inputs.
#[derive(Default)]
pub struct LinearScratch {
    acts: QuantActs,
}

impl LinearScratch {
    /// Bytes its buffers hold.
    pub(super) fn bytes(&self) -> usize {
        let a = &self.acts;
        a.q.capacity() + 4 * (a.d.capacity() + a.s.capacity() + a.qsum.capacity())
    }
}

impl Linear {
    /// Loads and fuses the named tensors (each `[out_i, in]`), with `.bias` tensors
    /// beside them when `bias` is set.
    pub fn load(src: &dyn TensorSource, names: &[String], bias: bool) -> Result<Self, FormatError> {
        let mut mats = Vec::new();
        for name in names {
            let t = src.tensor(name).ok_or_else(|| FormatError::Missing(format!("tensor {name}")))?;
            let [rows, cols] = *t.shape else {
                return Err(FormatError::Invalid(format!("tensor {name} is not a matrix")));
            };
            let b = if bias { Some(load_vector(src, &name.replace(".weight", ".bias"), rows)?) } else { None };
            mats.push(Matrix { name, dtype: t.dtype, rows, cols, bytes: t.bytes, bias: b });
        }
        Linear::fuse(mats)
    }

    /// Loads matrix `e` of each of the named 3-D tensors (`[experts, out_i, in]`, one
    /// mixture-of-experts layer's experts), fused as [`Linear::load`] fuses.
    pub fn load_expert(src: &dyn TensorSource, names: &[String], e: usize) -> Result<Self, FormatError> {
        let mut mats = Vec::new();
        for name in names {
            let t = src.tensor(name).ok_or_else(|| FormatError::Missing(format!("tensor {name}")))?;
            let [experts, rows, cols] = *t.shape else {
                return Err(FormatError::Invalid(format!("tensor {name} is not a stack of expert matrices")));
            };
            let each = t.bytes.len() / experts.max(1);
            let bytes = t.bytes.get(e * each..(e + 1) * each);
            let bytes = bytes.ok_or_else(|| FormatError::Invalid(format!("tensor {name} has no expert {e}")))?;
            mats.push(Matrix { name, dtype: t.dtype, rows, cols, bytes, bias: None });
        }
        Linear::fuse(mats)
    }

    fn fuse(mats: Vec<Matrix<'_>>) -> Result<Self, FormatError> {
        let mut parts = Vec::new();
        let (mut col0, mut in_features) = (0, None);
        for Matrix { name, dtype, rows, cols, bytes, bias } in mats {
            if *in_features.get_or_insert(cols) != cols {
                return Err(FormatError::Invalid(format!("tensor {name}: input width {cols} differs")));
            }
            parts.push(Part { w: load_weights(name, dtype, rows, cols, bytes)?, bias, col0 });
            col0 += rows;
        }
        let in_features = in_features.ok_or_else(|| FormatError::Invalid("no tensors to load".into()))?;
        Ok(Linear { parts, in_features, out_features: col0 })
    }

    /// `out[t] = W x[t]` for `tokens` rows; `out` is `tokens × out_features`.
    pub fn forward(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        x: &[f32],
        tokens: usize,
        out: &mut [f32],
        s: &mut LinearScratch,
    ) {
        if tokens == 0 {
            return;
        }
        let k = self.in_features;
        let quantized = self.parts.iter().any(|p| matches!(p.w, Weights::Quant(_)));
        if quantized {
            quantize_parallel(pool, x, tokens, k, &mut s.acts);
        }
        let total: usize = self.parts.iter().map(|p| p.w.groups()).sum();
        let view = OutRows::new(out, tokens, self.out_features);
        // About four tasks per thread balance uneven parts without much overhead.
        pool.for_ranges(total, (pool.threads() * 4).min(total), &|range| {
            let mut start = 0;
            for p in &self.parts {
                let n = p.w.groups();
                let (a, b) = (range.start.max(start), range.end.min(start + n));
                if a < b {
                    let sub = view.sub(p.col0, p.w.rows());
                    match &p.w {
                        Weights::Quant(m) => quant::matmul(isa, m, &s.acts, a - start..b - start, &sub),
                        Weights::Dense(m) => dense::matmul(isa, m, x, tokens, a - start..b - start, &sub),
                    }
                }
                start += n;
            }
        });
        for p in &self.parts {
            if let Some(b) = &p.bias {
                for row in out.chunks_exact_mut(self.out_features) {
                    crate::kernels::ops::add_assign(&mut row[p.col0..p.col0 + b.len()], b);
                }
            }
        }
    }

    /// Bytes the weights occupy in memory.
    pub fn size_bytes(&self) -> usize {
        self.parts
            .iter()
            .map(|p| match &p.w {
                Weights::Quant(m) => m.size_bytes(),
                Weights::Dense(m) => m.w.len() * 4,
            })
            .sum()
    }
}

fn load_weights(name: &str, dtype: DType, rows: usize, cols: usize, bytes: &[u8]) -> Result<Weights, FormatError> {
    match dtype {
        _ if dtype.is_quantized() => QuantMatrix::from_gguf(dtype, rows, cols, bytes)
            .map(Weights::Quant)
            .map_err(|e| FormatError::Invalid(format!("tensor {name}: {e}"))),
        _ => {
            let mut w = vec![0f32; rows * cols];
            quant::dequantize_row(dtype, bytes, &mut w);
            Ok(Weights::Dense(DenseMatrix { rows, cols, w }))
        }
    }
}

/// A 1-D tensor of `len` values as f32.
pub fn load_vector(src: &dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>, FormatError> {
    let t = src.tensor(name).ok_or_else(|| FormatError::Missing(format!("tensor {name}")))?;
    if t.shape.iter().product::<usize>() != len || t.dtype.block_elems() != 1 {
        return Err(FormatError::Invalid(format!("tensor {name}: expected {len} unquantized values")));
    }
    let mut v = vec![0f32; len];
    quant::dequantize_row(t.dtype, t.bytes, &mut v);
    Ok(v)
}

/// Quantizes activation rows on the pool; each row's result is independent of the split.
fn quantize_parallel(pool: &ThreadPool, x: &[f32], rows: usize, cols: usize, acts: &mut QuantActs) {
    acts.resize(rows, cols);
    let nb = cols / quant::QBLOCK;
    let (q, d, s, qs) = acts.parts_mut();
    let (q, d, s, qs) = (DisjointMut::new(q), DisjointMut::new(d), DisjointMut::new(s), DisjointMut::new(qs));
    pool.for_ranges(rows, pool.threads().min(rows), &|r| {
        // SAFETY: each task owns the rows `r` of every buffer.
        let (q, d, s, qs) = unsafe {
            (
                q.part(r.start * cols..r.end * cols),
                d.part(r.start * nb..r.end * nb),
                s.part(r.start * nb..r.end * nb),
                qs.part(r.start * nb..r.end * nb),
            )
        };
        quant::quantize_rows(&x[r.start * cols..r.end * cols], q, d, s, qs);
    });
}

const _: () = assert!(GROUP == 16);
