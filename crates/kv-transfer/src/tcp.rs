//! KV over TCP, for workers on different hosts: one connection per (sender,
//! receiver) pair, frames inline in length-prefixed records, handoffs interleaved.
//! After the handshake every record in either direction carries a MAC under the
//! session's keys (unless the key is the insecure one): a relay that passed the
//! handshake through can read the records, but not alter, inject, drop or replay
//! one without the connection closing.

use crate::link::{Link, Stream, IO_TIMEOUT};
use crate::receive;
use crate::slots::{LogEvery, PortSlots};
use crate::transport::{wrong_kind, Binding, ListenAt, Transport};
use crate::{
    auth, handshake, ClusterKey, HandoffId, HandoffToken, Inboxes, KvAddr, KvReceiver, KvSink, KvTransport, Share,
    TransferError, TransportKind,
};
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
        stream.set_read_timeout(Some(handshake::exchange_timeout()))?;
        let session = handshake::answer(&mut stream, key)?;
        stream.set_read_timeout(None)?;
        Ok(TcpTransport { link: Link::start(TransportKind::Tcp, Stream::Tcp(stream), None, session)? })
    }

    #[cfg(test)]
    pub(crate) fn link(&self) -> &Link {
        &self.link
    }
}

impl KvTransport for TcpTransport {
    fn open(&self, id: HandoffId, token: HandoffToken) -> Result<Box<dyn KvSink>, TransferError> {
        self.link.open(id, token, Share::Main)
    }

