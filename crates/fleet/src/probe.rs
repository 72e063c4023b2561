//! The link probe: a fleet worker times its KV link to every peer that decodes, once
//! when either of them joins, and publishes what it measured in its own record.
//!
//! Each measurement is real handoffs over the link a prefill would use (TCP, with
//! its framing, checksums and acknowledgement) into an inbox the peer opens for the
//! probe and empties without touching its KV blocks: one large handoff for the
//! rate, then a few one-frame handoffs on the now-open link for the round trip.
//! Probes run one at a time so they do not share the wire with each other.

use crate::{Change, LinkRecord, NatsConfig, NodeId, NodeRecord};
use futures_util::future::BoxFuture;
use pdserve_kv_transfer::{ClusterKey, HandoffToken, KvAddr, Throughput};
use pdserve_protocol::{Capabilities, ServeError};
use pdserve_remote::RemoteWorker;
use pdserve_types::{RequestId, Role};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

type ProbeError = Box<dyn std::error::Error + Send + Sync>;

/// Times one handoff of `bytes` to the probe inbox a peer opened at `to` under
/// `token`, over the link a prefill sent there would use (the local worker's).
pub type SendProbe = Arc<
    dyn Fn(KvAddr, RequestId, HandoffToken, usize) -> BoxFuture<'static, Result<Throughput, ServeError>> + Send + Sync,
>;

/// Payload of the rate probe: 8 MB, over a second on a 100 Mb/s link, some
/// milliseconds on loopback.
const RATE_BYTES: usize = 8 << 20;
/// One-frame handoffs timed for the round trip; the smallest counts.
const ROUND_TRIPS: usize = 3;
/// A probe that has not finished by then (a peer gone mid-probe) is given up.
const PROBE_LIMIT: Duration = Duration::from_secs(30);
/// Rates below these are reported as far below the transport's class: half of
/// 1 Gb/s Ethernet between hosts, and a tenth of what the TCP transport moves over
/// loopback on a small machine (about 3 GB/s, docs/benchmarks.md) on one host.
const SLOW_BETWEEN_HOSTS_GBPS: f64 = 0.0625;
const SLOW_SAME_HOST_GBPS: f64 = 0.3;

/// The links this node measured, by peer; its fleet record carries them.
#[derive(Default)]
pub struct LinkTable(Mutex<BTreeMap<NodeId, LinkRecord>>);

impl LinkTable {
    pub fn snapshot(&self) -> Vec<LinkRecord> {
        self.lock().values().cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeId, LinkRecord>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Who probes, and from where.
pub struct Prober {
    pub me: NodeId,
    /// This node's KV address as peers see it: a peer at the same IP is on this host.
    pub my_kv: SocketAddr,
    pub send: SendProbe,
    pub key: ClusterKey,
    pub table: Arc<LinkTable>,
}

impl Prober {
    /// Follows the fleet at `cfg` and probes each peer that decodes (or may: mixed)
    /// when it appears or moves; a peer that leaves takes its link off the table.
    pub async fn run(self, cfg: NatsConfig) {
        let me = Arc::new(self);
        let mut changes = crate::follow(cfg);
        let one_at_a_time = Arc::new(tokio::sync::Semaphore::new(1));
        let mut probing: HashMap<NodeId, (SocketAddr, tokio::task::JoinHandle<()>)> = HashMap::new();
        while let Some(change) = changes.recv().await {
            match change {
                Change::Up(peer) if me.wants(&peer) => {
                    if probing.get(&peer.node_id).is_some_and(|(kv, _)| *kv == peer.endpoints.kv) {
                        continue;
                    }
                    let (me2, gate, id, kv) =
                        (me.clone(), one_at_a_time.clone(), peer.node_id.clone(), peer.endpoints.kv);
                    let task = tokio::spawn(async move {
                        let _turn = gate.acquire_owned().await;
                        me2.probe_and_record(&peer).await;
                    });
                    if let Some((_, old)) = probing.insert(id, (kv, task)) {
                        old.abort();
                    }
                }
                Change::Up(_) => {}
                Change::Down(id) => {
                    if let Some((_, task)) = probing.remove(&id) {
                        task.abort();
                    }
                    me.table.lock().remove(&id);
                }
            }
        }
    }

    /// A peer this node would send KV to: another node of the same protocol whose
    /// role decodes.
    fn wants(&self, peer: &NodeRecord) -> bool {
        peer.node_id != self.me
            && peer.protocol == pdserve_remote::PROTOCOL_VERSION
            && matches!(peer.role, Role::Decode | Role::Mixed)
    }

    async fn probe_and_record(&self, peer: &NodeRecord) {
        let measured = tokio::time::timeout(PROBE_LIMIT, self.probe(peer)).await;
        let link = match measured {
            Ok(Ok(link)) => link,
            Ok(Err(e)) => return tracing::warn!(peer = %peer.node_id, error = %e, "link probe failed"),
            Err(_) => return tracing::warn!(peer = %peer.node_id, "link probe did not finish in 30 s"),
        };
        let same_host = peer.endpoints.kv.ip() == self.my_kv.ip();
        let floor = if same_host { SLOW_SAME_HOST_GBPS } else { SLOW_BETWEEN_HOSTS_GBPS };
        if link.gb_per_s < floor {
            tracing::warn!(
                peer = %peer.node_id,
                gb_per_s = link.gb_per_s,
                expected_at_least = floor,
                same_host,
                "the KV link to this peer is far below its transport's class; handoffs there will be slow"
            );
        } else {
            tracing::info!(peer = %peer.node_id, gb_per_s = link.gb_per_s, latency_ms = link.latency_ms, "link probed");
        }
        self.table.lock().insert(peer.node_id.clone(), link);
    }

    async fn probe(&self, peer: &NodeRecord) -> Result<LinkRecord, ProbeError> {
        let remote = RemoteWorker::connect(peer.endpoints.control, &self.key).await?;
        let to = KvAddr::Tcp(peer.endpoints.kv);
        // The rate first: it also opens the link, so the round trips after it time
        // no connection set-up (a prefill finds the link open too).
        let rate = self.handoff(&remote, &to, RATE_BYTES).await?;
        let mut round_trip = Duration::MAX;
        for _ in 0..ROUND_TRIPS {
            round_trip = round_trip.min(self.handoff(&remote, &to, 1).await?.elapsed);
        }
        let wire = rate.elapsed.saturating_sub(round_trip).max(Duration::from_micros(1));
        Ok(LinkRecord {
            to: peer.node_id.clone(),
            transport: "tcp".into(),
            gb_per_s: Throughput { bytes: rate.bytes, elapsed: wire }.gb_per_s(),
            latency_ms: round_trip.as_secs_f64() * 1e3,
            measured_unix_ms: crate::now_unix_ms(),
        })
    }

    /// One timed handoff of `bytes` into a probe inbox `peer` opens for it.
    async fn handoff(&self, peer: &RemoteWorker, to: &KvAddr, bytes: usize) -> Result<Throughput, ProbeError> {
        let id = fresh_id();
        let token = peer.probes()?.probe_inbox(id).await?;
        Ok((self.send)(to.clone(), id, token, bytes).await?)
    }
}

/// A random handoff id, apart from any request's.
fn fresh_id() -> RequestId {
    let t = HandoffToken::random().0;
    RequestId(u64::from_le_bytes([t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]]))
}
