//! The control protocol between a router and a worker process: one TCP connection,
//! length-prefixed JSON messages, calls multiplexed by [`CallId`]. KV never travels
//! here; it goes from the prefill process straight to the decode process's
//! [`KvAddr`].

use pdserve_protocol::{Event, GenerateRequest, ServeError};
use pdserve_types::{RequestId, Role, SamplingParams};
use pdserve_worker::{FirstToken, WorkerStats};
use serde::{Deserialize, Serialize};
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bumped on any incompatible change; both ends check it in the handshake.
pub const PROTOCOL_VERSION: u32 = 1;

/// A message larger than this is a broken or hostile peer, not a request.
const MAX_MESSAGE: usize = 64 << 20;

/// Numbers one call on one connection; its replies carry the same number.
pub type CallId = u64;

/// Where a decode worker receives KV frames.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvAddr {
    Tcp(SocketAddr),
    /// The Unix socket of a shared-memory receiver (same host only).
    Shm(PathBuf),
}

/// What a worker process says about itself when a router connects.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub protocol: u32,
    pub name: String,
    pub role: Role,
    /// The served model's name; a router refuses workers that disagree.
    pub model: String,
    /// Port of the TCP KV receiver (decode and mixed workers), on the control host.
    pub kv_tcp_port: Option<u16>,
    /// Socket of the shared-memory KV receiver (decode and mixed workers).
    pub kv_shm: Option<PathBuf>,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum ToWorker {
    Hello {
        protocol: u32,
    },
    /// Prefill and decode here; the call's events stream back.
    Generate {
        call: CallId,
        req: GenerateRequest,
    },
    /// Prefill here and send the KV to `to`; answered by [`FromWorker::Prefilled`]
    /// once every frame has reached the receiver.
    Prefill {
        call: CallId,
        req: GenerateRequest,
        to: KvAddr,
    },
    /// Reserve blocks for a transfer and start receiving its frames.
    Reserve {
        call: CallId,
        id: RequestId,
        prompt_len: usize,
    },
    /// Decode a transferred sequence; events after `first` stream back on `call`.
    FinishImport {
        call: CallId,
        id: RequestId,
        prompt: Vec<u32>,
        first: u32,
        params: SamplingParams,
    },
    AbortImport {
        id: RequestId,
    },
    /// The client of `call` left: stop its work.
    Cancel {
        call: CallId,
    },
    Stats {
        call: CallId,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum FromWorker {
    Hello(WorkerInfo),
    Event {
        call: CallId,
        event: Event,
    },
    /// `kv_bytes`: payload bytes the prefill sent, for metrics.
    Prefilled {
        call: CallId,
        result: Result<FirstToken, ServeError>,
        kv_bytes: u64,
    },
    Reserved {
        call: CallId,
        result: Result<(), ServeError>,
    },
    Stats {
        call: CallId,
        stats: Option<WorkerStats>,
    },
}

/// Writes one message: a big-endian u32 length, then JSON.
pub async fn write<W: AsyncWrite + Unpin, T: Serialize>(w: &mut W, msg: &T) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    w.write_u32(body.len() as u32).await?;
    w.write_all(&body).await?;
    w.flush().await
}

/// Reads one message; `Ok(None)` at a clean end of stream.
pub async fn read<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(r: &mut R) -> io::Result<Option<T>> {
    let len = match r.read_u32().await {
        Ok(n) => n as usize,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    };
    if len > MAX_MESSAGE {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("message of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    serde_json::from_slice(&body).map(Some).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}
