//! The sending end of a connection to a remote receiver (TCP, or the control socket
//! of a shared-memory segment), shared by every handoff sent to that receiver.
//!
//! Sinks write whole records under a lock on the calling thread; one reader thread
//! per link applies the receiver's answers (a handoff failed, a handoff is done, a
//! slot came back while a sink slept for one) and wakes whoever waits on them.
//!
//! A 12 KiB frame is too small to pay a system call of its own: a TCP sink gathers
//! its frames into writes of about 256 KiB, and a shared-memory sink packs its frames
//! into a slot (256 KiB by default) and announces the slot once it is full.
//!
//! On a TCP link with a session every record carries a MAC (`records`): sinks leave
//! room for it, and the writer fills it in under its lock, so the sequence numbers
//! follow the order the records go out in.

use crate::auth::{self, Session, SessionMac, MAC_BYTES};
use crate::records::{self, to_receiver, to_sender, Body, Record, Status};
use crate::segment::{HeldSlot, Segment};
use crate::slots::LogEvery;
use crate::{Frame, HandoffId, HandoffToken, KvSink, Share, TransferError, TransportKind};
use std::collections::{HashMap, HashSet};
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long a sender waits on its peer (a write, a free slot, the answer to `END`)
/// before it gives the handoff up.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Inline (TCP) frames are gathered into writes of about this size: one system call
/// per ~20 frames of the default model instead of one per 12 KiB frame. The last
/// partial batch goes out with `END`, which the decode side waits for anyway.
const BATCH_BYTES: usize = 256 << 10;

/// How often a sender waiting for a shared-memory slot looks at the segment even if
/// nobody woke it.
const RECHECK: Duration = Duration::from_millis(20);

pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    /// Blocks until there is something to read (or the connection ended).
    ///
    /// A thread blocked in `read` wakes whenever the peer *reads* too (Linux shares one
    /// wait queue per socket between readers and writers), i.e. on every record the
    /// receiver takes: `poll` waits for input only.
    fn wait_readable(&self) {
        let fd = match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        };
        let mut want = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: `want` is one valid pollfd for the duration of the call, and `fd`
        // stays open while `self` is borrowed. Errors (EINTR) fall through to `read`,
        // which blocks or reports them.
        unsafe { libc::poll(&mut want, 1, -1) };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

pub struct Link {
    kind: TransportKind,
    /// The stream, and the MACs of what is written on it (a session's).
    writer: Mutex<(Stream, Option<SessionMac>)>,
    /// Bytes at the end of each record for its MAC: [`MAC_BYTES`] with a session.
    room: usize,
    shared: Arc<Shared>,
    /// Present on shared-memory links: frames go into its slots.
    segment: Option<Segment>,
    reader: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    /// Set once the link broke or a handoff failed: until then a frame's send need
    /// not look at `state`.
    alert: AtomicBool,
}

/// A shared-memory slot as the sender sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotUse {
    Free,
    /// A sink holds it and writes frames into it.
    Filling,
    /// Announced; free again once the receiver clears its word in the segment.
    Sent,
}

#[derive(Default)]
struct State {
    /// Why the connection is unusable.
    broken: Option<String>,
    /// Handoffs the receiver failed before their end.
    failed: HashMap<HandoffId, Status>,
    /// Answers to `END`: status and frames received.
    done: HashMap<HandoffId, (Status, u32)>,
    /// Handoffs with a sink on this link.
    open: HashSet<HandoffId>,
    /// Shared-memory slots, by index.
    slots: Vec<SlotUse>,
}

impl Link {
    /// Starts the reader thread on `stream`, whose handshake (if any) is done; with a
    /// `session` (`(send, receive)`), records go out and answers come in with MACs.
    pub fn start(
        kind: TransportKind,
        stream: Stream,
        segment: Option<Segment>,
        session: Session,
    ) -> io::Result<Arc<Link>> {
        let (sealing, opening) = session.unzip();
        let room = if sealing.is_some() { MAC_BYTES } else { 0 };
        let slots = segment.as_ref().map_or(0, |s| s.slots());
        let state = State { slots: vec![SlotUse::Free; slots], ..State::default() };
        let shared =
            Arc::new(Shared { state: Mutex::new(state), changed: Condvar::new(), alert: AtomicBool::new(false) });
        let reader = BufReader::with_capacity(16 << 10, stream.try_clone()?);
        let s = shared.clone();
        let reader = thread::Builder::new()
            .name(format!("kv-{kind}-replies"))
            .spawn(move || read_replies(reader, s, opening))?;
        let writer = Mutex::new((stream, sealing));
        Ok(Arc::new(Link { kind, writer, room, shared, segment, reader: Some(reader) }))
    }

