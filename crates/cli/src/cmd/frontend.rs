//! `pdserve frontend`: the OpenAI API and the router in front of worker processes.
//!
//! Each worker address is kept connected for the life of the process: a worker that
//! is down is waited for (and said so in the log), one that dies leaves the router's
//! set and is reconnected when it comes back. While no worker can decode, requests
//! get 503; the process only exits on a signal.

use super::http::{self, Listen, Served};
use pdserve_frontend::Metrics;
use pdserve_kv_transfer::{ClusterKey, TransportKind};
use pdserve_protocol::Worker;
use pdserve_remote::RemoteWorker;
use pdserve_router::{Deadlines, Mode, PolicyKind, Router};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// How long start-up waits for the listed workers before serving without them.
const CONNECT_PATIENCE: Duration = Duration::from_secs(60);

#[derive(clap::Args)]
pub struct Args {
    /// Worker control addresses (`pdserve worker --listen`), comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    workers: Vec<SocketAddr>,
    /// The model the workers serve (the frontend loads only its tokenizer).
    #[arg(long, default_value = "default")]
    model: String,
    /// aggregated | disaggregated | auto.
    #[arg(long, default_value = "auto")]
    mode: Mode,
    /// How to pick among workers of one role: least-loaded | round-robin.
    #[arg(long, default_value = "least-loaded")]
    policy: PolicyKind,
    /// How prefill workers send KV to decode workers: tcp (the default) | shm (same host).
    #[arg(long)]
    kv_transport: Option<TransportKind>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    grace_seconds: u64,
    /// Refuse (429 with Retry-After) a request predicted to wait longer than this
    /// before its prefill starts; 0 turns admission control off.
    #[arg(long, default_value_t = 30.0)]
    max_queue_seconds: f64,
    /// A name the model answers to in the API (repeat for aliases; the first is listed
    /// first). Default: the model file's name.
    #[arg(long = "served-model-name")]
    served_model_names: Vec<String>,
    /// Browser origins allowed to call the API (CORS), comma separated, or `*`. Off by
    /// default.
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Vec<String>,
    #[command(flatten)]
    security: super::Security,
}

pub fn run(a: Args) -> anyhow::Result<super::Stopped> {
    let via = match (a.mode, a.kv_transport) {
        (_, Some(TransportKind::Inproc)) => {
            anyhow::bail!("--kv-transport inproc needs workers in this process (use `pdserve serve`); pick tcp or shm")
        }
        (Mode::Aggregated, Some(_)) => anyhow::bail!("--kv-transport needs --mode disaggregated or auto"),
        (_, via) => via.unwrap_or(TransportKind::Tcp),
    };
    let key = a.security.key()?;
    let meta = super::load_meta(&a.model)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let metrics = Metrics::new();
        let router = Arc::new(
            Router::new([], a.mode, Deadlines::default(), tokio::runtime::Handle::current())
                .with_policy(a.policy.build())
                .with_admission(super::admission(a.max_queue_seconds))
                .with_transport(via)
                .with_telemetry(Arc::new(metrics.clone())),
        );
        let mut first = Vec::new();
        for &addr in &a.workers {
            let (tx, rx) = tokio::sync::oneshot::channel();
            first.push(rx);
            tokio::spawn(supervise(addr, key.clone(), router.clone(), metrics.clone(), meta.name.clone(), tx));
        }
        // Serve as soon as every listed worker answered once, or after the patience.
        let _ = tokio::time::timeout(CONNECT_PATIENCE, futures_join(first)).await;
        let banner = format!(
            "workers: {}",
            router
                .workers()
                .snapshot()
                .iter()
                .map(|e| format!("{} ({})", e.name(), e.role()))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let model = Served {
            tokenizer: meta.tokenizer,
            chat: meta.chat,
            name: meta.name,
            served_names: a.served_model_names.clone(),
            allowed_origins: a.allowed_origins.clone(),
            context_length: meta.context_length,
        };
        let at = Listen {
            host: &a.host,
            port: a.port,
            grace: Duration::from_secs(a.grace_seconds),
            mode: format!("{:?}", a.mode).to_lowercase(),
        };
        http::serve(router, metrics, model, at, &banner).await
    })
}

async fn futures_join(rxs: Vec<tokio::sync::oneshot::Receiver<()>>) {
    for rx in rxs {
        let _ = rx.await;
    }
}

/// Keeps the worker at `addr` in the router's set while it is connected.
async fn supervise(
    addr: SocketAddr,
    key: ClusterKey,
    router: Arc<Router>,
    metrics: Metrics,
    model: String,
    first: tokio::sync::oneshot::Sender<()>,
) {
    let mut first = Some(first);
    pdserve_remote::keep_connected(addr, key, |w: RemoteWorker| {
        let (router, metrics, model) = (router.clone(), metrics.clone(), model.clone());
        let announce = first.take();
        async move {
            if let Some(tx) = announce {
                let _ = tx.send(());
            }
            let info = w.info().clone();
            if info.model != model {
                tracing::error!(%addr, theirs = %info.model, ours = %model, "worker serves another model; not used");
                tokio::time::sleep(Duration::from_secs(30)).await;
            } else {
                let id = router.workers().add(Arc::new(w.clone()) as Arc<dyn Worker>);
                metrics.set_role(&info.name, info.role);
                metrics.set_worker_up(&info.name, true);
                w.lost().await;
                router.workers().remove(id);
                metrics.forget_worker(&info.name);
            }
        }
    })
    .await
}
