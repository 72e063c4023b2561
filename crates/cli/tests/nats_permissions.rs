//! The example NATS configuration, `deploy/nats/permissions.conf`, over a real
//! nats-server: a fleet whose worker, frontend (with the River) and planner each
//! connect as their own user works end to end, and the server refuses none of what
//! they do; the River client (`forest`) can write no plan, node record, KV event or
//! traffic sample, touch no bucket through the JetStream API, and read none of the
//! fleet's subjects or another user's replies; a worker cannot write the plan and a
//! frontend no node record. Each refusal is the server's (a permissions violation),
//! and its effect is absent: a watch of the bucket and subscribers with the rights
//! to read see nothing forged.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use async_nats::jetstream;
use common::{derived_profile, eventually, metric, nats_binary, start_with, Proc, TempDir};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CONF: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/nats/permissions.conf");
const USERS: [&str; 5] = ["worker", "frontend", "planner", "forest", "observer"];
/// The name the test's own clients give the server (its log names each client).
const TEST_CLIENT: &str = "permission-test";
/// What forged values carry, to be looked for where they must not arrive.
const FORGED: &str = "forged-by-a-test";

/// A nats-server on the example configuration, killed when dropped; its log kept.
struct Nats {
    child: Child,
    url: String,
    log: PathBuf,
    _dir: TempDir,
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Nats {
    fn start() -> Nats {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = std::env::temp_dir().join(format!("pdserve-nats-perm-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("nats.log");
        let child = Command::new(nats_binary())
            .args(["-c", CONF, "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(dir.join("data"))
            .envs(USERS.map(|u| (format!("PDSERVE_NATS_{}_PASSWORD", u.to_uppercase()), password(u))))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not start: {}", std::fs::read_to_string(&log).unwrap());
            std::thread::sleep(Duration::from_millis(50));
        }
        Nats { child, url: format!("nats://127.0.0.1:{port}"), log, _dir: TempDir(dir) }
    }

    /// The server's log lines that report a refused publish or subscription.
    fn violations(&self) -> Vec<String> {
        let log = std::fs::read_to_string(&self.log).unwrap();
        log.lines().filter(|l| l.contains("Violation")).map(String::from).collect()
    }
}

fn password(user: &str) -> String {
    format!("{user}-pw-{}", std::process::id())
}

/// What a pdserve process needs to connect as `user`.
fn env_of(user: &str) -> Vec<(String, String)> {
    vec![
        ("PDSERVE_NATS_USER".into(), user.into()),
        ("PDSERVE_NATS_PASSWORD".into(), password(user)),
        ("PDSERVE_NATS_INBOX_PREFIX".into(), format!("_INBOX_{user}")),
    ]
}

fn start_as(user: &str, args: &[&str]) -> Proc {
    let env = env_of(user);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    start_with(args, &env)
}

/// `pdserve ARGS` as `user`: its standard output, which must say it succeeded.
fn pdserve_as(user: &str, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve")).args(args).envs(env_of(user)).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A client connected as `user`, and the errors the server sent it.
async fn client_as(n: &Nats, user: &str) -> (async_nats::Client, Arc<Mutex<Vec<String>>>) {
    let errors = Arc::new(Mutex::new(Vec::new()));
    let kept = errors.clone();
    let client = async_nats::ConnectOptions::with_user_and_password(user.into(), password(user))
        .custom_inbox_prefix(format!("_INBOX_{user}"))
        .name(TEST_CLIENT)
        .event_callback(move |event| {
            let kept = kept.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    kept.lock().unwrap().push(e.to_string());
                }
            }
        })
        .connect(n.url.as_str())
        .await
        .unwrap();
    (client, errors)
}

/// Every message on `subject` from now on, as text.
async fn collect(client: &async_nats::Client, subject: &str) -> Arc<Mutex<Vec<String>>> {
    let got = Arc::new(Mutex::new(Vec::new()));
    let mut sub = client.subscribe(subject.to_string()).await.unwrap();
    client.flush().await.unwrap();
    let kept = got.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            kept.lock().unwrap().push(format!("{}: {}", m.subject, String::from_utf8_lossy(&m.payload)));
        }
    });
    got
}

/// Waits (bounded: a liveness check) until `cond` holds.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the server has told `errors`' client that it refused `what` on
/// `subject` (`Publish` or `Subscription`).
async fn refused(errors: &Arc<Mutex<Vec<String>>>, what: &str, subject: &str) {
    let needle = format!("{what} to \"{subject}\"").to_lowercase();
    let said = || errors.lock().unwrap().iter().any(|e| e.to_lowercase().contains(&needle));
    until(&format!("the server refuses {what} to {subject}"), said).await;
}

