//! The KV pool across workers, on the real model: a conversation's history cached on
//! a worker busy with a long prompt is fetched by an idle worker that joined later,
//! between two of the holder's steps, instead of recomputed or queued behind the
//! long prompt. The turn's tokens equal one engine computing everything, the engine
//! reports exactly the fetched tokens as reused, the fetched blocks join the
//! fetcher's cache, and no block is left in use anywhere. In this process and across
//! the control protocol over TCP.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{collect, local, model, remotes, request, rt, serve, settle, worker};

use pdserve_kv_transfer::TransportKind;
use pdserve_kv_transfer::{HandoffToken, KvTarget};
use pdserve_protocol::{
    DecodeHandoff, Event, EventSender, Generate, GenerateRequest, KvDestination, KvEventLog, Phase, PrefillRoute,
    Prefilled, PrefixPeer, Reply, RoleSwitch, ServeError, Telemetry, Worker, WorkerInfo, WorkerStats,
};
use pdserve_router::{Deadlines, Mode, Router};
use pdserve_types::{Epoch, RequestId, Role};
use pdserve_worker::LocalWorker;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the router reported: fetches (tokens, why one fell back), indexed blocks,
/// and predicted against realized cache hits.
#[derive(Default)]
struct Seen {
    fetches: Mutex<Vec<(usize, Option<&'static str>)>>,
    indexed: Mutex<usize>,
    hits: Mutex<Vec<(usize, usize)>>,
}

impl Seen {
    /// Waits up to 5 s for the router's index to hold `blocks` blocks; whether it does.
    async fn indexed_at_least(&self, blocks: usize) -> bool {
        for _ in 0..500 {
            if *self.indexed.lock().unwrap() >= blocks {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }
}

impl Telemetry for Seen {
    fn phase(&self, _: Phase, _: f64) {}
    fn route(&self, _: PrefillRoute) {}
    fn kv_transfer_bytes(&self, _: TransportKind, _: u64) {}
    fn migrated(&self, _: &'static str) {}
    fn kv_index(&self, _: &[f64], _: usize, blocks: usize) {
        *self.indexed.lock().unwrap() = blocks;
    }
    fn prefix_hit(&self, predicted: usize, realized: usize, _: Option<&'static str>) {
        self.hits.lock().unwrap().push((predicted, realized));
    }
    fn prefix_fetched(&self, tokens: usize, _: f64, fell_back: Option<&'static str>) {
        self.fetches.lock().unwrap().push((tokens, fell_back));
    }
}

const HISTORY: &str = "User: I am planning a trip through the mountains next spring and would like some advice. \
I will be travelling with two friends, we have about ten days, and none of us has done much hiking before. \
We would like to see lakes, small villages and perhaps a glacier, and we prefer to sleep in huts rather than tents. \
Assistant: That sounds like a wonderful plan. With ten days and little hiking experience, I would suggest \
starting with short valley walks for the first two days, then moving on to a hut-to-hut route of moderate \
difficulty, with a rest day in the middle. Pack light, bring layers for changing weather, and book the huts \
early, because they fill up quickly in the season. User: Thank you. What should we eat on the way, and do the \
huts serve meals, or should we carry our own food for the whole route? We would also like to know whether \
we need special boots, and how heavy our packs should be at most. Assistant: Most staffed huts serve a \
hearty dinner and a simple breakfast, so you only need to carry lunch and snacks: bread, cheese, dried \
fruit, nuts and chocolate travel well. Sturdy hiking boots with good ankle support are enough for \
marked trails; break them in before the trip. Keep each pack under about a fifth of your body weight, \
and remember a rain jacket, a warm hat, sun cream, a small first aid kit and a headlamp. User: That is \
very helpful. Is it safe to walk on a glacier without a guide? Assistant: No: crevasses can hide under \
snow bridges even late in the season. Walk on a glacier only with a certified guide, rope and crampons, \
or admire it from the marked viewpoints and moraine trails, which are safe and often the most beautiful. \
User:";

fn greedy(id: u64, text: &str, max_tokens: u32) -> GenerateRequest {
    let mut r = request(id, text, max_tokens);
    r.params.ignore_eos = true;
    r
}

/// A long prompt nobody has cached.
fn long_prompt() -> String {
    (0..40).map(|i| format!("Line {i}: the quick brown fox jumps over the lazy dog near the river bank. ")).collect()
}

/// Sends the router's only worker a long prompt and gives it time to start the
/// step. The router counts the prompt in that worker's queue until its first token,
/// over half a second away on any machine, whatever the engine reports meanwhile
/// (mid-step it repeats its last answer, from before the prompt arrived over TCP).
async fn busy_with_a_long_prompt(r: &Router) -> pdserve_protocol::TokenStream {
    let busy = r.generate(greedy(3, &long_prompt(), 8)).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    busy
}

/// `holder` serves the history alone, then a long prompt; `fetcher` joins while the
/// long prompt is prefilled there, and the next turn goes to it with the history
/// fetched. With `warm`, the fetcher has served that text first, which shares the
/// history's beginning: only the rest of the history moves. Checks everything the
/// module says; `locals` are the two engines.
async fn fetch_while_the_holder_is_busy(
    [holder, fetcher]: [Arc<dyn Worker>; 2],
    locals: [&LocalWorker; 2],
    via: TransportKind,
    warm: Option<&str>,
) {
    let turn = format!("{HISTORY} Which month is best for the glacier?");
    let alone = Router::new([worker("alone", Role::Mixed)], Mode::Aggregated, Deadlines::default(), rt());
    let (want, _) = collect(alone.generate(greedy(1, &turn, 24)).unwrap()).await;

    let seen = Arc::new(Seen::default());
    let r = Arc::new(
        Router::new([holder], Mode::Aggregated, Deadlines::default(), rt())
            .with_transport(via)
            .with_telemetry(seen.clone()),
    );
    r.follow_kv_events();
    let (_, end) = collect(r.generate(greedy(2, HISTORY, 1)).unwrap()).await;
    assert!(matches!(end, Event::Done { .. }), "{end:?}");
    let history_blocks = (model().tokenizer.encode(HISTORY, false).len() - 1) / 16;
    assert!(seen.indexed_at_least(history_blocks).await, "the router's index never saw the history");

    let (kept, unique) = match warm {
        Some(w) => kept_of(w, locals[1]).await,
        None => (0, 0),
    };
    assert!(warm.is_none() || kept > 0, "the warm text shares no block with the history");
    let busy = busy_with_a_long_prompt(&r).await;
    r.workers().add(fetcher);
    seen.indexed_at_least(history_blocks + unique).await;
    let (got, end) = collect(r.generate(greedy(4, &turn, 24)).unwrap()).await;
    let Event::Done { usage, .. } = end else { panic!("the turn failed: {end:?}") };
    assert_eq!(got, want, "the tokens of one engine computing everything");

    let fetches = seen.fetches.lock().unwrap().clone();
    assert_eq!(fetches.len(), 1, "one fetch: {fetches:?}");
    let (sent, fell_back) = fetches[0];
    assert_eq!(fell_back, None);
    assert_eq!(sent, (history_blocks - kept) * 16, "every whole block of the history the fetcher lacked");
    let fetched = history_blocks * 16;
    assert_eq!(usage.cached_tokens, fetched, "the engine reused what it kept and what was fetched");
    // Checked as the stream ends, just after its last event.
    for _ in 0..200 {
        if seen.hits.lock().unwrap().len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let hits = seen.hits.lock().unwrap().clone();
    assert!(hits.contains(&(fetched, fetched)), "predicted = realized: {hits:?}");
    let (_, end) = collect(busy).await;
    assert!(matches!(end, Event::Done { .. }), "{end:?}");
    assert_eq!(settle(&locals).await, 0, "a block is left in use");
    // The fetcher caches the history now: its next turn would hit locally.
    assert!(locals[1].stats().await.unwrap().blocks.cached >= history_blocks);
}

/// Has `fetcher` serve `warm`; the history's blocks it then caches, and the blocks
/// of `warm` it caches that the history does not share.
async fn kept_of(warm: &str, fetcher: &LocalWorker) -> (usize, usize) {
    let (tx, rx) = pdserve_protocol::TokenStream::channel(8);
    fetcher.generate(greedy(9, warm, 1), tx).unwrap();
    collect(rx).await;
    let (w, h) = (model().tokenizer.encode(warm, false), model().tokenizer.encode(HISTORY, false));
    let common = w.iter().zip(&h).take_while(|(a, b)| a == b).count();
    let cached = (w.len() - 1) / 16;
    let kept = (common / 16).min(cached);
    (kept, cached - kept)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_workers_prefix_is_fetched_by_an_idle_one_in_process() {
    let (a, b) = (local("holder", Role::Mixed, 256), local("fetcher", Role::Mixed, 256));
    let workers: [Arc<dyn Worker>; 2] = [Arc::new(a.clone()), Arc::new(b.clone())];
    fetch_while_the_holder_is_busy(workers, [&a, &b], TransportKind::Inproc, None).await;
}

/// The start of the history, then another turn: what the fetcher already caches.
fn other_conversation() -> String {
    let start = HISTORY.find("Assistant:").unwrap();
    format!(
        "{}Assistant: Have you thought about a guided tour instead? A local guide knows the huts, the weather \
         and the safest trails, and can adapt the route to your group every day.",
        &HISTORY[..start]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_sends_only_the_blocks_the_fetcher_lacks_in_process() {
    let (a, b) = (local("pholder", Role::Mixed, 256), local("pfetcher", Role::Mixed, 256));
    let workers: [Arc<dyn Worker>; 2] = [Arc::new(a.clone()), Arc::new(b.clone())];
    fetch_while_the_holder_is_busy(workers, [&a, &b], TransportKind::Inproc, Some(&other_conversation())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_sends_only_the_blocks_the_fetcher_lacks_over_tcp() {
    let (a, b) = (serve("qholder", Role::Mixed).await, serve("qfetcher", Role::Mixed).await);
    let warm = other_conversation();
    fetch_while_the_holder_is_busy(remotes(&a, &b), [&a.local, &b.local], TransportKind::Tcp, Some(&warm)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_workers_prefix_is_fetched_by_an_idle_one_over_tcp() {
    let (a, b) = (serve("rholder", Role::Mixed).await, serve("rfetcher", Role::Mixed).await);
    fetch_while_the_holder_is_busy(remotes(&a, &b), [&a.local, &b.local], TransportKind::Tcp, None).await;
}

/// Disaggregated: the decode worker `d` caches a whole conversation (as after
/// decoding an earlier turn's answer) of which the prefill worker `p` caches only
/// the start. The next turn's prefill on `p` fetches the rest from `d` instead of
/// recomputing it, then sends the whole prompt's KV to `d` as usual. The tokens
/// equal one engine's, `p` reports what it kept and fetched as reused, both
/// predicted and realized, and no block is left in use on either.
async fn prefill_fetches_from_the_decoder(
    [p, d]: [Arc<dyn Worker>; 2],
    [lp, ld]: [&LocalWorker; 2],
    via: TransportKind,
) {
    let turn = format!("{HISTORY} Which month is best for the glacier?");
    let alone = Router::new([worker("alone3", Role::Mixed)], Mode::Aggregated, Deadlines::default(), rt());
    let (want, _) = collect(alone.generate(greedy(1, &turn, 24)).unwrap()).await;
    let (tx, rx) = pdserve_protocol::TokenStream::channel(8);
    ld.generate(greedy(2, HISTORY, 1), tx).unwrap();
    collect(rx).await;
    let (kept, unique) = kept_of(&other_conversation(), lp).await;
    assert!(kept > 0, "the prefill worker caches the conversation's start");

    let seen = Arc::new(Seen::default());
    let r = Router::new([p, d], Mode::Disaggregated, Deadlines::default(), rt())
        .with_transport(via)
        .with_telemetry(seen.clone());
    let r = Arc::new(r);
    r.follow_kv_events();
    let history_blocks = (model().tokenizer.encode(HISTORY, false).len() - 1) / 16;
    seen.indexed_at_least(history_blocks + unique).await;
    let (got, end) = collect(r.generate(greedy(4, &turn, 24)).unwrap()).await;
    let Event::Done { usage, .. } = end else { panic!("the turn failed: {end:?}") };
    assert_eq!(got, want, "the tokens of one engine computing everything");
    let fetches = seen.fetches.lock().unwrap().clone();
    assert_eq!(fetches, vec![((history_blocks - kept) * 16, None)], "one fetch of what the prefill worker lacked");
    let fetched = history_blocks * 16;
    assert_eq!(usage.cached_tokens, fetched, "the prefill engine reused what it kept and what was fetched");
    for _ in 0..200 {
        if !seen.hits.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(seen.hits.lock().unwrap().clone(), vec![(fetched, fetched)], "predicted = realized");
    assert_eq!(settle(&[lp, ld]).await, 0, "a block is left in use");
    assert!(lp.stats().await.unwrap().blocks.cached >= history_blocks, "the fetched blocks joined p's cache");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_fetches_what_the_decode_worker_caches_in_process() {
    let (p, d) = (local("fp", Role::Prefill, 256), local("fd", Role::Decode, 256));
    let workers: [Arc<dyn Worker>; 2] = [Arc::new(p.clone()), Arc::new(d.clone())];
    prefill_fetches_from_the_decoder(workers, [&p, &d], TransportKind::Inproc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_fetches_what_the_decode_worker_caches_over_tcp() {
    let (p, d) = (serve("tp", Role::Prefill).await, serve("td", Role::Decode).await);
    prefill_fetches_from_the_decoder(remotes(&p, &d), [&p.local, &d.local], TransportKind::Tcp).await;
}

/// A worker whose exports fail (its link breaks): everything else is `0`'s.
struct BrokenExport(LocalWorker);

impl Worker for BrokenExport {
    fn info(&self) -> &WorkerInfo {
        self.0.info()
    }
    fn load(&self) -> usize {
        self.0.load()
    }
    fn is_alive(&self) -> bool {
        true
    }
    fn generate(&self, req: GenerateRequest, events: EventSender) -> Result<(), ServeError> {
        self.0.generate(req, events)
    }
    fn kv_target(&self, via: TransportKind) -> Option<KvTarget> {
        self.0.kv_target(via)
    }
    fn reserve(&self, id: RequestId, prompt_len: usize, fence: Option<Epoch>) -> Reply<'_, pdserve_protocol::Reserved> {
        self.0.reserve(id, prompt_len, fence)
    }
    fn prefill(&self, req: GenerateRequest, to: KvDestination) -> Reply<'static, Prefilled> {
        self.0.prefill(req, to)
    }
    fn decode(&self, handoff: DecodeHandoff, events: EventSender) -> Result<(), ServeError> {
        self.0.decode(handoff, events)
    }
    fn release(&self, id: RequestId) {
        self.0.release(id)
    }
    fn stats(&self) -> Reply<'_, WorkerStats> {
        self.0.stats()
    }
    fn kv_event_log(&self) -> Option<&dyn KvEventLog> {
        self.0.kv_event_log()
    }
    fn prefix_peer(&self) -> Option<&dyn PrefixPeer> {
        Some(self)
    }
}

impl PrefixPeer for BrokenExport {
    fn reserve_after(&self, id: RequestId, n: usize, keep: Vec<u32>, fence: Option<Epoch>) -> Reply<'_, HandoffToken> {
        self.0.reserve_after(id, n, keep, fence)
    }
    fn prefill_imported(&self, req: GenerateRequest, n: usize, to: KvDestination) -> Reply<'static, Prefilled> {
        self.0.prefill_imported(req, n, to)
    }
    fn export_prefix(&self, _: RequestId, _: Vec<u32>, _: usize, _: KvDestination) -> Reply<'static, usize> {
        Box::pin(async { Err(ServeError::Internal("the KV link broke".into())) })
    }
    fn generate_imported(&self, req: GenerateRequest, n: usize, events: EventSender) -> Result<(), ServeError> {
        self.0.generate_imported(req, n, events)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_that_fails_recomputes_instead_and_leaks_nothing() {
    let turn = format!("{HISTORY} And which month for the lakes?");
    let alone = Router::new([worker("alone2", Role::Mixed)], Mode::Aggregated, Deadlines::default(), rt());
    let (want, _) = collect(alone.generate(greedy(1, &turn, 8)).unwrap()).await;
    let (a, b) = (local("ha", Role::Mixed, 256), local("hb", Role::Mixed, 256));
    let seen = Arc::new(Seen::default());
    let holder: Arc<dyn Worker> = Arc::new(BrokenExport(a.clone()));
    let r = Arc::new(Router::new([holder], Mode::Aggregated, Deadlines::default(), rt()).with_telemetry(seen.clone()));
    r.follow_kv_events();
    collect(r.generate(greedy(2, HISTORY, 1)).unwrap()).await;
    let history_blocks = (model().tokenizer.encode(HISTORY, false).len() - 1) / 16;
    seen.indexed_at_least(history_blocks).await;
    let busy = busy_with_a_long_prompt(&r).await;
    r.workers().add(Arc::new(b.clone()));
    let (got, end) = collect(r.generate(greedy(4, &turn, 8)).unwrap()).await;
    let Event::Done { usage, .. } = end else { panic!("the turn failed: {end:?}") };
    assert_eq!(got, want);
    assert_eq!(usage.cached_tokens, 0, "recomputed on the fetcher");
    let fetches = seen.fetches.lock().unwrap().clone();
    assert_eq!(fetches, vec![(0, Some("internal"))], "the fetch fell back");
    collect(busy).await;
    assert_eq!(settle(&[&a, &b]).await, 0, "the fetcher's reservation was released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_switch_that_overtakes_a_fetch_gives_its_blocks_back() {
    // The receiver reserved and got the frames, then left decode before the request
    // could start there: refused for its stale epoch, with the blocks released.
    let (a, b) = (local("sa", Role::Mixed, 256), local("sb", Role::Mixed, 256));
    collect({
        let (tx, rx) = pdserve_protocol::TokenStream::channel(8);
        a.generate(greedy(1, HISTORY, 1), tx).unwrap();
        rx
    })
    .await;
    let req = greedy(2, &format!("{HISTORY} When do the huts open?"), 4);
    let tokens = (req.prompt.len() - 1) / 16 * 16;
    let epoch = b.stats().await.unwrap().assignment.unwrap();
    let token = b.reserve(req.id, tokens, Some(epoch.epoch)).await.unwrap().token;
    let to = KvDestination::plain(b.kv_target(TransportKind::Inproc).unwrap(), token);
    assert_eq!(a.export_prefix(req.id, req.prompt[..tokens].to_vec(), 0, to).await.unwrap(), tokens);
    b.set_role(epoch.switch(Role::Prefill)).await.unwrap();
    let (tx, _rx) = pdserve_protocol::TokenStream::channel(8);
    let fenced = GenerateRequest { fence: Some(epoch.epoch), ..req };
    let err = b.generate_imported(fenced, tokens, tx).unwrap_err();
    assert!(matches!(err, ServeError::StaleEpoch { .. }), "{err:?}");
    assert_eq!(settle(&[&a, &b]).await, 0, "the reservation was given back");
}
