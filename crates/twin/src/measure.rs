//! `pdserve profile`: times worker shapes on this machine with the real model, the shapes
//! in turn at every point so the machine's drift falls on all of them alike.
//!
//! - Prefill: lone prompts of 16 to 2048 tokens in chunks of the engine's default
//!   budget (512), each chunk one point (its size and the context before it).
//! - Decode: batches of 1 to 32 sequences at three context lengths, each sequence's
//!   context imported as a KV transfer (no prefill to compute, no blocks shared); the
//!   median of three steps in each of three passes over the grid.
//! - The layers alone: decode passes of 1 to 16 sequences through the model less its
//!   output head's over the same rows; their fixed part is what a stage group's
//!   stages share (the rest of a step's stays on its head).
//! - Verified drafts: a step of sequences each computing several rows with logits,
//!   as a speculating engine verifies drafts, timed through the model alone (no
//!   sampling) and set against what the fitted shape prices them at; logged, a check
//!   of that price rather than a figure the profile keeps.
//! - KV links: a 64 KiB and a 16 MiB handoff over each transport (the best of three):
//!   the small one is the latency, the difference the rate.
//! - KV tiers: a 512-token prompt pushed out of a fresh engine's pool into the host
//!   tier (then, separately, the disk tier, its file synced and dropped from the page
//!   cache) and asked for again; the engine's own seconds per block copied back (the
//!   median of three each).
//! - Co-running: a one-thread engine's decode step and prompt chunk alone, beside a
//!   second one-thread engine that decodes and beside one that prefills (the median
//!   of five tries of each pair, alone timed before and after).
//! - Overheads: a role switch; a short request's trip through a worker beyond its
//!   engine step; and each streamed token's cost beyond the engine's decode step,
//!   from streams served over HTTP by a `pdserve serve` of the same model.

use crate::profile::{self, Link, ModelShape, Point, PointKind, Profile, Provenance, Shape};
use crate::TwinError;
use pdserve_bench::client::{first_model, Client};
use pdserve_bench::openai::{BodyOptions, Endpoint};
use pdserve_bench::process::ServerProcess;
use pdserve_bench::prompt::{Prompt, PromptKind};
use pdserve_bench::target::Target;
use pdserve_bench::workload::RequestSpec;
use pdserve_engine::batch::{Engine, EngineConfig, PassTimes, BLOCK_SIZE};
use pdserve_engine::kernels::Isa;
use pdserve_engine::kvcache::KvStorage;
use pdserve_engine::model::{ForwardScratch, Model, SeqBatch};
use pdserve_engine::threadpool::ThreadPool;
use pdserve_engine::tiers::TierConfig;
use pdserve_engine::timed::{RestoreCost, StepShape, StepTime};
use pdserve_kv_transfer::{frame, probe, ClusterKey, HandoffId, Inboxes, KvTarget, Links, ListenAt, TransportKind};
use pdserve_protocol::{Event, GenerateRequest, RoleSwitch, TokenStream, Worker};
use pdserve_types::{Assignment, Epoch, KvDtype, KvFrame, RequestId, Role, SamplingParams};
use pdserve_worker::{CoRun, LocalWorker, WorkerOptions};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PREFILL_LENS: [usize; 6] = [16, 64, 256, 512, 1024, 2048];
const DECODE_BATCHES: [usize; 6] = [1, 2, 4, 8, 16, 32];
const DECODE_CONTEXTS: [usize; 3] = [64, 512, 1536];
/// Passes over the decode grid, and steps timed per point in each.
const DECODE_PASSES: usize = 3;
const DECODE_STEPS: usize = 3;
/// A median fit error above this says the machine's speed changed while a shape was
/// timed (a quiet machine fits its steps within 2–3 %): the profile is worth timing
/// again.
pub const NOISY_FIT: f64 = 0.05;
const LINK_SMALL: usize = 64 << 10;
const LINK_LARGE: usize = 16 << 20;

/// What to time.
pub struct Spec {
    pub model: Arc<Model>,
    pub name: String,
    /// One shape per entry.
    pub threads: Vec<usize>,
    /// KV blocks per worker the profile states (the sim's default).
    pub kv_blocks: usize,
    pub machine: String,
    pub date: String,
    pub command: String,
    /// This binary and the `--model` it was given: the served streams are timed on a
    /// `pdserve serve` of the same model.
    pub exe: std::path::PathBuf,
    pub model_arg: String,
}

