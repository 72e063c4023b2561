//! One random model written twice, as a HF safetensors directory and as a GGUF file
//! (`pdserve_engine::testing`), must give the same logits through both loaders. The two
//! copies differ where the formats differ: GGUF llama permutes the Q and K rows and uses
//! the interleaved ("normal") RoPE, safetensors keeps HF's rows and the half-split
//! ("neox") RoPE. Both are the same function of the tokens.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::config::{ModelConfig, RopeStyle};
use pdserve_engine::format::gguf::GgufFile;
use pdserve_engine::format::safetensors::SafetensorsModel;
use pdserve_engine::format::DType;
use pdserve_engine::kernels::Isa;
use pdserve_engine::kvcache::KvStorage;
use pdserve_engine::model::{ForwardScratch, Model, SeqBatch};
use pdserve_engine::testing::{
    random_llama_config, random_llama_config_256, random_qwen2_config, scratch_dir, write_random_llama,
    write_random_model, RandomModelOptions,
};
use pdserve_engine::threadpool::ThreadPool;
use std::path::PathBuf;

/// Relative agreement asked of the two copies.
const TOL: f32 = 1e-4;

/// A temp directory removed when the test ends, pass or fail.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The model written to `name`, loaded from safetensors and from GGUF.
fn both(name: &str, cfg: &ModelConfig, seed: u64) -> (TempDir, Model, Model) {
    both_with(name, cfg, &RandomModelOptions { seed, dtype: DType::F32, tie_embeddings: false })
}

fn both_with(name: &str, cfg: &ModelConfig, opts: &RandomModelOptions) -> (TempDir, Model, Model) {
    let dir = TempDir(scratch_dir(name).unwrap());
    let paths = write_random_model(&dir.0, cfg, opts).unwrap();
    let st = SafetensorsModel::open(&paths.safetensors_dir).unwrap();
    let st_model = Model::load(&st, ModelConfig::from_hf(st.hf_config()).unwrap()).unwrap();
    let gg = GgufFile::open(&paths.gguf_path).unwrap();
    let gg_cfg = ModelConfig::from_gguf(&gg.header).unwrap();
    let gg_model = Model::load(&gg, gg_cfg).unwrap();
    (dir, st_model, gg_model)
}

/// A fixed pseudo-random token sequence over the model's vocabulary.
fn tokens(n: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let mut x = 0x2545_f491_4f6c_dd1d ^ salt;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// Runs `model` on several sequences: a prefill of each, then `decode` more steps
/// feeding the token `(last + 1) % vocab` (the same for every model under test).
/// Returns the logits of every step, one row per sequence.
fn run(model: &Model, prompts: &[Vec<u32>], decode: usize) -> Vec<Vec<f32>> {
    let cfg = &model.cfg;
    let pool = ThreadPool::new(1);
    let per_seq = 8;
    let mut kv = KvStorage::new(cfg, per_seq * prompts.len(), 16);
    let blocks: Vec<Vec<u32>> =
        (0..prompts.len()).map(|s| (0..per_seq as u32).map(|b| s as u32 * per_seq as u32 + b).collect()).collect();
    let mut scratch = ForwardScratch::default();
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let mut pos = vec![0; prompts.len()];
    let mut steps = Vec::new();
    for _ in 0..=decode {
        let batch: Vec<SeqBatch<'_>> = seqs
            .iter()
            .zip(&pos)
            .zip(&blocks)
            .map(|((t, &p), b)| SeqBatch {
                tokens: &t[p..],
                start_pos: p,
                blocks: b,
                logits: 1,
                score: None,
                pool: None,
            })
            .collect();
        let logits =
            model.forward(Isa::detect(), &pool, &batch, &mut kv, &mut scratch, &mut |_, _| true).unwrap().to_vec();
        assert_eq!(logits.len(), prompts.len() * cfg.vocab_size);
        assert!(logits.iter().all(|x| x.is_finite()));
        steps.push(logits);
        for (s, p) in seqs.iter_mut().zip(&mut pos) {
            *p = s.len();
            let next = (s[s.len() - 1] + 1) % cfg.vocab_size as u32;
            s.push(next);
        }
    }
    steps
}

/// Largest difference relative to the largest logit magnitude.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().chain(b).fold(0f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    // Lengths below, at and across the 16-token block boundary.
    [1, 7, 16, 37].iter().enumerate().map(|(i, &n)| tokens(n, vocab, i as u64)).collect()
}

