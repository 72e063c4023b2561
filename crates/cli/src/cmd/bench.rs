//! `pdserve bench`: `engine` measures the engine alone (below); `load` and `compare`
//! are argument parsing over `pdserve-bench` (docs/bench.md).
//!
//! `bench engine`: prompts are random token ids (no special tokens), generation
//! ignores EOS, so every run does exactly the work it reports. Prefill is timed from
//! `add` to the first token; decode is timed once every sequence has its first token,
//! until all finish.

use anyhow::Context;
use pdserve_bench::arrivals::ArrivalKind;
use pdserve_bench::compare::suite::Named;
use pdserve_bench::compare::{run_compare, CompareOptions};
use pdserve_bench::lengths::LengthSpec;
use pdserve_bench::load::{run_load, LoadOptions, Sweep};
use pdserve_bench::metrics::Slo;
use pdserve_bench::openai::{BodyOptions, Endpoint};
use pdserve_bench::prompt::{PromptKind, TokenRange};
use pdserve_bench::workload::{PrefixOrder, Replies, WorkloadFlags};
use pdserve_engine::batch::{Engine, EngineConfig};
use pdserve_engine::grammar::Grammars;
use pdserve_engine::loader::LoadedModel;
use pdserve_types::{RequestId, SamplingParams};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Subcommand)]
pub enum What {
    /// Prefill and batched-decode throughput of one engine.
    Engine(EngineArgs),
    /// Load an OpenAI-compatible server (pdserve, llama-server, vLLM) and report
    /// TTFT, TPOT, ITL, E2E, throughput and goodput per point.
    Load(LoadArgs),
    /// Start every serving topology of a thread budget in turn and compare them.
    Compare(CompareArgs),
    /// Decode throughput of one engine with a JSON-Schema constraint against none,
    /// and the time of each token mask.
    Grammar(GrammarArgs),
    /// Time to first token of a prefix the pool evicted: recomputed, copied back
    /// from the host-RAM tier, or read back from the disk tier.
    Tiers(super::bench_tiers::TiersArgs),
    /// How long a fleet role switch takes, from the planner's decision to the worker
    /// admitting work in its new role (takes the planner lease; no planner may run).
    Switch(super::bench_switch::SwitchArgs),
    /// A worker leaving decode with long decodes in flight: its sequences finished in
    /// place against handed over by their KV, timed, tokens checked.
    Migrate(super::bench_migrate::MigrateArgs),
}

