//! What the process tests share: `pdserve` children killed when a test ends, their
//! logs, and one-line HTTP helpers.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use pdserve_testkit::http::{self, post_request};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A cluster token for this test binary's workers and frontends.
pub fn token_file() -> &'static str {
    static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("pdserve-test-token-{}", std::process::id()));
        let token: String =
            (0..32).map(|i| char::from(b'a' + ((std::process::id() as usize * 7 + i * 13) % 26) as u8)).collect();
        // For its owner alone, as a token should be (pdserve warns otherwise).
        let _ = std::fs::remove_file(&path);
        let mut f = std::fs::File::options().write(true).create_new(true).mode(0o600).open(&path).unwrap();
        std::io::Write::write_all(&mut f, token.as_bytes()).unwrap();
        path.to_string_lossy().into_owned()
    })
}

pub mod net;

const GOLDEN: &str = include_str!("../../../engine/tests/golden/smollm2-135m-q4_1.json");

/// A child process killed when the test ends, however it ends.
pub struct Proc {
    pub child: Child,
    /// The address it printed ("listening on A" or "at http://A/v1").
    pub addr: SocketAddr,
    /// Everything it logged so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    pub fn logged(&self, needle: &str) -> bool {
        self.log_count(needle) > 0
    }

    /// How many of its log lines hold `needle`.
    pub fn log_count(&self, needle: &str) -> usize {
        self.log.lock().unwrap().iter().filter(|l| l.contains(needle)).count()
    }

    /// Its log lines that hold `needle`.
    pub fn lines(&self, needle: &str) -> Vec<String> {
        self.log.lock().unwrap().iter().filter(|l| l.contains(needle)).cloned().collect()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `pdserve ARGS` and waits for the line announcing its address.
pub fn start(args: &[&str]) -> Proc {
    start_logging(args, "info")
}

/// [`start`] with `RUST_LOG=filter`; every line the process logs is kept.
pub fn start_logging(args: &[&str], filter: &str) -> Proc {
    start_with(args, &[("RUST_LOG", filter)])
}

/// [`start`] with these environment variables set.
pub fn start_with(args: &[&str], env: &[(&str, &str)]) -> Proc {
    spawn_announced(Command::new(env!("CARGO_BIN_EXE_pdserve")), args, env)
}

/// [`start`] inside network namespace `ns` (`ip netns exec`, which becomes the
/// process: killing the child kills pdserve).
pub fn start_in(ns: &str, args: &[&str]) -> Proc {
    let mut cmd = Command::new(ip());
    cmd.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_pdserve")]);
    spawn_announced(cmd, args, &[])
}

/// iproute2's `ip`, also where root's PATH lacks `/usr/sbin`.
pub fn ip() -> &'static str {
    system_tool("ip")
}

/// A system tool by absolute path where one of the usual directories has it.
pub fn system_tool(name: &'static str) -> &'static str {
    ["/usr/sbin/", "/sbin/", "/usr/bin/", "/bin/"]
        .iter()
        .map(|dir| format!("{dir}{name}"))
        .find(|p| std::path::Path::new(p).exists())
        .map_or(name, |p| Box::leak(p.into_boxed_str()))
}

/// Runs `cmd ARGS` (a pdserve command line) and waits for its address.
pub fn spawn_announced(mut cmd: Command, args: &[&str], env: &[(&str, &str)]) -> Proc {
    // Workers and frontends share the tests' cluster token.
    let token = ["--cluster-token-file", token_file()];
    let secured = matches!(args.first(), Some(&"worker" | &"frontend" | &"planner"));
    let mut child = cmd
        .args(args)
        .args(if secured { &token[..] } else { &[] })
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let log = Arc::new(Mutex::new(Vec::new()));
    let addr = loop {
        let line = lines.next().expect("process exited before announcing its address").unwrap();
        log.lock().unwrap().push(line.clone());
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split(',').next().unwrap().trim().parse().unwrap();
        }
        if let Some(rest) = line.split("at http://").nth(1) {
            break rest.split('/').next().unwrap().parse().unwrap();
        }
    };
    // Keep draining stderr so the child never blocks on a full pipe.
    let kept = log.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            kept.lock().unwrap().push(line);
        }
    });
    Proc { child, addr, log }
}

/// A profile derived for tests: SmolLM2's shape, costs of the order measured here.
pub fn derived_profile(path: &std::path::Path) {
    let p = json!({
        "schema": 1,
        "provenance": {"kind": "derived", "sources": ["this test"], "assumptions": ["costs of the order measured here"]},
        "model": {"name": "SmolLM2-135M-Instruct.Q4_1.gguf", "vocab_size": 49152, "context_length": 8192,
                  "n_layers": 30, "kv_bytes_per_token": 23040.0, "kv_blocks": 256, "hidden": 576,
                  "weight_bytes": 100_000_000u64},
        "shapes": [{"threads": 1, "step": {"fixed_s": 0.003, "token_s": 0.0008, "pair_s": 7e-7,
                    "decode_pair_s": 2e-6, "logits_s": 0.0004}, "points": []}],
        "links": [{"transport": "tcp", "latency_s": 7e-5, "bytes_per_s": 3e9}],
        "switch_s": 1e-6, "admission_s": 5e-4
    });
    std::fs::write(path, p.to_string()).unwrap();
}

