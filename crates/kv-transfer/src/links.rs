//! A sender's links, one per receiver it has sent to: the one way the prefill side
//! opens a sink, whatever the target.

use crate::{
    ClusterKey, HandoffId, HandoffToken, InProcess, KvAddr, KvSink, KvTarget, KvTransport, ShmConfig, ShmTransport,
    TcpTransport, TransferError,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// Open connections to remote receivers, connected on first use and kept.
#[derive(Default)]
pub struct Links {
    /// What this side proves to receivers.
    key: ClusterKey,
    open: Mutex<HashMap<KvAddr, Arc<dyn KvTransport>>>,
}

impl Links {
    /// Links that prove `key` to the receivers they connect to.
    pub fn new(key: ClusterKey) -> Links {
        Links { key, open: Mutex::default() }
    }

    /// Opens the sink of handoff `id` at `target`. Connecting blocks (a few seconds at
    /// most), so call it off the async workers.
    pub fn open(
        &self,
        target: &KvTarget,
        id: HandoffId,
        token: HandoffToken,
    ) -> Result<Box<dyn KvSink>, TransferError> {
        match target {
            KvTarget::InProc(inboxes) => InProcess::new(inboxes.clone()).open(id, token),
            KvTarget::Remote(addr) => {
                let link = self.link(addr)?;
                link.open(id, token).inspect_err(|_| self.forget(addr))
            }
        }
    }

    /// Drops the link to `addr` (after a failure), so the next handoff reconnects
    /// rather than reuse a link that may be down.
    pub fn forget(&self, addr: &KvAddr) {
        self.lock().remove(addr);
    }

    fn link(&self, addr: &KvAddr) -> Result<Arc<dyn KvTransport>, TransferError> {
        if let Some(t) = self.lock().get(addr) {
            return Ok(t.clone());
        }
        let connected: Arc<dyn KvTransport> = match addr {
            KvAddr::Tcp(a) => Arc::new(TcpTransport::connect(*a, &self.key)?),
            KvAddr::Shm(path) => Arc::new(ShmTransport::connect(path, ShmConfig::default(), &self.key)?),
        };
        Ok(self.lock().entry(addr.clone()).or_insert(connected).clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<KvAddr, Arc<dyn KvTransport>>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
