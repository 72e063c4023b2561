//! `pdserve worker`: one worker in its own process, serving routers over TCP.

use super::http;
use anyhow::Context;
use pdserve_engine::batch::EngineConfig;
use pdserve_kv_transfer::{Inboxes, ShmReceiver, TcpReceiver};
use pdserve_remote::{WorkerInfo, WorkerServer, PROTOCOL_VERSION};
use pdserve_types::Role;
use pdserve_worker::Worker;
use std::net::SocketAddr;

#[derive(clap::Args)]
pub struct Args {
    /// prefill | decode | mixed.
    #[arg(long)]
    role: Role,
    /// Address routers connect to (control messages and token streams).
    #[arg(long)]
    listen: SocketAddr,
    /// Where this worker receives KV (decode and mixed); port 0 picks a free one.
    /// Default: the control address's host, any port.
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
}

/// Holds the KV receivers alive for the life of the process.
struct Receivers {
    tcp: TcpReceiver,
    shm: ShmReceiver,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let m = super::load_model(&a.model)?;
    let name = a.name.clone().unwrap_or_else(|| format!("{}@{}", a.role, a.listen));
    let cfg = EngineConfig { threads: a.threads.max(1), num_blocks: a.kv_blocks, ..Default::default() };
    let worker = Worker::spawn(&name, a.role, m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec())
        .with_context(|| format!("starting worker {name}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("cannot listen on {}", a.listen))?;
        let (inboxes, receivers) = match a.role {
            Role::Prefill => (None, None),
            Role::Decode | Role::Mixed => {
                let (inboxes, r) = kv_receivers(a.kv_listen.unwrap_or(SocketAddr::new(a.listen.ip(), 0))).await?;
                (Some(inboxes), Some(r))
            }
        };
        let info = WorkerInfo {
            protocol: PROTOCOL_VERSION,
            name: name.clone(),
            role: a.role,
            model: m.name.clone(),
            kv_tcp_port: receivers.as_ref().map(|r| r.tcp.local_addr().port()),
            kv_shm: receivers.as_ref().map(|r| r.shm.path().to_path_buf()),
        };
        eprintln!(
            "pdserve worker: {name} ({} role, {} thread(s)) listening on {}{}",
            a.role,
            a.threads.max(1),
            listener.local_addr()?,
            info.kv_tcp_port.map(|p| format!(", KV on tcp port {p}")).unwrap_or_default()
        );
        WorkerServer::new(worker, info, inboxes).serve(listener, http::signal()).await;
        drop(receivers);
        eprintln!("pdserve worker: stopped");
        Ok(())
    })
}

async fn kv_receivers(tcp: SocketAddr) -> anyhow::Result<(Inboxes, Receivers)> {
    let inboxes = Inboxes::new(256);
    let tcp = TcpReceiver::bind(tcp, inboxes.clone()).await.with_context(|| format!("KV receiver on {tcp}"))?;
    let sock = std::env::temp_dir().join(format!("pdserve-kv-{}-{}.sock", std::process::id(), tcp.local_addr().port()));
    let _ = std::fs::remove_file(&sock);
    let shm = ShmReceiver::bind(&sock, inboxes.clone()).await.context("shared-memory KV receiver")?;
    Ok((inboxes, Receivers { tcp, shm }))
}
