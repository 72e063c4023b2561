//! Benchmarks of the engine alone, as `pdserve bench engine` and `bench grammar` run
//! them: prompts are random token ids (no special tokens), generation ignores EOS,
//! so every run does exactly the work it reports. Prefill is timed from `add` to the
//! first token; decode is timed once every sequence has its first token, until all
//! finish. With speculation, each decode figure is taken without it and with it in the
//! same run; with a text, decode prompts quote it (input-grounded: the answer repeats
//! the prompt, where drafts pay).

use crate::batch::{Engine, EngineConfig, SpecConfig};
use crate::grammar::Grammars;
use crate::loader::LoadedModel;
use pdserve_types::{Grammar, GrammarSpec, KvDtype, RequestId, SamplingParams, SpecTotals};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// What `bench engine` measures.
#[derive(Debug, Clone)]
pub struct EngineBench {
    /// Thread counts to measure.
    pub threads: Vec<usize>,
    /// Prompt lengths for the prefill measurement.
    pub prefill: Vec<usize>,
    /// Batch sizes for the decode measurement.
    pub batch: Vec<usize>,
    /// Prompt length before decoding.
    pub decode_prompt: usize,
    /// Tokens generated per sequence in the decode measurement.
    pub decode_tokens: u32,
    /// Repetitions; the best is reported.
    pub reps: usize,
    /// How the KV cache stores its values.
    pub kv_dtype: KvDtype,
    /// Speculation to measure each decode figure with, beside the figure without.
    pub speculation: Option<SpecConfig>,
    /// What the decode prompts are.
    pub decode_prompts: DecodePrompts,
}

/// The prompts of the decode measurement.
#[derive(Debug, Clone)]
pub enum DecodePrompts {
    /// Random token ids.
    Random,
    /// Passages of a text (its token ids), for the model to go on with.
    Continue(Vec<u32>),
    /// Passages of a text followed by their first tokens again, so that the model's
    /// likeliest continuation quotes the passage (input-grounded).
    Quote(Vec<u32>),
}

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub kind: &'static str,
    pub threads: usize,
    pub prompt: usize,
    pub batch: usize,
    pub tokens_per_s: f64,
    /// Decoded with [`EngineBench::speculation`].
    pub speculative: bool,
    /// Drafted tokens verified and accepted (in the run reported).
    pub drafted: u64,
    pub accepted: u64,
}

/// Everything `bench engine` measured.
#[derive(Debug, Serialize)]
pub struct Report {
    pub model: String,
    pub isa: String,
    pub rows: Vec<Row>,
    pub peak_rss_mb: f64,
    /// Resident memory once the model is loaded.
    pub loaded_rss_mb: f64,
    /// Bytes of the weights as the engine holds them (repacked).
    pub weight_bytes: usize,
    /// Memory read bandwidth at each thread count, GB/s, measured in the same run:
    /// the roofline of decode.
    pub read_gb_per_s: Vec<(usize, f64)>,
}

/// Measures `m` as `b` says, handing each figure to `each` as it is taken.
pub fn engine(m: &LoadedModel, b: &EngineBench, mut each: impl FnMut(&Row)) -> Report {
    let loaded_rss_mb = rss_mb("VmRSS:");
    let read_gb_per_s: Vec<(usize, f64)> = b.threads.iter().map(|&t| (t, read_bandwidth(t))).collect();
    let mut rows = Vec::new();
    let mut push = |row: Row| {
        each(&row);
        rows.push(row);
    };
    for &threads in &b.threads {
        for &p in &b.prefill {
            let tps = best_of(b.reps, || prefill(m, b.kv_dtype, threads, p));
            let row = Row {
                kind: "prefill",
                threads,
                prompt: p,
                batch: 1,
                tokens_per_s: tps,
                speculative: false,
                drafted: 0,
                accepted: 0,
            };
            push(row);
        }
        // llama-bench's tg128: generation from an (almost) empty context (not with a
        // text to quote: a one-token prompt quotes nothing).
        let shapes = matches!(b.decode_prompts, DecodePrompts::Random).then_some((1, 1)).into_iter();
        for (prompt, batch) in shapes.chain(b.batch.iter().map(|&n| (b.decode_prompt, n))) {
            for spec in [None].into_iter().chain(b.speculation.as_ref().map(Some)) {
                let (mut tps, mut totals) = (0.0, SpecTotals::default());
                for _ in 0..b.reps.max(1) {
                    let (t, s) = decode(m, b, threads, batch, prompt, spec);
                    if t > tps {
                        (tps, totals) = (t, s);
                    }
                }
                let speculative = spec.is_some();
                let (drafted, accepted) = (totals.drafted, totals.accepted);
                push(Row { kind: "decode", threads, prompt, batch, tokens_per_s: tps, speculative, drafted, accepted });
            }
        }
    }
    Report {
        model: m.name.clone(),
        isa: crate::kernels::Isa::detect().to_string(),
        rows,
        peak_rss_mb: peak_rss_mb(),
        loaded_rss_mb,
        weight_bytes: m.model.weight_bytes(),
        read_gb_per_s,
    }
}

