//! A node keeps its record in the bucket: written every [`REFRESH`], deleted on a
//! clean stop, expired by the bucket if the node dies.

use crate::bus::{Bus, NatsConfig, REFRESH};
use crate::record::{NodeId, NodeRecord};
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
    let (stop, mut stopped) = oneshot::channel();
    let task = tokio::spawn(async move {
        let mut bus = tokio::select! {
            bus = Bus::connect_patiently(&cfg) => bus,
            _ = &mut stopped => return,
        };
        tracing::info!(node = %id, url = %cfg.url, "registered in the fleet");
        let mut failing = false;
        loop {
            match bus.put(&record().await).await {
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
        match bus.remove(&id).await {
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
