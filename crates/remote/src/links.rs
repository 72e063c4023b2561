//! A prefill worker's open KV links, one per decode worker it has sent to.

use crate::wire::KvAddr;
use pdserve_kv_transfer::{KvTransport, ShmConfig, ShmTransport, TcpTransport, TransferError};
use pdserve_protocol::ServeError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Default)]
pub struct Links {
    open: Mutex<HashMap<KvAddr, Arc<dyn KvTransport>>>,
}

impl Links {
    /// The link to `to`, connecting on first use (blocking connect, off the async
    /// workers).
    pub async fn get(&self, to: &KvAddr) -> Result<Arc<dyn KvTransport>, ServeError> {
        if let Some(t) = self.lock().get(to) {
            return Ok(t.clone());
        }
        let addr = to.clone();
        let connected = tokio::task::spawn_blocking(move || connect(&addr))
            .await
            .map_err(|e| ServeError::Internal(format!("connecting to {to:?}: {e}")))?
            .map_err(|e| ServeError::Internal(format!("cannot open a KV link to {to:?}: {e}")))?;
        Ok(self.lock().entry(to.clone()).or_insert(connected).clone())
    }

    /// Drops the link to `to` (after a failure), so the next transfer reconnects.
    pub fn forget(&self, to: &KvAddr) {
        self.lock().remove(to);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<KvAddr, Arc<dyn KvTransport>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn connect(to: &KvAddr) -> Result<Arc<dyn KvTransport>, TransferError> {
    Ok(match to {
        KvAddr::Tcp(addr) => Arc::new(TcpTransport::connect(*addr)?),
        KvAddr::Shm(path) => Arc::new(ShmTransport::connect(path, ShmConfig::default())?),
    })
}
