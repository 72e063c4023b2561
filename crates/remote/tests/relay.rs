//! A relay between a router and a worker, run as an attacker on the path would run
//! one: it passes the handshake through untouched, so both ends are satisfied, then
//! injects or alters messages. Every message after the handshake carries a MAC under
//! a key derived from the cluster token and both nonces, so the side that reads a
//! meddled message closes the connection instead of acting on it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_kv_transfer::ClusterKey;
use pdserve_protocol::{Event, GenerateRequest, ServeError, TokenStream, Worker};
use pdserve_remote::control::{FromWorker, Op, ToWorker, MAC_BYTES};
use pdserve_remote::{ConnectError, RemoteWorker, WorkerServer};
use pdserve_testkit::FakeWorker;
use pdserve_types::{RequestId, Role, SamplingParams};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What follows each message past the handshake's unsealed ones (the worker's
/// `Challenge`, the router's `Hello`): its MAC.
const TRAILER: usize = MAC_BYTES;

/// The call id of what the relay slips in.
const INJECTED: u64 = 987_654;

#[derive(Clone, Copy, PartialEq)]
enum Meddle {
    /// After the router's first sealed message, a generate call of the relay's own,
    /// framed as the router frames its calls (with the best MAC it has: zeros).
    InjectCall,
    /// One digit of the first call's prompt changed: still valid JSON.
    AlterCall,
    /// When the router's first call passes, a reply to it of the relay's own.
    InjectReply,
    /// The worker's name in its `Hello` (the worker's first sealed message) changed.
    AlterHello,
}

fn request(prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        id: RequestId(7),
        tag: "relayed".into(),
        prompt,
        params: SamplingParams { max_tokens: 4, ..Default::default() }.validate().unwrap(),
        fence: None,
        trace: Default::default(),
    }
}

