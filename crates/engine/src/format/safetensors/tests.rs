//! Reading checkpoints: the round trip with our writer, name mapping, config
//! defaults, and damaged or incomplete files, which must be errors and never panics.

use super::*;
use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::testing::{random_llama_config, scratch_dir, write_random_llama};
use proptest::prelude::*;

/// A file from a literal header and data section.
fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

const TINY_CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 8,
    "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
    "vocab_size": 4, "tie_word_embeddings": true}"#;

/// A directory with `config` and one file holding `tensors` (all F32).
fn tiny_dir(name: &str, config: Option<&str>, tensors: &[(&str, &[usize])]) -> PathBuf {
    let dir = scratch_dir(name).unwrap();
    if let Some(config) = config {
        std::fs::write(dir.join("config.json"), config).unwrap();
    }
    let data: Vec<Vec<u8>> = tensors.iter().map(|(_, s)| f32_bytes(&vec![0.5; s.iter().product()])).collect();
    let list: Vec<TensorToWrite<'_>> =
        tensors.iter().zip(&data).map(|((n, s), d)| (*n, DType::F32, *s, &d[..])).collect();
    std::fs::write(dir.join("model.safetensors"), to_safetensors_bytes(&list).unwrap()).unwrap();
    dir
}

/// The model's config, as the loader makes it.
fn config(model: &SafetensorsModel) -> ModelConfig {
    ModelConfig::from_hf(model.hf_config()).unwrap()
}

/// Why opening `dir` and reading its config, as the loader does, fails.
fn open_err(dir: &Path) -> FormatError {
    let opened = SafetensorsModel::open(dir).and_then(|m| ModelConfig::from_hf(m.hf_config()));
    let err = opened.expect_err("open should fail");
    let _ = std::fs::remove_dir_all(dir);
    err
}

#[test]
fn parses_what_the_writer_writes() {
    let x = f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let h = [0u8, 60, 0, 64]; // f16 1.0, 2.0
    let bytes = to_safetensors_bytes(&[("x", DType::F32, &[2, 3], &x), ("h", DType::F16, &[2], &h)]).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    assert_eq!(header_len % 8, 0);
    let t = parse_header(&bytes).unwrap();
    assert_eq!(t.len(), 2, "metadata is not a tensor");
    let x_t = t.iter().find(|t| t.name == "x").unwrap();
    assert_eq!((x_t.dtype.as_str(), &x_t.shape[..]), ("F32", &[2, 3][..]));
    assert_eq!(&bytes[x_t.start..x_t.end], &x[..]);
    let h_t = t.iter().find(|t| t.name == "h").unwrap();
    assert_eq!(&bytes[h_t.start..h_t.end], &h[..]);
    assert!(to_safetensors_bytes(&[("q", DType::Q8_0, &[32], &[0; 34])]).is_err());
    assert!(to_safetensors_bytes(&[("x", DType::F32, &[2], &x)]).is_err());
}

