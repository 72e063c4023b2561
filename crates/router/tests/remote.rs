//! The router driving workers over the control protocol (`pdserve worker`'s server,
//! here on loopback in one test process so blocks can be counted on the workers
//! themselves): the same tokens as one engine over TCP and shared memory, exactly
//! every frame's bytes moved, and after a thousand random cancellations across the
//! hop no block is left on either worker. A worker leaving decode hands its
//! sequences back over the hop.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{collect, collect_all, key, local, remotes, request, rt, serve, settle, worker, PROMPTS};

use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{Event, Generate, TokenStream, Worker};
use pdserve_remote::{RemoteWorker, WorkerServer};
use pdserve_router::{Deadlines, Mode, Router};
use pdserve_testkit::rng::Rng;
use pdserve_types::{Role, SamplingParams};
use pdserve_worker::LocalWorker;
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_routers_and_workers_holding_the_cluster_key_meet() {
    let d = serve("dk", Role::Decode).await;
    let stranger = pdserve_kv_transfer::ClusterKey::random();
    let r = RemoteWorker::connect(d.remote.addr(), &stranger).await;
    assert!(matches!(r, Err(pdserve_remote::ConnectError::Refused(_))), "{:?}", r.err());
    // An impostor worker: answers the challenge without the key.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fake: Arc<dyn Worker> = Arc::new(local("impostor", Role::Decode, 16));
    tokio::spawn(WorkerServer::new(fake, stranger).serve(listener, std::future::pending()));
    let r = RemoteWorker::connect(addr, &key()).await;
    assert!(r.is_err(), "a worker without the key was accepted");
}

/// A router that lets go of a worker (drops every handle) closes the connection, so
/// the worker frees its session and slot: more connections than a worker serves at
/// once (64), each made and dropped in turn, all get in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_no_one_holds_closes_and_frees_its_slot() {
    let d = serve("dc", Role::Decode).await;
    for i in 0..80 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let w = loop {
            match RemoteWorker::connect(d.remote.addr(), &key()).await {
                Ok(w) => break w,
                Err(e) => assert!(tokio::time::Instant::now() < deadline, "connection {i} refused: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        drop(w);
    }
}

/// A worker whose server stops (SIGTERM) says so in its stats: the router's next
/// stats poll takes it out of routing, while the other stays usable and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_worker_is_routed_nothing_new() {
    let stopping = local("stopping", Role::Mixed, 256);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served: Arc<dyn Worker> = Arc::new(stopping.clone());
    tokio::spawn(WorkerServer::new(served, key()).serve(listener, async move {
        let _ = stopped.await;
    }));
    let a: Arc<dyn Worker> = Arc::new(RemoteWorker::connect(addr, &key()).await.unwrap());
    let b = serve("staying", Role::Mixed).await;
    let r = Router::new([a, Arc::new(b.remote.clone())], Mode::Aggregated, Deadlines::default(), rt());
    r.poll_stats().await;
    assert!(r.workers().snapshot().iter().all(|e| e.usable()));
    stop.send(()).unwrap();
    // The server takes the stop on its own task: poll until its stats carry it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let round = loop {
        let round = r.poll_stats().await;
        if round[0].1.as_ref().is_some_and(|s| s.stopping) || tokio::time::Instant::now() > deadline {
            break round;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let usable: Vec<(String, bool)> = round.iter().map(|(e, _)| (e.name().to_string(), e.usable())).collect();
    assert_eq!(usable, [("stopping".to_string(), false), ("staying".to_string(), true)]);
    assert!(round[0].1.as_ref().is_some_and(|s| s.stopping), "its stats say it stops");
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let (toks, last) = collect(r.generate(request(i as u64, prompt, 4)).unwrap()).await;
        assert!(matches!(last, Event::Done { .. }) && !toks.is_empty(), "{last:?}");
    }
    // A finished prompt leaves its full blocks in the prefix cache of the worker
    // that ran it: the long prompt's, on the staying worker only.
    assert!(b.local.stats().await.unwrap().blocks.cached > 0, "the staying worker ran them");
    assert_eq!(stopping.stats().await.unwrap().blocks.cached, 0, "nothing new ran on the stopping worker");
}

