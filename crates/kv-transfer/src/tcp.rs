//! KV over TCP, for workers on different hosts: one connection per (sender,
//! receiver) pair, frames inline in length-prefixed records, handoffs interleaved.

use crate::link::{Link, Stream, IO_TIMEOUT};
use crate::receive;
use crate::slots::PortSlots;
use crate::{auth, ClusterKey, HandoffId, HandoffToken, Inboxes, KvSink, KvTransport, TransferError, TransportKind};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::BufReader;
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::task::{JoinHandle, JoinSet};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Read buffer per connection: many frames per system call.
const READ_BUFFER: usize = 256 << 10;

/// The sending side: one connection to a [`TcpReceiver`].
pub struct TcpTransport {
    link: Arc<Link>,
}

impl TcpTransport {
    /// Connects to the receiver at `addr` and proves `key` (blocking, a few seconds at
    /// most: a peer that accepts but never answers fails the connect).
    pub fn connect(addr: SocketAddr, key: &ClusterKey) -> Result<TcpTransport, TransferError> {
        let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        stream.set_read_timeout(Some(auth::exchange_timeout()))?;
        auth::answer(&mut stream, key)?;
        stream.set_read_timeout(None)?;
        Ok(TcpTransport { link: Link::start(TransportKind::Tcp, Stream::Tcp(stream), None)? })
    }

    #[cfg(test)]
    pub(crate) fn link(&self) -> &Link {
        &self.link
    }
}

impl KvTransport for TcpTransport {
    fn open(&self, id: HandoffId, token: HandoffToken) -> Result<Box<dyn KvSink>, TransferError> {
        self.link.open(id, token)
    }

    fn kind(&self) -> TransportKind {
        self.link.kind()
    }
}

/// The receiving side: accepts connections and delivers their frames into
/// `inboxes`. Dropping it closes the listener and every connection.
pub struct TcpReceiver {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl TcpReceiver {
    /// Listens on `addr` (port 0 picks a free one); must run inside a tokio runtime.
    pub async fn bind(addr: impl ToSocketAddrs, inboxes: Inboxes) -> io::Result<TcpReceiver> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(accept(listener, inboxes));
        Ok(TcpReceiver { addr, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept(listener: TcpListener, inboxes: Inboxes) {
    // Owned here, so aborting this task aborts every connection.
    let mut conns = JoinSet::new();
    let slots = PortSlots::new(crate::MAX_CONNECTIONS);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    // Over a budget: dropped at once (the peer sees the connection close).
                    let pending = match slots.knock(peer.ip()) {
                        Ok(p) => p,
                        Err(why) => {
                            if let Some(quiet) = slots.log_refusal() {
                                tracing::warn!(%peer, ?why, refused_since_last = quiet, "KV port: a connection refused");
                            }
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let inboxes = inboxes.clone();
                    conns.spawn(async move {
                        let (r, mut w) = stream.into_split();
                        let mut r = BufReader::with_capacity(READ_BUFFER, r);
                        if auth::challenge(&mut r, &mut w, inboxes.key()).await.is_err() {
                            return;
                        }
                        if let Ok(_slot) = pending.admit() {
                            let _ = receive::serve(&mut r, &mut w, &inboxes, None).await;
                        }
                    });
                }
                // Out of descriptors, most likely: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            },
            Some(_) = conns.join_next() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Frame, FrameError};

    fn frame(id: u64, index: u32) -> Frame {
        Frame { handoff: HandoffId(id), layer: 1, index, k: vec![index as u16; 3072], v: vec![7; 3072] }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrupt_frame_fails_its_handoff_and_the_connection_survives() {
        let inboxes = Inboxes::new(64);
        let rx = TcpReceiver::bind("127.0.0.1:0", inboxes.clone()).await.unwrap();
        let mut bad = inboxes.expect(HandoffId(1)).unwrap();
        let mut good = inboxes.expect(HandoffId(2)).unwrap();
        let (tb, tg) = (bad.token(), good.token());
        let addr = rx.local_addr();
        let sender = tokio::task::spawn_blocking(move || {
            let t = TcpTransport::connect(addr, &ClusterKey::insecure()).unwrap();
            let mut b = t.open(HandoffId(1), tb).unwrap();
            b.send(frame(1, 0)).unwrap();
            b.flush().unwrap();
            t.link().send_corrupted(&frame(1, 1), 40 + 2 * 3072).unwrap();
            let mut g = t.open(HandoffId(2), tg).unwrap();
            for i in 0..10 {
                g.send(frame(2, i)).unwrap();
            }
            (b.finish(), g.finish())
        });
        assert_eq!(bad.recv().await.unwrap(), Some(frame(1, 0)));
        assert!(matches!(bad.recv().await, Err(TransferError::Corrupt(FrameError::Checksum { .. }))));
        for i in 0..10 {
            assert_eq!(good.recv().await.unwrap(), Some(frame(2, i)));
        }
        assert_eq!(good.recv().await.unwrap(), None);
        let (b, g) = sender.await.unwrap();
        assert!(matches!(b, Err(TransferError::Rejected)), "{b:?}");
        g.unwrap();
    }
}
