//! The contract between the hops of the request path:
//!
//! - the frontend hands a [`GenerateRequest`] to whatever implements [`Generate`]
//!   (the router) and reads an [`Event`] stream back;
//! - the router drives workers through one surface, [`Worker`] ([`worker`]), the same
//!   for a worker in this process, in another process, or simulated.
//!
//! Dropping a [`TokenStream`] cancels its request: every hop watches its sender for
//! closure and stops work at once. Everything here is token-level; text (templates,
//! detokenization, stop strings) belongs to the frontend.

pub mod worker;

pub use pdserve_types::{FinishReason, TokenOut};
pub use worker::{
    unsupported, Capabilities, DecodeHandoff, KvCursor, KvDestination, KvEventLog, KvEvents, LinkProbe, Prefilled,
    PrefixPeer, Reply, Reserved, RoleState, RoleSwitch, Worker, WorkerInfo, WorkerStats,
};

use pdserve_types::{Assignment, DraftRecord, Epoch, RequestId, SamplingParams, TokenId};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;
use tokio::sync::{mpsc, Notify};

/// A validated, tokenized request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Internal: unique per request, random, never shown to clients.
    pub id: RequestId,
    /// The id clients and operators know the request by (`X-Request-Id`), carried to
    /// every hop so each process logs it.
    pub tag: RequestTag,
    pub prompt: Vec<TokenId>,
    pub params: SamplingParams,
    /// The epoch of the receiving worker's role that the router routed for; a worker
    /// at another epoch refuses the call ([`ServeError::StaleEpoch`]). `None`: any.
    #[serde(default)]
    pub fence: Option<Epoch>,
    /// Where the request ran and how long its phases took, for its lifecycle record.
    /// Never sent to another process.
    #[serde(skip)]
    pub trace: Trace,
}

/// What the router learns about one request as it goes, shared with the frontend
/// that reports the request when it ends. Empty (and ignored) unless made with
/// [`Trace::new`].
#[derive(Clone, Default)]
pub struct Trace(Option<Arc<std::sync::Mutex<TraceData>>>);

#[derive(Debug, Clone, Default)]
pub struct TraceData {
    pub route: Option<PrefillRoute>,
    pub prefill: Option<String>,
    pub decode: Option<String>,
    /// Seconds per phase, as the hops measured them.
    pub phases: Vec<(Phase, f64)>,
}

impl Trace {
    pub fn new() -> Trace {
        Trace(Some(Arc::default()))
    }

    pub fn update(&self, f: impl FnOnce(&mut TraceData)) {
        if let Some(m) = &self.0 {
            f(&mut m.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        }
    }

    pub fn get(&self) -> TraceData {
        self.0.as_ref().map(|m| m.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()).unwrap_or_default()
    }
}

impl fmt::Debug for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Trace")
    }
}

/// The public id of a request: the client's `X-Request-Id`, or one the frontend made.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RequestTag(pub Arc<str>);