#[derive(clap::Args)]
pub struct GrammarArgs {
    /// `default`, a model `pdserve pull --list` names, or a path to a GGUF file or
    /// safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// Compute threads of the engine.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Batch sizes (sequences decoding together).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batch: Vec<usize>,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 128)]
    decode_tokens: u32,
    /// Repetitions; the best is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct LoadArgs {
    /// Server base URL (with or without /v1).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Allow a non-loopback URL.
    #[arg(long)]
    allow_remote: bool,
    /// completions | chat.
    #[arg(long, default_value = "completions")]
    endpoint: Endpoint,
    /// ids (token-id prompts, exact lengths) | text (words); default ids, text for chat.
    #[arg(long)]
    prompt: Option<PromptKind>,
    /// The `model` field (default: the first model of the server's /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Sampling temperature of every request (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[command(flatten)]
    work: WorkloadArgs,
    /// Per-request timeout.
    #[arg(long, default_value_t = 600)]
    timeout_seconds: u64,
    /// Also run every point against an instant in-process server (client floor).
    #[arg(long)]
    calibrate: bool,
    /// Write every request record and the summaries as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// What `bench load` sends and how (and what `pdserve sim` simulates).
#[derive(clap::Args)]
pub struct WorkloadArgs {
    /// Closed loop at each of these concurrencies (default 1).
    #[arg(long, value_delimiter = ',')]
    pub concurrency: Option<Vec<usize>>,
    /// Open loop at each of these request rates (requests/s) instead.
    #[arg(long, value_delimiter = ',')]
    pub rate: Vec<f64>,
    /// Open-loop arrivals: poisson | gamma.
    #[arg(long, default_value = "poisson")]
    pub arrivals: ArrivalKind,
    /// Gamma shape (1 = Poisson, < 1 burstier).
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Prompt length: N, MIN..MAX (uniform) or MEAN~STD (normal).
    #[arg(long, default_value = "512")]
    pub input_len: LengthSpec,
    /// Output length, same forms (exact: min_tokens = max_tokens, ignore_eos).
    #[arg(long, default_value = "128")]
    pub output_len: LengthSpec,
    /// Number of shared system prefixes (0: none); each request = a prefix + --input-len.
    #[arg(long, default_value_t = 0)]
    pub shared_prefixes: usize,
    /// Tokens per shared prefix.
    #[arg(long, default_value_t = 1024)]
    pub prefix_len: usize,
    /// Which prefix a request takes: `random` (a seeded draw each) or `cycle` (request
    /// i takes prefix i mod N, an LRU's worst case).
    #[arg(long, default_value = "random")]
    pub prefix_order: PrefixOrder,
    /// The fraction of requests that take a shared prefix; the others take as many
    /// tokens of their own in its place (e.g. 0.9: one hot prefix in 90 % of requests).
    #[arg(long, default_value_t = 1.0)]
    pub prefix_share: f64,
    /// Chat users holding multi-turn conversations (0: single requests). Each turn's
    /// prompt is its conversation so far plus a new message of --input-len tokens.
    #[arg(long, default_value_t = 0)]
    pub conversations: usize,
    /// Turns per conversation, in the forms of --input-len.
    #[arg(long, default_value = "5..10")]
    pub turns: LengthSpec,
    /// What stands for a reply in a conversation's later turns: `random` tokens of
    /// its length (any server), or the reply the server `generated` (its token ids,
    /// asked for with vLLM's `return_token_ids`; completions with id prompts only).
    #[arg(long, default_value = "random")]
    pub replies: Replies,
    /// Replay a Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Tokens per trace hash id.
    #[arg(long, default_value_t = 512)]
    pub trace_block_size: usize,
    /// Replay the trace this many times faster.
    #[arg(long, default_value_t = 1.0)]
    pub trace_speedup: f64,
    /// A phase of a shifting workload, LABEL:SECONDS:RATE:ISL/OSL[+ISL/OSL][:sin=PERIOD];
    /// repeat it to play phases back to back as one point (they set its length).
    #[arg(long)]
    pub phase: Vec<pdserve_bench::phases::Phase>,
    /// Token ids are drawn from LO..HI (avoid the special tokens).
    #[arg(long, default_value = "1000..40000")]
    pub token_range: TokenRange,
    /// Seed of the workload: the same seed gives the same prompts and lengths.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Requests per point at most (closed loop: at least 2 × concurrency).
    #[arg(long, default_value_t = 100)]
    pub requests: usize,
    /// Seconds per point at most (issuing stops; requests in flight finish).
    #[arg(long, default_value_t = 120.0)]
    pub seconds: f64,
    /// Goodput SLO on TTFT.
    #[arg(long, default_value_t = 5000.0)]
    pub slo_ttft_ms: f64,
    /// Goodput SLO on TPOT.
    #[arg(long, default_value_t = 50.0)]
    pub slo_tpot_ms: f64,
    /// Requests sent one at a time before measuring.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
}

#[derive(clap::Args)]
pub struct CompareArgs {
    /// Total compute threads every topology gets.
    #[arg(long, default_value_t = 2)]
    budget: usize,
    /// prefill-heavy, decode-heavy, balanced, shared-prefix.
    #[arg(long, value_delimiter = ',', default_value = "prefill-heavy,decode-heavy,balanced,shared-prefix")]
    workloads: Vec<Named>,
    /// Closed-loop concurrencies.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    concurrency: Vec<usize>,
    /// Open-loop request rates instead of concurrencies.
    #[arg(long, value_delimiter = ',')]
    rate: Vec<f64>,
    /// Open-loop arrivals: poisson | gamma.
    #[arg(long, default_value = "poisson")]
    arrivals: ArrivalKind,
    /// Gamma shape (1 = Poisson, < 1 burstier).
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// Requests per point at most (closed loop: at least 2 × concurrency).
    #[arg(long, default_value_t = 32)]
    requests_per_point: usize,
    /// Seconds per point at most.
    #[arg(long, default_value_t = 30.0)]
    seconds_per_point: f64,
    /// Topologies to run (names, or the families replicated and disagg; default all).
    #[arg(long, value_delimiter = ',')]
    topologies: Vec<String>,
    /// Also measure an external OpenAI-compatible server already running here.
    #[arg(long)]
    peer_url: Option<String>,
    /// Allow a non-loopback URL.
    #[arg(long)]
    allow_remote: bool,
    /// Output directory: results.json, results.md, plots/*.svg, logs/.
    #[arg(long, default_value = "bench-results/compare")]
    out: PathBuf,
    /// Model every topology serves (`default` or a path).
    #[arg(long, default_value = "default")]
    model: String,
    /// KV blocks per worker for every topology.
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Also simulate every measured topology on this profile (`pdserve sim`) and
    /// write the predictions and their errors beside the measurements
    /// (predicted.json, predicted.md).
    #[arg(long)]
    sim: Option<PathBuf>,
    /// Extra argument for every `pdserve serve` (repeat it).
    #[arg(long, allow_hyphen_values = true)]
    serve_arg: Vec<String>,
    /// ids (token-id prompts, exact lengths) | text (words).
    #[arg(long, default_value = "ids")]
    prompt: PromptKind,
    /// Token ids are drawn from LO..HI (avoid the special tokens).
    #[arg(long, default_value = "1000..40000")]
    token_range: TokenRange,
    /// Seed of the workload: the same seed gives the same prompts and lengths.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Goodput SLO on TTFT.
    #[arg(long, default_value_t = 5000.0)]
    slo_ttft_ms: f64,
    /// Goodput SLO on TPOT.
    #[arg(long, default_value_t = 50.0)]
    slo_tpot_ms: f64,
    /// Per-request timeout.
    #[arg(long, default_value_t = 600)]
    timeout_seconds: u64,
    /// How long a topology may take to answer /health.
    #[arg(long, default_value_t = 300)]
    startup_timeout_seconds: u64,
    /// Requests sent one at a time before measuring, per topology.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Keep the runs of this earlier results.json (same sweep) for the topologies not selected.
    #[arg(long)]
    reuse: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct EngineArgs {
    /// `default`, a model `pdserve pull --list` names, or a path to a GGUF file or
    /// safetensors directory.
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
    /// Resident memory once the model is loaded.
    loaded_rss_mb: f64,
    /// Bytes of the weights as the engine holds them (repacked).
    weight_bytes: usize,
    /// Memory read bandwidth at each thread count, GB/s, measured in the same run:
    /// the roofline of decode.
    read_gb_per_s: Vec<(usize, f64)>,
}

pub fn run(what: What) -> anyhow::Result<()> {
    match what {
        What::Engine(a) => engine_bench(a),
        What::Load(a) => load(a),
        What::Compare(a) => compare(a),
        What::Grammar(a) => grammar_bench(a),
        What::Tiers(a) => super::bench_tiers::run(a),
        What::Switch(a) => super::bench_switch::run(a),
        What::Migrate(a) => super::bench_migrate::run(a),
    }
}

impl WorkloadArgs {
    pub fn workload(&self) -> anyhow::Result<pdserve_bench::workload::Workload> {
        let flags = WorkloadFlags {
            input: self.input_len,
            output: self.output_len,
            shared_prefixes: self.shared_prefixes,
            prefix_len: self.prefix_len,
            prefix_order: self.prefix_order,
            prefix_share: self.prefix_share,
            conversations: self.conversations,
            turns: self.turns,
            replies: self.replies,
            trace: self.trace.clone(),
            trace_block_size: self.trace_block_size,
            phases: self.phase.clone(),
            range: self.token_range,
            seed: self.seed,
        };
        Ok(flags.build()?)
    }

