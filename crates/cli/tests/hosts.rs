//! The fleet across hosts, with faults. Three "hosts" are Linux network namespaces on
//! one bridge, each with its own address and its own nats-server; the three servers
//! form one JetStream cluster and the fleet bucket keeps three copies. Workers are
//! spread over the hosts, one frontend serves them all. While a bounded load runs,
//! each fault in turn: a decode worker killed mid-stream, a prefill worker killed
//! mid-prefill, one NATS server killed, a slowed link, a host cut off for 10 s, and
//! a new host joining. After each, every request ended with its full greedy text or
//! a clear error, no worker holds a used KV block once idle, and the fleet view
//! matches the processes that run.
//!
//! Needs root (`ip netns`, veth, a bridge, `tc`): CI runs as root, as does this
//! project's development machine. This kernel has no `netem` queueing discipline, so
//! the slow link is a token bucket (`tbf`): a real kernel-enforced rate limit with
//! its queueing delay and tail drops, not netem's fixed delay and random loss.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::net::Net;
use common::{
    eventually, fleet_records, ip, metric, nats_binary, settle_used_blocks, start_in, try_fleet_records, Proc, TempDir,
};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tokens each streaming load request asks for (ignore_eos: exactly this many): a
/// stream lasts over a second, longer than a fleet record is old, so a worker its
/// record shows busy is still busy when killed.
const MAX_TOKENS: u32 = 120;

/// Prompt tokens of a prefill-heavy request: about a second of prefill on one
/// thread, so a prefill worker is busy most of the time and its record shows it.
const LONG_PROMPT: u64 = 1000;

/// One nats-server of the cluster, on its host.
struct NatsNode {
    child: Child,
    _dir: TempDir,
}

impl Drop for NatsNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nats_node(net: &Net, host: usize, cluster: usize) -> NatsNode {
    let addr_ip = net.ip(host);
    let dir = std::env::temp_dir().join(format!(
        "pdserve-{}-nats{host}-{}",
        net.tag,
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
    ));
    let routes: Vec<String> =
        (0..cluster).filter(|&h| h != host).map(|h| format!("nats://{}:6222", net.ip(h))).collect();
    let child = Command::new(ip())
        .args(["netns", "exec", net.ns(host), &nats_binary(), "-js", "-a", &addr_ip, "-p", "4222"])
        .args(["--server_name", &format!("n{host}"), "--cluster_name", "pdserve-test"])
        .args(["--cluster", &format!("nats://{addr_ip}:6222"), "--routes", &routes.join(","), "-sd"])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("{addr_ip}:4222").parse().unwrap();
    eventually("nats-server listens", || TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok());
    NatsNode { child, _dir: TempDir(dir) }
}

/// The cluster's URLs, this host's server first.
fn urls(net: &Net, first: usize) -> String {
    let mut hosts: Vec<usize> = (0..3).collect();
    hosts.sort_by_key(|&h| h != first);
    hosts.iter().map(|&h| format!("nats://{}:4222", net.ip(h))).collect::<Vec<_>>().join(",")
}

fn worker(net: &Net, host: usize, role: &str, id: &str) -> Proc {
    let listen = format!("{}:0", net.ip(host));
    let nats = urls(net, host.min(2));
    let args = ["worker", "--role", role, "--listen", &listen, "--threads", "1", "--kv-blocks", "512"];
    let fleet = ["--nats", &nats, "--nats-replicas", "3", "--node-id", id];
    start_in(net.ns(host), &[&args[..], &fleet[..]].concat())
}

/// What one load request came to.
#[derive(Debug, Clone)]
enum Outcome {
    /// The stream ended with `[DONE]`: its text.
    Done(String),
    /// A clear refusal or failure: an HTTP error status or an error event, with an
    /// OpenAI error body.
    Error(String),
    /// Anything else: a cut stream, a body that is not an error, no answer in time.
    Broken(String),
}