/// A stopping worker exits once its engine is idle and its server owes nothing: a
/// call counts from its start until its last frame is written to the router, so a
/// request whose last frames are still queued keeps the worker up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_server_owes_a_call_until_its_last_frame_is_written() {
    let local = local("owing", Role::Mixed, 256);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = WorkerServer::new(Arc::new(local.clone()), key());
    tokio::spawn(server.clone().serve(listener, std::future::pending()));
    let remote = RemoteWorker::connect(addr, &key()).await.unwrap();
    // Longer than the router buffers unread (64 events): left unread, the call is
    // paced and runs until read, however slow this machine is.
    let mut req = request(1, PROMPTS[0], 200);
    req.params = SamplingParams { max_tokens: 200, ignore_eos: true, ..Default::default() }.validate().unwrap();
    let (tx, mut rx) = TokenStream::channel(256);
    remote.generate(req, tx).unwrap();
    assert!(matches!(rx.next().await, Some(Event::Token(_))));
    assert!(server.owed() >= 1, "a running call is owed");
    let (toks, last) = collect(rx).await;
    assert_eq!(toks.len(), 199);
    assert!(matches!(last, Event::Done { .. }), "{last:?}");
    // The writer drops a frame's count just after writing it, so this may lag the read.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while server.owed() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server.owed(), 0, "a finished call, its frames written, is owed still");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_handoff_gives_one_engines_tokens_over_tcp_and_shm() {
    let alone = Router::new([worker("alone", Role::Mixed)], Mode::Aggregated, Deadlines::default(), rt());
    let (p, d) = (serve("p", Role::Prefill).await, serve("d", Role::Decode).await);
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let r = Router::new(remotes(&p, &d), Mode::Disaggregated, Deadlines::default(), rt()).with_transport(transport);
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
    let mut rng = Rng::new(0x9e37_79b9);
    let mut rnd = move |n: u64| rng.range(0, n);
    for (m, mode) in [Mode::Disaggregated, Mode::Auto].into_iter().enumerate() {
        let r = Router::new(remotes(&p, &d), mode, Deadlines::default(), rt()).with_transport(TransportKind::Tcp);
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

/// A worker checks what it is sent (D1): values out of range are refused before
/// anything is computed, and the worker goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_messages_out_of_range_and_survives() {
    let w = serve("v", Role::Mixed).await;
    let mut bad = request(1, PROMPTS[0], 4);
    // What the frontend would never send: no validation ran on these.
    bad.params.top_logprobs = u32::MAX;
    let mut worse = request(2, PROMPTS[0], 4);
    worse.params.temperature = -5.0;
    worse.params.min_tokens = 100;
    for req in [bad, worse] {
        let (tx, stream) = TokenStream::channel(8);
        w.remote.generate(req, tx).unwrap();
        let (_, end) = collect(stream).await;
        assert!(matches!(end, Event::Failed(pdserve_protocol::ServeError::Invalid(_))), "{end:?}");
    }
    let (tx, stream) = TokenStream::channel(16);
    w.remote.generate(request(3, PROMPTS[0], 4), tx).unwrap();
    assert!(matches!(collect(stream).await.1, Event::Done { .. }));
}

/// A connection acts only on what it started (D3, D4): another router's release does
/// not touch a reservation, and it cannot decode it either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cannot_touch_another_connections_reservations() {
    let d = serve("own", Role::Decode).await;
    let intruder = RemoteWorker::connect(d.remote.addr(), &key()).await.unwrap();
    let id = pdserve_types::RequestId(77);
    let reserved = d.remote.reserve(id, 40, None).await.unwrap();
    // Its answer crossed the wire whole: a worker that drafts nothing wants no draft K/V.
    assert_eq!(reserved.draft_worth, Some(0.0));
    intruder.release(id);
    let handoff = pdserve_protocol::DecodeHandoff {
        id,
        tag: "x".into(),
        prompt: vec![1; 40],
        first: 5,
        params: request(0, PROMPTS[0], 4).params,
        cached_tokens: 0,
    };
    let (tx, stream) = TokenStream::channel(8);
    intruder.decode(handoff, tx).unwrap();
    assert!(matches!(collect(stream).await.1, Event::Failed(_)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = d.local.stats().await.unwrap();
    assert_eq!(stats.importing, 1, "the reservation survived the intruder");
    assert!(stats.blocks.used >= 3);
    // Its owner releases it; nothing stays.
    d.remote.release(id);
    assert_eq!(settle(&[&d.local]).await, 0);
}

/// A worker whose reservations are granted at once but answered late, as a busy
/// engine's are: the grant is made, its answer still on the way.
struct LateGrant(LocalWorker);

impl Worker for LateGrant {
    fn info(&self) -> &pdserve_protocol::WorkerInfo {
        self.0.info()
    }
    fn load(&self) -> usize {
        self.0.load()
    }
    fn is_alive(&self) -> bool {
        self.0.is_alive()
    }
    fn generate(
        &self,
        req: pdserve_protocol::GenerateRequest,
        events: pdserve_protocol::EventSender,
    ) -> Result<(), pdserve_protocol::ServeError> {
        self.0.generate(req, events)
    }
    fn kv_target(&self, via: TransportKind) -> Option<pdserve_kv_transfer::KvTarget> {
        self.0.kv_target(via)
    }
    fn reserve(
        &self,
        id: pdserve_types::RequestId,
        prompt_len: usize,
        fence: Option<pdserve_types::Epoch>,
    ) -> pdserve_protocol::Reply<'_, pdserve_protocol::Reserved> {
        Box::pin(async move {
            let granted = self.0.reserve(id, prompt_len, fence).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            granted
        })
    }
    fn prefill(
        &self,
        req: pdserve_protocol::GenerateRequest,
        to: pdserve_protocol::KvDestination,
    ) -> pdserve_protocol::Reply<'static, pdserve_protocol::Prefilled> {
        self.0.prefill(req, to)
    }
    fn decode(
        &self,
        handoff: pdserve_protocol::DecodeHandoff,
        events: pdserve_protocol::EventSender,
    ) -> Result<(), pdserve_protocol::ServeError> {
        self.0.decode(handoff, events)
    }
    fn release(&self, id: pdserve_types::RequestId) {
        self.0.release(id)
    }
    fn stats(&self) -> pdserve_protocol::Reply<'_, pdserve_protocol::WorkerStats> {
        self.0.stats()
    }
}

