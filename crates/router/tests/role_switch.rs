//! Roles switched in place under traffic, over fake workers: epoch fencing refuses
//! work routed for an old role, the router re-routes it, and nothing is lost or
//! served twice; a worker leaving decode finishes its sequences in place.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{Event, Generate, GenerateRequest, RoleSwitch, TokenStream, Worker};
use pdserve_router::{Deadlines, Migrating, Mode, Router};
use pdserve_testkit::fake::{token_at, FakeWorker};
use pdserve_types::{Assignment, Epoch, RequestId, Role, SamplingParams};
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

fn expected(req: &GenerateRequest) -> Vec<u32> {
    (0..req.params.max_tokens as usize).map(|i| token_at(&req.prompt, i)).collect()
}

fn router(workers: &[&FakeWorker]) -> Arc<Router> {
    let ws = workers.iter().map(|w| Arc::new((*w).clone()) as Arc<dyn Worker>);
    Arc::new(
        Router::new(ws, Mode::Auto, Deadlines::default(), tokio::runtime::Handle::current())
            .with_transport(TransportKind::Inproc),
    )
}

async fn tokens(mut s: TokenStream) -> Vec<u32> {
    let mut out = Vec::new();
    loop {
        match s.next().await.expect("a final event") {
            Event::Token(t) => out.push(t.token),
            Event::Done { .. } => return out,
            Event::Prompt(_) => {}
            other => panic!("ended with {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_routed_for_an_old_role_is_refused_and_routed_again() {
    let (a, b) = (FakeWorker::new("a", Role::Mixed, 1000), FakeWorker::new("b", Role::Mixed, 1000));
    let r = router(&[&a, &b]);
    let m = Migrating::new(r.clone(), 0);
    // Another process (a fleet planner) makes `b` a prefill worker; this router has
    // not heard. Decodes it sends there are refused before any work and go to `a`.
    let now = b.set_role(Assignment::new(Role::Prefill, Epoch(1))).await.unwrap();
    assert_eq!(now, Assignment::new(Role::Prefill, Epoch(1)));
    let reqs: Vec<_> = (0..8).map(|i| request(i, 40, 12)).collect();
    let streams: Vec<_> = reqs.iter().map(|q| m.generate(q.clone()).unwrap()).collect();
    for (q, s) in reqs.iter().zip(streams) {
        assert_eq!(tokens(s).await, expected(q), "every request whole, once");
    }
    let e = r.workers().snapshot().into_iter().find(|e| e.name() == "b").unwrap();
    assert_eq!(e.assignment(), now, "the refusal taught the router b's role");
    assert_eq!(b.served(), 0, "b decoded nothing after leaving decode");
    assert_eq!(a.served(), 8);
    // A refusal for an old epoch is retryable and says where the worker stands.
    let mut stale = request(99, 20, 4);
    stale.fence = Some(Epoch(0));
    let (tx, _rx) = TokenStream::channel(8);
    let err = b.generate(stale, tx).unwrap_err();
    assert!(err.is_retryable() && err.kind() == "stale_epoch", "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_leaving_decode_finishes_its_sequences_in_place_and_decodes_no_more() {
    let (a, b) = (FakeWorker::new("a", Role::Mixed, 1000), FakeWorker::new("b", Role::Mixed, 1000));
    a.knobs(|k| k.token_interval = Duration::from_millis(5));
    let r = router(&[&a, &b]);
    let m = Migrating::new(r.clone(), 1);
    // A long decode runs on `a` (least loaded, first) when the switch comes.
    let long = request(1, 40, 60);
    let running = m.generate(long.clone()).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let ea = r.workers().snapshot().into_iter().find(|e| e.name() == "a").unwrap();
    let now = r.switch_role(&ea, Role::Prefill).await.unwrap();
    assert_eq!(now, Assignment::new(Role::Prefill, Epoch(1)));
    // New requests decode on `b` and prefill on `a` (its new role), all whole.
    let reqs: Vec<_> = (2..6).map(|i| request(i, 64, 8)).collect();
    let streams: Vec<_> = reqs.iter().map(|q| m.generate(q.clone()).unwrap()).collect();
    for (q, s) in reqs.iter().zip(streams) {
        assert_eq!(tokens(s).await, expected(q));
    }
    assert_eq!(tokens(running).await, expected(&long), "the running decode finished in place, unchanged");
    assert_eq!((a.served(), b.served()), (1, 4), "a decoded only what it had; b took every new decode");
    // Back to mixed: immediate, and a's blocks all came back.
    assert_eq!(r.switch_role(&ea, Role::Mixed).await.unwrap(), Assignment::new(Role::Mixed, Epoch(2)));
    for _ in 0..200 {
        if a.used_blocks() + b.used_blocks() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(a.used_blocks() + b.used_blocks(), 0, "no block leaked across the switches");
}
