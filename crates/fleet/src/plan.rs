//! The fleet planner's lease and the roles it wants, in one key of the bucket.
//!
//! One key, [`PLAN_KEY`], holds who plans and each node's desired [`Assignment`], so
//! the lease and the roles change together or not at all. A planner takes the lease
//! by creating the key (which fails while another holds it) and keeps it by updating
//! it at the revision it last wrote, every [`REFRESH`]; the bucket expires it [`TTL`]
//! after its last write, so a dead planner's lease lapses by itself. Every write a
//! planner makes is such a compare-and-set: one that lost the lease (expired and
//! taken, or overwritten) cannot write anything, and learns it from the refusal.
//!
//! Workers follow the key and take the assignment it names for them when its epoch
//! is newer than theirs; a worker holds exactly one assignment at a time, so a planner
//! that dies between two writes leaves each worker in one role, old or new. A lapsed
//! key changes nothing: workers keep what they hold.

use crate::bus::{Bus, FleetError, NatsConfig, REFRESH, TTL};
use crate::record::{now_unix_ms, NodeId};
use crate::seal;
use async_nats::jetstream::kv::Operation;
use futures_util::StreamExt;
use pdserve_types::Assignment;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::mpsc;

/// The key of the plan in the fleet bucket.
pub const PLAN_KEY: &str = "planner";

/// The active planner and the roles it wants.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Who holds the lease (`host-pid`, or `--id`).
    pub holder: String,
    /// The assignment each node is asked to take.
    pub roles: BTreeMap<NodeId, Assignment>,
    pub updated_unix_ms: u64,
}

impl Plan {
    /// The plan sealed under the bus's key: workers take no role from anyone else.
    fn encode(&self, bus: &Bus) -> bytes::Bytes {
        bus.seal(seal::PLAN, &serde_json::to_vec(self).unwrap_or_default()).into()
    }

    /// The plan in a sealed value, if it verifies under the bus's key.
    pub fn decode(bus: &Bus, bytes: &[u8]) -> Result<Plan, String> {
        bus.open_as(seal::PLAN, bytes)
    }
}

/// Why a lease write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Another planner wrote the key since (or it expired and was taken).
    #[error("the planner lease was lost to another writer")]
    Lost,
    #[error(transparent)]
    Fleet(#[from] FleetError),
}

/// The lease, held: the plan as last written and the revision it was written at.
pub struct Lease {
    bus: Bus,
    plan: Plan,
    revision: u64,
}

impl Lease {
    /// Takes the lease for `holder` if no one holds it, starting from `roles`.
    /// `Ok(None)`: someone does (their plan is returned by [`read_plan`]).
    pub async fn take(bus: &Bus, holder: &str) -> Result<Option<Lease>, FleetError> {
        let plan = Plan { holder: holder.to_string(), roles: BTreeMap::new(), updated_unix_ms: now_unix_ms() };
        match bus.store().create(PLAN_KEY, plan.encode(bus)).await {
            Ok(revision) => Ok(Some(Lease { bus: bus.clone(), plan, revision })),
            Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(FleetError::Bucket(e.to_string())),
        }
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Writes the plan with `roles` changed, keeping the lease. Nothing changes
    /// unless the write lands.
    pub async fn write(&mut self, roles: impl IntoIterator<Item = (NodeId, Assignment)>) -> Result<(), LeaseError> {
        let mut next = self.plan.clone();
        next.roles.extend(roles);
        self.commit(next).await
    }

    /// Writes the plan again, unchanged but for its time: keeps the lease alive.
    pub async fn renew(&mut self) -> Result<(), LeaseError> {
        self.commit(self.plan.clone()).await
    }

    /// Forgets the desired roles of nodes not in `keep` (nodes that left).
    pub async fn retain(&mut self, keep: impl Fn(&NodeId) -> bool) -> Result<(), LeaseError> {
        let mut next = self.plan.clone();
        next.roles.retain(|id, _| keep(id));
        if next.roles.len() == self.plan.roles.len() {
            return Ok(());
        }
        self.commit(next).await
    }

    async fn commit(&mut self, mut next: Plan) -> Result<(), LeaseError> {
        next.updated_unix_ms = now_unix_ms();
        match self.bus.store().update(PLAN_KEY, next.encode(&self.bus), self.revision).await {
            Ok(revision) => {
                (self.plan, self.revision) = (next, revision);
                Ok(())
            }
            Err(e) if e.kind() == async_nats::jetstream::kv::UpdateErrorKind::WrongLastRevision => {
                Err(LeaseError::Lost)
            }
            Err(e) => Err(LeaseError::Fleet(FleetError::Bucket(e.to_string()))),
        }
    }

    /// Gives the lease up at once (a clean stop), so a standby need not wait for it
    /// to lapse. The desired roles go with it; workers keep what they hold. Nothing
    /// can be written under this lease afterwards.
    pub async fn release(&mut self) {
        let _ = self.bus.store().delete_expect_revision(PLAN_KEY, Some(self.revision)).await;
        // No write is ever made at revision 0 of an existing key.
        self.revision = 0;
    }
}

/// The plan in the bucket now, if a planner holds the lease.
pub async fn read_plan(bus: &Bus) -> Result<Option<Plan>, FleetError> {
    let bytes = bus.store().get(PLAN_KEY).await.map_err(|e| FleetError::Bucket(e.to_string()))?;
    Ok(bytes.and_then(|b| Plan::decode(bus, &b).ok()))
}

/// Follows the plan for node `id` on the current runtime: each assignment the plan
/// names for it arrives on the receiver (the caller takes those newer than its own).
/// Dropping the receiver stops the follower. NATS may come and go; the plan is
/// read afresh each time the watch is set up again.
pub fn follow_plan(cfg: NatsConfig, id: NodeId) -> mpsc::Receiver<(String, Assignment)> {
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        loop {
            let bus = tokio::select! {
                bus = Bus::connect_patiently(&cfg) => bus,
                _ = tx.closed() => return,
            };
            let mut watch = match bus.store().watch_with_history(PLAN_KEY).await {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch the planner's key; retrying");
                    tokio::time::sleep(REFRESH).await;
                    continue;
                }
            };
            loop {
                let entry = tokio::select! {
                    e = watch.next() => e,
                    _ = tx.closed() => return,
                };
                let Some(Ok(entry)) = entry else { break };
                if entry.operation != Operation::Put {
                    continue;
                }
                match Plan::decode(&bus, &entry.value) {
                    Ok(plan) => {
                        if let Some(&a) = plan.roles.get(&id) {
                            if tx.send((plan.holder, a)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "a plan ignored"),
                }
            }
            tracing::warn!("the planner watch ended; watching again");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    rx
}

/// How long a planner may go without renewing before it must assume the lease
/// lapsed: well inside [`TTL`], so it stops acting before a standby can start.
pub const LEASE_GRACE: Duration = Duration::from_millis(TTL.as_millis() as u64 * 2 / 3);