pub fn worker(role: &str) -> Proc {
    worker_with(role, &[])
}

/// [`worker`] with more flags.
pub fn worker_with(role: &str, extra: &[&str]) -> Proc {
    let args = ["worker", "--role", role, "--listen", "127.0.0.1:0", "--threads", "1", "--kv-blocks", "512"];
    start(&[&args[..], extra].concat())
}

pub fn frontend(workers: &[&Proc], mode: &str, transport: &str) -> Proc {
    let list = workers.iter().map(|w| w.addr.to_string()).collect::<Vec<_>>().join(",");
    start(&["frontend", "--workers", &list, "--mode", mode, "--kv-transport", transport, "--port", "0"])
}

pub fn one_process() -> Proc {
    start(&["serve", "--mode", "aggregated", "--workers", "1", "--threads-per-worker", "1", "--port", "0"])
}

/// One HTTP/1.1 request; returns the status and the body.
pub fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let request = match (method, body) {
        ("POST", Some(b)) => post_request(path, &b.to_string(), &[]),
        _ => http::get_request(path),
    };
    let reply = http::send_blocking(addr, &request);
    (reply.status, reply.text())
}

pub fn complete(addr: SocketAddr, prompt: &Value, max_tokens: u32) -> String {
    let req = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    let (status, body) = http(addr, "POST", "/v1/completions", Some(&req));
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

pub fn golden_prompts() -> Vec<Value> {
    let g: Value = serde_json::from_str(GOLDEN).unwrap();
    g["greedy"].as_array().unwrap().iter().map(|c| c["prompt_ids"].clone()).collect()
}

/// Waits (bounded: a liveness check, not a timing claim) until `cond` holds.
pub fn eventually(what: &str, cond: impl FnMut() -> bool) {
    eventually_or(what, cond, String::new)
}

/// [`eventually`], and if it never holds, the failure says what `state` finds then.
pub fn eventually_or(what: &str, mut cond: impl FnMut() -> bool, state: impl FnOnce() -> String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        if Instant::now() >= deadline {
            panic!("never happened: {what}\n{}", state());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The nats-server the tests run: `PDSERVE_NATS_SERVER`, else the one
/// `scripts/nats.sh install` put in the target directory.
pub fn nats_binary() -> String {
    if let Ok(path) = std::env::var("PDSERVE_NATS_SERVER") {
        return path;
    }
    let local = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/nats-venv/bin/nats-server");
    assert!(
        std::path::Path::new(local).exists(),
        "no nats-server: run `scripts/nats.sh install` (scripts/test.sh does) or set PDSERVE_NATS_SERVER"
    );
    local.to_string()
}

/// A nats-server with JetStream on a free port, killed when dropped.
pub struct Nats {
    child: Child,
    pub url: String,
    _dir: TempDir,
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub fn nats() -> Nats {
    nats_with(&[])
}

/// A nats-server started with these extra flags (e.g. to require a password).
pub fn nats_with(extra: &[&str]) -> Nats {
    nats_on(free_port(), extra)
}

/// A nats-server on `port` (to bring one back where it was).
pub fn nats_on(port: u16, extra: &[&str]) -> Nats {
    let dir = std::env::temp_dir().join(format!("pdserve-nats-{}-{port}", std::process::id()));
    let child = Command::new(nats_binary())
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(&dir)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nats-server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Nats { child, url: format!("nats://127.0.0.1:{port}"), _dir: TempDir(dir) }
}

/// A directory removed when dropped.
pub struct TempDir(pub std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `pdserve fleet --json --nats URL`: the node records.
pub fn fleet_records(url: &str) -> Vec<Value> {
    try_fleet_records(url).unwrap()
}

/// `pdserve fleet --plan --nats URL`: the fleet planner's plan (`null` if none).
pub fn plan_of(url: &str) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve")).args(["fleet", "--plan", "--nats", url]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// [`fleet_records`], or the command's error.
pub fn try_fleet_records(url: &str) -> Result<Vec<Value>, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve")).args(["fleet", "--json", "--nats", url]).output().unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(serde_json::from_slice::<Value>(&out.stdout).unwrap().as_array().unwrap().clone())
}

/// Sum of a metric's samples whose line contains `filter`.
pub fn metric(addr: SocketAddr, name: &str, filter: &str) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", None);
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits (the frontend refreshes block counts once a second) until no worker holds
/// a used block, and returns what is still used at the end.
pub fn settle_used_blocks(addr: SocketAddr) -> f64 {
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

/// Waits for the process to exit; its exit code.
pub fn exit_code(p: &mut Proc, within: Duration) -> Option<i32> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(status) = p.child.try_wait().unwrap() {
            return status.code();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}
