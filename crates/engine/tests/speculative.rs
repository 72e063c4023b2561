//! Speculative decoding on the real model: whatever the engine drafts, verifies and
//! rolls back, every request's tokens, logprobs and top logprobs are bit for bit those
//! of plain decoding: greedy requests, and sampled requests with a seed (each emitted
//! token is the sample plain decoding draws, so the seed gives the same tokens), with
//! the measured verification rule and with every draft verified whole. The drafts must
//! actually be accepted and rejected for this to mean anything (checked where every
//! draft is verified: what the measured rule verifies follows step timings), and
//! every block comes back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{Engine, EngineConfig, SpecConfig, StepOutput};
use pdserve_engine::loader::{self, LoadedModel};
use pdserve_types::{RequestId, SamplingParams, TokenOut};
use std::collections::BTreeMap;
use std::sync::OnceLock;

fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| loader::load(&pdserve_engine::models::require_default_model()).unwrap())
}

/// Input-grounded prompts (the answer quotes the prompt, so drafts are often right)
/// and open-ended ones (drafts are rarely right).
const PROMPTS: [&str; 5] = [
    "Repeat the following code exactly.\n\ndef area(width, height):\n    \"\"\"Return the area of a rectangle.\"\"\"\n    return width * height\n\n\ndef perimeter(width, height):\n    \"\"\"Return the perimeter of a rectangle.\"\"\"\n    return 2 * (width + height)\n\nHere is the code repeated exactly:\n\ndef area(width, height):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Extract the name and the city as JSON.\nText: Maria Lopez moved from Lisbon to Porto in 2019 and now runs a bakery in Porto.\nJSON: {\"name\": \"",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Question: Why is the sky blue during the day? Answer:",
];

const GEN: u32 = 40;

fn params(i: usize) -> SamplingParams {
    // Every other request samples, with its own seed.
    let temperature = if i.is_multiple_of(2) { 0.0 } else { 0.8 };
    SamplingParams {
        max_tokens: GEN - i as u32 * 3,
        temperature,
        seed: Some(7 + i as u64),
        ignore_eos: true,
        logprobs: true,
        top_logprobs: 3,
        ..Default::default()
    }
    .validate()
    .unwrap()
}

fn engine(speculation: Option<SpecConfig>, max_batch_tokens: usize, num_blocks: usize) -> Engine {
    let m = model();
    let cfg = EngineConfig { threads: 1, num_blocks, max_batch_tokens, speculation, ..Default::default() };
    Engine::new(m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec())
}

/// Runs the prompts together to the end; each request's outputs, in order.
fn run(e: &mut Engine) -> BTreeMap<u64, Vec<TokenOut>> {
    for (i, text) in PROMPTS.iter().enumerate() {
        let tokens = model().tokenizer.encode_with_bos(text, false);
        e.add(RequestId(i as u64), tokens, params(i)).unwrap();
    }
    let mut out: BTreeMap<u64, Vec<TokenOut>> = BTreeMap::new();
    let mut steps = 0;
    while e.has_work() {
        for StepOutput { id, sampled, .. } in e.step() {
            out.entry(id.0).or_default().push(sampled);
        }
        steps += 1;
        assert!(steps < 10_000, "the engine does not make progress");
    }
    assert_eq!(e.stats().blocks.used, 0, "a block was not given back");
    for (i, got) in &out {
        assert_eq!(got.len(), params(*i as usize).max_tokens as usize, "request {i}");
    }
    out
}

fn plain() -> &'static BTreeMap<u64, Vec<TokenOut>> {
    static P: OnceLock<BTreeMap<u64, Vec<TokenOut>>> = OnceLock::new();
    P.get_or_init(|| run(&mut engine(None, 512, 256)))
}

fn assert_same(what: &str, want: &BTreeMap<u64, Vec<TokenOut>>, got: &BTreeMap<u64, Vec<TokenOut>>) {
    for (id, w) in want {
        let g = &got[id];
        let ids = |s: &[TokenOut]| s.iter().map(|x| x.token).collect::<Vec<_>>();
        assert_eq!(ids(w), ids(g), "{what}: request {id}'s tokens differ");
        let lps = |s: &[TokenOut]| s.iter().map(|x| (x.logprob, x.top.clone())).collect::<Vec<_>>();
        assert_eq!(lps(w), lps(g), "{what}: request {id}'s logprobs differ");
    }
}

#[test]
fn speculation_changes_no_token_and_no_logprob() {
    let want = plain();
    for max_draft in [1, 4, 8] {
        let mut e = engine(Some(SpecConfig { max_draft, verify_all: true }), 512, 256);
        let got = run(&mut e);
        assert_same(&format!("drafts of up to {max_draft}"), want, &got);
        let spec = e.stats().spec;
        assert!(spec.accepted > 0, "nothing accepted: {spec:?}");
        assert!(spec.accepted < spec.drafted, "nothing rejected: {spec:?}");
    }
    // The measured rule verifies what it finds worth it: the same output.
    let got = run(&mut engine(Some(SpecConfig { max_draft: 8, verify_all: false }), 512, 256));
    assert_same("the measured rule", want, &got);
}

#[test]
fn drafts_fit_a_tight_step_budget_and_a_small_pool() {
    // 6 tokens a step: prompts are chunked beside drafts, and drafts are cut to the
    // rows left. 24 blocks: sequences are preempted and recomputed while drafting.
    let mut e = engine(Some(SpecConfig { max_draft: 8, verify_all: true }), 6, 24);
    let got = run(&mut e);
    assert_same("tight budget and pool", plain(), &got);
    assert!(e.stats().spec.accepted > 0, "{:?}", e.stats().spec);
}

#[test]
fn input_grounded_requests_accept_most_drafts() {
    // The code to repeat is in the prompt: greedy output copies it, and the drafts
    // are that copy.
    let mut e = engine(Some(SpecConfig { max_draft: 8, verify_all: true }), 512, 256);
    let tokens = model().tokenizer.encode_with_bos(PROMPTS[0], false);
    e.add(RequestId(0), tokens, params(0)).unwrap();
    let mut steps = 0;
    let mut n = 0;
    while e.has_work() {
        n += e.step().len();
        steps += 1;
    }
    assert_eq!(n, GEN as usize);
    let spec = e.stats().spec;
    // One step prefilled; the other steps made more than a token each.
    assert!(steps - 1 < n * 2 / 3, "{steps} steps for {n} tokens: {spec:?}");
}
