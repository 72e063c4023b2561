//! Speculation across the router's moves: a worker leaving decode hands its drafting
//! sequences back, each is prefilled again on that worker from its caches (the
//! target's and the draft model's) and decodes on the other, its draft K/V shipped
//! with the target's, with the tokens of an uninterrupted plain run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{collect, collect_all, local_with, model, request, rt, settle, worker, PROMPTS};
use pdserve_engine::batch::{DraftModel, EngineConfig, SpecConfig};
use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{Event, Generate, GenerateRequest, ServeError, TokenStream, Worker};
use pdserve_router::{Deadlines, Migrating, Mode, Router};
use pdserve_types::{Assignment, DraftRecord, Epoch, Role};
use pdserve_worker::LocalWorker;
use std::sync::Arc;
use std::time::Duration;

/// A mixed worker whose drafts come from the default model itself (every greedy
/// draft is right, so speculation runs at every step).
fn drafting(name: &str) -> LocalWorker {
    let draft = DraftModel::new(model().model.clone(), "self", &model().model).unwrap();
    let speculation = Some(SpecConfig { max_draft: 4, verify_all: true, draft: Some(draft) });
    local_with(name, Role::Mixed, EngineConfig { threads: 1, num_blocks: 256, speculation, ..Default::default() })
}

/// Requests 0 and 1: two prompts, so that neither worker's caches hold the other's.
fn long(id: u64) -> GenerateRequest {
    let mut r = request(id, PROMPTS[1 + id as usize % 2], 240);
    r.params.ignore_eos = true;
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drafting_sequence_moved_by_a_role_switch_takes_its_draft_kv_along() {
    let alone = Router::new([worker("alone", Role::Mixed)], Mode::Aggregated, Deadlines::default(), rt());
    let mut want = Vec::new();
    for i in 0..2 {
        want.push(collect(alone.generate(long(i)).unwrap()).await.0);
    }
    let (a, b) = (drafting("sa"), drafting("sb"));
    let workers: [Arc<dyn Worker>; 2] = [Arc::new(a.clone()), Arc::new(b.clone())];
    let r =
        Arc::new(Router::new(workers, Mode::Auto, Deadlines::default(), rt()).with_transport(TransportKind::Inproc));
    let front = Migrating::new(r.clone(), 0);
    let streams: Vec<TokenStream> = (0..2).map(|i| front.generate(long(10 + i)).unwrap()).collect();
    // Both decode (one on each worker) before `sa` leaves decode.
    for _ in 0..2000 {
        if a.stats().await.unwrap().running > 0 && b.stats().await.unwrap().running > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = b.stats().await.unwrap().spec;
    let ea = r.workers().snapshot().into_iter().find(|e| e.name() == "sa").unwrap();
    r.switch_role(&ea, Role::Prefill).await.unwrap();
    assert_eq!(ea.worker.role_switch().unwrap().move_decodes().await.unwrap(), 1, "sa hands back the one it decodes");
    for ((got, end), want) in collect_all(streams).await.into_iter().zip(want) {
        assert!(matches!(end, Event::Done { .. }), "{end:?}");
        assert_eq!(got, want, "the uninterrupted greedy tokens");
    }
    let after = b.stats().await.unwrap().spec;
    assert_eq!(after.draft_prompt_tokens, before.draft_prompt_tokens, "sb computed the moved draft K/V again");
    assert!(after.accepted > before.accepted, "sb drafted for the moved request: {after:?}");
    assert_eq!(a.stats().await.unwrap().running, 0);
    assert_eq!(settle(&[&a, &b]).await, 0);
    for w in [&a, &b] {
        assert_eq!(w.stats().await.unwrap().draft_blocks.map(|d| d.used), Some(0), "{}", w.name());
    }
}

/// A sequence a role switch hands back brings its record of drafts with it, which the
/// router gives the request on its next worker (`replayed` in its migration), so that
/// worker plans the request's drafts from it instead of learning them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_handed_back_brings_its_record_of_drafts() {
    let a = drafting("sa");
    let req = long(20);
    let (events, stream) = TokenStream::for_request(&req.params);
    a.generate(req, events).unwrap();
    // Past 8 tokens, after which the stream says the record a first time.
    for _ in 0..2000 {
        if a.stats().await.unwrap().spec.accepted >= 12 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let roles = a.role_switch().unwrap();
    roles.set_role(Assignment::new(Role::Prefill, Epoch(1))).await.unwrap();
    assert_eq!(roles.move_decodes().await.unwrap(), 1);
    let (got, said, end) = with_drafts(stream).await;
    let Event::Failed(ServeError::Moved { worker, drafts: Some(record) }) = end else { panic!("{end:?}") };
    assert_eq!(worker, "sa");
    // Every drafted token is right here, and at least one step verified a draft.
    assert!(record.accepted > 0 && record.accepted <= record.tried, "{record:?} after {} tokens", got.len());
    assert!(record.accepted < got.len() as u64, "{record:?} after {} tokens", got.len());
    // On the way the stream said the record now and then (what a lost worker's
    // request brings to its next worker), each said growing, none past the last.
    assert!(!said.is_empty(), "no record said in {} tokens", got.len());
    let grows = |a: &DraftRecord, b: &DraftRecord| a.tried < b.tried && a.accepted <= b.accepted;
    assert!(said.windows(2).all(|w| grows(&w[0], &w[1])), "{said:?}");
    assert!(said.iter().all(|d| d.tried <= record.tried && d.accepted <= record.accepted), "{said:?} {record:?}");
    assert_eq!(settle(&[&a]).await, 0);
}

/// A stream's tokens, the records of drafts it said, and its end.
async fn with_drafts(mut s: TokenStream) -> (Vec<u32>, Vec<DraftRecord>, Event) {
    let (mut toks, mut said) = (Vec::new(), Vec::new());
    loop {
        match s.next().await.expect("stream ended without a final event") {
            Event::Token(t) => toks.push(t.token),
            Event::Drafts(d) => said.push(d),
            last => return (toks, said, last),
        }
    }
}
