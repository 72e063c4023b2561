//! The timed engine (simulated workers): the real scheduler and block pool with a
//! cost model's time and deterministic tokens.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{Engine, EngineConfig, Objectives, SpecConfig};
use pdserve_engine::tiers::TierConfig;
use pdserve_engine::timed::{Clock, RestoreCost, StepCost, StepShape, StepTime, TimedModel, TimedSpeculation};
use pdserve_types::{RequestId, SamplingParams};
use std::collections::BTreeMap;

const COST: StepCost = StepCost { fixed_s: 0.01, token_s: 0.001, pair_s: 1e-6, decode_pair_s: 2e-6, logits_s: 0.002 };

fn engine(num_blocks: usize, max_batch_tokens: usize) -> Engine {
    engine_with(num_blocks, max_batch_tokens, RestoreCost::default())
}

fn engine_with(num_blocks: usize, max_batch_tokens: usize, restore: RestoreCost) -> Engine {
    engine_keeping(num_blocks, max_batch_tokens, restore, None)
}

fn engine_keeping(
    num_blocks: usize,
    max_batch_tokens: usize,
    restore: RestoreCost,
    objectives: Option<Objectives>,
) -> Engine {
    let t = model(restore);
    let cfg = EngineConfig {
        threads: 1,
        num_blocks,
        max_batch_tokens,
        max_seqs: 64,
        cache_salt: 0,
        objectives,
        ..Default::default()
    };
    Engine::timed(t, cfg, vec![])
}

/// The model every test times: [`COST`] on a virtual clock.
fn model(restore: RestoreCost) -> TimedModel {
    TimedModel {
        vocab_size: 49152,
        context_length: 8192,
        n_layers: 4,
        kv_values: 2,
        step: StepTime::line(COST),
        threads: 1,
        work: None,
        restore,
        clock: Clock::Virtual,
        speculation: None,
        stages: None,
    }
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 1000 + (i * 7 + salt) % 5000).collect()
}

/// Steps until idle; tokens by request, and the modelled seconds of every step.
fn drain(e: &mut Engine) -> (BTreeMap<u64, Vec<u32>>, Vec<f64>) {
    let (mut out, mut steps) = (BTreeMap::<u64, Vec<u32>>::new(), Vec::new());
    while e.has_work() {
        for o in e.step() {
            out.entry(o.id.0).or_default().push(o.sampled.token);
        }
        steps.push(e.take_charged());
        assert!(steps.len() < 10_000);
    }
    assert_eq!(e.stats().blocks.used, 0);
    (out, steps)
}

#[test]
fn steps_cost_what_the_model_says() {
    let mut e = engine(256, 64);
    e.add(RequestId(1), prompt(100, 0), SamplingParams::greedy(3)).unwrap();
    let (out, steps) = drain(&mut e);
    assert_eq!(out[&1].len(), 3);
    // Chunks of 64 and 36 tokens, then two decode steps.
    let want = [
        COST.seconds(&StepShape::chunk(0, 64, false)),
        COST.seconds(&StepShape::prefill(64, 36)),
        COST.seconds(&StepShape::decode(1, 100)),
        COST.seconds(&StepShape::decode(1, 101)),
    ];
    assert_eq!(steps.len(), want.len());
    for (got, want) in steps.iter().zip(want) {
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    }
}

#[test]
fn tokens_are_the_same_batched_alone_or_after_preemption() {
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(40 + 13 * i, i as u32)).collect();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut e = engine(256, 512);
            e.add(RequestId(9), p.clone(), SamplingParams::greedy(20)).unwrap();
            drain(&mut e).0.remove(&9).unwrap()
        })
        .collect();
    // Few blocks: the batch preempts and recomputes, and must not change a token.
    for blocks in [256, 24] {
        let mut e = engine(blocks, 512);
        for (i, p) in prompts.iter().enumerate() {
            e.add(RequestId(i as u64), p.clone(), SamplingParams::greedy(20)).unwrap();
        }
        let (out, _) = drain(&mut e);
        for (i, want) in alone.iter().enumerate() {
            assert_eq!(&out[&(i as u64)], want, "request {i} with {blocks} blocks");
        }
    }
}

#[test]
fn export_and_import_continue_the_same_tokens() {
    let p = prompt(70, 3);
    let mut one = engine(64, 512);
    one.add(RequestId(1), p.clone(), SamplingParams::greedy(8)).unwrap();
    let want = drain(&mut one).0.remove(&1).unwrap();

    let (mut pre, mut dec) = (engine(64, 512), engine(64, 512));
    dec.reserve_import(RequestId(1), p.len()).unwrap();
    let mut frames = Vec::new();
    let first = pre.prefill_export(RequestId(1), p.clone(), SamplingParams::greedy(8), &mut |f| {
        frames.push(f);
        true
    });
    let first = first.unwrap().sampled.token;
    // 70 tokens are 5 blocks, on each of 4 layers.
    assert_eq!(frames.len(), 5 * 4);
    for f in &frames {
        dec.import_frame(RequestId(1), f).unwrap();
    }
    assert!(dec.finish_import(RequestId(1), p, first, SamplingParams::greedy(8)).unwrap());
    let (mut rest, _) = drain(&mut dec);
    let mut got = vec![first];
    got.append(rest.get_mut(&1).unwrap());
    assert_eq!(got, want);
    assert_eq!(pre.stats().blocks.used, 0);
}

