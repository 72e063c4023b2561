//! `pdserve frontend`: the OpenAI API and the router in front of worker processes.
//!
//! Each worker address is kept connected for the life of the process: a worker that
//! is down is waited for (and said so in the log), one that dies leaves the router's
//! set and is reconnected when it comes back. While no worker can decode, requests
//! get 503; the process only exits on a signal.

use super::http::{self, ApiArgs, Served};
use pdserve_frontend::Metrics;
use pdserve_kv_transfer::{ClusterKey, TransportKind};
use pdserve_protocol::Worker;
use pdserve_remote::RemoteWorker;
use pdserve_router::{Mode, PolicyKind, Router};
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
    #[command(flatten)]
    api: ApiArgs,
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
            Router::new([], a.mode, a.api.deadlines(), tokio::runtime::Handle::current())
                .with_policy(a.policy.build())
                .with_admission(a.api.admission())
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
        let model =
            Served { tokenizer: meta.tokenizer, chat: meta.chat, name: meta.name, context_length: meta.context_length };
        http::serve(router, metrics, model, &a.api, &banner).await
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
