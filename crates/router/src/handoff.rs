//! The disaggregated handoff, one task per request:
//!
//! ```text
//! Routed ─► Queued(P) ─► Reserved(D) ─► [Fetching(P)] ─► Prefilling(P) + Transferring ─► DecodeReady ─► Streaming ─► Done
//!    │          │             │               │                  │                           │
//!    └──────────┴─────────────┴───────────────┴──── Failed / Cancelled: release D's reservation; on a prefill
//!                                   failure or timeout, start over once with a spare prefill
//!                                   worker if there is one, else prefill locally on D
//! ```
//!
//! `Fetching(P)`, where the router planned it: P receives a prefix a peer caches
//! (the last answer of a conversation, cached only on the decode worker that
//! generated it) and then computes only the rest; a fetch that fails leaves P to
//! compute everything (see [`crate::fetch`]).
//!
//! One code path for every pair of workers and every transport: D reserves and
//! answers with a token, P prefills into D's [`kv_target`](pdserve_protocol::Worker::kv_target) with that
//! token, D decodes. Every state waits with a deadline and watches the client: a
//! client that leaves cancels at once (dropping P's prefill future stops it), and every
//! exit path releases what the state held. Once D streams, D owns the request and its
//! cancellation.

use crate::cost::{Queue, Ticket, TransferCost, Waiting};
use crate::fetch::{self, Fetch, FetchCtx, FetchPace};
use crate::workers::Entry;
use crate::Ending;
use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{
    Capabilities, DecodeHandoff, Event, EventSender, GenerateRequest, KvDestination, Phase, Prefilled, Reserved,
    ServeError, Telemetry, TokenStream, Usage,
};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument;

/// Per-phase time limits; the prefill limit grows with the prompt.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// Waiting for a slot on the prefill worker (the router's prefill queue).
    pub queue: Duration,
    /// Waiting for D to have room for the prompt's blocks; past it, D prefills the
    /// request itself (its engine queues it).
    pub reserve: Duration,
    pub prefill_base: Duration,
    /// Allowance per prompt token, generous against the measured prefill rate.
    pub prefill_per_token: Duration,
    /// A streaming client that reads nothing for this long is cut off and its
    /// request cancelled (its sequence is paused meanwhile).
    pub client_stall: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            queue: Duration::from_secs(600),
            reserve: Duration::from_secs(10),
            prefill_base: Duration::from_secs(10),
            prefill_per_token: Duration::from_millis(20),
            client_stall: Duration::from_secs(30),
        }
    }
}

impl Deadlines {
    fn prefill(&self, prompt_len: usize) -> Duration {
        self.prefill_base + self.prefill_per_token * prompt_len as u32
    }
}

/// Where a handoff ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// D is streaming the rest (or the first token ended the request).
    Streaming,
    /// The prefill side failed or timed out; D prefills locally instead.
    LocalFallback,
    Cancelled,
    Failed,
}

/// The two workers of one handoff and what governs it.
pub struct Handoff {
    pub prefill: Arc<Entry>,
    pub decode: Arc<Entry>,
    /// Another prefill worker to start over with if the first fails.
    pub spare: Option<Arc<Entry>>,
    /// How the prefill worker sends KV to the decode worker.
    pub via: TransportKind,
    pub transfer: Arc<TransferCost>,
    pub deadlines: Deadlines,
    pub telemetry: Arc<dyn Telemetry>,
    /// A peer's cached prefix the prefill worker fetches before prefilling, where
    /// that was predicted sooner than computing it there.
    pub fetch: Option<(Fetch, Arc<FetchPace>)>,
    /// Prompt tokens the prefill worker is predicted to find cached or to fetch.
    pub cached: usize,
}

impl Handoff {
    /// Makes its spare the prefill worker, leaving no spare; false when it has none.
    fn use_spare(&mut self) -> bool {
        match self.spare.take() {
            Some(spare) => {
                self.prefill = spare;
                // The fetch and the cache hit were predicted for the first worker.
                self.fetch = None;
                self.cached = 0;
                true
            }
            None => false,
        }
    }
}

/// Starts the handoff of `req`, in the current span, on `rt`.
/// `waiting` counts it in the decode worker's backlog until its first token.
/// `end` is settled when it ends (see [`Ending`]).
pub fn start(
    rt: &tokio::runtime::Handle,
    h: Handoff,
    req: GenerateRequest,
    waiting: Waiting,
    end: Ending,
) -> TokenStream {
    let (client, stream) = TokenStream::for_request(&req.params);
    // P's queue counts the prompt from now, not from when the task first runs: a
    // request routed in between would find P idle and queue a prompt there too.
    let queued = queue_on(&h, &req);
    rt.spawn(run(h, req, client, (waiting, queued), end).instrument(tracing::Span::current()));
    stream
}

