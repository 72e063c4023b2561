//! Keeping a connection to a worker whose address is configured: connect with
//! backoff, hand each new connection over, wait for it to be lost, start again. A
//! worker that restarts is used again; one that never answers is reported, not fatal.

use crate::{ConnectError, RemoteWorker};
use pdserve_kv_transfer::ClusterKey;
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const FIRST_RETRY: Duration = Duration::from_millis(200);
const MAX_RETRY: Duration = Duration::from_secs(5);
/// How often a worker that does not answer is reported again.
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// Connects to `addr` for as long as this future runs. Each connection goes to `up`,
/// whose future should resolve once the worker is done with (normally when
/// [`RemoteWorker::lost`] resolves); then the next connection is sought.
pub async fn keep_connected<F, Fut>(addr: SocketAddr, key: ClusterKey, mut up: F)
where
    F: FnMut(RemoteWorker) -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        let w = connect_patiently(addr, &key).await;
        tracing::info!(worker = %w.info_name(), %addr, "connected to worker");
        up(w).await;
        tracing::warn!(%addr, "worker lost; reconnecting");
    }
}

/// Connects, retrying with backoff and saying what it waits for.
async fn connect_patiently(addr: SocketAddr, key: &ClusterKey) -> RemoteWorker {
    let start = Instant::now();
    let mut wait = FIRST_RETRY;
    let mut reported: Option<Instant> = None;
    loop {
        match RemoteWorker::connect(addr, key).await {
            Ok(w) => return w,
            Err(e) => {
                if reported.is_none_or(|t| t.elapsed() >= REPORT_EVERY) {
                    report(addr, &e, start.elapsed());
                    reported = Some(Instant::now());
                }
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(MAX_RETRY);
    }
}

fn report(addr: SocketAddr, e: &ConnectError, waited: Duration) {
    tracing::warn!(%addr, error = %e, waited_s = waited.as_secs(), "waiting for worker");
}

impl RemoteWorker {
    fn info_name(&self) -> String {
        pdserve_protocol::Worker::info(self).name.clone()
    }
}
