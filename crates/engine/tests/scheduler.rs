//! The scheduler on the real model: block accounting under random traffic with cancels
//! and preemption, the prefix cache, stop conditions, refused requests, and cancels in
//! every state.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{Engine, EngineConfig, EngineError, FinishReason, StepOutput};
use pdserve_engine::loader::{self, LoadedModel};
use pdserve_kv::PoolStats;
use pdserve_types::rng::Rng;
use pdserve_types::TokenOut;
use pdserve_types::{RequestId, SamplingParams, StopCondition};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| loader::load(&pdserve_engine::models::require_default_model()).unwrap())
}

fn engine(num_blocks: usize, max_batch_tokens: usize, max_seqs: usize) -> Engine {
    let m = model();
    let cfg = EngineConfig {
        threads: 1,
        num_blocks,
        max_batch_tokens,
        max_seqs,
        cache_salt: 0,
        objectives: None,
        ..Default::default()
    };
    Engine::new(m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec())
}

/// The project's seeded generator, with the two draws these tests make.
struct Prng(Rng);

impl Prng {
    fn new(seed: u64) -> Prng {
        Prng(Rng::new(seed))
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0.range(lo, hi + 1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.0.range(0, 100) < percent
    }
}

fn check_pool(s: PoolStats, num_blocks: usize) {
    assert_eq!(s.total, num_blocks);
    assert_eq!(s.free + s.used + s.cached, s.total, "{s:?}");
}

/// Steps until idle, checking the pool after every step; outputs by request id.
fn drain(e: &mut Engine) -> BTreeMap<u64, Vec<StepOutput>> {
    let out = drain_while_working(e);
    assert_eq!(e.stats().blocks.used, 0);
    out
}

/// [`drain`], where something may stay behind holding blocks (a paused request).
fn drain_while_working(e: &mut Engine) -> BTreeMap<u64, Vec<StepOutput>> {
    let mut out: BTreeMap<u64, Vec<StepOutput>> = BTreeMap::new();
    let mut steps = 0;
    while e.has_work() {
        for o in e.step() {
            out.entry(o.id.0).or_default().push(o);
        }
        check_pool(e.stats().blocks, e.config().num_blocks);
        steps += 1;
        assert!(steps < 20_000, "the engine does not make progress: {:?}", e.stats());
    }
    out
}

fn sampled(outs: &[StepOutput]) -> Vec<TokenOut> {
    outs.iter().map(|o| o.sampled.clone()).collect()
}

fn ids(outs: &[StepOutput]) -> Vec<u32> {
    outs.iter().map(|o| o.sampled.token).collect()
}

/// `prompt` alone on a roomy engine.
fn alone(prompt: &[u32], params: &SamplingParams) -> Vec<StepOutput> {
    let mut e = engine(128, 512, 8);
    e.add(RequestId(0), prompt.to_vec(), params.clone()).unwrap();
    drain(&mut e).remove(&0).unwrap()
}

/// Random token ids of ordinary text tokens.
fn random_prompt(rng: &mut Prng, len: usize) -> Vec<u32> {
    (0..len).map(|_| rng.range(200, 20_000) as u32).collect()
}

struct Req {
    prompt: Vec<u32>,
    params: SamplingParams,
}

#[test]
fn random_traffic_with_cancels_keeps_block_accounting_exact() {
    random_traffic(0x5eed_2024);
}

fn random_traffic(seed: u64) {
    const NUM_BLOCKS: usize = 16;
    let mut rng = Prng::new(seed);
    let reqs = random_requests(&mut rng);
    let mut e = engine(NUM_BLOCKS, 32, 8);
    let mut t = Traffic::default();
    let mut steps = 0;
    while t.next < reqs.len() as u64 || e.has_work() {
        t.arrive(&mut e, &reqs, &mut rng);
        t.cancel_now_and_then(&mut e, &mut rng);
        t.step(&mut e);
        check_pool(e.stats().blocks, NUM_BLOCKS);
        steps += 1;
        assert!(steps < 20_000, "the engine does not make progress: {:?}", e.stats());
    }
    let Traffic { out, cancelled, finished, preemptions, .. } = t;
    let s = e.stats();
    assert_eq!((s.waiting, s.running, s.blocks.used), (0, 0, 0), "{s:?}");
    assert!(preemptions > 0, "the tiny cache never forced a preemption");
    assert!(!cancelled.is_empty() && cancelled.len() < reqs.len() / 2, "{cancelled:?}");
    assert_eq!(finished.len() + cancelled.len(), reqs.len());
    // Every finished request produced exactly its tokens, as if it had run alone:
    // preemption by recompute neither lost nor repeated any.
    for id in &finished {
        let (r, got) = (&reqs[id], &out[id]);
        assert_eq!(got.len(), r.params.max_tokens as usize, "request {id}");
        assert_eq!(got.last().unwrap().finish, Some(FinishReason::Length));
        assert!(got[..got.len() - 1].iter().all(|o| o.finish.is_none()));
        assert_eq!(sampled(got), sampled(&alone(&r.prompt, &r.params)), "request {id}");
    }
}

/// The 22 requests of [`random_traffic`]: prompts of 5 to 150 tokens, 1 to 24 tokens
/// to generate, greedy or sampled.
fn random_requests(rng: &mut Prng) -> BTreeMap<u64, Req> {
    let mut reqs: BTreeMap<u64, Req> = BTreeMap::new();
    for id in 0..22u64 {
        let len = rng.range(5, 150) as usize;
        let max_tokens = rng.range(1, 24) as u32;
        let temperature = if rng.chance(50) { 0.0 } else { 0.8 };
        let params = SamplingParams {
            max_tokens,
            temperature,
            seed: Some(id),
            ignore_eos: true,
            logprobs: true,
            ..Default::default()
        };
        reqs.insert(id, Req { prompt: random_prompt(rng, len), params: params.validate().unwrap() });
    }
    reqs
}

/// What [`random_traffic`] has seen so far.
#[derive(Default)]
struct Traffic {
    /// Outputs by request id.
    out: BTreeMap<u64, Vec<StepOutput>>,
    cancelled: BTreeSet<u64>,
    finished: BTreeSet<u64>,
    /// The next request to arrive.
    next: u64,
    preemptions: usize,
}

impl Traffic {
    /// Arrivals: a few at a time.
    fn arrive(&mut self, e: &mut Engine, reqs: &BTreeMap<u64, Req>, rng: &mut Prng) {
        while self.next < reqs.len() as u64 && (e.stats().waiting < 2 || rng.chance(20)) {
            let r = &reqs[&self.next];
            e.add(RequestId(self.next), r.prompt.clone(), r.params.clone()).unwrap();
            self.next += 1;
        }
    }

