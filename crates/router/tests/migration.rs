//! Request migration over fake workers: a worker lost mid-stream, the request
//! resumed elsewhere by token replay, the client's stream unbroken.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{Event, Generate, GenerateRequest, PrefillRoute, ServeError, TokenStream, Usage, Worker};
use pdserve_router::{Deadlines, Migrating, Mode, Router};
use pdserve_testkit::fake::{token_at, FakeWorker};
use pdserve_types::{RequestId, Role, SamplingParams};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The reason of every move.
#[derive(Default)]
struct Moves(Mutex<Vec<&'static str>>);

impl Moves {
    fn of(&self, reason: &str) -> usize {
        self.0.lock().unwrap().iter().filter(|r| **r == reason).count()
    }
}

impl pdserve_protocol::Telemetry for Moves {
    fn phase(&self, _: pdserve_protocol::Phase, _: f64) {}
    fn route(&self, _: PrefillRoute) {}
    fn kv_transfer_bytes(&self, _: TransportKind, _: u64) {}
    fn migrated(&self, reason: &'static str) {
        self.0.lock().unwrap().push(reason);
    }
}

fn request(prompt_len: u32, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        fence: None,
        id: RequestId(7),
        tag: "t7".into(),
        prompt: (0..prompt_len).map(|i| 1000 + i * 7).collect(),
        params: SamplingParams { max_tokens, ..Default::default() }.validate().unwrap(),
        trace: Default::default(),
    }
}

fn expected(req: &GenerateRequest) -> Vec<u32> {
    (0..req.params.max_tokens as usize).map(|i| token_at(&req.prompt, i)).collect()
}

/// A router over `workers` behind migration allowing `max` moves, and its move count.
fn migrating(workers: &[&FakeWorker], mode: Mode, max: u32) -> (Migrating, Arc<Moves>) {
    let moves = Arc::new(Moves::default());
    let ws = workers.iter().map(|w| Arc::new((*w).clone()) as Arc<dyn Worker>);
    let r = Router::new(ws, mode, Deadlines::default(), tokio::runtime::Handle::current())
        .with_transport(TransportKind::Inproc)
        .with_telemetry(moves.clone());
    (Migrating::new(Arc::new(r), max), moves)
}

/// Reads `n` tokens, then kills `victim` and reads the rest: the tokens and the end.
async fn kill_after(s: TokenStream, n: usize, victim: &FakeWorker) -> (Vec<u32>, Event) {
    read(s, |read| {
        if read == n {
            victim.kill();
        }
    })
    .await
}

/// Reads the stream to its end, calling `on_token` with the count read so far.
async fn read(mut s: TokenStream, mut on_token: impl FnMut(usize)) -> (Vec<u32>, Event) {
    let mut toks = Vec::new();
    loop {
        match s.next().await.expect("a final event") {
            Event::Token(t) => {
                toks.push(t.token);
                on_token(toks.len());
            }
            Event::Prompt(_) => {}
            last => return (toks, last),
        }
    }
}

