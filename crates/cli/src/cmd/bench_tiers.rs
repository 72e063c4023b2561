//! `pdserve bench tiers`: what a prefix costs when the pool no longer holds it:
//! recomputed, copied back from host RAM (tier 2), read back from disk (tier 3,
//! with the file dropped from the page cache first, so the reads reach the device),
//! handed over by a peer worker whose pool holds it (prefilled there from its
//! cache), or fetched from that peer (its cached blocks copied out between two of
//! its steps, idle or busy prefilling a prompt of its own), over TCP and over shared
//! memory.

use anyhow::Context;
use pdserve_engine::batch::{Engine, EngineConfig, BLOCK_SIZE};
use pdserve_engine::loader::LoadedModel;
use pdserve_engine::tiers::TierConfig;
use pdserve_kv_transfer::{ClusterKey, TransportKind};
use pdserve_protocol::{Event, GenerateRequest, KvDestination, PrefixPeer, TokenStream, Worker};
use pdserve_types::{RequestId, SamplingParams};
use pdserve_worker::LocalWorker;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct TiersArgs {
    /// `default`, a model `pdserve pull --list` names, or a path to a GGUF file or
    /// safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// Compute threads of the engine.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Prefix lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    prefix: Vec<usize>,
    /// Directory for the disk tier's file.
    #[arg(long, default_value = "target/bench-kv-disk")]
    disk_dir: PathBuf,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// How the KV cache (and so every tier) stores K and V: f16 | q8_0 | q4_0.
    #[arg(long, default_value = "f16")]
    kv_cache_dtype: pdserve_types::KvDtype,
    /// Write the results as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One prefix length: seconds to first token when the prefix is recomputed and
/// when it comes back from each tier, and the copy alone.
#[derive(Serialize, Debug, Clone, Copy, Default)]
struct Row {
    prefix_tokens: usize,
    recompute_s: f64,
    host_ttft_s: f64,
    host_restore_s: f64,
    disk_ttft_s: f64,
    disk_restore_s: f64,
    /// A peer's pool holds the prefix: time to the first token with the KV here.
    peer_tcp_ttft_s: f64,
    peer_shm_ttft_s: f64,
    /// The blocks fetched from that peer: time to the first token here.
    fetch_tcp_ttft_s: f64,
    fetch_shm_ttft_s: f64,
    /// The same over TCP while the peer prefills a prompt as long of its own.
    fetch_busy_tcp_ttft_s: f64,
}

impl Row {
    /// Its line of the table `run` prints.
    fn print(&self) {
        let ms = |s: f64| s * 1e3;
        let faster = |s: f64| self.recompute_s / s;
        println!(
            "| {} | {:.1} | {:.1} | {:.2} | {:.0} | {:.1} | {:.2} | {:.0} | {:.1} | {:.0} | {:.1} | {:.0} | \
             {:.1} | {:.0} | {:.1} | {:.0} | {:.1} | {:.0} |",
            self.prefix_tokens,
            ms(self.recompute_s),
            ms(self.host_ttft_s),
            ms(self.host_restore_s),
            faster(self.host_ttft_s),
            ms(self.disk_ttft_s),
            ms(self.disk_restore_s),
            faster(self.disk_ttft_s),
            ms(self.peer_tcp_ttft_s),
            faster(self.peer_tcp_ttft_s),
            ms(self.peer_shm_ttft_s),
            faster(self.peer_shm_ttft_s),
            ms(self.fetch_tcp_ttft_s),
            faster(self.fetch_tcp_ttft_s),
            ms(self.fetch_shm_ttft_s),
            faster(self.fetch_shm_ttft_s),
            ms(self.fetch_busy_tcp_ttft_s),
            faster(self.fetch_busy_tcp_ttft_s),
        );
    }
}

/// Where the prefix is when it is asked for again.
#[derive(Clone, Copy, PartialEq)]
enum From {
    Nowhere,
    Host,
    Disk,
}

pub fn run(a: TiersArgs) -> anyhow::Result<()> {
    let m = super::load_model(&a.model)?;
    pdserve_engine::kvcache::check_dtype(&m.model.cfg, a.kv_cache_dtype).map_err(anyhow::Error::msg)?;
    println!(
        "| prefix tokens | recompute ms | host: TTFT ms | host: copy ms | × faster | disk: TTFT ms | disk: read ms | \
         × faster | peer over TCP: TTFT ms | × faster | peer over shm: TTFT ms | × faster | \
         fetch over TCP: TTFT ms | × faster | fetch over shm: TTFT ms | × faster | \
         fetch from a busy peer (TCP): TTFT ms | × faster |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for &n in &a.prefix {
        let median = |from| median_of(a.reps, || once(&m, &a, n, from));
        let (recompute_s, _) = median(From::Nowhere)?;
        let (host_ttft_s, host_restore_s) = median(From::Host)?;
        let (disk_ttft_s, disk_restore_s) = median(From::Disk)?;
        let peer_tcp_ttft_s = peer(&m, &a, n, TransportKind::Tcp)?;
        let peer_shm_ttft_s = peer(&m, &a, n, TransportKind::Shm)?;
        let fetch_tcp_ttft_s = fetch(&m, &a, n, TransportKind::Tcp, false)?;
        let fetch_shm_ttft_s = fetch(&m, &a, n, TransportKind::Shm, false)?;
        let fetch_busy_tcp_ttft_s = fetch(&m, &a, n, TransportKind::Tcp, true)?;
        let row = Row {
            prefix_tokens: n,
            recompute_s,
            host_ttft_s,
            host_restore_s,
            disk_ttft_s,
            disk_restore_s,
            peer_tcp_ttft_s,
            peer_shm_ttft_s,
            fetch_tcp_ttft_s,
            fetch_shm_ttft_s,
            fetch_busy_tcp_ttft_s,
        };
        row.print();
        rows.push(row);
    }
    let _ = std::fs::remove_dir_all(&a.disk_dir);
    if let Some(path) = &a.out {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The median (over `reps`) of `f`'s (time to first token, copy time).
fn median_of(reps: usize, mut f: impl FnMut() -> anyhow::Result<(f64, f64)>) -> anyhow::Result<(f64, f64)> {
    let mut runs = (0..reps.max(1)).map(|_| f()).collect::<anyhow::Result<Vec<_>>>()?;
    runs.sort_by(|x, y| x.0.total_cmp(&y.0));
    Ok(runs[runs.len() / 2])
}

/// A fresh engine runs the prefix once (cold), pushes it out of its pool to `from`,
/// then asks for it again: that request's time to first token, and the seconds its
/// engine spent copying blocks back.
fn once(m: &LoadedModel, a: &TiersArgs, tokens: usize, from: From) -> anyhow::Result<(f64, f64)> {
    let blocks = tokens.div_ceil(BLOCK_SIZE) + 4;
    let tiers = match from {
        From::Nowhere => TierConfig::default(),
        From::Host => TierConfig { host_blocks: blocks, ..TierConfig::default() },
        From::Disk => TierConfig { disk_blocks: blocks, disk_dir: Some(a.disk_dir.clone()), ..TierConfig::default() },
    };
    let cfg = EngineConfig {
        threads: a.threads,
        num_blocks: blocks,
        max_batch_tokens: 512,
        max_seqs: 1,
        cache_salt: 0,
        objectives: None,
        speculation: None,
        kv_dtype: a.kv_cache_dtype,
    };
    let mut e = Engine::new(m.model.clone(), cfg, Vec::new()).with_tiers(&tiers)?;
    let prompt = pdserve_engine::bench::random_prompt(tokens, tokens as u64, m.model.cfg.vocab_size);
    let cold = first_token(&mut e, 0, &prompt)?;
    if from == From::Nowhere {
        return Ok((cold, 0.0));
    }
    e.evict_cached();
    e.flush_tiers(true).context("flushing the disk tier")?;
    let warm = first_token(&mut e, 1, &prompt)?;
    let t = e.stats().tiers;
    Ok((warm, t.restore_seconds_host + t.restore_seconds_disk))
}

/// A prefix another worker's pool holds, as `auto` uses it: that worker prefills the
/// prompt from its cache (computing only the last, partial block) and hands the whole
/// KV to this worker over `via`. Two one-thread workers in this process; the holder
/// computes the prompt once, then the median over `--reps` handoffs of the time from
/// reserving the blocks here to holding the first token and every frame.
fn peer(m: &LoadedModel, a: &TiersArgs, tokens: usize, via: TransportKind) -> anyhow::Result<f64> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let (holder, here, prompt) = warm_pair(m, a, tokens, via, tokens.div_ceil(BLOCK_SIZE) + 4).await?;
        let mut times = Vec::new();
        for id in 1..=a.reps.max(1) as u64 {
            let req = request("peer", id, &prompt, 2);
            let started = Instant::now();
            let reserved = here.reserve(req.id, tokens, None).await?;
            let target = here.kv_target(via).context("no KV receiver here")?;
            let got = holder.prefill(req, KvDestination::reserved(target, reserved)).await;
            times.push(started.elapsed().as_secs_f64());
            here.release(RequestId(id));
            let got = got?;
            anyhow::ensure!(
                got.cached_tokens + BLOCK_SIZE >= tokens,
                "the holder found {} of {tokens} tokens in its cache",
                got.cached_tokens
            );
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    })
}

/// A prefix another worker's pool holds, fetched as the router does it: the holder
/// copies its cached blocks into a reservation here (`PrefixPeer::export_prefix`)
/// between two of its steps, and this worker computes the last, partial block and
/// samples (`PrefixPeer::generate_imported`). The median over `--reps` of the time from
/// reserving the blocks here to the first token here; with `busy`, the holder is
/// prefilling a fresh prompt of the same length of its own each time.
fn fetch(m: &LoadedModel, a: &TiersArgs, tokens: usize, via: TransportKind, busy: bool) -> anyhow::Result<f64> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let (holder, here, prompt) = warm_pair(m, a, tokens, via, 2 * tokens.div_ceil(BLOCK_SIZE) + 8).await?;
        let vocab = m.model.cfg.vocab_size;
        let whole = (tokens - 1) / BLOCK_SIZE * BLOCK_SIZE;
        let mut times = Vec::new();
        for id in 1..=a.reps.max(1) as u64 {
            // The holder's own long prefill, running when the fetch comes (dropped
            // after: the request is cancelled).
            let _own = match busy {
                true => {
                    let own = pdserve_engine::bench::random_prompt(tokens, 7000 + id, vocab);
                    Some(start_prefill(&holder, request("own", 1000 + id, &own, 1)).await?)
                }
                false => None,
            };
            let started = Instant::now();
            let reserved = here.reserve(RequestId(id), whole, None).await?;
            let target = here.kv_target(via).context("no KV receiver here")?;
            let sent = holder.export_prefix(
                RequestId(id),
                prompt[..whole].to_vec(),
                0,
                KvDestination::prefix(target, reserved),
            );
            let sent = sent.await?;
            anyhow::ensure!(sent == whole, "the holder sent {sent} of {whole} cached tokens");
            let (tx, mut stream) = TokenStream::channel(8);
            here.generate_imported(request("fetch", id, &prompt, 1), sent, tx)?;
            while !matches!(stream.next().await, Some(Event::Token(_) | Event::Done { .. } | Event::Failed(_)) | None) {
            }
            times.push(started.elapsed().as_secs_f64());
            while !matches!(stream.next().await, Some(Event::Done { .. } | Event::Failed(_)) | None) {}
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    })
}

