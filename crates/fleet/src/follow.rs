//! Following the fleet: every write of a node record, and every node that leaves.
//!
//! A node is up while its record is in the bucket. It leaves when its record is
//! deleted (a clean stop), or when it has not been written for [`TTL`], a fresh
//! read of the bucket no longer holds it (the bucket expired it), and it does not
//! write again within [`MISSING_GRACE`]. The fresh read guards against a watch that
//! stopped delivering: a record still in the bucket keeps its node. The grace
//! covers the bucket losing records that are alive: a JetStream leader lost with its
//! server is re-elected seconds later, and records whose writes failed for [`TTL`]
//! meanwhile expire; their nodes write again once they can. While NATS
//! itself is unreachable nobody leaves. In every case in-flight work and the control
//! connections decide whether a node is usable; the view only adds and drops them.

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
/// How long a node whose record expired may take to write it again before it is
/// taken to have left.
pub const MISSING_GRACE: Duration = Duration::from_secs(10);

/// Follows the fleet at `cfg` on the current runtime; the changes arrive on the
/// receiver, which stops the follower when dropped.
pub fn follow(cfg: NatsConfig) -> mpsc::Receiver<Change> {
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(async move {
        let mut view = View { tx, seen: HashMap::new(), missing: HashMap::new() };
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
    /// Nodes whose records a fresh read no longer held, and since when.
    missing: HashMap<NodeId, Instant>,
}

impl View {
    /// Follows `bus` until the receiver leaves (false) or the watch breaks (true).
    async fn run(&mut self, bus: &Bus) -> bool {
        loop {
            // The watch first, then the read: a write (a clean stop's delete) that
            // lands between the two is in the watch; one in both is seen once.
            let mut watch = match bus.watch().await {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch the fleet bucket; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            if !self.resync(bus).await {
                return !self.tx.is_closed();
            }
            let mut sweep = tokio::time::interval(SWEEP);
            loop {
                tokio::select! {
                    entry = watch.next() => match entry {
                        Some(Ok(e)) => {
                            if !self.apply(bus, &e.key, e.operation, &e.value).await {
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
                        if !self.give_up_missing().await {
                            return false;
                        }
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
            self.seen.remove(&id);
            tracing::info!(node = %id, grace_s = MISSING_GRACE.as_secs(), "a fleet record expired; waiting for it");
            self.missing.insert(id, Instant::now());
        }
        for rec in nodes {
            self.up(rec).await;
        }
        true
    }

    async fn apply(&mut self, bus: &Bus, key: &str, op: Operation, value: &[u8]) -> bool {
        let Some(id) = node_of(key) else { return true };
        match op {
            Operation::Put => match bus.record(value) {
                Ok(rec) if rec.node_id == id => self.up(rec).await,
                Ok(_) => tracing::warn!(key, "a record under another node's key; ignored"),
                Err(e) => tracing::warn!(key, error = %e, "a record ignored"),
            },
            Operation::Delete | Operation::Purge => self.down(id).await,
        }
        !self.tx.is_closed()
    }

    /// Nodes missing for longer than the grace have left. False once the receiver
    /// is gone.
    async fn give_up_missing(&mut self) -> bool {
        let over: Vec<NodeId> = self
            .missing
            .iter()
            .filter(|(_, since)| since.elapsed() > MISSING_GRACE)
            .map(|(id, _)| id.clone())
            .collect();
        for id in over {
            self.missing.remove(&id);
            let _ = self.tx.send(Change::Down(id)).await;
        }
        !self.tx.is_closed()
    }

    async fn up(&mut self, rec: NodeRecord) {
        if older_than_seen(&self.seen, &rec) {
            // A sealed record can be replayed by anyone who saw it; one older than
            // what the node last wrote is not news.
            tracing::debug!(node = %rec.node_id, "a record older than the node's last one; ignored");
            return;
        }
        if self.missing.remove(&rec.node_id).is_some() {
            tracing::info!(node = %rec.node_id, "a fleet record written again after it expired");
        }
        let first_seen = match self.seen.get(&rec.node_id) {
            Some(&(written, at)) if written == rec.updated_unix_ms => at,
            _ => Instant::now(),
        };
        self.seen.insert(rec.node_id.clone(), (rec.updated_unix_ms, first_seen));
        let _ = self.tx.send(Change::Up(Box::new(rec))).await;
    }

    async fn down(&mut self, id: NodeId) {
        if self.seen.remove(&id).is_some() | self.missing.remove(&id).is_some() {
            let _ = self.tx.send(Change::Down(id)).await;
        }
    }
}

/// Whether `rec` was written before the newest record seen from its node.
fn older_than_seen(seen: &HashMap<NodeId, (u64, Instant)>, rec: &NodeRecord) -> bool {
    seen.get(&rec.node_id).is_some_and(|&(written, _)| rec.updated_unix_ms < written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_older_than_the_nodes_last_is_a_replay() {
        let mut seen = HashMap::new();
        let fresh = NodeRecord::sample("n1", 2_000);
        assert!(!older_than_seen(&seen, &fresh), "a node not seen yet");
        seen.insert(fresh.node_id.clone(), (2_000, Instant::now()));
        assert!(!older_than_seen(&seen, &fresh), "the same write again (a fresh read)");
        assert!(!older_than_seen(&seen, &NodeRecord::sample("n1", 3_000)));
        assert!(older_than_seen(&seen, &NodeRecord::sample("n1", 1_999)));
        assert!(!older_than_seen(&seen, &NodeRecord::sample("n2", 1)), "another node");
    }
}
