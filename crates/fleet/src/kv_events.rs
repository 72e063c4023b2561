//! A fleet worker's KV events, pushed over NATS to every router at once.
//!
//! Each worker publishes the events its pool logs on `pdserve.kv.<node_id>`, in
//! batches every [`KV_EVERY`] (and an empty one at least every [`KV_HEARTBEAT`], so
//! routers know the stream is alive). A router applies a batch only where it
//! continues what it holds of that worker; a gap, a restart or a new router is healed
//! by asking the worker over its control connection, as without NATS. Core NATS, not
//! JetStream: a lost batch costs a poll, never a wrong index.

use crate::bus::{subscribe_sealed, Bus, NatsConfig};
use crate::record::NodeId;
use crate::seal;
use pdserve_protocol::{KvCursor, KvEvents, Worker};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Subjects of the workers' KV events: this, then the node id.
pub const KV_SUBJECT_PREFIX: &str = "pdserve.kv.";
/// How often a worker looks for new events to publish.
pub const KV_EVERY: Duration = Duration::from_millis(10);
/// The longest a worker stays silent.
pub const KV_HEARTBEAT: Duration = Duration::from_millis(400);

/// One batch: the events after `from`, by the worker named `worker`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvBatch {
    pub worker: String,
    pub from: KvCursor,
    pub events: KvEvents,
}

/// Publishes `worker`'s KV events as node `id` until the process ends.
pub fn publish_kv_events(cfg: NatsConfig, id: NodeId, worker: Arc<dyn Worker>) {
    tokio::spawn(async move {
        let bus = Bus::connect_patiently(&cfg).await;
        let client = bus.client();
        let subject = format!("{KV_SUBJECT_PREFIX}{id}");
        let name = worker.info().name.clone();
        let mut cursor = KvCursor::default();
        let mut last = Instant::now();
        loop {
            tokio::time::sleep(KV_EVERY).await;
            // A worker that keeps no log publishes nothing.
            let Some(log) = worker.kv_event_log() else { continue };
            let Ok(got) = log.kv_events(cursor).await else { continue };
            let from = cursor;
            cursor = got.cursor;
            // A snapshot (the first read, or a log that ran past us) is for routers to
            // ask for themselves: publishing starts after it.
            let quiet = got.events.is_empty() && last.elapsed() < KV_HEARTBEAT;
            if got.snapshot.is_some() || quiet {
                continue;
            }
            let batch = KvBatch { worker: name.clone(), from, events: got };
            let body = bus.seal(seal::KV_EVENTS, &serde_json::to_vec(&batch).unwrap_or_default());
            if let Err(e) = client.publish(subject.clone(), body.into()).await {
                tracing::debug!(error = %e, "KV events not published");
            }
            last = Instant::now();
        }
    });
}

/// Every batch any worker publishes from now on, until the receiver is dropped. A
/// router that falls behind drops batches: polling catches it up.
pub fn follow_kv_events(cfg: NatsConfig) -> mpsc::Receiver<KvBatch> {
    subscribe_sealed(cfg, format!("{KV_SUBJECT_PREFIX}>"), seal::KV_EVENTS, 1024)
}
