//! The roles as separate processes: `pdserve worker` ×2 behind `pdserve frontend`,
//! against `pdserve serve` in one process. Greedy tokens must not depend on where the
//! prefill ran or how its KV travelled (TCP, shared memory), killing the prefill
//! process mid-prefill must not lose the request or leak a block, and a client that
//! stops reading must not keep a sequence computing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{
    complete, frontend, golden_prompts, metric, one_process, settle_used_blocks, start, start_logging, worker,
};
use pdserve_testkit::http::{self, post_request};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[test]
fn greedy_tokens_match_across_processes_over_tcp_and_shm() {
    let prompts = golden_prompts();
    let reference = {
        let one = one_process();
        prompts.iter().map(|p| complete(one.addr, p, 32)).collect::<Vec<_>>()
    };
    let (p, d) = (worker("prefill"), worker("decode"));
    for transport in ["tcp", "shm"] {
        let fe = frontend(&[&p, &d], "disaggregated", transport);
        for (prompt, want) in prompts.iter().zip(&reference) {
            assert_eq!(&complete(fe.addr, prompt, 32), want, "{transport}: prompt {prompt}");
        }
        let remote = metric(fe.addr, "pdserve_prefill_route_total", "remote");
        assert_eq!(remote as usize, prompts.len(), "every prefill ran on the prefill process");
        assert!(metric(fe.addr, "pdserve_kv_transfer_bytes_total", transport) > 0.0);
        assert_eq!(settle_used_blocks(fe.addr), 0.0);
    }
}

#[test]
fn killing_the_prefill_process_mid_prefill_falls_back_without_leaks() {
    // A prompt long enough that its prefill is still running when the process dies.
    let prompt: Vec<u32> = (0..1800u32).map(|i| 1000 + (i * 7919) % 30000).collect();
    let prompt = json!(prompt);
    let want = complete(one_process().addr, &prompt, 16);
    let (mut p, d) = (worker("prefill"), worker("decode"));
    let fe = frontend(&[&p, &d], "disaggregated", "tcp");
    let addr = fe.addr;
    let request = std::thread::spawn(move || complete(addr, &prompt, 16));
    std::thread::sleep(Duration::from_millis(300));
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    assert_eq!(request.join().unwrap(), want, "the request survives with the same tokens");
    assert_eq!(settle_used_blocks(fe.addr), 0.0, "no block leaked on the decode worker");
    // With its prefill worker gone the frontend still serves, prefilling locally.
    let after = complete(fe.addr, &json!([504, 3575, 282, 4649, 314]), 4);
    assert!(!after.is_empty());
}

#[test]
fn a_client_leaving_mid_stream_cancels_on_the_worker_process() {
    let (p, d) = (worker("prefill"), worker("decode"));
    let fe = frontend(&[&p, &d], "disaggregated", "tcp");
    let req = json!({"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 2000, "ignore_eos": true, "stream": true});
    let mut s = TcpStream::connect(fe.addr).unwrap();
    let body = req.to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Read until a few tokens have streamed, then hang up.
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while seen.matches("data:").count() < 5 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    drop(s);
    assert_eq!(settle_used_blocks(fe.addr), 0.0, "the decode process kept the request's blocks");
}

/// A streamed completion from a client with a small receive buffer that reads nothing
/// yet: the server feels it stop within a few hundred tokens.
fn stalled_stream(addr: SocketAddr, max_tokens: u32) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    s.set_recv_buffer_size(4096).unwrap();
    s.connect(&addr.into()).unwrap();
    let mut s: TcpStream = s.into();
    let req = json!({"prompt": [504, 3575, 282], "max_tokens": max_tokens, "ignore_eos": true, "stream": true, "temperature": 0});
    s.write_all(&post_request("/v1/completions", &req.to_string(), &[])).unwrap();
    s
}

/// Reads a streamed answer to its end; its JSON chunks (checked to end with `[DONE]`).
fn read_stream(s: &mut TcpStream) -> Vec<Value> {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 65536];
    while !bytes.ends_with(b"\r\n0\r\n\r\n") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the connection closed mid-stream");
        bytes.extend_from_slice(&buf[..n]);
    }
    http::Reply::parse(&bytes).chunks()
}

fn stream_text(chunks: &[Value]) -> String {
    chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect()
}

