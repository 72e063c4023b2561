//! How servers start, wait and stop, as an operator sees it: flags that do not fit are
//! refused in one line; a frontend outlives its workers and reconnects; SIGTERM drains
//! (503 to newcomers, streams go on), the grace deadline ends streams with an error
//! event and `[DONE]`, a second signal stops at once, and the exit code says whether
//! requests were cut.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{complete, exit_code, start, Proc};
use pdserve_testkit::http::{self, post_request};
use serde_json::json;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Exit code of a server that cut requests at shutdown.
const CUT: i32 = 3;

fn kill(p: &Proc, signal: &str) {
    let ok = Command::new("kill").args([signal, &p.child.id().to_string()]).status().unwrap();
    assert!(ok.success());
}

fn status(addr: SocketAddr, path: &str) -> u16 {
    http::send_blocking(addr, &http::get_request(path)).status
}

/// A streamed completion that runs for a long time, read until a few chunks came.
fn long_stream(addr: SocketAddr) -> (TcpStream, Vec<u8>) {
    let body = json!({"prompt": [504, 3575, 282], "max_tokens": 3000, "ignore_eos": true, "stream": true}).to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&post_request("/v1/completions", &body, &[])).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen).matches("data:").count() < 5 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    (s, seen)
}

#[test]
fn flags_that_do_not_fit_the_mode_are_refused_in_one_line() {
    let cases: [&[&str]; 10] = [
        &["worker", "--role", "mixed", "--listen", "127.0.0.1:0"],
        &["serve", "--speculative", "ngram", "--spec-tokens", "0"],
        &["serve", "--speculative", "draft"],
        &["serve", "--speculative", "ngram", "--draft-model", "smollm2-135m"],
        &["serve", "--mode", "aggregated", "--prefill", "1"],
        &["serve", "--slo-tpot-ms", "20"],
        &["serve", "--protect-tpot", "--slo-tpot-ms", "0"],
        &["serve", "--mode", "disaggregated", "--workers", "2"],
        &["frontend", "--workers", "127.0.0.1:9", "--mode", "aggregated", "--kv-transport", "shm", "--insecure"],
        &["bench", "compare", "--peer-url", "http://127.0.0.1:9", "--topologies", "single"],
    ];
    for args in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_pdserve")).args(args).stderr(Stdio::piped()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("error: --") || err.starts_with("error: no cluster token"), "{args:?}: {err}");
    }
}

