//! `pdserve pull hf:ORG/REPO[:QUANT]` against a local server with the Hugging Face
//! Hub's URL layout and headers (the hub itself cannot be reached from here): the
//! file list at `/api/models/REPO/tree/main`, downloads at `/REPO/resolve/main/PATH`
//! redirected to a content address, ranges, and a gated repository. It serves the
//! real default model: pulled, resumed after a cut, checked against the listed
//! sha256, listed by `pdserve models`, then served by `--model hf:...` with the hub
//! out of reach.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use pdserve_engine::models::require_default_model;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

const TOKEN: &str = "hf_test_secret";

/// A repository's files: path → bytes.
type Repo = Vec<(String, Arc<Vec<u8>>)>;

/// What the fake hub saw and how it misbehaves.
#[derive(Default)]
struct Seen {
    /// `Range` headers of content requests, in order.
    ranges: Vec<String>,
    /// Cut the next full download after this many bytes.
    cut_after: Option<usize>,
}

struct FakeHub {
    addr: SocketAddr,
    seen: Arc<Mutex<Seen>>,
}

impl FakeHub {
    fn start(repos: HashMap<String, Repo>) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (repos, shared) = (Arc::new(repos), seen.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (repos, seen) = (repos.clone(), shared.clone());
                std::thread::spawn(move || serve(stream, &repos, &seen));
            }
        });
        FakeHub { addr, seen }
    }
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// One request: its path and headers (lower-cased names).
fn read_request(stream: &mut BufReader<TcpStream>) -> Option<(String, HashMap<String, String>)> {
    let mut line = String::new();
    stream.read_line(&mut line).ok()?;
    let path = line.split_whitespace().nth(1)?.to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        stream.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            return Some((path, headers));
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_lowercase(), v.trim().to_string());
        }
    }
}

fn reply(stream: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8]) {
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body);
}

/// The hub's answers: the tree listing, `resolve` redirected to `/cdn/SHA256`, and
/// the content with ranges; `gated` repositories want the token.
fn serve(stream: TcpStream, repos: &HashMap<String, Repo>, seen: &Mutex<Seen>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let Some((path, headers)) = read_request(&mut reader) else { return };
    let mut stream = stream;
    let authorized = headers.get("authorization").is_some_and(|a| a == &format!("Bearer {TOKEN}"));
    let owns = |r: &String| path.starts_with(&format!("/{r}/")) || path.starts_with(&format!("/api/models/{r}/"));
    if let Some(repo) = repos.keys().find(|r| owns(r)) {
        if repo.contains("gated") && !authorized {
            return reply(&mut stream, "401 Unauthorized", &[], b"{\"error\": \"Access to this repo is restricted\"}");
        }
        return repo_answer(&mut stream, &repos[repo], &path);
    }
    let blob = path.strip_prefix("/cdn/").and_then(|sha| repos.values().flatten().find(|(_, b)| sha256(b) == sha));
    match blob {
        Some((_, bytes)) => content(&mut stream, bytes, headers.get("range"), seen),
        None => reply(&mut stream, "404 Not Found", &[], b""),
    }
}

/// The listing, or a file's redirect to its content address, with the hub's headers.
fn repo_answer(stream: &mut TcpStream, files: &Repo, path: &str) {
    if path.starts_with("/api/models/") {
        let list: Vec<Value> = files
            .iter()
            .map(|(p, b)| {
                json!({"type": "file", "path": p, "size": b.len(), "oid": "0123abcd",
                       "lfs": {"oid": sha256(b), "size": b.len(), "pointerSize": 134}})
            })
            .collect();
        return reply(stream, "200 OK", &[("Content-Type", "application/json".into())], list_json(&list).as_bytes());
    }
    let file = path.split("/resolve/main/").nth(1).and_then(|f| files.iter().find(|(p, _)| p == f));
    let Some((_, bytes)) = file else { return reply(stream, "404 Not Found", &[], b"Entry not found") };
    let headers = [
        ("Location", format!("/cdn/{}", sha256(bytes))),
        ("X-Repo-Commit", "0123456789abcdef0123456789abcdef01234567".into()),
        ("X-Linked-Etag", format!("\"{}\"", sha256(bytes))),
        ("X-Linked-Size", bytes.len().to_string()),
    ];
    reply(stream, "302 Found", &headers, b"");
}

/// A file's bytes from the `Range` asked for, cut short once when told to.
fn content(stream: &mut TcpStream, bytes: &[u8], range: Option<&String>, seen: &Mutex<Seen>) {
    let from: usize = match range {
        Some(r) => {
            seen.lock().unwrap().ranges.push(r.clone());
            r.trim_start_matches("bytes=").trim_end_matches('-').parse().unwrap()
        }
        None => 0,
    };
    let body = &bytes[from..];
    let (status, extra) = match from {
        0 => ("200 OK", String::new()),
        _ => ("206 Partial Content", format!("Content-Range: bytes {from}-{}/{}\r\n", bytes.len() - 1, bytes.len())),
    };
    let cut = if from == 0 { seen.lock().unwrap().cut_after.take() } else { None };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nAccept-Ranges: bytes\r\nConnection: close\r\n{extra}\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes());
    // A connection lost midway: part of the body, then the socket closes.
    let _ = stream.write_all(&body[..cut.unwrap_or(body.len()).min(body.len())]);
}