    fn open_part(&self, id: HandoffId, token: HandoffToken) -> Result<Box<dyn KvSink>, TransferError> {
        self.link.open(id, token, Share::Part)
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

impl KvReceiver for TcpReceiver {
    fn addr(&self) -> KvAddr {
        KvAddr::Tcp(self.addr)
    }
}

/// TCP in the list of transports.
pub(crate) struct Tcp;

impl Transport for Tcp {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn bind<'a>(&'a self, at: &'a ListenAt, inboxes: Inboxes) -> Binding<'a> {
        Box::pin(async move { Ok(Box::new(TcpReceiver::bind(at.net, inboxes).await?) as Box<dyn KvReceiver>) })
    }

    fn connect(&self, addr: &KvAddr, key: &ClusterKey) -> Result<Arc<dyn KvTransport>, TransferError> {
        match addr {
            KvAddr::Tcp(a) => Ok(Arc::new(TcpTransport::connect(*a, key)?)),
            other => Err(wrong_kind(self.kind(), other)),
        }
    }

    fn modelled(&self, _: &str) -> KvAddr {
        KvAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 0)))
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
    let forged = Arc::new(LogEvery::new());
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
                    let (inboxes, forged) = (inboxes.clone(), forged.clone());
                    conns.spawn(async move {
                        let (r, mut w) = stream.into_split();
                        let mut r = BufReader::with_capacity(READ_BUFFER, r);
                        let Ok(session) = handshake::challenge(&mut r, &mut w, inboxes.key()).await else { return };
                        let Ok(_slot) = pending.admit() else { return };
                        if let Err(e) = receive::serve(&mut r, &mut w, &inboxes, None, session).await {
                            if let Some(quiet) = auth::is_forged(&e).then(|| forged.due()).flatten() {
                                tracing::warn!(%peer, error = %e, forged_since_last = quiet, "KV port: a connection closed on a record that failed its MAC");
                            }
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
        Frame {
            handoff: HandoffId(id),
            layer: 1,
            index,
            dtype: pdserve_types::KvDtype::F16,
            k: vec![index as u16; 3072],
            v: vec![7; 3072],
        }
    }

    /// With the insecure key (no MACs) and with a real one (every record sealed).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrupt_frame_fails_its_handoff_and_the_connection_survives() {
        for key in [ClusterKey::insecure(), ClusterKey::random()] {
            let inboxes = Inboxes::guarded(64, key.clone(), crate::frame::MAX_FRAME_BYTES);
            let rx = TcpReceiver::bind("127.0.0.1:0", inboxes.clone()).await.unwrap();
            let mut bad = inboxes.expect(HandoffId(1)).unwrap();
            let mut good = inboxes.expect(HandoffId(2)).unwrap();
            let (tb, tg) = (bad.token(), good.token());
            let addr = rx.local_addr();
            let sender = tokio::task::spawn_blocking(move || {
                let t = TcpTransport::connect(addr, &key).unwrap();
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

    /// A receiver on loopback whose inboxes let in only peers proving its key.
    async fn guarded_receiver() -> (ClusterKey, Inboxes, TcpReceiver) {
        let key = ClusterKey::random();
        let inboxes = Inboxes::guarded(64, key.clone(), crate::frame::MAX_FRAME_BYTES);
        let rx = TcpReceiver::bind("127.0.0.1:0", inboxes.clone()).await.unwrap();
        (key, inboxes, rx)
    }

    /// A relay between a sender and the receiver at `to`, as an attacker on the path
    /// would run it: passes the handshake (KNOCK, PROOF) through untouched, then hands
    /// each record the sender sends to `meddle` and forwards what it returns. Answers
    /// pass untouched. Each record is whole: `len u32 | tag u8 | handoff u64 | rest`.
    fn relay(to: SocketAddr, mut meddle: impl FnMut(Vec<u8>) -> Vec<u8> + Send + 'static) -> SocketAddr {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut from, _) = listener.accept().unwrap();
            let mut up = TcpStream::connect(to).unwrap();
            let (mut answers, mut back) = (up.try_clone().unwrap(), from.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = io::copy(&mut answers, &mut back);
                let _ = back.shutdown(std::net::Shutdown::Both);
            });
            for seen in 1.. {
                let mut len = [0u8; 4];
                if from.read_exact(&mut len).is_err() {
                    break;
                }
                let mut rec = len.to_vec();
                rec.resize(4 + u32::from_le_bytes(len) as usize, 0);
                if from.read_exact(&mut rec[4..]).is_err() {
                    break;
                }
                let out = if seen <= 2 { rec } else { meddle(rec) };
                if up.write_all(&out).is_err() {
                    break;
                }
            }
            let _ = up.shutdown(std::net::Shutdown::Both);
        });
        addr
    }

    /// Sends frames 0..4 of handoff 1 through `via` and finishes.
    fn send_through(via: SocketAddr, key: ClusterKey, token: HandoffToken) -> Result<(), TransferError> {
        let t = TcpTransport::connect(via, &key)?;
        let mut s = t.open(HandoffId(1), token)?;
        let sent = (0..4).try_for_each(|i| s.send(frame(1, i)));
        sent.and(s.finish())
    }

    /// A relay that read the handoff's token off the wire (`OPEN`) slips in a frame of
    /// its own, checksummed and framed as a sender without a session would: the
    /// receiver closes the connection and the inbox gets nothing but the failure.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_past_the_handshake_cannot_inject_a_kv_record() {
        let (key, inboxes, rx) = guarded_receiver().await;
        let mut inbox = inboxes.expect(HandoffId(1)).unwrap();
        let token = inbox.token();
        let via = relay(rx.local_addr(), |mut rec| {
            if rec[4] == crate::records::to_receiver::OPEN {
                let mut poison = frame(1, 0);
                poison.k.fill(0xbad);
                let mut bytes = Vec::new();
                poison.encode_into(&mut bytes).unwrap();
                crate::records::put(&mut rec, crate::records::to_receiver::FRAME, HandoffId(1), &bytes);
            }
            rec
        });
        let sender = tokio::task::spawn_blocking(move || send_through(via, key, token));
        let got = inbox.recv().await;
        assert!(matches!(got, Err(TransferError::Disconnected(_))), "the inbox got {got:?}");
        let sent = sender.await.unwrap();
        assert!(sent.is_err(), "the transfer succeeded through a forging relay");
    }

    /// A relay that rewrites the first frame's K (and fixes its checksum, which
    /// guards against faults, not against an attacker) fails the transfer: no frame
    /// of it reaches the inbox.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_past_the_handshake_cannot_alter_a_kv_record() {
        let (key, inboxes, rx) = guarded_receiver().await;
        let mut inbox = inboxes.expect(HandoffId(1)).unwrap();
        let token = inbox.token();
        let mut altered = false;
        let via = relay(rx.local_addr(), move |mut rec| {
            if rec[4] == crate::records::to_receiver::FRAME && !altered {
                altered = true;
                let at = crate::records::PREFIX_BYTES;
                let n = crate::frame::encoded_len_at(&rec[at..]).unwrap();
                let mut f = crate::frame::decode(&rec[at..at + n]).unwrap();
                f.k[0] ^= 1;
                f.encode_to_slice(&mut rec[at..at + n]).unwrap();
            }
            rec
        });
        let sender = tokio::task::spawn_blocking(move || send_through(via, key, token));
        let got = inbox.recv().await;
        assert!(matches!(got, Err(TransferError::Disconnected(_))), "the inbox got {got:?}");
        assert!(sender.await.unwrap().is_err(), "the transfer succeeded through a tampering relay");
    }

    /// Frames of layer `layer`, blocks 0..4, of handoff 1 (as a prefill group's
    /// stage holding that layer sends them).
    fn layer(layer: u32) -> Vec<Frame> {
        (0..4).map(|i| Frame { layer, ..frame(1, i) }).collect()
    }

    fn send(sink: &mut Box<dyn KvSink>, frames: Vec<Frame>) {
        frames.into_iter().for_each(|f| sink.send(f).unwrap());
    }

