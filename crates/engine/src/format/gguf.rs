//! GGUF v3 reader over a memory map: metadata, tensor directory, tensor bytes.
//!
//! Every length and offset read from the file is checked before use, so a truncated
//! or hostile file gives a [`FormatError`], never a panic or an out-of-bounds read.

use super::{DType, FormatError, TensorInfo};
use std::collections::BTreeMap;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Refuse absurd counts before allocating for them.
const MAX_TENSORS: u64 = 1 << 20;
const MAX_DIMS: u32 = 4;

pub use pdserve_text::meta::MetaValue;

/// A parsed GGUF header: metadata and where each tensor's bytes lie in the file.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
}

impl pdserve_text::meta::Metadata for GgufHeader {
    fn get(&self, key: &str) -> Option<&MetaValue> {
        GgufHeader::get(self, key)
    }
}

impl GgufHeader {
    /// Parses the header of `bytes` (the whole file) and checks that every tensor's bytes
    /// lie inside it.
    pub fn parse(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader { bytes, pos: 0 };
        if r.take(4)? != MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        if n_tensors > MAX_TENSORS {
            return Err(r.corrupt("tensor count is implausibly large"));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty, 0)?;
            metadata.insert(key, value);
        }
        let mut infos = Vec::new();
        for _ in 0..n_tensors {
            infos.push(r.tensor_info()?);
        }
        let alignment = match metadata.get("general.alignment") {
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| r.corrupt("general.alignment must be a power of two"))?,
            None => DEFAULT_ALIGNMENT,
        };
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        let tensors =
            infos.into_iter().map(|t| t.locate(data_start, bytes.len() as u64)).collect::<Result<Vec<_>, _>>()?;
        Ok(GgufHeader { version, metadata, tensors })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// A tensor entry before its offset is resolved against the data section.
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: u32,
    offset: u64,
}

impl RawTensor {
    fn locate(self, data_start: u64, file_len: u64) -> Result<TensorInfo, FormatError> {
        let dtype = DType::from_ggml(self.ggml_type).ok_or_else(|| FormatError::UnsupportedTensorType {
            tensor: self.name.clone(),
            ggml_type: self.ggml_type,
        })?;
        // GGUF lists dims innermost first; we store them outermost first like every
        // other tensor library.
        let shape: Vec<usize> = self
            .dims
            .iter()
            .rev()
            .map(|&d| usize::try_from(d).map_err(|_| self.bad("dimension too large")))
            .collect::<Result<_, _>>()?;
        let n_bytes = dtype
            .storage_bytes(&shape)
            .ok_or_else(|| self.bad("shape does not fit its type (innermost dim not a whole number of blocks)"))?;
        let start = data_start.checked_add(self.offset).ok_or_else(|| self.bad("offset overflow"))?;
        let end = start.checked_add(n_bytes as u64).ok_or_else(|| self.bad("size overflow"))?;
        if end > file_len {
            return Err(FormatError::Truncated(format!(
                "tensor `{}` needs bytes {start}..{end} but the file has {file_len}",
                self.name
            )));
        }
        Ok(TensorInfo { name: self.name, dtype, shape, offset: start as usize, n_bytes })
    }

    fn bad(&self, why: &str) -> FormatError {
        FormatError::Corrupt(format!("tensor `{}`: {why}", self.name))
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn corrupt(&self, why: &str) -> FormatError {
        FormatError::Corrupt(format!("{why} (at byte {})", self.pos))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| FormatError::Truncated(format!("header ends early at byte {}", self.bytes.len())))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], FormatError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A length that must fit in the bytes still unread (each element is at least
    /// `min_elem` bytes), so a forged count cannot make us allocate gigabytes.
    fn count(&mut self, min_elem: usize) -> Result<usize, FormatError> {
        let n = self.u64()?;
        let left = (self.bytes.len() - self.pos) as u64;
        if n.saturating_mul(min_elem.max(1) as u64) > left {
            return Err(FormatError::Truncated(format!("a count of {n} runs past the end")));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, FormatError> {
        let n = self.count(1)?;
        let raw = self.take(n)?;
        String::from_utf8(raw.to_vec()).map_err(|_| self.corrupt("string is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue, FormatError> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>()?[0]),
            1 => MetaValue::I8(self.array::<1>()?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array()?)),
            7 => MetaValue::Bool(self.array::<1>()?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.corrupt("arrays nested too deeply"));
                }
                let elem_ty = self.u32()?;
                let n = self.count(elem_size_lower_bound(elem_ty))?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_ty, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(self.corrupt(&format!("unknown metadata type {other}"))),
        })
    }

    fn tensor_info(&mut self) -> Result<RawTensor, FormatError> {
        let name = self.string()?;
        let n_dims = self.u32()?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(self.corrupt(&format!("tensor `{name}` has {n_dims} dimensions")));
        }
        let dims = (0..n_dims).map(|_| self.u64()).collect::<Result<Vec<_>, _>>()?;
        let ggml_type = self.u32()?;
        let offset = self.u64()?;
        Ok(RawTensor { name, dims, ggml_type, offset })
    }
}

