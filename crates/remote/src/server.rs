//! A worker process's control server: takes calls from routers over TCP and runs them
//! on the local [`Worker`]. Every connection owns what its calls started; when it
//! closes, their requests are cancelled and their reservations released.

use crate::linked::{forward, SharedSink};
use crate::links::Links;
use crate::wire::{self, CallId, FromWorker, KvAddr, ToWorker, WorkerInfo};
use pdserve_kv_transfer::{HandoffId, Inboxes};
use pdserve_protocol::{Event, GenerateRequest, ServeError, TokenStream};
use pdserve_types::{RequestId, SamplingParams};
use pdserve_worker::{FirstToken, Worker};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinHandle};

/// How long a finishing import waits for its last frames after the prefill side said
/// it sent them all (they are normally already here).
const FRAMES_GRACE: Duration = Duration::from_secs(10);
/// Replies queued per connection before the sender waits.
const OUTBOX: usize = 1024;

/// One worker offered to routers.
pub struct WorkerServer {
    worker: Worker,
    info: WorkerInfo,
    /// Where transfers into this worker land (decode and mixed workers).
    inboxes: Option<Inboxes>,
    links: Links,
}

impl WorkerServer {
    pub fn new(worker: Worker, info: WorkerInfo, inboxes: Option<Inboxes>) -> Arc<WorkerServer> {
        Arc::new(WorkerServer { worker, info, inboxes, links: Links::default() })
    }

    /// Accepts routers until `shutdown` resolves.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let _ = stream.set_nodelay(true);
                        tokio::spawn(self.clone().session(stream));
                    }
                    Err(e) => eprintln!("pdserve worker: accept failed: {e}"),
                },
                _ = &mut shutdown => return,
            }
        }
    }

    async fn session(self: Arc<Self>, stream: TcpStream) {
        let (mut rd, mut wr) = stream.into_split();
        let (out, mut outbox) = mpsc::channel::<FromWorker>(OUTBOX);
        let writer = tokio::spawn(async move {
            while let Some(msg) = outbox.recv().await {
                if wire::write(&mut wr, &msg).await.is_err() {
                    return;
                }
            }
        });
        let s = Arc::new(Session { srv: self, out, calls: Mutex::default(), imports: Mutex::default() });
        loop {
            match wire::read::<_, ToWorker>(&mut rd).await {
                Ok(Some(msg)) => s.clone().handle(msg),
                Ok(None) => break,
                Err(e) => {
                    eprintln!("pdserve worker: dropping a router connection: {e}");
                    break;
                }
            }
        }
        s.close();
        writer.abort();
    }
}

/// A call in progress: its task, and a flag a running prefill checks between layers.
struct Running {
    stop: Arc<AtomicBool>,
    task: AbortHandle,
}

/// One router connection and everything its calls hold.
struct Session {
    srv: Arc<WorkerServer>,
    out: mpsc::Sender<FromWorker>,
    calls: Mutex<HashMap<CallId, Running>>,
    /// Transfers into this worker.
    imports: Mutex<HashMap<RequestId, Import>>,
}

enum Import {
    /// Blocks asked for; the router may still abort before they are granted.
    Reserving,
    /// A task feeding the transfer's frames into the reservation.
    Receiving(JoinHandle<bool>),
}

type Reply<T> = tokio::sync::oneshot::Receiver<Result<T, ServeError>>;

/// Releases an import (its forwarding task and its reserved blocks) unless disarmed:
/// the engine took it over.
struct AbortOnDrop {
    session: Arc<Session>,
    id: RequestId,
    armed: bool,
}

impl AbortOnDrop {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.session.abort_import(self.id);
        }
    }
}