/// Streams one greedy completion; every way it can end is an [`Outcome`].
fn stream(addr: SocketAddr, prompt: &Value, max_tokens: u32) -> Outcome {
    let body =
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true})
            .to_string();
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else {
        return Outcome::Broken("cannot connect".into());
    };
    s.set_read_timeout(Some(Duration::from_secs(90))).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if s.write_all(head.as_bytes()).and_then(|()| s.write_all(body.as_bytes())).is_err() {
        return Outcome::Broken("cannot send".into());
    }
    let mut r = BufReader::new(s);
    let mut status = String::new();
    if r.read_line(&mut status).is_err() {
        return Outcome::Broken("no status line".into());
    }
    if !status.contains(" 200 ") {
        let mut rest = String::new();
        let _ = r.read_to_string(&mut rest);
        let body = rest.split("\r\n\r\n").nth(1).unwrap_or("");
        return match serde_json::from_str::<Value>(body)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(String::from))
        {
            Some(msg) => Outcome::Error(format!("{}: {msg}", status.trim())),
            None => Outcome::Broken(format!("{} with body {body:?}", status.trim())),
        };
    }
    let mut text = String::new();
    for line in r.lines() {
        let Ok(line) = line else { return Outcome::Broken(format!("stream cut after {text:?}")) };
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            return Outcome::Done(text);
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else { return Outcome::Broken(format!("bad event {data}")) };
        if let Some(msg) = v["error"]["message"].as_str() {
            return Outcome::Error(format!("error event: {msg}"));
        }
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
    }
    Outcome::Broken(format!("stream ended without [DONE] after {text:?}"))
}

/// What a load sends.
#[derive(Clone, Copy)]
enum Work {
    /// Four prompts of 300 tokens in turn, [`MAX_TOKENS`] each: decode-heavy, and
    /// served from the prefix cache once seen.
    Streams,
    /// A new prompt of [`LONG_PROMPT`] tokens every time (never a prefix-cache hit),
    /// eight tokens each: prefill-heavy.
    LongPrompts,
}

impl Work {
    /// Request `i` of the load: its prompt and token count.
    fn request(self, i: u64) -> (Value, u32) {
        let tokens =
            |n: u64, salt: u64| json!((0..n).map(|t| 1000 + (t * 37 + salt * 101) % 20_000).collect::<Vec<_>>());
        match self {
            Work::Streams => (tokens(300, i % 4), MAX_TOKENS),
            Work::LongPrompts => (tokens(LONG_PROMPT, 1000 + i), 8),
        }
    }
}

/// Each prompt's greedy text, asked of the fleet while no fault runs.
type Texts = BTreeMap<String, String>;

fn reference_texts(fe: SocketAddr, requests: impl IntoIterator<Item = (Value, u32)>) -> Texts {
    requests
        .into_iter()
        .map(|(prompt, max_tokens)| match stream(fe, &prompt, max_tokens) {
            Outcome::Done(t) => (prompt.to_string(), t),
            other => panic!("reference run: {other:?}"),
        })
        .collect()
}

/// A closed-loop load of `clients` streams of `work` until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Vec<(Value, u32, Outcome)>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(addr: SocketAddr, clients: u64, work: Work) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..clients)
            .map(|c| {
                let (stop, outcomes) = (stop.clone(), outcomes.clone());
                std::thread::spawn(move || {
                    let mut i = c;
                    while !stop.load(Ordering::SeqCst) {
                        let (prompt, max_tokens) = work.request(i);
                        let o = stream(addr, &prompt, max_tokens);
                        outcomes.lock().unwrap().push((prompt, max_tokens, o));
                        i += clients;
                    }
                })
            })
            .collect();
        Load { stop, outcomes, threads }
    }

    fn finished(&self) -> usize {
        self.outcomes.lock().unwrap().len()
    }

    /// Stops issuing, waits for the requests in flight, and returns every outcome.
    fn stop(self) -> Vec<(Value, u32, Outcome)> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            t.join().unwrap();
        }
        Arc::try_unwrap(self.outcomes).unwrap().into_inner().unwrap()
    }
}

