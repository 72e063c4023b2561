//! Speculative decoding on the real model: whatever the engine drafts, verifies and
//! rolls back, every request's tokens, logprobs and top logprobs are bit for bit those
//! of plain decoding: greedy requests, and sampled requests with a seed (each emitted
//! token is the sample plain decoding draws, so the seed gives the same tokens), with
//! the measured verification rule and with every draft verified whole. The drafts must
//! actually be accepted and rejected for this to mean anything (checked where every
//! draft is verified: what the measured rule verifies follows step timings), and
//! every block comes back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{DraftModel, Engine, EngineConfig, EngineError, SpecConfig, StepOutput};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::format::gguf::GgufFile;
use pdserve_engine::loader::{self, LoadedModel};
use pdserve_engine::model::Model;
use pdserve_engine::testing::{random_llama_config, scratch_dir, write_random_llama};
use pdserve_types::{DraftRecord, KvFrame, RequestId, SamplingParams, TokenOut};
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
        let mut e = engine(Some(SpecConfig { max_draft, verify_all: true, draft: None }), 512, 256);
        let got = run(&mut e);
        assert_same(&format!("drafts of up to {max_draft}"), want, &got);
        let spec = e.stats().spec;
        assert!(spec.accepted > 0, "nothing accepted: {spec:?}");
        assert!(spec.accepted < spec.drafted, "nothing rejected: {spec:?}");
    }
    // The measured rule verifies what it finds worth it: the same output.
    let got = run(&mut engine(Some(SpecConfig { max_draft: 8, verify_all: false, draft: None }), 512, 256));
    assert_same("the measured rule", want, &got);
}

#[test]
fn drafts_fit_a_tight_step_budget_and_a_small_pool() {
    // 6 tokens a step: prompts are chunked beside drafts, and drafts are cut to the
    // rows left. 24 blocks: sequences are preempted and recomputed while drafting.
    let mut e = engine(Some(SpecConfig { max_draft: 8, verify_all: true, draft: None }), 6, 24);
    let got = run(&mut e);
    assert_same("tight budget and pool", plain(), &got);
    assert!(e.stats().spec.accepted > 0, "{:?}", e.stats().spec);
}

