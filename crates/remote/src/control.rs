//! The control protocol between a router and a worker process: one TCP connection,
//! length-prefixed JSON messages, calls multiplexed by [`CallId`]. Each call is one
//! operation of the [`Worker`](pdserve_protocol::Worker) surface ([`Op`]); KV never
//! travels here, it goes from the prefill process straight to the decode process's
//! [`KvAddr`].
//!
//! ```text
//! router                               worker
//!                               ◄──    Challenge{nonce_w}
//!   Hello{protocol, proof, nonce_r} ►  checks the proof (else closes)
//!        both ends now derive the session's keys from (cluster key, nonce_w, nonce_r)
//!                               ◄──    Hello(Handshake{.., proof}) + MAC   the router checks both
//!   Call{call, op} + MAC        ──►    runs op on the worker
//!                               ◄──    Event{call, ..}* + MAC   (generate, decode)
//!                               ◄──    Reply{call, ..} + MAC    (reserve, prefill, stats)
//!   Cancel{call} + MAC          ──►    stops the call
//!   Ping + MAC                  ──►    (twice a second)
//!                               ◄──    Pong + MAC
//! ```
//!
//! Both sides prove they hold the cluster's secret (HMAC of the other's nonce), so
//! neither a stranger's router nor a stranger's worker gets in. From the worker's
//! `Hello` on, every message in each direction ends with a MAC under that
//! direction's session key ([`SessionMac`]) over an implicit sequence number and
//! the message (`len u32 | JSON | mac 32 bytes`, the length counting the JSON only),
//! so a relay that passed the handshake through cannot inject, alter, replay, reorder
//! or drop a message: the side that reads it closes the connection. It can still read
//! them: the protocol authenticates, it does not encrypt (prompts cross in the clear).
//! With the insecure key there is no session, and no MAC.

pub use pdserve_kv_transfer::auth::{SessionMac, MAC_BYTES};
use pdserve_kv_transfer::{auth, HandoffToken, KvAddr};
use pdserve_protocol::{
    DecodeHandoff, Event, GenerateRequest, Prefilled, Reserved, ServeError, WorkerInfo, WorkerStats,
};
use pdserve_types::{Epoch, RequestId, StageReceiver};
use serde::{Deserialize, Serialize};
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bumped on any incompatible change; both ends check it in the handshake. 15: a
/// request may ask for its prompt's embedding, which comes back as its own event and
/// with a prefill's first token.
pub const PROTOCOL_VERSION: u32 = 15;

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
    /// Its KV receivers, at most one per transport kind; a router reaches a TCP one
    /// at its port on the host the router connected to ([`KvAddr::seen_at`]).
    #[serde(default)]
    pub kv: Vec<KvAddr>,
    /// The optional parts of the worker surface the worker has: a router asks only
    /// for these.
    #[serde(default)]
    pub capabilities: Vec<Capability>,
    /// The worker's answer to the router's nonce.
    pub proof: Vec<u8>,
}

/// An optional part of the [`Worker`](pdserve_protocol::Worker) surface, as a worker
/// announces it in its [`Handshake`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Capability {
    /// [`pdserve_protocol::PrefixPeer`].
    PrefixPeer,
    /// [`pdserve_protocol::KvEventLog`].
    KvEventLog,
    /// [`pdserve_protocol::RoleSwitch`].
    RoleSwitch,
    /// [`pdserve_protocol::LinkProbe`].
    LinkProbe,
}

