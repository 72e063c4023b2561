//! Gemma 3 (the real 270M Q4_K_M file) through the same machinery as the Llama family:
//! a prompt's logits, tokens and logprobs are bit-for-bit the same whether it is
//! prefilled in one go or in chunks, batched with other sequences' prefills and
//! decodes, computed on one thread or two, found in the prefix cache, or prefilled on
//! one engine and continued on another from exported K/V. The prompts are the golden
//! file's (no tokenizer needed); the longest, 679 tokens, is past the 512-token sliding
//! window, so chunks straddle the window's edge.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{Engine, EngineConfig, KvFrame, StepOutput};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::format::gguf::GgufFile;
use pdserve_engine::kernels::Isa;
use pdserve_engine::kvcache::KvStorage;
use pdserve_engine::model::{ForwardScratch, Model, SeqBatch};
use pdserve_engine::threadpool::ThreadPool;
use pdserve_types::{RequestId, SamplingParams, TokenOut};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

const GEN: u32 = 12;
/// Gemma 3's end-of-sequence id (unused: every request ignores it).
const EOS: u32 = 1;

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| {
        let file = GgufFile::open(&pdserve_engine::models::require_known_model("gemma3-270m")).unwrap();
        let cfg = ModelConfig::from_gguf(&file.header).unwrap();
        Arc::new(Model::load(&file, cfg).unwrap())
    })
    .clone()
}

/// The golden prompts (BOS included), longest last.
fn prompts() -> &'static [Vec<u32>] {
    static P: OnceLock<Vec<Vec<u32>>> = OnceLock::new();
    P.get_or_init(|| {
        let text = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/gemma3-270m-q4_k_m.json"));
        let g: serde_json::Value = serde_json::from_str(text).unwrap();
        let mut p: Vec<Vec<u32>> = g["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect())
            .collect();
        p.sort_by_key(Vec::len);
        p
    })
}

fn long_prompt() -> &'static [u32] {
    let p = prompts().last().unwrap();
    assert!(p.len() > model().cfg.gemma3.as_ref().unwrap().sliding_window, "no prompt past the window");
    p
}

/// Runs `prompt` through `Model::forward` in chunks of the given sizes (the last one
/// repeats), then decodes `decode` tokens greedily; every logits row computed.
fn forward_chunked(prompt: &[u32], chunks: &[usize], decode: usize, threads: usize) -> Vec<Vec<f32>> {
    let m = model();
    let n_blocks = (prompt.len() + decode).div_ceil(16);
    let mut kv = KvStorage::new(&m.cfg, n_blocks, 16);
    // Blocks out of order, as a paged cache hands them out.
    let blocks: Vec<u32> = (0..n_blocks as u32).rev().collect();
    let pool = ThreadPool::new(threads);
    let mut s = ForwardScratch::default();
    let mut tokens = prompt.to_vec();
    let (mut pos, mut out) = (0, Vec::new());
    let mut sizes = chunks.iter().copied().chain(std::iter::repeat(*chunks.last().unwrap()));
    while pos < tokens.len() {
        let end = if pos < prompt.len() { (pos + sizes.next().unwrap()).min(prompt.len()) } else { tokens.len() };
        let b =
            SeqBatch { tokens: &tokens[pos..end], start_pos: pos, blocks: &blocks, logits: 1, score: None, pool: None };
        let logits = m.forward(Isa::detect(), &pool, &[b], &mut kv, &mut s, &mut |_, _| true).unwrap().to_vec();
        pos = end;
        if pos == tokens.len() && tokens.len() < prompt.len() + decode {
            let next = (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap() as u32;
            tokens.push(next);
        }
        out.push(logits);
    }
    out
}

#[test]
fn chunked_prefill_gives_the_logits_of_one_pass() {
    let p = long_prompt();
    let one = forward_chunked(p, &[p.len()], 3, 1);
    let one: Vec<&Vec<f32>> = one.iter().collect();
    // Chunks that end before, on and after the window's edge; two threads.
    for (chunks, threads) in [(&[512][..], 1), (&[100][..], 2), (&[7][..], 1), (&[300, 211, 1][..], 2)] {
        let chunked = forward_chunked(p, chunks, 3, threads);
        // The prompt's last logits, then three decode steps.
        let tail: Vec<&Vec<f32>> = chunked.iter().skip(chunked.len() - 4).collect();
        assert!(tail.iter().zip(&one).all(|(a, b)| a == b), "chunks {chunks:?} on {threads} threads");
    }
}

fn greedy() -> SamplingParams {
    SamplingParams { max_tokens: GEN, ignore_eos: true, logprobs: true, top_logprobs: 4, ..Default::default() }
        .validate()
        .unwrap()
}

fn engine(threads: usize, max_batch_tokens: usize) -> Engine {
    let cfg = EngineConfig {
        threads,
        num_blocks: 192,
        max_batch_tokens,
        max_seqs: 16,
        cache_salt: 3,
        objectives: None,
        ..Default::default()
    };
    Engine::new(model(), cfg, vec![EOS])
}

/// Steps `e` until idle: every request's outputs.
fn drain(e: &mut Engine) -> BTreeMap<u64, Vec<StepOutput>> {
    let mut out: BTreeMap<u64, Vec<StepOutput>> = BTreeMap::new();
    let mut steps = 0;
    while e.has_work() {
        for o in e.step() {
            out.entry(o.id.0).or_default().push(o);
        }
        steps += 1;
        assert!(steps < 10_000, "the engine does not make progress");
    }
    assert_eq!(e.stats().blocks.used, 0);
    out
}

fn sampled(outs: &[StepOutput]) -> Vec<TokenOut> {
    outs.iter().map(|o| o.sampled.clone()).collect()
}

/// Every prompt alone on a fresh engine, one thread.
fn alone() -> &'static Vec<Vec<TokenOut>> {
    static A: OnceLock<Vec<Vec<TokenOut>>> = OnceLock::new();
    A.get_or_init(|| {
        prompts()
            .iter()
            .map(|p| {
                let mut e = engine(1, 4096);
                e.add(RequestId(0), p.clone(), greedy()).unwrap();
                let out = sampled(&drain(&mut e)[&0]);
                assert_eq!(out.len(), GEN as usize);
                out
            })
            .collect()
    })
}

