//! The HTTP side shared by `serve` and `frontend`: the OpenAI API in front of a
//! router, block-count reporting, and the graceful shutdown.

use anyhow::Context;
use pdserve_engine::chat::ChatTemplate;
use pdserve_engine::tokenizer::Tokenizer;
use pdserve_frontend::{Frontend, Metrics};
use pdserve_protocol::Generate;
use pdserve_router::Router;
use std::sync::Arc;
use std::time::Duration;

/// What the frontend needs of the model.
pub struct Served {
    pub tokenizer: Arc<Tokenizer>,
    pub chat: Arc<ChatTemplate>,
    pub name: String,
    /// `--served-model-name`s; empty: `name`.
    pub served_names: Vec<String>,
    pub context_length: usize,
}

pub struct Listen<'a> {
    pub host: &'a str,
    pub port: u16,
    pub grace: Duration,
    pub mode: String,
}

/// Serves the API until SIGINT/SIGTERM, then lets requests in flight finish within
/// the grace period. `banner` describes the topology in the startup line.
pub async fn serve(
    router: Arc<Router>,
    metrics: Metrics,
    model: Served,
    at: Listen<'_>,
    banner: &str,
) -> anyhow::Result<()> {
    let frontend = Frontend::new(
        router.clone() as Arc<dyn Generate>,
        model.tokenizer,
        model.chat,
        model.name.clone(),
        model.context_length,
        metrics.clone(),
    )
    .with_mode(&at.mode)
    .with_served_names(model.served_names.clone());
    let listener = tokio::net::TcpListener::bind((at.host, at.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", at.host, at.port))?;
    let addr = listener.local_addr()?;
    tracing::info!(
        "pdserve: serving {} ({} mode, {banner}) at http://{addr}/v1 — try: curl http://{addr}/v1/completions -H 'Content-Type: application/json' -d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'",
        model.name, at.mode
    );
    tokio::spawn(report_blocks(router.clone(), metrics));
    let shutdown = shutdown_signal(router.clone());
    let server = pdserve_frontend::serve(listener, frontend.router(), shutdown);
    // Graceful: stop accepting, let streams finish; after the grace period the
    // process exits and dropping the streams cancels what is left.
    tokio::select! {
        r = server => r.context("http server")?,
        _ = async { draining(&router).await; tokio::time::sleep(at.grace).await } => {
            tracing::warn!("pdserve: grace period over, cancelling {} request(s)", router.in_flight());
        }
    }
    tracing::info!("pdserve: stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn signal() {
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
}

/// Resolves on a signal, after telling the router to refuse new requests.
async fn shutdown_signal(router: Arc<Router>) {
    signal().await;
    tracing::info!("pdserve: shutting down, finishing {} request(s) in flight", router.in_flight());
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
        for e in router.workers().snapshot() {
            if let Ok(s) = e.worker.stats().await {
                metrics.set_kv_blocks(e.name(), s.blocks.free, s.blocks.used, s.blocks.cached);
            }
        }
    }
}