impl Capability {
    /// The capabilities `worker` has.
    pub fn of(worker: &dyn pdserve_protocol::Worker) -> Vec<Capability> {
        let has = [
            (Capability::PrefixPeer, worker.prefix_peer().is_some()),
            (Capability::KvEventLog, worker.kv_event_log().is_some()),
            (Capability::RoleSwitch, worker.role_switch().is_some()),
            (Capability::LinkProbe, worker.link_probe().is_some()),
        ];
        has.into_iter().filter_map(|(c, has)| has.then_some(c)).collect()
    }
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
    /// Reserve blocks for a transfer; answered with [`Answer::Reserved`], or with
    /// [`Answer::Token`] where it keeps some of its own.
    Reserve {
        id: RequestId,
        prompt_len: usize,
        /// The epoch the router routed for (see `RoleSwitch::set_role`).
        #[serde(default)]
        fence: Option<Epoch>,
        /// Leading tokens whose blocks come from the worker's own cache (a partial
        /// fetch, `PrefixPeer::reserve_after`).
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
        /// reservation `req.id` (`PrefixPeer::prefill_imported`); 0: none.
        #[serde(default)]
        imported: usize,
        /// What the draft model's K/V of the prompt is worth to the receiver
        /// (`Reserved::draft_worth`).
        #[serde(default)]
        draft_worth: Option<f64>,
        /// The layers that go straight to the decode group's later stages
        /// (`Reserved::stages`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        stages: Vec<StageReceiver>,
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
        /// The layers that go straight to the receiving group's later stages.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        stages: Vec<StageReceiver>,
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
    /// An operation that only asks the worker (`crate::asks::Ask`, carried as its
    /// JSON so the wire module need not know each one); answered with
    /// [`Answer::Value`].
    Ask(serde_json::Value),
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
    Reserved(Reserved),
    /// Boxed, as the stats are: a prefill's result is several times the size of the
    /// small answers.
    Prefilled(Box<Prefilled>),
    /// Boxed: the stats are several times the size of every other answer.
    Stats(Box<WorkerStats>),
    /// The answer of an [`Op::Ask`], as JSON.
    Value(serde_json::Value),
    Count(usize),
}

/// The session's MACs of a connection, `(send, receive)`, for the end that
/// `sends_as` (its proof's label: [`ROUTER_LABEL`] or [`WORKER_LABEL`]), from the
/// worker's challenge and the router's nonce; `None` with the insecure key.
pub fn session(
    key: &pdserve_kv_transfer::ClusterKey,
    worker_nonce: &[u8],
    router_nonce: &[u8],
    sends_as: &[u8],
) -> Option<(SessionMac, SessionMac)> {
    let receives_as = if sends_as == ROUTER_LABEL { WORKER_LABEL } else { ROUTER_LABEL };
    key.session(worker_nonce, router_nonce, sends_as, receives_as)
}

/// Writes one message: a big-endian u32 length, then JSON, then (in a session) the
/// MAC of both under `mac`.
pub async fn write<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
    mac: Option<&mut SessionMac>,
) -> io::Result<()> {
    let mut bytes = vec![0u8; 4];
    serde_json::to_writer(&mut bytes, msg).map_err(io::Error::other)?;
    let len = bytes.len() - 4;
    if len > MAX_MESSAGE {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("message of {len} bytes")));
    }
    bytes[..4].copy_from_slice(&(len as u32).to_be_bytes());
    if let Some(mac) = mac {
        let tag = mac.seal(&[&bytes]);
        bytes.extend_from_slice(&tag);
    }
    w.write_all(&bytes).await?;
    w.flush().await
}

/// Reads one message; `Ok(None)` at a clean end of stream. The buffer grows as
/// bytes arrive, so a length prefix alone allocates nothing. In a session (`mac`),
/// a message whose MAC fails is an error ([`auth::is_forged`]), never parsed.
pub async fn read<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
    mac: Option<&mut SessionMac>,
) -> io::Result<Option<T>> {
    let Some(body) = read_body(r, MAX_MESSAGE).await? else { return Ok(None) };
    if let Some(mac) = mac {
        read_mac(r, &body, mac).await?;
    }
    decode(&body).map(Some)
}

/// An unsealed message of at most `limit` bytes: the handshake's.
pub async fn read_at_most<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
    limit: usize,
) -> io::Result<Option<T>> {
    match read_body(r, limit).await? {
        Some(body) => decode(&body).map(Some),
        None => Ok(None),
    }
}

