//! A sender's links, one per receiver it has sent to: the one way the prefill side
//! opens a sink, whatever the target.

use crate::{ClusterKey, HandoffId, HandoffToken, InProcess, KvAddr, KvSink, KvTarget, KvTransport, TransferError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A receiver that refused or did not answer is not tried again for this long: the
/// handoffs sent its way fail at once (and fall back) instead of each waiting out a
/// connection timeout.
const COOL_DOWN: Duration = Duration::from_secs(10);

/// Open connections to remote receivers, connected on first use and kept.
#[derive(Default)]
pub struct Links {
    /// What this side proves to receivers, and asks them to prove.
    key: ClusterKey,
    open: Mutex<State>,
}

#[derive(Default)]
struct State {
    links: HashMap<KvAddr, Arc<dyn KvTransport>>,
    /// Receivers that failed to connect, and when.
    failed: HashMap<KvAddr, Instant>,
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
            KvTarget::InProc(t) => match crate::inboxes_of(t) {
                Some(inboxes) => InProcess::new(inboxes.clone()).open(id, token),
                None => Err(TransferError::ReceiverGone(id)),
            },
            KvTarget::Remote(addr) => {
                let link = self.link(addr)?;
                link.open(id, token).inspect_err(|_| self.forget(addr))
            }
        }
    }

    /// Opens a [part](crate::Share::Part) of handoff `id` at `target`, which must be
    /// in another process; blocks as [`Links::open`] does.
    pub fn open_part(
        &self,
        target: &KvAddr,
        id: HandoffId,
        token: HandoffToken,
    ) -> Result<Box<dyn KvSink>, TransferError> {
        self.link(target)?.open_part(id, token).inspect_err(|_| self.forget(target))
    }

    /// Drops the link to `addr` (after a failure), so the next handoff reconnects
    /// rather than reuse a link that may be down.
    pub fn forget(&self, addr: &KvAddr) {
        self.lock().links.remove(addr);
    }

    fn link(&self, addr: &KvAddr) -> Result<Arc<dyn KvTransport>, TransferError> {
        {
            let st = self.lock();
            if let Some(t) = st.links.get(addr) {
                return Ok(t.clone());
            }
            if st.failed.get(addr).is_some_and(|t| t.elapsed() < COOL_DOWN) {
                return Err(TransferError::Disconnected(format!("{addr:?} failed recently; not retried yet")));
            }
        }
        let connected = match crate::remote(addr.kind()) {
            Some(t) => t.connect(addr, &self.key),
            None => Err(TransferError::Disconnected(format!("{addr:?} is not reachable from another process"))),
        };
        let mut st = self.lock();
        match connected {
            Ok(t) => {
                st.failed.remove(addr);
                Ok(st.links.entry(addr.clone()).or_insert(t).clone())
            }
            Err(e) => {
                st.failed.insert(addr.clone(), Instant::now());
                Err(e)
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