/// Two one-thread workers with `blocks` blocks each, `here` receiving KV over `via`,
/// and a random prompt of `tokens` the holder has computed once (its pool caches it).
async fn warm_pair(
    m: &LoadedModel,
    a: &TiersArgs,
    tokens: usize,
    via: TransportKind,
    blocks: usize,
) -> anyhow::Result<(LocalWorker, LocalWorker, Vec<u32>)> {
    let key = ClusterKey::random();
    let holder = super::bench_migrate::mixed_worker(m, "holder", &key, a.threads, blocks, a.kv_cache_dtype)?;
    let here = super::bench_migrate::mixed_worker(m, "here", &key, a.threads, blocks, a.kv_cache_dtype)?;
    super::serve::listen(&here, via).await?;
    let prompt = pdserve_engine::bench::random_prompt(tokens, tokens as u64, m.model.cfg.vocab_size);
    let (tx, mut warm) = TokenStream::channel(8);
    holder.generate(request("warm", 0, &prompt, 1), tx)?;
    while !matches!(warm.next().await, Some(Event::Done { .. }) | None) {}
    Ok((holder, here, prompt))
}

/// A request of `prompt` that generates `max_tokens`, whatever they are.
fn request(tag: &str, id: u64, prompt: &[u32], max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        fence: None,
        id: RequestId(id),
        tag: format!("{tag}-{id}").as_str().into(),
        prompt: prompt.to_vec(),
        params: SamplingParams { max_tokens, ignore_eos: true, ..Default::default() },
        trace: Default::default(),
    }
}

/// Queues `req` on `w` and waits until its prefill runs; the stream keeps it alive.
async fn start_prefill(w: &impl Worker, req: GenerateRequest) -> anyhow::Result<TokenStream> {
    let (tx, stream) = TokenStream::channel(8);
    w.generate(req, tx)?;
    for _ in 0..1000 {
        if w.stats().await?.queued_prompt_tokens > 0 {
            return Ok(stream);
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    anyhow::bail!("the holder never started its own prefill")
}

/// Seconds from queueing `prompt` to its first token.
fn first_token(e: &mut Engine, id: u64, prompt: &[u32]) -> anyhow::Result<f64> {
    let params = SamplingParams { max_tokens: 1, ignore_eos: true, ..Default::default() };
    let t = Instant::now();
    e.add(RequestId(id), prompt.to_vec(), params).map_err(|err| anyhow::anyhow!("{err}"))?;
    while e.has_work() {
        if !e.step().is_empty() {
            return Ok(t.elapsed().as_secs_f64());
        }
    }
    anyhow::bail!("the engine finished without a token")
}