#[test]
fn input_grounded_requests_accept_most_drafts() {
    // The code to repeat is in the prompt: greedy output copies it, and the drafts
    // are that copy.
    let mut e = engine(Some(SpecConfig { max_draft: 8, verify_all: true, draft: None }), 512, 256);
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

/// The default model drafting for itself: its greedy drafts are what greedy requests
/// sample (the numerics do not depend on the batch), so most drafts are kept.
fn self_draft() -> DraftModel {
    DraftModel::new(model().model.clone(), "self", &model().model).unwrap()
}

/// A random two-layer model of the default model's vocabulary: its drafts are
/// almost all rejected.
fn random_draft() -> DraftModel {
    static D: OnceLock<DraftModel> = OnceLock::new();
    D.get_or_init(|| {
        let target = &model().model;
        let cfg = ModelConfig { vocab_size: target.cfg.vocab_size, context_length: 1024, ..random_llama_config() };
        let dir = scratch_dir("spec-random-draft").unwrap();
        let gguf = GgufFile::open(&write_random_llama(&dir, &cfg, 11).unwrap().gguf_path).unwrap();
        let draft = Model::load(&gguf, ModelConfig::from_gguf(&gguf.header).unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        DraftModel::new(std::sync::Arc::new(draft), "random", target).unwrap()
    })
    .clone()
}

fn drafting(draft: DraftModel, max_draft: usize, verify_all: bool) -> Option<SpecConfig> {
    Some(SpecConfig { max_draft, verify_all, draft: Some(draft) })
}

#[test]
fn a_draft_model_changes_no_token_and_no_logprob() {
    let want = plain();
    for (name, draft) in [("itself", self_draft()), ("a random model", random_draft())] {
        for max_draft in [1, 5] {
            let mut e = engine(drafting(draft.clone(), max_draft, true), 512, 256);
            let got = run(&mut e);
            assert_same(&format!("{name}, drafts of up to {max_draft}"), want, &got);
            let stats = e.stats();
            assert!(stats.spec.accepted < stats.spec.drafted, "{name}: nothing rejected: {:?}", stats.spec);
            assert_eq!(stats.draft_blocks.unwrap().used, 0, "{name}: a draft block was not given back");
            if name == "itself" {
                // The greedy half of the requests keeps every draft.
                assert!(2 * stats.spec.accepted > stats.spec.drafted, "{name}: {:?}", stats.spec);
            }
        }
    }
    let got = run(&mut engine(drafting(random_draft(), 8, false), 512, 256));
    assert_same("a random model, the measured rule", want, &got);
}

#[test]
fn a_draft_model_fits_a_tight_step_budget_and_a_small_pool() {
    // 6 tokens a step: the draft model catches up on a prompt over several steps.
    // 24 blocks: preempted sequences drop their draft K/V and draft again.
    let mut e = engine(drafting(self_draft(), 4, true), 6, 24);
    let got = run(&mut e);
    assert_same("tight budget and pool", plain(), &got);
    let stats = e.stats();
    assert!(stats.spec.accepted > 0, "{:?}", stats.spec);
    assert_eq!(stats.draft_blocks.unwrap().used, 0);
}

#[test]
fn a_vocabulary_of_another_size_is_refused() {
    let cfg = random_llama_config();
    let dir = scratch_dir("spec-small-vocab").unwrap();
    let gguf = GgufFile::open(&write_random_llama(&dir, &cfg, 3).unwrap().gguf_path).unwrap();
    let draft = Model::load(&gguf, ModelConfig::from_gguf(&gguf.header).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let err = DraftModel::new(std::sync::Arc::new(draft), "other", &model().model).unwrap_err();
    assert!(err.contains("96 tokens") && err.contains("49152"), "{err}");
}

#[test]
fn a_prompt_sent_again_finds_its_draft_blocks_cached() {
    let mut e = engine(drafting(self_draft(), 4, true), 512, 256);
    let tokens = model().tokenizer.encode_with_bos(PROMPTS[0], false);
    let mut outs = Vec::new();
    for id in 0..3 {
        if id == 2 {
            // The target's cache forgets the prompt, the draft pool's keeps it: the
            // draft model starts ahead of the target, and nothing changes.
            e.evict_cached();
        }
        e.add(RequestId(id), tokens.clone(), params(0)).unwrap();
        let mut got = Vec::new();
        while e.has_work() {
            got.extend(e.step().into_iter().map(|o| o.sampled.token));
        }
        outs.push(got);
        let draft = e.stats().draft_blocks.unwrap();
        // The prompt's and the accepted output's full blocks, in the draft pool's
        // prefix cache as in the target's.
        assert!(draft.cached >= tokens.len() / 16, "{draft:?}");
        assert_eq!(draft.used, 0);
    }
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0], outs[2]);
    assert_eq!(outs[0], plain()[&0].iter().map(|t| t.token).collect::<Vec<_>>());
}

#[test]
fn a_request_drafts_what_an_earlier_one_said_after_the_same_words() {
    // The first request's prompt holds the code; the second's only its first line,
    // so its own tokens have nothing to look up and its drafts come from the
    // worker's pool of what earlier requests said.
    let first = PROMPTS[0];
    let second = "Write a Python function.\n\ndef area(width, height):\n";
    let greedy = SamplingParams { max_tokens: 24, ignore_eos: true, ..Default::default() }.validate().unwrap();
    let alone = |e: &mut Engine, id: u64, text: &str| {
        e.add(RequestId(id), model().tokenizer.encode_with_bos(text, false), greedy.clone()).unwrap();
        let mut got = Vec::new();
        while e.has_work() {
            got.extend(e.step().into_iter().map(|o| o.sampled.token));
        }
        got
    };
    let want = alone(&mut engine(None, 512, 256), 1, second);
    let ngram = || engine(Some(SpecConfig { max_draft: 8, verify_all: true, draft: None }), 512, 256);
    // Alone, it drafts from its own tokens only.
    let mut own = ngram();
    assert_eq!(alone(&mut own, 1, second), want);
    let own = own.stats().spec.accepted;
    let mut e = ngram();
    alone(&mut e, 0, first);
    let before = e.stats().spec;
    assert_eq!(alone(&mut e, 1, second), want);
    let pooled = e.stats().spec.accepted - before.accepted;
    assert!(pooled > own, "{pooled} drafted tokens accepted after the first request, {own} alone");
}

/// Prefills each prompt on `p` for a decode engine `d` (frames through `pass`), then
/// decodes them all together on `d`: each request's outputs.
fn handed_off(p: &mut Engine, d: &mut Engine, pass: &mut dyn FnMut(&KvFrame) -> bool) -> BTreeMap<u64, Vec<TokenOut>> {
    let mut out: BTreeMap<u64, Vec<TokenOut>> = BTreeMap::new();
    for (i, text) in PROMPTS.iter().enumerate() {
        let (id, tokens) = (RequestId(i as u64), model().tokenizer.encode_with_bos(text, false));
        let mut frames = Vec::new();
        let first = p
            .prefill_export(id, tokens.clone(), params(i), &mut |f| {
                frames.push(f);
                true
            })
            .unwrap();
        d.reserve_import(id, tokens.len()).unwrap();
        for f in frames.iter().filter(|f| pass(f)) {
            d.import_frame(id, f).unwrap();
        }
        assert!(d.finish_import(id, tokens, first.sampled.token, params(i)).unwrap());
        out.insert(id.0, vec![first.sampled]);
    }
    while d.has_work() {
        for StepOutput { id, sampled, .. } in d.step() {
            out.entry(id.0).or_default().push(sampled);
        }
    }
    for e in [p, d] {
        let s = e.stats();
        assert_eq!((s.blocks.used, s.draft_blocks.unwrap().used), (0, 0), "a block was not given back");
    }
    out
}

fn prompt_tokens() -> u64 {
    PROMPTS.iter().map(|t| model().tokenizer.encode_with_bos(t, false).len() as u64).sum()
}

#[test]
fn the_draft_kv_goes_with_the_target_kv_across_the_handoff() {
    let target_layers = model().model.cfg.n_layers as u32;
    // 16 tokens a step: the draft model cannot keep up with the prompt's chunks
    // beside the target and finishes it before the export.
    for (name, draft, budget) in [
        ("itself", self_draft(), 512),
        ("a random model", random_draft(), 512),
        ("itself, 16-token steps", self_draft(), 16),
    ] {
        let draft_layers = draft.model().cfg.n_layers as u32;
        let (mut p, mut d) =
            (engine(drafting(draft.clone(), 4, true), budget, 256), engine(drafting(draft, 4, true), 512, 256));
        let mut draft_frames = Vec::new();
        let got = handed_off(&mut p, &mut d, &mut |f| {
            if f.layer >= target_layers {
                draft_frames.push((f.layer, f.index));
            }
            true
        });
        assert_same(name, plain(), &got);
        // Every block of every prompt, in each of the draft model's layers.
        let blocks: u32 =
            PROMPTS.iter().map(|t| model().tokenizer.encode_with_bos(t, false).len().div_ceil(16) as u32).sum();
        assert_eq!(draft_frames.len() as u32, blocks * draft_layers, "{name}");
        assert!(draft_frames.iter().all(|&(l, _)| l < target_layers + draft_layers), "{name}");
        // The prefill engine computed each prompt once in the draft model; the decode
        // engine none of it, and drafted.
        assert_eq!(p.stats().spec.draft_prompt_tokens, prompt_tokens(), "{name}");
        assert_eq!(p.take_draft_shipped() as u64, prompt_tokens(), "{name}: the draft K/V its worker reports sent");
        let spec = d.stats().spec;
        assert_eq!(spec.draft_prompt_tokens, 0, "{name}: the decode engine computed the prompt again");
        assert!(spec.drafted > 0, "{name}: {spec:?}");
    }
}

#[test]
fn a_draft_kv_that_did_not_all_arrive_is_computed_again() {
    let target_layers = model().model.cfg.n_layers as u32;
    let (mut p, mut d) =
        (engine(drafting(self_draft(), 4, true), 512, 256), engine(drafting(self_draft(), 4, true), 512, 256));
    // The last draft layer's frames are lost: the decode engine gives those blocks
    // back and computes the prompts in the draft model itself.
    let last = target_layers + self_draft().model().cfg.n_layers as u32 - 1;
    let got = handed_off(&mut p, &mut d, &mut |f| f.layer != last);
    assert_same("draft frames lost", plain(), &got);
    assert_eq!(d.stats().spec.draft_prompt_tokens, prompt_tokens());
    assert!(d.stats().spec.accepted > 0);
}

#[test]
fn draft_frames_a_decode_engine_cannot_place_are_refused() {
    let target_layers = model().model.cfg.n_layers;
    let draft_layers = self_draft().model().cfg.n_layers;
    let tokens = model().tokenizer.encode_with_bos(PROMPTS[3], false);
    let mut p = engine(drafting(self_draft(), 4, true), 512, 256);
    let mut frames = Vec::new();
    p.prefill_export(RequestId(1), tokens.clone(), params(0), &mut |f| {
        frames.push(f);
        true
    })
    .unwrap();
    let draft_frame = frames.iter().find(|f| f.layer as usize == target_layers).unwrap().clone();
    let cases = [
        ("an engine without a draft model", engine(None, 512, 256), draft_frame.clone()),
        (
            "a layer past the draft model's",
            engine(drafting(self_draft(), 4, true), 512, 256),
            KvFrame { layer: (target_layers + draft_layers) as u32, ..draft_frame.clone() },
        ),
        (
            "a block past the prompt's",
            engine(drafting(self_draft(), 4, true), 512, 256),
            KvFrame { index: tokens.len().div_ceil(16) as u32, ..draft_frame.clone() },
        ),
        (
            "a frame of another size",
            engine(drafting(self_draft(), 4, true), 512, 256),
            KvFrame { k: vec![0; 3], ..draft_frame.clone() },
        ),
    ];
    for (what, mut d, frame) in cases {
        d.reserve_import(RequestId(1), tokens.len()).unwrap();
        let err = d.import_frame(RequestId(1), &frame).unwrap_err();
        assert!(matches!(err, EngineError::BadFrame(_)), "{what}: {err}");
        d.abort_import(RequestId(1));
        let s = d.stats();
        assert_eq!((s.blocks.used, s.draft_blocks.map_or(0, |b| b.used)), (0, 0), "{what}");
    }
}

#[test]
fn the_draft_model_follows_a_prompt_computed_in_its_first_step() {
    // A prompt admitted and computed whole in one step: the draft model computes it
    // in that step too, not in the first decode step (which would hold up every
    // other sequence's decode for a prefill).
    let mut e = engine(drafting(self_draft(), 4, true), 512, 256);
    let tokens = model().tokenizer.encode_with_bos(PROMPTS[0], false);
    e.add(RequestId(0), tokens.clone(), params(0)).unwrap();
    assert_eq!(e.step().len(), 1, "the prompt in one step");
    assert_eq!(e.stats().spec.draft_prompt_tokens, tokens.len() as u64);
}

/// Greedy, `max_tokens` of them whatever the model says.
fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, ..Default::default() }.validate().unwrap()
}

