//! `pdserve bench engine`: prefill and decode throughput of the engine alone.
//!
//! Prompts are random token ids (no special tokens), generation ignores EOS, so every
//! run does exactly the work it reports. Prefill is timed from `add` to the first
//! token; decode is timed once every sequence has its first token, until all finish.

use anyhow::Context;
use pdserve_engine::engine::{Engine, EngineConfig};
use pdserve_engine::loader::LoadedModel;
use pdserve_types::{RequestId, SamplingParams};
use serde::Serialize;
use std::time::Instant;

#[derive(clap::Subcommand)]
pub enum What {
    /// Prefill and batched-decode throughput of one engine.
    Engine(EngineArgs),
}

#[derive(clap::Args)]
pub struct EngineArgs {
    #[arg(long, default_value = "default")]
    model: String,
    /// Thread counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Prompt lengths for the prefill measurement.
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    prefill: Vec<usize>,
    /// Batch sizes for the decode measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32")]
    batch: Vec<usize>,
    /// Prompt length before decoding.
    #[arg(long, default_value_t = 512)]
    decode_prompt: usize,
    /// Tokens generated per sequence in the decode measurement.
    #[arg(long, default_value_t = 128)]
    decode_tokens: u32,
    /// Repetitions; the best is reported (as llama-bench reports the mean of quiet runs).
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Row {
    kind: &'static str,
    threads: usize,
    prompt: usize,
    batch: usize,
    tokens_per_s: f64,
}

#[derive(Serialize)]
struct Report {
    model: String,
    isa: String,
    rows: Vec<Row>,
    peak_rss_mb: f64,
}

pub fn run(what: What) -> anyhow::Result<()> {
    let What::Engine(a) = what;
    let m = super::load_model(&a.model)?;
    let mut rows = Vec::new();
    for &threads in &a.threads {
        for &p in &a.prefill {
            let tps = best_of(a.reps, || prefill(&m, threads, p));
            println!("prefill  threads={threads} prompt={p:<5}        {tps:8.1} tok/s");
            rows.push(Row { kind: "prefill", threads, prompt: p, batch: 1, tokens_per_s: tps });
        }
        // llama-bench's tg128: generation from an (almost) empty context.
        let tps = best_of(a.reps, || decode(&m, threads, 1, 1, a.decode_tokens));
        println!("decode   threads={threads} prompt=1     batch=1   {tps:8.1} tok/s");
        rows.push(Row { kind: "decode", threads, prompt: 1, batch: 1, tokens_per_s: tps });
        for &b in &a.batch {
            let tps = best_of(a.reps, || decode(&m, threads, b, a.decode_prompt, a.decode_tokens));
            println!("decode   threads={threads} prompt={:<5} batch={b:<3} {tps:8.1} tok/s", a.decode_prompt);
            rows.push(Row { kind: "decode", threads, prompt: a.decode_prompt, batch: b, tokens_per_s: tps });
        }
    }
    let report = Report {
        model: m.name.clone(),
        isa: pdserve_engine::kernels::Isa::detect().to_string(),
        rows,
        peak_rss_mb: peak_rss_mb(),
    };
    println!("peak RSS {:.0} MB, kernels {}", report.peak_rss_mb, report.isa);
    if let Some(path) = &a.out {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn best_of(reps: usize, mut f: impl FnMut() -> f64) -> f64 {
    (0..reps.max(1)).map(|_| f()).fold(0.0, f64::max)
}

fn engine(m: &LoadedModel, threads: usize, tokens: usize, seqs: usize) -> Engine {
    let cfg = EngineConfig {
        threads,
        num_blocks: tokens.div_ceil(16) + seqs + 8,
        max_batch_tokens: 512,
        max_seqs: seqs.max(1),
        cache_salt: 0,
    };
    Engine::new(m.model.clone(), cfg, Vec::new())
}

/// Token ids from a fixed generator, skipping the low ids where special tokens live.
fn random_prompt(len: usize, seed: u64, vocab: usize) -> Vec<u32> {
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

fn prefill(m: &LoadedModel, threads: usize, len: usize) -> f64 {
    let mut e = engine(m, threads, len + 1, 1);
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

fn decode(m: &LoadedModel, threads: usize, batch: usize, prompt: usize, gen: u32) -> f64 {
    let mut e = engine(m, threads, batch * (prompt + gen as usize), batch);
    for i in 0..batch {
        let p = random_prompt(prompt, 1000 + i as u64, m.model.cfg.vocab_size);
        if e.add(RequestId(i as u64), p, params(gen)).is_err() {
            return 0.0;
        }
    }
    // Prefill everything first; tokens sampled meanwhile are not counted.
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
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}