#[test]
fn a_prefill_waiting_for_blocks_does_not_hold_up_the_decodes_behind_it() {
    // 10 blocks of 16 tokens. A local prompt is admitted first and takes the last two
    // free blocks for its first chunk; two transferred sequences then fill the pool
    // behind it. The prefill must wait, the decodes must go on (one preempting the
    // other), and everything must finish.
    let mut e = engine(10, 32);
    e.reserve_import(RequestId(2), 64).unwrap();
    e.reserve_import(RequestId(3), 64).unwrap();
    e.add(RequestId(1), prompt(96, 1), SamplingParams::greedy(4)).unwrap();
    let first = e.step();
    assert!(first.is_empty(), "a first chunk samples nothing");
    for id in [2, 3] {
        assert!(e.finish_import(RequestId(id), prompt(64, id as u32), 1234, SamplingParams::greedy(4)).unwrap());
    }
    let (out, _) = drain(&mut e);
    assert_eq!(out.get(&1).map(Vec::len), Some(4), "the prefill finished");
    assert_eq!((out[&2].len(), out[&3].len()), (3, 3), "both decodes finished (their first token came with them)");
}

#[test]
fn an_engine_that_cannot_compute_anything_says_it_is_stalled() {
    let mut e = engine(4, 64);
    e.reserve_import(RequestId(9), 60).unwrap();
    e.add(RequestId(1), prompt(40, 0), SamplingParams::greedy(2)).unwrap();
    assert!(e.step().is_empty());
    assert!(e.has_work() && e.stalled(), "the prompt waits for blocks the transfer holds");
    assert!(e.abort_import(RequestId(9)));
    e.step();
    assert!(!e.stalled());
    drain(&mut e);
}

/// A prefix the pool pushed down to the host tier comes back at the modelled copy
/// time instead of being recomputed: the second prefill charges each restored block's
/// copy and computes only the prompt's last, partial block.
#[test]
fn a_prefix_restored_from_the_host_tier_costs_the_modelled_copy() {
    let restore = RestoreCost { host_block_s: 0.002, disk_block_s: 0.0 };
    let tiers = TierConfig { host_blocks: 64, ..TierConfig::default() };
    let mut e = engine_with(64, 512, restore).with_tiers(&tiers).unwrap();
    let p = prompt(16 * 10 + 3, 1);
    e.add(RequestId(1), p.clone(), SamplingParams::greedy(1)).unwrap();
    let cold: f64 = drain(&mut e).1.iter().sum();
    e.evict_cached();
    e.add(RequestId(2), p.clone(), SamplingParams::greedy(1)).unwrap();
    let (out, steps) = drain(&mut e);
    assert_eq!(out[&2].len(), 1);
    assert_eq!(e.stats().tiers.restored_host, 10, "every full block came back from the host tier");
    let warm: f64 = steps.iter().sum();
    let tail = COST.seconds(&StepShape::prefill(160, 3));
    assert!((warm - (10.0 * 0.002 + tail)).abs() < 1e-9, "warm {warm} s, cold {cold} s");
    assert!(warm < cold);
}

#[test]
fn a_prompt_waits_for_the_prefix_a_running_prefill_is_computing_instead_of_computing_it_again() {
    // Two prompts that share 256 tokens and fit one 512-token step together.
    let shared = prompt(256, 3);
    let with = |salt| [shared.clone(), prompt(32, salt)].concat();
    let mut e = engine(256, 512);
    e.add(RequestId(1), with(1), SamplingParams::greedy(2)).unwrap();
    e.add(RequestId(2), with(2), SamplingParams::greedy(2)).unwrap();
    let mut cached = BTreeMap::new();
    while e.has_work() {
        for o in e.step() {
            cached.entry(o.id.0).or_insert(o.cached_tokens);
        }
    }
    // The second finds the shared blocks cached: 288 + 32 prompt tokens computed,
    // not 2 × 288.
    assert_eq!((cached[&1], cached[&2]), (0, 256));
    assert_eq!(e.stats().blocks.used, 0);
}

/// When each request's tokens came, on the engine's own clock (its steps' modelled
/// seconds), stepping until idle; `add` is called with the clock before each step.
fn token_times(e: &mut Engine, add: &mut dyn FnMut(&mut Engine, f64)) -> BTreeMap<u64, Vec<f64>> {
    let (mut times, mut clock) = (BTreeMap::<u64, Vec<f64>>::new(), 0.0);
    loop {
        add(e, clock);
        if !e.has_work() {
            return times;
        }
        let out = e.step();
        clock += e.take_charged();
        for o in out {
            times.entry(o.id.0).or_default().push(clock);
        }
    }
}

