//! Batch invariance of the engine on the real model: a prompt's greedy tokens and the
//! logprobs reported for them are bit-for-bit the same whether the request runs alone,
//! batched with other requests, prefilled in small chunks interleaved with other
//! sequences' decodes, or on one compute thread instead of two.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{Engine, EngineConfig, StepOutput};
use pdserve_engine::loader::{self, LoadedModel};
use pdserve_types::TokenOut;
use pdserve_types::{RequestId, SamplingParams};
use std::collections::BTreeMap;
use std::sync::OnceLock;

const GEN: u32 = 24;

fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| loader::load(&pdserve_engine::models::require_default_model()).unwrap())
}

/// The four prompts under test, 20 to 120 tokens each.
const TARGETS: [&str; 4] = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable metal type with an oil-based ink.",
    "Here is a short recipe for bread. Mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes until it is smooth and elastic, then let it rise in a warm place for about an hour. Shape it into a loaf, let it rise again, and bake it in a hot oven until the crust is golden brown and the loaf sounds hollow when tapped. The",
    "Question: Why is the sky blue during the day, and why does it turn red and orange at sunset? Explain it simply. Answer:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return b\n\n\ndef factorial(n):\n    \"\"\"Return n factorial.\"\"\"\n",
];

/// Other traffic sharing the batch: different lengths, stopping at different times.
const OTHERS: [&str; 5] = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three facts about the planet Mars:\n1.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In mathematics, a prime number is a natural number greater than 1 that is not a product of two smaller natural numbers. The first few primes are",
    "Translate to French: Good morning, how are you today?",
];

fn tokens(text: &str) -> Vec<u32> {
    model().tokenizer.encode_with_bos(text, false)
}

fn greedy() -> SamplingParams {
    SamplingParams { max_tokens: GEN, ignore_eos: true, logprobs: true, top_logprobs: 5, ..Default::default() }
        .validate()
        .unwrap()
}

/// Distractor `i`: varied lengths and sampling, so the batch changes shape over time.
fn other_params(i: usize) -> SamplingParams {
    let max_tokens = [5, 20, 13, 24, 2][i % 5];
    let temperature = if i.is_multiple_of(2) { 0.0 } else { 0.9 };
    SamplingParams { max_tokens, temperature, seed: Some(i as u64), ignore_eos: true, ..Default::default() }
        .validate()
        .unwrap()
}

fn engine(threads: usize, max_batch_tokens: usize) -> Engine {
    let m = model();
    let cfg = EngineConfig {
        threads,
        num_blocks: 256,
        max_batch_tokens,
        max_seqs: 64,
        cache_salt: 0,
        objectives: None,
        ..Default::default()
    };
    Engine::new(m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec())
}

/// Outputs per request id, and the step at which each request sampled its first token.
type Run = (BTreeMap<u64, Vec<TokenOut>>, BTreeMap<u64, usize>);

/// Runs every request queued on `e` to the end.
fn drain(e: &mut Engine) -> Run {
    let mut out: BTreeMap<u64, Vec<TokenOut>> = BTreeMap::new();
    let mut first = BTreeMap::new();
    let mut steps = 0;
    while e.has_work() {
        for StepOutput { id, sampled, .. } in e.step() {
            first.entry(id.0).or_insert(steps);
            out.entry(id.0).or_default().push(sampled);
        }
        steps += 1;
        assert!(steps < 10_000, "the engine does not make progress");
    }
    assert_eq!(e.stats().blocks.used, 0);
    (out, first)
}

/// Target `i` alone on a fresh engine.
fn alone(i: usize, threads: usize) -> Vec<TokenOut> {
    let mut e = engine(threads, 512);
    e.add(RequestId(i as u64), tokens(TARGETS[i]), greedy()).unwrap();
    let (mut out, _) = drain(&mut e);
    assert_eq!(out.len(), 1);
    out.remove(&(i as u64)).unwrap()
}

/// All targets and the distractors added before the first step; ids 0..4 are the
/// targets, 100.. the distractors.
fn together(threads: usize, max_batch_tokens: usize) -> Run {
    let mut e = engine(threads, max_batch_tokens);
    for (i, text) in OTHERS.iter().enumerate().take(2) {
        e.add(RequestId(100 + i as u64), tokens(text), other_params(i)).unwrap();
    }
    for (i, text) in TARGETS.iter().enumerate() {
        e.add(RequestId(i as u64), tokens(text), greedy()).unwrap();
    }
    for (i, text) in OTHERS.iter().enumerate().skip(2) {
        e.add(RequestId(100 + i as u64), tokens(text), other_params(i)).unwrap();
    }
    let run = drain(&mut e);
    for (i, _) in OTHERS.iter().enumerate() {
        assert_eq!(run.0[&(100 + i as u64)].len(), other_params(i).max_tokens as usize);
    }
    run
}