/// Runs `tokens` greedily on `e` with nothing beside it: the tokens it generates.
fn alone(e: &mut Engine, id: u64, tokens: Vec<u32>, max_tokens: u32) -> Vec<u32> {
    e.add(RequestId(id), tokens, greedy(max_tokens)).unwrap();
    let mut got = Vec::new();
    while e.has_work() {
        got.extend(e.step().into_iter().map(|o| o.sampled.token));
    }
    got
}

#[test]
fn a_long_prompt_for_a_short_answer_drafts_by_lookup_once_the_costs_are_measured() {
    // The measured rule. A first request times what the decision weighs: the draft
    // model's prompt, its passes, and decode steps of two sizes.
    let mut e = engine(drafting(self_draft(), 4, false), 512, 256);
    let first = model().tokenizer.encode_with_bos(PROMPTS[1], false);
    alone(&mut e, 0, first.clone(), 32);
    let followed = e.stats().spec.draft_prompt_tokens;
    assert!(followed >= first.len() as u64 - 1, "the first prompt was not followed: {followed}");
    // A long prompt for two tokens: what drafts could save on them is less than
    // the draft model's compute of the prompt, so it drafts by lookup, the draft
    // model computes none of it, and the output is plain decoding's.
    let long = model().tokenizer.encode_with_bos(&PROMPTS[0].repeat(3), false);
    let got = alone(&mut e, 1, long.clone(), 2);
    assert_eq!(e.stats().spec.draft_prompt_tokens, followed, "the draft model computed the long prompt");
    assert_eq!(got, alone(&mut engine(None, 512, 256), 1, long, 2));
    assert_eq!(e.stats().draft_blocks.unwrap().used, 0);
}