/// Times every shape, the links and the overheads.
pub fn profile(spec: &Spec, log: &mut dyn FnMut(&str)) -> Result<Profile, TwinError> {
    let c = &spec.model.cfg;
    let shapes = time_shapes(spec, log);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| TwinError::Invalid(format!("starting a runtime: {e}")))?;
    let links = time_links(&rt, c.n_kv_heads * BLOCK_SIZE * c.head_dim, log)?;
    let threads = spec.threads.iter().copied().min().unwrap_or(1);
    let tiers = time_tiers(&spec.model, threads, log)?;
    let co = time_co_run(&spec.model, log);
    let (o, served) = time_overheads(&rt, spec, threads, log)?;
    let (token_s, host_token_s) = (served.token_s, served.host_token_s);
    Ok(Profile {
        schema: profile::SCHEMA,
        provenance: Provenance::Measured {
            machine: spec.machine.clone(),
            date: spec.date.clone(),
            command: spec.command.clone(),
        },
        model: model_shape(spec),
        shapes,
        links,
        switch_s: o.switch_s,
        admission_s: o.admission_s,
        token_overhead_s: token_s,
        host_token_s,
        co_run_slowdown: co.decode_beside_decode,
        cores: std::thread::available_parallelism().ok().map(|n| n.get()),
        co_run: Some(co),
        tiers: Some(tiers),
    })
}

/// The model as the profile states it.
fn model_shape(spec: &Spec) -> ModelShape {
    let c = &spec.model.cfg;
    ModelShape {
        name: spec.name.clone(),
        vocab_size: c.vocab_size,
        context_length: c.context_length,
        n_layers: c.n_layers,
        // K and V, f16, every layer (`Profile::with_kv_dtype` rescales it).
        kv_bytes_per_token: pdserve_engine::kvcache::bytes_per_token(c, KvDtype::F16) as f64,
        kv_dtype: KvDtype::F16,
        kv_blocks: spec.kv_blocks,
        hidden: c.hidden,
        weight_bytes: spec.model.weight_bytes() as u64,
        max_batch_tokens: None,
        max_seqs: None,
        speculation: None,
    }
}

/// Every shape's prefill and decode points, timed in turn, and its step fitted to
/// them.
fn time_shapes(spec: &Spec, log: &mut dyn FnMut(&str)) -> Vec<Shape> {
    let started = Instant::now();
    let prefill = prefill_points(&spec.model, &spec.threads);
    let decode = decode_points(&spec.model, &spec.threads);
    log(&format!(
        "{} shape(s) timed point by point in turn: {:.0} s",
        spec.threads.len(),
        started.elapsed().as_secs_f64()
    ));
    let mut shapes = Vec::new();
    for ((&t, mut points), more) in spec.threads.iter().zip(prefill).zip(decode) {
        points.extend(more);
        let step = profile::fit(&mut points);
        let err = profile::fit_error(&points);
        log(&format!("{t} thread(s): {} points; median fit error {:.1} %", points.len(), err * 100.0));
        if err > NOISY_FIT {
            log(&format!(
                "warning: a fit error above {:.0} % means this machine's speed changed while timing; time the profile again when it is quiet",
                NOISY_FIT * 100.0
            ));
        }
        let layers_fixed_s = layers_fixed(&spec.model, t);
        if let Some(f) = layers_fixed_s {
            log(&format!(
                "{t} thread(s): a decode pass through the layers alone: {:.2} ms fixed, of the step's {:.2}",
                f * 1e3,
                step.fixed_s * 1e3
            ));
        }
        let shape = Shape { threads: t, step, points, layers_fixed_s };
        log(&format!("{t} thread(s): {}", verify_check(&spec.model, &shape)));
        shapes.push(shape);
    }
    shapes
}

/// Decode batches whose passes through the layers alone are timed, at this context.
const LAYER_BATCHES: [usize; 5] = [1, 2, 4, 8, 16];
const LAYER_CONTEXT: usize = 64;

/// The fixed part of a decode pass through every layer alone: what a stage group's
/// stages share, each paying its share on every pass. The rest of a step's fixed
/// part (the output head's weights, sampling, the step's bookkeeping) stays on the
/// group's head. Each batch's pass is the model's whole pass less its output head's
/// over as many rows, the head timed right after the layers as a step meets it (its
/// weights no longer in the cache: timed alone, again and again, it takes less than
/// half as long here); the medians of five, after one that warms, and the line
/// through them by rows gives the fixed part.
fn layers_fixed(model: &Arc<Model>, threads: usize) -> Option<f64> {
    let (pool, isa) = (ThreadPool::new(threads), Isa::detect());
    let most = LAYER_BATCHES.iter().copied().max().unwrap_or(1);
    let per_seq = (LAYER_CONTEXT + 1).div_ceil(BLOCK_SIZE);
    let mut kv = KvStorage::new(&model.cfg, most * per_seq, BLOCK_SIZE);
    let mut s = ForwardScratch::default();
    let tables: Vec<Vec<u32>> =
        (0..most as u32).map(|i| (i * per_seq as u32..(i + 1) * per_seq as u32).collect()).collect();
    let mut passes = PassTimes::default();
    for b in LAYER_BATCHES {
        let tokens: Vec<Vec<u32>> = (0..b).map(|i| prompt(1, 9000 + i)).collect();
        let batch: Vec<SeqBatch<'_>> =
            (0..b).map(|i| SeqBatch::plain(&tokens[i], LAYER_CONTEXT, &tables[i], 1)).collect();
        let rows = vec![0.5f32; b * model.cfg.hidden];
        let (mut whole, mut head) = (Vec::new(), Vec::new());
        for _ in 0..6 {
            let started = Instant::now();
            model.forward(isa, &pool, &batch, &mut kv, &mut s, &mut |_, _| true);
            let between = Instant::now();
            model.head_logits(isa, &pool, &batch, &rows, &mut s);
            whole.push((between - started).as_secs_f64());
            head.push(between.elapsed().as_secs_f64());
        }
        let (whole, head) = (median(whole[1..].to_vec()), median(head[1..].to_vec()));
        passes.record(b, (whole - head).max(0.0));
    }
    passes.cost().map(|c| c.fixed)
}

