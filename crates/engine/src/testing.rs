//! Test support: tiny random-weight models written both as a HF safetensors directory
//! and as a GGUF file from the same numbers, so the two loaders and the forward pass can
//! be checked against each other without downloading anything.
//!
//! Public because benches and other crates' tests use it; nothing on the request path
//! calls it.

use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::format::gguf::MetaValue;
use crate::format::gguf_write::GgufWriter;
use crate::format::safetensors::to_safetensors_bytes;
use crate::format::{DType, FormatError, TensorView};
use crate::kernels::quant::dequantize_row;
use crate::sampler::Rng;
use std::path::{Path, PathBuf};

/// A small llama: 2 layers, hidden 64, FFN 128, 4 heads over 2 KV heads of 16, vocab 96.
pub fn random_llama_config() -> ModelConfig {
    ModelConfig {
        arch: Architecture::LLAMA,
        n_layers: 2,
        hidden: 64,
        ffn_hidden: 128,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        vocab_size: 96,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_style: RopeStyle::Neox,
        context_length: 256,
        rope_attn_factor: 1.0,
        rope_original_context: 256,
        gemma3: None,
        moe: None,
    }
}

/// The same shapes as [`random_llama_config`] for qwen2 (which adds q/k/v biases).
pub fn random_qwen2_config() -> ModelConfig {
    ModelConfig { arch: Architecture::QWEN2, rms_eps: 1e-6, ..random_llama_config() }
}

/// [`random_llama_config`] widened to 256 (hidden, FFN, 4 heads of 64), so that every
/// matrix row is a whole number of 256-value blocks (the K types, IQ4_XS).
pub fn random_llama_config_256() -> ModelConfig {
    ModelConfig { hidden: 256, ffn_hidden: 256, head_dim: 64, ..random_llama_config() }
}

/// Where [`write_random_model`] put the two copies of one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RandomModelPaths {
    /// `config.json` and `model.safetensors`.
    pub safetensors_dir: PathBuf,
    pub gguf_path: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RandomModelOptions {
    pub seed: u64,
    /// F32, F16 or BF16: both copies store the same rounded values. A quantized type:
    /// the GGUF copy stores the embedding and every matrix as random blocks of it
    /// ([`random_blocks`]) and the safetensors copy their dequantized values in F32.
    pub dtype: DType,
    /// Leave out `lm_head.weight` / `output.weight`, as SmolLM2 does.
    pub tie_embeddings: bool,
}

/// [`write_random_model`] in f32 with an untied output projection.
pub fn write_random_llama(dir: &Path, cfg: &ModelConfig, seed: u64) -> Result<RandomModelPaths, FormatError> {
    let opts = RandomModelOptions { seed, dtype: DType::F32, tie_embeddings: false };
    write_random_model(dir, cfg, &opts)
}

/// Generates random weights for `cfg` (llama or qwen2; `rope_style` is ignored) once and
/// writes them to `dir/safetensors/` and `dir/model.gguf`.
///
/// The GGUF copy is what llama.cpp's converter would make of the safetensors one: for
/// llama, Q and K rows are permuted to the interleaved RoPE layout (GGUF llama uses
/// [`RopeStyle::Normal`]); qwen2 keeps HF's layout. Norm weights are F32 in the GGUF, as
/// llama.cpp writes them, holding exactly the values rounded to `dtype`.
pub fn write_random_model(
    dir: &Path,
    cfg: &ModelConfig,
    opts: &RandomModelOptions,
) -> Result<RandomModelPaths, FormatError> {
    let cfg = cfg.clone().validate()?;
    let names = arch_names(cfg.arch)?;
    let elems = opts.dtype.block_elems();
    for (hf, _, shape, role) in weight_specs(&cfg, opts.tie_embeddings) {
        if role.quantizable() && !shape.last().is_some_and(|c| c.is_multiple_of(elems)) {
            let why = format!("{hf} {shape:?} is not a whole number of {elems}-value {:?} blocks", opts.dtype);
            return Err(FormatError::Invalid(why));
        }
    }
    let weights = random_weights(&cfg, opts);
    let paths = RandomModelPaths { safetensors_dir: dir.join("safetensors"), gguf_path: dir.join("model.gguf") };
    create_dir(&paths.safetensors_dir)?;
    write(&paths.safetensors_dir.join("config.json"), hf_config(&cfg, names, opts).as_bytes())?;
    write(&paths.safetensors_dir.join("model.safetensors"), &safetensors_file(&weights, opts)?)?;
    write(&paths.gguf_path, &gguf_file(&cfg, names.2, &weights, opts.dtype)?)?;
    Ok(paths)
}

