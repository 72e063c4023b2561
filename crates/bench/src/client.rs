//! The HTTP side: one streamed request → one [`RequestRecord`], never a panic or an
//! `Err` (a refused connection, a 500, a malformed chunk or an in-band error event are
//! all failed records with the reason).
//!
//! Each request opens its own HTTP/1.1 connection (as a new user would), so TTFT
//! includes the TCP connect — tens of microseconds on loopback. A chunk's time is
//! taken when its bytes are handed to the client, before any parsing.

use crate::openai::{clip, interpret, BodyOptions, StreamItem, Usage};
use crate::record::RequestRecord;
use crate::sse::SseParser;
use crate::target::Target;
use crate::workload::RequestSpec;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{header, Request, Response};
use hyper_util::rt::TokioIo;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Sends requests to one target.
#[derive(Clone, Debug)]
pub struct Client {
    pub target: Target,
    pub body: BodyOptions,
    /// Per request, from send to the end of the stream.
    pub timeout: Duration,
}

/// What the stream said, accumulated while reading it.
#[derive(Default)]
struct StreamState {
    chunk_times_s: Vec<f64>,
    /// When `[DONE]` arrived, from the send.
    done_at_s: Option<f64>,
    usage: Usage,
    done: bool,
    finished: bool,
    busy: Duration,
    /// Refused to shed load, with the `Retry-After` seconds.
    shed: Option<f64>,
    /// The ids generated, where the server returned them.
    reply_ids: Vec<u32>,
}

impl crate::runner::Server for Client {
    async fn send(&self, spec: &RequestSpec, origin: Instant, scheduled_s: Option<f64>) -> RequestRecord {
        self.send(spec, origin, scheduled_s).await
    }
}

impl Client {
    /// Sends one request; `origin` is the start of the sweep point.
    pub async fn send(&self, spec: &RequestSpec, origin: Instant, scheduled_s: Option<f64>) -> RequestRecord {
        let t = Instant::now();
        let payload = serde_json::to_vec(&self.body.body(spec)).unwrap_or_default();
        let mut p = StreamState { busy: t.elapsed(), ..StreamState::default() };
        let sent = Instant::now();
        let path = self.target.api_path(self.body.endpoint.path());
        let exchange = tokio::time::timeout(self.timeout, self.exchange(&path, payload, sent, &mut p)).await;
        let timed_out = exchange.is_err();
        let outcome = exchange.unwrap_or_else(|_| Err(format!("timed out after {:.0} s", self.timeout.as_secs_f64())));
        let e2e_s = p.done_at_s.unwrap_or_else(|| sent.elapsed().as_secs_f64());
        let t = Instant::now();
        let mut rec = RequestRecord {
            index: spec.index,
            start_s: sent.duration_since(origin).as_secs_f64(),
            scheduled_s,
            requested_output_tokens: spec.output_len,
            input_tokens: p.usage.prompt_tokens.unwrap_or(spec.prompt.len() as u64),
            output_tokens: p.usage.completion_tokens.unwrap_or(p.chunk_times_s.len() as u64),
            e2e_s,
            shed: p.shed,
            timed_out,
            ..RequestRecord::default()
        };
        match outcome.and_then(|()| complete(&p)) {
            Ok(()) => rec.ok = true,
            Err(e) => rec.error = Some(e),
        }
        rec.chunk_times_s = p.chunk_times_s;
        rec.reply_ids = p.reply_ids;
        rec.client_busy_s = (p.busy + t.elapsed()).as_secs_f64();
        rec.derive()
    }

