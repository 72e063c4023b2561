//! The disaggregated handoff, one task per request:
//!
//! ```text
//! Routed ─► Reserved(D) ─► Prefilling(P) + Transferring ─► DecodeReady ─► Streaming ─► Done
//!    │           │                  │                           │
//!    └───────────┴──── Failed / Cancelled: abort D's reservation; on a prefill
//!                      failure or timeout, prefill locally on D instead
//! ```
//!
//! Every state waits with a deadline and watches the client: a client that leaves
//! cancels at once, and every exit path releases what the state held (D's reserved
//! blocks). Once D streams, D's worker loop owns the request and its cancellation.

use pdserve_kv_transfer::{Frame, HandoffId, Inboxes, KvSink, KvTransport, TransferError};
use pdserve_protocol::{Event, EventSender, GenerateRequest, Phase, ServeError, Telemetry, TokenStream, Usage};
use pdserve_worker::{FirstToken, FrameSink, Worker};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Per-phase time limits; the prefill limit grows with the prompt.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub reserve: Duration,
    pub prefill_base: Duration,
    /// Allowance per prompt token, generous against the measured prefill rate.
    pub prefill_per_token: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            reserve: Duration::from_secs(5),
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
    pub p: Worker,
    pub d: Worker,
    pub deadlines: Deadlines,
    pub telemetry: Arc<dyn Telemetry>,
    /// `None`: frames go straight into D's queue (same process, no copy).
    pub link: Option<Arc<KvLink>>,
}

/// A transport for KV frames and the inboxes its receiver fills on D's side.
pub struct KvLink {
    pub transport: Arc<dyn KvTransport>,
    pub inboxes: Inboxes,
}

/// The sending half of a linked transfer, shared by P's frame sink (which sends) and
/// the handoff task (which finishes it once P is done).
type SharedSink = Arc<Mutex<Option<Box<dyn KvSink>>>>;

/// A linked transfer in flight: its sink and the task forwarding D's inbox into D.
struct Linked {
    sink: SharedSink,
    forward: tokio::task::JoinHandle<bool>,
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
    let Hop { p, d, deadlines: dl, telemetry, link } = hop;
    let id = req.id;
    // Reserved(D): blocks first, so a transfer never arrives where it cannot land.
    let reserved = match d.reserve(id, req.prompt.len()) {
        Ok(rx) => wait(dl.reserve, &client, rx).await,
        Err(e) => return fail(&client, e),
    };
    match reserved {
        Wait::Done(Ok(Ok(()))) => {}
        Wait::Done(Ok(Err(e))) => return fail(&client, e),
        Wait::Done(Err(_)) => return fail(&client, ServeError::NoWorker(format!("worker {} stopped", d.name()))),
        Wait::TimedOut => {
            d.abort_import(id);
            return fail(&client, ServeError::Timeout("reserving KV blocks".into()));
        }
        Wait::Cancelled => {
            d.abort_import(id);
            return Outcome::Cancelled;
        }
    }
    // Prefilling(P), frames flowing into D as each layer completes (Transferring).
    let broken = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let (sink, linked) = match &link {
        None => (frame_sink(d.clone(), id, broken.clone(), client.clone(), bytes.clone()), None),
        Some(link) => match open_link(link, &d, id, &broken, &client, &bytes) {
            Ok((sink, linked)) => (sink, Some(linked)),
            Err(e) => {
                d.abort_import(id);
                return fail(&client, ServeError::Internal(format!("KV transfer: {e}")));
            }
        },
    };
    let transport = link.as_ref().map_or("inproc", |l| l.transport.name());
    let started = Instant::now();
    let first = match p.prefill(req.clone(), sink) {
        Ok(rx) => wait(dl.prefill(req.prompt.len()), &client, rx).await,
        Err(_) => Wait::TimedOut,
    };
    telemetry.phase(Phase::Prefill, started.elapsed().as_secs_f64());
    // Over a link, D must hold every frame before it may decode.
    let delivered = match linked {
        Some(l) if matches!(first, Wait::Done(Ok(Ok(_)))) => finish_link(l).await,
        Some(l) => {
            l.forward.abort();
            false
        }
        None => true,
    };
    if !delivered {
        broken.store(true, Ordering::SeqCst);
    }
    telemetry.kv_transfer_bytes(transport, bytes.load(Ordering::Relaxed));
    let first = match first {
        Wait::Done(Ok(Ok(first))) if !broken.load(Ordering::SeqCst) => first,
        Wait::Cancelled => {
            d.abort_import(id);
            return Outcome::Cancelled;
        }
        Wait::Done(Ok(Err(e @ (ServeError::Invalid(_) | ServeError::ContextLength { .. })))) => {
            d.abort_import(id);
            return fail(&client, e);
        }
        // Prefill failed, its worker is gone, the transfer broke, or it ran past the
        // deadline: D prefills locally, on the same client stream.
        _ => {
            d.abort_import(id);
            return match d.generate_into(req, client.clone()) {
                Ok(()) => Outcome::LocalFallback,
                Err(e) => fail(&client, e),
            };
        }
    };
    decode_ready(&d, req, first, client)
}

/// DecodeReady: the first token goes to the client at once, then D takes over.
fn decode_ready(d: &Worker, req: GenerateRequest, first: FirstToken, client: EventSender) -> Outcome {
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
    match d.finish_import(id, req.prompt, first.token.token, req.params, client.clone()) {
        Ok(()) => Outcome::Streaming,
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
) -> Result<(FrameSink, Linked), TransferError> {
    let hid = HandoffId(id.0);
    let mut inbox = link.inboxes.expect(hid)?;
    let (d, fwd_bytes) = (d.clone(), bytes.clone());
    let forward = tokio::spawn(async move {
        loop {
            match inbox.recv().await {
                Ok(Some(f)) => {
                    fwd_bytes.fetch_add(f.payload_bytes() as u64, Ordering::Relaxed);
                    if d.frame(id, f.into_kv()).is_err() {
                        return false;
                    }
                }
                Ok(None) => return true,
                Err(_) => return false,
            }
        }
    });
    let shared: SharedSink = Arc::new(Mutex::new(Some(link.transport.open(hid)?)));
    let (sink_shared, broken, client) = (shared.clone(), broken.clone(), client.clone());
    let sink: FrameSink = Box::new(move |frame| {
        if broken.load(Ordering::SeqCst) || client.is_closed() {
            return false;
        }
        let mut guard = sink_shared.lock().unwrap_or_else(|e| e.into_inner());
        let ok = guard.as_mut().is_some_and(|s| s.send(Frame::from_kv(hid, frame)).is_ok());
        if !ok {
            broken.store(true, Ordering::SeqCst);
        }
        ok
    });
    Ok((sink, Linked { sink: shared, forward }))
}

/// Ends a linked transfer after P is done: the sink's finish waits (off the async
/// workers) until the receiver holds every frame, then the forwarder drains them into D.
async fn finish_link(l: Linked) -> bool {
    let sink = l.sink.lock().unwrap_or_else(|e| e.into_inner()).take();
    let Some(sink) = sink else {
        l.forward.abort();
        return false;
    };
    let finished = tokio::task::spawn_blocking(move || sink.finish().is_ok()).await.unwrap_or(false);
    if !finished {
        l.forward.abort();
        return false;
    }
    l.forward.await.unwrap_or(false)
}