impl RequestTag {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestTag {
    fn from(s: &str) -> Self {
        RequestTag(s.into())
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from a prefix cache.
    pub cached_tokens: usize,
}

/// What a request's stream carries, in order: the prompt's scores (only when asked
/// for, before the first token), tokens, then exactly one `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// Each prompt token from the second on, scored given the tokens before it.
    Prompt(Vec<TokenOut>),
    /// The prompt's pooled final hidden states, when the request asked for them.
    Embedding(Vec<f32>),
    Token(TokenOut),
    /// What the sequence's drafted tokens came to so far, now and then while it
    /// speculates: the router keeps the latest, so that a request whose worker is
    /// lost brings it to its next one. Never sent on to a client.
    Drafts(DraftRecord),
    Done {
        reason: FinishReason,
        usage: Usage,
    },
    Failed(ServeError),
}

impl Event {
    /// Whether this event ends the stream.
    pub fn is_last(&self) -> bool {
        matches!(self, Event::Done { .. } | Event::Failed(_))
    }
}

/// How far a stream's consumer may fall behind its producer. A client that stops
/// reading must not keep a sequence computing (or its stream buffering) forever:
/// a hop that forwards a stream waits once [`WINDOW`](pace::WINDOW) events are unread
/// downstream, so events pile up at the worker, which pauses the sequence at
/// [`PAUSE_AT`](pace::PAUSE_AT) unread and resumes it below
/// [`RESUME_BELOW`](pace::RESUME_BELOW). The router cancels a stream whose client read
/// nothing for its stall deadline.
pub mod pace {
    pub const WINDOW: usize = 32;
    pub const PAUSE_AT: usize = 64;
    pub const RESUME_BELOW: usize = 16;
}

/// The receiving end of a request. Drop it to cancel.
pub struct TokenStream {
    rx: mpsc::Receiver<Event>,
    /// Told each time an event is taken, so a producer can wait for its consumer.
    taken: Arc<Notify>,
}

impl TokenStream {
    /// A stream and the sender a worker writes to. `capacity` bounds the events in
    /// flight; producers that must never block size it to the request's max tokens.
    pub fn channel(capacity: usize) -> (EventSender, TokenStream) {
        let (tx, rx) = mpsc::channel(capacity.max(2));
        let taken = Arc::new(Notify::new());
        (EventSender { tx, taken: taken.clone() }, TokenStream { rx, taken })
    }

    /// A stream with room for every event a request with `params` can make (a
    /// token each, and the events around them), so its producer never waits.
    pub fn for_request(params: &pdserve_types::SamplingParams) -> (EventSender, TokenStream) {
        TokenStream::channel(params.max_tokens as usize + 4)
    }

    /// The next event, or `None` when the producer is gone without a final event
    /// (callers treat that as an internal error).
    pub async fn next(&mut self) -> Option<Event> {
        let e = self.rx.recv().await;
        self.taken.notify_waiters();
        e
    }

    /// Blocking variant for non-async callers and tests.
    pub fn blocking_next(&mut self) -> Option<Event> {
        let e = self.rx.blocking_recv();
        self.taken.notify_waiters();
        e
    }
}

/// The producing end of a request's stream.
#[derive(Clone)]
pub struct EventSender {
    tx: mpsc::Sender<Event>,
    taken: Arc<Notify>,
}

impl EventSender {
    /// Sends without waiting; fails when the client is gone (cancel the request) or
    /// the channel is full (the producer sized it too small).
    pub fn send(&self, e: Event) -> Result<(), Gone> {
        self.tx.try_send(e).map_err(|_| Gone)
    }

