//! KV transfer: how a prefill worker's K/V reaches the decode worker (the handoff in
//! docs/ARCHITECTURE.md).
//!
//! ```text
//! prefill engine thread                               decode worker
//!   on_frame(KvFrame) ─► KvSink::send(Frame) ─link─►  Inboxes ─► Inbox::recv() ─► import_frame
//!                        KvSink::finish()     ─────►            Ok(None): every frame arrived
//! ```
//!
//! The decode side first [`Inboxes::expect`]s the handoff (after reserving blocks),
//! which makes an unguessable [`HandoffToken`]; the prefill side, told the token by
//! the router, [`KvTransport::open`]s a sink for it and streams one [`Frame`] per
//! (layer, block) as each layer completes. A receiver routes frames only to a handoff
//! whose sink presented its token, so no other process can write into (or spoil) a
//! reservation it did not get. Frames of one handoff arrive in order.
//! A handoff into a stage group whose later stages receive their own layers goes to
//! several receivers at once, each layer to the one that holds it ([`ByLayer`]).
//! Every link that leaves the process carries frames in the checksummed [wire
//! format](frame), so a corrupt frame fails its handoff instead of poisoning the cache.
//!
//! Transports, all behind [`KvTransport`] and named by [`TransportKind`]; a decode
//! worker says where it receives with a [`KvTarget`], and [`Links`] opens a sink to
//! any target, so the sending side has one code path for all of them:
//! - [`InProcess`]: the frame itself moves through a bounded channel; no copy.
//! - [`TcpTransport`] → [`TcpReceiver`]: length-prefixed frames on one connection per
//!   peer, any number of handoffs interleaved on it.
//! - [`ShmTransport`] → [`ShmReceiver`] (same host): frames are packed into a ring of
//!   pre-faulted slots in a `/dev/shm` segment, a Unix socket carries "handoff H, slot
//!   S, length L" per slot, and slots come back through words in the segment itself;
//!   one copy on each side.
//!
//! Senders block (they run on the engine's thread); receivers are tokio tasks that
//! feed per-handoff bounded channels, so a slow consumer slows its sender down.
//!
//! Cost, from [`measure`] on the 2-core development machine (docs/benchmarks.md): a
//! frame of the default model is 12 KiB; shared memory carries such frames at about
//! the speed of a bare two-thread ring (15–21 GB/s), TCP at ~3–5 GB/s (faster than a
//! bare socket written 12 KiB at a time, since frames go out in 256 KiB writes). A
//! 512-token prompt (11.8 MB) therefore takes ~1 ms over shared memory and ~3 ms over
//! loopback TCP, overlapped with seconds of prefill. With a cluster token (not
//! `--insecure`) every TCP record also carries an HMAC-SHA256 ([`auth::SessionMac`]),
//! about 0.6 ms per MiB on each end: loopback TCP then measured ~0.9 GB/s instead of
//! ~2.4 GB/s on the same machine (~13 ms for that prompt). Shared memory carries none.

pub mod auth;
mod by_layer;
pub mod frame;
mod handshake;
mod in_process;
mod inbox;
mod link;
mod links;
mod measure;
mod receive;
mod records;
mod segment;
mod shm;
pub mod slots;
mod stage;
mod target;
mod tcp;
mod transport;

use pdserve_types::crc32c;
use std::fmt;
use std::sync::Arc;

pub use auth::ClusterKey;
pub use by_layer::ByLayer;
pub use frame::{Frame, FrameError};
pub use in_process::InProcess;
pub use inbox::{Inbox, Inboxes};
pub use links::Links;
pub use measure::{measure, measure_copy, measure_copy_twice, measure_raw_shm, measure_raw_tcp, probe, Throughput};
pub use shm::{ShmConfig, ShmReceiver, ShmTransport};
pub use stage::{StageConn, StageHandler, StageServer};
pub use target::{in_proc, inboxes_of, HandoffToken, InProcTarget, KvAddr, KvTarget, TransportKind};
pub use tcp::{TcpReceiver, TcpTransport};
pub use transport::{bind, remote, Binding, KvReceiver, ListenAt, Transport};

/// Every transport that leaves the process; a new one is registered here.
pub static REMOTE: &[&dyn Transport] = &[&tcp::Tcp, &shm::Shm];

/// Authenticated connections a receiver serves at once; more are closed as they
/// arrive (connections still proving the token have a budget of their own, see
/// [`slots`]).
pub const MAX_CONNECTIONS: usize = 64;

