//! `pdserve serve`: frontend, router and workers in one process.

use super::http::{self, Listen, Served};
use anyhow::Context;
use pdserve_engine::batch::EngineConfig;
use pdserve_frontend::Metrics;
use pdserve_kv_transfer::{Inboxes, ShmConfig, ShmReceiver, ShmTransport, TcpReceiver, TcpTransport};
use pdserve_router::{Deadlines, KvLink, Mode, Policy, Router};
use pdserve_types::Role;
use pdserve_worker::Worker;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// `default` or a path to a GGUF file or safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// aggregated | disaggregated | auto (per request, from live measurements: prefill
    /// on the decode worker or on another worker, whichever gives the first token sooner).
    #[arg(long, default_value = "auto")]
    mode: Mode,
    /// How to pick among workers of one role: least-loaded | round-robin.
    #[arg(long, default_value = "least-loaded")]
    policy: Policy,
    /// Prefill workers (disaggregated and auto; default 1).
    #[arg(long)]
    prefill: Option<usize>,
    /// Decode workers (disaggregated and auto; default 1).
    #[arg(long)]
    decode: Option<usize>,
    /// Mixed workers (aggregated, or auto over mixed workers; default 1).
    #[arg(long)]
    workers: Option<usize>,
    /// Compute threads per worker (default: the cores divided among the workers).
    #[arg(long)]
    threads_per_worker: Option<usize>,
    /// KV blocks of 16 tokens per worker.
    #[arg(long, default_value_t = 1024)]
    kv_blocks: usize,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// How KV moves from prefill to decode workers: inproc (hand over the frames),
    /// tcp (loopback socket) or shm (shared-memory ring); tcp and shm exercise the
    /// transports a multi-process deployment uses.
    #[arg(long, default_value = "inproc")]
    kv_transport: String,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    grace_seconds: u64,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let m = super::load_model(&a.model)?;
    let roles = topology(&a);
    let cores = super::generate::default_threads();
    let threads = a.threads_per_worker.unwrap_or_else(|| (cores / roles.len()).max(1));
    let metrics = Metrics::new();
    let mut workers = Vec::new();
    for (i, role) in roles.iter().enumerate() {
        let name = format!("{role}-{i}");
        let cfg = EngineConfig { threads, num_blocks: a.kv_blocks, ..Default::default() };
        let w = Worker::spawn(&name, *role, m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec())
            .with_context(|| format!("starting worker {name}"))?;
        metrics.set_role(&name, *role);
        workers.push(w);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let mut router = Router::new(workers, a.mode, Deadlines::default(), tokio::runtime::Handle::current())
            .with_policy(a.policy)
            .with_telemetry(Arc::new(metrics.clone()));
        // The receivers must outlive the server; they stop when dropped.
        let (link, _receivers) = kv_link(&a.kv_transport).await?;
        if let Some(link) = link {
            router = router.with_kv_link(link);
        }
        let model = Served {
            tokenizer: m.tokenizer.clone(),
            chat: m.chat.clone(),
            name: m.name.clone(),
            context_length: m.model.cfg.context_length,
        };
        let at = Listen {
            host: &a.host,
            port: a.port,
            grace: Duration::from_secs(a.grace_seconds),
            mode: format!("{:?}", a.mode).to_lowercase(),
        };
        let banner = format!(
            "workers: {}, {threads} thread(s) each",
            roles.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
        );
        http::serve(router, metrics, model, at, &banner).await
    })
}

/// Which workers to start, from the mode and the counts given.
fn topology(a: &Args) -> Vec<Role> {
    match a.mode {
        Mode::Aggregated => vec![Role::Mixed; a.workers.unwrap_or(1).max(1)],
        // Auto over mixed workers: any of them may prefill for another.
        Mode::Auto if a.workers.is_some() => vec![Role::Mixed; a.workers.unwrap_or(1).max(1)],
        _ => {
            let mut r = vec![Role::Prefill; a.prefill.unwrap_or(1)];
            r.extend(vec![Role::Decode; a.decode.unwrap_or(1).max(1)]);
            r
        }
    }
}

/// Holds a transport's receiving end alive.
enum Receiver {
    Tcp(#[allow(dead_code)] pdserve_kv_transfer::TcpReceiver),
    Shm(#[allow(dead_code)] pdserve_kv_transfer::ShmReceiver),
}

/// Builds the KV link for `--kv-transport`: `None` for in-process hand-over.
async fn kv_link(kind: &str) -> anyhow::Result<(Option<KvLink>, Option<Receiver>)> {
    let inboxes = Inboxes::new(256);
    match kind {
        "inproc" => Ok((None, None)),
        "tcp" => {
            let rx = TcpReceiver::bind("127.0.0.1:0", inboxes.clone()).await.context("KV receiver")?;
            let tx = TcpTransport::connect(rx.local_addr())?;
            Ok((Some(KvLink { transport: Arc::new(tx), inboxes }), Some(Receiver::Tcp(rx))))
        }
        "shm" => {
            let sock = std::env::temp_dir().join(format!("pdserve-kv-{}.sock", std::process::id()));
            let _ = std::fs::remove_file(&sock);
            let rx = ShmReceiver::bind(&sock, inboxes.clone()).await.context("KV receiver")?;
            let tx = ShmTransport::connect(rx.path(), ShmConfig::default())?;
            Ok((Some(KvLink { transport: Arc::new(tx), inboxes }), Some(Receiver::Shm(rx))))
        }
        other => anyhow::bail!("unknown --kv-transport `{other}` (expected inproc, tcp or shm)"),
    }
}
