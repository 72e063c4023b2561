//! The router on the real model: disaggregated in-process gives the same tokens as
//! aggregated; cancellation and deadline failures in any state leave no KV block used.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{collect, collect_all, group_head, model, request, rt, worker, PROMPTS};

use common::local;
use pdserve_kv_transfer::{ListenAt, TransportKind};
use pdserve_protocol::{Event, Generate, TokenStream, Worker};
use pdserve_router::{Deadlines, Mode, Router};
use pdserve_types::{Role, SamplingParams};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn router(mode: Mode, dl: Deadlines) -> Router {
    let workers = match mode {
        Mode::Aggregated => vec![worker("mixed", Role::Mixed)],
        _ => vec![worker("prefill", Role::Prefill), worker("decode", Role::Decode)],
    };
    Router::new(workers, mode, dl, tokio::runtime::Handle::current())
}

async fn used_blocks(r: &Router) -> usize {
    let mut used = 0;
    for e in r.workers().snapshot() {
        used += e.worker.stats().await.unwrap().blocks.used;
    }
    used
}

/// Polls until every worker has released its blocks (cancellation is asynchronous).
async fn settle(r: &Router) -> usize {
    for _ in 0..200 {
        if used_blocks(r).await == 0 {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    used_blocks(r).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_equals_aggregated() {
    let agg = router(Mode::Aggregated, Deadlines::default());
    let dis = router(Mode::Disaggregated, Deadlines::default());
    for (i, p) in PROMPTS.iter().enumerate() {
        let (a, a_end) = collect(agg.generate(request(i as u64, p, 24)).unwrap()).await;
        let (d, d_end) = collect(dis.generate(request(100 + i as u64, p, 24)).unwrap()).await;
        assert_eq!(a, d, "prompt {i}");
        assert!(matches!(a_end, Event::Done { .. }) && matches!(d_end, Event::Done { .. }));
        if let (Event::Done { usage: ua, .. }, Event::Done { usage: ud, .. }) = (&a_end, &d_end) {
            assert_eq!(ua.completion_tokens, a.len());
            assert_eq!(ud.completion_tokens, d.len());
        }
    }
    assert_eq!(settle(&agg).await, 0);
    assert_eq!(settle(&dis).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_timeout_falls_back_to_local_prefill() {
    let reference = router(Mode::Aggregated, Deadlines::default());
    let (want, _) = collect(reference.generate(request(1, PROMPTS[1], 16)).unwrap()).await;
    // A prefill deadline no prefill can meet: every request falls back to D.
    let dl =
        Deadlines { prefill_base: Duration::from_nanos(1), prefill_per_token: Duration::ZERO, ..Default::default() };
    let r = router(Mode::Disaggregated, dl);
    let (got, end) = collect(r.generate(request(2, PROMPTS[1], 16)).unwrap()).await;
    assert!(matches!(end, Event::Done { .. }), "{end:?}");
    assert_eq!(got, want);
    assert_eq!(settle(&r).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_in_every_state_releases_blocks() {
    let r = router(Mode::Disaggregated, Deadlines::default());
    // Routed/Reserved: drop at once. Prefilling: drop after a short delay. Streaming:
    // drop after a few tokens.
    for (n, delay_ms, after_tokens) in [(0u64, 0u64, 0usize), (1, 2, 0), (2, 0, 3), (3, 0, 1)] {
        let mut s = r.generate(request(10 + n, PROMPTS[1], 64)).unwrap();
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        let mut seen = 0;
        while seen < after_tokens {
            match s.next().await {
                Some(Event::Token(_)) => seen += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        drop(s);
    }
    assert_eq!(settle(&r).await, 0, "blocks leaked after cancellations");
    // The workers still serve.
    let (toks, end) = collect(r.generate(request(99, PROMPTS[0], 8)).unwrap()).await;
    assert_eq!(toks.len(), 8);
    assert!(matches!(end, Event::Done { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_keeps_short_prompts_local_and_matches() {
    let agg = router(Mode::Aggregated, Deadlines::default());
    let auto = router(Mode::Auto, Deadlines::default());
    for (i, p) in PROMPTS.iter().enumerate() {
        let (a, _) = collect(agg.generate(request(i as u64, p, 12)).unwrap()).await;
        let (b, _) = collect(auto.generate(request(50 + i as u64, p, 12)).unwrap()).await;
        assert_eq!(a, b);
    }
    assert_eq!(settle(&auto).await, 0);
}

/// 1002 requests (334 per mode), each cancelled at a random moment (before routing completes, during
/// prefill, mid-stream) or left to finish, in every mode: afterwards no worker holds a
/// KV block and every request that was not cancelled ended with a final event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_cancels_leak_nothing() {
    let mut rng = pdserve_testkit::rng::Rng::new(0x1234_5678);
    let mut rnd = move |n: u64| rng.range(0, n);
    for mode in [Mode::Disaggregated, Mode::Auto, Mode::Aggregated] {
        let r = router(mode, Deadlines::default());
        let mut live = Vec::new();
        for i in 0..334u64 {
            let p = PROMPTS[rnd(3) as usize];
            let s = r.generate(request(1000 + i, p, 1 + rnd(12) as u32)).unwrap();
            // 0: drop now; 1: after one token; 2: keep to the end.
            live.push((rnd(3), s));
            if live.len() >= 8 {
                drain_some(&mut live).await;
            }
        }
        while !live.is_empty() {
            drain_some(&mut live).await;
        }
        assert_eq!(settle(&r).await, 0, "{mode:?}: blocks leaked");
        assert_eq!(idle(&r).await, 0, "{mode:?}: the load count did not return to 0");
    }
}

/// Waits until the router counts no request in flight on any worker.
async fn idle(r: &Router) -> usize {
    for _ in 0..200 {
        if r.in_flight() == 0 {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    r.in_flight()
}

async fn drain_some(live: &mut Vec<(u64, TokenStream)>) {
    for (what, mut s) in live.drain(..) {
        match what {
            0 => drop(s),
            1 => {
                let _ = s.next().await;
            }
            _ => {
                let (_, end) = collect(s).await;
                assert!(matches!(end, Event::Done { .. }), "{end:?}");
            }
        }
    }
}

/// The same handoff with frames over loopback TCP and over shared memory: the tokens
/// are the ones one engine produces alone, and no block is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_and_shm_links_give_the_same_tokens() {
    let agg = router(Mode::Aggregated, Deadlines::default());
    let mut want = Vec::new();
    for (i, p) in PROMPTS.iter().enumerate() {
        want.push(collect(agg.generate(request(i as u64, p, 16)).unwrap()).await.0);
    }
    let cfg = &model().model.cfg;
    for (k, via) in [TransportKind::Tcp, TransportKind::Shm].into_iter().enumerate() {
        let d = local("decode", Role::Decode, 256);
        let sock = std::env::temp_dir().join(format!("pdserve-router-test-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&sock);
        d.listen(via, &ListenAt { net: "127.0.0.1:0".parse().unwrap(), socket: sock }).await.unwrap();
        let seen = Arc::new(Bytes::default());
        let workers: [Arc<dyn Worker>; 2] = [worker("prefill", Role::Prefill), Arc::new(d)];
        let r = Router::new(workers, Mode::Disaggregated, Deadlines::default(), rt())
            .with_transport(via)
            .with_telemetry(seen.clone());
        for (i, p) in PROMPTS.iter().enumerate() {
            let req = request(200 + 10 * k as u64 + i as u64, p, 16);
            // Every layer's blocks, K and V in f16: what must have crossed the link.
            let blocks = req.prompt.len().div_ceil(16);
            let expect = (cfg.n_layers * blocks * 2 * cfg.n_kv_heads * 16 * cfg.head_dim * 2) as u64;
            let (got, end) = collect(r.generate(req).unwrap()).await;
            assert!(matches!(end, Event::Done { .. }), "{end:?}");
            assert_eq!(got, want[i], "link {k}, prompt {i}");
            assert_eq!(seen.take(via.label()), expect, "{via}: the frames did not all cross the link");
        }
        assert_eq!(settle(&r).await, 0);
    }
}

/// Counts transfer bytes per transport name.
#[derive(Default)]
struct Bytes(std::sync::Mutex<std::collections::HashMap<String, u64>>);

impl Bytes {
    fn take(&self, name: &str) -> u64 {
        self.0.lock().unwrap().remove(name).unwrap_or(0)
    }
}

impl pdserve_protocol::Telemetry for Bytes {
    fn phase(&self, _: pdserve_protocol::Phase, _: f64) {}
    fn route(&self, _: pdserve_protocol::PrefillRoute) {}
    fn kv_transfer_bytes(&self, transport: TransportKind, bytes: u64) {
        *self.0.lock().unwrap().entry(transport.label().to_string()).or_default() += bytes;
    }
    fn migrated(&self, reason: &'static str) {
        *self.0.lock().unwrap().entry(reason.to_string()).or_default() += 1;
    }
}

/// More long prompts at once than the decode worker has blocks for: they wait (for a
/// prefill slot, then for blocks) instead of failing, and all finish with the tokens
/// one engine gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_decode_worker_makes_handoffs_wait_not_fail() {
    let d: Arc<dyn Worker> = Arc::new(local("small-decode", Role::Decode, 40));
    let r = Router::new([worker("prefill", Role::Prefill), d], Mode::Disaggregated, Deadlines::default(), rt());
    let agg = router(Mode::Aggregated, Deadlines::default());
    // ~230 tokens: 15 blocks each, so two fit on the decode worker at a time.
    let text = PROMPTS[1].repeat(10);
    let (want, _) = collect(agg.generate(request(1, &text, 8)).unwrap()).await;
    let streams: Vec<_> = (0..6).map(|i| r.generate(request(100 + i, &text, 8)).unwrap()).collect();
    for (got, end) in collect_all(streams).await {
        assert!(matches!(end, Event::Done { .. }), "{end:?}");
        assert_eq!(got, want);
    }
    assert_eq!(settle(&r).await, 0);
}

/// In `auto`, a worker the planner made a decoder is waited for like a disaggregated
/// one: long prompts that find it full are not prefilled there (that would stall its
/// decodes), and none of them counts as moved for want of room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_waits_for_a_dedicated_decode_worker_instead_of_prefilling_there() {
    let text = PROMPTS[1].repeat(24);
    let out = 200;
    let long = |id| {
        let mut req = request(id, &text, out);
        req.params = SamplingParams { max_tokens: out, ignore_eos: true, ..Default::default() }.validate().unwrap();
        req
    };
    // Room for two whole sequences, not for a third prompt beside two: a third
    // handoff waits about as long as two 200-token decodes take (well past auto's
    // 500 ms for a mixed worker).
    let (prompt, whole) = (long(0).prompt.len().div_ceil(16), (long(0).prompt.len() + out as usize).div_ceil(16));
    let blocks = 2 * whole + 2;
    assert!(blocks < 3 * prompt, "the test's sizes do not keep a third prompt out");
    let d: Arc<dyn Worker> = Arc::new(local("small-decode", Role::Decode, blocks));
    let seen = Arc::new(Bytes::default());
    // A reserve deadline far beyond two decodes even on a loaded machine: the test is
    // whether auto waits for the dedicated worker at all (a mixed one gets 500 ms),
    // not how long two decodes take.
    let patient = Deadlines { reserve: std::time::Duration::from_secs(120), ..Deadlines::default() };
    let r = Router::new([worker("prefill", Role::Prefill), d], Mode::Auto, patient, rt()).with_telemetry(seen.clone());
    let agg = router(Mode::Aggregated, Deadlines::default());
    let (want, _) = collect(agg.generate(long(1)).unwrap()).await;
    let streams: Vec<_> = (0..4).map(|i| r.generate(long(100 + i)).unwrap()).collect();
    for (got, end) in collect_all(streams).await {
        assert!(matches!(end, Event::Done { .. }), "{end:?}");
        assert_eq!(got, want);
    }
    assert_eq!(seen.take("decode_full"), 0, "a handoff was prefilled on the decode worker");
    assert!(seen.take("tcp") + seen.take("inproc") + seen.take("shm") > 0, "nothing was handed off");
    assert_eq!(settle(&r).await, 0);
}

/// A prefill worker that fails (too few blocks for the prompt) is replaced by the
/// other prefill worker, not by local prefill on D: every frame crosses to D, the
/// tokens are one engine's, and nothing stays reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_starts_over_on_the_spare_prefill_worker() {
    let m = model();
    let bad: Arc<dyn Worker> = Arc::new(local("tiny-prefill", Role::Prefill, 4));
    // The failing worker comes first, so the policy picks it first every time (both
    // idle, nothing cached: ties go to the first).
    let workers = [bad, worker("prefill", Role::Prefill), worker("decode", Role::Decode)];
    let seen = Arc::new(Bytes::default());
    let r = Router::new(workers, Mode::Disaggregated, Deadlines::default(), rt()).with_telemetry(seen.clone());
    let agg = router(Mode::Aggregated, Deadlines::default());
    let cfg = &m.model.cfg;
    // ~90 tokens: 6 blocks, more than the tiny worker has.
    let text = PROMPTS[1].repeat(4);
    let (want, _) = collect(agg.generate(request(1, &text, 8)).unwrap()).await;
    for i in 0..3 {
        let req = request(10 + i, &text, 8);
        let blocks = req.prompt.len().div_ceil(16);
        assert!(blocks > 4);
        let expect = (cfg.n_layers * blocks * 2 * cfg.n_kv_heads * 16 * cfg.head_dim * 2) as u64;
        let (got, end) = collect(r.generate(req).unwrap()).await;
        assert!(matches!(end, Event::Done { .. }), "{end:?}");
        assert_eq!(got, want);
        assert_eq!(seen.take("inproc"), expect, "the prompt was not prefilled remotely");
    }
    assert_eq!(settle(&r).await, 0);
}

/// Long prompts arriving together on the default topology (one prefill and one decode
/// worker of 1024 blocks): every one is served — none refused because the decode
/// worker's command queue filled with frames (each prompt is 7,500 frames, the queue
/// 4,096) — and no block stays reserved. One round: a second took four more minutes
/// of prefill and found nothing the block count after the first does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_long_prompts_are_served_not_refused() {
    let workers = [
        Arc::new(local("prefill", Role::Prefill, 1024)) as Arc<dyn Worker>,
        Arc::new(local("decode", Role::Decode, 1024)),
    ];
    let r = Router::new(workers, Mode::Auto, Deadlines::default(), rt());
    let long = |i: u64| {
        let mut req = request(500 + i, PROMPTS[1], 8);
        req.prompt = (0..4000u32).map(|t| 1000 + (t * 7919 + i as u32 * 31) % 30000).collect();
        req
    };
    let streams: Vec<_> = (0..3).map(|i| r.generate(long(i)).unwrap()).collect();
    for (toks, end) in collect_all(streams).await {
        assert!(matches!(end, Event::Done { .. }), "{end:?}");
        assert_eq!(toks.len(), 8);
    }
    assert_eq!(settle(&r).await, 0);
}

/// A stage group's head leaving decode hands its running sequence back: it is
/// prefilled again on the head from its cache (the head's layers from its own pool,
/// the later stage's from that stage) and decodes on the other worker, with the
/// tokens of an uninterrupted run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_head_leaving_decode_hands_its_sequences_on_unchanged() {
    let long = |id: u64| {
        let mut r = request(id, PROMPTS[1], 96);
        r.params.ignore_eos = true;
        r
    };
    let alone = Router::new([worker("alone", Role::Mixed)], Mode::Aggregated, Deadlines::default(), rt());
    let (want, _) = collect(alone.generate(long(1)).unwrap()).await;
    let (g, b) = (group_head("g", Role::Mixed), local("b", Role::Mixed, 256));
    let workers: [Arc<dyn Worker>; 2] = [Arc::new(g.clone()), Arc::new(b.clone())];
    let moved = Arc::new(Moved::default());
    let r = Router::new(workers, Mode::Auto, Deadlines::default(), rt())
        .with_transport(TransportKind::Inproc)
        .with_telemetry(moved.clone());
    let r = Arc::new(r);
    let front = pdserve_router::Migrating::new(r.clone(), 0);
    let streams: Vec<TokenStream> = (0..2).map(|i| front.generate(long(10 + i)).unwrap()).collect();
    // Both decode (one on each worker) before the group leaves decode.
    for _ in 0..2000 {
        if g.stats().await.unwrap().running > 0 && b.stats().await.unwrap().running > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let eg = r.workers().snapshot().into_iter().find(|e| e.name() == "g").unwrap();
    r.switch_role(&eg, Role::Prefill).await.unwrap();
    assert_eq!(eg.worker.role_switch().unwrap().move_decodes().await.unwrap(), 1, "g hands back the one it decodes");
    for (got, end) in collect_all(streams).await {
        assert!(matches!(end, Event::Done { .. }), "{end:?}");
        assert_eq!(got, want, "the uninterrupted greedy tokens");
    }
    // Handed over, not recomputed on b: whole blocks of all 30 layers (768 bytes a
    // token a layer, f16), the later stage's among them.
    let bytes = moved.0.load(Ordering::SeqCst);
    assert!(bytes > 0 && bytes % (30 * 16 * 768) == 0, "{bytes} bytes handed over");
    assert_eq!(g.stats().await.unwrap().running, 0);
    assert_eq!(common::settle(&[&g, &b]).await, 0);
}

/// The K/V bytes the router saw handed over.
#[derive(Default)]
struct Moved(AtomicU64);

impl pdserve_protocol::Telemetry for Moved {
    fn phase(&self, _: pdserve_protocol::Phase, _: f64) {}
    fn route(&self, _: pdserve_protocol::PrefillRoute) {}
    fn kv_transfer_bytes(&self, _: TransportKind, bytes: u64) {
        self.0.fetch_add(bytes, Ordering::SeqCst);
    }
    fn migrated(&self, _: &'static str) {}
}