/// Counts `req` in the queue of `h`'s prefill worker: the prefills it finds ahead,
/// and its ticket. The queue counts the tokens P computes, not those it caches or
/// fetches.
fn queue_on(h: &Handoff, req: &GenerateRequest) -> (Queue, Ticket) {
    let p_load = &h.prefill.prefill;
    (p_load.ahead(), p_load.admit(req.prompt.len() - h.cached.min(req.prompt.len())))
}

enum Wait<T> {
    Done(T),
    TimedOut,
    Cancelled,
}

/// Waits for `fut` unless the deadline passes or the client leaves first.
async fn wait<T>(limit: Duration, client: &EventSender, fut: impl Future<Output = T>) -> Wait<T> {
    tokio::select! {
        r = tokio::time::timeout(limit, fut) => r.map_or(Wait::TimedOut, Wait::Done),
        _ = client.closed() => Wait::Cancelled,
    }
}

fn fail(client: &EventSender, e: ServeError) -> Outcome {
    tracing::warn!(kind = e.kind(), error = %e, "request failed");
    let _ = client.send(Event::Failed(e));
    Outcome::Failed
}

/// D prefills the request itself, its events relayed to the client's stream.
fn fall_back(h: &Handoff, mut req: GenerateRequest, client: EventSender, waiting: Waiting, end: Ending) -> Outcome {
    let d = &h.decode;
    req.fence = Some(d.epoch());
    tracing::info!(decode = d.name(), "prefilling on the decode worker instead");
    let (inner_tx, inner) = TokenStream::for_request(&req.params);
    match d.worker.generate(req, inner_tx) {
        Ok(()) => {
            let holder = end.holder();
            let on_first = move |first: &Event| {
                if matches!(first, Event::Token(_)) {
                    holder.keep(waiting.started());
                }
            };
            let on_end = move |out, cached| end.ended(out, cached);
            let (stall, lost) = (h.deadlines.client_stall, d.clone());
            let on_lost = move || lost.lost_one();
            crate::relay::relay(&tokio::runtime::Handle::current(), inner, client, stall, on_first, on_end, on_lost);
            Outcome::LocalFallback
        }
        Err(e) => fail(&client, d.noted(e)),
    }
}

/// The handoff of `req` from its routing on: `waiting` in D's backlog, and `queued`
/// in P's queue (the prefills it found ahead, and its ticket there).
async fn run(
    h: Handoff,
    req: GenerateRequest,
    client: EventSender,
    (mut waiting, (ahead, ticket)): (Waiting, (Queue, Ticket)),
    end: Ending,
) -> Outcome {
    let id = req.id;
    let d = h.decode.clone();
    let started = Instant::now();
    // Queued(P): wait for a prefill slot first, so D's blocks are held only by
    // prompts about to be prefilled, not by the whole queue.
    let slot = match wait(h.deadlines.queue, &client, h.prefill.slots.clone().acquire_owned()).await {
        Wait::Done(Ok(slot)) => slot,
        Wait::Done(Err(_)) => return fail(&client, ServeError::Internal("the prefill queue closed".into())),
        Wait::TimedOut => return fail(&client, ServeError::Timeout("waiting for a prefill worker".into())),
        Wait::Cancelled => return Outcome::Cancelled,
    };
    let router_queue = started.elapsed().as_secs_f64();
    // Reserved(D): blocks next, so a transfer never arrives where it cannot land.
    let reserved = match reserve(&d, &req, &client, h.deadlines.reserve).await {
        Reserve::Held(reserved) => {
            waiting.holds_blocks();
            reserved
        }
        Reserve::Failed(e) => return fail(&client, d.noted(e)),
        Reserve::Cancelled => return Outcome::Cancelled,
        // D stays full: let its engine queue the request and prefill it there.
        Reserve::Full => {
            drop((slot, ticket));
            h.telemetry.migrated(DECODE_FULL);
            return fall_back(&h, req, client, waiting, end.unpredicted());
        }
    };
    // Fetching(P): what P lacks of a prefix a peer caches, where that was planned.
    let Some(imported) = fetch_into_prefill(&h, &req, &client).await else {
        h.prefill.worker.release(id);
        d.worker.release(id);
        return Outcome::Cancelled;
    };
    // Prefilling(P), frames flowing into D as each layer completes (Transferring).
    let prefilled = prefill(&h, &req, &client, reserved, imported).await;
    drop((slot, ticket));
    let first = match prefilled {
        Ok(first) => {
            observe_prefill(&h, &req, &first, router_queue, ahead);
            first
        }
        Err(Wait::Cancelled) => {
            d.worker.release(id);
            return Outcome::Cancelled;
        }
        // The model's limit holds on every worker. Other refusals may be P's own (a
        // prompt larger than its whole cache), so they fall through: another worker
        // serves the request or repeats the refusal.
        Err(Wait::Done(e @ ServeError::ContextLength { .. })) => {
            d.worker.release(id);
            return fail(&client, e);
        }
        // Prefill failed, its worker is gone, the transfer broke, or it ran past the
        // deadline: start over with the spare prefill worker (D's reservation is
        // released first and taken again, so no frame of the failed attempt counts),
        // or else D prefills locally, on the same client stream.
        Err(why) => return start_over(h, req, client, waiting, end, why).await,
    };
    decode_ready(&d, req, first, client, &h, (waiting, end))
}

