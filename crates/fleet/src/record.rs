//! What a node says about itself in the fleet bucket, refreshed every second.

use pdserve_types::{Epoch, KvDtype, Role};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

/// A node's name in the fleet, and its key in the bucket (`nodes.<id>`): 1 to 64
/// letters, digits, `-` or `_`, so it is a valid NATS key token everywhere.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeId(String);

impl NodeId {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// An id made from `text`: characters a key cannot hold become `-`.
    pub fn sanitized(text: &str) -> NodeId {
        let s: String =
            text.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '-' }).take(64).collect();
        NodeId(if s.is_empty() { "node".into() } else { s })
    }
}

impl FromStr for NodeId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
        match s.len() {
            1..=64 if s.chars().all(ok) => Ok(NodeId(s.to_string())),
            _ => Err(format!("node id `{s}` must be 1 to 64 letters, digits, `-` or `_`")),
        }
    }
}

impl TryFrom<String> for NodeId {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<NodeId> for String {
    fn from(id: NodeId) -> String {
        id.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A node's entry in the bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node_id: NodeId,
    /// The worker's name in logs and metrics (`pdserve worker --name`).
    #[serde(default)]
    pub name: String,
    /// The served model's name; frontends use only nodes serving theirs.
    pub model: String,
    pub role: Role,
    pub epoch: Epoch,
    /// The control protocol version the node speaks.
    pub protocol: u32,
    pub endpoints: Endpoints,
    pub threads: usize,
    pub kv_cache: KvCache,
    pub load: Load,
    /// What the node measured on its KV links to peers that decode (the link probe).
    #[serde(default)]
    pub links: Vec<LinkRecord>,
    /// Bytes of memory its host (or its cgroup, where that leaves less) has available
    /// besides what runs there now: what `pdserve split --nats` places layers by.
    /// 0: not known.
    #[serde(default)]
    pub memory_available: u64,
    /// Milliseconds since the Unix epoch when the node wrote this.
    pub updated_unix_ms: u64,
}

/// One link probe's result: a handoff's round trip and rate from the node that
/// writes it to the KV receiver of node `to`, over the transport a prefill sent
/// there would use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkRecord {
    pub to: NodeId,
    /// `tcp` (the only transport between hosts).
    pub transport: String,
    /// Payload rate of a large handoff, its round trip taken off (decimal GB/s).
    pub gb_per_s: f64,
    /// Smallest time of a one-frame handoff on the open link: open, send, acknowledged.
    pub latency_ms: f64,
    pub measured_unix_ms: u64,
}

/// Where to reach a node. KV bytes go to `kv` directly, never over NATS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoints {
    /// Control connection (`pdserve worker --listen`).
    pub control: SocketAddr,
    /// KV receiver over TCP.
    pub kv: SocketAddr,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCache {
    pub block_size: usize,
    pub blocks_total: usize,
    pub blocks_free: usize,
    pub blocks_used: usize,
    /// Free but holding a reusable prefix.
    pub blocks_cached: usize,
    /// How the cache stores K and V (what the node's exports put on the wire).
    #[serde(default)]
    pub dtype: KvDtype,
    /// Bytes of one token's K and V over all layers in that form (0: not known).
    #[serde(default)]
    pub bytes_per_token: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Load {
    /// Prompt tokens queued or being prefilled.
    pub queued_prompt_tokens: usize,
    pub waiting: usize,
    pub running: usize,
    /// Reservations waiting for (or receiving) a transfer.
    pub importing: usize,
}

impl Load {
    /// Requests the node holds in any state: what routers compare.
    pub fn requests(&self) -> usize {
        self.waiting + self.running + self.importing
    }
}

impl NodeRecord {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<NodeRecord, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
impl NodeRecord {
    /// A decode node's record, written at `updated_unix_ms`.
    pub(crate) fn sample(id: &str, updated_unix_ms: u64) -> NodeRecord {
        NodeRecord {
            node_id: id.parse().unwrap_or_else(|_| NodeId::sanitized(id)),
            name: "decode@127.0.0.1:7001".into(),
            model: "m".into(),
            role: Role::Decode,
            epoch: Epoch(2),
            protocol: 1,
            endpoints: Endpoints { control: ([127, 0, 0, 1], 7001).into(), kv: ([127, 0, 0, 1], 7101).into() },
            threads: 1,
            kv_cache: KvCache {
                block_size: 16,
                blocks_total: 8,
                blocks_free: 5,
                blocks_used: 3,
                blocks_cached: 1,
                ..KvCache::default()
            },
            load: Load { queued_prompt_tokens: 10, waiting: 1, running: 2, importing: 0 },
            links: vec![LinkRecord {
                to: "n2".parse().unwrap_or_else(|_| NodeId::sanitized("n2")),
                transport: "tcp".into(),
                gb_per_s: 1.5,
                latency_ms: 0.2,
                measured_unix_ms: 4,
            }],
            memory_available: 8_000_000_000,
            updated_unix_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_checked_and_sanitized() {
        assert!("gpu-3_a".parse::<NodeId>().is_ok());
        for bad in ["", "a.b", "a b", "nodes.>", &"x".repeat(65)] {
            assert!(bad.parse::<NodeId>().is_err(), "{bad}");
        }
        assert_eq!(NodeId::sanitized("decode@127.0.0.1:7002").as_str(), "decode-127-0-0-1-7002");
        assert_eq!(NodeId::sanitized("").as_str(), "node");
    }

    #[test]
    fn a_record_round_trips_and_a_bad_id_is_refused() {
        let rec = NodeRecord::sample("n1", 5);
        assert_eq!(NodeRecord::decode(&rec.encode()).unwrap(), rec);
        let bad = String::from_utf8(rec.encode()).unwrap().replace("\"n1\"", "\"n.1\"");
        assert!(NodeRecord::decode(bad.as_bytes()).is_err());
    }
}
