//! A worker's membership in the fleet: its node record written every second, its KV
//! events published, the roles a fleet planner sets taken, and its links to the
//! peers that decode timed.

use crate::probe::{LinkTable, Prober, SendProbe};
use crate::{Endpoints, KvCache, Load, NatsConfig, NodeId, NodeRecord, Registration};
use pdserve_kv_transfer::ClusterKey;
use pdserve_protocol::{Capabilities, Worker};
use std::sync::Arc;

/// One worker as the fleet knows it.
pub struct Member {
    pub id: NodeId,
    pub worker: Arc<dyn Worker>,
    /// Where others reach it (after any `--advertise` rewrite).
    pub endpoints: Endpoints,
    pub threads: usize,
    /// KV blocks of 16 tokens.
    pub blocks: usize,
    /// Times this worker's side of a link probe.
    pub send_probe: SendProbe,
    pub key: ClusterKey,
}

/// Joins the fleet at `cfg`: probes the links to its peers, takes the roles its
/// planner sets, publishes its KV events and keeps its node record written until the
/// registration is dropped or deregistered.
pub fn join(cfg: NatsConfig, m: Member) -> Registration {
    let links = Arc::new(LinkTable::default());
    let prober =
        Prober { me: m.id.clone(), my_kv: m.endpoints.kv, send: m.send_probe, key: m.key, table: links.clone() };
    tokio::spawn(prober.run(cfg.clone()));
    tokio::spawn(take_planned_roles(cfg.clone(), m.id.clone(), m.worker.clone()));
    crate::publish_kv_events(cfg.clone(), m.id.clone(), m.worker.clone());
    let node = Node {
        id: m.id.clone(),
        worker: m.worker,
        endpoints: m.endpoints,
        threads: m.threads,
        blocks: m.blocks,
        links,
    };
    crate::register(cfg, m.id, move || node.clone().record())
}

/// Takes each role a fleet planner names for this node in the plan. The plan is
/// written again every second: only a newer epoch is news, and the worker itself
/// refuses one older than it holds.
async fn take_planned_roles(cfg: NatsConfig, id: NodeId, worker: Arc<dyn Worker>) {
    let mut plan = crate::follow_plan(cfg, id);
    let mut seen = None;
    while let Some((holder, want)) = plan.recv().await {
        if seen.is_some_and(|s| s >= want.epoch) {
            continue;
        }
        seen = Some(want.epoch);
        match async { worker.roles()?.set_role(want).await }.await {
            Ok(now) if now == want => tracing::info!(planner = %holder, to = %now, "took the role the planner set"),
            Ok(now) => tracing::debug!(planner = %holder, want = %want, holds = %now, "a planned role already taken"),
            Err(e) => tracing::warn!(planner = %holder, want = %want, error = %e, "cannot take the planned role"),
        }
    }
}

/// What this worker writes to the fleet bucket each second.
#[derive(Clone)]
struct Node {
    id: NodeId,
    worker: Arc<dyn Worker>,
    endpoints: Endpoints,
    threads: usize,
    blocks: usize,
    links: Arc<LinkTable>,
}

impl Node {
    async fn record(self) -> NodeRecord {
        // A worker that cannot answer for its stats is reported idle and empty; its
        // record still says it is there.
        let s = self.worker.stats().await.unwrap_or_default();
        let info = self.worker.info();
        let now = s.assignment.unwrap_or(pdserve_types::Assignment::new(info.role, Default::default()));
        NodeRecord {
            node_id: self.id,
            name: info.name.clone(),
            model: info.model.clone(),
            role: now.role,
            epoch: now.epoch,
            protocol: pdserve_remote::PROTOCOL_VERSION,
            endpoints: self.endpoints,
            threads: self.threads,
            kv_cache: KvCache {
                block_size: 16,
                blocks_total: self.blocks,
                blocks_free: s.blocks.free,
                blocks_used: s.blocks.used,
                blocks_cached: s.blocks.cached,
                dtype: info.kv_dtype,
                bytes_per_token: info.kv_bytes_per_token,
            },
            load: Load {
                queued_prompt_tokens: s.queued_prompt_tokens,
                waiting: s.waiting,
                running: s.running,
                importing: s.importing,
            },
            links: self.links.snapshot(),
            memory_available: crate::memory_available().unwrap_or(0),
            updated_unix_ms: crate::now_unix_ms(),
        }
    }
}
