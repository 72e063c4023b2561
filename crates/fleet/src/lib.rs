//! The fleet over NATS.
//!
//! Workers started with `--nats` [`register`] a [`NodeRecord`] (who they are, where
//! to reach them, their KV blocks and load) in one JetStream key-value bucket and
//! refresh it every second; frontends [`follow`] the bucket to keep their worker set
//! and read each worker's own reported load; `pdserve fleet` prints it. A fleet
//! planner holds a [`Lease`] on one more key, which names the role it wants of each
//! node, and frontends publish their traffic for it; workers push their KV events to
//! every router. A worker [`join`]s with all of that at once, and times its KV links
//! to the peers that decode. Only this state goes over NATS: control calls use each
//! worker's direct connection, and KV bytes never touch NATS.

mod bus;
mod follow;
pub mod forest;
mod host;
mod kv_events;
mod member;
mod plan;
mod probe;
mod record;
mod register;
pub mod request_lease;
pub mod seal;
mod stage;
mod traffic;

pub use bus::{Bus, FleetError, NatsConfig, BUCKET, REFRESH, TTL};
pub use follow::{follow, Change};
pub use host::memory_available;
pub use kv_events::{follow_kv_events, publish_kv_events, KvBatch, KV_SUBJECT_PREFIX};
pub use member::{join, Member};
pub use plan::{follow_plan, read_plan, Lease, LeaseError, Plan, LEASE_GRACE, PLAN_KEY};
pub use probe::SendProbe;
pub use record::{now_unix_ms, Endpoints, KvCache, LinkRecord, Load, NodeId, NodeRecord};
pub use register::{register, Registration};
pub use stage::{announce_stage, find_stages, StageRecord};
pub use traffic::{follow_traffic, publish_traffic, TrafficBatch, TRAFFIC_EVERY, TRAFFIC_SUBJECT};