fn elem_size_lower_bound(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8, // length prefix
        9 => 12,
        _ => 8,
    }
}

/// An opened GGUF model: the header plus the memory maps its tensors point into. A
/// model split by llama.cpp's `gguf-split` (`NAME-00001-of-00003.gguf`, ...) opens from
/// its first part and maps every part; `header` then holds the first part's metadata
/// and every part's tensors.
pub struct GgufFile {
    maps: Vec<memmap2::Mmap>,
    pub header: GgufHeader,
    /// Tensor name to (part, index in `header.tensors`).
    index: std::collections::HashMap<String, (usize, usize)>,
}

impl GgufFile {
    pub fn open(path: &std::path::Path) -> Result<Self, FormatError> {
        let (map, mut header) = map_part(path)?;
        let count = split_field(&header, "split.count")?.unwrap_or(1);
        let mut maps = vec![map];
        let mut part_of = vec![0; header.tensors.len()];
        if count > 1 {
            if split_field(&header, "split.no")? != Some(0) {
                return Err(FormatError::Invalid(format!(
                    "{} is not the first part of its split model; open the part named NAME-00001-of-{count:05}.gguf",
                    path.display()
                )));
            }
            for (no, part) in split_parts(path, count)?.iter().enumerate().skip(1) {
                let (map, h) = map_part(part).map_err(|e| match e {
                    FormatError::Io { .. } => FormatError::Invalid(format!(
                        "part {} of {count} of the split model is missing: {}",
                        no + 1,
                        part.display()
                    )),
                    e => e,
                })?;
                if split_field(&h, "split.count")? != Some(count) || split_field(&h, "split.no")? != Some(no) {
                    return Err(FormatError::Invalid(format!(
                        "{} is not part {} of {count} of the model {} begins",
                        part.display(),
                        no + 1,
                        path.display()
                    )));
                }
                part_of.extend(std::iter::repeat_n(no, h.tensors.len()));
                header.tensors.extend(h.tensors);
                maps.push(map);
            }
            let expected = split_field(&header, "split.tensors.count")?;
            if expected.is_some_and(|n| n != header.tensors.len()) {
                return Err(FormatError::Invalid(format!(
                    "the split model's parts hold {} tensors, its first part says {}",
                    header.tensors.len(),
                    expected.unwrap_or_default()
                )));
            }
        }
        let mut index = std::collections::HashMap::new();
        for (i, t) in header.tensors.iter().enumerate() {
            if index.insert(t.name.clone(), (part_of[i], i)).is_some() {
                return Err(FormatError::Invalid(format!("tensor {} appears twice", t.name)));
            }
        }
        Ok(GgufFile { maps, header, index })
    }
}

/// Maps one file and parses its header.
fn map_part(path: &std::path::Path) -> Result<(memmap2::Mmap, GgufHeader), FormatError> {
    let io = |source| FormatError::Io { path: path.display().to_string(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: the map is read-only; pdserve never writes model files, and a file
    // changed underneath a running server is outside what any loader can guard.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    let header = GgufHeader::parse(&map)?;
    Ok((map, header))
}

/// A `split.*` count from the header, if present.
fn split_field(h: &GgufHeader, key: &str) -> Result<Option<usize>, FormatError> {
    match h.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| FormatError::Invalid(format!("metadata {key} is not a count"))),
    }
}

/// Every part's path of a model split in `count`, from its first part's
/// (`NAME-00001-of-00003.gguf`, llama.cpp's naming).
fn split_parts(first: &std::path::Path, count: usize) -> Result<Vec<std::path::PathBuf>, FormatError> {
    let suffix = format!("-00001-of-{count:05}.gguf");
    let name = first.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let prefix = name.strip_suffix(&suffix).ok_or_else(|| {
        FormatError::Invalid(format!(
            "the first part of a model split in {count} must be named NAME{suffix}, not {name}"
        ))
    })?;
    Ok((1..=count).map(|i| first.with_file_name(format!("{prefix}-{i:05}-of-{count:05}.gguf"))).collect())
}

impl super::TensorSource for GgufFile {
    fn tensor(&self, name: &str) -> Option<super::TensorView<'_>> {
        let &(part, i) = self.index.get(name)?;
        let t = &self.header.tensors[i];
        Some(super::TensorView {
            dtype: t.dtype,
            shape: &t.shape,
            bytes: &self.maps[part][t.offset..t.offset + t.n_bytes],
        })
    }
}
