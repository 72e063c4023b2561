//! The roles as separate processes: `pdserve worker` ×2 behind `pdserve frontend`,
//! against `pdserve serve` in one process. Greedy tokens must not depend on where the
//! prefill ran or how its KV travelled (TCP, shared memory), and killing the prefill
//! process mid-prefill must not lose the request or leak a block.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const GOLDEN: &str = include_str!("../../engine/tests/golden/smollm2-135m-q4_1.json");

/// A child process killed when the test ends, however it ends.
struct Proc {
    child: Child,
    /// The address it printed ("listening on A" or "at http://A/v1").
    addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `pdserve ARGS` and waits for the line announcing its address.
fn start(args: &[&str]) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("process exited before announcing its address").unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split(',').next().unwrap().trim().parse().unwrap();
        }
        if let Some(rest) = line.split("at http://").nth(1) {
            break rest.split('/').next().unwrap().parse().unwrap();
        }
    };
    // Keep draining stderr so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Proc { child, addr }
}

fn worker(role: &str) -> Proc {
    start(&["worker", "--role", role, "--listen", "127.0.0.1:0", "--threads", "1", "--kv-blocks", "512"])
}

fn frontend(workers: &[&Proc], mode: &str, transport: &str) -> Proc {
    let list = workers.iter().map(|w| w.addr.to_string()).collect::<Vec<_>>().join(",");
    start(&["frontend", "--workers", &list, "--mode", mode, "--kv-transport", transport, "--port", "0"])
}

fn one_process() -> Proc {
    start(&["serve", "--mode", "aggregated", "--workers", "1", "--threads-per-worker", "1", "--port", "0"])
}

/// One HTTP/1.1 request; returns the status and the body.
fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).unwrap().parse().unwrap();
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

fn complete(addr: SocketAddr, prompt: &Value, max_tokens: u32) -> String {
    let req = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    let (status, body) = http(addr, "POST", "/v1/completions", Some(&req));
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

fn golden_prompts() -> Vec<Value> {
    let g: Value = serde_json::from_str(GOLDEN).unwrap();
    g["greedy"].as_array().unwrap().iter().map(|c| c["prompt_ids"].clone()).collect()
}

/// Sum of a metric's samples whose line contains `filter`.
fn metric(addr: SocketAddr, name: &str, filter: &str) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", None);
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits (the frontend refreshes block counts once a second) until no worker holds
/// a used block, and returns what is still used at the end.
fn settle_used_blocks(addr: SocketAddr) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    std::thread::sleep(Duration::from_millis(1200));
    loop {
        let used = metric(addr, "pdserve_kv_blocks{", "state=\"used\"");
        if used == 0.0 || Instant::now() > deadline {
            return used;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

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