/// The handoff's fallback when a decode worker's reservation times out: the router
/// releases it and asks the same worker to prefill the request itself, under the
/// same id. The release must reach the worker before that request does, even while
/// the reservation's answer is still on its way; otherwise the request finds its
/// own reservation and is refused as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_overtaking_its_grant_lands_before_the_next_call() {
    let local = local("late", Role::Mixed, 256);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served: Arc<dyn Worker> = Arc::new(LateGrant(local.clone()));
    tokio::spawn(WorkerServer::new(served, key()).serve(listener, std::future::pending()));
    let remote = RemoteWorker::connect(addr, &key()).await.unwrap();
    let req = request(91, PROMPTS[1], 4);
    let gave_up = tokio::time::timeout(Duration::from_millis(50), remote.reserve(req.id, req.prompt.len(), None)).await;
    assert!(gave_up.is_err(), "the grant's answer is late");
    remote.release(req.id);
    let (tx, stream) = TokenStream::channel(8);
    remote.generate(req, tx).unwrap();
    let (tokens, end) = collect(stream).await;
    assert!(matches!(end, Event::Done { .. }), "{end:?}");
    assert_eq!(tokens.len(), 4);
    assert_eq!(settle(&[&local]).await, 0);
}

/// A worker leaving decode hands its running sequences back over control: each
/// stream ends with `Moved` across the hop, is prefilled again on that worker from
/// its cache and decodes on the other, with the tokens of an uninterrupted run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decodes_handed_back_over_control_move_to_the_other_worker_unchanged() {
    let alone = Router::new([worker("alone", Role::Mixed)], Mode::Aggregated, Deadlines::default(), rt());
    let long = |id: u64| {
        let mut r = request(id, PROMPTS[1], 96);
        r.params.ignore_eos = true;
        r
    };
    let (want, _) = collect(alone.generate(long(1)).unwrap()).await;
    let (a, b) = (serve("ma", Role::Mixed).await, serve("mb", Role::Mixed).await);
    let r = Arc::new(
        Router::new(remotes(&a, &b), Mode::Auto, Deadlines::default(), rt()).with_transport(TransportKind::Tcp),
    );
    let front = pdserve_router::Migrating::new(r.clone(), 0);
    let streams: Vec<TokenStream> = (0..2).map(|i| front.generate(long(10 + i)).unwrap()).collect();
    // Both decode (one on each worker) before `ma` leaves decode.
    for _ in 0..1000 {
        if a.local.stats().await.unwrap().running > 0 && b.local.stats().await.unwrap().running > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let ea = r.workers().snapshot().into_iter().find(|e| e.name() == "ma").unwrap();
    r.switch_role(&ea, Role::Prefill).await.unwrap();
    assert_eq!(ea.worker.role_switch().unwrap().move_decodes().await.unwrap(), 1, "ma hands back the one it decodes");
    for (got, end) in collect_all(streams).await {
        assert!(matches!(end, Event::Done { .. }), "{end:?}");
        assert_eq!(got, want, "the uninterrupted greedy tokens");
    }
    assert_eq!(a.local.stats().await.unwrap().running, 0);
    assert_eq!(settle(&[&a.local, &b.local]).await, 0);
}