/// Steps of sequences verifying drafts: (sequences, rows each, context).
const VERIFY_STEPS: [(usize, usize, usize); 6] =
    [(1, 5, 64), (1, 9, 64), (4, 5, 64), (1, 5, 512), (1, 9, 512), (4, 9, 512)];

/// Times [`VERIFY_STEPS`] through the model (the median of five passes, after one
/// that warms it) and says how far `shape`'s price of them is off.
fn verify_check(model: &Arc<Model>, shape: &Shape) -> String {
    let step = StepTime { cost: shape.step, decode_table: shape.decode_table() };
    let (pool, isa) = (ThreadPool::new(shape.threads), Isa::detect());
    let per_seq = 1024 / BLOCK_SIZE;
    let mut kv = KvStorage::new(&model.cfg, 4 * per_seq, BLOCK_SIZE);
    let mut scratch = ForwardScratch::default();
    let tables: Vec<Vec<u32>> = (0..4u32).map(|i| (i * per_seq as u32..(i + 1) * per_seq as u32).collect()).collect();
    let mut errors = Vec::new();
    let mut said = Vec::new();
    for (b, r, ctx) in VERIFY_STEPS {
        let tokens: Vec<Vec<u32>> = (0..b).map(|i| prompt(r, 7000 + i)).collect();
        let batch: Vec<SeqBatch<'_>> = (0..b).map(|i| SeqBatch::plain(&tokens[i], ctx, &tables[i], r)).collect();
        let mut times: Vec<f64> = (0..6)
            .map(|_| {
                let t = Instant::now();
                model.forward(isa, &pool, &batch, &mut kv, &mut scratch, &mut |_, _| true);
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.remove(0);
        let measured = median(times);
        let priced = step.seconds(&(0..b).map(|_| StepShape::part(ctx, r, r)).sum());
        errors.push((priced - measured).abs() / measured);
        said.push(format!("{b}×{r} at {ctx}: {:.2} ms, priced {:.2}", measured * 1e3, priced * 1e3));
    }
    let worst = errors.iter().copied().fold(0.0, f64::max);
    format!(
        "verified drafts: their price off by {:.1} % (median), {:.1} % at worst ({})",
        median(errors) * 100.0,
        worst * 100.0,
        said.join("; ")
    )
}

/// Each transport's latency and rate, for frames of `frame_elems` values.
fn time_links(
    rt: &tokio::runtime::Runtime,
    frame_elems: usize,
    log: &mut dyn FnMut(&str),
) -> Result<Vec<Link>, TwinError> {
    let mut links = Vec::new();
    for kind in TransportKind::ALL {
        let link = rt.block_on(time_link(kind, frame_elems))?;
        log(&format!("{}: {:.0} µs, {:.2} GB/s", link.transport, link.latency_s * 1e6, link.bytes_per_s / 1e9));
        links.push(link);
    }
    Ok(links)
}

/// [`tier_restore`], reported.
fn time_tiers(model: &Arc<Model>, threads: usize, log: &mut dyn FnMut(&str)) -> Result<RestoreCost, TwinError> {
    let tiers = tier_restore(model, threads)?;
    log(&format!(
        "a block back from host RAM {:.0} µs, from disk {:.0} µs",
        tiers.host_block_s * 1e6,
        tiers.disk_block_s * 1e6
    ));
    Ok(tiers)
}

/// [`co_run`], reported.
fn time_co_run(model: &Arc<Model>, log: &mut dyn FnMut(&str)) -> CoRun {
    let co = co_run(model);
    log(&format!(
        "two one-thread workers at once: a decode step {:.2}× as long beside a decode, {:.2}× beside a prefill; \
         a prompt chunk {:.2}× and {:.2}×",
        co.decode_beside_decode, co.decode_beside_prefill, co.prefill_beside_decode, co.prefill_beside_prefill
    ));
    co
}

/// A worker's [`overheads`] and the [`served`] streams' cost per token, reported.
fn time_overheads(
    rt: &tokio::runtime::Runtime,
    spec: &Spec,
    threads: usize,
    log: &mut dyn FnMut(&str),
) -> Result<(Overheads, Served), TwinError> {
    let o = rt.block_on(overheads(&spec.model, threads))?;
    let served = rt.block_on(served(spec, threads))?;
    let (token_s, host_token_s) = (served.token_s, served.host_token_s);
    log(&format!(
        "role switch {:.1} µs; admission {:.0} µs; served TPOT {:.2} ms against {:.2} ms bare: {:.0} µs per token; \
         host CPU {:.0} µs per token",
        o.switch_s * 1e6,
        o.admission_s * 1e6,
        served.tpot_s * 1e3,
        served.bare_tpot_s * 1e3,
        token_s * 1e6,
        host_token_s * 1e6
    ));
    Ok((o, served))
}

/// Seconds to copy one block back into the pool from the host tier and from the
/// disk tier (median of three runs each).
fn tier_restore(model: &Arc<Model>, threads: usize) -> Result<RestoreCost, TwinError> {
    let dir = std::env::temp_dir().join(format!("pdserve-profile-tiers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| TwinError::io(&dir, e))?;
    let per_block = |disk: Option<&std::path::Path>| -> Result<f64, TwinError> {
        let runs: Result<Vec<f64>, TwinError> = (0..3).map(|i| restore_once(model, threads, disk, i)).collect();
        Ok(median(runs?))
    };
    let host = per_block(None);
    let disk = per_block(Some(&dir));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(RestoreCost { host_block_s: host?, disk_block_s: disk? })
}

/// One 512-token prompt computed, pushed down to the tier (`disk` or host RAM), and
/// asked for again: the engine's seconds per block copied back.
fn restore_once(
    model: &Arc<Model>,
    threads: usize,
    disk: Option<&std::path::Path>,
    salt: usize,
) -> Result<f64, TwinError> {
    const TOKENS: usize = 512;
    let blocks = TOKENS / BLOCK_SIZE + 4;
    let tiers = match disk {
        None => TierConfig { host_blocks: blocks, ..TierConfig::default() },
        Some(d) => TierConfig { disk_blocks: blocks, disk_dir: Some(d.to_path_buf()), ..TierConfig::default() },
    };
    let invalid = |e: &dyn std::fmt::Display| TwinError::Invalid(format!("timing the KV tiers: {e}"));
    let mut e = engine(model, threads, blocks).with_tiers(&tiers).map_err(|e| invalid(&e))?;
    let p = prompt(TOKENS, 900 + salt);
    for (id, push_down) in [(0, true), (1, false)] {
        e.add(RequestId(id), p.clone(), SamplingParams::greedy(1)).map_err(|e| invalid(&e))?;
        while e.has_work() {
            e.step();
        }
        if push_down {
            e.evict_cached();
            e.flush_tiers(true).map_err(|e| invalid(&e))?;
        }
    }
    let t = e.stats().tiers;
    let (n, seconds) = match disk {
        Some(_) => (t.restored_disk, t.restore_seconds_disk),
        None => (t.restored_host, t.restore_seconds_host),
    };
    if n == 0 {
        return Err(invalid(&"no block came back from the tier"));
    }
    Ok(seconds / n as f64)
}

fn engine(model: &Arc<Model>, threads: usize, num_blocks: usize) -> Engine {
    Engine::new(model.clone(), EngineConfig { threads, num_blocks, ..EngineConfig::default() }, Vec::new())
}

/// A prompt of `n` ordinary tokens no other prompt of the run starts like.
fn prompt(n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|i| 1000 + ((i * 7919 + salt * 104_729) % 30_000) as u32).collect()
}

/// Every shape's prefill points, each prompt timed on one shape's engine right after
/// the other's, so that a change in the machine's speed between seconds falls on all
/// shapes alike and not on their ratio.
fn prefill_points(model: &Arc<Model>, threads: &[usize]) -> Vec<Vec<Point>> {
    let lens: Vec<usize> = PREFILL_LENS.iter().copied().filter(|&l| l < model.cfg.context_length).collect();
    let mut engines: Vec<Engine> = threads.iter().map(|&t| engine(model, t, 4096)).collect();
    let mut points = vec![Vec::new(); threads.len()];
    // One untimed warm-up, then two passes.
    for pass in 0..3 {
        for (k, &len) in lens.iter().enumerate() {
            let salt = pass * 100 + k;
            for (e, points) in engines.iter_mut().zip(&mut points) {
                let timed = time_prefill(e, len, salt);
                if pass > 0 {
                    points.extend(timed);
                }
            }
        }
    }
    points
}

/// One prompt of `len` tokens run alone, a point per chunk of the step budget.
fn time_prefill(e: &mut Engine, len: usize, salt: usize) -> Vec<Point> {
    let budget = EngineConfig::default().max_batch_tokens;
    if e.add(RequestId(salt as u64), prompt(len, salt), SamplingParams::greedy(1)).is_err() {
        return Vec::new();
    }
    let mut points = Vec::new();
    let mut start = 0;
    while e.has_work() {
        let t = Instant::now();
        e.step();
        let seconds = t.elapsed().as_secs_f64();
        let n = budget.min(len - start);
        points.push(Point { kind: PointKind::Prefill, size: n, context: start, seconds, fitted: 0.0 });
        start += n;
    }
    points
}

/// Every shape's decode points, the shapes timed in turn at each point of the grid.
fn decode_points(model: &Arc<Model>, threads: &[usize]) -> Vec<Vec<Point>> {
    let c = &model.cfg;
    let mut engines: Vec<Engine> = threads.iter().map(|&t| engine(model, t, 4096)).collect();
    let grid: Vec<(usize, usize)> = DECODE_CONTEXTS
        .iter()
        .filter(|&&x| x + 16 < c.context_length)
        .flat_map(|&ctx| DECODE_BATCHES.iter().map(move |&b| (ctx, b)))
        .collect();
    // Every pass times the whole grid once, so a stretch of seconds in which the
    // machine runs slow falls on one pass of each point, which the median drops.
    let mut times = vec![vec![Vec::new(); grid.len()]; threads.len()];
    let mut next = 10_000u64;
    for _ in 0..DECODE_PASSES {
        for (g, &(ctx, b)) in grid.iter().enumerate() {
            for (e, times) in engines.iter_mut().zip(&mut times) {
                times[g].extend(time_decode_steps(e, model, ctx, b, &mut next));
            }
        }
    }
    // The timed steps ran at contexts ctx + 1 ..= ctx + DECODE_STEPS.
    let mid = DECODE_STEPS.div_ceil(2);
    let point = |(&(ctx, size), t): (&(usize, usize), Vec<f64>)| Point {
        kind: PointKind::Decode,
        size,
        context: ctx + mid,
        seconds: median(t),
        fitted: 0.0,
    };
    times.into_iter().map(|t| grid.iter().zip(t).map(point).collect()).collect()
}

/// Times [`DECODE_STEPS`] decode steps of `b` sequences at `ctx` positions, then
/// runs them to their end.
fn time_decode_steps(e: &mut Engine, model: &Arc<Model>, ctx: usize, b: usize, next: &mut u64) -> Vec<f64> {
    add_decodes(e, model, ctx, b, DECODE_STEPS as u32 + 3, next);
    let times = (0..DECODE_STEPS).map(|_| time_step(e)).collect();
    while e.has_work() {
        e.step();
    }
    times
}

/// Adds `b` sequences at `ctx` positions that will decode `tokens` tokens each.
/// Each sequence's context arrives as a transfer of its own (values that are not a
/// real prompt's: attention costs the same whatever they are), so no two sequences
/// share cached blocks, as in serving.
fn add_decodes(e: &mut Engine, model: &Arc<Model>, ctx: usize, b: usize, tokens: u32, next: &mut u64) {
    let c = &model.cfg;
    let elems = c.n_kv_heads * BLOCK_SIZE * c.head_dim;
    for _ in 0..b {
        let (id, p) = (RequestId(*next), prompt(ctx, *next as usize));
        *next += 1;
        if e.reserve_import(id, ctx).is_err() {
            continue;
        }
        for layer in 0..c.n_layers {
            for index in 0..ctx.div_ceil(BLOCK_SIZE) {
                let fill = half_bits(((index * 31 + layer * 7) % 97) as f32 / 97.0 - 0.5);
                let f = KvFrame {
                    layer: layer as u32,
                    index: index as u32,
                    dtype: KvDtype::F16,
                    k: vec![fill; elems],
                    v: vec![fill; elems],
                };
                let _ = e.import_frame(id, &f);
            }
        }
        let _ = e.finish_import(id, p, 2000, exactly(tokens));
    }
}

fn time_step(e: &mut Engine) -> f64 {
    let t = Instant::now();
    e.step();
    t.elapsed().as_secs_f64()
}

/// The f16 bits of `x`.
fn half_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// What each kind of step does to the other's on a shared machine: a one-thread
/// engine's decode step (4 sequences at 512 positions) and prompt chunk (256 tokens)
/// timed alone, beside a second one-thread engine that decodes, and beside one that
/// prefills; each pair's ratio, the median of five tries.
fn co_run(model: &Arc<Model>) -> CoRun {
    let tries: Vec<[f64; 4]> = (0..5u64).map(|k| co_run_once(model, 80_000 + k * 1_000)).collect();
    let pair = |i: usize| median(tries.iter().map(|t| t[i]).collect()).max(1.0);
    CoRun {
        decode_beside_decode: pair(0),
        decode_beside_prefill: pair(1),
        prefill_beside_decode: pair(2),
        prefill_beside_prefill: pair(3),
    }
}

/// The steps a co-run try times in each condition.
const CO_RUN_DECODES: usize = 20;
const CO_RUN_PROMPTS: usize = 3;
const CO_RUN_PROMPT: usize = 256;

/// One try: [decode beside decode, decode beside prefill, prefill beside decode,
/// prefill beside prefill], each over the same step alone. Alone is timed before
/// and after the neighbours, so a drift through the try falls on both sides of each
/// ratio; every decode window starts fresh sequences at the same context.
fn co_run_once(model: &Arc<Model>, salt: u64) -> [f64; 4] {
    let mut e = engine(model, 1, 2048);
    let mut next = salt;
    let mut timed = || {
        add_decodes(&mut e, model, 512, 4, CO_RUN_DECODES as u32 + 2, &mut next);
        let decode = median((0..CO_RUN_DECODES).map(|_| time_step(&mut e)).collect());
        while e.has_work() {
            e.step();
        }
        let prompts = (0..CO_RUN_PROMPTS).map(|_| {
            add_prompt(&mut e, &mut next);
            let t = Instant::now();
            while e.has_work() {
                e.step();
            }
            t.elapsed().as_secs_f64()
        });
        [decode, median(prompts.collect())]
    };
    let before = timed();
    let by_decode = beside_neighbour(model, Neighbour::Decode, salt + 500, &mut timed);
    let by_prefill = beside_neighbour(model, Neighbour::Prefill, salt + 700, &mut timed);
    let after = timed();
    let alone = [(before[0] + after[0]) / 2.0, (before[1] + after[1]) / 2.0];
    [by_decode[0] / alone[0], by_prefill[0] / alone[0], by_decode[1] / alone[1], by_prefill[1] / alone[1]]
}

/// Adds a co-run prompt no other prompt of the run starts like, to prefill alone.
fn add_prompt(e: &mut Engine, next: &mut u64) {
    *next += 1;
    let _ = e.add(RequestId(*next), prompt(CO_RUN_PROMPT, *next as usize), SamplingParams::greedy(1));
}

#[derive(Clone, Copy)]
enum Neighbour {
    Decode,
    Prefill,
}

/// Runs `timed` while a second one-thread engine computes steps of `neighbour`'s
/// kind without pause on another thread.
fn beside_neighbour<T>(model: &Arc<Model>, neighbour: Neighbour, salt: u64, timed: impl FnOnce() -> T) -> T {
    let (stop, started) = (AtomicBool::new(false), AtomicBool::new(false));
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut e = engine(model, 1, 2048);
            let mut next = salt;
            while !stop.load(Ordering::Relaxed) {
                if !e.has_work() {
                    match neighbour {
                        Neighbour::Decode => add_decodes(&mut e, model, 512, 4, 10_000, &mut next),
                        Neighbour::Prefill => add_prompt(&mut e, &mut next),
                    }
                }
                e.step();
                started.store(true, Ordering::Relaxed);
            }
        });
        while !started.load(Ordering::Relaxed) {
            std::thread::yield_now();
        }
        let out = timed();
        stop.store(true, Ordering::Relaxed);
        out
    })
}