    /// Cancels of live requests, whatever their state.
    fn cancel_now_and_then(&mut self, e: &mut Engine, rng: &mut Prng) {
        let Traffic { cancelled, finished, next, .. } = self;
        if rng.chance(4) {
            let live: Vec<u64> = (0..*next).filter(|id| !cancelled.contains(id) && !finished.contains(id)).collect();
            if !live.is_empty() {
                let id = live[rng.range(0, live.len() as u64 - 1) as usize];
                assert!(e.cancel(RequestId(id)));
                assert!(!e.cancel(RequestId(id)));
                cancelled.insert(id);
            }
        }
    }

    /// One step: counts a preemption and keeps the outputs, none of them after its
    /// request's end.
    fn step(&mut self, e: &mut Engine) {
        let Traffic { out, cancelled, finished, preemptions, .. } = self;
        let waiting_before = e.stats().waiting;
        let step = e.step();
        // Admission only shrinks the queue; it grows when a running sequence is preempted.
        if e.stats().waiting > waiting_before {
            *preemptions += 1;
        }
        for o in step {
            assert!(!cancelled.contains(&o.id.0) && !finished.contains(&o.id.0), "output after the end: {o:?}");
            if o.finish.is_some() {
                finished.insert(o.id.0);
            }
            out.entry(o.id.0).or_default().push(o);
        }
    }
}

#[test]
fn preempted_request_resumes_with_the_same_tokens() {
    // 12 blocks hold 192 tokens; two requests of 60 + 80 and 50 + 80 tokens need 18.
    let a = random_prompt(&mut Prng::new(1), 60);
    let b = random_prompt(&mut Prng::new(2), 50);
    let params =
        SamplingParams { max_tokens: 80, ignore_eos: true, logprobs: true, ..Default::default() }.validate().unwrap();
    let mut e = engine(12, 256, 4);
    e.add(RequestId(1), a.clone(), params.clone()).unwrap();
    e.add(RequestId(2), b.clone(), params.clone()).unwrap();
    let mut out: BTreeMap<u64, Vec<StepOutput>> = BTreeMap::new();
    let mut preempted_after = None;
    while e.has_work() {
        for o in e.step() {
            out.entry(o.id.0).or_default().push(o);
        }
        check_pool(e.stats().blocks, 12);
        let s = e.stats();
        if preempted_after.is_none() && s.waiting == 1 {
            preempted_after = Some(out[&2].len());
        }
    }
    assert_eq!(e.stats().blocks.used, 0);
    // B (the newer) was sent back to the queue while it was decoding.
    let n = preempted_after.expect("no preemption");
    assert!(n > 0 && n < 80, "preempted after {n} tokens");
    assert_eq!(sampled(&out[&1]), sampled(&alone(&a, &params)));
    assert_eq!(sampled(&out[&2]), sampled(&alone(&b, &params)));
}

#[test]
fn a_paused_request_waits_without_its_slot_and_resumes_with_the_same_tokens() {
    let a = random_prompt(&mut Prng::new(3), 40);
    let b = random_prompt(&mut Prng::new(4), 30);
    let params =
        SamplingParams { max_tokens: 30, ignore_eos: true, logprobs: true, ..Default::default() }.validate().unwrap();
    // One slot: B can only run while A is paused.
    let mut e = engine(64, 256, 1);
    e.add(RequestId(1), a.clone(), params.clone()).unwrap();
    let mut out: BTreeMap<u64, Vec<StepOutput>> = BTreeMap::new();
    while out.get(&1).map_or(0, Vec::len) < 10 {
        for o in e.step() {
            out.entry(o.id.0).or_default().push(o);
        }
    }
    assert!(e.pause(RequestId(1)));
    e.add(RequestId(2), b.clone(), params.clone()).unwrap();
    let while_paused = drain_while_working(&mut e);
    assert_eq!(out[&1].len(), 10, "a paused request produced tokens");
    assert!(!while_paused.contains_key(&1));
    // B got the slot and finished; A kept its blocks all along.
    assert_eq!(sampled(&while_paused[&2]), sampled(&alone(&b, &params)));
    assert!(e.stats().blocks.used > 0);
    assert!(!e.has_work(), "only a paused request is left");
    assert!(e.resume(RequestId(1)));
    out.entry(1).or_default().extend(drain(&mut e).remove(&1).unwrap());
    assert_eq!(sampled(&out[&1]), sampled(&alone(&a, &params)));
    assert!(!e.pause(RequestId(1)), "a finished request cannot be paused");
}

#[test]
fn prefix_cache_serves_a_repeated_prompt() {
    let prompt = random_prompt(&mut Prng::new(7), 100);
    let params =
        SamplingParams { max_tokens: 8, logprobs: true, ignore_eos: true, ..Default::default() }.validate().unwrap();
    let mut e = engine(64, 512, 8);
    e.add(RequestId(1), prompt.clone(), params.clone()).unwrap();
    let first = drain(&mut e).remove(&1).unwrap();
    assert!(first.iter().all(|o| o.cached_tokens == 0 && o.prompt_tokens == 100));
    let cached = e.stats().blocks.cached;
    assert!(cached >= 6, "{:?}", e.stats());
    e.add(RequestId(2), prompt.clone(), params.clone()).unwrap();
    let second = drain(&mut e).remove(&2).unwrap();
    let hit = second[0].cached_tokens;
    assert!(hit > 0 && hit.is_multiple_of(16), "cached_tokens {hit}");
    // Every full block of the prompt, leaving the last token to compute.
    assert_eq!(hit, 96);
    assert_eq!(sampled(&first), sampled(&second));
}

/// A chat prompt the instruct model answers in a few tokens, then ends.
fn say_hi() -> Vec<u32> {
    let m = model();
    let text = m.chat.render(&[pdserve_engine::chat::ChatMessage::new("user", "Say hi")], true).unwrap();
    m.tokenizer.encode(&text, true)
}

fn run_one(prompt: &[u32], params: SamplingParams) -> Vec<StepOutput> {
    let mut e = engine(64, 512, 8);
    e.add(RequestId(1), prompt.to_vec(), params.validate().unwrap()).unwrap();
    let outs = drain(&mut e).remove(&1).unwrap();
    assert!(outs[..outs.len() - 1].iter().all(|o| o.finish.is_none()));
    assert!(outs.last().unwrap().finish.is_some());
    outs
}

#[test]
fn stop_conditions() {
    let eog = model().tokenizer.eog_ids().to_vec();
    let p = say_hi();
    let base = SamplingParams { max_tokens: 64, ..Default::default() };

    // The model's own end: an EOS within a few tokens.
    let natural = run_one(&p, base.clone());
    let n = natural.len();
    assert!(n > 2 && n + 4 < 64, "{n} tokens: {:?}", ids(&natural));
    assert_eq!(natural[n - 1].finish, Some(FinishReason::Stop));
    assert!(eog.contains(&natural[n - 1].sampled.token));
    assert!(natural[..n - 1].iter().all(|o| !eog.contains(&o.sampled.token)));

    // max_tokens cuts it short.
    let short = run_one(&p, SamplingParams { max_tokens: 2, ..base.clone() });
    assert_eq!(ids(&short), ids(&natural)[..2]);
    assert_eq!(short[1].finish, Some(FinishReason::Length));

    // A stop token id ends generation at its first occurrence, the id included.
    let t = natural[1].sampled.token;
    let first_t = natural.iter().position(|o| o.sampled.token == t).unwrap();
    let stop = StopCondition { token_ids: vec![t], ..Default::default() };
    let stopped = run_one(&p, SamplingParams { stop: stop.clone(), ..base.clone() });
    assert_eq!(ids(&stopped), ids(&natural)[..=first_t]);
    assert_eq!(stopped.last().unwrap().finish, Some(FinishReason::Stop));

    // min_tokens bans EOS (and stop ids) until that many tokens exist.
    let min = n as u32 + 4;
    let long = run_one(&p, SamplingParams { min_tokens: min, ..base.clone() });
    assert!(long.len() > min as usize, "{} tokens", long.len());
    assert!(long[..min as usize].iter().all(|o| !eog.contains(&o.sampled.token)));
    assert_eq!(ids(&long)[..n - 1], ids(&natural)[..n - 1]);
    let long = run_one(&p, SamplingParams { min_tokens: 5, stop, ..base.clone() });
    assert!(long[..5].iter().all(|o| o.sampled.token != t));

    // ignore_eos samples the EOS and keeps going to max_tokens.
    let all = run_one(&p, SamplingParams { ignore_eos: true, ..base.clone() });
    assert_eq!(all.len(), 64);
    assert_eq!(all[63].finish, Some(FinishReason::Length));
    assert_eq!(ids(&all)[..n], ids(&natural)[..]);
}

#[test]
fn bad_requests_are_refused_without_side_effects() {
    let cfg = &model().model.cfg;
    let mut e = engine(16, 64, 8);
    let ok = random_prompt(&mut Prng::new(3), 20);
    let params =
        SamplingParams { max_tokens: 6, ignore_eos: true, logprobs: true, ..Default::default() }.validate().unwrap();
    let want = alone(&ok, &params);
    e.add(RequestId(1), ok.clone(), params.clone()).unwrap();
    // One step in: request 1 is running and holds blocks.
    let mut got = e.step();
    let before = e.stats();
    assert_eq!((before.waiting, before.running), (0, 1));
    let p = |max_tokens| SamplingParams { max_tokens, ..Default::default() }.validate().unwrap();
    let vocab = cfg.vocab_size as u32;
    let cases: Vec<(RequestId, Vec<u32>, SamplingParams, EngineError)> = vec![
        (RequestId(2), Vec::new(), p(4), EngineError::EmptyPrompt),
        (RequestId(2), vec![1, 2, vocab, 3], p(4), EngineError::BadToken(vocab)),
        (RequestId(2), vec![1, u32::MAX], p(4), EngineError::BadToken(u32::MAX)),
        (
            RequestId(2),
            vec![1; 100],
            p(cfg.context_length as u32 - 99),
            EngineError::TooLong { prompt: 100, max_tokens: cfg.context_length - 99, context: cfg.context_length },
        ),
        (RequestId(2), vec![1; 200], p(100), EngineError::TooLargeForCache { needed: 19, total: 16 }),
        (RequestId(1), vec![1; 10], p(4), EngineError::Duplicate(RequestId(1))),
    ];
    for (id, prompt, params, err) in cases {
        let what = err.to_string();
        assert_eq!(e.add(id, prompt, params), Err(err));
        let s = e.stats();
        assert_eq!((s.waiting, s.running, s.blocks), (before.waiting, before.running, before.blocks), "after {what}");
    }
    // Exactly the context length passes the length check (and fails only on this cache).
    assert_eq!(
        e.add(RequestId(3), vec![1; 100], p(cfg.context_length as u32 - 100)),
        Err(EngineError::TooLargeForCache { needed: cfg.context_length.div_ceil(16), total: 16 })
    );
    // A waiting duplicate is refused too, and nothing else changes.
    e.add(RequestId(4), vec![5; 8], p(2)).unwrap();
    assert_eq!(e.add(RequestId(4), vec![5; 8], p(2)), Err(EngineError::Duplicate(RequestId(4))));
    assert_eq!(e.stats().waiting, 1);
    while e.has_work() {
        got.extend(e.step());
    }
    let mine: Vec<StepOutput> = got.into_iter().filter(|o| o.id == RequestId(1)).collect();
    assert_eq!(sampled(&mine), sampled(&want));
    assert_eq!(e.stats().blocks.used, 0);
}

#[test]
fn cancel_frees_blocks_in_every_state() {
    let mut e = engine(32, 16, 2);
    let total = e.stats().blocks.total;
    let params = SamplingParams { max_tokens: 50, ignore_eos: true, ..Default::default() }.validate().unwrap();
    let a = random_prompt(&mut Prng::new(4), 10);
    e.add(RequestId(1), a.clone(), params.clone()).unwrap();
    e.add(RequestId(2), random_prompt(&mut Prng::new(5), 100), params.clone()).unwrap();
    e.add(RequestId(3), random_prompt(&mut Prng::new(6), 20), params.clone()).unwrap();
    // Step 1: A prefills and samples; B starts its prefill with the 6 tokens left.
    // Steps 2-3: A decodes, B takes 15 tokens a step. C waits for a slot (max_seqs 2).
    let mut a_out = Vec::new();
    for _ in 0..3 {
        for o in e.step() {
            assert_eq!(o.id, RequestId(1), "B is still prefilling");
            a_out.push(o);
        }
    }
    assert_eq!(a_out.len(), 3);
    let s = e.stats();
    assert_eq!((s.waiting, s.running), (1, 2));
    // A: 13 tokens in 1 block; B: 36 tokens in 3 blocks.
    assert_eq!(s.blocks.used, 4);

    // Waiting: holds no blocks.
    assert!(e.cancel(RequestId(3)));
    let s = e.stats();
    assert_eq!((s.waiting, s.running, s.blocks.used), (0, 2, 4));

    // Prefilling: its blocks return (its two full blocks stay as prefix cache).
    assert!(e.cancel(RequestId(2)));
    let s = e.stats();
    assert_eq!((s.waiting, s.running, s.blocks.used, s.blocks.cached), (0, 1, 1, 2));
    check_pool(s.blocks, total);

    // Decoding: A goes on unaffected, then is cancelled mid-way.
    for _ in 0..20 {
        a_out.extend(e.step());
    }
    assert_eq!(a_out.len(), 23);
    assert_eq!(sampled(&a_out), sampled(&alone(&a, &params))[..23]);
    assert!(e.stats().blocks.used >= 2);
    assert!(e.cancel(RequestId(1)));
    assert!(!e.cancel(RequestId(1)));
    let s = e.stats();
    assert_eq!((s.waiting, s.running, s.blocks.used), (0, 0, 0));
    check_pool(s.blocks, total);
    assert!(!e.has_work());
    assert!(e.step().is_empty());
}

#[test]
fn a_prefill_waiting_for_blocks_is_not_overtaken() {
    // 8 blocks. A (20 + 12 tokens) decodes in 2 blocks; B's 120-token prompt needs all
    // 8, and runs out of blocks mid-prefill while A decodes. C (10 tokens) arrives then
    // and would fit in the one free block. If C is admitted behind the stalled B, it
    // holds that block, B can never finish its prompt once A is done, and nothing
    // is left to run: the engine would report work forever and produce nothing.
    let mut e = engine(8, 32, 8);
    let p = |max_tokens| SamplingParams { max_tokens, ignore_eos: true, ..Default::default() }.validate().unwrap();
    let reqs = [
        (random_prompt(&mut Prng::new(11), 20), p(12)),
        (random_prompt(&mut Prng::new(12), 120), p(8)),
        (random_prompt(&mut Prng::new(13), 10), p(5)),
    ];
    for (i, (prompt, params)) in reqs.iter().enumerate().take(2) {
        e.add(RequestId(i as u64), prompt.clone(), params.clone()).unwrap();
    }
    let mut out: BTreeMap<u64, Vec<StepOutput>> = BTreeMap::new();
    for step in 0..200 {
        if step == 3 {
            e.add(RequestId(2), reqs[2].0.clone(), reqs[2].1.clone()).unwrap();
        }
        if !e.has_work() {
            break;
        }
        for o in e.step() {
            out.entry(o.id.0).or_default().push(o);
        }
        check_pool(e.stats().blocks, 8);
    }
    assert!(
        !e.has_work(),
        "stuck: {:?}, outputs {:?}",
        e.stats(),
        out.iter().map(|(id, o)| (*id, o.len())).collect::<Vec<_>>()
    );
    assert_eq!(e.stats().blocks.used, 0);
    for (i, (prompt, params)) in reqs.iter().enumerate() {
        assert_eq!(sampled(&out[&(i as u64)]), sampled(&alone(prompt, params)), "request {i}");
    }
}
