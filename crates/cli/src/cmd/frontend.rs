//! `pdserve frontend`: the OpenAI API and the router in front of worker processes.

use super::http::{self, Listen, Served};
use anyhow::Context;
use pdserve_frontend::Metrics;
use pdserve_remote::RemoteWorker;
use pdserve_router::{Deadlines, Mode, Node, Policy, Router};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Workers may still be loading when the frontend starts.
const CONNECT_PATIENCE: Duration = Duration::from_secs(60);

#[derive(clap::Args)]
pub struct Args {
    /// Worker control addresses (`pdserve worker --listen`), comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    workers: Vec<SocketAddr>,
    /// The model the workers serve (the frontend loads only its tokenizer).
    #[arg(long, default_value = "default")]
    model: String,
    #[arg(long, default_value = "auto")]
    mode: Mode,
    #[arg(long, default_value = "least-loaded")]
    policy: Policy,
    /// How prefill workers send KV to decode workers: tcp | shm (same host).
    #[arg(long, default_value = "tcp")]
    kv_transport: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[arg(long, default_value_t = 30)]
    grace_seconds: u64,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let transport: &'static str = match a.kv_transport.as_str() {
        "tcp" => "tcp",
        "shm" => "shm",
        other => anyhow::bail!("unknown --kv-transport `{other}` (expected tcp or shm)"),
    };
    let meta = super::load_meta(&a.model)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let metrics = Metrics::new();
        let mut nodes = Vec::new();
        for addr in &a.workers {
            let w = connect(*addr).await?;
            if w.info().model != meta.name {
                anyhow::bail!("worker {addr} serves {}, this frontend {}", w.info().model, meta.name);
            }
            metrics.set_role(w.name(), w.role());
            nodes.push(Node::Remote(w));
        }
        let banner = format!(
            "workers: {}",
            nodes.iter().map(|n| format!("{} ({})", n.name(), n.role())).collect::<Vec<_>>().join(", ")
        );
        let router = Router::new(nodes, a.mode, Deadlines::default(), tokio::runtime::Handle::current())
            .with_policy(a.policy)
            .with_remote_transport(transport)
            .with_telemetry(Arc::new(metrics.clone()));
        let model =
            Served { tokenizer: meta.tokenizer, chat: meta.chat, name: meta.name, context_length: meta.context_length };
        let at = Listen {
            host: &a.host,
            port: a.port,
            grace: Duration::from_secs(a.grace_seconds),
            mode: format!("{:?}", a.mode).to_lowercase(),
        };
        http::serve(router, metrics, model, at, &banner).await
    })
}

/// Connects to a worker, retrying while it starts.
async fn connect(addr: SocketAddr) -> anyhow::Result<RemoteWorker> {
    let start = Instant::now();
    loop {
        match RemoteWorker::connect(addr).await {
            Ok(w) => return Ok(w),
            Err(e) if start.elapsed() > CONNECT_PATIENCE => return Err(e).context("giving up"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