    pub fn kind(&self) -> TransportKind {
        self.kind
    }

    /// Opens a sink and tells the receiver at once, presenting `token`, so that the
    /// receiver routes the frames that follow (a wrong token fails the handoff).
    pub fn open(
        self: &Arc<Self>,
        id: HandoffId,
        token: HandoffToken,
        share: Share,
    ) -> Result<Box<dyn KvSink>, TransferError> {
        let mut st = self.shared.lock();
        if let Some(why) = &st.broken {
            return Err(TransferError::Disconnected(why.clone()));
        }
        if !st.open.insert(id) {
            return Err(TransferError::Duplicate(id));
        }
        st.failed.remove(&id);
        st.done.remove(&id);
        drop(st);
        let mut sink = LinkSink { link: self.clone(), id, sent: 0, buf: Vec::new(), slot: None, open: true };
        let mut body = token.0.to_vec();
        if share == Share::Part {
            body.push(crate::receive::PART);
        }
        sink.control(to_receiver::OPEN, &body)?;
        Ok(Box::new(sink))
    }

    /// Writes whole records, each put with [`Link::room`] for its MAC.
    fn write(&self, bytes: &mut [u8]) -> Result<(), TransferError> {
        let mut w = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let (stream, sealing) = &mut *w;
        if let Some(mac) = sealing {
            records::seal(bytes, mac);
        }
        stream.write_all(bytes).map_err(|e| {
            let err = match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => TransferError::TimedOut,
                _ => TransferError::Disconnected(e.to_string()),
            };
            self.shared.fail(format!("write: {e}"));
            err
        })
    }

    /// Fails if the link is down or the receiver gave up on `id`.
    fn check(&self, id: HandoffId, sent: u32) -> Result<(), TransferError> {
        if !self.shared.alert.load(Ordering::Acquire) {
            return Ok(());
        }
        check(&self.shared.lock(), id, sent)
    }

    /// Waits for a free slot of the segment: the lowest one, so that a steady transfer
    /// cycles through few slots that stay in cache.
    fn take_slot(&self, segment: &Segment, id: HandoffId, sent: u32) -> Result<HeldSlot, TransferError> {
        let deadline = Instant::now() + IO_TIMEOUT;
        let mut st = self.shared.lock();
        loop {
            check(&st, id, sent)?;
            if let Some(slot) = reclaim(&mut st.slots, segment) {
                return Ok(slot);
            }
            // Asleep from here until the receiver frees a slot and answers FREE; look
            // once more in case it freed one before it could see the flag. The flag is
            // left set by whoever finds a slot (another sink may sleep on it).
            segment.set_waiting();
            if let Some(slot) = reclaim(&mut st.slots, segment) {
                return Ok(slot);
            }
            // Looking again now and then costs nothing and survives a lost wake-up.
            st = self.shared.wait_until(st, deadline.min(Instant::now() + RECHECK))?;
        }
    }

    /// Gives back a slot that was never announced.
    fn release_slot(&self, slot: HeldSlot) {
        let mut st = self.shared.lock();
        if let Some(s) = st.slots.get_mut(slot.index as usize) {
            *s = SlotUse::Free;
        }
        self.shared.changed.notify_all();
    }

    /// Hands a held slot to the receiver (its `SLOT` record goes next).
    fn mark_sent(&self, segment: &Segment, slot: &HeldSlot) {
        let mut st = self.shared.lock();
        if let Some(s) = st.slots.get_mut(slot.index as usize) {
            *s = SlotUse::Sent;
        }
        segment.mark_sent(slot);
    }

    /// Waits for the receiver's answer to `END`.
    fn wait_done(&self, id: HandoffId, sent: u32) -> Result<(), TransferError> {
        let deadline = Instant::now() + IO_TIMEOUT;
        let mut st = self.shared.lock();
        let result = loop {
            if let Some((status, received)) = st.done.remove(&id) {
                break status_result(id, status, sent, received);
            }
            if let Some(why) = &st.broken {
                break Err(TransferError::Disconnected(why.clone()));
            }
            match self.shared.wait_until(st, deadline) {
                Ok(next) => st = next,
                Err(e) => return Err(e),
            }
        };
        st.failed.remove(&id);
        result
    }

    fn forget(&self, id: HandoffId) {
        let mut st = self.shared.lock();
        st.failed.remove(&id);
        st.done.remove(&id);
        st.open.remove(&id);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.writer.lock().unwrap_or_else(PoisonError::into_inner).0.shutdown();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait_until<'a>(
        &self,
        st: MutexGuard<'a, State>,
        deadline: Instant,
    ) -> Result<MutexGuard<'a, State>, TransferError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(TransferError::TimedOut);
        }
        Ok(self.changed.wait_timeout(st, left).unwrap_or_else(PoisonError::into_inner).0)
    }

    fn fail(&self, why: String) {
        let mut st = self.lock();
        st.broken.get_or_insert(why);
        self.alert.store(true, Ordering::Release);
        self.changed.notify_all();
    }

    fn apply(&self, rec: Record, body: &[u8]) -> io::Result<()> {
        let mut b = Body(body);
        let mut st = self.lock();
        match rec.tag {
            to_sender::NOTICE => {
                st.failed.insert(rec.handoff, b.status()?);
                self.alert.store(true, Ordering::Release);
            }
            to_sender::DONE => {
                let status = b.status()?;
                st.done.insert(rec.handoff, (status, b.u32()?));
            }
            // A slot came back while a sink slept waiting for one (the slot itself
            // is marked free in the segment): just wake the sleepers.
            to_sender::FREE => {
                b.u32()?;
            }
            tag => return Err(records::invalid(format!("unexpected record {tag} from the receiver"))),
        }
        self.changed.notify_all();
        Ok(())
    }
}