/// What `bench grammar` measures.
#[derive(Debug, Clone)]
pub struct GrammarBench {
    /// Compute threads of the engine.
    pub threads: usize,
    /// Batch sizes (sequences decoding together).
    pub batch: Vec<usize>,
    /// Tokens generated per sequence.
    pub decode_tokens: u32,
    /// Repetitions; the best is reported.
    pub reps: usize,
}

/// The constraint of the grammar benchmark: a long list of short strings, which no
/// sequence finishes within the measured tokens, so every step is constrained.
const BENCH_SCHEMA: &str =
    r#"{"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 200, "maxItems": 200}"#;

#[derive(Debug, Clone, Serialize)]
pub struct GrammarRow {
    pub threads: usize,
    pub batch: usize,
    pub plain_tokens_per_s: f64,
    pub constrained_tokens_per_s: f64,
    /// constrained / plain.
    pub ratio: f64,
    pub mask_p50_us: f64,
    pub mask_p99_us: f64,
}

/// Decode throughput of `m` with a JSON-Schema constraint against none, at each
/// batch size of `b`, handing each row to `each` as it is taken.
pub fn grammar(
    m: &LoadedModel,
    grammars: &Arc<Grammars>,
    b: &GrammarBench,
    mut each: impl FnMut(&GrammarRow),
) -> Vec<GrammarRow> {
    let prompt = m
        .tokenizer
        .encode("<|im_start|>user\nList two hundred words as a JSON array.<|im_end|>\n<|im_start|>assistant\n", true);
    let grammar = Grammar::new(GrammarSpec::JsonSchema(BENCH_SCHEMA.into()));
    let mut rows = Vec::new();
    for &batch in &b.batch {
        let plain = best_of(b.reps, || constrained_decode(m, &prompt, None, b.threads, batch, b.decode_tokens).0);
        let mut runs = Vec::new();
        for _ in 0..b.reps.max(1) {
            runs.push(constrained_decode(m, &prompt, Some((grammars, &grammar)), b.threads, batch, b.decode_tokens));
        }
        let (tps, p50, p99) = runs.into_iter().fold((0.0, 0.0, 0.0), |best, r| if r.0 > best.0 { r } else { best });
        let row = GrammarRow {
            threads: b.threads,
            batch,
            plain_tokens_per_s: plain,
            constrained_tokens_per_s: tps,
            ratio: tps / plain,
            mask_p50_us: p50 * 1e6,
            mask_p99_us: p99 * 1e6,
        };
        each(&row);
        rows.push(row);
    }
    rows
}

/// Decode tokens per second of `batch` copies of `prompt` (their prefill not
/// counted), constrained by `grammar` or not; with the mask time p50 and p99 (s).
fn constrained_decode(
    m: &LoadedModel,
    prompt: &[u32],
    grammar: Option<(&Arc<Grammars>, &Grammar)>,
    threads: usize,
    batch: usize,
    gen: u32,
) -> (f64, f64, f64) {
    let mut e = new_engine(m, KvDtype::F16, threads, batch * (prompt.len() + gen as usize), batch, None, STEP_TOKENS);
    let mut p = params(gen);
    if let Some((gs, g)) = grammar {
        e = e.with_grammars(gs.clone());
        p.grammar = Some(g.clone());
    }
    for i in 0..batch {
        if e.add(RequestId(i as u64), prompt.to_vec(), p.clone()).is_err() {
            return (0.0, 0.0, 0.0);
        }
    }
    let rate = decode_rate(&mut e, batch);
    let clock = e.mask_clock();
    (rate, clock.quantile(0.5), clock.quantile(0.99))
}

fn best_of(reps: usize, mut f: impl FnMut() -> f64) -> f64 {
    (0..reps.max(1)).map(|_| f()).fold(0.0, f64::max)
}

/// The serving default's token budget of a step.
const STEP_TOKENS: usize = 512;

