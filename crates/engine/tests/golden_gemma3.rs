//! Gemma 3 270M (Q4_K_M) against llama.cpp's greedy outputs (llama.cpp via
//! llama-cpp-python 0.3.36, CPU, one thread; `golden/gemma3-270m-q4_k_m.json`).
//!
//! Each case is decoded feeding llama.cpp's own tokens back (so one disagreement does
//! not derail the steps after it). Up to and including the first step whose golden
//! margin (top-1 minus top-2 logprob) is below NEAR_TIE, our top token must be
//! llama.cpp's (at steps with a margin of at least NEAR_TIE) and the logprob we give
//! llama.cpp's token must be within LOGPROB_TOL of its own. One prompt (679 tokens)
//! is longer than the model's 512-token sliding window, so its local layers must
//! forget the start of the prompt as llama.cpp's do.
//!
//! Measured (every ISA gives the same bits): 69 steps are compared; on the 67 outside
//! KNOWN_DISAGREEMENTS our logprobs differ from llama.cpp's by at most 0.171 (mean
//! 0.031). For scale, an exact f32 forward pass of the same weights (every tensor
//! dequantized, no activation quantization, f32 attention) is up to 0.180 (mean 0.027)
//! away from llama.cpp on the same steps: the tolerance is set by llama.cpp's own
//! rounding as much as by ours.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::config::ModelConfig;
use pdserve_engine::format::gguf::GgufFile;
use pdserve_engine::kernels::Isa;
use pdserve_engine::kvcache::KvStorage;
use pdserve_engine::model::{ForwardScratch, Model, SeqBatch};
use pdserve_engine::threadpool::ThreadPool;
use serde_json::Value;

/// The golden file's own rule for this model (a 270M model has many near-ties).
const NEAR_TIE: f64 = 0.15;

/// Measured maximum 0.171 (see above); the exact f32 pass reaches 0.18.
const LOGPROB_TOL: f32 = 0.25;

/// Steps (prompt length, step) above NEAR_TIE where we do not pick llama.cpp's token,
/// with what was measured there:
///
/// - 11-token prompt, step 19: llama.cpp 24261 −1.435 over 13430 −1.647 (margin
///   0.21); ours 13430 −1.278 over 24261 −1.483; the exact f32 pass puts them at
///   −1.477 and −1.481, a tie (0.004) that either engine's rounding tips over.
/// - 679-token prompt, step 7: llama.cpp gives 8687 (" notes") −2.765 and 5028 −3.201
///   (margin 0.44); ours 5028 −3.102, 8687 −3.921; the exact f32 pass also ranks 5028
///   first (−3.125) and 8687 fourth (−3.696), while agreeing with llama.cpp within 0.1
///   on every other top-5 token of that step and on the steps around it. Varying the
///   window by one either way, keeping position 0 visible to local layers, or rounding
///   K, V, queries and attention weights to f16 as llama.cpp does moves 8687 by under
///   0.05: llama.cpp's value there is not reproduced by any exact computation we tried.
///
/// At these steps our top token must be in llama.cpp's top five, and our logprob of
/// llama.cpp's token within KNOWN_TOL.
const KNOWN_DISAGREEMENTS: [(usize, usize); 2] = [(11, 19), (679, 7)];
const KNOWN_TOL: f32 = 1.25;

