//! Stage groups over the fleet. A later stage of a group (`pdserve worker --group G
//! --layers A..B --nats URL`) keeps a [`StageRecord`] under `stages.<group>.<node>` in
//! the fleet's bucket, refreshed and expired as node records are; the group's head
//! reads them to find its stages instead of being given their addresses. Frontends,
//! planners and `pdserve fleet` follow `nodes.` keys only: a later stage is no worker
//! to them, its head is.

use crate::bus::{Bus, NatsConfig, REFRESH};
use crate::record::NodeId;
use crate::register::{keep, Registration};
use crate::seal;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

const PREFIX: &str = "stages.";

/// What a later stage says of itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRecord {
    pub group: String,
    /// The model's name: a head takes only stages of its own.
    pub model: String,
    /// Its layers, both included.
    pub first: usize,
    pub last: usize,
    /// Where the head calls it (its stage data plane).
    pub addr: SocketAddr,
}

/// A group's name as it appears in keys: the characters a key token holds.
fn token(group: &str) -> String {
    NodeId::sanitized(group).to_string()
}

/// Announces the stage `rec` as node `id` until the registration is dropped or
/// deregistered; NATS may come later or go away.
pub fn announce_stage(cfg: NatsConfig, id: NodeId, rec: StageRecord) -> Registration {
    let key = format!("{PREFIX}{}.{id}", token(&rec.group));
    let body = serde_json::to_vec(&rec).unwrap_or_default();
    keep(cfg, id, key, seal::STAGE, move || std::future::ready(body.clone()))
}

/// The addresses of group `group`'s later stages of `model`, as the bucket says
/// every [`REFRESH`]: a list the head reads whenever it dials (empty until NATS
/// answers). Follows the bucket until the runtime stops.
pub fn find_stages(cfg: NatsConfig, group: &str, model: &str) -> Arc<Mutex<Vec<SocketAddr>>> {
    let found = Arc::new(Mutex::new(Vec::new()));
    let (out, group, model) = (found.clone(), group.to_string(), model.to_string());
    tokio::spawn(async move {
        let bus = Bus::connect_patiently(&cfg).await;
        tracing::info!(group, url = %cfg.url, "finding the group's stages in the fleet");
        let prefix = format!("{PREFIX}{}.", token(&group));
        loop {
            match bus.values(&prefix, seal::STAGE).await {
                Ok(recs) => {
                    let addrs = stages_of(recs, &group, &model);
                    *out.lock().unwrap_or_else(PoisonError::into_inner) = addrs;
                }
                Err(e) => tracing::warn!(error = %e, "cannot read the group's stages"),
            }
            tokio::time::sleep(REFRESH).await;
        }
    });
    found
}

/// The addresses of the records of `group` and `model`, in layer order.
fn stages_of(mut recs: Vec<StageRecord>, group: &str, model: &str) -> Vec<SocketAddr> {
    recs.retain(|r| r.group == group && r.model == model);
    recs.sort_by_key(|r| r.first);
    recs.into_iter().map(|r| r.addr).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(group: &str, model: &str, first: usize, port: u16) -> StageRecord {
        StageRecord {
            group: group.into(),
            model: model.into(),
            first,
            last: first + 4,
            addr: ([10, 0, 0, 1], port).into(),
        }
    }

    #[test]
    fn a_head_takes_its_groups_stages_of_its_model_in_layer_order() {
        let recs = vec![rec("g", "m", 20, 3), rec("g", "m", 10, 2), rec("h", "m", 5, 9), rec("g", "other", 5, 8)];
        let ports: Vec<u16> = stages_of(recs, "g", "m").iter().map(SocketAddr::port).collect();
        assert_eq!(ports, [2, 3]);
        assert_eq!(token("my group.1"), "my-group-1");
    }
}