impl Session {
    fn handle(self: Arc<Self>, msg: ToWorker) {
        match msg {
            // The router compares versions and hangs up on a mismatch.
            ToWorker::Hello { .. } => {
                let _ = self.out.try_send(FromWorker::Hello(self.srv.info.clone()));
            }
            ToWorker::Generate { call, req } => {
                let stream = self.srv.worker.generate(req);
                self.start(call, |s, _| s.pump(call, stream));
            }
            ToWorker::Prefill { call, req, to } => self.start(call, move |s, stop| s.prefill(call, req, to, stop)),
            ToWorker::Reserve { call, id, prompt_len } => {
                // Queued on the worker now, so an AbortImport that follows lands after it.
                let reserved = self.begin_reserve(id, prompt_len);
                self.start(call, move |s, _| s.reserve(call, id, reserved))
            }
            ToWorker::FinishImport { call, id, prompt, first, params } => {
                // Made before the task, so a task cancelled before it ever runs still
                // releases the import.
                let guard = AbortOnDrop { session: self.clone(), id, armed: true };
                self.start(call, move |s, _| s.finish_import(call, guard, prompt, first, params))
            }
            ToWorker::AbortImport { id } => self.abort_import(id),
            ToWorker::Cancel { call } => {
                if let Some(r) = lock(&self.calls).remove(&call) {
                    r.stop.store(true, Ordering::SeqCst);
                    r.task.abort();
                }
            }
            ToWorker::Stats { call } => {
                let s = self.clone();
                tokio::spawn(async move {
                    let stats = s.srv.worker.stats().await;
                    let _ = s.out.send(FromWorker::Stats { call, stats }).await;
                });
            }
        }
    }

    /// Runs a call's task, remembered so `Cancel` (or the connection closing) stops it.
    fn start<F, Fut>(self: Arc<Self>, call: CallId, f: F)
    where
        F: FnOnce(Arc<Session>, Arc<AtomicBool>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(f(self.clone(), stop.clone())).abort_handle();
        let mut calls = lock(&self.calls);
        calls.retain(|_, r| !r.task.is_finished());
        calls.insert(call, Running { stop, task });
    }

    async fn send_event(&self, call: CallId, event: Event) -> bool {
        self.out.send(FromWorker::Event { call, event }).await.is_ok()
    }