/// Every one of `workers` gives its blocks back (within 2 s).
async fn no_blocks_held(workers: &[&FakeWorker]) {
    for w in workers {
        for _ in 0..200 {
            if w.used_blocks() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(w.used_blocks(), 0, "{} keeps no block", w.info().name);
    }
}

fn slow(w: &FakeWorker) -> &FakeWorker {
    w.knobs(|k| k.token_interval = Duration::from_millis(5));
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_worker_lost_mid_stream_hands_the_request_on_with_no_token_lost() {
    let (a, b) = (FakeWorker::new("a", Role::Mixed, 1000), FakeWorker::new("b", Role::Mixed, 1000));
    let (r, moves) = migrating(&[slow(&a), slow(&b)], Mode::Aggregated, 1);
    let req = request(40, 30);
    let (got, end) = kill_after(r.generate(req.clone()).unwrap(), 10, &a).await;
    assert_eq!(got, expected(&req), "no duplicate, no gap, the uninterrupted text");
    let Event::Done { usage, .. } = end else { panic!("ended with {end:?}") };
    assert_eq!(usage, Usage { prompt_tokens: 40, completion_tokens: 30, cached_tokens: 0 });
    assert_eq!((a.served(), b.served()), (1, 1));
    assert_eq!(moves.of("worker_lost"), 1);
}

/// A speculating request's stream says its record of drafts now and then; when its
/// worker is lost, the last record said goes to its next worker with the replay, so
/// that one need not learn the request's acceptance again. No record reaches the
/// client (`read` would end at one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_workers_request_brings_the_record_of_drafts_its_stream_last_said() {
    let (a, b) = (FakeWorker::new("a", Role::Mixed, 1000), FakeWorker::new("b", Role::Mixed, 1000));
    for w in [&a, &b] {
        w.knobs(|k| k.drafts = true);
    }
    let (r, moves) = migrating(&[slow(&a), slow(&b)], Mode::Aggregated, 1);
    let req = request(20, 40);
    let (got, end) = kill_after(r.generate(req.clone()).unwrap(), 5, &a).await;
    assert_eq!(got, expected(&req));
    assert!(matches!(end, Event::Done { .. }), "{end:?}");
    assert_eq!(moves.of("worker_lost"), 1);
    // `a` said two drafts tried and one accepted a token, after each of the k tokens
    // the client had from it (5 at least, fewer than all): `b` starts from that.
    assert_eq!(a.drafts_brought(), [None]);
    let brought = b.drafts_brought();
    let [Some(d)] = brought[..] else { panic!("{brought:?}") };
    assert!(d.tried == 2 * d.accepted && (5..40).contains(&d.accepted), "{d:?}");
    no_blocks_held(&[&a, &b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_lost_after_a_handoff_resumes_on_another_decode_worker() {
    let p = FakeWorker::new("p", Role::Prefill, 1000);
    let (d1, d2) = (FakeWorker::new("d1", Role::Decode, 1000), FakeWorker::new("d2", Role::Decode, 1000));
    let (r, moves) = migrating(&[&p, slow(&d1), slow(&d2)], Mode::Disaggregated, 1);
    let req = request(64, 24);
    let (got, end) = kill_after(r.generate(req.clone()).unwrap(), 6, &d1).await;
    assert_eq!(got, expected(&req));
    assert!(matches!(end, Event::Done { .. }), "{end:?}");
    assert_eq!(d2.served(), 1, "the replayed request decoded on the other decode worker");
    assert_eq!(moves.of("worker_lost"), 1);
    no_blocks_held(&[&p, &d2]).await;
}

/// A decode worker that stays connected but ends a request as lost (a stage group's
/// head without a stage) is taken out at once: the request moves to the other decode
/// worker, not back to it, and so does the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_that_answers_as_lost_gets_no_more_work() {
    let p = FakeWorker::new("p", Role::Prefill, 1000);
    let (d1, d2) = (FakeWorker::new("d1", Role::Decode, 1000), FakeWorker::new("d2", Role::Decode, 1000));
    let (r, moves) = migrating(&[&p, slow(&d1), slow(&d2)], Mode::Disaggregated, 1);
    let req = request(64, 24);
    let (got, end) = read(r.generate(req.clone()).unwrap(), |n| {
        if n == 6 {
            d1.lose_a_stage()
        }
    })
    .await;
    assert_eq!(got, expected(&req));
    assert!(matches!(end, Event::Done { .. }), "{end:?}");
    let next = request(48, 8);
    let (got, end) = read(r.generate(next.clone()).unwrap(), |_| {}).await;
    assert_eq!(got, expected(&next));
    assert!(matches!(end, Event::Done { .. }), "{end:?}");
    assert_eq!((d1.served(), d2.served()), (1, 2), "both went to the other decode worker");
    assert_eq!(moves.of("worker_lost"), 1);
    no_blocks_held(&[&p, &d2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_lost_on_its_way_to_the_decode_worker_is_prefilled_again_with_no_token_lost() {
    let p = FakeWorker::new("p", Role::Prefill, 1000);
    let d = FakeWorker::new("d", Role::Decode, 1000);
    d.knobs(|k| k.lose_transfers = 1.into());
    let (r, moves) = migrating(&[&p, &d], Mode::Disaggregated, 1);
    let req = request(64, 24);
    let (got, end) = read(r.generate(req.clone()).unwrap(), |_| {}).await;
    assert_eq!(got, expected(&req), "the first token once, then the rest");
    assert!(matches!(end, Event::Done { .. }), "{end:?}");
    assert_eq!((moves.of("kv_lost"), moves.of("worker_lost")), (1, 0));
    assert_eq!(d.served(), 1, "decoded once, after the second transfer");
    no_blocks_held(&[&p, &d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_are_bounded_and_zero_turns_migration_off() {
    let (a, b, c) = (
        FakeWorker::new("a", Role::Mixed, 1000),
        FakeWorker::new("b", Role::Mixed, 1000),
        FakeWorker::new("c", Role::Mixed, 1000),
    );
    // One move allowed: the first loss moves the request, the second ends it.
    let (r, moves) = migrating(&[slow(&a), slow(&b), slow(&c)], Mode::Aggregated, 1);
    let mut s = r.generate(request(20, 40)).unwrap();
    let mut seen = 0;
    let end = loop {
        match s.next().await.unwrap() {
            Event::Token(_) => {
                seen += 1;
                // Kill whichever worker serves it now: a first, then the one it moved to.
                if seen == 5 {
                    a.kill();
                }
                if seen == 12 {
                    [&b, &c].iter().filter(|w| w.served() == 1).for_each(|w| w.kill());
                }
            }
            last => break last,
        }
    };
    assert!(matches!(end, Event::Failed(ServeError::WorkerLost(_))), "{end:?}");
    assert_eq!(moves.of("worker_lost"), 1);
    assert_eq!(b.served() + c.served(), 1, "no second move");

    let (x, y) = (FakeWorker::new("x", Role::Mixed, 1000), FakeWorker::new("y", Role::Mixed, 1000));
    let (r, moves) = migrating(&[slow(&x), slow(&y)], Mode::Aggregated, 0);
    let (got, end) = kill_after(r.generate(request(20, 40)).unwrap(), 5, &x).await;
    assert!(got.len() < 40 && matches!(end, Event::Failed(ServeError::WorkerLost(_))), "{end:?}");
    assert_eq!((y.served(), moves.of("worker_lost")), (0, 0));
}