/// Every outcome is the prompt's greedy text or a clear error; returns the errors.
fn check(fault: &str, outcomes: &[(Value, u32, Outcome)], want: &Texts) -> usize {
    assert!(!outcomes.is_empty(), "{fault}: no request finished");
    let mut errors = 0;
    for (p, _, o) in outcomes {
        match o {
            Outcome::Done(text) => {
                assert_eq!(Some(text), want.get(&p.to_string()), "{fault}: a prompt lost or repeated tokens")
            }
            Outcome::Error(e) => {
                eprintln!("{fault}: a request ended with a clear error: {e}");
                errors += 1;
            }
            Outcome::Broken(why) => panic!("{fault}: a request ended unclearly: {why}"),
        }
    }
    eprintln!(
        "{fault}: {} requests, {} with their full text, {errors} clear errors",
        outcomes.len(),
        outcomes.len() - errors
    );
    errors
}

/// Runs the load until `n` more requests have finished (bounded).
fn wait_for_requests(load: &Load, n: usize) {
    let target = load.finished() + n;
    let deadline = Instant::now() + Duration::from_secs(120);
    while load.finished() < target {
        assert!(Instant::now() < deadline, "the load stalled");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The node ids in the fleet view, read through the NATS cluster at `url`; none
/// while the read fails (said on stderr: a cluster that lost a server answers again
/// once JetStream has a leader for the bucket).
fn fleet_ids(url: &str) -> Option<BTreeSet<String>> {
    match try_fleet_records(url) {
        Ok(recs) => Some(recs.iter().map(|r| r["node_id"].as_str().unwrap().to_string()).collect()),
        Err(e) => {
            eprintln!("pdserve fleet failed: {}", e.trim());
            None
        }
    }
}

/// Once the load is stopped: nothing is held on any worker, and the fleet view is
/// exactly `expected`.
fn settled(fault: &str, fe: SocketAddr, url: &str, expected: &[&str]) {
    let used = settle_used_blocks(fe);
    if used != 0.0 {
        // Which worker holds them, as the frontend and the fleet records see it.
        let (_, m) = common::http(fe, "GET", "/metrics", None);
        let series: Vec<&str> =
            m.lines().filter(|l| l.starts_with("pdserve_kv_blocks{") && l.contains("used")).collect();
        let nodes: Vec<String> = try_fleet_records(url)
            .unwrap_or_default()
            .iter()
            .map(|r| format!("{}: {} used", r["node_id"], r["kv_cache"]["blocks_used"]))
            .collect();
        eprintln!("{fault}: used blocks per worker: {series:#?}\nfleet records: {nodes:?}");
    }
    assert_eq!(used, 0.0, "{fault}: KV blocks still used once idle");
    let want: BTreeSet<String> = expected.iter().map(|s| s.to_string()).collect();
    eventually(&format!("{fault}: the fleet view is {want:?}"), || fleet_ids(url).as_ref() == Some(&want));
    eventually(&format!("{fault}: the frontend uses {} workers", expected.len()), || {
        metric(fe, "pdserve_worker_up", "") == expected.len() as f64
    });
}

/// The node among `ids` whose record, written in the last 300 ms, says it is busy
/// (`load.field` above 0): a sequence that started a while ago is still running.
fn busy_node(url: &str, ids: &[&str], field: &str) -> Option<String> {
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    try_fleet_records(url)
        .unwrap_or_default()
        .into_iter()
        .filter(|r| ids.iter().any(|id| r["node_id"] == *id))
        .filter(|r| r["updated_unix_ms"].as_u64().is_some_and(|t| now_ms.saturating_sub(t) < 300))
        .find(|r| r["load"][field].as_u64() > Some(0))
        .map(|r| r["node_id"].as_str().unwrap().to_string())
}

/// One process fault under load: of `pair` (node id, host), the worker of `role`
/// whose fresh record shows it busy (a running sequence for decode, a queued prompt
/// for prefill) is killed with `kill -9`; every request must end with its greedy
/// text (asked for once the fault is over where `want` lacks it), the rest settle,
/// and the worker is started again on its host. Decode faults run [`Work::Streams`],
/// prefill faults [`Work::LongPrompts`]. Returns the one killed.
fn kill_busy_and_restart(
    net: &Net,
    procs: &mut BTreeMap<&'static str, Proc>,
    fe: SocketAddr,
    url: &str,
    want: &Texts,
    role: &str,
    pair: [(&'static str, usize); 2],
) -> &'static str {
    let fault = format!("kill -9 {role}");
    let (field, work) =
        if role == "decode" { ("running", Work::Streams) } else { ("queued_prompt_tokens", Work::LongPrompts) };
    let load = Load::start(fe, 2, work);
    wait_for_requests(&load, 1);
    let mut busy = None;
    eventually(&format!("a {role} worker reports {field}"), || {
        busy = busy_node(url, &[pair[0].0, pair[1].0], field);
        busy.is_some()
    });
    let (victim, host) = if busy.as_deref() == Some(pair[0].0) { pair[0] } else { pair[1] };
    let mut p = procs.remove(victim).unwrap();
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    wait_for_requests(&load, 4);
    let out = load.stop();
    let survivors: Vec<&str> = procs.keys().copied().collect();
    settled(&fault, fe, url, &survivors);
    let unknown = out.iter().filter(|(p, ..)| !want.contains_key(&p.to_string()));
    let mut want = want.clone();
    want.extend(reference_texts(fe, unknown.map(|(p, n, _)| (p.clone(), *n)).collect::<Vec<_>>()));
    assert_eq!(check(&fault, &out, &want), 0, "{fault}: a request failed instead of moving or retrying");
    procs.insert(victim, worker(net, host, role, victim));
    let all: Vec<&str> = procs.keys().copied().collect();
    settled(&format!("{role} back"), fe, url, &all);
    victim
}

/// [`kill_busy_and_restart`] until a kill lands on a request in flight, which the
/// frontend's migration counter shows: a record that showed the worker busy may be up
/// to 300 ms old, and its work may have ended since. Each attempt is checked alike.
fn kill_mid_flight(
    net: &Net,
    procs: &mut BTreeMap<&'static str, Proc>,
    fe: SocketAddr,
    url: &str,
    want: &Texts,
    role: &str,
    pair: [(&'static str, usize); 2],
) {
    let reason = if role == "decode" { "reason=\"worker_lost\"" } else { "reason=\"prefill_failed\"" };
    let moved = || metric(fe, "pdserve_requests_migrated_total", reason);
    let before = moved();
    for attempt in 1..=5 {
        let victim = kill_busy_and_restart(net, procs, fe, url, want, role, pair);
        if moved() > before {
            return;
        }
        eprintln!("kill -9 {role}: attempt {attempt} found {victim} idle; again");
    }
    panic!("kill -9 {role}: no kill landed on a request in flight in 5 attempts");
}

#[test]
fn a_fleet_of_three_hosts_rides_out_process_nats_and_network_faults() {
    let mut net = Net::new(3);
    let mut nats: Vec<Option<NatsNode>> = (0..3).map(|h| Some(nats_node(&net, h, 3))).collect();
    let url = urls(&net, 0);
    // Host 0: the frontend and a prefill worker; host 1: a decode worker; host 2: a
    // decode and a prefill worker.
    let mut procs: BTreeMap<&'static str, Proc> = BTreeMap::new();
    procs.insert("p0", worker(&net, 0, "prefill", "p0"));
    procs.insert("d1", worker(&net, 1, "decode", "d1"));
    procs.insert("d2", worker(&net, 2, "decode", "d2"));
    procs.insert("p2", worker(&net, 2, "prefill", "p2"));
    let fe = frontend(&net, &url);
    let all = ["d1", "d2", "p0", "p2"];
    settled("start", fe.addr, &url, &all);
    let rec = fleet_records(&url);
    eprintln!("fleet at start: {}", serde_json::to_string(&rec).unwrap());
    // The reference: each prompt's greedy text, with no fault.
    let want = reference_texts(fe.addr, (0..4).map(|i| Work::Streams.request(i)));

    // 1. A decode worker killed mid-stream: its request moves, the text is whole.
    kill_mid_flight(&net, &mut procs, fe.addr, &url, &want, "decode", [("d1", 1), ("d2", 2)]);

    // 2. A prefill worker killed mid-prefill: the handoff starts over on the other.
    kill_mid_flight(&net, &mut procs, fe.addr, &url, &want, "prefill", [("p0", 0), ("p2", 2)]);

    // 3. One NATS server killed (host 1's): requests in flight finish, new ones are
    // served, the fleet view holds through the other two servers.
    let load = Load::start(fe.addr, 2, Work::Streams);
    wait_for_requests(&load, 1);
    drop(nats[1].take());
    wait_for_requests(&load, 4);
    let out = load.stop();
    assert_eq!(check("kill one NATS server", &out, &want), 0, "losing one NATS server fails nothing");
    settled("kill one NATS server", fe.addr, &url, &all);
    nats[1] = Some(nats_node(&net, 1, 3));

    // 4. Host 2's link throttled: everything still completes.
    let load = Load::start(fe.addr, 2, Work::Streams);
    wait_for_requests(&load, 1);
    net.throttle(2, true);
    wait_for_requests(&load, 4);
    net.throttle(2, false);
    let out = load.stop();
    assert_eq!(check("throttled link", &out, &want), 0, "a slow link fails nothing");
    settled("throttled link", fe.addr, &url, &all);

    // 5. Host 2 cut off for 10 s: what was routed there fails over or ends with a
    // clear error; the host rejoins.
    let load = Load::start(fe.addr, 2, Work::Streams);
    wait_for_requests(&load, 1);
    net.cable(2, false);
    std::thread::sleep(Duration::from_secs(10));
    net.cable(2, true);
    wait_for_requests(&load, 4);
    let out = load.stop();
    check("host cut off for 10 s", &out, &want);
    settled("host cut off for 10 s", fe.addr, &url, &all);

    // 6. A new host joins under load: it is used.
    a_new_host_is_used(&mut net, &mut procs, &fe, &url, &want);
    settled("new host", fe.addr, &url, &["d1", "d2", "d3", "p0", "p2"]);
    drop(procs);
    drop(fe);
}

/// The frontend on host 0: disaggregated, KV over TCP, NATS with three replicas.
fn frontend(net: &Net, url: &str) -> Proc {
    let fe_host = net.ip(0);
    let args = ["frontend", "--nats", url, "--nats-replicas", "3", "--mode", "disaggregated", "--kv-transport", "tcp"];
    start_in(net.ns(0), &[&args[..], &["--host", &fe_host, "--port", "0"]].concat())
}

/// A decode worker on a new host, started under load, serves a sequence and fails
/// nothing. Three clients: with two, the least-loaded policy could keep finding a
/// free worker that joined earlier.
fn a_new_host_is_used(net: &mut Net, procs: &mut BTreeMap<&'static str, Proc>, fe: &Proc, url: &str, want: &Texts) {
    let load = Load::start(fe.addr, 3, Work::Streams);
    wait_for_requests(&load, 1);
    let h3 = net.add_host();
    procs.insert("d3", worker(net, h3, "decode", "d3"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !try_fleet_records(url).unwrap_or_default().iter().any(|r| {
        r["node_id"] == "d3"
            && (r["load"]["running"].as_u64() > Some(0) || r["kv_cache"]["blocks_cached"].as_u64() > Some(0))
    }) {
        if Instant::now() > deadline {
            let (_, m) = common::http(fe.addr, "GET", "/metrics", None);
            let m: Vec<&str> = m.lines().filter(|l| l.contains("worker_up") || l.contains("kv_blocks")).collect();
            eprintln!("records: {}", serde_json::to_string(&fleet_records(url)).unwrap());
            eprintln!("frontend: {m:#?}\nlog: {:#?}", fe.log.lock().unwrap().iter().rev().take(15).collect::<Vec<_>>());
            panic!("the new host's worker never served a sequence");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = load.stop();
    assert_eq!(check("new host", &out, want), 0, "a joining host fails nothing");
}
