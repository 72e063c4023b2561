//! The data plane of a pipeline stage group: a head's calls to a later stage, each one
//! record answered by one record, on a TCP connection that opens with the KV ports'
//! mutual challenge (under labels of its own, so a KV proof is worthless here) and then
//! carries a MAC on every record in both directions. What the bodies mean (a step's
//! shape and residual stream, the stage's output) is the caller's.
//!
//! A stage serves one head at a time; a newer authenticated connection takes over from
//! an older one (a restarted head, whose old connection may linger), and the older one
//! is closed before its next call.

use crate::auth::{Session, SessionMac, MAC_BYTES};
use crate::handshake::{self, Labels};
use crate::records::{self, Record};
use crate::{ClusterKey, HandoffId, TransferError};
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Head → stage: a call.
const CALL: u8 = 40;
/// Stage → head: the call's answer.
const REPLY: u8 = 41;
/// Stage → head: the call was refused (the body says why, in UTF-8).
const REFUSED: u8 = 42;

const LABELS: Labels = Labels { connecting: b"pdserve-stage-head", accepting: b"pdserve-stage" };
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a peer's kernel may leave us unanswered (sent data unacknowledged, or an
/// idle connection's probes) before the connection counts as lost.
pub const LIVENESS: Duration = Duration::from_secs(5);
/// The largest call or reply: a frame's record (64 MiB), which `read_sync` caps any
/// limit at; a length past it closes the connection before anything is allocated.
const LIMIT: usize = records::record_limit(crate::frame::MAX_FRAME_BYTES);

/// One end's framing: records out with room for their MAC, records in checked.
struct Ends {
    stream: TcpStream,
    session: Session,
    out: Vec<u8>,
    body: Vec<u8>,
}

impl Ends {
    fn send(&mut self, tag: u8, body: &[u8]) -> io::Result<()> {
        self.record(tag, body);
        self.stream.write_all(&self.out)
    }

    /// Puts the record of `body`, sealed, into `self.out`.
    fn record(&mut self, tag: u8, body: &[u8]) {
        self.out.clear();
        let room = if self.session.is_some() { MAC_BYTES } else { 0 };
        records::put_with_room(&mut self.out, tag, HandoffId(0), body, room);
        if let Some((send, _)) = self.session.as_mut() {
            records::seal(&mut self.out, send);
        }
    }

    fn receive(&mut self) -> io::Result<Option<Record>> {
        let mac: Option<&mut SessionMac> = self.session.as_mut().map(|(_, recv)| recv);
        records::read_sync(&mut self.stream, &mut self.body, LIMIT, mac)
    }
}

/// A head's connection to a later stage.
pub struct StageConn {
    ends: Ends,
    addr: SocketAddr,
    /// Writes the calls sent without waiting ([`StageConn::send`]), so the head never
    /// blocks on a stage that has stopped reading while it writes answers nobody reads
    /// yet; started at the first such call.
    writer: Option<Writer>,
    /// Calls sent and not yet answered.
    in_flight: usize,
}

/// What a connection holds unread.
enum Peeked {
    Nothing,
    Data,
    Closed,
}

/// A thread writing a connection's records in order, until its channel closes or a
/// write fails (then it shuts the connection, so the reader sees the failure too).
struct Writer {
    tx: std::sync::mpsc::SyncSender<Vec<u8>>,
}

impl Writer {
    fn start(stream: &TcpStream) -> io::Result<Writer> {
        let mut stream = stream.try_clone()?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(WRITES_QUEUED);
        std::thread::Builder::new().name("stage-write".into()).spawn(move || {
            for record in rx {
                if stream.write_all(&record).is_err() {
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                    return;
                }
            }
        })?;
        Ok(Writer { tx })
    }
}

/// Calls a head may have queued for writing to one stage: past a step's micro-batches.
const WRITES_QUEUED: usize = 64;