#[test]
fn a_frontend_outlives_its_workers_and_reconnects_when_one_comes_back() {
    let w = start(&["worker", "--role", "mixed", "--listen", "127.0.0.1:0", "--threads", "1", "--kv-blocks", "256"]);
    let addr = w.addr.to_string();
    let fe = start(&["frontend", "--workers", &addr, "--mode", "aggregated", "--port", "0", "--grace-seconds", "1"]);
    assert!(!complete(fe.addr, &json!([504, 3575, 282]), 4).is_empty());
    drop(w);
    // It used to shut itself down once its last worker was gone; it must keep serving
    // (503s), say what it waits for, and not exit.
    std::thread::sleep(Duration::from_secs(3));
    let mut fe = fe;
    assert!(fe.child.try_wait().unwrap().is_none(), "the frontend exited");
    assert_eq!(status(fe.addr, "/health"), 503);
    let body = json!({"prompt": "x", "max_tokens": 2}).to_string();
    assert_eq!(http::send_blocking(fe.addr, &post_request("/v1/completions", &body, &[])).status, 503);
    assert!(fe.logged("waiting for worker"), "{:?}", fe.log.lock().unwrap());
    // The worker comes back on its address: used again.
    let _w = start(&["worker", "--role", "mixed", "--listen", &addr, "--threads", "1", "--kv-blocks", "256"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while status(fe.addr, "/health") != 200 {
        assert!(Instant::now() < deadline, "never reconnected");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!complete(fe.addr, &json!([504, 3575, 282]), 4).is_empty());
}

#[test]
fn sigterm_drains_then_cuts_streams_cleanly_at_the_deadline() {
    let mut s = start(&["serve", "--mode", "aggregated", "--port", "0", "--grace-seconds", "2"]);
    let (mut stream, mut seen) = long_stream(s.addr);
    kill(&s, "-TERM");
    std::thread::sleep(Duration::from_millis(300));
    // Draining: connections are still accepted, and answered 503.
    assert_eq!(status(s.addr, "/health"), 503);
    let body = json!({"prompt": "x", "max_tokens": 2}).to_string();
    assert_eq!(http::send_blocking(s.addr, &post_request("/v1/completions", &body, &[])).status, 503);
    // The stream goes on, then ends with an error event and [DONE].
    let _ = stream.read_to_end(&mut seen);
    let mut events = http::Reply::parse(&seen).events();
    assert_eq!(events.pop().as_deref(), Some("[DONE]"), "the stream must end with [DONE]");
    let last = events.pop().unwrap();
    assert!(last.contains("\"error\"") && last.contains("shutting down"), "{last}");
    assert_eq!(exit_code(&mut s, Duration::from_secs(10)), Some(CUT), "requests were cut: exit {CUT}");
}

#[test]
fn a_second_signal_stops_at_once() {
    let mut s = start(&["serve", "--mode", "aggregated", "--port", "0", "--grace-seconds", "120"]);
    let (_stream, _) = long_stream(s.addr);
    kill(&s, "-TERM");
    std::thread::sleep(Duration::from_millis(300));
    assert!(s.child.try_wait().unwrap().is_none(), "still draining after one signal");
    kill(&s, "-INT");
    assert_eq!(exit_code(&mut s, Duration::from_secs(10)), Some(CUT));
}

/// A worker that stops answering (SIGSTOP) is taken out within seconds: requests go
/// to the other worker, `/health` stays up, its `pdserve_worker_up` turns 0 and its
/// block series go; once it answers again (SIGCONT) it is used again.
#[test]
fn a_hung_worker_is_detected_and_comes_back() {
    let args = |port: &str| {
        ["worker", "--role", "mixed", "--listen", port, "--threads", "1", "--kv-blocks", "256"].map(String::from)
    };
    let a = start(&args("127.0.0.1:0").iter().map(String::as_str).collect::<Vec<_>>());
    let b = start(&args("127.0.0.1:0").iter().map(String::as_str).collect::<Vec<_>>());
    let list = format!("{},{}", a.addr, b.addr);
    let fe = start(&["frontend", "--workers", &list, "--mode", "aggregated", "--port", "0"]);
    let name_a = format!("mixed@{}", a.addr);
    kill(&a, "-STOP");
    let deadline = Instant::now() + Duration::from_secs(10);
    let up = |v: u8| {
        common::http(fe.addr, "GET", "/metrics", None)
            .1
            .contains(&format!("pdserve_worker_up{{worker=\"{name_a}\"}} {v}"))
    };
    assert!(up(1), "the worker's up series");
    while !up(0) {
        assert!(Instant::now() < deadline, "the stopped worker was never taken out");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(fe.logged("lost a worker"));
    assert_eq!(status(fe.addr, "/health"), 200);
    for _ in 0..6 {
        assert!(!complete(fe.addr, &json!([504, 3575, 282]), 3).is_empty(), "a request went to the stopped worker");
    }
    std::thread::sleep(Duration::from_millis(1200));
    let (_, text) = common::http(fe.addr, "GET", "/metrics", None);
    assert!(!text.contains(&format!("pdserve_kv_blocks{{worker=\"{name_a}\"")), "stale block series");
    kill(&a, "-CONT");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !up(1) {
        assert!(Instant::now() < deadline, "the worker was not used again");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(b);
}

/// A worker keeps its socket files in `$TMPDIR/pdserve-<pid>`: a worker killed with
/// SIGKILL leaves its directory, the next pdserve process to start removes it, and a
/// worker that stops normally removes its own.
#[test]
fn socket_files_of_a_killed_worker_are_removed_by_the_next_start() {
    let tmp = std::env::temp_dir().join(format!("pdserve-sockets-test-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let env = [("TMPDIR", tmp.to_str().unwrap())];
    let args = ["worker", "--role", "decode", "--listen", "127.0.0.1:0", "--threads", "1", "--kv-blocks", "64"];
    let dir_of = |p: &Proc| tmp.join(format!("pdserve-{}", p.child.id()));
    let sockets = |p: &Proc| std::fs::read_dir(dir_of(p)).map(|d| d.count()).unwrap_or(0);

    let killed = common::start_with(&args, &env);
    assert_eq!(sockets(&killed), 1, "the worker's KV socket");
    kill(&killed, "-KILL");
    let left = dir_of(&killed);
    drop(killed);
    assert!(left.exists(), "SIGKILL cannot clean up");

    let mut next = common::start_with(&args, &env);
    assert!(!left.exists(), "the next start did not remove a dead process's sockets");
    assert_eq!(sockets(&next), 1);
    let own = dir_of(&next);
    kill(&next, "-TERM");
    // Generous: the other tests of this file load the model on the same cores.
    assert_eq!(exit_code(&mut next, Duration::from_secs(30)), Some(0), "SIGTERM: exit 0 (None: killed or hung)");
    assert!(!own.exists(), "a worker that stopped left its sockets");
    std::fs::remove_dir_all(&tmp).unwrap();
}