/// Reorders the rows of a `[n_head * head_dim, cols]` Q or K weight from HF's
/// half-split RoPE layout to GGUF llama's interleaved one, as llama.cpp's converter
/// does: view as `[n_head, 2, head_dim / 2, cols]`, swap axes 1 and 2, flatten back.
/// `None` when the sizes do not fit that view.
pub fn permute_qk_for_gguf(w: &[f32], n_head: usize, cols: usize) -> Option<Vec<f32>> {
    permute_rows(w, n_head, cols)
}

/// [`permute_qk_for_gguf`] over rows of `cols` items of any kind (the bytes of a
/// quantized matrix's rows move the same way).
fn permute_rows<T: Clone>(w: &[T], n_head: usize, cols: usize) -> Option<Vec<T>> {
    let rows: Vec<&[T]> = w.chunks_exact(cols.max(1)).collect();
    let head_dim = rows.len().checked_div(n_head)?;
    if cols == 0 || !head_dim.is_multiple_of(2) || head_dim * n_head * cols != w.len() {
        return None;
    }
    let half = head_dim / 2;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                out.extend_from_slice(rows.get(h * head_dim + j * half + i)?);
            }
        }
    }
    Some(out)
}

/// What a weight is, which decides its initial values and its GGUF treatment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Embedding,
    Matrix,
    Norm,
    Bias,
    /// Q or K projection with this many heads: permuted for GGUF llama.
    RopeMatrix(usize),
}

impl Role {
    /// Stored in the model's quantized type when it has one (norms and biases stay F32).
    fn quantizable(self) -> bool {
        matches!(self, Role::Embedding | Role::Matrix | Role::RopeMatrix(_))
    }
}

/// One generated tensor, values already rounded to the target dtype.
struct Weight {
    hf: String,
    gguf: String,
    shape: Vec<usize>,
    role: Role,
    values: Vec<f32>,
    /// The GGUF blocks `values` were dequantized from, for a quantized model.
    blocks: Option<Vec<u8>>,
}

/// A tensor to generate: HF name, GGUF name, shape, role.
type Spec = (String, String, Vec<usize>, Role);

fn random_weights(cfg: &ModelConfig, opts: &RandomModelOptions) -> Vec<Weight> {
    let mut rng = Gaussian(Rng::new(opts.seed));
    let round = |v: f32| round_to(v, opts.dtype);
    weight_specs(cfg, opts.tie_embeddings)
        .into_iter()
        .map(|(hf, gguf, shape, role)| {
            if opts.dtype.is_quantized() && role.quantizable() {
                let n: usize = shape.iter().product();
                // Blocks reach about ±2/sqrt(fan-in): spread like the dense matrices.
                let scale = 2.0 / (shape.last().copied().unwrap_or(1).max(1) as f32).sqrt();
                let bytes = random_blocks(opts.dtype, n / opts.dtype.block_elems(), scale, &mut rng.0);
                let mut values = vec![0f32; n];
                dequantize_row(opts.dtype, &bytes, &mut values);
                return Weight { hf, gguf, shape, role, values, blocks: Some(bytes) };
            }
            let values = rng.values(&shape, role).into_iter().map(round).collect();
            Weight { hf, gguf, shape, role, values, blocks: None }
        })
        .collect()
}

/// Every tensor of a llama/qwen2 checkpoint in file order, under both names.
fn weight_specs(cfg: &ModelConfig, tie_embeddings: bool) -> Vec<Spec> {
    let vocab_by_hidden = vec![cfg.vocab_size, cfg.hidden];
    let embd = "model.embed_tokens.weight";
    let mut specs = vec![spec(embd, "token_embd.weight", vocab_by_hidden.clone(), Role::Embedding)];
    let layer = layer_specs(cfg);
    for l in 0..cfg.n_layers {
        for (hf, gguf, shape, role) in &layer {
            let names = (format!("model.layers.{l}.{hf}"), format!("blk.{l}.{gguf}"));
            specs.push((names.0, names.1, shape.clone(), *role));
        }
    }
    specs.push(spec("model.norm.weight", "output_norm.weight", vec![cfg.hidden], Role::Norm));
    if !tie_embeddings {
        specs.push(spec("lm_head.weight", "output.weight", vocab_by_hidden, Role::Matrix));
    }
    specs
}

