//! Benchmarks of the engine alone, as `pdserve bench engine` and `bench grammar` run
//! them: prompts are random token ids (no special tokens), generation ignores EOS,
//! so every run does exactly the work it reports. Prefill is timed from `add` to the
//! first token; decode is timed once every sequence has its first token, until all
//! finish.

use crate::batch::{Engine, EngineConfig};
use crate::grammar::Grammars;
use crate::loader::LoadedModel;
use pdserve_types::{Grammar, GrammarSpec, KvDtype, RequestId, SamplingParams};
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
}

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub kind: &'static str,
    pub threads: usize,
    pub prompt: usize,
    pub batch: usize,
    pub tokens_per_s: f64,
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
            push(Row { kind: "prefill", threads, prompt: p, batch: 1, tokens_per_s: tps });
        }
        // llama-bench's tg128: generation from an (almost) empty context.
        let tps = best_of(b.reps, || decode(m, b.kv_dtype, threads, 1, 1, b.decode_tokens));
        push(Row { kind: "decode", threads, prompt: 1, batch: 1, tokens_per_s: tps });
        for &n in &b.batch {
            let tps = best_of(b.reps, || decode(m, b.kv_dtype, threads, n, b.decode_prompt, b.decode_tokens));
            push(Row { kind: "decode", threads, prompt: b.decode_prompt, batch: n, tokens_per_s: tps });
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
    let mut e = new_engine(m, KvDtype::F16, threads, batch * (prompt.len() + gen as usize), batch);
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

fn new_engine(m: &LoadedModel, kv_dtype: KvDtype, threads: usize, tokens: usize, seqs: usize) -> Engine {
    let cfg = EngineConfig {
        threads,
        num_blocks: tokens.div_ceil(16) + seqs + 8,
        kv_dtype,
        max_batch_tokens: 512,
        max_seqs: seqs.max(1),
        cache_salt: 0,
        objectives: None,
        speculation: None,
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
    let mut e = new_engine(m, kv, threads, len + 1, 1);
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

fn decode(m: &LoadedModel, kv: KvDtype, threads: usize, batch: usize, prompt: usize, gen: u32) -> f64 {
    let mut e = new_engine(m, kv, threads, batch * (prompt + gen as usize), batch);
    for i in 0..batch {
        let p = random_prompt(prompt, 1000 + i as u64, m.model.cfg.vocab_size);
        if e.add(RequestId(i as u64), p, params(gen)).is_err() {
            return 0.0;
        }
    }
    decode_rate(&mut e, batch)
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
