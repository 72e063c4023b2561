//! A small GGUF v3 writer. Tests and benchmarks use it to make random-weight models of
//! real shapes; it is also how a safetensors checkpoint can be re-saved as GGUF.

use super::gguf::MetaValue;
use super::DType;
use std::io::{self, Write};

/// Collects metadata and tensors, then writes a complete file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, DType, Vec<usize>, Vec<u8>)>,
}

const ALIGN: usize = 32;

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn meta(&mut self, key: &str, value: MetaValue) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor; `shape` is outermost first and `data` is already in `dtype`'s layout.
    pub fn tensor(&mut self, name: &str, dtype: DType, shape: &[usize], data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.to_string(), dtype, shape.to_vec(), data));
        self
    }

    pub fn f32_tensor(&mut self, name: &str, shape: &[usize], values: &[f32]) -> &mut Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, DType::F32, shape, data)
    }

    pub fn write_to(&self, mut out: impl Write) -> io::Result<()> {
        let mut head = Vec::new();
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut head, k);
            head.extend_from_slice(&type_id(v).to_le_bytes());
            put_value(&mut head, v);
        }
        let mut offset = 0usize;
        for (name, dtype, shape, data) in &self.tensors {
            put_str(&mut head, name);
            head.extend_from_slice(&(shape.len() as u32).to_le_bytes());
            for d in shape.iter().rev() {
                head.extend_from_slice(&(*d as u64).to_le_bytes());
            }
            head.extend_from_slice(&dtype.ggml_id().to_le_bytes());
            head.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + data.len()).div_ceil(ALIGN) * ALIGN;
        }
        head.resize(head.len().div_ceil(ALIGN) * ALIGN, 0);
        out.write_all(&head)?;
        for (_, _, _, data) in &self.tensors {
            out.write_all(data)?;
            let pad = data.len().div_ceil(ALIGN) * ALIGN - data.len();
            out.write_all(&vec![0u8; pad])?;
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        // Writing into a Vec cannot fail.
        let _ = self.write_to(&mut v);
        v
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::Str(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::Str(s) => put_str(out, s),
        MetaValue::Array(items) => {
            let elem = items.first().map(type_id).unwrap_or(4);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_value(out, it);
            }
        }
    }
}
