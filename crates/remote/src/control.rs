//! The control protocol between a router and a worker process: one TCP connection,
//! length-prefixed JSON messages, calls multiplexed by [`CallId`]. Each call is one
//! operation of the [`Worker`](pdserve_protocol::Worker) surface ([`Op`]); KV never
//! travels here, it goes from the prefill process straight to the decode process's
//! [`KvAddr`].
//!
//! ```text
//! router                               worker
//!                               ◄──    Challenge{nonce}
//!   Hello{protocol, proof, nonce} ──►  checks the proof (else closes)
//!                               ◄──    Hello(Handshake{.., proof})   the router checks it
//!   Call{call, op}              ──►    runs op on the worker
//!                               ◄──    Event{call, ..}*   (generate, decode)
//!                               ◄──    Reply{call, ..}    (reserve, prefill, stats)
//!   Cancel{call}                ──►    stops the call
//!   Ping                        ──►    (every second)
//!                               ◄──    Pong
//! ```
//!
//! Both sides prove they hold the cluster's secret (HMAC of the other's nonce), so
//! neither a stranger's router nor a stranger's worker gets in.

use pdserve_kv_transfer::{HandoffToken, KvAddr};
use pdserve_protocol::{
    DecodeHandoff, Event, GenerateRequest, KvCursor, KvEvents, Prefilled, ServeError, WorkerInfo, WorkerStats,
};
use pdserve_types::{Assignment, Epoch, RequestId};
use serde::{Deserialize, Serialize};
use std::io;
use std::path::PathBuf;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bumped on any incompatible change; both ends check it in the handshake.
pub const PROTOCOL_VERSION: u32 = 9;

/// What the router proves it knows.
pub const ROUTER_LABEL: &[u8] = b"pdserve-control-router";
/// What the worker proves it knows.
pub const WORKER_LABEL: &[u8] = b"pdserve-control-worker";

/// The largest message either side accepts. A generate call carries at most a
/// context's worth of token ids plus its sampling parameters, far below this; a
/// bigger length prefix is a broken or hostile peer.
pub const MAX_MESSAGE: usize = 8 << 20;

/// The largest message a peer may send before it proved the cluster token: a `Hello`
/// is a few hundred bytes, so a stranger cannot make a worker hold megabytes while it
/// trickles a message in.
pub const MAX_HELLO: usize = 4 << 10;

/// Numbers one call on one connection; its replies carry the same number.
pub type CallId = u64;

/// What a worker process says about itself when a router connects.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Handshake {
    pub protocol: u32,
    pub info: WorkerInfo,
    /// Port of the TCP KV receiver, on the host the router connected to.
    pub kv_tcp_port: Option<u16>,
    /// Socket of the shared-memory KV receiver (same host only).
    pub kv_shm: Option<PathBuf>,
    /// The worker's answer to the router's nonce.
    pub proof: Vec<u8>,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum ToWorker {
    Hello {
        protocol: u32,
        /// The answer to the worker's challenge.
        proof: Vec<u8>,
        /// The router's challenge to the worker.
        nonce: Vec<u8>,
    },
    /// Are you there? (Answered with `Pong`.)
    Ping,
    Call {
        call: CallId,
        op: Box<Op>,
    },
    /// The caller of `call` left: stop its work.
    Cancel {
        call: CallId,
    },
    /// The consumer of stream `call` fell behind (`paused`), or caught up: the worker
    /// stops sending its events meanwhile, so the sequence pauses there.
    Pace {
        call: CallId,
        paused: bool,
    },
}