fn spec(hf: &str, gguf: &str, shape: Vec<usize>, role: Role) -> Spec {
    (hf.to_string(), gguf.to_string(), shape, role)
}

/// The tensors of one block, by name suffix. Kept as a one-line-per-tensor table.
#[rustfmt::skip]
fn layer_specs(cfg: &ModelConfig) -> Vec<(&'static str, &'static str, Vec<usize>, Role)> {
    let (h, q, kv, ffn) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.ffn_hidden);
    let mut layer = vec![
        ("input_layernorm.weight", "attn_norm.weight", vec![h], Role::Norm),
        ("self_attn.q_proj.weight", "attn_q.weight", vec![q, h], Role::RopeMatrix(cfg.n_heads)),
        ("self_attn.k_proj.weight", "attn_k.weight", vec![kv, h], Role::RopeMatrix(cfg.n_kv_heads)),
        ("self_attn.v_proj.weight", "attn_v.weight", vec![kv, h], Role::Matrix),
        ("self_attn.o_proj.weight", "attn_output.weight", vec![h, q], Role::Matrix),
        ("post_attention_layernorm.weight", "ffn_norm.weight", vec![h], Role::Norm),
        ("mlp.gate_proj.weight", "ffn_gate.weight", vec![ffn, h], Role::Matrix),
        ("mlp.up_proj.weight", "ffn_up.weight", vec![ffn, h], Role::Matrix),
        ("mlp.down_proj.weight", "ffn_down.weight", vec![h, ffn], Role::Matrix),
    ];
    if cfg.arch == Architecture::QWEN2 {
        layer.extend([
            ("self_attn.q_proj.bias", "attn_q.bias", vec![q], Role::Bias),
            ("self_attn.k_proj.bias", "attn_k.bias", vec![kv], Role::Bias),
            ("self_attn.v_proj.bias", "attn_v.bias", vec![kv], Role::Bias),
        ]);
    }
    layer
}

/// Approximately normal draws: the sum of 12 uniforms minus 6 has mean 0 and variance
/// 1, and uses no libm function, so weights are identical on every platform.
struct Gaussian(Rng);

impl Gaussian {
    fn next(&mut self) -> f32 {
        let sum: f64 = (0..12).map(|_| self.0.next_f64()).sum();
        (sum - 6.0) as f32
    }

    /// Matrices (the embedding too) are scaled by 1/sqrt(fan-in), not the usual 0.02:
    /// with weights that small every attention score is near zero, attention is uniform,
    /// and a RoPE layout mistake would not show in the logits the two copies are
    /// compared on. (Checked: loading the GGUF copy as Neox moves logprobs by ~1.)
    fn values(&mut self, shape: &[usize], role: Role) -> Vec<f32> {
        let n: usize = shape.iter().product();
        let fan_in = shape.last().copied().unwrap_or(1).max(1) as f32;
        let (offset, scale) = match role {
            // Tied models read logits off the embedding too, so it gets the same
            // scale: logits come out roughly N(0, 1) either way.
            Role::Embedding | Role::Matrix | Role::RopeMatrix(_) => (0.0, 1.0 / fan_in.sqrt()),
            Role::Norm => (1.0, 0.1),
            Role::Bias => (0.0, 0.1),
        };
        (0..n).map(|_| offset + scale * self.next()).collect()
    }
}