/// A decode of `answer` tokens running when a 2,000-token prompt arrives at a mixed
/// worker: its first 100 tokens' time per token, and the prompt's time to first
/// token.
fn decode_beside_a_long_prompt(objectives: Option<Objectives>, answer: u32) -> (f64, f64) {
    let mut e = engine_keeping(1024, 512, RestoreCost::default(), objectives);
    // Measured paces first: prefill-only steps of two sizes, then decode-only steps.
    e.add(RequestId(1), prompt(600, 1), SamplingParams::greedy(8)).unwrap();
    drain(&mut e);
    e.add(RequestId(2), prompt(64, 2), SamplingParams::greedy(answer)).unwrap();
    let mut arrived = None;
    let times = token_times(&mut e, &mut |e, clock| {
        if arrived.is_none() && clock > 0.1 {
            e.add(RequestId(3), prompt(2000, 3), SamplingParams::greedy(4)).unwrap();
            arrived = Some(clock);
        }
    });
    let decode = &times[&2];
    assert_eq!(decode.len(), answer as usize);
    let tpot = (decode[99] - decode[0]) / 99.0;
    (tpot, times[&3][0] - arrived.unwrap())
}

#[test]
fn a_long_prompt_is_spread_over_the_decodes_steps_so_they_keep_their_tpot_objective() {
    // Alone, the decode's steps take about 13 ms; the prompt's chunks about 4 s.
    let (stalled, ttft_stalled) = decode_beside_a_long_prompt(None, 100);
    assert!(stalled > 0.03, "without objectives the prompt's chunks stall the decode: {stalled}");
    let kept = Objectives { ttft_s: 30.0, tpot_s: 0.03 };
    let (tpot, ttft) = decode_beside_a_long_prompt(Some(kept), 100);
    assert!(tpot <= kept.tpot_s, "TPOT {tpot} over the objective");
    assert!(ttft > ttft_stalled && ttft < kept.ttft_s, "the prompt waited {ttft} s ({ttft_stalled} s unheld)");
    // A prompt that could not wait out the decode (1.1 s left, then about 2.4 s at
    // the pace of the 600-token prompt), nor come out by half its objective at
    // any allowance, is not held.
    let tight = Objectives { ttft_s: 3.0, ..kept };
    let (tpot, ttft) = decode_beside_a_long_prompt(Some(tight), 100);
    assert!((ttft - ttft_stalled).abs() < 1e-9 && (tpot - stalled).abs() < 1e-9, "{ttft} s, {tpot} s a token");
}

#[test]
fn a_prompt_that_cannot_wait_out_an_answer_with_no_set_length_is_computed_at_the_pace_its_ttft_needs() {
    // The answer may run to the context's end (a request without max_tokens): the
    // prompt cannot wait for it, but about 250 tokens a second bring its first
    // token by half of a 16 s objective (about 4 s at full pace), and the decode
    // keeps the rest.
    let answer = 8192 - 64;
    let (stalled, _) = decode_beside_a_long_prompt(None, answer);
    let obj = Objectives { ttft_s: 16.0, tpot_s: 0.03 };
    let (tpot, ttft) = decode_beside_a_long_prompt(Some(obj), answer);
    assert!(ttft <= obj.ttft_s * 0.5, "the prompt waited {ttft} s");
    assert!(tpot < stalled * 0.8, "TPOT {tpot} s held, {stalled} s unheld");
}

#[test]
fn a_step_that_carries_a_prompts_chunk_verifies_drafts_a_decode_step_does_not() {
    // Eight decodes whose drafted tokens are right half the time, on a model whose
    // row costs 3 ms against 34 ms for a plain step of eight: a drafted row there
    // yields less than it slows the others, so the measured rule verifies none.
    // Beside a 500-token chunk the same row adds under 1 % to the step, and the
    // rule verifies drafts there.
    let drafts = TimedSpeculation { per_token: 0.5, drafting: 1.0, draft_step: None, lookup: None };
    let t = TimedModel { speculation: Some(drafts), ..model(RestoreCost::default()) };
    let speculation = Some(SpecConfig { max_draft: 4, verify_all: false, draft: None });
    let cfg = EngineConfig { threads: 1, num_blocks: 1024, max_batch_tokens: 512, speculation, ..Default::default() };
    let mut e = Engine::timed(t, cfg, vec![]);
    let long = SamplingParams { max_tokens: 400, ignore_eos: true, ..Default::default() }.validate().unwrap();
    for i in 0..8 {
        e.add(RequestId(i), prompt(40, i as u32), long.clone()).unwrap();
    }
    // Until the fit tells a row from a step and the exploring is over.
    while !e.stats().decode_steps.tells_rows_apart() {
        e.step();
    }
    let drafted = |e: &Engine| e.stats().spec.drafted;
    let before = drafted(&e);
    for _ in 0..20 {
        e.step();
    }
    assert_eq!(drafted(&e), before, "decode steps verified drafts");
    e.add(RequestId(8), prompt(2000, 9), long).unwrap();
    let (before, mut chunks) = (drafted(&e), 0);
    while e.stats().queued_prompt_tokens > 0 {
        e.step();
        chunks += 1;
    }
    assert!(drafted(&e) - before >= 8 * chunks, "{} drafted tokens in {chunks} steps", drafted(&e) - before);
}
