//! The router over fake workers (no model): the live worker set, the handoff's one
//! path, and its failure paths, in milliseconds.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_protocol::{Event, Generate, GenerateRequest, TokenStream, Worker};
use pdserve_router::{Deadlines, Mode, PolicyKind, Router};
use pdserve_testkit::fake::{token_at, FakeWorker};
use pdserve_types::{RequestId, Role, SamplingParams};
use std::sync::Arc;
use std::time::Duration;

fn request(id: u64, prompt_len: u32, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        fence: None,
        id: RequestId(id),
        tag: format!("t{id}").as_str().into(),
        prompt: (0..prompt_len).map(|i| 1000 + i * 7 + id as u32).collect(),
        params: SamplingParams { max_tokens, ..Default::default() }.validate().unwrap(),
        trace: Default::default(),
    }
}

fn router(workers: &[&FakeWorker], mode: Mode) -> Router {
    let ws = workers.iter().map(|w| Arc::new((*w).clone()) as Arc<dyn Worker>);
    Router::new(ws, mode, Deadlines::default(), tokio::runtime::Handle::current())
}

/// The stream's tokens and its final event.
async fn collect(mut s: TokenStream) -> (Vec<u32>, Event) {
    let mut toks = Vec::new();
    loop {
        match s.next().await.expect("a final event") {
            Event::Token(t) => toks.push(t.token),
            last => return (toks, last),
        }
    }
}

fn expected(req: &GenerateRequest) -> Vec<u32> {
    (0..req.params.max_tokens as usize).map(|i| token_at(&req.prompt, i)).collect()
}

