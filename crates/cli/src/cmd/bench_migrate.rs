//! `pdserve bench migrate`: a worker leaving decode with long decodes in flight.
//!
//! Two one-thread workers on the model (one process, in-process KV transfer) decode
//! `--sequences` greedy requests of `--output` tokens each, spread over both. Once
//! every stream has `--after` tokens, worker 0 switches to prefill, three ways:
//! never (the reference tokens), finishing its sequences in place, and handing them
//! over (`RoleSwitch::move_decodes`: each is prefilled on worker 0 from its own cache and
//! its KV shipped to worker 1). Reported: how long until worker 0 runs nothing, how
//! long until every stream yields its next token, and whether every stream's tokens
//! equal the reference's.

use anyhow::Context;
use pdserve_engine::batch::EngineConfig;
use pdserve_engine::loader::LoadedModel;
use pdserve_kv_transfer::{ClusterKey, TransportKind};
use pdserve_protocol::{Capabilities, Event, Generate, GenerateRequest, TokenStream, Worker};
use pdserve_router::{Deadlines, Migrating, Mode, Router};
use pdserve_types::{RequestId, Role, SamplingParams};
use pdserve_worker::{LocalWorker, WorkerOptions};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct MigrateArgs {
    /// `default`, a model `pdserve pull --list` names, or a path to a GGUF file or
    /// safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// Requests decoding when the switch comes (spread over the two workers).
    #[arg(long, default_value_t = 4)]
    sequences: usize,
    /// Prompt tokens per request (random ids).
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Tokens each request generates (EOS ignored).
    #[arg(long, default_value_t = 512)]
    output: u32,
    /// Tokens every stream has before worker 0 switches.
    #[arg(long, default_value_t = 64)]
    after: usize,
    /// KV blocks per worker.
    #[arg(long, default_value_t = 1024)]
    kv_blocks: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// What worker 0 does with its sequences when it leaves decode.
#[derive(Clone, Copy, PartialEq, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
enum Way {
    NoSwitch,
    InPlace,
    Moved,
}

/// One run.
#[derive(Serialize, Debug)]
struct Run {
    way: Way,
    /// Sequences worker 0 handed over.
    moved: usize,
    /// From the switch until worker 0 runs no sequence.
    empty_s: f64,
    /// From the switch until every stream has two more tokens (a moved one's first
    /// comes from its prefill on worker 0, the second from its new decoder).
    resume_s: f64,
    /// The longest gap between two tokens of any stream after the switch.
    gap_max_s: f64,
    /// The usual gap between two tokens before the switch (median).
    itl_p50_s: f64,
    /// Every stream's tokens equal the run without a switch.
    identical: bool,
}

pub fn run(a: MigrateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.sequences >= 2, "--sequences must be at least 2 (one per worker)");
    anyhow::ensure!(a.after >= 1 && a.after < a.output as usize, "--after must be between 1 and --output");
    let m = super::load_model(&a.model)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let mut runs = Vec::new();
    let mut reference: Option<Vec<Vec<u32>>> = None;
    for way in [Way::NoSwitch, Way::InPlace, Way::Moved] {
        let (run, tokens) = rt.block_on(once(&m, &a, way, reference.as_deref()))?;
        reference.get_or_insert(tokens);
        runs.push(run);
    }
    println!(
        "worker 0 leaves decode with {} sequences of {} tokens in flight (after {}), s:",
        a.sequences, a.output, a.after
    );
    println!("| way | moved | worker 0 empty | every stream 2 tokens on | longest gap after | usual ITL | identical tokens |");
    println!("|---|---|---|---|---|---|---|");
    for r in &runs {
        println!(
            "| {:?} | {} | {:.3} | {:.3} | {:.3} | {:.4} | {} |",
            r.way, r.moved, r.empty_s, r.resume_s, r.gap_max_s, r.itl_p50_s, r.identical
        );
    }
    if let Some(path) = &a.out {
        std::fs::write(path, serde_json::to_string_pretty(&runs)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn worker(m: &LoadedModel, a: &MigrateArgs, name: &str, key: &ClusterKey) -> anyhow::Result<Arc<dyn Worker>> {
    Ok(Arc::new(mixed_worker(m, name, key, 1, a.kv_blocks, pdserve_types::KvDtype::F16)?))
}

/// A mixed worker on the model in this process, on the current runtime, for the
/// benchmarks that need two of them.
pub(super) fn mixed_worker(
    m: &LoadedModel,
    name: &str,
    key: &ClusterKey,
    threads: usize,
    kv_blocks: usize,
    kv_dtype: pdserve_types::KvDtype,
) -> anyhow::Result<LocalWorker> {
    let opts = WorkerOptions {
        name: name.into(),
        role: Role::Mixed,
        model_name: m.name.clone(),
        engine: EngineConfig { threads, num_blocks: kv_blocks, kv_dtype, ..Default::default() },
        eog: m.tokenizer.eog_ids().to_vec(),
        key: key.clone(),
        grammars: None,
        tiers: Default::default(),
    };
    Ok(LocalWorker::spawn(opts, m.model.clone(), tokio::runtime::Handle::current())?)
}

/// Each stream's tokens with the time each arrived.
type Timed = Vec<(Instant, u32)>;

/// Request `i`'s tokens with the time each arrived, its count so far in
/// `progress[i]`.
async fn timed(mut stream: TokenStream, i: usize, progress: Arc<Vec<AtomicUsize>>) -> anyhow::Result<Timed> {
    let mut got: Timed = Vec::new();
    loop {
        match stream.next().await {
            Some(Event::Token(t)) => {
                got.push((Instant::now(), t.token));
                progress[i].store(got.len(), Ordering::Relaxed);
            }
            Some(Event::Done { .. }) => return Ok(got),
            Some(Event::Failed(e)) => return Err(anyhow::anyhow!("request {i} failed: {e}")),
            Some(_) => {}
            None => return Err(anyhow::anyhow!("request {i}: the stream ended early")),
        }
    }
}

async fn once(
    m: &LoadedModel,
    a: &MigrateArgs,
    way: Way,
    reference: Option<&[Vec<u32>]>,
) -> anyhow::Result<(Run, Vec<Vec<u32>>)> {
    let key = ClusterKey::random();
    let workers = [worker(m, a, "w0", &key)?, worker(m, a, "w1", &key)?];
    let router = Arc::new(
        Router::new(workers, Mode::Auto, Deadlines::default(), tokio::runtime::Handle::current())
            .with_transport(TransportKind::Inproc),
    );
    let front = Migrating::new(router.clone(), 0);
    let progress: Arc<Vec<AtomicUsize>> = Arc::new((0..a.sequences).map(|_| AtomicUsize::new(0)).collect());
    let mut tasks = Vec::new();
    for i in 0..a.sequences {
        let stream = front.generate(request(m, a, i)).map_err(|e| anyhow::anyhow!("request {i}: {e}"))?;
        tasks.push(tokio::spawn(timed(stream, i, progress.clone())));
    }
    while progress.iter().any(|p| p.load(Ordering::Relaxed) < a.after) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let w0 = router.workers().snapshot().into_iter().find(|e| e.name() == "w0").context("no w0")?;
    let switched = Instant::now();
    let mut moved = 0;
    if way != Way::NoSwitch {
        router.switch_role(&w0, Role::Prefill).await?;
        if way == Way::Moved {
            moved = w0.worker.roles()?.move_decodes().await?;
        }
    }
    let mut empty_s = 0.0;
    if way != Way::NoSwitch {
        while w0.worker.stats().await?.running > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        empty_s = switched.elapsed().as_secs_f64();
    }
    let mut streams = Vec::new();
    for t in tasks {
        streams.push(t.await??);
    }
    let tokens: Vec<Vec<u32>> = streams.iter().map(|s| s.iter().map(|(_, t)| *t).collect()).collect();
    let after: Vec<Vec<Instant>> =
        streams.iter().map(|s| s.iter().map(|(at, _)| *at).filter(|at| *at > switched).collect()).collect();
    let since = |at: Instant| (at - switched).as_secs_f64();
    let resume_s = after.iter().filter_map(|s| s.get(1)).map(|at| since(*at)).fold(0.0, f64::max);
    let gap_max_s = after
        .iter()
        .flat_map(|s| s.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).chain(s.first().map(|at| since(*at))))
        .fold(0.0, f64::max);
    let run = Run {
        way,
        moved,
        empty_s,
        resume_s,
        gap_max_s,
        itl_p50_s: itl_before(&streams, switched),
        identical: reference.is_none_or(|r| r == tokens.as_slice()),
    };
    Ok((run, tokens))
}

fn request(m: &LoadedModel, a: &MigrateArgs, i: usize) -> GenerateRequest {
    let prompt = pdserve_engine::bench::random_prompt(a.prompt, 7 + i as u64, m.model.cfg.vocab_size);
    let params = SamplingParams { max_tokens: a.output, ignore_eos: true, ..Default::default() };
    GenerateRequest {
        fence: None,
        id: RequestId(1 + i as u64),
        tag: format!("migrate-{i}").as_str().into(),
        prompt,
        params,
        trace: Default::default(),
    }
}

/// The median gap between consecutive tokens of every stream before `t`.
fn itl_before(streams: &[Timed], t: Instant) -> f64 {
    let mut gaps: Vec<f64> = streams
        .iter()
        .flat_map(|s| s.windows(2).filter(|w| w[1].0 < t).map(|w| (w[1].0 - w[0].0).as_secs_f64()))
        .collect();
    gaps.sort_by(f64::total_cmp);
    gaps.get(gaps.len() / 2).copied().unwrap_or(0.0)
}