/// An engine of blocks enough for `tokens` over `seqs` sequences, `max_batch_tokens`
/// a step.
fn new_engine(
    m: &LoadedModel,
    kv_dtype: KvDtype,
    threads: usize,
    tokens: usize,
    seqs: usize,
    speculation: Option<&SpecConfig>,
    max_batch_tokens: usize,
) -> Engine {
    let cfg = EngineConfig {
        threads,
        num_blocks: tokens.div_ceil(16) + seqs + 8,
        kv_dtype,
        max_batch_tokens,
        max_seqs: seqs.max(1),
        cache_salt: 0,
        objectives: None,
        speculation: speculation.cloned(),
    };
    Engine::new(m.model.clone(), cfg, Vec::new())
}

/// Token ids from a fixed generator, skipping the low ids where special tokens live.
pub fn random_prompt(len: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (1000 + x % (vocab as u64 - 1000)) as u32
        })
        .collect()
}

fn params(max_tokens: u32) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, ..Default::default() }
}

fn prefill(m: &LoadedModel, kv: KvDtype, threads: usize, len: usize) -> f64 {
    let mut e = new_engine(m, kv, threads, len + 1, 1, None, STEP_TOKENS);
    let prompt = random_prompt(len, len as u64, m.model.cfg.vocab_size);
    let t = Instant::now();
    if e.add(RequestId(0), prompt, params(1)).is_err() {
        return 0.0;
    }
    while e.has_work() {
        e.step();
    }
    len as f64 / t.elapsed().as_secs_f64()
}

/// Decode tokens per second, and the speculation totals of the run.
fn decode(
    m: &LoadedModel,
    b: &EngineBench,
    threads: usize,
    batch: usize,
    prompt: usize,
    spec: Option<&SpecConfig>,
) -> (f64, SpecTotals) {
    let gen = b.decode_tokens;
    // Drafted rows need blocks past the sequence's end too.
    let seqs = batch * if spec.is_some() { 2 } else { 1 };
    // Every prompt in one step, so that every sequence decodes from the same step on:
    // the figure is of `batch` sequences decoding together (one that started early
    // and drafted would otherwise be done before the clock starts).
    let step = (batch * (prompt + 1)).max(STEP_TOKENS);
    let mut e = new_engine(m, b.kv_dtype, threads, batch * (prompt + gen as usize), seqs, spec, step);
    for i in 0..batch {
        let p = match &b.decode_prompts {
            DecodePrompts::Random => random_prompt(prompt, 1000 + i as u64, m.model.cfg.vocab_size),
            DecodePrompts::Continue(text) => passage(text, prompt, i, 0),
            DecodePrompts::Quote(text) => passage(text, prompt, i, (prompt / 4).min(32)),
        };
        if e.add(RequestId(i as u64), p, params(gen)).is_err() {
            return (0.0, SpecTotals::default());
        }
    }
    (decode_rate(&mut e, batch), e.stats().spec)
}

/// The `i`th prompt of `len` tokens from `text`: a passage of it, then its first
/// `again` tokens again.
fn passage(text: &[u32], len: usize, i: usize, again: usize) -> Vec<u32> {
    let n = len - again;
    let start = (i * n) % text.len().saturating_sub(n).max(1);
    let p = &text[start..(start + n).min(text.len())];
    p.iter().chain(&p[..again.min(p.len())]).copied().collect()
}

/// Tokens per second of `e`'s `batch` queued requests (ids 0..batch) once all of them
/// have started: their prefills, and tokens sampled meanwhile, are not counted.
fn decode_rate(e: &mut Engine, batch: usize) -> f64 {
    let mut started = vec![false; batch];
    while started.iter().any(|s| !s) && e.has_work() {
        for o in e.step() {
            started[o.id.0 as usize] = true;
        }
    }
    let (t, mut n) = (Instant::now(), 0usize);
    while e.has_work() {
        n += e.step().len();
    }
    n as f64 / t.elapsed().as_secs_f64()
}

/// High-water mark of resident memory, from /proc (0 where unavailable).
fn peak_rss_mb() -> f64 {
    rss_mb("VmHWM:")
}

/// A memory figure of /proc/self/status in MB (0 where unavailable).
fn rss_mb(key: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// GB/s of `threads` threads summing disjoint parts of a 1 GiB buffer, best of three:
/// what a memory-bound decode can read at most.
fn read_bandwidth(threads: usize) -> f64 {
    let buf: Vec<u64> = (0..(1usize << 27)).map(|i| i as u64).collect();
    let part = buf.len().div_ceil(threads.max(1));
    let once = || {
        let t = Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let jobs: Vec<_> =
                buf.chunks(part).map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))).collect();
            jobs.into_iter().map(|j| j.join().unwrap_or(0)).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        (buf.len() * 8) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    (0..3).map(|_| once()).fold(0.0, f64::max)
}