    pub fn sweep(&self) -> anyhow::Result<Sweep> {
        let trace_speedup = self.trace.as_ref().map(|_| self.trace_speedup);
        let (c, r) = (self.concurrency.clone(), self.rate.clone());
        let phased = !self.phase.is_empty();
        Ok(Sweep::from_flags(c, r, self.arrivals, self.burstiness, trace_speedup, phased)?)
    }

    pub fn slo(&self) -> Slo {
        Slo { ttft_ms: self.slo_ttft_ms, tpot_ms: self.slo_tpot_ms }
    }
}

fn load(a: LoadArgs) -> anyhow::Result<()> {
    let w = &a.work;
    let default_prompt = if a.endpoint == Endpoint::Chat { PromptKind::Text } else { PromptKind::Ids };
    let workload = w.workload()?;
    let opts = LoadOptions {
        url: a.url,
        allow_remote: a.allow_remote,
        body: BodyOptions {
            endpoint: a.endpoint,
            prompt_kind: a.prompt.unwrap_or(default_prompt),
            model: a.model,
            temperature: a.temperature,
            token_ids: workload.generates_replies(),
        },
        workload,
        sweep: w.sweep()?,
        requests: w.requests,
        seconds: w.seconds,
        timeout: Duration::from_secs(a.timeout_seconds),
        slo: w.slo(),
        warmup: w.warmup,
        calibrate: a.calibrate,
        out: a.out,
    };
    let report = run_load(&opts)?;
    print!("{}", pdserve_bench::report::markdown::load_report(&report));
    Ok(())
}

fn compare(a: CompareArgs) -> anyhow::Result<()> {
    // Read before measuring: a bad profile should not cost the whole comparison.
    let profile = a.sim.as_deref().map(pdserve_twin::profile::Profile::load).transpose()?;
    let concurrency = if a.rate.is_empty() { Some(a.concurrency) } else { None };
    let opts = CompareOptions {
        budget: a.budget,
        workloads: a.workloads,
        sweep: Sweep::from_flags(concurrency, a.rate, a.arrivals, a.burstiness, None, false)?,
        requests_per_point: a.requests_per_point,
        seconds_per_point: a.seconds_per_point,
        topologies: a.topologies,
        peer_url: a.peer_url,
        allow_remote: a.allow_remote,
        out: a.out,
        model: a.model,
        kv_blocks: a.kv_blocks,
        serve_args: a.serve_arg,
        body: BodyOptions {
            endpoint: Endpoint::Completions,
            prompt_kind: a.prompt,
            model: None,
            temperature: 0.0,
            token_ids: false,
        },
        range: a.token_range,
        seed: a.seed,
        slo: Slo { ttft_ms: a.slo_ttft_ms, tpot_ms: a.slo_tpot_ms },
        timeout: Duration::from_secs(a.timeout_seconds),
        startup_timeout: Duration::from_secs(a.startup_timeout_seconds),
        warmup: a.warmup,
        exe: None,
        reuse: a.reuse,
    };
    let report = run_compare(&opts)?;
    let md = opts.out.join("results.md");
    print!("{}", std::fs::read_to_string(&md).with_context(|| format!("reading {}", md.display()))?);
    if let Some(profile) = &profile {
        super::twin::compare_sim(profile, &opts, &report)?;
    }
    Ok(())
}

fn engine_bench(a: EngineArgs) -> anyhow::Result<()> {
    let m = super::load_model(&a.model)?;
    let loaded_rss_mb = rss_mb("VmRSS:");
    let read_gb_per_s: Vec<(usize, f64)> = a.threads.iter().map(|&t| (t, read_bandwidth(t))).collect();
    for (t, gbps) in &read_gb_per_s {
        println!("memory read threads={t}                   {gbps:8.1} GB/s");
    }
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
        loaded_rss_mb,
        weight_bytes: m.model.weight_bytes(),
        read_gb_per_s,
    };
    println!(
        "peak RSS {:.0} MB, {:.0} MB once loaded, weights {:.0} MB, kernels {}",
        report.peak_rss_mb,
        report.loaded_rss_mb,
        report.weight_bytes as f64 / 1e6,
        report.isa
    );
    if let Some(path) = &a.out {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The constraint of the grammar benchmark: a long list of short strings, which no
/// sequence finishes within the measured tokens, so every step is constrained.
const BENCH_SCHEMA: &str =
    r#"{"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 200, "maxItems": 200}"#;

#[derive(Serialize)]
struct GrammarRow {
    threads: usize,
    batch: usize,
    plain_tokens_per_s: f64,
    constrained_tokens_per_s: f64,
    /// constrained / plain.
    ratio: f64,
    mask_p50_us: f64,
    mask_p99_us: f64,
}

fn grammar_bench(a: GrammarArgs) -> anyhow::Result<()> {
    let m = super::load_model(&a.model)?;
    let grammars = super::grammars(&m.tokenizer).context("the model's vocabulary has no grammar support")?;
    let prompt = m
        .tokenizer
        .encode("<|im_start|>user\nList two hundred words as a JSON array.<|im_end|>\n<|im_start|>assistant\n", true);
    let grammar = pdserve_types::Grammar::new(pdserve_types::GrammarSpec::JsonSchema(BENCH_SCHEMA.into()));
    let mut rows = Vec::new();
    println!("| threads | batch | plain tok/s | json_schema tok/s | ratio | mask p50 µs | mask p99 µs |");
    println!("|---|---|---|---|---|---|---|");
    for &batch in &a.batch {
        let plain = best_of(a.reps, || constrained_decode(&m, &prompt, None, a.threads, batch, a.decode_tokens).0);
        let mut runs = Vec::new();
        for _ in 0..a.reps.max(1) {
            let g = Some((&grammars, &grammar));
            runs.push(constrained_decode(&m, &prompt, g, a.threads, batch, a.decode_tokens));
        }
        let (tps, p50, p99) = runs.into_iter().fold((0.0, 0.0, 0.0), |best, r| if r.0 > best.0 { r } else { best });
        let row = GrammarRow {
            threads: a.threads,
            batch,
            plain_tokens_per_s: plain,
            constrained_tokens_per_s: tps,
            ratio: tps / plain,
            mask_p50_us: p50 * 1e6,
            mask_p99_us: p99 * 1e6,
        };
        println!(
            "| {} | {batch} | {plain:.1} | {tps:.1} | {:.3} | {:.1} | {:.1} |",
            a.threads, row.ratio, row.mask_p50_us, row.mask_p99_us
        );
        rows.push(row);
    }
    if let Some(path) = &a.out {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Decode tokens per second of `batch` copies of `prompt` (their prefill not
/// counted), constrained by `grammar` or not; with the mask time p50 and p99 (s).
fn constrained_decode(
    m: &LoadedModel,
    prompt: &[u32],
    grammar: Option<(&Arc<Grammars>, &pdserve_types::Grammar)>,
    threads: usize,
    batch: usize,
    gen: u32,
) -> (f64, f64, f64) {
    let mut e = engine(m, threads, batch * (prompt.len() + gen as usize), batch);
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

fn engine(m: &LoadedModel, threads: usize, tokens: usize, seqs: usize) -> Engine {
    let cfg = EngineConfig {
        threads,
        num_blocks: tokens.div_ceil(16) + seqs + 8,
        max_batch_tokens: 512,
        max_seqs: seqs.max(1),
        cache_salt: 0,
        objectives: None,
    };
    Engine::new(m.model.clone(), cfg, Vec::new())
}

/// Token ids from a fixed generator, skipping the low ids where special tokens live.
pub(crate) fn random_prompt(len: usize, seed: u64, vocab: usize) -> Vec<u32> {
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
