//! The transports that leave the process, as one list ([`crate::REMOTE`]): each says
//! how it binds a receiver, how it connects to one, and what address a simulated
//! worker announces for it. Everything else (a worker's receivers, the handshake,
//! the links, the twin, the CLI) goes through this list, so a new transport is its
//! module, its kind and address (`target.rs`), and one line in the list.

use crate::{ClusterKey, Inboxes, KvAddr, KvTransport, TransferError, TransportKind};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

/// Where a process lets its receivers listen; each transport takes what it needs.
#[derive(Debug, Clone)]
pub struct ListenAt {
    /// The address network receivers bind (port 0: any free port).
    pub net: SocketAddr,
    /// The socket a same-host receiver announces itself on.
    pub socket: PathBuf,
}

/// A listening receiver of one transport that other processes send KV to; dropping
/// it stops it.
pub trait KvReceiver: Send + Sync {
    /// Where senders reach it.
    fn addr(&self) -> KvAddr;
}

/// A receiver's binding in progress.
pub type Binding<'a> = Pin<Box<dyn Future<Output = io::Result<Box<dyn KvReceiver>>> + Send + 'a>>;

/// One transport between processes.
pub trait Transport: Sync {
    fn kind(&self) -> TransportKind;

    /// Starts a receiver at `at` that delivers into `inboxes` (inside a tokio runtime).
    fn bind<'a>(&'a self, at: &'a ListenAt, inboxes: Inboxes) -> Binding<'a>;

    /// Connects to the receiver at `addr`, an address of this transport's kind
    /// (blocking: call it off the async workers).
    fn connect(&self, addr: &KvAddr, key: &ClusterKey) -> Result<Arc<dyn KvTransport>, TransferError>;

    /// The address a simulated worker named `name` announces: never connected to.
    fn modelled(&self, name: &str) -> KvAddr;
}

/// The transport of `kind`, if one leaves the process (in-process has none).
pub fn remote(kind: TransportKind) -> Option<&'static dyn Transport> {
    crate::REMOTE.iter().copied().find(|t| t.kind() == kind)
}

/// Binds a receiver of `kind` at `at`; in-process needs none.
pub async fn bind(kind: TransportKind, at: &ListenAt, inboxes: Inboxes) -> io::Result<Option<Box<dyn KvReceiver>>> {
    match remote(kind) {
        Some(t) => t.bind(at, inboxes).await.map(Some),
        None => Ok(None),
    }
}

/// The error of a transport handed an address of another kind.
pub(crate) fn wrong_kind(want: TransportKind, addr: &KvAddr) -> TransferError {
    TransferError::Disconnected(format!("{addr:?} is not a {want} address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_but_in_process_has_one_transport_that_answers_to_it() {
        for kind in TransportKind::ALL {
            let found = crate::REMOTE.iter().filter(|t| t.kind() == kind).count();
            assert_eq!(found, usize::from(kind != TransportKind::Inproc), "{kind}");
        }
    }

    #[test]
    fn a_modelled_address_is_of_its_transport_kind() {
        for t in crate::REMOTE {
            assert_eq!(t.modelled("w0").kind(), t.kind());
        }
    }

    #[test]
    fn a_transport_refuses_an_address_of_another_kind() {
        let key = ClusterKey::default();
        for t in crate::REMOTE {
            let other = crate::REMOTE.iter().find(|o| o.kind() != t.kind()).unwrap().modelled("w0");
            assert!(t.connect(&other, &key).is_err(), "{} took {other:?}", t.kind());
        }
    }
}