/// Waits until the frontend reports `n` paused requests.
fn wait_paused(addr: SocketAddr, n: f64, within: Duration) {
    let deadline = Instant::now() + within;
    while metric(addr, "pdserve_paused_requests", "") != n {
        assert!(Instant::now() < deadline, "never {n} paused request(s)");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A client that stops reading pauses its sequence on the decode worker process while
/// others are served; once it reads again it gets the same text as a client that
/// never stalled. One that never reads again is cut off after
/// `--client-stall-seconds` with an error event and `[DONE]`, and nothing stays held.
#[test]
fn a_client_that_stops_reading_is_paused_then_resumed_or_cut_off() {
    let (p, d) = (worker("prefill"), worker("decode"));
    let list = format!("{},{}", p.addr, d.addr);
    let args = ["--mode", "disaggregated", "--kv-transport", "tcp", "--port", "0", "--client-stall-seconds", "15"];
    let fe = start(&[&["frontend", "--workers", &list][..], &args].concat());
    let expected = complete(fe.addr, &json!([504, 3575, 282]), 2000);

    let mut slow = stalled_stream(fe.addr, 2000);
    wait_paused(fe.addr, 1.0, Duration::from_secs(120));
    assert!(!complete(fe.addr, &json!([504, 3575]), 4).is_empty(), "others wait for a paused stream");
    let chunks = read_stream(&mut slow);
    assert_eq!(stream_text(&chunks), expected, "a resumed stream lost or changed tokens");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
    wait_paused(fe.addr, 0.0, Duration::from_secs(10));

    let mut gone = stalled_stream(fe.addr, 2000);
    wait_paused(fe.addr, 1.0, Duration::from_secs(120));
    wait_paused(fe.addr, 0.0, Duration::from_secs(60));
    assert_eq!(settle_used_blocks(fe.addr), 0.0, "a cut-off stream kept its blocks");
    let chunks = read_stream(&mut gone);
    let (last, tokens) = chunks.split_last().unwrap();
    assert_eq!(last["error"]["code"], "timeout", "{last}");
    assert!(expected.starts_with(&stream_text(tokens)), "the tokens before the cut differ");
    assert!(fe.logged("the client stopped reading"));
}

/// One request across three processes carries its id: the client's `X-Request-Id`
/// comes back on the response and appears in the frontend's, the prefill worker's and
/// the decode worker's log lines.
#[test]
fn a_request_id_is_logged_by_every_process_it_crosses() {
    let filter = "info,pdserve_remote=debug";
    let worker = |role: &str| {
        let args = ["worker", "--role", role, "--listen", "127.0.0.1:0", "--threads", "1", "--kv-blocks", "256"];
        start_logging(&args, filter)
    };
    let (p, d) = (worker("prefill"), worker("decode"));
    let list = format!("{},{}", p.addr, d.addr);
    let args = ["frontend", "--workers", &list, "--mode", "disaggregated", "--kv-transport", "tcp", "--port", "0"];
    let fe = start_logging(&args, filter);
    let id = "trace-me-8c1f";
    let body = json!({"prompt": "The capital of France is", "max_tokens": 4}).to_string();
    let reply =
        http::send_blocking(fe.addr, &post_request("/v1/completions", &body, &[&format!("X-Request-Id: {id}")]));
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-request-id"), Some(id));
    assert_eq!(reply.json()["id"], format!("cmpl-{id}"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(fe.logged(id) && p.logged(id) && d.logged(id)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for (who, proc) in [("frontend", &fe), ("prefill worker", &p), ("decode worker", &d)] {
        assert!(
            proc.logged(id),
            "{who} never logged {id}: {:?} {:?} {:?}",
            fe.log.lock().unwrap(),
            p.log.lock().unwrap(),
            d.log.lock().unwrap()
        );
    }
}

/// A collector on loopback: accepts OTLP/HTTP posts and keeps their JSON bodies.
fn otlp_receiver() -> (SocketAddr, Arc<Mutex<Vec<Value>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let kept = bodies.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut bytes = Vec::new();
            let mut buf = [0u8; 8192];
            let body = loop {
                let n = conn.read(&mut buf).unwrap_or(0);
                if n == 0 {
                    break None;
                }
                bytes.extend_from_slice(&buf[..n]);
                let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
                let head = String::from_utf8_lossy(&bytes[..end]).to_ascii_lowercase();
                assert!(head.starts_with("post /v1/traces "), "{head}");
                let len: usize =
                    head.split("content-length:").nth(1).unwrap().lines().next().unwrap().trim().parse().unwrap();
                if bytes.len() >= end + 4 + len {
                    break Some(bytes[end + 4..end + 4 + len].to_vec());
                }
            };
            let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
            if let Some(b) = body {
                kept.lock().unwrap().push(serde_json::from_slice(&b).unwrap());
            }
        }
    });
    (addr, bodies)
}

/// With `--otlp-endpoint`, the request's spans reach the collector started here,
/// in OTLP's JSON shape, carrying the request id.
#[test]
fn spans_reach_an_otlp_collector() {
    let (collector, bodies) = otlp_receiver();
    let endpoint = format!("http://{collector}");
    let args =
        ["serve", "--mode", "disaggregated", "--threads-per-worker", "1", "--port", "0", "--otlp-endpoint", &endpoint];
    let fe = start(&args);
    let id = "otlp-span-7e2";
    let body = json!({"prompt": "Hello", "max_tokens": 2}).to_string();
    let reply =
        http::send_blocking(fe.addr, &post_request("/v1/completions", &body, &[&format!("X-Request-Id: {id}")]));
    assert_eq!(reply.status, 200, "{}", reply.text());
    let deadline = Instant::now() + Duration::from_secs(10);
    let found = loop {
        let spans: Vec<Value> = bodies
            .lock()
            .unwrap()
            .iter()
            .flat_map(|b| b["resourceSpans"][0]["scopeSpans"][0]["spans"].as_array().cloned().unwrap_or_default())
            .collect();
        let request = spans.into_iter().find(|s| {
            s["name"] == "request"
                && s["attributes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|a| a["key"] == "request_id" && a["value"]["stringValue"] == id)
        });
        if request.is_some() || Instant::now() > deadline {
            break request;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let span = found.expect("the request's span reached the collector");
    assert_eq!(span["traceId"].as_str().unwrap().len(), 32);
    assert_eq!(span["spanId"].as_str().unwrap().len(), 16);
    let attrs = span["attributes"].as_array().unwrap();
    assert!(attrs.iter().any(|a| a["key"] == "route" && a["value"]["stringValue"] == "remote"), "{span}");
    let (start, end): (u128, u128) = (
        span["startTimeUnixNano"].as_str().unwrap().parse().unwrap(),
        span["endTimeUnixNano"].as_str().unwrap().parse().unwrap(),
    );
    assert!(start > 0 && end >= start);
}

/// How a client of [`clients_hanging_up_at_random_points_leave_no_block_held`] leaves.
#[derive(Clone, Copy, Debug)]
enum Leave {
    /// Reads the whole answer.
    AtTheEnd,
    /// Hangs up once the request is written.
    AtOnce,
    /// Hangs up after this many bytes of the answer.
    AfterBytes(usize),
    /// Hangs up after this many milliseconds, read or not.
    AfterMs(u64),
    /// Writes half the body, then hangs up.
    MidBody,
}

/// One request that leaves as `leave` says; a whole answer is checked to end well.
fn request_and_leave(addr: SocketAddr, body: &Value, leave: Leave) {
    let request = post_request("/v1/completions", &body.to_string(), &[]);
    let mut s = TcpStream::connect(addr).unwrap();
    let _ = s.set_read_timeout(Some(Duration::from_secs(120)));
    match leave {
        Leave::MidBody => return drop(s.write_all(&request[..request.len() - body.to_string().len() / 2])),
        _ => s.write_all(&request).unwrap(),
    }
    let (mut got, mut buf) = (Vec::new(), [0u8; 4096]);
    let started = Instant::now();
    loop {
        match leave {
            Leave::AtOnce => return,
            Leave::AfterBytes(n) if got.len() >= n => return,
            Leave::AfterMs(ms) if started.elapsed() >= Duration::from_millis(ms) => return,
            _ => {}
        }
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => panic!("{leave:?}: reading: {e}"),
        }
    }
    assert!(!got.is_empty(), "{leave:?}: the server closed without an answer to {body}");
    let reply = http::Reply::parse(&got);
    match leave {
        Leave::AtTheEnd if reply.status == 200 && reply.is_stream() => drop(reply.chunks_of(body)),
        Leave::AtTheEnd if reply.status == 200 => drop(reply.json_of(body)),
        Leave::AtTheEnd => drop(reply.error(reply.status)),
        // The answer ended before the client meant to leave.
        _ => {}
    }
}

/// Four clients send streamed and whole completions of random prompts to a
/// disaggregated pair of worker processes and hang up at random points: before the
/// body is whole, at once, mid-prefill, mid-handoff, mid-stream. Afterwards no
/// worker holds a used KV block, and a greedy request gives the text it gave before.
#[test]
fn clients_hanging_up_at_random_points_leave_no_block_held() {
    let (p, d) = (worker("prefill"), worker("decode"));
    let fe = frontend(&[&p, &d], "disaggregated", "tcp");
    let probe = json!([504, 3575, 282, 4649, 314]);
    let before = complete(fe.addr, &probe, 16);
    let clients: Vec<_> = (0..4u64)
        .map(|c| {
            let addr = fe.addr;
            std::thread::spawn(move || {
                let mut rng = pdserve_types::rng::Rng::new(0xc1_1e47 + c);
                for _ in 0..24 {
                    let len = rng.range(20, 300) as usize;
                    let prompt: Vec<u64> = (0..len).map(|_| rng.range(1000, 30_000)).collect();
                    let body = json!({"prompt": prompt, "max_tokens": rng.range(1, 48),
                                      "stream": rng.range(0, 2) == 1, "temperature": 0});
                    let leave = match rng.range(0, 5) {
                        0 => Leave::AtTheEnd,
                        1 => Leave::AtOnce,
                        2 => Leave::AfterBytes(rng.range(1, 3000) as usize),
                        3 => Leave::AfterMs(rng.range(0, 1500)),
                        _ => Leave::MidBody,
                    };
                    request_and_leave(addr, &body, leave);
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    assert_eq!(settle_used_blocks(fe.addr), 0.0, "a hung-up request kept its blocks");
    assert_eq!(complete(fe.addr, &probe, 16), before, "the same greedy text after the hang-ups");
}
