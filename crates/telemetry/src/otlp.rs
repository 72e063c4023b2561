//! Spans to an OpenTelemetry collector, over OTLP/HTTP with the JSON encoding
//! (`POST {endpoint}/v1/traces`). Installed only when an endpoint is given, so it
//! costs nothing otherwise.
//!
//! Every span carrying a `request_id` field gets a trace id derived from that id, and
//! its children inherit it: the spans one request leaves in the frontend, the prefill
//! worker and the decode worker land in the same trace without any trace context on
//! the wire. Spans queue in a bounded buffer and a background thread posts them every
//! second; when the collector is slow or away, spans are dropped, never requests.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// Spans buffered for export before new ones are dropped.
const BUFFER: usize = 4096;
/// Spans per request to the collector.
const BATCH: usize = 512;
const FLUSH_EVERY: Duration = Duration::from_secs(1);
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Where spans go: `http://host:port`, optionally with a path (default `/v1/traces`).
#[derive(Debug, Clone)]
pub struct Endpoint {
    host: String,
    addr: SocketAddr,
    path: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, String> {
        let rest =
            url.strip_prefix("http://").ok_or_else(|| format!("OTLP endpoint `{url}`: only http:// is supported"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let path = match path.trim_end_matches('/') {
            "" => "/v1/traces".to_string(),
            p => p.to_string(),
        };
        let with_port = if authority.contains(':') { authority.to_string() } else { format!("{authority}:4318") };
        let addr = with_port
            .to_socket_addrs()
            .map_err(|e| format!("OTLP endpoint `{url}`: {e}"))?
            .next()
            .ok_or_else(|| format!("OTLP endpoint `{url}` resolves to no address"))?;
        Ok(Endpoint { host: authority.to_string(), addr, path })
    }
}

/// A finished span, ready to encode.
struct Finished {
    trace: u128,
    id: u64,
    parent: Option<u64>,
    name: &'static str,
    start: u128,
    end: u128,
    attrs: Vec<(&'static str, String)>,
}

/// What a span keeps while open.
struct Open {
    trace: u128,
    id: u64,
    start: u128,
    attrs: Vec<(&'static str, String)>,
}

/// The layer: records spans, hands finished ones to the exporter thread.
pub struct OtlpLayer {
    tx: SyncSender<Finished>,
}

impl OtlpLayer {
    /// Starts the exporter thread for `endpoint`, reporting as `service`.
    pub fn new(endpoint: Endpoint, service: &str) -> std::io::Result<OtlpLayer> {
        let (tx, rx) = sync_channel(BUFFER);
        let service = service.to_string();
        std::thread::Builder::new().name("otlp-export".into()).spawn(move || export(rx, endpoint, service))?;
        Ok(OtlpLayer { tx })
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for OtlpLayer {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut fields = Fields(Vec::new());
        attrs.record(&mut fields);
        let inherited = span.parent().and_then(|p| p.extensions().get::<Open>().map(|o| o.trace));
        let own = fields.0.iter().find(|(k, _)| *k == "request_id").map(|(_, v)| trace_of(v));
        let trace = own.or(inherited).unwrap_or_else(random_trace);
        let open = Open { trace, id: span_id(), start: now_nanos(), attrs: fields.0 };
        span.extensions_mut().insert(open);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut fields = Fields(Vec::new());
        values.record(&mut fields);
        let mut ext = span.extensions_mut();
        if let Some(open) = ext.get_mut::<Open>() {
            open.attrs.extend(fields.0);
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let parent = span.parent().and_then(|p| p.extensions().get::<Open>().map(|o| o.id));
        let Some(open) = span.extensions_mut().remove::<Open>() else { return };
        let done = Finished {
            trace: open.trace,
            id: open.id,
            parent,
            name: span.name(),
            start: open.start,
            end: now_nanos(),
            attrs: open.attrs,
        };
        // A full buffer drops the span: tracing must never slow a request down.
        let _ = self.tx.try_send(done);
    }
}

struct Fields(Vec<(&'static str, String)>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name(), value.to_string()));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name(), format!("{value:?}")));
    }
}

/// The trace of a request: the same in every process that sees its id.
fn trace_of(request_id: &str) -> u128 {
    let half = |salt: u64| {
        let mut h = DefaultHasher::new();
        (salt, request_id).hash(&mut h);
        u128::from(h.finish())
    };
    (half(0x0f7e1) << 64) | half(0x5eed)
}

fn random_trace() -> u128 {
    let mut b = [0u8; 16];
    let _ = getrandom::fill(&mut b);
    u128::from_le_bytes(b).max(1)
}

fn span_id() -> u64 {
    getrandom::u64().unwrap_or_else(|_| now_nanos() as u64).max(1)
}

fn now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

/// The exporter thread: batches spans and posts them until the layer is gone.
fn export(rx: Receiver<Finished>, endpoint: Endpoint, service: String) {
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        let gone = match rx.recv_timeout(FLUSH_EVERY) {
            Ok(s) => {
                batch.push(s);
                continue_waiting(&rx, &mut batch);
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        if !batch.is_empty() {
            if let Err(e) = post(&endpoint, &encode(&service, &batch)) {
                // An event, not a span: it is logged, never exported itself.
                tracing::warn!(spans = batch.len(), collector = %endpoint.addr, error = %e, "could not export spans");
            }
            batch.clear();
        }
        if gone {
            return;
        }
    }
}

/// Gathers what arrives within the flush period, up to a batch.
fn continue_waiting(rx: &Receiver<Finished>, batch: &mut Vec<Finished>) {
    let until = std::time::Instant::now() + FLUSH_EVERY;
    while batch.len() < BATCH {
        let left = until.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(s) => batch.push(s),
            Err(_) => return,
        }
    }
}

/// The OTLP/JSON body of one export request.
fn encode(service: &str, spans: &[Finished]) -> String {
    let spans: Vec<serde_json::Value> = spans
        .iter()
        .map(|s| {
            let attrs: Vec<serde_json::Value> =
                s.attrs.iter().map(|(k, v)| serde_json::json!({"key": k, "value": {"stringValue": v}})).collect();
            let mut span = serde_json::json!({
                "traceId": format!("{:032x}", s.trace),
                "spanId": format!("{:016x}", s.id),
                "name": s.name,
                "kind": 1,
                "startTimeUnixNano": s.start.to_string(),
                "endTimeUnixNano": s.end.to_string(),
                "attributes": attrs,
            });
            if let Some(p) = s.parent {
                span["parentSpanId"] = format!("{p:016x}").into();
            }
            span
        })
        .collect();
    serde_json::json!({
        "resourceSpans": [{
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
            "scopeSpans": [{"scope": {"name": "pdserve"}, "spans": spans}],
        }]
    })
    .to_string()
}

/// One HTTP/1.1 POST; success is a 2xx status.
fn post(endpoint: &Endpoint, body: &str) -> std::io::Result<()> {
    let mut s = TcpStream::connect_timeout(&endpoint.addr, IO_TIMEOUT)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    write!(
        s,
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        endpoint.path,
        endpoint.host,
        body.len()
    )?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head)?;
    match &head[9..10] {
        b"2" => Ok(()),
        _ => Err(std::io::Error::other(format!("collector answered {}", String::from_utf8_lossy(&head[9..12])))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_default_to_the_traces_path_and_port() {
        let e = Endpoint::parse("http://127.0.0.1").unwrap();
        assert_eq!((e.addr.port(), e.path.as_str()), (4318, "/v1/traces"));
        let e = Endpoint::parse("http://127.0.0.1:9/custom/").unwrap();
        assert_eq!((e.addr.port(), e.path.as_str()), (9, "/custom"));
        assert!(Endpoint::parse("https://x").is_err());
    }

    #[test]
    fn a_request_has_one_trace_everywhere() {
        assert_eq!(trace_of("abc"), trace_of("abc"));
        assert_ne!(trace_of("abc"), trace_of("abd"));
    }

    #[test]
    fn the_body_is_otlp_json() {
        let s = Finished {
            trace: 1,
            id: 2,
            parent: Some(3),
            name: "request",
            start: 5,
            end: 9,
            attrs: vec![("request_id", "x".into())],
        };
        let v: serde_json::Value = serde_json::from_str(&encode("svc", &[s])).unwrap();
        let span = &v["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(span["traceId"], "00000000000000000000000000000001");
        assert_eq!(span["parentSpanId"], "0000000000000003");
        assert_eq!(span["attributes"][0]["value"]["stringValue"], "x");
    }
}
