//! The disaggregated handoff, one task per request:
//!
//! ```text
//! Routed ─► Reserved(D) ─► Prefilling(P) + Transferring ─► DecodeReady ─► Streaming ─► Done
//!    │           │                  │                           │
//!    └───────────┴──── Failed / Cancelled: abort D's reservation; on a prefill
//!                      failure or timeout, start over once with a spare prefill
//!                      worker if there is one, else prefill locally on D
//! ```
//!
//! Every state waits with a deadline and watches the client: a client that leaves
//! cancels at once, and every exit path releases what the state held (D's reserved
//! blocks). Once D streams, D's worker loop owns the request and its cancellation.

use crate::cost::{PrefillLoad, TransferCost};
use crate::node::Node;
use pdserve_kv_transfer::{HandoffId, Inboxes, KvTransport, TransferError};
use pdserve_protocol::{Event, EventSender, GenerateRequest, Phase, ServeError, Telemetry, TokenStream, Usage};
use pdserve_remote::linked::{forward, SharedSink};
use pdserve_remote::{CancelOnDrop, Prefilled};
use pdserve_worker::{FirstToken, FrameSink, Worker};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

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
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            queue: Duration::from_secs(600),
            reserve: Duration::from_secs(10),
            prefill_base: Duration::from_secs(10),
            prefill_per_token: Duration::from_millis(20),
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
pub struct Hop {
    pub p: Node,
    pub d: Node,
    /// P's queue and rate, for `auto`'s cost model.
    pub p_load: Arc<PrefillLoad>,
    /// P's prefill slots: a handoff holds one from before reserving on D until P is done.
    pub p_slots: Arc<tokio::sync::Semaphore>,
    /// Another prefill worker to start over with if P fails.
    pub spare: Option<Prefiller>,
    pub transfer: Arc<TransferCost>,
    pub deadlines: Deadlines,
    pub telemetry: Arc<dyn Telemetry>,
    /// Workers in this process: `None` hands frames straight into D's queue (no
    /// copy); a link ships them over TCP or shared memory.
    pub link: Option<Arc<KvLink>>,
    /// Workers in other processes: the transport P uses to reach D ("tcp", "shm").
    pub remote_transport: &'static str,
}

/// A prefill worker with its queue figures and slots.
pub struct Prefiller {
    pub node: Node,
    pub load: Arc<PrefillLoad>,
    pub slots: Arc<tokio::sync::Semaphore>,
}

impl Hop {
    /// This hop with its spare as P, and no spare left; `None` without a spare.
    fn with_spare(mut self) -> Option<Hop> {
        let spare = self.spare.take()?;
        Some(Hop { p: spare.node, p_load: spare.load, p_slots: spare.slots, ..self })
    }
}

/// A transport for KV frames and the inboxes its receiver fills on D's side.
pub struct KvLink {
    pub transport: Arc<dyn KvTransport>,
    pub inboxes: Inboxes,
}

/// How this handoff's KV travels, and what must happen once P is done.
enum Transfer {
    /// Frames went straight into D's queue.
    Direct,
    /// Over a link inside this process: finish the sink, then drain D's inbox.
    Linked { sink: SharedSink, forward: tokio::task::JoinHandle<bool> },
    /// Between worker processes: P finished its sink before answering, and D
    /// checks every frame arrived when told to decode. Dropping the guard before P
    /// answered cancels P's prefill.
    Remote(CancelOnDrop),
}

/// Starts the handoff of `req` from prefill worker `hop.p` to decode worker `hop.d`.
pub fn start(rt: &tokio::runtime::Handle, hop: Hop, req: GenerateRequest) -> TokenStream {
    let (client, stream) = TokenStream::channel(req.params.max_tokens as usize + 4);
    rt.spawn(run(hop, req, client));
    stream
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
    let _ = client.send(Event::Failed(e));
    Outcome::Failed
}