    async fn exchange(&self, path: &str, payload: Vec<u8>, sent: Instant, p: &mut StreamState) -> Result<(), String> {
        let resp = self.post(path, payload).await?;
        let status = resp.status();
        if matches!(status.as_u16(), 429 | 503) {
            p.shed = Some(retry_after(resp.headers()));
        }
        let mut body = resp.into_body();
        if !status.is_success() {
            let text = read_text(&mut body).await;
            return Err(format!("HTTP {}: {}", status.as_u16(), clip(text.trim())));
        }
        let mut parser = SseParser::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("reading the stream: {e}"))?;
            let Some(data) = frame.data_ref() else { continue };
            let now = Instant::now();
            let at = now.duration_since(sent).as_secs_f64();
            let result = parser.feed(data).iter().try_for_each(|ev| on_item(p, interpret(ev), at));
            p.busy += now.elapsed();
            result?;
            if p.done {
                p.done_at_s = Some(at);
                // Read the body to its end so the server sees a completed response,
                // not a disconnect; a server that keeps it open gets a second.
                let drain = async { while let Some(Ok(_)) = body.frame().await {} };
                let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
                return Ok(());
            }
        }
        match parser.finish() {
            Some(ev) => on_item(p, interpret(&ev), sent.elapsed().as_secs_f64()),
            None => Ok(()),
        }
    }

    async fn post(&self, path: &str, payload: Vec<u8>) -> Result<Response<Incoming>, String> {
        let req = Request::post(path)
            .header(header::HOST, &self.target.authority)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "text/event-stream")
            .body(Full::new(Bytes::from(payload)))
            .map_err(|e| format!("building the request: {e}"))?;
        send(&self.target, req).await
    }
}

/// A `Retry-After` in seconds (0 when absent or a date).
fn retry_after(h: &hyper::HeaderMap) -> f64 {
    h.get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()?.trim().parse().ok()).unwrap_or(0.0)
}

/// Folds one stream item into the progress; an in-band error ends the request.
fn on_item(p: &mut StreamState, item: StreamItem, at: f64) -> Result<(), String> {
    match item {
        StreamItem::Done => p.done = true,
        StreamItem::Error(e) => return Err(e),
        StreamItem::Chunk { content, finished, usage, ids } => {
            if content {
                p.chunk_times_s.push(at);
            }
            p.reply_ids.extend(ids);
            p.finished |= finished;
            if let Some(u) = usage {
                p.usage = u;
            }
        }
    }
    Ok(())
}

/// A stream that just stopped (no `[DONE]`, no finish reason, no usage) was cut off.
fn complete(p: &StreamState) -> Result<(), String> {
    if p.done || p.finished || p.usage.completion_tokens.is_some() {
        Ok(())
    } else {
        Err("the stream ended without [DONE] or a finish reason".into())
    }
}

/// Opens a connection and sends one request on it.
async fn send(target: &Target, req: Request<Full<Bytes>>) -> Result<Response<Incoming>, String> {
    let stream = TcpStream::connect(target.addr).await.map_err(|e| format!("connect: {}", io_reason(&e)))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender.send_request(req).await.map_err(|e| format!("sending the request: {e}"))
}

/// A short lowercase reason for the usual socket errors ("connection refused").
fn io_reason(e: &std::io::Error) -> String {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::ConnectionRefused => "connection refused".into(),
        K::ConnectionReset => "connection reset".into(),
        K::TimedOut => "timed out".into(),
        K::AddrNotAvailable => "address not available".into(),
        _ => e.to_string(),
    }
}

/// At most 64 KiB of a response body as text (for error messages).
async fn read_text(body: &mut Incoming) -> String {
    let mut buf = Vec::new();
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(d) = frame.data_ref() {
            buf.extend_from_slice(d);
        }
        if buf.len() > 65_536 {
            break;
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// `GET path` → (status, body text). For `/health` and `/v1/models`.
pub async fn get(target: &Target, path: &str, timeout: Duration) -> Result<(u16, String), String> {
    let req = Request::get(path)
        .header(header::HOST, &target.authority)
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("building the request: {e}"))?;
    let fetch = async {
        let resp = send(target, req).await?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        Ok((status, read_text(&mut body).await))
    };
    tokio::time::timeout(timeout, fetch).await.unwrap_or_else(|_| Err("timed out".into()))
}

/// The first model a server lists, to put in the `model` field (vLLM requires it).
/// The server's Prometheus page, if it has one (pdserve's counters are read from it).
pub async fn metrics_page(target: &Target) -> Option<String> {
    let (status, page) = get(target, "/metrics", Duration::from_secs(5)).await.ok()?;
    (status == 200).then_some(page)
}

pub async fn first_model(target: &Target) -> Result<Option<String>, crate::error::BenchError> {
    let path = target.api_path("/models");
    let (status, body) = get(target, &path, Duration::from_secs(10)).await.map_err(|e| {
        let reason = e.strip_prefix("connect: ").unwrap_or(&e).to_string();
        crate::error::BenchError::Unreachable { url: target.url.clone(), reason }
    })?;
    if status != 200 {
        return Ok(None);
    }
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    Ok(v["data"][0]["id"].as_str().map(str::to_string))
}