/// Fetches into P what it lacks of a prefix a peer caches, where that was planned:
/// the tokens imported (0 when nothing was fetched), or `None` if the client left.
async fn fetch_into_prefill(h: &Handoff, req: &GenerateRequest, client: &EventSender) -> Option<usize> {
    let Some((f, pace)) = &h.fetch else { return Some(0) };
    let ctx = FetchCtx { via: h.via, pace: pace.clone(), telemetry: h.telemetry.clone() };
    match wait(FETCH_ENDS_ITSELF, client, fetch::into(f, &h.prefill, req, None, &ctx)).await {
        Wait::Done(n) => Some(n.unwrap_or(0)),
        _ => None,
    }
}

/// What a finished prefill teaches the cost book and the request's trace: P's time
/// is the router's queue, then P's own queue and compute as P reports them (not D's
/// reservation, the fetch or the link).
fn observe_prefill(h: &Handoff, req: &GenerateRequest, first: &Prefilled, router_queue: f64, ahead: Queue) {
    let computed = req.prompt.len() - first.cached_tokens.min(req.prompt.len());
    let took = router_queue + first.queued_seconds + first.prefill_seconds;
    h.prefill.prefill.observe(ahead, computed, secs(took));
    h.transfer.observe(req.prompt.len(), secs(first.transfer_seconds), first.kv_bytes);
    let phases = [
        (Phase::QueuePrefill, router_queue + first.queued_seconds),
        (Phase::Prefill, first.prefill_seconds),
        (Phase::KvTransfer, first.transfer_seconds),
    ];
    for (phase, s) in phases {
        h.telemetry.phase(phase, s);
    }
    req.trace.update(|t| t.phases.extend(phases));
    h.telemetry.kv_transfer_bytes(h.via, first.kv_bytes);
}

/// The prefill failed, its worker is gone, the transfer broke, or it ran past the
/// deadline: start over with the spare prefill worker (D's reservation is released
/// first and taken again, so no frame of the failed attempt counts), or else D
/// prefills locally, on the same client stream.
async fn start_over(
    mut h: Handoff,
    req: GenerateRequest,
    client: EventSender,
    waiting: Waiting,
    end: Ending,
    why: Wait<ServeError>,
) -> Outcome {
    let why = match why {
        Wait::Done(e) => h.prefill.noted(e).to_string(),
        _ => "it ran past its deadline".to_string(),
    };
    tracing::warn!(prefill = h.prefill.name(), reason = %why, "the prefill failed");
    h.telemetry.migrated(PREFILL_FAILED);
    h.decode.worker.release(req.id);
    if h.use_spare() {
        tracing::info!(prefill = h.prefill.name(), "starting over on the spare prefill worker");
        let queued = queue_on(&h, &req);
        return Box::pin(run(h, req, client, (waiting, queued), end.unpredicted())).await;
    }
    fall_back(&h, req, client, waiting, end.unpredicted())
}

/// How long the handoff waits on a fetch: `fetch::into` gives up at its own
/// deadline, so the handoff only watches for the client going away.
const FETCH_ENDS_ITSELF: Duration = Duration::MAX;
/// The migration reason of a request whose prefill moved to a spare worker or to D.
const PREFILL_FAILED: &str = "prefill_failed";
/// The migration reason of a request prefilled on D because D had no room for its
/// transfer within the reserve deadline.
const DECODE_FULL: &str = "decode_full";

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or_default()
}

enum Reserve {
    Held(Reserved),
    /// D had no room for the whole reserve deadline.
    Full,
    Failed(ServeError),
    Cancelled,
}

/// How often a full decode worker is asked again for blocks.
const RESERVE_RETRY: Duration = Duration::from_millis(20);