pub async fn run(hop: Hop, req: GenerateRequest, client: EventSender) -> Outcome {
    let id = req.id;
    let d = hop.d.clone();
    let started = Instant::now();
    let ticket = hop.p_load.admit(req.prompt.len());
    let ahead = hop.p_load.queued() - req.prompt.len();
    // Queued(P): wait for a prefill slot first, so D's blocks are held only by
    // prompts about to be prefilled, not by the whole queue.
    let slot = match wait(hop.deadlines.queue, &client, hop.p_slots.clone().acquire_owned()).await {
        Wait::Done(Ok(slot)) => slot,
        Wait::Done(Err(_)) => return fail(&client, ServeError::Internal("the prefill queue closed".into())),
        Wait::TimedOut => return fail(&client, ServeError::Timeout("waiting for a prefill worker".into())),
        Wait::Cancelled => return Outcome::Cancelled,
    };
    let router_queue = started.elapsed().as_secs_f64();
    // Reserved(D): blocks next, so a transfer never arrives where it cannot land.
    match reserve(&d, &req, &client, hop.deadlines.reserve).await {
        Reserve::Held => {}
        Reserve::Failed(e) => return fail(&client, e),
        Reserve::Cancelled => return Outcome::Cancelled,
        // D stays full: let its engine queue the request and prefill it there.
        Reserve::Full => {
            drop((slot, ticket));
            return match d.generate_into(req, client.clone()) {
                Ok(()) => Outcome::LocalFallback,
                Err(e) => fail(&client, e),
            };
        }
    }
    // Prefilling(P), frames flowing into D as each layer completes (Transferring).
    let prefilled = prefill(&hop, &req, &client).await;
    drop((slot, ticket));
    let first = match prefilled {
        Ok(first) => {
            hop.p_load.observe(ahead, req.prompt.len(), started.elapsed());
            hop.telemetry.phase(Phase::QueuePrefill, router_queue + first.queued_seconds);
            hop.telemetry.phase(Phase::Prefill, first.prefill_seconds);
            first
        }
        Err(Wait::Cancelled) => {
            d.abort_import(id);
            return Outcome::Cancelled;
        }
        // The model's limit holds on every worker. Other refusals may be P's own (a
        // prompt larger than its whole cache), so they fall through: another worker
        // serves the request or repeats the refusal.
        Err(Wait::Done(e @ ServeError::ContextLength { .. })) => {
            d.abort_import(id);
            return fail(&client, e);
        }
        // Prefill failed, its worker is gone, the transfer broke, or it ran past the
        // deadline: start over with the spare prefill worker (D's reservation is
        // released first and taken again, so no frame of the failed attempt counts),
        // or else D prefills locally, on the same client stream.
        Err(_) => {
            d.abort_import(id);
            if let Some(next) = hop.with_spare() {
                return Box::pin(run(next, req, client)).await;
            }
            return match d.generate_into(req, client.clone()) {
                Ok(()) => Outcome::LocalFallback,
                Err(e) => fail(&client, e),
            };
        }
    };
    decode_ready(&d, req, first, client, hop.telemetry.clone())
}

enum Reserve {
    Held,
    /// D had no room for the whole reserve deadline.
    Full,
    Failed(ServeError),
    Cancelled,
}

/// How often a full decode worker is asked again for blocks.
const RESERVE_RETRY: Duration = Duration::from_millis(20);

/// Reserves the prompt's blocks on D, retrying while D is full (its decodes finish and
/// free blocks) until `limit`; every exit but `Held` leaves nothing reserved.
async fn reserve(d: &Node, req: &GenerateRequest, client: &EventSender, limit: Duration) -> Reserve {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let answer = match d.reserve(req.id, req.prompt.len()) {
            Ok(rx) => wait(left, client, rx).await,
            Err(e) => Wait::Done(Ok(Err(e))),
        };
        match answer {
            Wait::Done(Ok(Ok(()))) => return Reserve::Held,
            Wait::Done(Ok(Err(ServeError::Overloaded(_)))) if Instant::now() + RESERVE_RETRY < deadline => {
                if let Wait::Cancelled = wait(RESERVE_RETRY, client, std::future::pending::<()>()).await {
                    return Reserve::Cancelled;
                }
            }
            Wait::Done(Ok(Err(ServeError::Overloaded(_)))) => return Reserve::Full,
            Wait::Done(Ok(Err(e))) => return Reserve::Failed(e),
            Wait::Done(Err(_)) => return Reserve::Failed(ServeError::NoWorker(format!("worker {} stopped", d.name()))),
            Wait::TimedOut => {
                d.abort_import(req.id);
                return Reserve::Full;
            }
            Wait::Cancelled => {
                d.abort_import(req.id);
                return Reserve::Cancelled;
            }
        }
    }
}