    /// Streams a request's events back; dropping the stream (task aborted) cancels it.
    async fn pump(self: Arc<Self>, call: CallId, stream: Result<TokenStream, ServeError>) {
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                self.send_event(call, Event::Failed(e)).await;
                return;
            }
        };
        while let Some(ev) = stream.next().await {
            let last = !matches!(ev, Event::Token(_));
            if !self.send_event(call, ev).await || last {
                return;
            }
        }
        self.send_event(call, Event::Failed(ServeError::Internal("the worker dropped the request".into()))).await;
    }

    async fn prefill(self: Arc<Self>, call: CallId, req: GenerateRequest, to: KvAddr, stop: Arc<AtomicBool>) {
        let bytes = Arc::new(AtomicU64::new(0));
        let result = self.prefill_to(req, &to, stop, bytes.clone()).await;
        if result.is_err() {
            // The next transfer reconnects rather than reuse a link that may be down.
            self.srv.links.forget(&to);
        }
        let kv_bytes = bytes.load(Ordering::Relaxed);
        let _ = self.out.send(FromWorker::Prefilled { call, result, kv_bytes }).await;
    }

    async fn prefill_to(
        &self,
        req: GenerateRequest,
        to: &KvAddr,
        stop: Arc<AtomicBool>,
        bytes: Arc<AtomicU64>,
    ) -> Result<FirstToken, ServeError> {
        let transport = self.srv.links.get(to).await?;
        let hid = HandoffId(req.id.0);
        let sink = SharedSink::new(transport.open(hid).map_err(|e| kv_error(to, e))?);
        let broken = Arc::new(AtomicBool::new(false));
        let frames = sink.frame_sink(hid, move || stop.load(Ordering::SeqCst), broken.clone(), bytes);
        let first = self.srv.worker.prefill(req, frames)?.await.map_err(|_| stopped(&self.srv.worker))??;
        if broken.load(Ordering::SeqCst) || !sink.finish().await {
            return Err(ServeError::Internal(format!("KV transfer to {to:?} failed")));
        }
        Ok(first)
    }

    fn begin_reserve(&self, id: RequestId, prompt_len: usize) -> Result<Reply<()>, ServeError> {
        let w = &self.srv.worker;
        if self.srv.inboxes.is_none() {
            return Err(ServeError::Invalid(format!("worker {} receives no KV (role {})", w.name(), w.role())));
        }
        let reply = w.reserve(id, prompt_len)?;
        lock(&self.imports).insert(id, Import::Reserving);
        Ok(reply)
    }

    async fn reserve(self: Arc<Self>, call: CallId, id: RequestId, reserved: Result<Reply<()>, ServeError>) {
        let result = self.receive(id, reserved).await;
        let _ = self.out.send(FromWorker::Reserved { call, result }).await;
    }

    /// Once the blocks are reserved, starts feeding the transfer's frames into them,
    /// unless the router aborted the import meanwhile.
    async fn receive(&self, id: RequestId, reserved: Result<Reply<()>, ServeError>) -> Result<(), ServeError> {
        let w = &self.srv.worker;
        reserved?.await.map_err(|_| stopped(w))??;
        let mut imports = lock(&self.imports);
        if !matches!(imports.get(&id), Some(Import::Reserving)) {
            return Err(ServeError::Internal(format!("the import of {id} was aborted")));
        }
        let inbox = self.srv.inboxes.as_ref().map(|i| i.expect(HandoffId(id.0)));
        match inbox {
            Some(Ok(inbox)) => {
                imports.insert(id, Import::Receiving(forward(inbox, w.clone(), id)));
                Ok(())
            }
            Some(Err(e)) => {
                imports.remove(&id);
                w.abort_import(id);
                Err(ServeError::Internal(format!("KV receiver: {e}")))
            }
            None => Err(ServeError::Internal("no KV receiver".into())),
        }
    }

    async fn finish_import(
        self: Arc<Self>,
        call: CallId,
        guard: AbortOnDrop,
        prompt: Vec<u32>,
        first: u32,
        params: SamplingParams,
    ) {
        let (w, id) = (&self.srv.worker, guard.id);
        let frames = lock(&self.imports).remove(&id);
        let delivered = match frames {
            Some(Import::Receiving(task)) => matches!(tokio::time::timeout(FRAMES_GRACE, task).await, Ok(Ok(true))),
            _ => false,
        };
        if !delivered {
            let e = ServeError::Internal(format!("the KV transfer of {id} did not complete"));
            self.send_event(call, Event::Failed(e)).await;
            return;
        }
        let (events, stream) = TokenStream::channel(params.max_tokens as usize + 4);
        let stream = w.finish_import(id, prompt, first, params, events).map(|()| stream);
        guard.disarm();
        self.pump(call, stream).await;
    }

    fn abort_import(&self, id: RequestId) {
        if let Some(Import::Receiving(task)) = lock(&self.imports).remove(&id) {
            task.abort();
        }
        self.srv.worker.abort_import(id);
    }

    /// The router is gone: cancel its requests and release its reservations.
    fn close(&self) {
        for (_, r) in lock(&self.calls).drain() {
            r.stop.store(true, Ordering::SeqCst);
            r.task.abort();
        }
        let ids: Vec<RequestId> = lock(&self.imports).keys().copied().collect();
        for id in ids {
            self.abort_import(id);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn stopped(w: &Worker) -> ServeError {
    ServeError::NoWorker(format!("worker {} stopped", w.name()))
}

fn kv_error(to: &KvAddr, e: pdserve_kv_transfer::TransferError) -> ServeError {
    ServeError::Internal(format!("KV transfer to {to:?}: {e}"))
}
