//! Hugging Face checkpoint directories: `config.json`, one or more `*.safetensors`
//! files, and the tokenizer files next to them.
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header
//! `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {..}}`, then the
//! raw data, with offsets relative to the end of the header. Every file is memory
//! mapped and every offset checked against it before use, so a damaged file gives a
//! [`FormatError`], never a panic.
//!
//! Tensors are served under GGUF names (`blk.N.attn_q.weight`), so the model loader
//! reads both formats the same way. `config.json` is read into a plain [`HfConfig`];
//! `ModelConfig::from_hf` turns it into the model's hyper-parameters.

use super::{DType, FormatError, TensorSource, TensorView};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The reference implementation refuses headers above 100 MB; so do we, before
/// parsing JSON of that size.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// An opened checkpoint directory.
pub struct SafetensorsModel {
    dir: PathBuf,
    maps: Vec<memmap2::Mmap>,
    /// By GGUF name.
    tensors: HashMap<String, Located>,
    config: HfConfig,
}

/// Where one tensor lies: which map, and the byte range in it.
#[derive(Debug, Clone)]
struct Located {
    map: usize,
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// One entry of a safetensors header, already checked against the file.
#[derive(Debug, Clone, PartialEq)]
struct RawTensor {
    name: String,
    /// The file's own dtype name (`F32`, `I64`, ...).
    dtype: String,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    start: usize,
    end: usize,
}

#[derive(Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

impl SafetensorsModel {
    pub fn open(dir: &Path) -> Result<Self, FormatError> {
        let config = read_config(dir)?;
        let mut model = SafetensorsModel { dir: dir.to_path_buf(), maps: Vec::new(), tensors: HashMap::new(), config };
        let files = safetensors_files(dir)?;
        if files.is_empty() {
            return Err(FormatError::Missing(format!("*.safetensors files in {}", dir.display())));
        }
        for path in files {
            model.add_file(&path)?;
        }
        model.check_tensors()?;
        Ok(model)
    }

    /// What `config.json` says; `ModelConfig::from_hf` makes the model's config of it.
    pub fn hf_config(&self) -> &HfConfig {
        &self.config
    }

    /// Whether the output projection reuses the token embedding (`output.weight` is then
    /// absent, as in GGUF files of such models).
    pub fn tied_embeddings(&self) -> bool {
        self.config.tie_word_embeddings.unwrap_or(false)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn tokenizer_json_path(&self) -> Option<PathBuf> {
        existing(self.dir.join("tokenizer.json"))
    }

    pub fn tokenizer_config_path(&self) -> Option<PathBuf> {
        existing(self.dir.join("tokenizer_config.json"))
    }

    /// GGUF names of every tensor served, in no particular order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    fn add_file(&mut self, path: &Path) -> Result<(), FormatError> {
        let io = |source| FormatError::Io { path: path.display().to_string(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; pdserve never writes model files, and a file
        // changed underneath a running server is outside what any loader can guard.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let here = |e: FormatError| in_file(e, path);
        let raw = parse_header(&map).map_err(here)?;
        let index = self.maps.len();
        self.maps.push(map);
        for t in raw {
            let Some(name) = gguf_name(&t.name) else {
                continue;
            }; // e.g. rotary inv_freq
            let dtype = supported_dtype(&t.dtype).ok_or_else(|| here(unsupported_dtype(&t.name, &t.dtype)))?;
            let located = Located { map: index, dtype, shape: t.shape, start: t.start, end: t.end };
            if self.tensors.insert(name, located).is_some() {
                let why = format!("tensor `{}` appears in more than one file", t.name);
                return Err(here(FormatError::Corrupt(why)));
            }
        }
        Ok(())
    }

    /// The few facts the config and the tensors must agree on before anyone loads.
    fn check_tensors(&self) -> Result<(), FormatError> {
        let embd = self
            .tensors
            .get("token_embd.weight")
            .ok_or_else(|| FormatError::Missing("tensor model.embed_tokens.weight".into()))?;
        if embd.shape != [self.config.vocab_size, self.config.hidden_size] {
            return Err(FormatError::Invalid(format!(
                "model.embed_tokens.weight has shape {:?} but config.json says vocab_size {} \
                 and hidden_size {}",
                embd.shape, self.config.vocab_size, self.config.hidden_size
            )));
        }
        if !self.tied_embeddings() && !self.tensors.contains_key("output.weight") {
            return Err(FormatError::Missing(
                "tensor lm_head.weight (config.json says the embeddings are not tied)".into(),
            ));
        }
        Ok(())
    }
}

impl TensorSource for SafetensorsModel {
    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let t = self.tensors.get(name)?;
        let bytes = self.maps.get(t.map)?.get(t.start..t.end)?;
        Some(TensorView { dtype: t.dtype, shape: &t.shape, bytes })
    }
}

fn existing(path: PathBuf) -> Option<PathBuf> {
    path.is_file().then_some(path)
}

/// Prefixes an error with the file it came from; a sharded checkpoint has many.
fn in_file(e: FormatError, path: &Path) -> FormatError {
    let file = path.display();
    match e {
        FormatError::Truncated(why) => FormatError::Truncated(format!("{file}: {why}")),
        FormatError::Corrupt(why) => FormatError::Corrupt(format!("{file}: {why}")),
        FormatError::Invalid(why) => FormatError::Invalid(format!("{file}: {why}")),
        other => other,
    }
}

/// Every `*.safetensors` file in `dir`, sorted so shards load in a stable order. The
/// optional `model.safetensors.index.json` adds nothing a directory scan does not find.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, FormatError> {
    let io = |source| FormatError::Io { path: dir.display().to_string(), source };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.extension().is_some_and(|e| e == "safetensors") && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Parses and checks the header of one whole safetensors file.
fn parse_header(bytes: &[u8]) -> Result<Vec<RawTensor>, FormatError> {
    let len_bytes: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| FormatError::Truncated("shorter than the 8-byte header length".into()))?;
    let header_len = u64::from_le_bytes(len_bytes);
    let available = bytes.len() as u64 - 8;
    if header_len > available {
        return Err(FormatError::Truncated(format!("header claims {header_len} bytes but only {available} follow")));
    }
    if header_len > MAX_HEADER_BYTES {
        return Err(FormatError::Corrupt(format!("header of {header_len} bytes is too large")));
    }
    let data_start = 8 + header_len as usize;
    let json = bytes.get(8..data_start).unwrap_or_default();
    let entries: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(json).map_err(|e| FormatError::Corrupt(format!("header is not a JSON object: {e}")))?;
    let data_len = bytes.len() - data_start;
    entries
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, value)| locate(name, &value, data_start, data_len))
        .collect()
}