/// Runs the prefill on P and moves its KV into D's reservation: the first token once
/// D holds every frame, or why not.
async fn prefill(hop: &Hop, req: &GenerateRequest, client: &EventSender) -> Result<FirstToken, Wait<ServeError>> {
    let limit = hop.deadlines.prefill(req.prompt.len());
    let broken = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let (transfer, rx) = start_prefill(hop, req, client, &broken, &bytes).map_err(Wait::Done)?;
    let first = match wait(limit, client, rx).await {
        Wait::Done(Ok(Ok(first))) => Ok(first),
        Wait::Done(Ok(Err(e))) => Err(Wait::Done(e)),
        Wait::Done(Err(_)) => Err(Wait::Done(ServeError::NoWorker(format!("worker {} stopped", hop.p.name())))),
        Wait::TimedOut => Err(Wait::TimedOut),
        Wait::Cancelled => Err(Wait::Cancelled),
    };
    let tail = Instant::now();
    let delivered = match transfer {
        Transfer::Direct => first.is_ok(),
        Transfer::Linked { sink, forward } if first.is_ok() => finish_link(sink, forward).await,
        Transfer::Linked { forward, .. } => {
            forward.abort();
            false
        }
        Transfer::Remote(guard) => {
            if first.is_ok() {
                guard.done();
            }
            first.is_ok()
        }
    };
    hop.transfer.observe(req.prompt.len(), tail.elapsed());
    if delivered {
        hop.telemetry.phase(Phase::KvTransfer, tail.elapsed().as_secs_f64());
    }
    let remote_bytes = first.as_ref().map_or(0, |(_, b)| *b);
    hop.telemetry.kv_transfer_bytes(transport_name(hop), bytes.load(Ordering::Relaxed) + remote_bytes);
    let (first, _) = first?;
    if !delivered || broken.load(Ordering::SeqCst) {
        return Err(Wait::Done(ServeError::Internal("the KV transfer broke".into())));
    }
    Ok(first)
}

fn transport_name(hop: &Hop) -> &'static str {
    match (&hop.p, &hop.link) {
        (Node::Remote(_), _) => hop.remote_transport,
        (_, Some(link)) => link.transport.name(),
        (_, None) => "inproc",
    }
}

/// Resolves to P's first token and the KV bytes P reported sending (remote only;
/// in this process the frame sinks count them), or an error if P is gone.
type FirstRx = Pin<Box<dyn Future<Output = Result<Prefilled, oneshot::error::RecvError>> + Send>>;

/// Starts P's prefill with its frames going to D by whichever path the pair allows.
fn start_prefill(
    hop: &Hop,
    req: &GenerateRequest,
    client: &EventSender,
    broken: &Arc<AtomicBool>,
    bytes: &Arc<AtomicU64>,
) -> Result<(Transfer, FirstRx), ServeError> {
    let id = req.id;
    match (&hop.p, &hop.d) {
        (Node::Local(p), Node::Local(d)) => {
            let (transfer, sink) = match &hop.link {
                None => (Transfer::Direct, frame_sink(d.clone(), id, broken.clone(), client.clone(), bytes.clone())),
                Some(link) => open_link(link, d, id, broken, client, bytes)
                    .map_err(|e| ServeError::Internal(format!("KV transfer: {e}")))?,
            };
            let rx = p.prefill(req.clone(), sink)?;
            Ok((transfer, Box::pin(async move { rx.await.map(|r| r.map(|f| (f, 0))) })))
        }
        (Node::Remote(p), Node::Remote(d)) => {
            let to = d.kv_addr(hop.remote_transport).ok_or_else(|| {
                ServeError::Internal(format!("worker {} has no {} KV receiver", d.name(), hop.remote_transport))
            })?;
            let call = p.prefill_to(req.clone(), to)?;
            Ok((Transfer::Remote(call.guard), Box::pin(call.result)))
        }
        _ => Err(ServeError::Internal("a handoff needs both workers in this process or both remote".into())),
    }
}