/// One operation of the worker surface.
#[derive(Debug, Serialize, Deserialize)]
pub enum Op {
    /// Prefill and decode here; events stream back.
    Generate {
        req: GenerateRequest,
    },
    /// Reserve blocks for a transfer; answered with [`Answer::Token`].
    Reserve {
        id: RequestId,
        prompt_len: usize,
        /// The epoch the router routed for (see `Worker::set_role`).
        #[serde(default)]
        fence: Option<Epoch>,
        /// Leading tokens whose blocks come from the worker's own cache (a partial
        /// fetch, `Worker::reserve_after`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        keep: Vec<u32>,
    },
    /// Prefill here and send the KV to `to`; answered with [`Answer::Prefilled`] once
    /// every frame reached the receiver.
    Prefill {
        req: GenerateRequest,
        to: KvAddr,
        token: HandoffToken,
        /// Leading prompt tokens whose K/V came from a peer into this connection's
        /// reservation `req.id` (`Worker::prefill_imported`); 0: none.
        #[serde(default)]
        imported: usize,
    },
    /// Decode a transferred sequence; events after the first token stream back.
    Decode {
        handoff: DecodeHandoff,
    },
    /// Send the K/V of the cached prefix of `tokens` to a peer's reservation at `to`
    /// without computing anything; answered with [`Answer::Count`] (tokens sent) once
    /// the receiver holds every frame.
    ExportPrefix {
        id: RequestId,
        tokens: Vec<u32>,
        /// Leading tokens the receiver keeps: not sent.
        #[serde(default)]
        skip: usize,
        to: KvAddr,
        token: HandoffToken,
    },
    /// Prefill and decode here, the first `imported` prompt tokens' K/V taken from
    /// the transfer into this connection's reservation `req.id`; events stream back.
    GenerateImported {
        req: GenerateRequest,
        imported: usize,
    },
    /// Give up a reservation this connection holds. No answer.
    Release {
        id: RequestId,
    },
    Stats,
    /// Switch role if the epoch is newer; answered with [`Answer::Assignment`].
    SetRole {
        to: Assignment,
    },
    /// Hand back the decodes a worker that left decode still runs; answered with
    /// [`Answer::Count`].
    MoveDecodes,
    /// The worker's prefix-cache events after a cursor; answered with
    /// [`Answer::KvEvents`].
    KvEvents {
        after: KvCursor,
    },
    /// Open an inbox that throws its frames away, for a peer's link probe; answered
    /// with [`Answer::Token`].
    ProbeInbox {
        id: RequestId,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum FromWorker {
    Challenge { nonce: Vec<u8> },
    Hello(Handshake),
    Pong,
    Event { call: CallId, event: Event },
    Reply { call: CallId, result: Result<Answer, ServeError> },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum Answer {
    Token(HandoffToken),
    Prefilled(Prefilled),
    /// Boxed: the stats are several times the size of every other answer.
    Stats(Box<WorkerStats>),
    KvEvents(KvEvents),
    Assignment(Assignment),
    Count(usize),
}

/// Writes one message: a big-endian u32 length, then JSON.
pub async fn write<W: AsyncWrite + Unpin, T: Serialize>(w: &mut W, msg: &T) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    if body.len() > MAX_MESSAGE {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("message of {} bytes", body.len())));
    }
    w.write_u32(body.len() as u32).await?;
    w.write_all(&body).await?;
    w.flush().await
}

/// Reads one message; `Ok(None)` at a clean end of stream. The buffer grows as
/// bytes arrive, so a length prefix alone allocates nothing.
pub async fn read<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(r: &mut R) -> io::Result<Option<T>> {
    read_at_most(r, MAX_MESSAGE).await
}

/// [`read`] with a smaller bound than [`MAX_MESSAGE`] (the handshake's).
pub async fn read_at_most<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
    limit: usize,
) -> io::Result<Option<T>> {
    let len = match r.read_u32().await {
        Ok(n) => n as usize,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    };
    if len > limit {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("message of {len} bytes")));
    }
    let mut body = Vec::with_capacity(len.min(64 << 10));
    let got = r.take(len as u64).read_to_end(&mut body).await?;
    if got < len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection ended inside a message"));
    }
    serde_json::from_slice(&body).map(Some).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_huge_length_prefix_is_refused_without_allocating_it() {
        let bytes = u32::MAX.to_be_bytes();
        let r: io::Result<Option<ToWorker>> = read(&mut &bytes[..]).await;
        assert!(r.is_err());
        // Announces 1 MiB, sends 3 bytes: an error, not a 1 MiB buffer.
        let mut short = (1u32 << 20).to_be_bytes().to_vec();
        short.extend_from_slice(b"{}}");
        let r: io::Result<Option<ToWorker>> = read(&mut &short[..]).await;
        assert!(matches!(r, Err(e) if e.kind() == io::ErrorKind::UnexpectedEof));
    }

    #[tokio::test]
    async fn messages_round_trip() {
        let mut buf = Vec::new();
        write(&mut buf, &ToWorker::Call { call: 7, op: Box::new(Op::Release { id: RequestId(3) }) })
            .await
            .unwrap_or_default();
        let back: Option<ToWorker> = read(&mut &buf[..]).await.ok().flatten();
        assert!(
            matches!(back, Some(ToWorker::Call { call: 7, op }) if matches!(*op, Op::Release { id: RequestId(3) }))
        );
    }
}