/// The fleet, each process as its own user: a simulated worker, a frontend that
/// also consumes the River, and a planner.
fn start_fleet(url: &str, profile: &str) -> [Proc; 3] {
    let worker = start_as(
        "worker",
        &[
            "worker",
            "--engine",
            "sim",
            "--profile",
            profile,
            "--role",
            "mixed",
            "--listen",
            "127.0.0.1:0",
            "--nats",
            url,
            "--node-id",
            "w1",
        ],
    );
    let fe = start_as(
        "frontend",
        &["frontend", "--nats", url, "--river", "--mode", "aggregated", "--policy", "kv-aware", "--port", "0"],
    );
    let planner = start_as(
        "planner",
        &[
            "planner",
            "--nats",
            url,
            "--id",
            "plan-a",
            "--metrics",
            "127.0.0.1:0",
            "--slo-ttft-ms",
            "3000",
            "--slo-tpot-ms",
            "50",
        ],
    );
    [worker, fe, planner]
}

/// A completion through the frontend at `fe`, which must succeed.
async fn complete(fe: std::net::SocketAddr, body: &str) {
    let reply =
        pdserve_testkit::http::send(fe, &pdserve_testkit::http::post_request("/v1/completions", body, &[])).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// The forest puts a request on the River and one on the Wind, and gets both
/// answers; the server refused it nothing.
async fn the_forest_is_served(n: &Nats, forest: &async_nats::Client, errors: &Arc<Mutex<Vec<String>>>) {
    let results = collect(forest, "infer.result.>").await;
    let js = jetstream::new(forest.clone());
    let river = json!({"prompt": "Hello", "max_tokens": 2, "nimsforest": {"request_id": "perm-river"}});
    let deadline = Instant::now() + Duration::from_secs(30);
    // The frontend makes the River stream once it consumes.
    while js.publish("river.infer.requests", river.to_string().into()).await.unwrap().await.is_err() {
        assert!(Instant::now() < deadline, "the River stream never came");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let data = json!({"request_id": "perm-wind", "prompt": "Hi", "max_tokens": 2});
    let leaf = pdserve_fleet::forest::Leaf::new("infer.request.submit", "forest:test", data);
    let answer = forest.request("infer.request.submit", leaf.to_bytes().into()).await.unwrap();
    let answer: Value = serde_json::from_slice(&answer.payload).unwrap();
    assert_eq!(answer, json!({"accepted": true, "request_id": "perm-wind"}));
    let answered = |id: &str| {
        let subject = format!("infer.result.{id}: ");
        results.lock().unwrap().iter().any(|m| m.starts_with(&subject) && m.contains("choices"))
    };
    until("the River request is answered", || answered("perm-river")).await;
    until("the Wind request is answered", || answered("perm-wind")).await;
    assert!(errors.lock().unwrap().is_empty(), "{:?}", errors.lock().unwrap());
    let refused_so_far = n.violations();
    assert!(refused_so_far.is_empty(), "the server refused the fleet something: {refused_so_far:#?}");
}

/// What readers with the rights to read see from now on: every write to the bucket,
/// the KV events and the traffic.
struct Watched {
    written: Arc<Mutex<Vec<String>>>,
    kv_events: Arc<Mutex<Vec<String>>>,
    traffic: Arc<Mutex<Vec<String>>>,
    bucket: jetstream::kv::Store,
}

async fn watch_the_fleet(n: &Nats, planner_user: &async_nats::Client) -> Watched {
    let (observer, _) = client_as(n, "observer").await;
    let bucket = jetstream::new(observer).get_key_value("INFER_LOAD").await.unwrap();
    let mut watch = bucket.watch_all().await.unwrap();
    let written = Arc::new(Mutex::new(Vec::<String>::new()));
    let kept = written.clone();
    tokio::spawn(async move {
        while let Some(Ok(e)) = watch.next().await {
            kept.lock().unwrap().push(format!("{}: {}", e.key, String::from_utf8_lossy(&e.value)));
        }
    });
    let (frontend_user, _) = client_as(n, "frontend").await;
    let kv_events = collect(&frontend_user, "pdserve.kv.>").await;
    let traffic = collect(planner_user, "pdserve.traffic").await;
    Watched { written, kv_events, traffic, bucket }
}

/// Subjects the forest may not write, and may not read.
const FOREST_WRITES: [&str; 8] = [
    "$KV.INFER_LOAD.planner",
    "$KV.INFER_LOAD.nodes.w1",
    "$KV.INFER_LOAD.nodes.forged",
    "pdserve.kv.w1",
    "pdserve.traffic",
    "$JS.API.STREAM.PURGE.KV_INFER_LOAD",
    "$JS.API.STREAM.DELETE.KV_INFER_LOAD",
    "$KV.INFER_REQ.req.perm-river",
];
const FOREST_READS: [&str; 5] =
    ["pdserve.kv.>", "pdserve.traffic", "$KV.INFER_LOAD.>", "_INBOX_frontend.>", "_INBOX.>"];

/// (b) The forest tries to write the fleet's subjects and read them, (c) a worker to
/// write the plan and a frontend a node record; the server refuses each. Answers
/// what the forest's subscriptions overheard.
async fn trespass(
    n: &Nats,
    forest: &async_nats::Client,
    forest_errors: &Arc<Mutex<Vec<String>>>,
) -> Vec<Arc<Mutex<Vec<String>>>> {
    let forged = json!({"body": FORGED, "mac": "AAAA"}).to_string();
    for subject in FOREST_WRITES {
        forest.publish(subject, forged.clone().into()).await.unwrap();
    }
    let mut overheard = Vec::new();
    for subject in FOREST_READS {
        overheard.push(collect(forest, subject).await);
    }
    let (worker_user, worker_errors) = client_as(n, "worker").await;
    worker_user.publish("$KV.INFER_LOAD.planner", forged.clone().into()).await.unwrap();
    worker_user.flush().await.unwrap();
    let (frontend_writer, frontend_errors) = client_as(n, "frontend").await;
    frontend_writer.publish("$KV.INFER_LOAD.nodes.forged", forged.clone().into()).await.unwrap();
    frontend_writer.flush().await.unwrap();
    for subject in FOREST_WRITES {
        refused(forest_errors, "Publish", subject).await;
    }
    for subject in FOREST_READS {
        refused(forest_errors, "Subscription", subject).await;
    }
    refused(&worker_errors, "Publish", "$KV.INFER_LOAD.planner").await;
    refused(&frontend_errors, "Publish", "$KV.INFER_LOAD.nodes.forged").await;
    overheard
}

/// What was allowed lands, the fleet's own writes keep coming, and nothing forged
/// reached a reader or the plan; the forest overheard nothing.
async fn nothing_forged_got_through(
    w: &Watched,
    overheard: &[Arc<Mutex<Vec<String>>>],
    fe: std::net::SocketAddr,
    body: &str,
) {
    let seen = |what: &Arc<Mutex<Vec<String>>>| what.lock().unwrap().len();
    let (writes, events, batches) = (seen(&w.written), seen(&w.kv_events), seen(&w.traffic));
    complete(fe, body).await;
    until("the fleet keeps writing its records, events and traffic", || {
        seen(&w.written) > writes + 2 && seen(&w.kv_events) > events && seen(&w.traffic) > batches
    })
    .await;
    for (what, got) in [("the bucket", &w.written), ("the KV events", &w.kv_events), ("the traffic", &w.traffic)] {
        let got = got.lock().unwrap();
        assert!(!got.iter().any(|m| m.contains(FORGED)), "a forged value reached {what}: {got:#?}");
    }
    for (subject, got) in FOREST_READS.iter().zip(overheard) {
        assert!(got.lock().unwrap().is_empty(), "the forest read {subject}: {:?}", got.lock().unwrap());
    }
    let plan = w.bucket.get("planner").await.unwrap().expect("the plan is still there");
    assert!(!String::from_utf8_lossy(&plan).contains(FORGED));
}

#[test]
fn a_fleet_of_least_privileged_users_works_and_a_river_client_cannot_touch_it() {
    let n = Nats::start();
    let dir = TempDir(std::env::temp_dir().join(format!("pdserve-nats-perm-sim-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let profile = dir.0.join("derived.json");
    derived_profile(&profile);
    let url = n.url.as_str();

    // (a) Each process as its own user.
    let [worker, fe, planner] = start_fleet(url, profile.to_str().unwrap());
    let prompt: Vec<u32> = (0..200u32).map(|t| 1000 + (t * 37) % 30000).collect();
    let req = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0});
    eventually("the frontend routes to the worker it found in the bucket", || {
        common::http(fe.addr, "POST", "/v1/completions", Some(&req)).0 == 200
    });
    eventually("the planner takes the lease", || planner.logged("took the planner lease"));
    eventually("the worker's KV events reach the frontend", || {
        metric(fe.addr, "pdserve_kv_index_pushed_events_total", "") > 0.0
    });
    let nodes = pdserve_as("observer", &["fleet", "--json", "--nats", url]);
    assert_eq!(nodes[0]["node_id"], "w1", "{nodes}");
    eventually("the observer reads the plan", || {
        pdserve_as("observer", &["fleet", "--plan", "--nats", url])["holder"] == "plan-a"
    });

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        // The planner's user hears the frontend's traffic.
        let (planner_user, _) = client_as(&n, "planner").await;
        let traffic = collect(&planner_user, "pdserve.traffic").await;
        let body = req.to_string();
        complete(fe.addr, &body).await;
        until("a traffic batch reaches the planner's user", || !traffic.lock().unwrap().is_empty()).await;
        let (forest, forest_errors) = client_as(&n, "forest").await;
        the_forest_is_served(&n, &forest, &forest_errors).await;
        let watched = watch_the_fleet(&n, &planner_user).await;
        let overheard = trespass(&n, &forest, &forest_errors).await;
        nothing_forged_got_through(&watched, &overheard, fe.addr, &body).await;
    });
    // The fleet still serves, and the refusals were all of the test's own making.
    assert_eq!(common::http(fe.addr, "POST", "/v1/completions", Some(&req)).0, 200);
    assert!(!worker.logged("panicked") && !fe.logged("panicked") && !planner.logged("panicked"));
    let theirs: Vec<String> =
        n.violations().into_iter().filter(|l| !l.contains(&format!(":rust:{TEST_CLIENT}\""))).collect();
    assert!(theirs.is_empty(), "the server refused the fleet something: {theirs:#?}");
}
