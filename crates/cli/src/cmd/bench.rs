//! `pdserve bench`: argument parsing over the benchmarks: `engine` and `grammar`
//! over `pdserve_engine::bench`, `load` and `compare` over `pdserve-bench`
//! (docs/bench.md), `tiers`, `switch` and `migrate` in their own files.

use super::workload::WorkloadArgs;
use anyhow::Context;
use pdserve_bench::arrivals::ArrivalKind;
use pdserve_bench::compare::suite::Named;
use pdserve_bench::compare::{run_compare, CompareOptions};
use pdserve_bench::load::{run_load, LoadOptions, Sweep};
use pdserve_bench::metrics::Slo;
use pdserve_bench::openai::{BodyOptions, Endpoint};
use pdserve_bench::prompt::{PromptKind, TokenRange};
use pdserve_bench::workload::Source;
use pdserve_engine::bench::{self, DecodePrompts, EngineBench, GrammarBench};
use std::path::PathBuf;
use std::time::Duration;

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
    /// Prompts of your own, one JSON string per line, sent as text in place of
    /// generated ones (--input-len does not apply); request i of point p takes prompt
    /// p × R + i, R the requests a point sends at most, so a long enough file gives
    /// every request its own.
    #[arg(long)]
    prompts: Option<PathBuf>,
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
    /// How the KV cache stores K and V: f16 | q8_0 | q4_0.
    #[arg(long, default_value = "f16")]
    kv_cache_dtype: pdserve_types::KvDtype,
    /// Decode prompts are passages of this text file for the model to go on with,
    /// instead of random token ids.
    #[arg(long)]
    decode_text: Option<std::path::PathBuf>,
    /// With `--decode-text`: each passage is followed by its first tokens again, so
    /// that the model's likeliest answer quotes it (input-grounded).
    #[arg(long, requires = "decode_text")]
    decode_quote: bool,
    /// With `--speculative`, each decode figure is measured without speculation and
    /// with it, in the same run.
    #[command(flatten)]
    spec: super::SpecArgs,
    /// Write the results as JSON here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
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

fn load(a: LoadArgs) -> anyhow::Result<()> {
    let w = &a.work;
    let default_prompt = if a.endpoint == Endpoint::Chat { PromptKind::Text } else { PromptKind::Ids };
    let workload = match &a.prompts {
        Some(path) => prompts_workload(w, path)?,
        None => w.workload()?,
    };
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
    print!("{}", pdserve_bench::load::markdown::load_report(&report));
    Ok(())
}

/// `--prompts FILE`: the file's prompts, dealt so that each point takes its own.
fn prompts_workload(w: &WorkloadArgs, path: &std::path::Path) -> anyhow::Result<pdserve_bench::workload::Workload> {
    let generated = w.workload()?;
    if !matches!(generated.source, Source::Random { .. }) {
        anyhow::bail!("--prompts mixes with none of --shared-prefixes, --conversations, --trace and --phase");
    }
    let prompts = pdserve_bench::prompts_file::load(path)?;
    let plans = pdserve_bench::load::plans(&w.sweep()?, w.requests, w.seconds, None)?;
    let per_point = plans.iter().map(|p| p.bounds.max_requests).max().unwrap_or(w.requests);
    let source = Source::Texts { prompts: std::sync::Arc::new(prompts), per_point, output: w.output_len };
    Ok(pdserve_bench::workload::Workload { source, ..generated })
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

/// The decode prompts `--decode-text` and `--decode-quote` ask for.
fn decode_prompts(a: &EngineArgs, m: &pdserve_engine::loader::LoadedModel) -> anyhow::Result<DecodePrompts> {
    let Some(path) = &a.decode_text else { return Ok(DecodePrompts::Random) };
    let text = std::fs::read_to_string(path).with_context(|| format!("--decode-text {}", path.display()))?;
    let ids = m.tokenizer.encode(&text, false);
    if ids.len() < 2 * a.decode_prompt {
        anyhow::bail!("--decode-text: {} tokens, fewer than twice --decode-prompt", ids.len());
    }
    Ok(if a.decode_quote { DecodePrompts::Quote(ids) } else { DecodePrompts::Continue(ids) })
}

fn engine_bench(a: EngineArgs) -> anyhow::Result<()> {
    a.spec.check()?;
    let m = super::load_model(&a.model)?;
    let decode_prompts = decode_prompts(&a, &m)?;
    let b = EngineBench {
        threads: a.threads,
        prefill: a.prefill,
        batch: a.batch,
        decode_prompt: a.decode_prompt,
        decode_tokens: a.decode_tokens,
        reps: a.reps,
        kv_dtype: a.kv_cache_dtype,
        speculation: a.spec.config(Some(&m))?,
        decode_prompts,
    };
    pdserve_engine::kvcache::check_dtype(&m.model.cfg, a.kv_cache_dtype).map_err(anyhow::Error::msg)?;
    // The figure without speculation each speculative one is compared with.
    let mut plain = 0.0;
    let report = bench::engine(&m, &b, |r| match (r.kind, r.speculative) {
        ("prefill", _) => {
            println!("prefill  threads={} prompt={:<5}        {:8.1} tok/s", r.threads, r.prompt, r.tokens_per_s)
        }
        (_, false) => {
            plain = r.tokens_per_s;
            println!(
                "decode   threads={} prompt={:<5} batch={:<3} {:8.1} tok/s",
                r.threads, r.prompt, r.batch, r.tokens_per_s
            )
        }
        (_, true) => println!(
            "  speculative                    batch={:<3} {:8.1} tok/s  {:.2}x  ({} of {} drafted accepted)",
            r.batch,
            r.tokens_per_s,
            r.tokens_per_s / plain,
            r.accepted,
            r.drafted
        ),
    });
    for (t, gbps) in &report.read_gb_per_s {
        println!("memory read threads={t}                   {gbps:8.1} GB/s");
    }
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

fn grammar_bench(a: GrammarArgs) -> anyhow::Result<()> {
    let m = super::load_model(&a.model)?;
    let grammars = super::grammars(&m.tokenizer).context("the model's vocabulary has no grammar support")?;
    let b = GrammarBench { threads: a.threads, batch: a.batch, decode_tokens: a.decode_tokens, reps: a.reps };
    println!("| threads | batch | plain tok/s | json_schema tok/s | ratio | mask p50 µs | mask p99 µs |");
    println!("|---|---|---|---|---|---|---|");
    let rows = bench::grammar(&m, &grammars, &b, |r| {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.3} | {:.1} | {:.1} |",
            r.threads, r.batch, r.plain_tokens_per_s, r.constrained_tokens_per_s, r.ratio, r.mask_p50_us, r.mask_p99_us
        );
    });
    if let Some(path) = &a.out {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
