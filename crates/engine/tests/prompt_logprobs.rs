//! Prompt scoring on the real model: a prompt token's logprob given the tokens before
//! it is what generation reports for that same token at that same position, exactly,
//! whatever the chunking or the batch; and scoring reuses no cached prefix.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{Engine, EngineConfig, StepOutput};
use pdserve_engine::loader::{self, LoadedModel};
use pdserve_types::{RequestId, SamplingParams, TokenOut};
use std::sync::OnceLock;

fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| loader::load(&pdserve_engine::models::require_default_model()).unwrap())
}

fn engine(max_batch_tokens: usize) -> Engine {
    let m = model();
    let cfg = EngineConfig {
        threads: 1,
        num_blocks: 256,
        max_batch_tokens,
        max_seqs: 8,
        cache_salt: 0,
        objectives: None,
        ..Default::default()
    };
    Engine::new(m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec())
}

fn params(max_tokens: u32, prompt_logprobs: Option<u32>) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        logprobs: true,
        top_logprobs: 3,
        prompt_logprobs,
        ..Default::default()
    }
    .validate()
    .unwrap()
}

/// Runs requests to the end; every output per request, in order.
fn run(e: &mut Engine, reqs: Vec<(u64, Vec<u32>, SamplingParams)>) -> Vec<Vec<StepOutput>> {
    let ids: Vec<u64> = reqs.iter().map(|r| r.0).collect();
    for (id, prompt, p) in reqs {
        e.add(RequestId(id), prompt, p).unwrap();
    }
    let mut out: Vec<Vec<StepOutput>> = ids.iter().map(|_| Vec::new()).collect();
    while e.has_work() {
        for o in e.step() {
            let i = ids.iter().position(|&id| RequestId(id) == o.id).unwrap();
            out[i].push(o);
        }
    }
    out
}

fn prompt() -> Vec<u32> {
    model()
        .tokenizer
        .encode_with_bos("Once upon a time, in a village by the sea, there lived an old fisherman who", false)
}

#[test]
fn prompt_scores_equal_the_logprobs_generation_reported() {
    let p = prompt();
    // Generate 12 tokens, then score prompt + those tokens as one prompt.
    let gen = run(&mut engine(512), vec![(1, p.clone(), params(12, None))]).remove(0);
    let generated: Vec<TokenOut> = gen.iter().map(|o| o.sampled.clone()).collect();
    let mut whole = p.clone();
    whole.extend(generated.iter().map(|t| t.token));
    for chunk in [512, 7] {
        let scored = run(&mut engine(chunk), vec![(2, whole.clone(), params(1, Some(3)))]).remove(0);
        let scores = scored[0].prompt_logprobs.clone().expect("prompt logprobs with the first token");
        assert_eq!(scores.len(), whole.len() - 1, "one score per prompt token after the first");
        assert!(scored.iter().skip(1).all(|o| o.prompt_logprobs.is_none()));
        for (i, t) in scores.iter().enumerate() {
            assert_eq!(t.token, whole[i + 1]);
            assert!(t.logprob <= 0.0 && t.top.len() == 3);
        }
        let tail = &scores[p.len() - 1..];
        for (s, g) in tail.iter().zip(&generated) {
            assert_eq!((s.token, s.logprob, &s.top), (g.token, g.logprob, &g.top), "chunk {chunk}");
        }
    }
}

#[test]
fn scores_do_not_depend_on_the_batch_and_skip_the_prefix_cache() {
    let p = prompt();
    let alone = run(&mut engine(512), vec![(1, p.clone(), params(2, Some(0)))]).remove(0);
    let want = alone[0].prompt_logprobs.clone().unwrap();
    // Batched with a longer request, on an engine whose cache already holds the prompt.
    let mut e = engine(64);
    run(&mut e, vec![(5, p.clone(), params(2, None))]);
    let other: Vec<u32> = (0..100).map(|i| 1000 + i * 13).collect();
    let got = run(&mut e, vec![(6, other, params(3, None)), (7, p.clone(), params(2, Some(0)))]).remove(1);
    assert_eq!(got[0].cached_tokens, 0, "a scored prompt is computed in full");
    assert_eq!(got[0].prompt_logprobs.clone().unwrap(), want);
}
