//! What a server on a network needs (issue 53): the API key, the deadline on a
//! request's body, the per-address connection cap, and work bounded before it starts
//! (`/tokenize`'s prompt length, a batch's prompt count).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{model, Script, Server, CONTEXT};
use pdserve_frontend::{Frontend, HttpLimits, Metrics};
use pdserve_testkit::http::{self, Reply};
use serde_json::json;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

const KEY: &str = "sk-test-0123456789";

fn frontend() -> Frontend {
    let m = model();
    let fake = Arc::new(common::Fake::new(Script::Reply("fine".into())));
    Frontend::new(fake, m.tokenizer.clone(), m.chat.clone(), m.name.clone(), CONTEXT, Metrics::new())
}

/// Serves `frontend` on a free loopback port under `limits`.
async fn start(frontend: Frontend, limits: HttpLimits) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(pdserve_frontend::serve_with(listener, frontend.router(), limits));
    addr
}

fn completion(headers: &[&str]) -> Vec<u8> {
    http::post_request("/v1/completions", &json!({"prompt": "Hello", "max_tokens": 4}).to_string(), headers)
}

fn get(path: &str, headers: &[&str]) -> Vec<u8> {
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    format!("GET {path} HTTP/1.1\r\nHost: test\r\n{extra}Connection: close\r\n\r\n").into_bytes()
}

#[tokio::test]
async fn an_api_key_guards_every_route_but_health_and_metrics() {
    let addr = start(frontend().with_api_key(Some(KEY)), HttpLimits::default()).await;
    let bearer = format!("Authorization: Bearer {KEY}");
    let x_api_key = format!("x-api-key: {KEY}");
    // No key, or a wrong one: 401 in OpenAI's error shape, on any route but two.
    for (request, what) in [
        (completion(&[]), "missing"),
        (completion(&["Authorization: Bearer sk-wrong"]), "invalid"),
        (completion(&[&format!("Authorization: Bearer {KEY}x")]), "invalid"),
        (completion(&["x-api-key: sk-wrong"]), "invalid"),
        (get("/v1/models", &[]), "missing"),
        (http::post_request("/tokenize", r#"{"prompt": "x"}"#, &[]), "missing"),
        (get("/no/such/route", &[]), "missing"),
    ] {
        let r = http::send(addr, &request).await;
        let e = r.error(401);
        assert_eq!((e["type"].as_str(), e["code"].as_str()), (Some("authentication_error"), Some("invalid_api_key")));
        assert!(e["message"].as_str().unwrap().contains(what), "{e}");
        assert!(!e.to_string().contains("sk-wrong"), "the key tried is not echoed: {e}");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        assert!(r.header("x-request-id").is_some());
    }
    // Anthropic's route refuses in Anthropic's shape.
    let r = http::send(addr, &http::post_request("/v1/messages", r#"{"max_tokens": 4, "messages": []}"#, &[])).await;
    assert_eq!(r.status, 401, "{}", r.text());
    let v = r.json();
    assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("authentication_error")), "{v}");
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    // The right key, in either header: served.
    for h in [&bearer, &x_api_key] {
        let r = http::send(addr, &completion(&[h])).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["choices"][0]["text"], "fine");
        assert_eq!(http::send(addr, &get("/v1/models", &[h])).await.status, 200);
    }
    // Probes and scrapers need none.
    for path in ["/health", "/metrics"] {
        let r = http::send(addr, &get(path, &[])).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
    // Every refusal is counted, so a key being guessed shows.
    let metrics = http::send(addr, &get("/metrics", &[])).await.text();
    assert!(metrics.contains("pdserve_requests_total{outcome=\"unauthorized\"} 8\n"), "{metrics}");
}

#[tokio::test]
async fn without_a_key_the_api_is_open() {
    let addr = start(frontend(), HttpLimits::default()).await;
    assert_eq!(http::send(addr, &completion(&[])).await.status, 200);
    assert_eq!(http::send(addr, &completion(&["Authorization: Bearer anything"])).await.status, 200);
}

/// A connection from `from` (any 127.x address works on loopback).
async fn connect_from(from: &str, addr: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(from.parse::<IpAddr>().unwrap(), 0)).unwrap();
    socket.connect(addr).await.unwrap()
}

async fn send_from(from: &str, addr: SocketAddr, request: &[u8]) -> Reply {
    let mut c = connect_from(from, addr).await;
    c.write_all(request).await.unwrap();
    let mut bytes = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), c.read_to_end(&mut bytes)).await.unwrap().unwrap();
    Reply::parse(&bytes)
}