/// Checks one header entry: a known dtype, a shape whose size matches its byte range,
/// and a range inside the data section.
fn locate(
    name: String,
    value: &serde_json::Value,
    data_start: usize,
    data_len: usize,
) -> Result<RawTensor, FormatError> {
    let bad = |why: String| FormatError::Corrupt(format!("tensor `{name}`: {why}"));
    let e = HeaderEntry::deserialize(value).map_err(|e| bad(e.to_string()))?;
    let elem = elem_bytes(&e.dtype).ok_or_else(|| bad(format!("unknown dtype `{}`", e.dtype)))?;
    let shape = e
        .shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| bad("dimension too large".into())))
        .collect::<Result<Vec<_>, _>>()?;
    let n_bytes =
        shape.iter().try_fold(elem, |acc, &d| acc.checked_mul(d)).ok_or_else(|| bad("size overflows".into()))?;
    let [begin, end] = e.data_offsets;
    if begin > end || end > data_len as u64 {
        return Err(FormatError::Truncated(format!(
            "tensor `{name}` has data offsets {begin}..{end} but the data section has \
             {data_len} bytes"
        )));
    }
    if end - begin != n_bytes as u64 {
        let why = format!("shape {shape:?} of {} needs {n_bytes} bytes, offsets span {}", e.dtype, end - begin);
        return Err(bad(why));
    }
    // Both are at most `data_len`, so the additions cannot overflow.
    let start = data_start + begin as usize;
    Ok(RawTensor { dtype: e.dtype, shape, start, end: start + n_bytes, name })
}

/// Element sizes of every dtype the format defines, so files that also hold tensors
/// we ignore (e.g. integer buffers) still parse.
fn elem_bytes(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

fn supported_dtype(dtype: &str) -> Option<DType> {
    match dtype {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        _ => None,
    }
}

fn unsupported_dtype(tensor: &str, dtype: &str) -> FormatError {
    FormatError::Invalid(format!(
        "tensor `{tensor}` has dtype {dtype}; pdserve reads safetensors weights in F32, F16 \
         and BF16 only"
    ))
}

/// The GGUF name of a HF llama/qwen2 tensor, or `None` for tensors the model does not use.
fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    // Digits only: `usize::from_str` would also take "+1".
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let gguf = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{kind}"))
}

/// The fields of `config.json` pdserve reads; the rest is ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    pub architectures: Option<Vec<String>>,
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub max_position_embeddings: Option<usize>,
    pub tie_word_embeddings: Option<bool>,
}

/// Reads `dir/config.json`.
fn read_config(dir: &Path) -> Result<HfConfig, FormatError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            FormatError::Missing(format!("config.json in {}", dir.display()))
        } else {
            FormatError::Io { path: path.display().to_string(), source }
        }
    })?;
    serde_json::from_str(&text).map_err(|e| FormatError::Invalid(format!("{}: {e}", path.display())))
}

/// One tensor for [`to_safetensors_bytes`]: name, dtype, shape (outermost first) and
/// bytes already in that dtype's little-endian layout.
pub type TensorToWrite<'a> = (&'a str, DType, &'a [usize], &'a [u8]);

/// Serializes tensors as one safetensors file (header padded to 8 bytes, data in the
/// order given). Tests and the random-model writer use it.
pub fn to_safetensors_bytes(tensors: &[TensorToWrite<'_>]) -> Result<Vec<u8>, FormatError> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    for &(name, dtype, shape, data) in tensors {
        let dtype_name = match dtype {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            other => {
                let why = format!("safetensors cannot hold `{name}` as {other:?}");
                return Err(FormatError::Invalid(why));
            }
        };
        if dtype.storage_bytes(shape) != Some(data.len()) {
            let why = format!("`{name}`: {} bytes do not match shape {shape:?}", data.len());
            return Err(FormatError::Invalid(why));
        }
        let entry = serde_json::json!({
            "dtype": dtype_name, "shape": shape, "data_offsets": [offset, offset + data.len()]
        });
        header.insert(name.to_string(), entry);
        offset += data.len();
    }
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    // Padding keeps the data section 8-byte aligned, as the reference writer does.
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + json.len() + offset);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for &(_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