/// `n` random blocks of the quantized `dtype`: random bytes, except that every f16
/// scale field (d, dmin, m) is drawn so the weights reach about ±`scale` (a min field:
/// a shift of about a quarter to a half of that). Empty for a dense `dtype`.
pub fn random_blocks(dtype: DType, n: usize, scale: f32, rng: &mut Rng) -> Vec<u8> {
    if !dtype.is_quantized() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(n * dtype.block_bytes());
    for _ in 0..n {
        let start = out.len();
        out.extend((0..dtype.block_bytes()).map(|_| (rng.next_u64() >> 32) as u8));
        for &(at, unit) in scale_fields(dtype) {
            let v = unit * scale * (0.5 + 0.5 * rng.next_f64() as f32);
            out[start + at..start + at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    out
}

/// A block's f16 scale fields: byte offset, and the value that makes the largest
/// weight about 1 (largest code times largest sub-scale, inverted); for a min field,
/// the value that shifts the weights by about 1/2.
#[rustfmt::skip]
fn scale_fields(dtype: DType) -> &'static [(usize, f32)] {
    match dtype {
        DType::Q4_0 => &[(0, 1.0 / 8.0)],
        DType::Q4_1 => &[(0, 1.0 / 15.0), (2, -0.5)],
        DType::Q8_0 => &[(0, 1.0 / 127.0)],
        DType::Q5_0 => &[(0, 1.0 / 16.0)],
        DType::Q5_1 => &[(0, 1.0 / 31.0), (2, -0.5)],
        DType::Q2_K => &[(80, 1.0 / (15.0 * 3.0)), (82, 0.5 / 15.0)],
        DType::Q3_K => &[(108, 1.0 / (32.0 * 4.0))],
        DType::Q4_K => &[(0, 1.0 / (63.0 * 15.0)), (2, 0.5 / 63.0)],
        DType::Q5_K => &[(0, 1.0 / (63.0 * 31.0)), (2, 0.5 / 63.0)],
        DType::Q6_K => &[(208, 1.0 / (128.0 * 32.0))],
        DType::IQ4_NL => &[(0, 1.0 / 127.0)],
        DType::IQ4_XS => &[(0, 1.0 / (32.0 * 127.0))],
        DType::F32 | DType::F16 | DType::BF16 => &[],
    }
}

/// The type a dense copy of an `opts.dtype` model is stored in.
fn dense_dtype(dtype: DType) -> DType {
    if dtype.is_quantized() {
        DType::F32
    } else {
        dtype
    }
}

fn round_to(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_f32(v).to_f32(),
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F16 => values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        DType::BF16 => values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn safetensors_file(weights: &[Weight], opts: &RandomModelOptions) -> Result<Vec<u8>, FormatError> {
    let dtype = dense_dtype(opts.dtype);
    let data: Vec<Vec<u8>> = weights.iter().map(|w| encode(&w.values, dtype)).collect();
    let mut tensors: Vec<_> =
        weights.iter().zip(&data).map(|(w, d)| (w.hf.as_str(), dtype, &w.shape[..], &d[..])).collect();
    // Real checkpoints carry buffers the model does not use; the loader must skip them.
    let inv_freq = encode(&[1.0, 0.5, 0.25, 0.125], DType::F32);
    tensors.push(("model.layers.0.self_attn.rotary_emb.inv_freq", DType::F32, &[4], &inv_freq));
    to_safetensors_bytes(&tensors)
}

/// HF's class and model type, and GGUF's architecture name, of the architectures
/// random models are written in (the others: scripts/random_gguf.py).
fn arch_names(arch: Architecture) -> Result<(&'static str, &'static str, &'static str), FormatError> {
    match arch {
        Architecture::LLAMA => Ok(("LlamaForCausalLM", "llama", "llama")),
        Architecture::QWEN2 => Ok(("Qwen2ForCausalLM", "qwen2", "qwen2")),
        _ => Err(FormatError::Invalid("random models are llama or qwen2 only".into())),
    }
}

fn hf_config(
    cfg: &ModelConfig,
    (architecture, model_type, _): (&str, &str, &str),
    opts: &RandomModelOptions,
) -> String {
    let torch_dtype = match opts.dtype {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        _ => "float32",
    };
    serde_json::json!({
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.context_length,
        "tie_word_embeddings": opts.tie_embeddings,
        "torch_dtype": torch_dtype,
    })
    .to_string()
}

fn gguf_file(cfg: &ModelConfig, arch: &str, weights: &[Weight], dtype: DType) -> Result<Vec<u8>, FormatError> {
    let mut w = GgufWriter::new();
    let u32_of = |v: usize| MetaValue::U32(u32::try_from(v).unwrap_or(u32::MAX));
    w.meta("general.architecture", MetaValue::Str(arch.into()))
        .meta("general.name", MetaValue::Str("pdserve random test model".into()));
    for (key, value) in [
        ("block_count", u32_of(cfg.n_layers)),
        ("context_length", u32_of(cfg.context_length)),
        ("embedding_length", u32_of(cfg.hidden)),
        ("feed_forward_length", u32_of(cfg.ffn_hidden)),
        ("attention.head_count", u32_of(cfg.n_heads)),
        ("attention.head_count_kv", u32_of(cfg.n_kv_heads)),
        ("attention.key_length", u32_of(cfg.head_dim)),
        ("attention.value_length", u32_of(cfg.head_dim)),
        ("rope.dimension_count", u32_of(cfg.head_dim)),
        ("vocab_size", u32_of(cfg.vocab_size)),
        ("rope.freq_base", MetaValue::F32(cfg.rope_theta)),
        ("attention.layer_norm_rms_epsilon", MetaValue::F32(cfg.rms_eps)),
    ] {
        w.meta(&format!("{arch}.{key}"), value);
    }
    for t in weights {
        let cols = t.shape.last().copied().unwrap_or(1);
        let (bytes, dtype) = match (&t.blocks, t.role) {
            (Some(blocks), _) => (blocks.clone(), dtype),
            (None, Role::Norm) => (encode(&t.values, DType::F32), DType::F32),
            (None, _) => (encode(&t.values, dense_dtype(dtype)), dense_dtype(dtype)),
        };
        let bytes = match t.role {
            Role::RopeMatrix(n_head) if cfg.arch == Architecture::LLAMA => {
                let row_bytes = dtype.storage_bytes(&[cols]).unwrap_or(0);
                permute_rows(&bytes, n_head, row_bytes)
                    .ok_or_else(|| FormatError::Invalid(format!("{} does not split into {n_head} heads", t.hf)))?
            }
            _ => bytes,
        };
        w.tensor(&t.gguf, dtype, &t.shape, bytes);
    }
    Ok(w.to_bytes())
}

fn create_dir(path: &Path) -> Result<(), FormatError> {
    std::fs::create_dir_all(path).map_err(|source| FormatError::Io { path: path.display().to_string(), source })
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), FormatError> {
    std::fs::write(path, bytes).map_err(|source| FormatError::Io { path: path.display().to_string(), source })
}

/// A dense tensor's values as f32 (`None` for quantized types or ragged bytes), so
/// tests can compare tensors whatever their storage type.
pub fn dense_values(view: &TensorView<'_>) -> Option<Vec<f32>> {
    let decode = |width: usize, f: fn(&[u8]) -> f32| {
        view.bytes.len().is_multiple_of(width).then(|| view.bytes.chunks_exact(width).map(f).collect())
    };
    match view.dtype {
        DType::F32 => decode(4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::F16 => decode(2, |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        DType::BF16 => decode(2, |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        _ => None,
    }
}

/// A fresh, empty directory under the system temp dir for one test; callers remove it.
pub fn scratch_dir(name: &str) -> Result<PathBuf, FormatError> {
    let dir = std::env::temp_dir().join(format!("pdserve-{name}-{}", std::process::id()));
    // A leftover from an earlier run with the same pid is stale; start clean.
    let _ = std::fs::remove_dir_all(&dir);
    create_dir(&dir)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::gguf::GgufFile;
    use crate::format::safetensors::SafetensorsModel;
    use crate::format::TensorSource;

    fn check_copies_agree(name: &str, cfg: &ModelConfig, opts: &RandomModelOptions) {
        let dir = scratch_dir(name).unwrap();
        let paths = write_random_model(&dir, cfg, opts).unwrap();
        let st = SafetensorsModel::open(&paths.safetensors_dir).unwrap();
        let gg = GgufFile::open(&paths.gguf_path).unwrap();
        let gg_cfg = ModelConfig::from_gguf(&gg.header).unwrap();
        let llama = cfg.arch == Architecture::LLAMA;
        let gguf_rope = if llama { RopeStyle::Normal } else { RopeStyle::Neox };
        assert_eq!(gg_cfg.rope_style, gguf_rope);
        let neox = ModelConfig { rope_style: RopeStyle::Neox, ..cfg.clone() };
        assert_eq!(ModelConfig::from_hf(st.hf_config()).unwrap(), neox);
        assert_eq!(ModelConfig { rope_style: RopeStyle::Neox, ..gg_cfg }, neox);
        assert_eq!(st.tied_embeddings(), opts.tie_embeddings);

        let mut names: Vec<&str> = st.tensor_names().collect();
        let mut gg_names: Vec<&str> = gg.header.tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        gg_names.sort_unstable();
        assert_eq!(names, gg_names);
        assert_eq!(st.tensor("output.weight").is_none(), opts.tie_embeddings);
        for name in names {
            let (a, b) = (st.tensor(name).unwrap(), gg.tensor(name).unwrap());
            assert_eq!(a.shape, b.shape, "{name}");
            assert_eq!(a.dtype, dense_dtype(opts.dtype), "{name}");
            if name.ends_with("norm.weight") || name.ends_with(".bias") {
                assert!(!b.dtype.is_quantized(), "{name}");
            } else {
                assert_eq!(b.dtype, opts.dtype, "{name}");
            }
            let mut vb = vec![f32::NAN; b.shape.iter().product()];
            dequantize_row(b.dtype, b.bytes, &mut vb);
            let va = dense_values(&a).unwrap();
            let n_head = if name.ends_with("attn_q.weight") {
                cfg.n_heads
            } else if name.ends_with("attn_k.weight") {
                cfg.n_kv_heads
            } else {
                0
            };
            if llama && n_head > 0 {
                assert_ne!(va, vb, "{name} should be permuted");
                assert_eq!(permute_qk_for_gguf(&va, n_head, cfg.hidden).unwrap(), vb, "{name}");
            } else {
                assert_eq!(va, vb, "{name}");
            }
            if name.ends_with("norm.weight") {
                assert_eq!(b.dtype, DType::F32);
                let mean = va.iter().sum::<f32>() / va.len() as f32;
                assert!((mean - 1.0).abs() < 0.1, "{name} mean {mean}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn safetensors_and_gguf_copies_agree() {
        let opts = |seed, dtype, tie_embeddings| RandomModelOptions { seed, dtype, tie_embeddings };
        check_copies_agree("rand-llama-f32", &random_llama_config(), &opts(1, DType::F32, false));
        check_copies_agree("rand-llama-bf16", &random_llama_config(), &opts(2, DType::BF16, true));
        check_copies_agree("rand-qwen2-f16", &random_qwen2_config(), &opts(3, DType::F16, false));
        // Quantized GGUF copies: the safetensors copy holds their dequantized values.
        check_copies_agree("rand-llama-q4k", &random_llama_config_256(), &opts(4, DType::Q4_K, false));
        let qwen2_256 = ModelConfig { arch: Architecture::QWEN2, rms_eps: 1e-6, ..random_llama_config_256() };
        check_copies_agree("rand-qwen2-q6k", &qwen2_256, &opts(5, DType::Q6_K, true));
        check_copies_agree("rand-llama-q5_0", &random_llama_config(), &opts(6, DType::Q5_0, false));
    }

    #[test]
    fn same_seed_writes_the_same_files() {
        let read = |dir: &Path, seed| {
            let p = write_random_llama(dir, &random_llama_config(), seed).unwrap();
            let st = std::fs::read(p.safetensors_dir.join("model.safetensors")).unwrap();
            (st, std::fs::read(p.gguf_path).unwrap())
        };
        let dir = scratch_dir("rand-seed").unwrap();
        let first = read(&dir, 5);
        assert_eq!(read(&dir, 5), first);
        assert_ne!(read(&dir, 6), first);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn permutation_interleaves_the_halves_of_each_head() {
        // One head of dimension 4, one column: rows (0 1 | 2 3) become 0 2 1 3.
        assert_eq!(permute_qk_for_gguf(&[0.0, 1.0, 2.0, 3.0], 1, 1), Some(vec![0.0, 2.0, 1.0, 3.0]));
        // Two heads of dimension 4, two columns each.
        let w: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let rows = [0, 2, 1, 3, 4, 6, 5, 7];
        let want: Vec<f32> = rows.iter().flat_map(|&r| [2.0 * r as f32, 2.0 * r as f32 + 1.0]).collect();
        assert_eq!(permute_qk_for_gguf(&w, 2, 2), Some(want));
        assert_eq!(permute_qk_for_gguf(&w, 3, 2), None);
        assert_eq!(permute_qk_for_gguf(&w, 0, 2), None);
        assert_eq!(permute_qk_for_gguf(&w, 2, 0), None);
        assert_eq!(permute_qk_for_gguf(&w[..6], 1, 2), None, "odd head dimension");
    }

    #[test]
    fn rejects_configs_it_cannot_write() {
        let dir = scratch_dir("rand-bad").unwrap();
        let bad = ModelConfig { n_kv_heads: 3, ..random_llama_config() };
        assert!(write_random_llama(&dir, &bad, 0).is_err());
        // 64-wide rows are not a whole number of 256-value Q4_K blocks.
        let q = RandomModelOptions { seed: 0, dtype: DType::Q4_K, tie_embeddings: false };
        assert!(write_random_model(&dir, &random_llama_config(), &q).is_err());
        assert!(write_random_model(&dir, &random_llama_config_256(), &q).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
