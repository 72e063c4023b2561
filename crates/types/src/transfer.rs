//! Where a handoff's frames go, and the names of the ways they can get there: the
//! vocabulary the control protocol speaks. The transports behind them are the
//! `kv-transfer` crate's.

use serde::{Deserialize, Serialize};
use std::any::Any;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

/// How KV moves between workers. One label per kind, used by the CLI, the router,
/// the control protocol and the metrics alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// Frames handed over inside one process; no copy.
    Inproc,
    /// Length-prefixed, checksummed frames over a TCP connection.
    Tcp,
    /// Frames packed into a shared-memory segment (same host).
    Shm,
}

impl TransportKind {
    pub const ALL: [TransportKind; 3] = [TransportKind::Inproc, TransportKind::Tcp, TransportKind::Shm];

    pub fn label(self) -> &'static str {
        match self {
            TransportKind::Inproc => "inproc",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

impl FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TransportKind::ALL.into_iter().find(|k| k.label() == s).ok_or_else(|| {
            let known: Vec<&str> = TransportKind::ALL.iter().map(|k| k.label()).collect();
            format!("unknown KV transport `{s}` (expected one of {})", known.join(", "))
        })
    }
}

/// A receiver another process can reach.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvAddr {
    Tcp(SocketAddr),
    /// The Unix socket of a shared-memory receiver (same host only).
    Shm(PathBuf),
}

impl KvAddr {
    pub fn kind(&self) -> TransportKind {
        match self {
            KvAddr::Tcp(_) => TransportKind::Tcp,
            KvAddr::Shm(_) => TransportKind::Shm,
        }
    }

    /// This address as a peer that reached the receiver's host at `host` sees it: a
    /// TCP receiver's port on that host (it may listen on every interface), anything
    /// else as it is.
    pub fn seen_at(&self, host: IpAddr) -> KvAddr {
        match self {
            KvAddr::Tcp(a) => KvAddr::Tcp(SocketAddr::new(host, a.port())),
            KvAddr::Shm(p) => KvAddr::Shm(p.clone()),
        }
    }
}

/// Where a decode worker receives KV: its inboxes in this process, or a receiver
/// address.
#[derive(Clone)]
pub enum KvTarget {
    InProc(InProcTarget),
    Remote(KvAddr),
}

/// A decode worker's receiver in this process. Opaque here: only the transfer crate
/// that made it knows what it holds, and opens it again.
#[derive(Clone)]
pub struct InProcTarget(pub Arc<dyn Any + Send + Sync>);

impl KvTarget {
    pub fn kind(&self) -> TransportKind {
        match self {
            KvTarget::InProc(_) => TransportKind::Inproc,
            KvTarget::Remote(a) => a.kind(),
        }
    }
}

impl fmt::Debug for KvTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvTarget::InProc(_) => f.write_str("InProc"),
            KvTarget::Remote(a) => a.fmt(f),
        }
    }
}

/// The secret a receiver issues with each handoff it expects; only a sink that
/// presents it may deliver that handoff's frames. 128 random bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HandoffToken(pub [u8; 16]);

impl HandoffToken {
    pub fn random() -> HandoffToken {
        let mut t = [0u8; 16];
        // The OS generator does not fail on supported platforms; were it to, a token
        // derived from the clock and address space is still unpredictable enough for
        // the one handoff it guards, and never all zeros.
        if getrandom::fill(&mut t).is_err() {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos());
            let here = &t as *const _ as usize as u128;
            t = (nanos ^ here.rotate_left(64) ^ 0x9e37_79b9_7f4a_7c15).to_le_bytes();
        }
        HandoffToken(t)
    }
}

/// A later stage of a decode group that takes its own layers of a handoff straight
/// from the sender: the layers (`first..=last`, the model's numbering), where it
/// receives, and the token it issued for the handoff. Frames of other layers go to
/// the group's head.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageReceiver {
    pub first: u32,
    pub last: u32,
    pub to: KvAddr,
    pub token: HandoffToken,
}

impl StageReceiver {
    pub fn holds(&self, layer: u32) -> bool {
        (self.first..=self.last).contains(&layer)
    }
}

impl fmt::Debug for HandoffToken {
    // Secrets stay out of logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HandoffToken(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_round_trip() {
        for k in TransportKind::ALL {
            assert_eq!(k.label().parse::<TransportKind>(), Ok(k));
            assert_eq!(serde_json::to_string(&k).ok().as_deref(), Some(format!("\"{}\"", k.label()).as_str()));
        }
        assert!("udp".parse::<TransportKind>().is_err());
    }

    #[test]
    fn tokens_differ() {
        assert_ne!(HandoffToken::random(), HandoffToken::random());
    }
}
