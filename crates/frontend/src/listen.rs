//! The HTTP listener, with the limits a server on a network needs: a cap on open
//! connections (past it, a 503 and the connection closes, so the process never runs
//! out of descriptors), and a deadline for a request's headers that also closes idle
//! keep-alive connections (a client that opens connections and sends half a request
//! holds nothing for long). Little of an answer is buffered per connection, so a
//! client that stops reading a stream is felt upstream within a few hundred tokens and
//! its sequence pauses (see `pdserve_protocol::pace`).

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

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
    /// A request's headers must arrive within this; an idle keep-alive connection is
    /// closed after it too.
    pub header_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits { max_connections: 4096, header_timeout: Duration::from_secs(10) }
    }
}

/// Serves `app` on `listener` under `limits` until the process ends.
pub async fn serve(listener: TcpListener, app: Router, limits: HttpLimits) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(c) => c,
            // Out of descriptors, most likely: back off instead of spinning.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                let app = app.clone();
                tokio::spawn(async move {
                    connection(stream, app, limits).await;
                    drop(slot);
                });
            }
            Err(_) => {
                tokio::spawn(refuse(stream));
            }
        }
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

/// Past the connection cap: one short 503, then close.
async fn refuse(mut stream: TcpStream) {
    let body = r#"{"error":{"message":"too many connections","type":"server_error","param":null,"code":"service_unavailable"}}"#;
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
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
