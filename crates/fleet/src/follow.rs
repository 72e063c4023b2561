//! Following the fleet: every write of a node record, and every node that leaves.
//!
//! A node is up while its record is in the bucket. It leaves when its record is
//! deleted (a clean stop) or when it has not been written for [`TTL`] and a fresh
//! read of the bucket no longer holds it (the bucket expired it). The fresh read
//! guards against a watch that stopped delivering: a record still in the bucket
//! keeps its node. While NATS itself is unreachable nobody leaves — in-flight work
//! and the control connections decide then — and the view is read afresh once NATS
//! is back.

use crate::bus::{node_of, Bus, NatsConfig, TTL};
use crate::record::{NodeId, NodeRecord};
use async_nats::jetstream::kv::Operation;
use futures_util::StreamExt;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// What changed in the fleet.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// A node wrote its record (new, or a refresh with its current load).
    Up(Box<NodeRecord>),
    /// A node left.
    Down(NodeId),
}

/// How often records are checked for age.
const SWEEP: Duration = Duration::from_millis(250);

/// Follows the fleet at `cfg` on the current runtime; the changes arrive on the
/// receiver, which stops the follower when dropped.
pub fn follow(cfg: NatsConfig) -> mpsc::Receiver<Change> {
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(async move {
        let mut view = View { tx, seen: HashMap::new() };
        loop {
            let bus = tokio::select! {
                bus = Bus::connect_patiently(&cfg) => bus,
                _ = view.tx.closed() => return,
            };
            tracing::info!(url = %cfg.url, "following the fleet");
            if !view.run(&bus).await {
                return;
            }
        }
    });
    rx
}

struct View {
    tx: mpsc::Sender<Change>,
    /// Nodes up: the write time their record carries, and when this process first
    /// saw that write. A write seen again (a fresh read, a new watch) is not news.
    seen: HashMap<NodeId, (u64, Instant)>,
}

impl View {
    /// Follows `bus` until the receiver leaves (false) or the watch breaks (true).
    async fn run(&mut self, bus: &Bus) -> bool {
        loop {
            if !self.resync(bus).await {
                return !self.tx.is_closed();
            }
            let mut watch = match bus.watch().await {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch the fleet bucket; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            let mut sweep = tokio::time::interval(SWEEP);
            loop {
                tokio::select! {
                    entry = watch.next() => match entry {
                        Some(Ok(e)) => {
                            if !self.apply(&e.key, e.operation, &e.value).await {
                                return false;
                            }
                        }
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "the fleet watch failed; reading the bucket afresh");
                            break;
                        }
                        None => break,
                    },
                    _ = sweep.tick() => {
                        let stale = self.seen.values().any(|(_, t)| t.elapsed() > TTL);
                        // A stale node with NATS up: read the bucket afresh (and watch
                        // anew, in case the watch is what went quiet).
                        if stale && bus.is_connected() {
                            break;
                        }
                    }
                    _ = self.tx.closed() => return false,
                }
            }
        }
    }

    /// Reads the whole bucket: nodes in it are up, known nodes missing from it left.
    /// False when the bucket could not be read (nothing changes then).
    async fn resync(&mut self, bus: &Bus) -> bool {
        let nodes = match bus.nodes().await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the fleet bucket");
                tokio::time::sleep(Duration::from_secs(1)).await;
                return false;
            }
        };
        let gone: Vec<NodeId> =
            self.seen.keys().filter(|id| !nodes.iter().any(|n| &n.node_id == *id)).cloned().collect();
        for id in gone {
            self.down(id).await;
        }
        for rec in nodes {
            self.up(rec).await;
        }
        true
    }

    async fn apply(&mut self, key: &str, op: Operation, value: &[u8]) -> bool {
        let Some(id) = node_of(key) else { return true };
        match op {
            Operation::Put => match NodeRecord::decode(value) {
                Ok(rec) if rec.node_id == id => self.up(rec).await,
                Ok(_) => tracing::warn!(key, "a record under another node's key; ignored"),
                Err(e) => tracing::warn!(key, error = %e, "a record that does not parse; ignored"),
            },
            Operation::Delete | Operation::Purge => self.down(id).await,
        }
        !self.tx.is_closed()
    }

    async fn up(&mut self, rec: NodeRecord) {
        let first_seen = match self.seen.get(&rec.node_id) {
            Some(&(written, at)) if written == rec.updated_unix_ms => at,
            _ => Instant::now(),
        };
        self.seen.insert(rec.node_id.clone(), (rec.updated_unix_ms, first_seen));
        let _ = self.tx.send(Change::Up(Box::new(rec))).await;
    }

    async fn down(&mut self, id: NodeId) {
        if self.seen.remove(&id).is_some() {
            let _ = self.tx.send(Change::Down(id)).await;
        }
    }
}
