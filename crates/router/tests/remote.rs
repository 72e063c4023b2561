//! The router driving workers over the control protocol (`pdserve worker`'s server,
//! here on loopback in one test process so blocks can be counted on the workers
//! themselves): the same tokens as one engine over TCP and shared memory, exactly
//! every frame's bytes moved, and after a thousand random cancellations across the
//! hop no block is left on either worker.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{collect, request, rt, worker, PROMPTS};

use pdserve_kv_transfer::{Inboxes, ShmReceiver, TcpReceiver};
use pdserve_protocol::{Event, Generate, TokenStream};
use pdserve_remote::{RemoteWorker, WorkerInfo, WorkerServer, PROTOCOL_VERSION};
use pdserve_router::{Deadlines, Mode, Node, Router};
use pdserve_types::Role;
use pdserve_worker::Worker;
use std::time::Duration;

/// A worker served over loopback, as `pdserve worker` does, and its local handle.
struct Served {
    local: Worker,
    remote: RemoteWorker,
    _receivers: Option<(TcpReceiver, ShmReceiver)>,
}

async fn serve(name: &str, role: Role) -> Served {
    let local = worker(name, role);
    let (inboxes, receivers) = if role == Role::Prefill {
        (None, None)
    } else {
        let inboxes = Inboxes::new(64);
        let tcp = TcpReceiver::bind("127.0.0.1:0", inboxes.clone()).await.unwrap();
        let sock = std::env::temp_dir().join(format!("pdserve-remote-test-{}-{name}.sock", std::process::id()));
        let _ = std::fs::remove_file(&sock);
        let shm = ShmReceiver::bind(&sock, inboxes.clone()).await.unwrap();
        (Some(inboxes), Some((tcp, shm)))
    };
    let info = WorkerInfo {
        protocol: PROTOCOL_VERSION,
        name: name.into(),
        role,
        model: "test".into(),
        kv_tcp_port: receivers.as_ref().map(|(t, _)| t.local_addr().port()),
        kv_shm: receivers.as_ref().map(|(_, s)| s.path().to_path_buf()),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(WorkerServer::new(local.clone(), info, inboxes).serve(listener, std::future::pending()));
    let remote = RemoteWorker::connect(addr).await.unwrap();
    Served { local, remote, _receivers: receivers }
}

/// Used blocks on the workers themselves, once cancellations have settled.
async fn settle(workers: &[&Worker]) -> usize {
    let mut used = 0;
    for _ in 0..300 {
        used = 0;
        for w in workers {
            used += w.stats().await.unwrap().blocks.used;
        }
        if used == 0 {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for w in workers {
        eprintln!("{}: {:?}", w.name(), w.stats().await);
    }
    used
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_handoff_gives_one_engines_tokens_over_tcp_and_shm() {
    let alone = Router::new([worker("alone", Role::Mixed)], Mode::Aggregated, Deadlines::default(), rt());
    let (p, d) = (serve("p", Role::Prefill).await, serve("d", Role::Decode).await);
    for transport in ["tcp", "shm"] {
        let nodes = [Node::Remote(p.remote.clone()), Node::Remote(d.remote.clone())];
        let r = Router::new(nodes, Mode::Disaggregated, Deadlines::default(), rt()).with_remote_transport(transport);
        for (i, text) in PROMPTS.iter().enumerate() {
            let (want, _) = collect(alone.generate(request(i as u64, text, 16)).unwrap()).await;
            let (got, end) = collect(r.generate(request(100 + i as u64, text, 16)).unwrap()).await;
            assert!(matches!(end, Event::Done { .. }), "{transport}: {end:?}");
            assert_eq!(got, want, "{transport}, prompt {i}");
        }
        assert_eq!(settle(&[&p.local, &d.local]).await, 0, "{transport}");
    }
}

/// 1000 requests across the process hop, each dropped at a random moment (at once,
/// during prefill, after its first token) or read to the end, in disaggregated and
/// auto modes: afterwards neither worker holds a block, and every request read to
/// the end finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_cancels_across_the_hop_leak_nothing() {
    let (p, d) = (serve("p2", Role::Prefill).await, serve("d2", Role::Decode).await);
    let mut seed = 0x9e37_79b9_u64;
    let mut rnd = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for (m, mode) in [Mode::Disaggregated, Mode::Auto].into_iter().enumerate() {
        let nodes = [Node::Remote(p.remote.clone()), Node::Remote(d.remote.clone())];
        let r = Router::new(nodes, mode, Deadlines::default(), rt());
        let mut live = Vec::new();
        for i in 0..500u64 {
            let text = PROMPTS[rnd(3) as usize];
            let s = r.generate(request(10_000 * (m as u64 + 1) + i, text, 1 + rnd(12) as u32)).unwrap();
            live.push((rnd(4), s));
            if live.len() >= 8 {
                drain(&mut live).await;
            }
        }
        drain(&mut live).await;
        assert_eq!(settle(&[&p.local, &d.local]).await, 0, "{mode:?}: blocks leaked");
    }
}

async fn drain(live: &mut Vec<(u64, TokenStream)>) {
    for (what, mut s) in live.drain(..) {
        match what {
            0 => drop(s),
            1 => {
                tokio::time::sleep(Duration::from_millis(3)).await;
                drop(s);
            }
            2 => {
                let _ = s.next().await;
            }
            _ => {
                let (_, end) = collect(s).await;
                assert!(matches!(end, Event::Done { .. }), "{end:?}");
            }
        }
    }
}
