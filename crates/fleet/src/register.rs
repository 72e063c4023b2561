//! A node keeps its record in the bucket: written every [`REFRESH`], deleted on a
//! clean stop, expired by the bucket if the node dies.

use crate::bus::{Bus, NatsConfig, REFRESH};
use crate::record::{NodeId, NodeRecord};
use crate::seal;
use std::future::Future;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A node's registration, running until [`Registration::deregister`].
pub struct Registration {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// Registers node `id` with the record `record` makes, on the current runtime. NATS
/// may come later or go away: the node serves regardless and registers once it can.
pub fn register<F, Fut>(cfg: NatsConfig, id: NodeId, mut record: F) -> Registration
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = NodeRecord> + Send,
{
    let key = crate::bus::key(&id);
    keep(cfg, id, key, seal::NODE, move || {
        let rec = record();
        async move { rec.await.encode() }
    })
}

/// Keeps the value `body` makes under `key`, sealed for `label`, for node `id`:
/// written every [`REFRESH`] from when NATS first answers, deleted by
/// [`Registration::deregister`].
pub(crate) fn keep<F, Fut>(cfg: NatsConfig, id: NodeId, key: String, label: &'static [u8], mut body: F) -> Registration
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = Vec<u8>> + Send,
{
    let (stop, mut stopped) = oneshot::channel();
    let task = tokio::spawn(async move {
        let mut bus = tokio::select! {
            bus = Bus::connect_patiently(&cfg) => bus,
            _ = &mut stopped => return,
        };
        tracing::info!(node = %id, key, url = %cfg.url, "registered in the fleet");
        let mut failing = false;
        loop {
            match bus.put_sealed(&key, label, &body().await).await {
                Ok(()) if failing => {
                    tracing::info!(node = %id, "fleet record written again");
                    failing = false;
                }
                Ok(()) => {}
                Err(e) => {
                    if !failing {
                        tracing::warn!(node = %id, error = %e, "cannot write the fleet record; retrying");
                        failing = true;
                    }
                    // The bucket may be gone with a restarted server: make it again.
                    if bus.is_connected() {
                        let _ = bus.reopen().await;
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(REFRESH) => {}
                _ = &mut stopped => break,
            }
        }
        match bus.remove_key(&key).await {
            Ok(()) => tracing::info!(node = %id, "left the fleet"),
            Err(e) => tracing::warn!(node = %id, error = %e, "cannot delete the fleet record; it expires"),
        }
    });
    Registration { stop, task }
}

impl Registration {
    /// Deletes the record (frontends stop sending work at once) and stops refreshing.
    pub async fn deregister(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(3), self.task).await;
    }
}