#[test]
fn a_prefill_engine_ships_the_draft_kv_only_where_the_receiver_values_it_above_its_cost() {
    let target_layers = model().model.cfg.n_layers as u32;
    let encode = |i: usize| model().tokenizer.encode_with_bos(PROMPTS[i], false);
    let (tokens, id) = (encode(0), RequestId(1));
    let want = alone(&mut engine(None, 512, 256), 1, tokens.clone(), 24);
    // A decode engine that has measured nothing wants the draft K/V whatever it
    // costs; once it has, it puts a price on it.
    let mut d = engine(drafting(self_draft(), 4, false), 512, 256);
    d.reserve_import(id, tokens.len()).unwrap();
    assert_eq!(d.draft_kv_worth(id), None);
    d.abort_import(id);
    alone(&mut d, 0, encode(1), 32);
    d.reserve_import(id, tokens.len()).unwrap();
    let worth = d.draft_kv_worth(id);
    assert!(worth.is_some_and(|w| w.is_finite() && w >= 0.0), "{worth:?}");
    d.abort_import(id);
    // An engine without a draft model, or one that verifies every draft, says so.
    let mut plain_d = engine(None, 512, 256);
    plain_d.reserve_import(id, tokens.len()).unwrap();
    assert_eq!(plain_d.draft_kv_worth(id), Some(0.0));
    let mut all = engine(drafting(self_draft(), 4, true), 512, 256);
    alone(&mut all, 0, encode(1), 32);
    all.reserve_import(id, tokens.len()).unwrap();
    assert_eq!(all.draft_kv_worth(id), None);
    // A prefill engine that has measured its draft model's prompt cost computes the
    // prompt in it and ships it where it is worth more than that (or its worth is
    // not known), and not where it is worth less; the decode engine then drafts by
    // lookup without computing it either, and the tokens are plain decoding's.
    for (worth, ships) in [(Some(0.0), false), (Some(1e9), true), (None, true)] {
        let mut p = engine(drafting(self_draft(), 4, false), 512, 256);
        alone(&mut p, 0, encode(1), 2);
        let before = p.stats().spec.draft_prompt_tokens;
        let mut d = engine(drafting(self_draft(), 4, false), 512, 256);
        d.reserve_import(id, tokens.len()).unwrap();
        let mut draft_frames = 0;
        let mut on_frame = |f: KvFrame| {
            draft_frames += usize::from(f.layer >= target_layers);
            d.import_frame(id, &f).is_ok()
        };
        let first = p.prefill_export_to(id, tokens.clone(), greedy(24), 0, worth, &mut on_frame).unwrap();
        let computed = p.stats().spec.draft_prompt_tokens - before;
        assert_eq!((computed > 0, draft_frames > 0), (ships, ships), "{worth:?}: {computed} tokens");
        assert!(d.finish_import(id, tokens.clone(), first.sampled.token, greedy(24)).unwrap());
        let mut got = vec![first.sampled.token];
        while d.has_work() {
            got.extend(d.step().into_iter().map(|o| o.sampled.token));
        }
        assert_eq!(got, want, "{worth:?}");
        let spec = d.stats().spec;
        assert_eq!(spec.draft_prompt_tokens, 0, "{worth:?}: the decode engine computed the prompt");
        assert!(!ships || spec.drafted > 0, "{worth:?}: {spec:?}");
        for e in [&p, &d] {
            let s = e.stats();
            assert_eq!((s.blocks.used, s.draft_blocks.unwrap().used), (0, 0), "{worth:?}: a block was not given back");
        }
    }
}