/// Names one transfer of one sequence's KV from a prefill to a decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HandoffId(pub u64);

impl fmt::Display for HandoffId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "handoff-{:x}", self.0)
    }
}

impl From<pdserve_types::RequestId> for HandoffId {
    fn from(id: pdserve_types::RequestId) -> Self {
        HandoffId(id.0)
    }
}

/// Which of a handoff's frames a sink sends. A handoff has one main sink; beside it,
/// any number of parts may each send some of its frames (a prefill group's later
/// stage sends its own layers' K/V to the receiver itself, not through its head). A
/// part's end vouches for its own frames only; the main sink ends the handoff, once
/// every part that joined it has ended (its sender sees to that: it finishes after
/// its parts did). A failed part fails the handoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    Main,
    Part,
}

/// The sending side of KV transfer to one receiver (a decode worker's [`Inboxes`],
/// here or on a peer). Object safe: the router holds `Arc<dyn KvTransport>` per pair.
pub trait KvTransport: Send + Sync {
    /// Opens the sink of handoff `id`, presenting the receiver's `token`. The receiver
    /// must already expect `id` with that token; a link that can tell at once
    /// (in-process) fails here, the others at the first send or at
    /// [`KvSink::finish`].
    fn open(&self, id: HandoffId, token: HandoffToken) -> Result<Box<dyn KvSink>, TransferError>;

    /// Opens a [part](Share::Part) of handoff `id` (the main sink may be open in
    /// another process). Only links that leave the process carry parts.
    fn open_part(&self, id: HandoffId, _token: HandoffToken) -> Result<Box<dyn KvSink>, TransferError> {
        Err(TransferError::Disconnected(format!("a {} link carries no parts of {id}", self.kind())))
    }

    fn kind(&self) -> TransportKind;
}

/// The sending half of one handoff. Calls block, so they belong on a plain thread
/// (the prefill engine's), not on an async task. Dropping a sink that was neither
/// finished nor aborted aborts it.
pub trait KvSink: Send {
    /// Sends one frame of this handoff, waiting while the link or the receiver is
    /// full. An error means the handoff is over (the receiver is gone or rejected a
    /// frame, or the link failed): stop computing frames for it.
    fn send(&mut self, frame: Frame) -> Result<(), TransferError>;

    /// [`KvSink::send`], handing the frame back when the link copied it out (TCP,
    /// shared memory) so that its buffers can be filled again instead of freed.
    fn send_returning(&mut self, frame: Frame) -> Result<Option<Frame>, TransferError> {
        self.send(frame).map(|()| None)
    }

    /// Sends frames the sink is still gathering into a batch (TCP); `finish` does it
    /// too. A no-op for sinks that send each frame at once.
    fn flush(&mut self) -> Result<(), TransferError> {
        Ok(())
    }

    /// Ends the handoff. Returns once the receiver has every frame, intact, queued in
    /// its inbox, or with the reason it has not.
    fn finish(self: Box<Self>) -> Result<(), TransferError>;

    /// Gives the handoff up; the receiver's inbox yields [`TransferError::Aborted`]
    /// after the frames already sent (frames still batched are dropped).
    fn abort(self: Box<Self>);
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum TransferError {
    #[error("{0} is already expected, or already has a sink")]
    Duplicate(HandoffId),
    #[error("no receiver expects {0}, or it stopped listening")]
    ReceiverGone(HandoffId),
    #[error("the sender aborted the handoff")]
    Aborted,
    #[error("corrupt frame: {0}")]
    Corrupt(FrameError),
    #[error("the receiver rejected a corrupt frame")]
    Rejected,
    #[error("{received} frames arrived but {sent} were sent")]
    Incomplete { sent: u32, received: u32 },
    #[error("a frame of {frame} was sent on the sink of {sink}")]
    WrongHandoff { sink: HandoffId, frame: HandoffId },
    #[error("cannot send frame: {0}")]
    Frame(FrameError),
    #[error("a frame of {bytes} bytes does not fit a {slot}-byte slot")]
    SlotTooSmall { bytes: usize, slot: usize },
    #[error("the link is down: {0}")]
    Disconnected(String),
    #[error("timed out waiting for the peer")]
    TimedOut,
    #[error("i/o: {0}")]
    Io(Arc<std::io::Error>),
}

impl From<std::io::Error> for TransferError {
    fn from(e: std::io::Error) -> Self {
        TransferError::Io(Arc::new(e))
    }
}