#[test]
fn rejects_damaged_headers() {
    let ok = r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}"#;
    assert!(parse_header(&raw_file(ok, &[0; 8])).is_ok());
    assert!(matches!(parse_header(&[1, 2, 3]), Err(FormatError::Truncated(_))));
    let mut long = raw_file(ok, &[0; 8]);
    long[..8].copy_from_slice(&1000u64.to_le_bytes());
    assert!(matches!(parse_header(&long), Err(FormatError::Truncated(_))));
    long[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(parse_header(&long), Err(FormatError::Truncated(_))));
    let cases = [
        (r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}"#, 7, "truncated"),
        (r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}"#, 8, "truncated"),
        (r#"{"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}"#, 16, "needs 12"),
        (r#"{"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}"#, 8, "unknown dtype"),
        (r#"{"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}"#, 8, "tensor `a`"),
        (
            r#"{"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 4294967296],
            "data_offsets": [0, 8]}}"#,
            8,
            "overflow",
        ),
        (r#"{"a": {"dtype": "F32"}}"#, 8, "missing field"),
        (r#"[1, 2]"#, 0, "JSON object"),
        ("not json", 0, "JSON object"),
    ];
    for (header, data_len, expect) in cases {
        let err = parse_header(&raw_file(header, &vec![0; data_len])).unwrap_err();
        assert!(err.to_string().contains(expect), "{header}: {err}");
    }
}

#[test]
fn maps_hf_names_to_gguf_names() {
    let cases = [
        ("model.embed_tokens.weight", Some("token_embd.weight")),
        ("model.norm.weight", Some("output_norm.weight")),
        ("lm_head.weight", Some("output.weight")),
        ("model.layers.0.input_layernorm.weight", Some("blk.0.attn_norm.weight")),
        ("model.layers.12.self_attn.q_proj.weight", Some("blk.12.attn_q.weight")),
        ("model.layers.3.self_attn.k_proj.bias", Some("blk.3.attn_k.bias")),
        ("model.layers.3.self_attn.v_proj.weight", Some("blk.3.attn_v.weight")),
        ("model.layers.3.self_attn.o_proj.weight", Some("blk.3.attn_output.weight")),
        ("model.layers.1.post_attention_layernorm.weight", Some("blk.1.ffn_norm.weight")),
        ("model.layers.1.mlp.gate_proj.weight", Some("blk.1.ffn_gate.weight")),
        ("model.layers.1.mlp.up_proj.weight", Some("blk.1.ffn_up.weight")),
        ("model.layers.1.mlp.down_proj.weight", Some("blk.1.ffn_down.weight")),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
        ("model.layers.+1.mlp.up_proj.weight", None),
        ("model.layers..mlp.up_proj.weight", None),
        ("model.layers.1.mlp.up_proj.scales", None),
        ("model.layers.1", None),
    ];
    for (hf, gguf) in cases {
        assert_eq!(gguf_name(hf).as_deref(), gguf, "{hf}");
    }
}

#[test]
fn opens_a_checkpoint_under_gguf_names() {
    let dir = scratch_dir("st-open").unwrap();
    let paths = write_random_llama(&dir, &random_llama_config(), 11).unwrap();
    let model = SafetensorsModel::open(&paths.safetensors_dir).unwrap();
    let cfg = random_llama_config();
    assert_eq!(config(&model).rope_style, RopeStyle::Neox);
    assert_eq!(config(&model).n_kv_heads, cfg.n_kv_heads);
    let q = model.tensor("blk.1.attn_q.weight").unwrap();
    assert_eq!((q.dtype, q.shape), (DType::F32, &[cfg.q_dim(), cfg.hidden][..]));
    assert_eq!(q.bytes.len(), cfg.q_dim() * cfg.hidden * 4);
    assert!(model.tensor("output.weight").is_some());
    assert!(model.tensor("model.layers.0.self_attn.q_proj.weight").is_none(), "HF names");
    assert!(model.tensor_names().all(|n| !n.contains("inv_freq")));
    assert_eq!(model.tokenizer_json_path(), None);
    std::fs::write(paths.safetensors_dir.join("tokenizer.json"), "{}").unwrap();
    let tok = model.tokenizer_json_path().unwrap();
    assert!(tok.ends_with("tokenizer.json"));
    assert_eq!(model.tokenizer_config_path(), None);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn reads_config_defaults_and_architecture_names() {
    let embd: &[(&str, &[usize])] = &[("model.embed_tokens.weight", &[4, 8])];
    let dir = tiny_dir("st-defaults", Some(TINY_CONFIG), embd);
    let model = SafetensorsModel::open(&dir).unwrap();
    let c = config(&model);
    assert_eq!((c.n_kv_heads, c.head_dim, c.rope_theta, c.context_length), (2, 4, 10000.0, 2048));
    assert!(model.tied_embeddings() && model.tensor("output.weight").is_none());
    let _ = std::fs::remove_dir_all(&dir);

    let by_name = TINY_CONFIG.replace(r#""model_type": "llama""#, r#""architectures": ["Qwen2ForCausalLM"]"#);
    let dir = tiny_dir("st-arch", Some(&by_name), embd);
    assert_eq!(config(&SafetensorsModel::open(&dir).unwrap()).arch, Architecture::QWEN2);
    let _ = std::fs::remove_dir_all(&dir);
    let mistral = TINY_CONFIG.replace("llama", "mistral");
    let dir = tiny_dir("st-mistral", Some(&mistral), embd);
    assert_eq!(config(&SafetensorsModel::open(&dir).unwrap()).arch, Architecture::LLAMA);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn loads_sharded_checkpoints() {
    let dir = tiny_dir("st-shards", Some(TINY_CONFIG), &[("model.norm.weight", &[8])]);
    let embd = f32_bytes(&[0.0; 32]);
    let shard = to_safetensors_bytes(&[("model.embed_tokens.weight", DType::F32, &[4, 8], &embd)]);
    std::fs::write(dir.join("model-00002-of-00002.safetensors"), shard.unwrap()).unwrap();
    let model = SafetensorsModel::open(&dir).unwrap();
    assert!(model.tensor("token_embd.weight").is_some());
    assert!(model.tensor("output_norm.weight").is_some());
    // The same tensor in two shards is an error.
    let dup = to_safetensors_bytes(&[("model.norm.weight", DType::F32, &[1], &[0; 4])]);
    std::fs::write(dir.join("z.safetensors"), dup.unwrap()).unwrap();
    assert!(matches!(open_err(&dir), FormatError::Corrupt(m) if m.contains("more than one")));
}

#[test]
fn bad_directories_are_errors() {
    let embd: &[(&str, &[usize])] = &[("model.embed_tokens.weight", &[4, 8])];
    let err = open_err(&tiny_dir("st-noconfig", None, embd));
    assert!(matches!(err, FormatError::Missing(m) if m.contains("config.json")));
    let err = open_err(&tiny_dir("st-badjson", Some("{"), embd));
    assert!(matches!(err, FormatError::Invalid(_)));
    let gpt2 = TINY_CONFIG.replace("llama", "gpt2");
    let err = open_err(&tiny_dir("st-gpt2", Some(&gpt2), embd));
    assert!(matches!(err, FormatError::UnsupportedArchitecture { name, .. } if name == "gpt2"));
    let zero_heads = TINY_CONFIG.replace(r#""num_attention_heads": 2"#, r#""num_attention_heads": 0"#);
    assert!(matches!(open_err(&tiny_dir("st-0heads", Some(&zero_heads), embd)), FormatError::Invalid(_)));
    let untied = TINY_CONFIG.replace("true", "false");
    let err = open_err(&tiny_dir("st-untied", Some(&untied), embd));
    assert!(matches!(err, FormatError::Missing(m) if m.contains("lm_head")));
    let wrong_vocab: &[(&str, &[usize])] = &[("model.embed_tokens.weight", &[5, 8])];
    let err = open_err(&tiny_dir("st-vocab", Some(TINY_CONFIG), wrong_vocab));
    assert!(matches!(err, FormatError::Invalid(m) if m.contains("vocab_size 4")));
    let no_embd: &[(&str, &[usize])] = &[("model.norm.weight", &[8])];
    assert!(matches!(open_err(&tiny_dir("st-noembd", Some(TINY_CONFIG), no_embd)), FormatError::Missing(_)));

    let dir = tiny_dir("st-empty", Some(TINY_CONFIG), embd);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(matches!(open_err(&dir), FormatError::Missing(m) if m.contains("safetensors")));
    assert!(SafetensorsModel::open(Path::new("/nonexistent/pdserve")).is_err());
}

#[test]
fn unsupported_dtypes_fail_only_for_used_tensors() {
    let dir = tiny_dir("st-dtype", Some(TINY_CONFIG), &[("model.embed_tokens.weight", &[4, 8])]);
    // An integer buffer the model does not use is fine.
    let ignored = r#"{"position_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}"#;
    std::fs::write(dir.join("extra.safetensors"), raw_file(ignored, &[0; 16])).unwrap();
    assert!(SafetensorsModel::open(&dir).is_ok());
    let used = r#"{"model.norm.weight": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}}"#;
    std::fs::write(dir.join("extra.safetensors"), raw_file(used, &[0; 16])).unwrap();
    let err = open_err(&dir);
    assert!(matches!(&err, FormatError::Invalid(m) if m.contains("F64")), "{err}");
}

#[test]
fn damaged_files_in_a_directory_are_errors() {
    let embd: &[(&str, &[usize])] = &[("model.embed_tokens.weight", &[4, 8])];
    let long = (1u64 << 40).to_le_bytes().to_vec();
    for (name, bytes) in [("short", vec![1u8, 2]), ("long", long)] {
        let dir = tiny_dir(&format!("st-{name}"), Some(TINY_CONFIG), embd);
        std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
        let err = open_err(&dir);
        assert!(matches!(&err, FormatError::Truncated(m) if m.contains("model.safetensors")), "{err}");
    }
    let dir = tiny_dir("st-emptyfile", Some(TINY_CONFIG), embd);
    std::fs::write(dir.join("model.safetensors"), b"").unwrap();
    assert!(matches!(open_err(&dir), FormatError::Truncated(_)));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn never_panics_on_mutated_files(flips in prop::collection::vec((0usize..300, any::<u8>()), 1..8)) {
        let x = f32_bytes(&[1.0; 6]);
        let mut bytes = to_safetensors_bytes(&[
            ("model.embed_tokens.weight", DType::F32, &[2, 3], &x),
            ("b", DType::F32, &[3], &x[..12]),
        ]).unwrap();
        for (pos, val) in flips {
            let n = bytes.len();
            bytes[pos % n] = val;
        }
        if let Ok(tensors) = parse_header(&bytes) {
            for t in tensors {
                prop_assert!(t.start <= t.end && t.end <= bytes.len());
            }
        }
    }
}