/// A request moved from another worker starts from the record of drafts it brings
/// (`SamplingParams::drafts_so_far`) and adds to it, its tokens those of plain
/// decoding; one that brings none starts with none.
#[test]
fn a_moved_request_goes_on_from_its_record_of_drafts() {
    let spec = Some(SpecConfig { max_draft: 8, verify_all: true, draft: None });
    let mut e = engine(spec, 512, 256);
    // The code to repeat is in the prompt, so lookups find drafts.
    let prompt = model().tokenizer.encode_with_bos(PROMPTS[0], false);
    let brought = DraftRecord { tried: 40, accepted: 30 };
    let moved = SamplingParams { drafts_so_far: Some(brought), ..greedy(24) };
    e.add(RequestId(1), prompt.clone(), moved).unwrap();
    e.add(RequestId(2), prompt.clone(), greedy(24)).unwrap();
    let mut got: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut first = true;
    let mut last = brought;
    while e.has_work() {
        for o in e.step() {
            got.entry(o.id.0).or_default().push(o.sampled.token);
        }
        if first {
            assert_eq!(e.draft_record(RequestId(1)), Some(brought), "after the prompt's step");
            assert_eq!(e.draft_record(RequestId(2)), None);
            first = false;
        }
        if let Some(r) = e.draft_record(RequestId(1)) {
            assert!(r.tried >= last.tried && r.accepted >= last.accepted, "{r:?} after {last:?}");
            last = r;
        }
    }
    assert!(last.tried > brought.tried, "it drafted on: {last:?}");
    let plain = alone(&mut engine(None, 512, 256), 1, prompt, 24);
    assert_eq!(got[&1], plain);
    assert_eq!(got[&2], plain);
}