/// Sends a completion's headers announcing 1000 bytes of body, then one byte every
/// 100 ms for `trickle` (a stalled body after that).
async fn trickler(addr: SocketAddr, trickle: Duration) -> TcpStream {
    let mut c = connect_from("127.0.0.1", addr).await;
    let head =
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{";
    c.write_all(head.as_bytes()).await.unwrap();
    let (rd, mut wr) = c.into_split();
    let until = Instant::now() + trickle;
    let writer = tokio::spawn(async move {
        while Instant::now() < until && wr.write_all(b" ").await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        wr
    });
    // Joined again once writing ends; reading goes on meanwhile through the caller.
    let wr = writer.await.unwrap();
    rd.reunite(wr).unwrap()
}

/// What the server said before closing (empty if it reset the connection).
async fn answer(mut c: TcpStream) -> Vec<u8> {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await.expect("the server closes") {
            Ok(0) | Err(_) => return bytes,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
        }
    }
}

fn short_limits(per_ip: usize) -> HttpLimits {
    HttpLimits {
        max_connections: 4,
        max_connections_per_ip: per_ip,
        header_timeout: Duration::from_secs(5),
        body_timeout: Duration::from_millis(600),
    }
}

#[tokio::test]
async fn a_trickled_body_gets_408_within_the_deadline_while_others_are_served() {
    let addr = start(frontend(), short_limits(4)).await;
    let started = Instant::now();
    // Two trickle then stall; all they sent is read, so the 408 arrives whole.
    let stalled = [
        tokio::spawn(trickler(addr, Duration::from_millis(300))),
        tokio::spawn(trickler(addr, Duration::from_millis(300))),
    ];
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Meanwhile another client is served.
    let r = http::send(addr, &completion(&[])).await;
    assert_eq!(r.status, 200, "{}", r.text());
    for t in stalled {
        let reply = Reply::parse(&answer(t.await.unwrap()).await);
        let e = reply.error(408);
        assert_eq!(e["code"], "request_timeout");
        assert_eq!(reply.header("connection"), Some("close"));
    }
    assert!(started.elapsed() < Duration::from_secs(4), "cut after {:?}", started.elapsed());
    // One that keeps trickling past the deadline is cut too (a 408, or a reset if
    // its last bytes were still unread when the server closed).
    let started = Instant::now();
    let bytes = answer(trickler(addr, Duration::from_secs(2)).await).await;
    if !bytes.is_empty() {
        Reply::parse(&bytes).error(408);
    }
    assert!(started.elapsed() < Duration::from_secs(4), "cut after {:?}", started.elapsed());
    assert_eq!(http::send(addr, &completion(&[])).await.status, 200);
}

#[tokio::test]
async fn one_address_cannot_take_every_connection() {
    let addr = start(frontend(), short_limits(2)).await;
    // Two connections from one address hold its share (half a request each)...
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = connect_from("127.0.0.1", addr).await;
        c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        held.push(c);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ...so a third from it gets a 429 at once...
    let r = send_from("127.0.0.1", addr, &get("/health", &[])).await;
    assert_eq!(r.error(429)["code"], "rate_limit_exceeded");
    assert_eq!(r.header("retry-after"), Some("1"));
    // ...while another address is served.
    let r = send_from("127.0.0.2", addr, &completion(&[])).await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Its share comes back as its connections close.
    drop(held);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(send_from("127.0.0.1", addr, &get("/health", &[])).await.status, 200);
}

#[tokio::test]
async fn tokenize_refuses_a_prompt_too_long_to_fit_before_tokenizing_it() {
    let s = Server::start(Script::Reply("fine".into())).await;
    // 3.9 MB of digits, under the body limit: refused by its length, as a completion's.
    let big = "1".repeat(3_900_000);
    let started = Instant::now();
    let body = json!({"prompt": big, "return_token_strs": true});
    let e = s.post_json("/tokenize", &body).await.error(400);
    assert_eq!(e["param"], "prompt");
    assert!(e["message"].as_str().unwrap().contains("bytes"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    let body = json!({"messages": [{"role": "user", "content": big}]});
    assert_eq!(s.post_json("/tokenize", &body).await.error(400)["param"], "messages");
    // A prompt that fits is tokenized as before.
    let v = s.post_json("/tokenize", &json!({"prompt": "Hello", "return_token_strs": true})).await.json();
    assert!(v["count"].as_u64().unwrap() >= 1 && v["token_strs"].is_array(), "{v}");
}

#[tokio::test]
async fn a_batch_over_the_prompt_count_is_refused_before_any_is_tokenized() {
    let s = Server::start(Script::Reply("fine".into())).await;
    // The last prompt is bad: were the batch tokenized first, that would be the error.
    let mut texts = vec!["Hello"; 128];
    texts.push("");
    let e = s.post_json("/v1/completions", &json!({"prompt": texts})).await.error(400);
    assert!(e["message"].as_str().unwrap().contains("at most 128 prompts"), "{e}");
    assert_eq!(e["param"], "prompt");
    let mut ids = vec![vec![1]; 128];
    ids.push(vec![-1]);
    let e = s.post_json("/v1/completions", &json!({"prompt": ids})).await.error(400);
    assert!(e["message"].as_str().unwrap().contains("at most 128 prompts"), "{e}");
    // 128 is allowed.
    let r = s.post_json("/v1/completions", &json!({"prompt": vec!["Hello"; 128], "max_tokens": 1})).await;
    assert_eq!(r.status, 200, "{}", r.text());
}