/// Reserves the prompt's blocks on D, retrying while D is full (its decodes finish and
/// free blocks) until `limit`; every exit but `Held` leaves nothing reserved: giving
/// up drops the call and releases, in case D granted it meanwhile.
async fn reserve(d: &Entry, req: &GenerateRequest, client: &EventSender, limit: Duration) -> Reserve {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match wait(left, client, d.worker.reserve(req.id, req.prompt.len(), Some(d.epoch()))).await {
            Wait::Done(Ok(reserved)) => return Reserve::Held(reserved),
            Wait::Done(Err(ServeError::Overloaded(_))) if Instant::now() + RESERVE_RETRY < deadline => {
                if let Wait::Cancelled = wait(RESERVE_RETRY, client, std::future::pending::<()>()).await {
                    return Reserve::Cancelled;
                }
            }
            Wait::Done(Err(ServeError::Overloaded(_))) => return Reserve::Full,
            Wait::Done(Err(e)) => return Reserve::Failed(e),
            Wait::TimedOut => {
                d.worker.release(req.id);
                return Reserve::Full;
            }
            Wait::Cancelled => {
                d.worker.release(req.id);
                return Reserve::Cancelled;
            }
        }
    }
}

/// Runs the prefill on P, its KV going into D's reservation: the first token once D
/// holds every frame, or why not. Giving up drops P's call, which stops P.
async fn prefill(
    h: &Handoff,
    req: &GenerateRequest,
    client: &EventSender,
    reserved: Reserved,
    imported: usize,
) -> Result<Prefilled, Wait<ServeError>> {
    let Some(target) = h.decode.worker.kv_target(h.via) else {
        let e = format!("worker {} receives no KV over {}", h.decode.name(), h.via);
        if imported > 0 {
            h.prefill.worker.release(req.id);
        }
        return Err(Wait::Done(ServeError::Internal(e)));
    };
    let fenced = GenerateRequest { fence: Some(h.prefill.epoch()), ..req.clone() };
    let to = KvDestination::reserved(target, reserved);
    let call = match imported {
        0 => h.prefill.worker.prefill(fenced, to),
        n => match h.prefill.worker.peering() {
            Ok(peer) => peer.prefill_imported(fenced, n, to),
            Err(e) => {
                // What an import refused always does: the reservation goes.
                h.prefill.worker.release(req.id);
                Box::pin(std::future::ready(Err(e)))
            }
        },
    };
    match wait(h.deadlines.prefill(req.prompt.len()), client, call).await {
        Wait::Done(Ok(first)) => Ok(first),
        Wait::Done(Err(e)) => Err(Wait::Done(e)),
        Wait::TimedOut => Err(Wait::TimedOut),
        Wait::Cancelled => Err(Wait::Cancelled),
    }
}

/// DecodeReady: the first token goes to the client at once, then D takes over.
fn decode_ready(
    d: &Entry,
    req: GenerateRequest,
    first: Prefilled,
    client: EventSender,
    h: &Handoff,
    (waiting, end): (Waiting, Ending),
) -> Outcome {
    let id = req.id;
    if let Some(scores) = first.prompt_logprobs.clone() {
        let _ = client.send(Event::Prompt(scores));
    }
    if let Some(embedding) = first.embedding.clone() {
        let _ = client.send(Event::Embedding(embedding));
    }
    if client.send(Event::Token(first.token.clone())).is_err() {
        d.worker.release(id);
        return Outcome::Cancelled;
    }
    end.holder().keep(waiting.started());
    if let Some(reason) = first.finished {
        d.worker.release(id);
        let usage =
            Usage { prompt_tokens: first.prompt_tokens, completion_tokens: 1, cached_tokens: first.cached_tokens };
        let _ = client.send(Event::Done { reason, usage });
        return Outcome::Streaming;
    }
    // D's events pass through a relay that times D's first decode step (queue_decode).
    let (inner_tx, inner) = TokenStream::for_request(&req.params);
    let handed = Instant::now();
    let trace = req.trace.clone();
    let handoff = DecodeHandoff {
        id,
        tag: req.tag,
        prompt: req.prompt,
        first: first.token.token,
        params: req.params,
        cached_tokens: first.cached_tokens,
    };
    match d.worker.decode(handoff, inner_tx) {
        Ok(()) => {
            let telemetry = h.telemetry.clone();
            let on_first = move |_: &Event| {
                let s = handed.elapsed().as_secs_f64();
                telemetry.phase(Phase::QueueDecode, s);
                trace.update(|t| t.phases.push((Phase::QueueDecode, s)));
            };
            let stall = h.deadlines.client_stall;
            // The first token came from the prefill: one more than the relay sees.
            let on_end = move |out, cached| end.ended(1 + out, cached);
            let lost = h.decode.clone();
            let on_lost = move || lost.lost_one();
            crate::relay::relay(&tokio::runtime::Handle::current(), inner, client, stall, on_first, on_end, on_lost);
            Outcome::Streaming
        }
        Err(e) => {
            d.worker.release(id);
            fail(&client, d.noted(e))
        }
    }
}