#[test]
fn batched_and_chunked_in_the_engine_matches_alone() {
    let want = alone();
    // 61 tokens a step: the long prompt takes a dozen steps, beside the others'
    // decodes; on two threads.
    let mut e = engine(2, 61);
    for (i, p) in prompts().iter().enumerate() {
        e.add(RequestId(i as u64), p.clone(), greedy()).unwrap();
    }
    let out = drain(&mut e);
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&sampled(&out[&(i as u64)]), w, "prompt {i} ({} tokens)", prompts()[i].len());
    }
}

#[test]
fn a_prefix_cache_hit_changes_nothing() {
    let p = long_prompt();
    let mut e = engine(1, 4096);
    e.add(RequestId(1), p.to_vec(), greedy()).unwrap();
    drain(&mut e);
    // Same prompt again: its full blocks come from the cache, the rest is computed.
    e.add(RequestId(2), p.to_vec(), greedy()).unwrap();
    let out = drain(&mut e);
    let again = &out[&2];
    assert_eq!(again[0].cached_tokens, p.len() / 16 * 16);
    assert_eq!(&sampled(again), alone().last().unwrap());
}

#[test]
fn exported_kv_continues_on_another_engine() {
    let p = long_prompt();
    let id = RequestId(7);
    // Prefill on P in chunks of 128 tokens, streaming its K/V.
    let mut pe = engine(1, 128);
    let mut frames: Vec<KvFrame> = Vec::new();
    let first = pe
        .prefill_export(id, p.to_vec(), greedy(), &mut |f| {
            frames.push(f);
            true
        })
        .unwrap();
    let cfg = &model().cfg;
    assert_eq!(frames.len(), cfg.n_layers * p.len().div_ceil(16), "every layer's blocks, the local ones too");
    let mut d = engine(1, 4096);
    d.reserve_import(id, p.len()).unwrap();
    for f in &frames {
        d.import_frame(id, f).unwrap();
    }
    d.finish_import(id, p.to_vec(), first.sampled.token, greedy()).unwrap();
    let rest = drain(&mut d);
    let got: Vec<TokenOut> = std::iter::once(first.sampled).chain(sampled(&rest[&id.0])).collect();
    assert_eq!(&got, alone().last().unwrap());
}