async fn settled(workers: &[&FakeWorker]) -> usize {
    for _ in 0..200 {
        if workers.iter().all(|w| w.used_blocks() == 0 && w.load() == 0) {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    workers.iter().map(|w| w.used_blocks()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_added_to_a_running_router_is_used() {
    let a = FakeWorker::new("a", Role::Mixed, 1000);
    // Least-loaded: the set is under test, not the default policy, whose choice here
    // would hang on the fakes' measured prefill paces (noise at these sizes).
    let r = router(&[&a], Mode::Aggregated).with_policy(PolicyKind::LeastLoaded.build());
    // Keep `a` busy, then add `b`: least-loaded sends the next requests to `b`.
    let busy: Vec<_> = (0..4).map(|i| r.generate(request(i, 32, 200)).unwrap()).collect();
    let b = FakeWorker::new("b", Role::Mixed, 1000);
    r.workers().add(Arc::new(b.clone()));
    for i in 10..13 {
        let req = request(i, 32, 4);
        let want = expected(&req);
        let (got, end) = collect(r.generate(req).unwrap()).await;
        assert_eq!(got, want);
        assert!(matches!(end, Event::Done { .. }));
    }
    assert_eq!(b.served(), 3, "the new worker took the requests the busy one would have");
    drop(busy);
    assert_eq!(settled(&[&a, &b]).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_worker_under_load_drains_it_and_fails_nothing() {
    let (a, b) = (FakeWorker::new("a", Role::Mixed, 1000), FakeWorker::new("b", Role::Mixed, 1000));
    let r = router(&[&a, &b], Mode::Aggregated).with_policy(PolicyKind::RoundRobin.build());
    let reqs: Vec<_> = (0..8).map(|i| request(i, 16, 50)).collect();
    let streams: Vec<_> = reqs.iter().map(|q| r.generate(q.clone()).unwrap()).collect();
    // Out of the set while half the requests run on it: no new work goes there...
    let id_b = r.workers().snapshot()[1].id;
    let gone = r.workers().remove(id_b).unwrap();
    let served_before = b.served();
    for i in 100..104 {
        let (_, end) = collect(r.generate(request(i, 16, 2)).unwrap()).await;
        assert!(matches!(end, Event::Done { .. }));
    }
    assert_eq!(b.served(), served_before, "a removed worker took new work");
    // ...and what runs there finishes, with the right tokens.
    for (q, s) in reqs.iter().zip(streams) {
        let (got, end) = collect(s).await;
        assert!(matches!(end, Event::Done { .. }), "{end:?}");
        assert_eq!(got, expected(q));
    }
    tokio::time::timeout(Duration::from_secs(5), gone.drained()).await.unwrap();
    assert_eq!(settled(&[&a, &b]).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handoff_moves_kv_between_fakes_and_gives_the_same_tokens() {
    let (p, d) = (FakeWorker::new("p", Role::Prefill, 1000), FakeWorker::new("d", Role::Decode, 1000));
    let r = router(&[&p, &d], Mode::Disaggregated);
    for i in 0..20 {
        let req = request(i, 40 + i as u32, 8);
        let want = expected(&req);
        let (got, end) = collect(r.generate(req).unwrap()).await;
        assert!(matches!(end, Event::Done { .. }), "{end:?}");
        assert_eq!(got, want);
    }
    assert_eq!(d.served(), 20, "every request decoded on the decode worker");
    assert_eq!(settled(&[&p, &d]).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefill_worker_is_replaced_by_the_spare_then_by_local_prefill() {
    let bad = FakeWorker::new("bad", Role::Prefill, 1000);
    bad.knobs(|k| k.fail_prefill.store(true, std::sync::atomic::Ordering::SeqCst));
    let (good, d) = (FakeWorker::new("good", Role::Prefill, 1000), FakeWorker::new("d", Role::Decode, 1000));
    let r = router(&[&bad, &good, &d], Mode::Disaggregated);
    let req = request(1, 64, 6);
    let (got, _) = collect(r.generate(req.clone()).unwrap()).await;
    assert_eq!(got, expected(&req));
    // With no spare left, D prefills itself.
    let r = router(&[&bad, &d], Mode::Disaggregated);
    let (got, end) = collect(r.generate(req.clone()).unwrap()).await;
    assert!(matches!(end, Event::Done { .. }), "{end:?}");
    assert_eq!(got, expected(&req));
    assert_eq!(settled(&[&bad, &good, &d]).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_is_not_chosen_and_with_none_left_requests_are_refused() {
    let (d1, d2) = (FakeWorker::new("d1", Role::Mixed, 1000), FakeWorker::new("d2", Role::Mixed, 1000));
    let r = router(&[&d1, &d2], Mode::Aggregated);
    d1.kill();
    for i in 0..4 {
        let (_, end) = collect(r.generate(request(i, 16, 2)).unwrap()).await;
        assert!(matches!(end, Event::Done { .. }));
    }
    assert_eq!(d1.served(), 0);
    d2.kill();
    assert!(!r.ready());
    assert!(r.generate(request(9, 16, 2)).is_err(), "no live worker: refused at once");
}

/// SLO admission counts the request's own prefill: an idle worker still refuses a
/// prompt whose prefill alone is predicted past the objective, and admits one that
/// fits; behind a queue, a prompt that would have fitted alone is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slo_admission_refuses_a_first_token_predicted_past_the_objective() {
    let w = FakeWorker::new("w", Role::Mixed, 100_000);
    w.knobs(|k| k.token_interval = Duration::from_millis(300));
    let r = router(&[&w], Mode::Aggregated).with_slo_admission(Some(Duration::from_millis(500)));
    // Before any measurement a prompt token is taken to cost ~1 ms.
    match r.generate(request(1, 800, 2)) {
        Err(pdserve_protocol::ServeError::SloInfeasible { predicted_ms, slo_ms, retry_s }) => {
            assert!(predicted_ms >= 700 && slo_ms == 500 && retry_s >= 1, "{predicted_ms} {retry_s}")
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| "a stream")),
    }
    let a = r.generate(request(2, 300, 2)).unwrap();
    assert!(
        matches!(r.generate(request(3, 300, 2)), Err(pdserve_protocol::ServeError::SloInfeasible { .. })),
        "300 tokens behind 300 queued: ~600 ms"
    );
    assert!(matches!(collect(a).await.1, Event::Done { .. }));
    assert!(r.generate(request(4, 300, 2)).is_ok(), "the queue drained");
}

/// TPOT admission judges the decode worker's step with the request added, from the
/// worker's own fit: sequences running there and tokens its blocks hold both count,
/// and a worker without a fit is not judged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpot_admission_refuses_a_request_that_would_slow_its_decoder_past_the_objective() {
    use pdserve_protocol::ServeError;
    let w = FakeWorker::new("w", Role::Mixed, 100_000);
    w.knobs(|k| k.token_interval = Duration::from_millis(20));
    let r = router(&[&w], Mode::Aggregated).with_tpot_admission(Some(Duration::from_millis(30)));
    let first = r.generate(request(1, 16, 400)).unwrap();
    let e = r.workers().snapshot()[0].clone();
    // The worker's steps: 10 ms, 5 ms a sequence, 1 µs a context token.
    let mut steps = pdserve_types::DecodeSteps::default();
    for b in 1..=8usize {
        for k in [0, 1000] {
            steps.record(b, k, 0.010 + 0.005 * b as f64 + 1e-6 * k as f64);
        }
    }
    e.report_decode(&steps, 0);
    // 1 running + this one: 20.4 ms; 2 + 1: 25.4 ms; 3 + 1: 30.4 ms, refused.
    let second = r.generate(request(2, 16, 400)).unwrap();
    let third = r.generate(request(3, 16, 400)).unwrap();
    match r.generate(request(4, 16, 400)) {
        Err(ServeError::TpotInfeasible { predicted_ms, slo_ms, retry_s }) => {
            assert!(predicted_ms == 31 && slo_ms == 30 && retry_s >= 1, "{predicted_ms} {retry_s}")
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| "a stream")),
    }
    drop((first, second, third));
    for _ in 0..200 {
        if w.load() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(r.generate(request(5, 16, 400)).is_ok(), "the batch emptied");
    // 1,000 blocks held (16,000 tokens) add 16 ms to every step.
    e.report_decode(&steps, 1000);
    assert!(matches!(r.generate(request(6, 16, 400)), Err(ServeError::TpotInfeasible { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_refuses_what_would_wait_too_long_and_says_when_to_retry() {
    let w = FakeWorker::new("w", Role::Mixed, 100_000);
    // First tokens come late, so prompts stay queued while more arrive.
    w.knobs(|k| k.token_interval = Duration::from_millis(300));
    let r = router(&[&w], Mode::Aggregated).with_admission(Some(Duration::from_secs(1)));
    // Before any measurement a prompt token is taken to cost ~1 ms: two prompts of 600
    // tokens queue 1.2 s of work.
    let a = r.generate(request(1, 600, 2)).unwrap();
    let b = r.generate(request(2, 600, 2)).unwrap();
    match r.generate(request(3, 600, 2)) {
        Err(pdserve_protocol::ServeError::QueueFull { wait_s, limit_s, retry_s }) => {
            assert!(wait_s >= 1 && limit_s == 1 && retry_s >= 1)
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| "a stream")),
    }
    // Admitted requests finish; once the queue drained, requests are admitted again.
    assert!(matches!(collect(a).await.1, Event::Done { .. }));
    assert!(matches!(collect(b).await.1, Event::Done { .. }));
    assert!(r.generate(request(4, 600, 2)).is_ok());
}

/// The over-shedding a security probe found: after one warm-up request, a long
/// prompt prefilling made admission refuse everyone ("would wait about 57 s" during
/// a 15 s prefill: the warm-up's first-token time, spread over its few tokens, was
/// charged for each of the long prompt's). Short requests arriving while long
/// prompts fill every prefill slot are admitted, and the idle decoder prefills them
/// itself rather than queue them behind the long ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_requests_behind_long_prompts_are_admitted_and_prefilled_by_the_decoder() {
    let (p, d) = (FakeWorker::new("p", Role::Prefill, 100_000), FakeWorker::new("d", Role::Decode, 100_000));
    p.knobs(|k| (k.prefill_fixed, k.prefill_per_token) = (Duration::from_millis(200), Duration::from_millis(1)));
    let routes = Arc::new(Routes::default());
    let r = router(&[&p, &d], Mode::Auto).with_admission(Some(Duration::from_secs(10))).with_telemetry(routes.clone());
    assert!(matches!(collect(r.generate(request(1, 10, 2)).unwrap()).await.1, Event::Done { .. }));
    assert_eq!(routes.local(), 0, "an idle prefill worker takes the warm-up");
    let admit = |req| r.generate(req).unwrap_or_else(|e| panic!("refused: {e}"));
    let long: Vec<TokenStream> = (2..4).map(|i| admit(request(i, 3000, 2))).collect();
    for _ in 0..500 {
        if p.load() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(p.load(), 2, "both long prompts prefill");
    for i in 0..5 {
        let (got, end) = collect(admit(request(10 + i, 4, 1))).await;
        assert!(matches!(end, Event::Done { .. }) && got.len() == 1, "{end:?}");
        if p.load() == 2 {
            assert_eq!(routes.local(), i + 1, "short request {i} waited for a prefill slot");
        }
    }
    for s in long {
        assert!(matches!(collect(s).await.1, Event::Done { .. }));
    }
    assert_eq!(settled(&[&p, &d]).await, 0);
}

/// Prefills the router placed on the decode worker itself.
#[derive(Default)]
struct Routes(std::sync::atomic::AtomicU64);

impl Routes {
    fn local(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl pdserve_protocol::Telemetry for Routes {
    fn phase(&self, _: pdserve_protocol::Phase, _: f64) {}
    fn route(&self, r: pdserve_protocol::PrefillRoute) {
        if r == pdserve_protocol::PrefillRoute::Local {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    fn kv_transfer_bytes(&self, _: pdserve_kv_transfer::TransportKind, _: u64) {}
    fn migrated(&self, _: &'static str) {}
}

/// The KV index's size, as the router last reported it.
#[derive(Default)]
struct IndexSize(std::sync::atomic::AtomicUsize);

impl pdserve_protocol::Telemetry for IndexSize {
    fn phase(&self, _: pdserve_protocol::Phase, _: f64) {}
    fn route(&self, _: pdserve_protocol::PrefillRoute) {}
    fn kv_transfer_bytes(&self, _: pdserve_kv_transfer::TransportKind, _: u64) {}
    fn migrated(&self, _: &'static str) {}
    fn kv_index(&self, _: &[f64], _: usize, blocks: usize) {
        self.0.store(blocks, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Under the default policy (kv-aware) a prefix a busy worker holds draws a request
/// there only where the request is prefilled there. Aggregated, the busy worker's
/// cache wins over an idle worker; disaggregated, the whole prompt's KV reaches the
/// decoder from the prefill worker anyway, so the idle decoder is chosen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_prefix_draws_a_request_only_to_a_worker_that_prefills_it() {
    for (mode, role, to_cached) in [(Mode::Aggregated, Role::Mixed, true), (Mode::Disaggregated, Role::Decode, false)] {
        let (cached, idle) = (FakeWorker::new("cached", role, 1000), FakeWorker::new("idle", role, 1000));
        let prefill = FakeWorker::new("prefill", Role::Prefill, 1000);
        let first: Vec<&FakeWorker> = match mode {
            Mode::Disaggregated => vec![&prefill, &cached],
            _ => vec![&cached],
        };
        let seen = Arc::new(IndexSize::default());
        let r = Arc::new(router(&first, mode).with_telemetry(seen.clone()));
        r.follow_kv_events();
        // `cached` decodes one long request, then `idle` joins.
        let busy = r.generate(request(1, 32, 5000)).unwrap();
        r.workers().add(Arc::new(idle.clone()));
        let req = request(2, 320, 4);
        let hashes = pdserve_kv::block_hashes(&req.prompt, 16, 0);
        let n = hashes.len();
        cached.holds(hashes);
        for _ in 0..500 {
            if seen.0.load(std::sync::atomic::Ordering::SeqCst) >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(seen.0.load(std::sync::atomic::Ordering::SeqCst) >= n, "{mode:?}: the index never saw the prefix");
        let before = (cached.served(), idle.served());
        let (got, end) = collect(r.generate(req.clone()).unwrap()).await;
        assert_eq!(got, expected(&req));
        assert!(matches!(end, Event::Done { .. }), "{end:?}");
        let took = (cached.served() - before.0, idle.served() - before.1);
        let want = if to_cached { (1, 0) } else { (0, 1) };
        assert_eq!(took, want, "{mode:?}: (cached, idle) decoders took");
        drop(busy);
        assert_eq!(settled(&[&cached, &idle, &prefill]).await, 0);
    }
}
