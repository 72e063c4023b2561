//! `pdserve serve`: frontend, router and workers in one process.

use anyhow::Context;
use pdserve_engine::engine::EngineConfig;
use pdserve_frontend::{Frontend, Metrics};
use pdserve_kv_transfer::{Inboxes, ShmConfig, ShmReceiver, ShmTransport, TcpReceiver, TcpTransport};
use pdserve_protocol::Generate;
use pdserve_router::{Deadlines, KvLink, Mode, Router};
use pdserve_types::Role;
use pdserve_worker::Worker;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// `default` or a path to a GGUF file or safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// aggregated | disaggregated | auto (per request: short prompts prefill locally).
    #[arg(long, default_value = "auto")]
    mode: Mode,
    /// Prefill workers (disaggregated and auto; default 1).
    #[arg(long)]
    prefill: Option<usize>,
    /// Decode workers (disaggregated and auto; default 1).
    #[arg(long)]
    decode: Option<usize>,
    /// Mixed workers (aggregated; default 1).
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
            .with_telemetry(Arc::new(metrics.clone()));
        // The receivers must outlive the server; they stop when dropped.
        let (link, _receivers) = kv_link(&a.kv_transport).await?;
        if let Some(link) = link {
            router = router.with_kv_link(link);
        }
        let router = Arc::new(router);
        let mode = format!("{:?}", a.mode).to_lowercase();
        let frontend = Frontend::new(
            router.clone() as Arc<dyn Generate>,
            m.tokenizer.clone(),
            m.chat.clone(),
            m.name.clone(),
            m.model.cfg.context_length,
            metrics.clone(),
        )
        .with_mode(&mode);
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        eprintln!(
            "pdserve: serving {} ({} mode, workers: {}, {threads} thread(s) each) at http://{addr}/v1 — try: curl http://{addr}/v1/completions -H 'Content-Type: application/json' -d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'",
            m.name,
            mode,
            roles.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
        );
        tokio::spawn(report_blocks(router.clone(), metrics));
        let shutdown = shutdown_signal(router.clone());
        let server = pdserve_frontend::serve(listener, frontend.router(), shutdown);
        // Graceful: stop accepting, let streams finish; after the grace period the
        // process exits and dropping the streams cancels what is left.
        let grace = Duration::from_secs(a.grace_seconds);
        tokio::select! {
            r = server => r.context("http server")?,
            _ = async { draining(&router).await; tokio::time::sleep(grace).await } => {
                eprintln!("pdserve: grace period over, cancelling {} request(s)", router.in_flight());
            }
        }
        eprintln!("pdserve: stopped");
        Ok(())
    })
}

/// Which workers to start, from the mode and the counts given.
fn topology(a: &Args) -> Vec<Role> {
    match a.mode {
        Mode::Aggregated => vec![Role::Mixed; a.workers.unwrap_or(1).max(1)],
        _ => {
            let mut r = vec![Role::Prefill; a.prefill.unwrap_or(1)];
            r.extend(vec![Role::Decode; a.decode.unwrap_or(1).max(1)]);
            r
        }
    }
}

/// Resolves on SIGINT or SIGTERM, after telling the router to refuse new requests.
async fn shutdown_signal(router: Arc<Router>) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    eprintln!("pdserve: shutting down, finishing {} request(s) in flight", router.in_flight());
    router.drain();
}

/// Resolves once the router is draining.
async fn draining(router: &Router) {
    while router.ready() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Publishes each worker's KV block counts to the metrics once a second.
async fn report_blocks(router: Arc<Router>, metrics: Metrics) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        for w in router.workers() {
            if let Some(s) = w.stats().await {
                metrics.set_kv_blocks(w.name(), s.blocks.free, s.blocks.used, s.blocks.cached);
            }
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