/// The latency and rate of one transport, from a small and a large handoff.
async fn time_link(kind: TransportKind, frame_elems: usize) -> Result<Link, TwinError> {
    let key = ClusterKey::random();
    let inboxes = Inboxes::guarded(256, key.clone(), frame::encoded_len_for(frame_elems));
    let io = |e: std::io::Error| TwinError::Invalid(format!("{kind} receiver: {e}"));
    let sock = std::env::temp_dir().join(format!("pdserve-profile-{}.sock", std::process::id()));
    let at = ListenAt { net: ([127, 0, 0, 1], 0).into(), socket: sock.clone() };
    let rx = pdserve_kv_transfer::bind(kind, &at, inboxes.clone()).await.map_err(io)?;
    let target =
        rx.as_ref().map_or_else(|| pdserve_kv_transfer::in_proc(inboxes.clone()), |r| KvTarget::Remote(r.addr()));
    let links = Arc::new(Links::new(key));
    let mut best = [f64::INFINITY; 2];
    let mut id = 1;
    for _ in 0..3 {
        for (k, bytes) in [LINK_SMALL, LINK_LARGE].into_iter().enumerate() {
            id += 1;
            let secs = handoff(&links, &inboxes, &target, id, bytes, frame_elems).await?;
            best[k] = best[k].min(secs);
        }
    }
    let _ = std::fs::remove_file(&sock);
    let rate = (LINK_LARGE - LINK_SMALL) as f64 / (best[1] - best[0]).max(1e-9);
    let latency = (best[0] - LINK_SMALL as f64 / rate).max(0.0);
    Ok(Link { transport: kind.to_string(), latency_s: latency, bytes_per_s: rate })
}

