//! `pdserve worker`: one worker in its own process, serving routers over TCP.

use super::http;
use anyhow::Context;
use pdserve_engine::batch::EngineConfig;
use pdserve_protocol::Worker;
use pdserve_remote::WorkerServer;
use pdserve_types::Role;
use pdserve_worker::{LocalWorker, WorkerOptions};
use std::net::SocketAddr;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    /// prefill | decode | mixed.
    #[arg(long)]
    role: Role,
    /// Address routers connect to (control messages and token streams).
    #[arg(long)]
    listen: SocketAddr,
    /// Where this worker receives KV over TCP; port 0 picks a free one. Default: the
    /// control address's host, any port.
    #[arg(long)]
    kv_listen: Option<SocketAddr>,
    /// `default` or a path to a GGUF file or safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// Compute threads (default 1: two workers share a 2-core machine).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// KV blocks of 16 tokens.
    #[arg(long, default_value_t = 1024)]
    kv_blocks: usize,
    /// Name in metrics and logs (default: ROLE@LISTEN).
    #[arg(long)]
    name: Option<String>,
    #[command(flatten)]
    security: super::Security,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let key = a.security.key()?;
    let m = super::load_model(&a.model)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("cannot listen on {}", a.listen))?;
        // Named by the address it actually listens on (port 0 picks one).
        let name = a.name.clone().unwrap_or(format!("{}@{}", a.role, listener.local_addr()?));
        let opts = WorkerOptions {
            name: name.clone(),
            role: a.role,
            model_name: m.name.clone(),
            engine: EngineConfig { threads: a.threads.max(1), num_blocks: a.kv_blocks, ..Default::default() },
            eog: m.tokenizer.eog_ids().to_vec(),
            key: key.clone(),
        };
        let worker = LocalWorker::spawn(opts, m.model.clone(), tokio::runtime::Handle::current())
            .with_context(|| format!("starting worker {name}"))?;
        // Every worker receives KV: its role may change to decode at run time.
        let kv = a.kv_listen.unwrap_or(SocketAddr::new(a.listen.ip(), 0));
        let kv = worker.listen_tcp(kv).await.with_context(|| format!("KV receiver on {kv}"))?;
        let sock = super::socket_path(&format!("kv-{}", kv.port()))?;
        worker.listen_shm(&sock).await.context("shared-memory KV receiver")?;
        let stop = http::signal();
        tracing::info!(
            "pdserve worker: {name} ({} role, {} thread(s)) listening on {}, KV on tcp port {}",
            a.role,
            a.threads.max(1),
            listener.local_addr()?,
            kv.port()
        );
        WorkerServer::new(Arc::new(worker) as Arc<dyn Worker>, key).serve(listener, stop).await;
        tracing::info!("pdserve worker: stopped");
        Ok(())
    })
}