    /// Events sent and not yet taken: how far the consumer is behind.
    pub fn unread(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    /// Resolves once fewer than `n` events are unread, or the consumer is gone.
    pub async fn room(&self, n: usize) {
        loop {
            // Registered before the check, so a take between the two still wakes us.
            let taken = self.taken.notified();
            if self.unread() < n || self.tx.is_closed() {
                return;
            }
            tokio::select! {
                _ = taken => {}
                _ = self.tx.closed() => return,
            }
        }
    }

    /// True once the consumer dropped its stream: the request is cancelled.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Resolves when the consumer drops its stream.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// The consumer of a stream is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gone;

/// Why a request could not be served; mapped to an HTTP status once, in the frontend.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum ServeError {
    /// The request is malformed or out of range (400).
    #[error("{0}")]
    Invalid(String),
    /// Prompt plus max_tokens exceed the model's context (400).
    #[error("this model's maximum context length is {context} tokens, but the request needs {needed} ({prompt} in the prompt plus max_tokens)")]
    ContextLength { context: usize, prompt: usize, needed: usize },
    /// Admission refused the request (429).
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// The request would wait longer than the admission limit to start (429, with
    /// `Retry-After: retry_s`).
    #[error("overloaded: the request would wait about {wait_s} s to start, over the limit of {limit_s} s")]
    QueueFull { wait_s: u64, limit_s: u64, retry_s: u64 },
    /// The request's first token is predicted later than the time-to-first-token
    /// objective admission holds to (429, with `Retry-After: retry_s`): refused
    /// before any of it is computed.
    #[error("overloaded: the first token is predicted in about {predicted_ms} ms, over the objective of {slo_ms} ms")]
    SloInfeasible { predicted_ms: u64, slo_ms: u64, retry_s: u64 },
    /// With the request in its batch, its decode worker's step (the time per output
    /// token of every sequence there) is predicted past the objective admission
    /// holds to (429, with `Retry-After: retry_s`): refused before any of it is
    /// computed.
    #[error("overloaded: with this request its decode worker is predicted at about {predicted_ms} ms per output token, over the objective of {slo_ms} ms")]
    TpotInfeasible { predicted_ms: u64, slo_ms: u64, retry_s: u64 },
    /// No worker can take the request (503).
    #[error("no worker available: {0}")]
    NoWorker(String),
    /// A phase ran past its deadline (504).
    #[error("timed out: {0}")]
    Timeout(String),
    /// Shutting down; no new requests (503).
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The worker serving the request stopped answering (its process died or its
    /// connection broke) (503). The router may move the request elsewhere.
    #[error("worker lost: {0}")]
    WorkerLost(String),
    /// The KV a handoff sent to the decode worker did not land whole there (a frame
    /// it could not take, or the transfer outlasted its grace): nothing of the
    /// request ran on it, and the router prefills the request again (503).
    #[error("KV transfer lost: {0}")]
    KvLost(String),
    /// The worker changed role since the router looked (a role switch): the call was
    /// refused before any work, and the router routes it again.
    #[error("worker {worker} is now {now}, not at the epoch routed for")]
    StaleEpoch { worker: String, now: Assignment },
    /// The worker stopped decoding (a role switch) and handed the sequence back
    /// mid-stream: its KV stays in `worker`'s prefix cache, and the router moves the
    /// request on from there (503 if it reaches a client), with `drafts`, the
    /// sequence's record of drafted tokens (none where it drafted nothing).
    #[error("worker {worker} left decode; the request moves to another worker")]
    Moved {
        worker: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        drafts: Option<DraftRecord>,
    },
    /// A bug (500).
    #[error("internal error: {0}")]
    Internal(String),
}

impl ServeError {
    /// A stable, machine-readable name for logs and error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            ServeError::Invalid(_) => "invalid_request",
            ServeError::ContextLength { .. } => "context_length_exceeded",
            ServeError::Overloaded(_) => "overloaded",
            ServeError::QueueFull { .. } => "queue_full",
            ServeError::SloInfeasible { .. } | ServeError::TpotInfeasible { .. } => "slo_infeasible",
            ServeError::NoWorker(_) => "no_worker",
            ServeError::Timeout(_) => "timeout",
            ServeError::ShuttingDown => "shutting_down",
            ServeError::WorkerLost(_) => "worker_lost",
            ServeError::KvLost(_) => "kv_lost",
            ServeError::StaleEpoch { .. } => "stale_epoch",
            ServeError::Moved { .. } => "moved",
            ServeError::Internal(_) => "internal",
        }
    }

    /// Seconds a refused client should wait before trying again (`Retry-After`):
    /// admission's refusals only.
    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            ServeError::QueueFull { retry_s, .. }
            | ServeError::SloInfeasible { retry_s, .. }
            | ServeError::TpotInfeasible { retry_s, .. } => Some((*retry_s).max(1)),
            ServeError::Overloaded(_) => Some(1),
            _ => None,
        }
    }

    /// Whether another worker (or a later attempt) may succeed where this failed:
    /// the router retries these, and clients may.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ServeError::Overloaded(_)
                | ServeError::QueueFull { .. }
                | ServeError::SloInfeasible { .. }
                | ServeError::TpotInfeasible { .. }
                | ServeError::NoWorker(_)
                | ServeError::Timeout(_)
                | ServeError::StaleEpoch { .. }
                | ServeError::Moved { .. }
        )
    }
}

