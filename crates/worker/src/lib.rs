//! A worker: one engine on its own OS thread, owned by a loop that takes bounded
//! commands, steps the engine and routes each token to its request's stream.
//!
//! Sits between the router (which calls [`Worker`]'s methods) and the engine. The
//! loop checks every request's stream between steps and cancels those whose client
//! is gone, so cancellation reaches the engine within one step.

mod handoff;
mod worker_loop;

pub use handoff::{FirstToken, FrameRecycler, FrameSink};
pub use worker_loop::WorkerStats;

use pdserve_engine::batch::{EngineConfig, KvFrame};
use pdserve_engine::model::Model;
use pdserve_protocol::{EventSender, GenerateRequest, ServeError, TokenStream};
use pdserve_types::{RequestId, Role, SamplingParams};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use tokio::sync::oneshot;

/// Commands queued for the loop; bounded, so a flooded worker says "overloaded".
pub(crate) enum Command {
    Generate(GenerateRequest, EventSender),
    Prefill {
        req: GenerateRequest,
        sink: FrameSink,
        reply: oneshot::Sender<Result<FirstToken, ServeError>>,
        sent: std::time::Instant,
    },
    Reserve {
        id: RequestId,
        prompt_len: usize,
        reply: oneshot::Sender<Result<(), ServeError>>,
    },
    Frame {
        id: RequestId,
        frame: KvFrame,
        recycle: Option<FrameRecycler>,
    },
    FinishImport {
        id: RequestId,
        prompt: Vec<u32>,
        first: u32,
        params: SamplingParams,
        events: EventSender,
    },
    AbortImport {
        id: RequestId,
    },
    Stats(oneshot::Sender<WorkerStats>),
}

/// Commands a worker queues before refusing more.
const QUEUE: usize = 4096;

/// A cheap handle to a running worker.
#[derive(Clone)]
pub struct Worker {
    name: Arc<str>,
    role: Role,
    tx: SyncSender<Command>,
    /// Requests admitted and not finished: the router's load signal.
    active: Arc<AtomicUsize>,
}

impl Worker {
    /// Starts a worker thread around a new engine for `model`.
    pub fn spawn(
        name: &str,
        role: Role,
        model: Arc<Model>,
        cfg: EngineConfig,
        eog: Vec<u32>,
    ) -> std::io::Result<Worker> {
        let (tx, rx) = sync_channel(QUEUE);
        let active = Arc::new(AtomicUsize::new(0));
        let counter = active.clone();
        std::thread::Builder::new()
            .name(format!("pdserve-{name}"))
            .spawn(move || worker_loop::run(model, cfg, eog, rx, counter))?;
        Ok(Worker { name: name.into(), role, tx, active })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn role(&self) -> Role {
        self.role
    }

    /// Requests and prefills queued or in flight on this worker.
    pub fn load(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Queues a command that counts toward the load from now until the loop is done
    /// with it, so requests routed in a burst see each other.
    fn send_counted(&self, c: Command) -> Result<(), ServeError> {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.send(c).inspect_err(|_| {
            self.active.fetch_sub(1, Ordering::Relaxed);
        })
    }

    fn send(&self, c: Command) -> Result<(), ServeError> {
        self.tx.try_send(c).map_err(|e| match e {
            TrySendError::Full(_) => ServeError::Overloaded(format!("worker {} queue is full", self.name)),
            TrySendError::Disconnected(_) => ServeError::NoWorker(format!("worker {} stopped", self.name)),
        })
    }

    /// Prefill and decode here (aggregated).
    pub fn generate(&self, req: GenerateRequest) -> Result<TokenStream, ServeError> {
        let (events, stream) = TokenStream::channel(req.params.max_tokens as usize + 4);
        self.generate_into(req, events)?;
        Ok(stream)
    }

    /// Like [`generate`](Self::generate), writing into an existing stream (a router
    /// falling back to local prefill keeps the client's stream).
    pub fn generate_into(&self, req: GenerateRequest, events: EventSender) -> Result<(), ServeError> {
        self.send_counted(Command::Generate(req, events))
    }

    /// Prefill only: K/V go to `sink` layer by layer; resolves to the first token.
    pub fn prefill(
        &self,
        req: GenerateRequest,
        sink: FrameSink,
    ) -> Result<oneshot::Receiver<Result<FirstToken, ServeError>>, ServeError> {
        let (reply, rx) = oneshot::channel();
        self.send_counted(Command::Prefill { req, sink, reply, sent: std::time::Instant::now() })?;
        Ok(rx)
    }

    /// Reserves blocks for an incoming transfer.
    pub fn reserve(
        &self,
        id: RequestId,
        prompt_len: usize,
    ) -> Result<oneshot::Receiver<Result<(), ServeError>>, ServeError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Reserve { id, prompt_len, reply })?;
        Ok(rx)
    }

    /// Writes one transferred frame into the reserved blocks.
    pub fn frame(&self, id: RequestId, frame: KvFrame) -> Result<(), ServeError> {
        self.send(Command::Frame { id, frame, recycle: None })
    }

    /// [`Worker::frame`], handing the frame's buffers to `recycle` once written.
    pub fn frame_recycled(&self, id: RequestId, frame: KvFrame, recycle: FrameRecycler) -> Result<(), ServeError> {
        self.send(Command::Frame { id, frame, recycle: Some(recycle) })
    }

    /// Starts decoding a transferred sequence; tokens after `first` go to `events`.
    pub fn finish_import(
        &self,
        id: RequestId,
        prompt: Vec<u32>,
        first: u32,
        params: SamplingParams,
        events: EventSender,
    ) -> Result<(), ServeError> {
        self.send_counted(Command::FinishImport { id, prompt, first, params, events })
    }

    /// Releases a reservation (transfer failed, timed out or was cancelled).
    pub fn abort_import(&self, id: RequestId) {
        // A full queue or a stopped worker both end with the blocks freed: the loop
        // aborts stale imports itself, and a stopped worker holds nothing.
        let _ = self.send(Command::AbortImport { id });
    }

    /// Block counts and queue sizes, for metrics and tests.
    pub async fn stats(&self) -> Option<WorkerStats> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Stats(reply)).ok()?;
        rx.await.ok()
    }
}
