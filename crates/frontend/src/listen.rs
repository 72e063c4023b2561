//! The HTTP listener, with the limits a server on a network needs: a cap on open
//! connections (past it, a 503 and the connection closes, so the process never runs
//! out of descriptors) and a smaller one per client address (past it, a 429, so one
//! source cannot take every slot); a deadline for a request's headers that also closes
//! idle keep-alive connections, and one for its whole body (a 408, and the connection
//! closes), so a client that sends half a request, or trickles one, holds nothing for
//! long. Little of an answer is buffered per connection, so a client that stops reading
//! a stream is felt upstream within a few hundred tokens and its sequence pauses (see
//! `pdserve_protocol::pace`).

use crate::errors::ApiError;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Sleep;

/// Bytes of an answer the kernel may hold for a client (it doubles this): fixed, not
/// grown by autotuning to megabytes, which would hide a stalled reader for thousands
/// of tokens. A token's SSE event is about 250 bytes.
const SEND_BUFFER: usize = 64 * 1024;
/// Bytes hyper buffers per connection, each way (headers must fit in it).
const HTTP_BUFFER: usize = 64 * 1024;

/// What one listener allows.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Open connections at most; more get a 503.
    pub max_connections: usize,
    /// Open connections from one client address at most (an IPv6 address by its /64,
    /// what one host is given); more get a 429.
    pub max_connections_per_ip: usize,
    /// A request's headers must arrive within this; an idle keep-alive connection is
    /// closed after it too.
    pub header_timeout: Duration,
    /// A request's whole body must arrive within this from the end of its headers;
    /// later, a 408 and the connection closes.
    pub body_timeout: Duration,
}

impl HttpLimits {
    /// `max` connections, a quarter of them from any one address: a few sources
    /// cannot take them all, while a busy client (or a proxy) still gets thousands.
    pub fn with_max_connections(max: usize) -> HttpLimits {
        HttpLimits {
            max_connections: max,
            max_connections_per_ip: (max / 4).max(1),
            header_timeout: Duration::from_secs(10),
            // A fixed bound rather than a minimum rate: simple, and it caps how long
            // any body holds a slot. 4 MB (the body limit) in 30 s is ~1.1 Mbit/s.
            body_timeout: Duration::from_secs(30),
        }
    }
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits::with_max_connections(4096)
    }
}

/// Serves `app` on `listener` under `limits` until the process ends.
pub async fn serve(listener: TcpListener, app: Router, limits: HttpLimits) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let clients = Clients { open: Arc::default(), cap: limits.max_connections_per_ip.max(1) };
    let within = limits.body_timeout;
    let app = app.layer(axum::middleware::from_fn(move |req, next| body_deadline(within, req, next)));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            // Out of descriptors, most likely: back off instead of spinning.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Some(held) = clients.hold(peer.ip()) else {
            tokio::spawn(refuse(stream, PER_CLIENT));
            continue;
        };
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                let app = app.clone();
                tokio::spawn(async move {
                    connection(stream, app, limits).await;
                    drop((slot, held));
                });
            }
            Err(_) => {
                tokio::spawn(refuse(stream, ALL));
            }
        }
    }
}

/// Open connections per client address.
struct Clients {
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
    cap: usize,
}

impl Clients {
    /// One more connection from `ip`, unless it has its share already.
    fn hold(&self, ip: IpAddr) -> Option<Held> {
        let key = client_of(ip);
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let n = open.entry(key).or_insert(0);
        if *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(Held { open: self.open.clone(), key })
    }
}

/// A connection counted against its client until dropped.
struct Held {
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
    key: IpAddr,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// The address a client is counted by: IPv4 as is (also when mapped into IPv6), IPv6
/// by its /64, since one host commonly holds a whole /64.
fn client_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        v4 => v4,
    }
}

/// Gives the request's body `within` to arrive whole; a late one is answered 408 (and
/// the connection closed) whatever the handler made of the cut body.
async fn body_deadline(within: Duration, req: Request, next: Next) -> Response {
    if req.body().is_end_stream() {
        return next.run(req).await;
    }
    let late = Arc::new(AtomicBool::new(false));
    let flag = late.clone();
    let req = req.map(|inner| Body::new(Deadline { inner, at: Box::pin(tokio::time::sleep(within)), late: flag }));
    let resp = next.run(req).await;
    match late.load(Ordering::Relaxed) {
        true => ApiError::BodyTimeout(within).into_response(),
        false => resp,
    }
}

/// A body that fails once its deadline passes before its end.
struct Deadline {
    inner: Body,
    at: Pin<Box<Sleep>>,
    late: Arc<AtomicBool>,
}

impl HttpBody for Deadline {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        if this.at.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        this.late.store(true, Ordering::Relaxed);
        Poll::Ready(Some(Err(axum::Error::new("the request body did not arrive in time"))))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

async fn connection(stream: TcpStream, app: Router, limits: HttpLimits) {
    let _ = socket2::SockRef::from(&stream).set_send_buffer_size(SEND_BUFFER);
    let service = TowerToHyperService::new(app);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).max_buf_size(HTTP_BUFFER);
    // Errors here are the client's (reset, timeout, garbage); nothing to do about them.
    let _ = http.serve_connection(TokioIo::new(stream), service).await;
}

/// The answer past the connection cap: status line and body.
type Refusal = (&'static str, &'static str);
const ALL: Refusal = (
    "503 Service Unavailable",
    r#"{"error":{"message":"too many connections","type":"server_error","param":null,"code":"service_unavailable"}}"#,
);
const PER_CLIENT: Refusal = (
    "429 Too Many Requests",
    r#"{"error":{"message":"too many connections from this address","type":"rate_limit_error","param":null,"code":"rate_limit_exceeded"}}"#,
);

/// Past a connection cap: one short answer, then close.
async fn refuse(mut stream: TcpStream, (status, body): Refusal) {
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    // Read what the client sent before answering, and let it read the answer before
    // closing: closing with unread bytes would reset the connection and lose the 503.
    let mut buf = [0u8; 8192];
    let _ = tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buf)).await;
    let answered = async {
        stream.write_all(reply.as_bytes()).await?;
        stream.shutdown().await?;
        while stream.read(&mut buf).await? > 0 {}
        Ok::<(), std::io::Error>(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), answered).await;
}