/// Parses a message's JSON.
pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> io::Result<T> {
    serde_json::from_slice(body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Reads the MAC that follows the message `body` and checks it as the next one
/// `mac` receives.
pub async fn read_mac<R: AsyncRead + Unpin>(r: &mut R, body: &[u8], mac: &mut SessionMac) -> io::Result<()> {
    let mut tag = [0u8; MAC_BYTES];
    r.read_exact(&mut tag).await?;
    let len = (body.len() as u32).to_be_bytes();
    match mac.open(&[&len, body], &tag) {
        true => Ok(()),
        false => Err(auth::forged()),
    }
}

/// The JSON of one message of at most `limit` bytes; `Ok(None)` at a clean end of
/// stream.
pub async fn read_body<R: AsyncRead + Unpin>(r: &mut R, limit: usize) -> io::Result<Option<Vec<u8>>> {
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
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_huge_length_prefix_is_refused_without_allocating_it() {
        let bytes = u32::MAX.to_be_bytes();
        let r: io::Result<Option<ToWorker>> = read(&mut &bytes[..], None).await;
        assert!(r.is_err());
        // Announces 1 MiB, sends 3 bytes: an error, not a 1 MiB buffer.
        let mut short = (1u32 << 20).to_be_bytes().to_vec();
        short.extend_from_slice(b"{}}");
        let r: io::Result<Option<ToWorker>> = read(&mut &short[..], None).await;
        assert!(matches!(r, Err(e) if e.kind() == io::ErrorKind::UnexpectedEof));
    }

    #[tokio::test]
    async fn messages_round_trip() {
        let mut buf = Vec::new();
        write(&mut buf, &ToWorker::Call { call: 7, op: Box::new(Op::Release { id: RequestId(3) }) }, None)
            .await
            .unwrap_or_default();
        let back: Option<ToWorker> = read(&mut &buf[..], None).await.ok().flatten();
        assert!(
            matches!(back, Some(ToWorker::Call { call: 7, op }) if matches!(*op, Op::Release { id: RequestId(3) }))
        );
    }

    /// In a session each message carries the MAC of its place in the sequence: the
    /// router's messages read back in order, and a replayed, altered or reflected one
    /// is refused.
    #[tokio::test]
    async fn sealed_messages_round_trip_and_the_rest_fail() {
        let key = pdserve_kv_transfer::ClusterKey::random();
        let (w, r) = (auth::nonce(), auth::nonce());
        let (mut router_send, mut router_recv) = session(&key, &w, &r, ROUTER_LABEL).unwrap();
        let (_, worker_recv) = session(&key, &w, &r, WORKER_LABEL).unwrap();
        let mut buf = Vec::new();
        for call in [1, 2] {
            let msg = ToWorker::Cancel { call };
            write(&mut buf, &msg, Some(&mut router_send)).await.unwrap();
        }
        let mut recv = worker_recv.clone();
        let mut r = &buf[..];
        let first: Option<ToWorker> = read(&mut r, Some(&mut recv)).await.ok().flatten();
        let second: Option<ToWorker> = read(&mut r, Some(&mut recv)).await.ok().flatten();
        assert!(matches!((first, second), (Some(ToWorker::Cancel { call: 1 }), Some(ToWorker::Cancel { call: 2 }))));
        // Replayed: the first message again, after it was read.
        let one = &buf[..buf.len() / 2];
        let again: io::Result<Option<ToWorker>> = read(&mut &one[..], Some(&mut recv)).await;
        assert!(again.is_err_and(|e| auth::is_forged(&e)));
        // Altered: `1` becomes `3`, still valid JSON.
        let mut altered = buf.clone();
        let at = 4 + altered[4..].iter().position(|&b| b == b'1').unwrap();
        altered[at] = b'3';
        let r: io::Result<Option<ToWorker>> = read(&mut &altered[..], Some(&mut worker_recv.clone())).await;
        assert!(r.is_err_and(|e| auth::is_forged(&e)));
        // Reflected: the router's own message, read back as if the worker sent it.
        let r: io::Result<Option<ToWorker>> = read(&mut &buf[..], Some(&mut router_recv)).await;
        assert!(r.is_err_and(|e| auth::is_forged(&e)));
        // Unsealed (a peer without the session) is refused too.
        let mut plain = Vec::new();
        write(&mut plain, &ToWorker::Ping, None).await.unwrap();
        plain.extend_from_slice(&[0; MAC_BYTES]);
        let r: io::Result<Option<ToWorker>> = read(&mut &plain[..], Some(&mut worker_recv.clone())).await;
        assert!(r.is_err_and(|e| auth::is_forged(&e)));
    }
}