fn assert_same(what: &str, want: &[TokenOut], got: &[TokenOut]) {
    let ids = |s: &[TokenOut]| s.iter().map(|x| x.token).collect::<Vec<_>>();
    let lps = |s: &[TokenOut]| s.iter().map(|x| x.logprob).collect::<Vec<_>>();
    let tops = |s: &[TokenOut]| s.iter().map(|x| x.top.clone()).collect::<Vec<_>>();
    assert_eq!(ids(want), ids(got), "{what}: tokens differ");
    assert_eq!(lps(want), lps(got), "{what}: logprobs differ");
    assert_eq!(tops(want), tops(got), "{what}: top logprobs differ");
}

fn baseline() -> &'static Vec<Vec<TokenOut>> {
    static B: OnceLock<Vec<Vec<TokenOut>>> = OnceLock::new();
    B.get_or_init(|| {
        (0..TARGETS.len())
            .map(|i| {
                let out = alone(i, 1);
                assert_eq!(out.len(), GEN as usize);
                out
            })
            .collect()
    })
}

#[test]
fn prompts_are_the_sizes_under_test() {
    for t in TARGETS {
        let n = tokens(t).len();
        assert!((20..=120).contains(&n), "{n} tokens: {t:?}");
    }
    // The prompts differ, and so do their continuations (the comparison is not trivial).
    let b = baseline();
    let continuations: Vec<Vec<u32>> = b.iter().map(|out| out.iter().map(|s| s.token).collect()).collect();
    for (i, x) in continuations.iter().enumerate() {
        assert!(continuations[i + 1..].iter().all(|y| x != y), "{continuations:?}");
    }
}

#[test]
fn batched_with_others_matches_alone() {
    let b = baseline();
    let (out, first) = together(1, 4096);
    // Everyone was admitted and prefilled in the first step.
    assert!(first.values().all(|&s| s == 0), "{first:?}");
    for (i, want) in b.iter().enumerate() {
        assert_same(&format!("target {i} batched"), want, &out[&(i as u64)]);
    }
}

#[test]
fn chunked_prefill_mixed_with_decodes_matches_alone() {
    let b = baseline();
    // 7 tokens a step: every prompt is split over many steps, and once the first
    // distractors decode, each step mixes their decodes with prefill chunks.
    let (out, first) = together(1, 7);
    for (i, want) in b.iter().enumerate() {
        assert_same(&format!("target {i} chunked"), want, &out[&(i as u64)]);
        // Its prompt took many steps, while the first distractor was already decoding.
        let n = tokens(TARGETS[i]).len();
        assert!(first[&(i as u64)] >= n / 7, "{first:?}");
        assert!(first[&100] < first[&(i as u64)], "{first:?}");
    }
}

#[test]
fn two_threads_match_one() {
    // The baseline ran on one thread. Two threads split every matmul, norm and
    // attention differently; alone and batched must still match it bit for bit.
    let b = baseline();
    assert_same("target 1 alone on two threads", &b[1], &alone(1, 2));
    let (out, _) = together(2, 4096);
    for (i, want) in b.iter().enumerate() {
        assert_same(&format!("target {i} batched on two threads"), want, &out[&(i as u64)]);
    }
}

/// The planner's prefill pace comes from the steps that computed prompt tokens only:
/// a prompt run alone in 32-token chunks counts each chunk there, every prompt token
/// once, and its decode steps apart.
#[test]
fn prefill_only_steps_are_counted_apart_from_decode_steps() {
    let mut e = engine(1, 32);
    let prompt = tokens(TARGETS[1]);
    e.add(RequestId(0), prompt.clone(), greedy()).unwrap();
    drain(&mut e);
    let s = e.stats();
    assert_eq!(s.prefill_steps.tokens, prompt.len() as u64);
    assert_eq!(s.prefill_steps.steps, prompt.len().div_ceil(32) as u64);
    assert_eq!(s.decode_steps.steps, u64::from(GEN) - 1);
    assert!(s.prefill_steps.fit().is_some_and(|(fixed, per_token)| fixed >= 0.0 && per_token > 0.0));
}