fn read_replies(mut r: BufReader<Stream>, shared: Arc<Shared>, mut opening: Option<SessionMac>) {
    let mut body = Vec::new();
    let why = loop {
        if r.buffer().is_empty() {
            r.get_ref().wait_readable();
        }
        match records::read_sync(&mut r, &mut body, records::REPLY_LIMIT, opening.as_mut()) {
            Ok(Some(rec)) => {
                if let Err(e) = shared.apply(rec, &body[..rec.len]) {
                    break e.to_string();
                }
            }
            Ok(None) => break "the receiver closed the connection".to_string(),
            Err(e) => {
                if auth::is_forged(&e) {
                    if let Some(quiet) = FORGED_REPLIES.due() {
                        tracing::warn!(error = %e, forged_since_last = quiet, "KV link closed: an answer failed its MAC");
                    }
                    r.get_ref().shutdown();
                }
                break e.to_string();
            }
        }
    };
    shared.fail(why);
}

/// Answers that failed their MAC are logged at most once a while, for every link.
static FORGED_REPLIES: LogEvery = LogEvery::new();

/// The lowest slot that is free, now held, after noting which sent slots the receiver
/// has finished with.
fn reclaim(slots: &mut [SlotUse], segment: &Segment) -> Option<HeldSlot> {
    for (index, s) in slots.iter_mut().enumerate() {
        if *s == SlotUse::Sent && segment.is_free(index) {
            *s = SlotUse::Free;
        }
        if *s == SlotUse::Free {
            *s = SlotUse::Filling;
            return Some(HeldSlot { index: index as u32, used: 0 });
        }
    }
    None
}

/// The body of a `SLOT` record: the slot and the bytes of frames in it.
fn slot_body(index: u32, used: usize) -> [u8; 8] {
    let mut body = [0u8; 8];
    body[..4].copy_from_slice(&index.to_le_bytes());
    body[4..].copy_from_slice(&(used as u32).to_le_bytes());
    body
}

fn check(st: &State, id: HandoffId, sent: u32) -> Result<(), TransferError> {
    if let Some(why) = &st.broken {
        return Err(TransferError::Disconnected(why.clone()));
    }
    match st.failed.get(&id) {
        Some(&status) => status_result(id, status, sent, 0),
        None => Ok(()),
    }
}

fn status_result(id: HandoffId, status: Status, sent: u32, received: u32) -> Result<(), TransferError> {
    match status {
        Status::Delivered => Ok(()),
        Status::Gone => Err(TransferError::ReceiverGone(id)),
        Status::Rejected => Err(TransferError::Rejected),
        Status::Incomplete => Err(TransferError::Incomplete { sent, received }),
        Status::Refused => Err(TransferError::Disconnected("the receiver refused the segment".into())),
    }
}

struct LinkSink {
    link: Arc<Link>,
    id: HandoffId,
    sent: u32,
    /// Records not written yet (inline frames batch here), reused write after write.
    buf: Vec<u8>,
    /// Shared memory: the slot being filled.
    slot: Option<HeldSlot>,
    /// Neither finished nor aborted yet.
    open: bool,
}