async fn handoff(
    links: &Arc<Links>,
    inboxes: &Inboxes,
    target: &KvTarget,
    id: u64,
    bytes: usize,
    frame_elems: usize,
) -> Result<f64, TwinError> {
    let hid = HandoffId::from(RequestId(id));
    let mut inbox = inboxes.expect(hid).map_err(|e| TwinError::Invalid(format!("inbox: {e}")))?;
    let token = inbox.token();
    let recycle = inboxes.clone();
    tokio::spawn(async move {
        while let Ok(Some(f)) = inbox.recv().await {
            recycle.recycle(f.k, f.v);
        }
    });
    let (links, target) = (links.clone(), target.clone());
    let took = tokio::task::spawn_blocking(move || probe(&links, &target, hid, token, bytes, frame_elems))
        .await
        .map_err(|e| TwinError::Invalid(format!("link probe: {e}")))?
        .map_err(|e| TwinError::Invalid(format!("link probe: {e}")))?;
    Ok(took.elapsed.as_secs_f64())
}

struct Overheads {
    switch_s: f64,
    admission_s: f64,
}

/// A role switch in place; a 16-token request's trip through a worker less the same
/// prefill on a bare engine (medians of 9).
async fn overheads(model: &Arc<Model>, threads: usize) -> Result<Overheads, TwinError> {
    let opts = WorkerOptions {
        name: "profile".into(),
        role: Role::Mixed,
        model_name: "profile".into(),
        engine: EngineConfig { threads, num_blocks: 256, ..EngineConfig::default() },
        eog: Vec::new(),
        key: ClusterKey::random(),
        grammars: None,
        tiers: Default::default(),
    };
    let w = LocalWorker::spawn(opts, model.clone(), tokio::runtime::Handle::current())
        .map_err(|e| TwinError::Invalid(format!("starting a worker: {e}")))?;
    let mut switch = Vec::new();
    for k in 1..=9u64 {
        let role = if k % 2 == 0 { Role::Mixed } else { Role::Decode };
        let t = Instant::now();
        w.set_role(Assignment::new(role, Epoch(k))).await.map_err(|e| TwinError::Invalid(e.to_string()))?;
        switch.push(t.elapsed().as_secs_f64());
    }
    w.set_role(Assignment::new(Role::Mixed, Epoch(100))).await.map_err(|e| TwinError::Invalid(e.to_string()))?;
    let (mut through, mut bare) = (Vec::new(), Vec::new());
    let mut e = engine(model, threads, 256);
    for k in 0..9 {
        let p = prompt(16, 50_000 + k);
        let (tx, mut rx) = TokenStream::channel(64);
        let req = GenerateRequest {
            id: RequestId(1000 + k as u64),
            tag: "profile".into(),
            prompt: p.clone(),
            params: SamplingParams::greedy(1),
            fence: None,
            trace: Default::default(),
        };
        let t = Instant::now();
        w.generate(req, tx).map_err(|e| TwinError::Invalid(e.to_string()))?;
        while let Some(ev) = rx.next().await {
            if matches!(ev, Event::Done { .. } | Event::Failed(_)) {
                break;
            }
        }
        through.push(t.elapsed().as_secs_f64());
        let q = prompt(16, 60_000 + k);
        let _ = e.add(RequestId(k as u64), q, SamplingParams::greedy(1));
        let t = Instant::now();
        while e.has_work() {
            e.step();
        }
        bare.push(t.elapsed().as_secs_f64());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(Overheads { switch_s: median(switch), admission_s: (median(through) - median(bare)).max(0.0) })
}

/// One 64-token prompt's stream on a bare engine: its decode step (the mean over
/// the stream) and the CPU seconds the whole stream took (prefill and every decode
/// step, on every one of the engine's threads).
fn bare_stream(model: &Arc<Model>, threads: usize, salt: usize) -> (f64, f64) {
    let mut e = engine(model, threads, 256);
    let _ = e.add(RequestId(1), prompt(64, salt), exactly(DECODE_TOKENS));
    let (whole, cpu) = (Instant::now(), pdserve_bench::process::cpu_seconds("self"));
    e.step();
    let t = Instant::now();
    while e.has_work() {
        e.step();
    }
    let tpot = t.elapsed().as_secs_f64() / (DECODE_TOKENS - 1) as f64;
    // Where /proc cannot say, every thread is taken as busy for the whole stream.
    let busy = threads as f64 * whole.elapsed().as_secs_f64();
    let cpu = cpu.zip(pdserve_bench::process::cpu_seconds("self")).map_or(busy, |(before, after)| after - before);
    (tpot, cpu)
}

/// Tokens of each timed stream.
const DECODE_TOKENS: u32 = 65;

fn exactly(n: u32) -> SamplingParams {
    SamplingParams { max_tokens: n, min_tokens: n, ignore_eos: true, ..SamplingParams::default() }
}

/// Times streams served over HTTP by `pdserve serve` (this binary, one aggregated
/// worker of `threads`) to `bench load`'s client, each right after the same stream
/// on a bare engine in this process: what serving adds to each decode step (the
/// worker loop, the router, detokenizing, SSE, the client's parsing) and the CPU
/// the server and the client spent beyond the engine's compute. Paired, a machine
/// whose speed drifts from one pair to the next moves both halves of a pair alike:
/// the per-token cost is the median of the pairs' differences, the CPU the
/// difference of their sums (a process's CPU is counted in 10 ms ticks, too coarse
/// for one stream).
async fn served(spec: &Spec, threads: usize) -> Result<Served, TwinError> {
    let args: Vec<String> = ["--model", &spec.model_arg, "--mode", "aggregated", "--workers", "1"]
        .iter()
        .map(|s| s.to_string())
        .chain(["--threads-per-worker".to_string(), threads.to_string()])
        .collect();
    let log = std::env::temp_dir().join(format!("pdserve-profile-serve-{}.log", std::process::id()));
    let bench = |e: pdserve_bench::BenchError| TwinError::Invalid(format!("timing a served stream: {e}"));
    let mut server = ServerProcess::spawn("profile", &spec.exe, &args, log.clone()).map_err(bench)?;
    let timed = async {
        server.wait_healthy(Duration::from_secs(120)).await?;
        let target = Target::parse(&server.url(), false)?;
        let model = first_model(&target).await?;
        let (endpoint, prompt_kind) = (Endpoint::Completions, PromptKind::Ids);
        let body = BodyOptions { endpoint, prompt_kind, model, temperature: 0.0, token_ids: false };
        let client = Client { target, body, timeout: Duration::from_secs(120) };
        let mut pairs = Vec::new();
        for k in 0..=SERVED_STREAMS {
            let (bare_tpot, bare_stream) = bare_stream(&spec.model, threads, 71_000 + k);
            let before = server.cpu_seconds();
            let spec = RequestSpec {
                index: k,
                prompt: Prompt { prefix: Vec::new(), body: prompt(64, 90_000 + k) },
                output_len: DECODE_TOKENS,
                ..RequestSpec::default()
            };
            let rec = client.send(&spec, tokio::time::Instant::now(), None).await;
            let cpu = server.cpu_seconds().zip(before).map(|(after, before)| after - before + rec.client_busy_s);
            // The first warms the server up.
            if let (true, Some(tpot), Some(cpu)) = (k > 0, rec.tpot_s, cpu) {
                pairs.push(Pair { tpot, bare_tpot, cpu, bare_stream });
            }
        }
        Ok::<_, pdserve_bench::BenchError>(pairs)
    };
    let pairs = timed.await;
    let _ = server.stop(Duration::from_secs(5)).await;
    let _ = std::fs::remove_file(&log);
    let pairs = pairs.map_err(bench)?;
    if pairs.is_empty() {
        return Err(TwinError::Invalid("no served stream could be timed".into()));
    }
    let of = |f: fn(&Pair) -> f64| median(pairs.iter().map(f).collect());
    Ok(Served {
        tpot_s: of(|p| p.tpot),
        bare_tpot_s: of(|p| p.bare_tpot),
        token_s: of(|p| p.tpot - p.bare_tpot).max(0.0),
        host_token_s: (pairs.iter().map(|p| p.cpu - p.bare_stream).sum::<f64>()
            / (pairs.len() * DECODE_TOKENS as usize) as f64)
            .max(0.0),
    })
}

/// Streams [`served`] times after its warm-up.
const SERVED_STREAMS: usize = 5;

/// A served stream and the same stream on a bare engine just before it.
struct Pair {
    tpot: f64,
    bare_tpot: f64,
    /// CPU seconds the server and the client used for the served stream, and the
    /// bare engine for the same stream (every compute thread's).
    cpu: f64,
    bare_stream: f64,
}

/// What [`served`] measured.
struct Served {
    /// Medians of the served TPOT and of the bare decode step.
    tpot_s: f64,
    bare_tpot_s: f64,
    /// Serving's seconds per token beyond the bare step.
    token_s: f64,
    /// Host CPU per streamed token beyond the engine's compute.
    host_token_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