/// DecodeReady: the first token goes to the client at once, then D takes over.
fn decode_ready(
    d: &Node,
    req: GenerateRequest,
    first: FirstToken,
    client: EventSender,
    telemetry: Arc<dyn Telemetry>,
) -> Outcome {
    let id = req.id;
    if client.send(Event::Token(first.token.clone())).is_err() {
        d.abort_import(id);
        return Outcome::Cancelled;
    }
    if let Some(reason) = first.finished {
        d.abort_import(id);
        let usage =
            Usage { prompt_tokens: first.prompt_tokens, completion_tokens: 1, cached_tokens: first.cached_tokens };
        let _ = client.send(Event::Done { reason, usage });
        return Outcome::Streaming;
    }
    // D's events pass through a relay that times D's first decode step (queue_decode).
    let (inner_tx, inner) = TokenStream::channel(req.params.max_tokens as usize + 4);
    let handed = Instant::now();
    match d.finish_import(id, req.prompt, first.token.token, req.params, inner_tx) {
        Ok(()) => {
            let on_first = move |_: &Event| telemetry.phase(Phase::QueueDecode, handed.elapsed().as_secs_f64());
            crate::relay::relay(&tokio::runtime::Handle::current(), inner, client, on_first);
            Outcome::Streaming
        }
        Err(e) => {
            d.abort_import(id);
            fail(&client, e)
        }
    }
}

/// Forwards frames to D; a frame D cannot queue, or a client that left, breaks the
/// transfer (the prefill side then stops sending).
fn frame_sink(
    d: Worker,
    id: pdserve_types::RequestId,
    broken: Arc<AtomicBool>,
    client: EventSender,
    bytes: Arc<AtomicU64>,
) -> FrameSink {
    Box::new(move |frame| {
        if broken.load(Ordering::SeqCst) || client.is_closed() {
            return false;
        }
        bytes.fetch_add(2 * (frame.k.len() + frame.v.len()) as u64, Ordering::Relaxed);
        let ok = d.frame(id, frame).is_ok();
        if !ok {
            broken.store(true, Ordering::SeqCst);
        }
        ok
    })
}

/// Opens a linked transfer: D's inbox first (so the first frame has somewhere to go),
/// a task that forwards it into D's reservation, and P's sink over the transport.
fn open_link(
    link: &KvLink,
    d: &Worker,
    id: pdserve_types::RequestId,
    broken: &Arc<AtomicBool>,
    client: &EventSender,
    bytes: &Arc<AtomicU64>,
) -> Result<(Transfer, FrameSink), TransferError> {
    let hid = HandoffId(id.0);
    let forward = forward(link.inboxes.expect(hid)?, d.clone(), id);
    let sink = SharedSink::new(link.transport.open(hid)?);
    let client = client.clone();
    let frames = sink.frame_sink(hid, move || client.is_closed(), broken.clone(), bytes.clone());
    Ok((Transfer::Linked { sink, forward }, frames))
}

/// Ends a linked transfer after P is done: the sink's finish waits until the receiver
/// holds every frame, then the forwarder drains them into D.
async fn finish_link(sink: SharedSink, forward: tokio::task::JoinHandle<bool>) -> bool {
    if !sink.finish().await {
        forward.abort();
        return false;
    }
    forward.await.unwrap_or(false)
}