    /// Drains `inbox` to its end: the frames, by layer, and how it ended. An inbox
    /// that does not end within seconds fails the test (it would wait for a part).
    async fn drain(inbox: &mut crate::Inbox) -> (Vec<u32>, Result<(), TransferError>) {
        let mut layers = Vec::new();
        let ended = loop {
            let next = tokio::time::timeout(std::time::Duration::from_secs(10), inbox.recv()).await;
            match next.expect("the inbox did not end") {
                Ok(Some(f)) => layers.push(f.layer),
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        (layers, ended)
    }

    /// A part of a handoff, sent from its own connection (another process's link),
    /// delivers into the same inbox as the main sink; the handoff ends with the main
    /// sink, after the part. Parts may open before or after the main sink.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parts_on_other_links_deliver_into_the_handoff_the_main_sink_ends() {
        let (key, inboxes, rx) = guarded_receiver().await;
        let mut inbox = inboxes.expect(HandoffId(1)).unwrap();
        let (token, at) = (inbox.token(), rx.local_addr());
        let sender = tokio::task::spawn_blocking(move || {
            let [head, stage, other] = [(); 3].map(|()| TcpTransport::connect(at, &key).unwrap());
            let mut early = stage.open_part(HandoffId(1), token)?;
            let mut main = head.open(HandoffId(1), token)?;
            send(&mut main, layer(0));
            send(&mut early, layer(1));
            let mut late = other.open_part(HandoffId(1), token)?;
            send(&mut late, layer(2));
            early.finish()?;
            late.finish()?;
            main.finish()
        });
        let (layers, ended) = drain(&mut inbox).await;
        sender.await.unwrap().unwrap();
        ended.unwrap();
        let mut by_layer = layers.clone();
        by_layer.sort_unstable();
        assert_eq!(by_layer, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], "every part's frames, once: {layers:?}");
    }

    /// The handoff fails where a part does: one given up, or one not ended when the
    /// main sink ends. A part that comes after the main sink ended delivers nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_part_given_up_or_unfinished_fails_the_handoff_and_none_joins_after_it() {
        let (key, inboxes, rx) = guarded_receiver().await;
        let at = rx.local_addr();
        for given_up in [true, false] {
            let mut inbox = inboxes.expect(HandoffId(1)).unwrap();
            let (token, key) = (inbox.token(), key.clone());
            // The receiver knows of a part once it read its `OPEN`: the main sink
            // starts after the part's frames arrived.
            let (arrived, wait) = std::sync::mpsc::channel();
            let sender = tokio::task::spawn_blocking(move || {
                let (head, stage) = (TcpTransport::connect(at, &key)?, TcpTransport::connect(at, &key)?);
                let mut part = stage.open_part(HandoffId(1), token)?;
                send(&mut part, layer(1));
                part.flush()?;
                wait.recv().unwrap();
                let mut main = head.open(HandoffId(1), token)?;
                send(&mut main, layer(0));
                if given_up {
                    // Whether the receiver reads the abort before or after the main
                    // sink's end, the handoff fails.
                    part.abort();
                    return Ok((main.finish(), None));
                }
                let ended = main.finish();
                Ok::<_, TransferError>((ended, Some(part)))
            });
            for _ in 0..4 {
                assert_eq!(inbox.recv().await.unwrap().map(|f| f.layer), Some(1));
            }
            arrived.send(()).unwrap();
            let (layers, ended) = drain(&mut inbox).await;
            let (main, part) = sender.await.unwrap().unwrap();
            assert!(main.is_err(), "the main sink ended well beside a part that did not ({given_up})");
            assert!(ended.is_err(), "the inbox ended well beside a part that did not: {layers:?}");
            if let Some(part) = part {
                assert!(part.finish().is_err(), "a part ended well after its handoff failed");
            }
            drop(inbox);
            inboxes.forget(HandoffId(1));
        }
        let mut inbox = inboxes.expect(HandoffId(1)).unwrap();
        let token = inbox.token();
        let late = tokio::task::spawn_blocking(move || {
            let (head, stage) = (TcpTransport::connect(at, &key)?, TcpTransport::connect(at, &key)?);
            let mut main = head.open(HandoffId(1), token)?;
            send(&mut main, layer(0));
            main.finish()?;
            let mut part = stage.open_part(HandoffId(1), token)?;
            // The receiver's refusal may come back before the last frame is sent.
            let sent = layer(1).into_iter().try_for_each(|f| part.send(f));
            Ok::<_, TransferError>(sent.and_then(|()| part.finish()))
        });
        let (layers, ended) = drain(&mut inbox).await;
        assert!(late.await.unwrap().unwrap().is_err(), "a part joined a handoff that had ended");
        ended.unwrap();
        assert_eq!(layers, [0; 4], "a late part's frames reached the inbox");
    }

    /// Parts that ended well do not end the handoff: a main sink given up after them
    /// fails it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_main_sink_given_up_after_its_parts_ended_fails_the_handoff() {
        let (key, inboxes, rx) = guarded_receiver().await;
        let mut inbox = inboxes.expect(HandoffId(1)).unwrap();
        let (token, at) = (inbox.token(), rx.local_addr());
        let sender = tokio::task::spawn_blocking(move || {
            let [head, stage] = [(); 2].map(|()| TcpTransport::connect(at, &key).unwrap());
            let mut main = head.open(HandoffId(1), token)?;
            let mut part = stage.open_part(HandoffId(1), token)?;
            send(&mut part, layer(1));
            part.finish()?;
            send(&mut main, layer(0));
            main.flush()?;
            main.abort();
            Ok::<_, TransferError>(())
        });
        let (layers, ended) = drain(&mut inbox).await;
        sender.await.unwrap().unwrap();
        assert!(ended.is_err(), "the handoff ended well without its main sink: {layers:?}");
    }
}