#[test]
fn a_decodes_drafts_take_their_rows_before_a_prompts_chunks() {
    // Every draft verified whole, 32 tokens a step. A request that repeats a list decodes
    // while a long prompt is computed in chunks that would fill every step: its drafts
    // take their rows first, so it still gains more than a token a step there.
    let spec = Some(SpecConfig { max_draft: 8, verify_all: true, draft: None });
    let mut e = engine(spec, 32, 256);
    let copy = model().tokenizer.encode_with_bos(&"red green blue, ".repeat(12), false);
    e.add(RequestId(0), copy.clone(), greedy(400)).unwrap();
    let mut got = Vec::new();
    let mut take = |out: Vec<StepOutput>| {
        let before = got.len();
        got.extend(out.into_iter().filter(|o| o.id == RequestId(0)).map(|o| o.sampled.token));
        got.len() - before
    };
    // Until it decodes.
    while take(e.step()) == 0 {}
    let long = model().tokenizer.encode_with_bos(&PROMPTS[3].repeat(80), false);
    assert!(long.len() > 40 * 32, "{} prompt tokens", long.len());
    e.add(RequestId(1), long, greedy(1)).unwrap();
    let (mut steps, mut tokens) = (0, 0);
    while e.stats().queued_prompt_tokens > 0 {
        let n = take(e.step());
        steps += usize::from(n > 0);
        tokens += n;
    }
    assert!(tokens >= 2 * steps, "{tokens} tokens in {steps} steps beside the prompt's chunks");
    while e.has_work() {
        take(e.step());
    }
    assert_eq!(got, alone(&mut engine(None, 512, 256), 0, copy, 400));
}
