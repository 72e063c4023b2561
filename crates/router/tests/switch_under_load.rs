//! Roles switched back and forth on the real model while greedy requests run: every
//! request ends whole, with the tokens of an uninterrupted single-worker run, none
//! fails because of a switch, and no KV block is left used. A worker that leaves
//! decode hands its running sequences to the other by their KV.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{collect, request, worker, PROMPTS};
use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{Capabilities, Event, Generate, Phase, PrefillRoute, Telemetry, TokenStream};
use pdserve_router::{Deadlines, Migrating, Mode, Router};
use pdserve_types::Role;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_roles_under_load_loses_and_changes_nothing() {
    let reference = Router::new([worker("ref", Role::Mixed)], Mode::Aggregated, Deadlines::default(), common::rt());
    let mut want = Vec::new();
    for (i, p) in PROMPTS.iter().enumerate() {
        want.push(collect(reference.generate(request(i as u64, p, 32)).unwrap()).await.0);
    }
    let workers = [worker("w0", Role::Mixed), worker("w1", Role::Mixed)];
    let router = Arc::new(Router::new(workers, Mode::Auto, Deadlines::default(), common::rt()));
    let front = Arc::new(Migrating::new(router.clone(), 1));
    // Flip between two mixed workers and a prefill/decode split every 40 ms, while
    // 24 requests (8 of each prompt, 4 at a time) run.
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let (router, stop) = (router.clone(), stop.clone());
        tokio::spawn(async move {
            let mut switches = 0;
            let plans = [[Role::Prefill, Role::Decode], [Role::Mixed, Role::Mixed], [Role::Decode, Role::Prefill]];
            for plan in plans.iter().cycle() {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                for (e, role) in router.workers().snapshot().iter().zip(plan) {
                    if e.role() != *role {
                        router.switch_role(e, *role).await.unwrap();
                        switches += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            switches
        })
    };
    for round in 0..6u64 {
        let runs: Vec<_> = (0..4u64)
            .map(|k| {
                let i = ((round * 4 + k) % PROMPTS.len() as u64) as usize;
                let front = front.clone();
                tokio::spawn(async move {
                    let s = front.generate(request(1000 + round * 4 + k, PROMPTS[i], 32)).unwrap();
                    (i, collect(s).await)
                })
            })
            .collect();
        for r in runs {
            let (i, (tokens, end)) = r.await.unwrap();
            assert!(matches!(end, Event::Done { .. }), "prompt {i} ended with {end:?}");
            assert_eq!(tokens, want[i], "prompt {i}: the uninterrupted greedy tokens");
        }
    }
    stop.store(true, Ordering::SeqCst);
    let switches = flipper.await.unwrap();
    assert!(switches >= 6, "the roles changed under the load ({switches} switches)");
    used_blocks_settle(&router).await;
}

/// What the router reported: each move's reason, each finished request's realized
/// prefix hit.
#[derive(Default)]
struct Seen {
    moved: Mutex<Vec<&'static str>>,
    realized: Mutex<Vec<usize>>,
}

impl Telemetry for Seen {
    fn phase(&self, _: Phase, _: f64) {}
    fn route(&self, _: PrefillRoute) {}
    fn kv_transfer_bytes(&self, _: TransportKind, _: u64) {}
    fn migrated(&self, reason: &'static str) {
        self.moved.lock().unwrap().push(reason);
    }
    fn prefix_hit(&self, _: usize, realized: usize, _: Option<&'static str>) {
        self.realized.lock().unwrap().push(realized);
    }
}

async fn used_blocks_settle(router: &Router) {
    for e in router.workers().snapshot() {
        let mut used = usize::MAX;
        for _ in 0..200 {
            used = e.worker.stats().await.unwrap().blocks.used;
            if used == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(used, 0, "{} keeps no block", e.name());
    }
}

/// Stream `i`'s tokens and its last event, its count so far in `counts[i]`.
async fn counted(mut s: TokenStream, i: usize, counts: Arc<Vec<AtomicUsize>>) -> (Vec<u32>, Event) {
    let mut tokens = Vec::new();
    loop {
        match s.next().await.expect("a final event") {
            Event::Token(t) => {
                tokens.push(t.token);
                counts[i].store(tokens.len(), Ordering::SeqCst);
            }
            last => return (tokens, last),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_leaving_decode_hands_its_sequences_over_by_their_kv_with_identical_tokens() {
    const OUT: u32 = 160;
    let reference = Router::new([worker("ref", Role::Mixed)], Mode::Aggregated, Deadlines::default(), common::rt());
    let prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[1], PROMPTS[2]];
    // Every decode runs its full length, so that each is mid-stream at the switch.
    let long = |id: u64, p: &str| {
        let mut r = request(id, p, OUT);
        r.params.ignore_eos = true;
        r
    };
    let mut want = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        want.push(collect(reference.generate(long(i as u64, p)).unwrap()).await.0);
    }
    let seen = Arc::new(Seen::default());
    let workers = [worker("w0", Role::Mixed), worker("w1", Role::Mixed)];
    let router = Arc::new(
        Router::new(workers, Mode::Auto, Deadlines::default(), common::rt())
            .with_transport(TransportKind::Inproc)
            .with_telemetry(seen.clone()),
    );
    // No migration budget: a planned move does not spend it.
    let front = Migrating::new(router.clone(), 0);
    // Each stream counts its tokens; `w0` leaves decode once all have 64.
    let counts: Arc<Vec<AtomicUsize>> = Arc::new(prompts.iter().map(|_| AtomicUsize::new(0)).collect());
    let runs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| tokio::spawn(counted(front.generate(long(100 + i as u64, p)).unwrap(), i, counts.clone())))
        .collect();
    for _ in 0..3000 {
        if counts.iter().all(|c| c.load(Ordering::SeqCst) >= 64) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Both workers decode (the load spreads the four).
    let w0 = router.workers().snapshot().into_iter().find(|e| e.name() == "w0").unwrap();
    router.switch_role(&w0, Role::Prefill).await.unwrap();
    let moved = w0.worker.roles().unwrap().move_decodes().await.unwrap();
    assert!(moved > 0, "w0 was decoding when it switched");
    assert_eq!(w0.worker.stats().await.unwrap().running, 0, "w0 runs nothing once they moved");
    for (i, run) in runs.into_iter().enumerate() {
        let (tokens, end) = run.await.unwrap();
        assert!(matches!(end, Event::Done { .. }), "request {i} ended with {end:?}");
        assert_eq!(tokens, want[i], "request {i}: the uninterrupted greedy tokens");
    }
    assert_eq!(*seen.moved.lock().unwrap(), vec!["role_switch"; moved]);
    // A moved sequence is prefilled on w0 from its cache: the prompt and the tokens
    // generated before the move, less at most the last partial block.
    let longest = prompts.iter().map(|p| common::model().tokenizer.encode(p, false).len()).max().unwrap();
    let best = seen.realized.lock().unwrap().iter().copied().max().unwrap_or(0);
    assert!(best >= longest + 48, "a moved sequence reused its generated tokens' KV (best hit {best})");
    // A worker that decodes moves nothing.
    let w1 = router.workers().snapshot().into_iter().find(|e| e.name() == "w1").unwrap();
    assert_eq!(w1.worker.roles().unwrap().move_decodes().await.unwrap(), 0);
    used_blocks_settle(&router).await;
}