fn golden() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/gemma3-270m-q4_k_m.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().cloned().fold(f32::MIN, f32::max);
    let z: f32 = logits.iter().map(|x| (x - m).exp()).sum::<f32>().ln() + m;
    logits.iter().map(|x| x - z).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn gemma3_greedy_matches_llama_cpp() {
    let file = GgufFile::open(&pdserve_engine::models::require_known_model("gemma3-270m")).unwrap();
    let cfg = ModelConfig::from_gguf(&file.header).unwrap();
    let window = cfg.gemma3.as_ref().unwrap().sliding_window;
    let model = Model::load(&file, cfg.clone()).unwrap();
    let pool = ThreadPool::new(2);
    let isa = Isa::detect();
    let g = golden();
    let (mut worst, mut compared, mut long_prompt_compared) = (0f32, 0, 0);
    for case in g["greedy"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let golden_ids = ids(&case["ids"]);
        let steps = case["steps"].as_array().unwrap();
        let last = steps.iter().position(|s| s["margin"].as_f64().unwrap() < NEAR_TIE).unwrap_or(steps.len() - 1);
        let n_blocks = (prompt.len() + steps.len()).div_ceil(16);
        let mut kv = KvStorage::new(&cfg, n_blocks, 16);
        let blocks: Vec<u32> = (0..n_blocks as u32).collect();
        let mut s = ForwardScratch::default();
        let mut tokens = prompt.clone();
        let mut pos = 0;
        for (i, step) in steps.iter().enumerate().take(last + 1) {
            let b = SeqBatch::plain(&tokens[pos..], pos, &blocks, 1);
            let logits = model.forward(isa, &pool, &[b], &mut kv, &mut s, &mut |_, _| true).unwrap().to_vec();
            pos = tokens.len();
            let lp = log_softmax(&logits);
            let want = step["id"].as_u64().unwrap() as u32;
            assert_eq!(want, golden_ids[i]);
            let got = (0..lp.len()).max_by(|&a, &b| lp[a].total_cmp(&lp[b]).then(b.cmp(&a))).unwrap() as u32;
            let want_lp = step["top"][0]["logprob"].as_f64().unwrap() as f32;
            let margin = step["margin"].as_f64().unwrap();
            let diff = (lp[want as usize] - want_lp).abs();
            let what = format!("{}-token prompt, step {i}", prompt.len());
            eprintln!(
                "{what}: ours {got} llama.cpp {want}, logprob {} vs {want_lp} (margin {margin:.3})",
                lp[want as usize]
            );
            if KNOWN_DISAGREEMENTS.contains(&(prompt.len(), i)) {
                let top: Vec<u32> =
                    step["top"].as_array().unwrap().iter().map(|e| e["id"].as_u64().unwrap() as u32).collect();
                assert!(top.contains(&got), "{what}: our token {got} is not in llama.cpp's top five {top:?}");
                assert!(diff < KNOWN_TOL, "{what}: logprob {} vs {want_lp}", lp[want as usize]);
            } else {
                worst = worst.max(diff);
                assert!(diff < LOGPROB_TOL, "{what}: logprob {} vs {want_lp}", lp[want as usize]);
                if margin >= NEAR_TIE {
                    assert_eq!(got, want, "{what}: margin {margin:.3}");
                }
            }
            compared += 1;
            if prompt.len() > window {
                long_prompt_compared += 1;
            }
            tokens.push(want);
        }
    }
    eprintln!("{compared} steps compared; largest logprob difference {worst:.4}");
    assert!(long_prompt_compared > 8, "the prompt longer than the sliding window was not compared");
}

/// The hyper-parameters read from the file's `gemma3.*` metadata, and the ones
/// llama.cpp fixes for Gemma 3 (local RoPE base, layer pattern, query scale).
#[test]
fn the_file_reads_as_gemma3_270m() {
    let file = GgufFile::open(&pdserve_engine::models::require_known_model("gemma3-270m")).unwrap();
    let cfg = ModelConfig::from_gguf(&file.header).unwrap();
    assert_eq!(cfg.arch, pdserve_engine::config::Architecture::GEMMA3);
    assert_eq!(cfg.rope_style, pdserve_engine::config::RopeStyle::Neox);
    let dims = (cfg.n_layers, cfg.hidden, cfg.ffn_hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size);
    assert_eq!(dims, (18, 640, 2048, 4, 1, 256, 262_144));
    assert_eq!((cfg.rms_eps, cfg.rope_theta), (1e-6, 1e6));
    let g = cfg.gemma3.as_ref().unwrap();
    assert_eq!((g.sliding_window, g.rope_theta_local, g.rope_scale_global), (512, 10_000.0, 1.0));
    assert_eq!((g.query_scale, g.final_logit_softcap), (1.0 / 16.0, None));
    let global: Vec<usize> = (0..cfg.n_layers).filter(|&l| g.is_global(l)).collect();
    assert_eq!(global, [5, 11, 17]);
}