/// One hop that turns requests into token streams: a worker, or the router in front
/// of several.
pub trait Generate: Send + Sync + 'static {
    fn generate(&self, req: GenerateRequest) -> Result<TokenStream, ServeError>;
    /// Whether at least one worker can take requests.
    fn ready(&self) -> bool;
}

/// A phase of a request's life, for `pdserve_phase_seconds{phase}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    QueuePrefill,
    Prefill,
    KvTransfer,
    QueueDecode,
    Decode,
}

/// Where a prompt was prefilled, for `pdserve_prefill_route_total{where}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillRoute {
    /// On the decode worker itself.
    Local,
    /// On a prefill worker, with the KV shipped to the decode worker.
    Remote,
}

/// What the router and workers report; the frontend's metrics implement it, so each
/// figure is recorded where it is known without the lower hops knowing Prometheus.
pub trait Telemetry: Send + Sync + 'static {
    fn phase(&self, phase: Phase, seconds: f64);
    fn route(&self, route: PrefillRoute);
    fn kv_transfer_bytes(&self, transport: pdserve_types::TransportKind, bytes: u64);
    /// A request moved to another worker, and why (`worker_lost`).
    fn migrated(&self, reason: &'static str);
    /// A worker now serves in `role`.
    fn role(&self, _worker: &str, _role: pdserve_types::Role) {}
    /// A worker left: its role is no longer reported.
    fn role_gone(&self, _worker: &str) {}
    /// The planner switched roles: the role vectors before and after (`"prefill,decode"`)
    /// and the reason.
    fn planned(&self, _from: &str, _to: &str, _reason: &'static str) {}
    /// The router's KV index applied events `lags` seconds after they happened,
    /// resynced from `resyncs` snapshots, and now holds `blocks` distinct blocks.
    fn kv_index(&self, _lags: &[f64], _resyncs: usize, _blocks: usize) {}
    /// KV events that arrived pushed by their worker (over NATS) rather than polled.
    fn kv_events_pushed(&self, _events: usize) {}
    /// A finished request's cached prompt tokens, as the router predicted them and as
    /// the engine reused them; `cause` says why they differ.
    fn prefix_hit(&self, _predicted: usize, _realized: usize, _cause: Option<&'static str>) {}
    /// A prefix fetched from a peer: `tokens` sent in `seconds`, or (with `fell_back`
    /// saying why) none, and the prompt recomputed.
    fn prefix_fetched(&self, _tokens: usize, _seconds: f64, _fell_back: Option<&'static str>) {}
}

/// Records nothing (tests, embedded use without metrics).
pub struct NoTelemetry;

impl Telemetry for NoTelemetry {
    fn phase(&self, _: Phase, _: f64) {}
    fn route(&self, _: PrefillRoute) {}
    fn kv_transfer_bytes(&self, _: pdserve_types::TransportKind, _: u64) {}
    fn migrated(&self, _: &'static str) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn token(i: u32) -> Event {
        Event::Token(TokenOut { token: i, logprob: 0.0, top: Vec::new() })
    }

    #[tokio::test]
    async fn a_producer_sees_its_consumer_fall_behind_and_waits_for_it() {
        let (tx, mut rx) = TokenStream::channel(16);
        for i in 0..10 {
            tx.send(token(i)).unwrap();
        }
        assert_eq!(tx.unread(), 10);
        // Nobody reads: the wait does not end.
        assert!(tokio::time::timeout(Duration::from_millis(50), tx.room(5)).await.is_err());
        let waiter = tokio::spawn({
            let tx = tx.clone();
            async move { tx.room(5).await }
        });
        for _ in 0..6 {
            rx.next().await.unwrap();
        }
        tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        assert_eq!(tx.unread(), 4);
        // A consumer that leaves ends the wait too.
        for i in 0..10 {
            tx.send(token(i)).unwrap();
        }
        drop(rx);
        tokio::time::timeout(Duration::from_secs(5), tx.room(1)).await.unwrap();
    }
}