impl StageConn {
    /// Connects to the stage at `addr` and proves `key`; each call then waits at most
    /// `call_timeout` for its answer.
    pub fn connect(addr: SocketAddr, key: &ClusterKey, call_timeout: Duration) -> Result<StageConn, TransferError> {
        let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
        stream.set_nodelay(true)?;
        watch_liveness(&stream)?;
        stream.set_read_timeout(Some(handshake::exchange_timeout()))?;
        stream.set_write_timeout(Some(call_timeout))?;
        let session = handshake::answer_as(&mut stream, key, LABELS)?;
        stream.set_read_timeout(Some(call_timeout))?;
        let ends = Ends { stream, session, out: Vec::new(), body: Vec::new() };
        Ok(StageConn { ends, addr, writer: None, in_flight: 0 })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether the stage has closed the connection (or it broke), looked at without
    /// waiting: between calls a stage sends nothing, so anything readable is its end.
    pub fn is_closed(&self) -> bool {
        matches!(self.peek(), Peeked::Closed)
    }

    /// Whether the oldest call in flight has begun to be answered (or the connection
    /// ended), so [`StageConn::answer`] will not wait on the stage's compute: looked at
    /// without waiting.
    pub fn answered(&self) -> bool {
        self.in_flight > 0 && !matches!(self.peek(), Peeked::Nothing)
    }

    /// What the connection holds unread, looked at without waiting.
    fn peek(&self) -> Peeked {
        let s = &self.ends.stream;
        if s.set_nonblocking(true).is_err() {
            return Peeked::Closed;
        }
        let mut byte = [0u8; 1];
        let peeked = match s.peek(&mut byte) {
            Ok(0) => Peeked::Closed,
            Ok(_) => Peeked::Data,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Peeked::Nothing,
            Err(_) => Peeked::Closed,
        };
        match s.set_nonblocking(false) {
            Ok(()) => peeked,
            Err(_) => Peeked::Closed,
        }
    }

    /// Sends `body` and returns the stage's answer; a refusal, a timeout or a closed
    /// connection is an error, after which the connection is of no further use.
    pub fn call(&mut self, body: &[u8]) -> Result<&[u8], TransferError> {
        if self.in_flight > 0 {
            return Err(TransferError::Disconnected(format!("a call with {} in flight", self.in_flight)));
        }
        self.ends.send(CALL, body)?;
        self.in_flight = 1;
        self.answer()
    }

    /// Sends `body` without waiting for its answer (a thread of the connection's writes
    /// it): calls in flight are answered in order, each by [`StageConn::answer`].
    pub fn send(&mut self, body: &[u8]) -> Result<(), TransferError> {
        if self.writer.is_none() {
            self.writer = Some(Writer::start(&self.ends.stream)?);
        }
        self.ends.record(CALL, body);
        let record = std::mem::take(&mut self.ends.out);
        let writer = self.writer.as_ref().map(|w| w.tx.send(record));
        if !matches!(writer, Some(Ok(()))) {
            return Err(TransferError::Disconnected("the connection's writer stopped".into()));
        }
        self.in_flight += 1;
        Ok(())
    }

    /// Calls sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The answer to the oldest call in flight; errors as [`StageConn::call`]'s.
    pub fn answer(&mut self) -> Result<&[u8], TransferError> {
        self.in_flight = self.in_flight.saturating_sub(1);
        let lost = |why: String| TransferError::Disconnected(why);
        match self.ends.receive() {
            Ok(Some(rec)) if rec.tag == REPLY => Ok(&self.ends.body[..rec.len]),
            Ok(Some(rec)) if rec.tag == REFUSED => Err(lost(format!(
                "the stage refused the call: {}",
                String::from_utf8_lossy(&self.ends.body[..rec.len])
            ))),
            Ok(Some(rec)) => Err(lost(format!("the stage answered with record {}", rec.tag))),
            Ok(None) => Err(lost("the stage closed the connection".into())),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                Err(TransferError::TimedOut)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Has the kernel find a peer host that vanished without a reset (power, cable) in
/// [`LIVENESS`], not at the call timeout: it probes an idle connection every second,
/// and drops one whose probes or sent data go unanswered that long. A stage busy with
/// a long step still answers (its kernel does), so only a lost host or link trips it.
fn watch_liveness(stream: &TcpStream) -> io::Result<()> {
    let s = socket2::SockRef::from(stream);
    let second = Duration::from_secs(1);
    let probes = socket2::TcpKeepalive::new().with_time(second).with_interval(second);
    #[cfg(target_os = "linux")]
    let probes = probes.with_retries(LIVENESS.as_secs() as u32);
    s.set_tcp_keepalive(&probes)?;
    #[cfg(target_os = "linux")]
    s.set_tcp_user_timeout(Some(LIVENESS))?;
    Ok(())
}

/// What a stage does with a call: its answer into `reply`, or why it refuses.
pub trait StageHandler: Send + 'static {
    fn handle(&mut self, call: &[u8], reply: &mut Vec<u8>) -> Result<(), String>;
}

/// A stage's listener; dropping it stops accepting (connections end with their head).
pub struct StageServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl StageServer {
    /// Serves `handler` on `listener`, on threads of its own.
    pub fn start(listener: TcpListener, key: ClusterKey, handler: impl StageHandler) -> io::Result<StageServer> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Shared { handler: Mutex::new(Box::new(handler)), newest: AtomicU64::new(0), key };
        let (s, st) = (Arc::new(shared), stop.clone());
        std::thread::Builder::new().name("stage-accept".into()).spawn(move || accept(&listener, &s, &st))?;
        Ok(StageServer { addr, stop })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StageServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accepting thread so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

struct Shared {
    handler: Mutex<Box<dyn StageHandler>>,
    /// The generation of the newest head's connection: an older one closes.
    newest: AtomicU64,
    key: ClusterKey,
}

fn accept(listener: &TcpListener, s: &Arc<Shared>, stop: &AtomicBool) {
    let mut generation = 0;
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        generation += 1;
        let (s, g) = (s.clone(), generation);
        let spawned = std::thread::Builder::new().name("stage-head".into()).spawn(move || {
            if let Err(e) = serve_head(stream, &s, g) {
                tracing::info!(error = %e, "stage: a head's connection ended");
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "stage: cannot serve a connection");
        }
    }
}

fn serve_head(mut stream: TcpStream, s: &Shared, generation: u64) -> io::Result<()> {
    stream.set_nodelay(true)?;
    watch_liveness(&stream)?;
    stream.set_read_timeout(Some(handshake::exchange_timeout()))?;
    let session = handshake::challenge_blocking(&mut stream, &s.key, LABELS)?;
    stream.set_read_timeout(None)?;
    if s.newest.fetch_max(generation, Ordering::SeqCst) > generation {
        return Ok(());
    }
    tracing::info!(peer = ?stream.peer_addr().ok(), "stage: serving a head");
    let mut ends = Ends { stream, session, out: Vec::new(), body: Vec::new() };
    let mut reply = Vec::new();
    while let Some(rec) = ends.receive()? {
        if s.newest.load(Ordering::SeqCst) != generation {
            return Err(io::Error::other("a newer head connected"));
        }
        if rec.tag != CALL {
            return Err(records::invalid(format!("record {} from a head", rec.tag)));
        }
        reply.clear();
        let handled =
            s.handler.lock().unwrap_or_else(PoisonError::into_inner).handle(&ends.body[..rec.len], &mut reply);
        match handled {
            Ok(()) => ends.send(REPLY, &reply)?,
            Err(why) => ends.send(REFUSED, why.as_bytes())?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