/// One message as the wire has it: `len u32 (big-endian) | JSON | trailer`.
fn framed(json: &[u8], trailer: &[u8]) -> Vec<u8> {
    let mut out = (json.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(json);
    out.extend_from_slice(trailer);
    out
}

/// Reads one message: its JSON and the `trailer` bytes after it.
async fn read_message(r: &mut (impl AsyncRead + Unpin), trailer: usize) -> Option<(Vec<u8>, Vec<u8>)> {
    let len = r.read_u32().await.ok()? as usize;
    let mut json = vec![0u8; len];
    r.read_exact(&mut json).await.ok()?;
    let mut tail = vec![0u8; trailer];
    r.read_exact(&mut tail).await.ok()?;
    Some((json, tail))
}

/// A served fake worker and a relay in front of it: the address to connect to, the
/// worker, and the JSON of every message the worker sent through the relay.
async fn worker_behind_relay(key: &ClusterKey, meddle: Meddle) -> (SocketAddr, FakeWorker, Arc<Mutex<Vec<String>>>) {
    let fake = FakeWorker::new("relayed", Role::Mixed, 64);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let to = listener.local_addr().unwrap();
    let served: Arc<dyn Worker> = Arc::new(fake.clone());
    tokio::spawn(WorkerServer::new(served, key.clone()).serve(listener, std::future::pending()));

    let relay = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let via = relay.local_addr().unwrap();
    let from_worker = Arc::new(Mutex::new(Vec::new()));
    let seen = from_worker.clone();
    tokio::spawn(async move {
        let (router, _) = relay.accept().await.unwrap();
        let (router_rd, router_wr) = router.into_split();
        let (worker_rd, worker_wr) = TcpStream::connect(to).await.unwrap().into_split();
        let router_wr = Arc::new(tokio::sync::Mutex::new(router_wr));
        tokio::spawn(to_router(worker_rd, router_wr.clone(), meddle, seen));
        to_worker(router_rd, worker_wr, router_wr, meddle).await;
    });
    (via, fake, from_worker)
}

type RouterWrite = Arc<tokio::sync::Mutex<tokio::net::tcp::OwnedWriteHalf>>;

/// Worker → router: passed through, each message noted in `seen`.
async fn to_router(
    mut worker_rd: tokio::net::tcp::OwnedReadHalf,
    back: RouterWrite,
    meddle: Meddle,
    seen: Arc<Mutex<Vec<String>>>,
) {
    let mut trailer = 0;
    while let Some((mut json, tail)) = read_message(&mut worker_rd, trailer).await {
        if meddle == Meddle::AlterHello && json.starts_with(b"{\"Hello\"") {
            let at = json.windows(7).position(|w| w == b"relayed").unwrap();
            json[at] = b'R';
        }
        trailer = TRAILER;
        seen.lock().unwrap().push(String::from_utf8_lossy(&json).into_owned());
        if back.lock().await.write_all(&framed(&json, &tail)).await.is_err() {
            break;
        }
    }
    let _ = back.lock().await.shutdown().await;
}

/// Router → worker: passed through, but for the meddling (once).
async fn to_worker(
    mut router_rd: tokio::net::tcp::OwnedReadHalf,
    mut worker_wr: tokio::net::tcp::OwnedWriteHalf,
    router_wr: RouterWrite,
    meddle: Meddle,
) {
    let (mut trailer, mut sealed, mut done) = (0, 0, false);
    while let Some((mut json, tail)) = read_message(&mut router_rd, trailer).await {
        trailer = TRAILER;
        sealed += 1;
        let is_call = json.starts_with(b"{\"Call\"");
        let mut out = Vec::new();
        match meddle {
            Meddle::AlterCall if is_call && !done => {
                done = true;
                let at = json.windows(10).position(|w| w == b"\"prompt\":[").unwrap() + 10;
                json[at] += 1;
                out = framed(&json, &tail);
            }
            Meddle::InjectCall if sealed == 2 && !done => {
                done = true;
                out = framed(&json, &tail);
                let call = ToWorker::Call { call: INJECTED, op: Box::new(Op::Generate { req: request(vec![9, 9]) }) };
                out.extend(framed(&serde_json::to_vec(&call).unwrap(), &[0; TRAILER]));
            }
            Meddle::InjectReply if is_call && !done => {
                done = true;
                let call =
                    serde_json::from_slice::<serde_json::Value>(&json).unwrap()["Call"]["call"].as_u64().unwrap();
                let reply =
                    FromWorker::Reply { call, result: Err(ServeError::Internal("written by the relay".into())) };
                let reply = framed(&serde_json::to_vec(&reply).unwrap(), &[0; TRAILER]);
                let _ = router_wr.lock().await.write_all(&reply).await;
            }
            _ => {}
        }
        if out.is_empty() {
            out = framed(&json, &tail);
        }
        if worker_wr.write_all(&out).await.is_err() {
            break;
        }
    }
    let _ = worker_wr.shutdown().await;
}

/// Resolves once the connection to `w` is closed, failing the test after 5 s.
async fn closes(w: &RemoteWorker) {
    let lost = tokio::time::timeout(Duration::from_secs(5), w.lost()).await;
    assert!(lost.is_ok(), "the connection stayed open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_past_the_handshake_cannot_inject_a_call() {
    let key = ClusterKey::random();
    let (via, fake, from_worker) = worker_behind_relay(&key, Meddle::InjectCall).await;
    let remote = RemoteWorker::connect(via, &key).await.unwrap();
    closes(&remote).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(fake.served(), 0, "the worker ran the relay's call");
    let answered = from_worker.lock().unwrap().iter().any(|m| m.contains(&INJECTED.to_string()));
    assert!(!answered, "the worker answered the relay's call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_past_the_handshake_cannot_alter_a_call() {
    let key = ClusterKey::random();
    let (via, fake, _) = worker_behind_relay(&key, Meddle::AlterCall).await;
    let remote = RemoteWorker::connect(via, &key).await.unwrap();
    let (events, mut stream) = TokenStream::channel(16);
    remote.generate(request(vec![5, 5, 5]), events).unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), stream.next()).await.unwrap();
    assert!(matches!(first, Some(Event::Failed(ServeError::WorkerLost(_)))), "{first:?}");
    closes(&remote).await;
    assert_eq!(fake.served(), 0, "the worker ran the altered call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_past_the_handshake_cannot_answer_for_the_worker() {
    let key = ClusterKey::random();
    let (via, _, _) = worker_behind_relay(&key, Meddle::InjectReply).await;
    let remote = RemoteWorker::connect(via, &key).await.unwrap();
    let stats = tokio::time::timeout(Duration::from_secs(5), remote.stats()).await.unwrap();
    let e = stats.expect_err("stats through a relay that answers first");
    assert!(!e.to_string().contains("written by the relay"), "the router took the relay's answer: {e}");
    closes(&remote).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cannot_rewrite_what_a_worker_says_it_is() {
    let key = ClusterKey::random();
    let (via, _, _) = worker_behind_relay(&key, Meddle::AlterHello).await;
    let r = RemoteWorker::connect(via, &key).await;
    assert!(matches!(r, Err(ConnectError::Forged(_))), "{:?}", r.err());
}