impl LinkSink {
    /// TCP: the frame travels inside its record, records go out in batches.
    fn send_inline(&mut self, frame: &Frame) -> Result<(), TransferError> {
        let start = self.buf.len();
        let room = self.link.room;
        let end = start + records::PREFIX_BYTES + frame.encoded_len() + room;
        self.buf.resize(end, 0);
        if let Err(e) = frame.encode_to_slice(&mut self.buf[start + records::PREFIX_BYTES..end - room]) {
            self.buf.truncate(start);
            return Err(TransferError::Frame(e));
        }
        let prefix = records::prefix(to_receiver::FRAME, self.id, frame.encoded_len() + room);
        self.buf[start..start + records::PREFIX_BYTES].copy_from_slice(&prefix);
        if self.buf.len() >= BATCH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// Shared memory: the frame goes after the others in this sink's slot; the slot
    /// goes to the receiver (one record) when the next frame does not fit.
    fn send_in_slot(&mut self, frame: &Frame) -> Result<(), TransferError> {
        let bytes = frame.encoded_len();
        let slot_bytes = self.link.segment.as_ref().map_or(0, Segment::slot_bytes);
        if bytes > slot_bytes {
            return Err(TransferError::SlotTooSmall { bytes, slot: slot_bytes });
        }
        if self.slot.as_ref().is_some_and(|s| s.used + bytes > slot_bytes) {
            self.announce_slot()?;
        }
        let Some(segment) = &self.link.segment else { return Ok(()) };
        // Held in the sink before writing, so that a failure below still returns it.
        let slot = match &mut self.slot {
            Some(slot) => slot,
            None => self.slot.insert(self.link.take_slot(segment, self.id, self.sent)?),
        };
        segment.write(slot, frame).map_err(TransferError::Frame)?;
        Ok(())
    }

    /// Hands the slot being filled to the receiver.
    fn announce_slot(&mut self) -> Result<(), TransferError> {
        let (Some(segment), Some(slot)) = (&self.link.segment, self.slot.take()) else { return Ok(()) };
        self.link.mark_sent(segment, &slot);
        self.control(to_receiver::SLOT, &slot_body(slot.index, slot.used))
    }

    /// Writes a control record at once; records still batched are dropped (callers
    /// flush first unless they abort).
    fn control(&mut self, tag: u8, body: &[u8]) -> Result<(), TransferError> {
        self.buf.clear();
        records::put_with_room(&mut self.buf, tag, self.id, body, self.link.room);
        let written = self.link.write(&mut self.buf);
        self.buf.clear();
        written
    }
}

impl KvSink for LinkSink {
    fn send(&mut self, frame: Frame) -> Result<(), TransferError> {
        self.send_returning(frame).map(drop)
    }

    fn send_returning(&mut self, frame: Frame) -> Result<Option<Frame>, TransferError> {
        if frame.handoff != self.id {
            return Err(TransferError::WrongHandoff { sink: self.id, frame: frame.handoff });
        }
        self.link.check(self.id, self.sent)?;
        match self.link.segment {
            Some(_) => self.send_in_slot(&frame)?,
            None => self.send_inline(&frame)?,
        }
        self.sent += 1;
        Ok(Some(frame))
    }

    fn flush(&mut self) -> Result<(), TransferError> {
        if self.link.segment.is_some() {
            return self.announce_slot();
        }
        if self.buf.is_empty() {
            return Ok(());
        }
        let result = self.link.write(&mut self.buf);
        self.buf.clear();
        result
    }

    fn finish(mut self: Box<Self>) -> Result<(), TransferError> {
        self.open = false;
        let sent = self.sent;
        let result = self.flush().and_then(|()| self.control(to_receiver::END, &sent.to_le_bytes()));
        let result = result.and_then(|()| self.link.wait_done(self.id, sent));
        self.link.forget(self.id);
        result
    }

    fn abort(self: Box<Self>) {}
}

impl Drop for LinkSink {
    fn drop(&mut self) {
        // A slot never announced was never seen by the receiver: it is free again.
        if let Some(slot) = self.slot.take() {
            self.link.release_slot(slot);
        }
        if self.open {
            self.open = false;
            let _ = self.control(to_receiver::ABORT, &[]);
            self.link.forget(self.id);
        }
    }
}

#[cfg(test)]
impl Link {
    /// Sends `frame` with byte `at` of its encoding flipped, as a faulty link would.
    pub fn send_corrupted(&self, frame: &Frame, at: usize) -> Result<(), TransferError> {
        let mut bytes = Vec::new();
        frame.encode_into(&mut bytes).map_err(TransferError::Frame)?;
        bytes[at] ^= 0x40;
        let mut out = Vec::new();
        match &self.segment {
            Some(segment) => {
                let mut slot = self.take_slot(segment, frame.handoff, 0)?;
                segment.write_raw(&mut slot, &bytes);
                self.mark_sent(segment, &slot);
                let body = slot_body(slot.index, bytes.len());
                records::put_with_room(&mut out, to_receiver::SLOT, frame.handoff, &body, self.room);
            }
            None => records::put_with_room(&mut out, to_receiver::FRAME, frame.handoff, &bytes, self.room),
        }
        self.write(&mut out)
    }
}
