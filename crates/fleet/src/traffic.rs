//! Frontends tell a fleet planner about their traffic: every request's arrival and
//! end, and the prefill pace they measured per worker, in batches on one subject.
//!
//! Core NATS publish, no JetStream: a planner that is down or slow misses batches,
//! and its window simply sees less traffic; no request waits on this.

use crate::bus::{subscribe_sealed, Bus, NatsConfig};
use crate::seal;
use pdserve_types::RequestSample;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::mpsc;

/// The subject frontends publish their traffic on.
pub const TRAFFIC_SUBJECT: &str = "pdserve.traffic";
/// How often a frontend publishes what came since its last batch.
pub const TRAFFIC_EVERY: Duration = Duration::from_millis(250);
/// Samples in one batch at most; a busier frontend sends several.
const BATCH: usize = 2048;

/// What one frontend saw since its last batch.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrafficBatch {
    pub frontend: String,
    /// The model the requests were for (a frontend may serve several; empty from one
    /// that names none).
    #[serde(default)]
    pub model: String,
    pub samples: Vec<RequestSample>,
    /// Seconds per prompt token each worker prefilled at, by worker name.
    pub prefill_pace: BTreeMap<String, f64>,
}

/// Publishes `samples` of `model` as they come, with the paces `pace` reads, every
/// [`TRAFFIC_EVERY`], until the sender side closes. Batches made while NATS is
/// away are dropped.
pub fn publish_traffic<F>(
    cfg: NatsConfig,
    frontend: String,
    model: String,
    mut samples: mpsc::Receiver<RequestSample>,
    pace: F,
) where
    F: Fn() -> BTreeMap<String, f64> + Send + 'static,
{
    tokio::spawn(async move {
        let bus = Bus::connect_patiently(&cfg).await;
        let client = bus.client();
        let mut tick = tokio::time::interval(TRAFFIC_EVERY);
        loop {
            tick.tick().await;
            let mut batch = TrafficBatch {
                frontend: frontend.clone(),
                model: model.clone(),
                samples: Vec::new(),
                prefill_pace: pace(),
            };
            let mut open = true;
            while batch.samples.len() < BATCH {
                match samples.try_recv() {
                    Ok(s) => batch.samples.push(s),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            if !batch.samples.is_empty() || !batch.prefill_pace.is_empty() {
                let body = bus.seal(seal::TRAFFIC, &serde_json::to_vec(&batch).unwrap_or_default());
                if let Err(e) = client.publish(TRAFFIC_SUBJECT, body.into()).await {
                    tracing::debug!(error = %e, "traffic batch not published");
                }
            }
            if !open {
                return;
            }
        }
    });
}

/// Every batch any frontend publishes from now on, until the receiver is dropped.
pub fn follow_traffic(cfg: NatsConfig) -> mpsc::Receiver<TrafficBatch> {
    subscribe_sealed(cfg, TRAFFIC_SUBJECT.to_string(), seal::TRAFFIC, 64)
}
