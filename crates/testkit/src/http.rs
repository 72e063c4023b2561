//! A raw HTTP/1.1 test client: requests written byte for byte (so tests can send
//! what no library would), responses parsed strictly (chunked bodies, SSE framing,
//! OpenAI error bodies). Async over tokio, or blocking for tests of whole processes.

use serde_json::Value;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a test waits for a whole response.
const PATIENCE: Duration = Duration::from_secs(120);

/// A `POST` of a JSON body, with extra header lines (`"Name: value"`).
pub fn post_request(path: &str, body: &str, headers: &[&str]) -> Vec<u8> {
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

pub fn get_request(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").into_bytes()
}

/// Sends raw bytes and reads the whole response (the server closes after it).
pub async fn send(addr: SocketAddr, request: &[u8]) -> Reply {
    let mut conn = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    conn.write_all(request).await.unwrap_or_else(|e| panic!("write to {addr}: {e}"));
    let mut bytes = Vec::new();
    match tokio::time::timeout(PATIENCE, conn.read_to_end(&mut bytes)).await {
        Ok(Ok(_)) => Reply::parse(&bytes),
        Ok(Err(e)) => panic!("reading from {addr}: {e}"),
        Err(_) => panic!("no whole response from {addr} within {PATIENCE:?}"),
    }
}

/// Writes `request` while reading the answer, for servers that answer before
/// reading the whole body (and may reset the connection once they have).
pub async fn send_eager(addr: SocketAddr, request: Vec<u8>) -> Reply {
    let conn = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let (mut rd, mut wr) = conn.into_split();
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&request).await;
        wr
    });
    let mut bytes = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let read = async {
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => bytes.extend_from_slice(&buf[..n]),
            }
        }
    };
    if tokio::time::timeout(PATIENCE, read).await.is_err() {
        panic!("no response from {addr} within {PATIENCE:?}");
    }
    writer.abort();
    Reply::parse(&bytes)
}

/// The blocking form of [`send`], for tests that drive other processes.
pub fn send_blocking(addr: SocketAddr, request: &[u8]) -> Reply {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let _ = s.set_read_timeout(Some(PATIENCE));
    s.write_all(request).unwrap_or_else(|e| panic!("write to {addr}: {e}"));
    let mut bytes = Vec::new();
    s.read_to_end(&mut bytes).unwrap_or_else(|e| panic!("reading from {addr}: {e}"));
    Reply::parse(&bytes)
}

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// Names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn parse(bytes: &[u8]) -> Reply {
        let split = bytes.windows(4).position(|w| w == b"\r\n\r\n").expect("end of headers");
        let head = std::str::from_utf8(&bytes[..split]).expect("UTF-8 headers");
        let mut lines = head.split("\r\n");
        let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).expect("status");
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let raw = &bytes[split + 4..];
        let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
        let body = if chunked { dechunk(raw) } else { raw.to_vec() };
        Reply { status, headers, body }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        self.json_of("")
    }

    /// The body as JSON, naming `context` (what was asked) if it is not.
    pub fn json_of(&self, context: impl std::fmt::Display) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{context}: not JSON ({e}): {}", self.text()))
    }

    /// Whether the body is a server-sent event stream.
    pub fn is_stream(&self) -> bool {
        self.header("content-type").is_some_and(|t| t.starts_with("text/event-stream"))
    }

    /// The `data:` payloads of an SSE body, checking the framing on the way.
    pub fn events(&self) -> Vec<String> {
        let text = self.text();
        assert!(text.ends_with("\n\n"), "SSE body must end with a blank line: {text:?}");
        text.trim_end_matches("\n\n")
            .split("\n\n")
            .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {e:?}")).to_string())
            .collect()
    }

    /// The named events of an SSE body (`event: NAME` then `data: {json}`), as
    /// Anthropic's and the Responses API's streams send them.
    pub fn named_events(&self) -> Vec<(String, Value)> {
        let text = self.text();
        assert!(text.ends_with("\n\n"), "SSE body must end with a blank line: {text:?}");
        let frame = |e: &str| {
            let (name, data) = e.split_once('\n').unwrap_or_else(|| panic!("not a named event: {e:?}"));
            let name = name.strip_prefix("event: ").unwrap_or_else(|| panic!("no event name: {e:?}"));
            let data = data.strip_prefix("data: ").unwrap_or_else(|| panic!("no data: {e:?}"));
            (name.to_string(), serde_json::from_str(data).unwrap_or_else(|err| panic!("{err}: {data}")))
        };
        text.trim_end_matches("\n\n").split("\n\n").map(frame).collect()
    }

    /// The JSON chunks of an SSE body; asserts it ends with `[DONE]`.
    pub fn chunks(&self) -> Vec<Value> {
        self.chunks_of("")
    }

    /// [`Reply::chunks`], naming `context` (what was asked) in a failure.
    pub fn chunks_of(&self, context: impl std::fmt::Display) -> Vec<Value> {
        let mut events = self.events();
        assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{context}: {}", self.text());
        events.iter().map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{context}: {err}: {e}"))).collect()
    }

    /// Asserts an OpenAI error body with this status; returns the `error` object.
    pub fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", self.text());
        let v = self.json();
        let e = v["error"].clone();
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
        e
    }
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else { return out };
        let size = std::str::from_utf8(&raw[..eol]).ok().and_then(|s| usize::from_str_radix(s.trim(), 16).ok());
        let Some(size) = size else { return out };
        raw = &raw[eol + 2..];
        if size == 0 || raw.len() < size {
            out.extend_from_slice(&raw[..size.min(raw.len())]);
            return out;
        }
        out.extend_from_slice(&raw[..size]);
        raw = raw.get(size + 2..).unwrap_or_default();
    }
}
