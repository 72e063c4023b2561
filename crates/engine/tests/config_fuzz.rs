//! A file whose header parses can still lie about the model: random hyper-parameters
//! under every supported architecture name, and random extra tensors of the kinds the
//! newer architectures read (fused q/k/v, Q/K norms, expert stacks, an expert router,
//! RoPE factors), over a small real llama's tensors. Reading the config and loading the
//! model must give a model or an error, never a panic.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::config::ModelConfig;
use pdserve_engine::format::gguf::{GgufFile, MetaValue};
use pdserve_engine::format::gguf_write::GgufWriter;
use pdserve_engine::format::{DType, TensorSource};
use pdserve_engine::model::Model;
use pdserve_engine::testing::{random_llama_config, scratch_dir, write_random_llama};
use proptest::prelude::*;
use std::sync::OnceLock;

const ARCHS: [&str; 6] = ["llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma3"];

/// Keys, with the small llama's own value (or a plausible one) that a case mostly keeps.
const KEYS: [(&str, u32); 13] = [
    ("block_count", 2),
    ("context_length", 256),
    ("embedding_length", 64),
    ("feed_forward_length", 128),
    ("attention.head_count", 4),
    ("attention.head_count_kv", 2),
    ("attention.key_length", 16),
    ("rope.dimension_count", 16),
    ("expert_count", 4),
    ("expert_used_count", 2),
    ("expert_feed_forward_length", 32),
    ("rope.scaling.original_context_length", 128),
    ("attention.sliding_window", 8),
];

const EXTRA: [&str; 7] = [
    "blk.0.attn_qkv.weight",
    "blk.0.attn_q_norm.weight",
    "blk.0.ffn_gate_inp.weight",
    "blk.0.ffn_gate_exps.weight",
    "blk.0.ffn_down_exps.weight",
    "rope_freqs.weight",
    "rope_factors_long.weight",
];

/// A tensor: name, dtype, shape, bytes.
type Tensor = (String, DType, Vec<usize>, Vec<u8>);

/// The small llama's tensors.
fn base() -> &'static Vec<Tensor> {
    static BASE: OnceLock<Vec<Tensor>> = OnceLock::new();
    BASE.get_or_init(|| {
        let dir = scratch_dir("config-fuzz-base").unwrap();
        let file = GgufFile::open(&write_random_llama(&dir, &random_llama_config(), 3).unwrap().gguf_path).unwrap();
        file.header
            .tensors
            .iter()
            .map(|t| {
                let v = file.tensor(&t.name).unwrap();
                (t.name.clone(), v.dtype, v.shape.to_vec(), v.bytes.to_vec())
            })
            .collect()
    })
}

/// Mostly the plausible value, sometimes none, a small or any number.
fn value(plausible: u32) -> impl Strategy<Value = Option<u32>> {
    prop_oneof![
        12 => Just(Some(plausible)),
        1 => Just(None),
        1 => (0u32..5).prop_map(Some),
        1 => (0u32..300).prop_map(Some),
        1 => any::<u32>().prop_map(Some),
    ]
}

fn values() -> impl Strategy<Value = Vec<Option<u32>>> {
    KEYS.iter().map(|&(_, v)| value(v)).collect::<Vec<_>>()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn lying_headers_load_or_fail_without_panicking(
        arch in 0..ARCHS.len(),
        values in values(),
        attn_factor in prop_oneof![Just(1.0f32), -2.0f32..4.0, Just(f32::NAN)],
        extra in prop::collection::vec((0..EXTRA.len(), prop::collection::vec(prop_oneof![Just(2usize), Just(4), Just(16), Just(32), Just(64), 1usize..200], 1..4)), 0..5),
    ) {
        let arch = ARCHS[arch];
        let mut w = GgufWriter::new();
        w.meta("general.architecture", MetaValue::Str(arch.into()));
        w.meta(&format!("{arch}.rope.scaling.attn_factor"), MetaValue::F32(attn_factor));
        for ((key, _), v) in KEYS.iter().zip(&values) {
            if let Some(v) = v {
                w.meta(&format!("{arch}.{key}"), MetaValue::U32(*v));
            }
        }
        for (name, dtype, shape, bytes) in base() {
            w.tensor(name, *dtype, shape, bytes.clone());
        }
        for (i, shape) in &extra {
            if base().iter().all(|t| t.0 != EXTRA[*i]) {
                let n: usize = shape.iter().product();
                w.f32_tensor(EXTRA[*i], shape, &vec![0.5; n]);
            }
        }
        let dir = scratch_dir("config-fuzz").unwrap();
        let path = dir.join("m.gguf");
        std::fs::write(&path, w.to_bytes()).unwrap();
        let Ok(file) = GgufFile::open(&path) else { return Ok(()) };
        if let Ok(cfg) = ModelConfig::from_gguf(&file.header) {
            let _ = Model::load(&file, cfg);
        }
    }
}