fn list_json(list: &[Value]) -> String {
    Value::Array(list.to_vec()).to_string()
}

fn pdserve(args: &[&str], cache: &std::path::Path, hub: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(args)
        .env("PDSERVE_CACHE_DIR", cache)
        .env("HF_ENDPOINT", hub)
        .env("HF_TOKEN", TOKEN)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn a_hub_model_is_pulled_resumed_checked_listed_and_served() {
    let model = Arc::new(std::fs::read(require_default_model()).unwrap());
    let other = Arc::new(b"GGUF not really a model".to_vec());
    let shards: Vec<Arc<Vec<u8>>> = (0..2).map(|i| Arc::new(vec![i as u8 + 7; 4096])).collect();
    let repo: Repo = vec![
        ("README.md".into(), Arc::new(b"# smol".to_vec())),
        ("smol-Q4_1.gguf".into(), model.clone()),
        ("smol-Q8_0.gguf".into(), other),
        ("F16/smol-F16-00001-of-00002.gguf".into(), shards[0].clone()),
        ("F16/smol-F16-00002-of-00002.gguf".into(), shards[1].clone()),
    ];
    let gated: Repo = vec![("g-Q4_1.gguf".into(), Arc::new(b"gated bytes".to_vec()))];
    let hub =
        FakeHub::start(HashMap::from([("test-org/smol-GGUF".into(), repo), ("test-org/gated-GGUF".into(), gated)]));
    let url = format!("http://{}", hub.addr);
    let cache = common::TempDir(std::env::temp_dir().join(format!("pdserve-hub-{}", std::process::id())));
    let dir = cache.0.join("models/hf/test-org/smol-GGUF");

    // Cut after 30 MB: the pull fails, saying it can be resumed, and keeps its part.
    hub.seen.lock().unwrap().cut_after = Some(30_000_000);
    let cut = pdserve(&["pull", "hf:test-org/smol-GGUF:Q4_1"], &cache.0, &url);
    assert!(!cut.status.success(), "{}", text(&cut));
    assert!(text(&cut).contains("pull again"), "{}", text(&cut));
    let part = std::fs::metadata(dir.join("smol-Q4_1.gguf.part")).unwrap().len();
    assert_eq!(part, 30_000_000);

    // Again: resumed from there, checked, renamed.
    let pulled = pdserve(&["pull", "hf:test-org/smol-GGUF:Q4_1"], &cache.0, &url);
    assert!(pulled.status.success(), "{}", text(&pulled));
    assert_eq!(hub.seen.lock().unwrap().ranges, ["bytes=30000000-"]);
    let path = dir.join("smol-Q4_1.gguf");
    assert_eq!(String::from_utf8_lossy(&pulled.stdout).trim(), path.display().to_string());
    assert_eq!(sha256(&std::fs::read(&path).unwrap()), sha256(&model));
    assert!(!dir.join("smol-Q4_1.gguf.part").exists());

    // A split quant: every part.
    let split = pdserve(&["pull", "hf:test-org/smol-GGUF:F16"], &cache.0, &url);
    assert!(split.status.success(), "{}", text(&split));
    for (i, shard) in shards.iter().enumerate() {
        assert_eq!(&std::fs::read(dir.join(format!("F16/smol-F16-0000{}-of-00002.gguf", i + 1))).unwrap(), &**shard);
    }

    // Gated: the token opens it; without one, a clear refusal.
    assert!(pdserve(&["pull", "hf:test-org/gated-GGUF"], &cache.0, &url).status.success());
    let refused = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["pull", "hf:test-org/gated-GGUF:Q8_0"])
        .env("PDSERVE_CACHE_DIR", &cache.0)
        .env("HF_ENDPOINT", &url)
        .env_remove("HF_TOKEN")
        .output()
        .unwrap();
    assert!(text(&refused).contains("HF_TOKEN"), "{}", text(&refused));
    let missing = pdserve(&["pull", "hf:test-org/smol-GGUF:Q2_K"], &cache.0, &url);
    assert!(text(&missing).contains("no GGUF of quant Q2_K"), "{}", text(&missing));

    // Listed with its size under the name --model takes.
    let models = pdserve(&["models"], &cache.0, &url);
    let listing = String::from_utf8_lossy(&models.stdout);
    let mb = format!("{:.1} MB", model.len() as f64 / 1e6);
    assert!(listing.lines().any(|l| l.starts_with("hf:test-org/smol-GGUF:Q4_1 ") && l.contains(&mb)), "{listing}");
    assert!(
        listing.contains("hf:test-org/smol-GGUF:F16") && listing.contains("hf:test-org/gated-GGUF:Q4_1"),
        "{listing}"
    );

    // Served from the cache, the hub out of reach.
    let server = common::start_with(
        &["serve", "--model", "hf:test-org/smol-GGUF:Q4_1", "--mode", "aggregated", "--workers", "1", "--port", "0"],
        &[("PDSERVE_CACHE_DIR", cache.0.to_str().unwrap()), ("HF_ENDPOINT", "http://127.0.0.1:9")],
    );
    let said = common::complete(server.addr, &json!("The capital of France is"), 4);
    assert!(!said.is_empty());
}