fn check(name: &str, cfg: &ModelConfig, seed: u64, decode: usize) {
    let (_dir, st, gg) = both(name, cfg, seed);
    assert_eq!(st.cfg.rope_style, RopeStyle::Neox);
    let gguf_rope =
        if cfg.arch == pdserve_engine::config::Architecture::LLAMA { RopeStyle::Normal } else { RopeStyle::Neox };
    assert_eq!(gg.cfg.rope_style, gguf_rope);
    let p = prompts(cfg.vocab_size);
    let (a, b) = (run(&st, &p, decode), run(&gg, &p, decode));
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        let d = rel_diff(x, y);
        assert!(d <= TOL, "{name}: step {step}: logits differ by {d} relative");
        // The logits carry information: they vary across the vocabulary.
        let spread = x.iter().fold(f32::MIN, |m, v| m.max(*v)) - x.iter().fold(f32::MAX, |m, v| m.min(*v));
        assert!(spread > 0.1, "{name}: flat logits");
    }
}

#[test]
fn llama_prefill_logits_agree() {
    check("st-eq-llama-prefill", &random_llama_config(), 1, 0);
}

#[test]
fn llama_prefill_then_decode_logits_agree() {
    check("st-eq-llama-decode", &random_llama_config(), 2, 1);
}

#[test]
fn qwen2_with_biases_agrees_over_several_decode_steps() {
    check("st-eq-qwen2", &random_qwen2_config(), 3, 3);
}

#[test]
fn the_comparison_sees_a_wrong_rope_layout() {
    // The GGUF copy read as if its rows were in HF order: the positions are rotated in
    // the wrong pairs, which must show up far above the tolerance. (Position 0 is not
    // rotated at all, so only longer prompts reveal it.)
    let dir = TempDir(scratch_dir("st-eq-wrong-rope").unwrap());
    let paths = write_random_llama(&dir.0, &random_llama_config(), 4).unwrap();
    let st = SafetensorsModel::open(&paths.safetensors_dir).unwrap();
    let st_model = Model::load(&st, ModelConfig::from_hf(st.hf_config()).unwrap()).unwrap();
    let gg = GgufFile::open(&paths.gguf_path).unwrap();
    let wrong = ModelConfig { rope_style: RopeStyle::Neox, ..ModelConfig::from_gguf(&gg.header).unwrap() };
    let gg_model = Model::load(&gg, wrong).unwrap();
    let p = prompts(st_model.cfg.vocab_size);
    let (a, b) = (run(&st_model, &p, 1), run(&gg_model, &p, 1));
    for (x, y) in a.iter().zip(&b) {
        let d = rel_diff(x, y);
        assert!(d > 100.0 * TOL, "a wrong RoPE layout went unnoticed: {d}");
    }
}

/// A GGUF copy in each quantized type (random blocks: random codes, sane scales) against
/// the safetensors copy holding exactly its dequantized values in F32, run through the
/// dense f32 kernel. The quantized path also quantizes activations to 8 bits per 32 and
/// stores folded scales as f16 (Q2_K, Q3_K, Q6_K are re-quantized to 8 bits per 32), so
/// the two differ by far more than [`TOL`]. Measured: 0.006–0.025 of the largest logit,
/// the same for Q8_0 (exact, and loaded for years) as for the new types, so `QTOL` is
/// twice the worst. A piece decoded in the wrong order moves logits by ~0.3 or more.
const QTOL: f32 = 0.05;

#[test]
fn quantized_gguf_matches_its_dequantized_values() {
    for (i, dtype) in DType::ALL.into_iter().filter(|t| t.is_quantized()).enumerate() {
        let opts = RandomModelOptions { seed: 40 + i as u64, dtype, tie_embeddings: i % 2 == 1 };
        let (_dir, st, gg) = both_with(&format!("st-eq-{}", dtype.name()), &random_llama_config_256(), &opts);
        let p = prompts(st.cfg.vocab_size);
        let (a, b) = (run(&st, &p, 1), run(&gg, &p, 1));
        for (step, (x, y)) in a.iter().zip(&b).enumerate() {
            let d = rel_diff(x, y);
            assert!(d <= QTOL, "{dtype:?}: step {step}: logits differ by {d} relative");
            let spread = x.iter().fold(f32::MIN, |m, v| m.max(*v)) - x.iter().fold(f32::MAX, |m, v| m.min(*v));
            assert!(spread > 0.1, "{dtype:?}: flat logits");
        }
    }
}
