//! The router's handle on a worker in another process: the same operations as a
//! local [`pdserve_worker::Worker`], carried as calls over one control connection.
//!
//! Cancellation crosses the hop like any other: when a caller drops a stream or a
//! pending prefill, a `Cancel` goes to the worker, which drops its own stream (and so
//! cancels the request in its engine). A lost connection fails every call in flight.

use crate::wire::{self, CallId, FromWorker, KvAddr, ToWorker, WorkerInfo, PROTOCOL_VERSION};
use pdserve_protocol::{Event, EventSender, GenerateRequest, ServeError};
use pdserve_types::{RequestId, Role, SamplingParams};
use pdserve_worker::{FirstToken, WorkerStats};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// Calls queued for the connection before callers are told the worker is overloaded.
const QUEUE: usize = 4096;
const HANDSHAKE: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot connect to worker {addr}: {source}")]
    Io { addr: SocketAddr, source: std::io::Error },
    #[error("worker {0} did not answer the handshake")]
    NoHandshake(SocketAddr),
    #[error("worker {addr} speaks protocol {theirs}, this build speaks {PROTOCOL_VERSION}")]
    Version { addr: SocketAddr, theirs: u32 },
}

/// A prefill's result with the payload bytes it sent.
pub type Prefilled = Result<(FirstToken, u64), ServeError>;

enum Pending {
    Stream(EventSender),
    Prefill(oneshot::Sender<Prefilled>),
    Reserve(oneshot::Sender<Result<(), ServeError>>),
    Stats(oneshot::Sender<Option<WorkerStats>>),
}

struct Conn {
    info: WorkerInfo,
    addr: SocketAddr,
    out: mpsc::Sender<ToWorker>,
    pending: Mutex<HashMap<CallId, Pending>>,
    next_call: AtomicU64,
    /// Streams and prefills in flight: the router's load signal.
    active: AtomicUsize,
    alive: AtomicBool,
}

/// A cheap handle to a worker process.
#[derive(Clone)]
pub struct RemoteWorker {
    conn: Arc<Conn>,
}

/// A prefill in flight: its result, and a guard that cancels the prefill if dropped
/// before the result arrived.
pub struct PrefillCall {
    pub result: oneshot::Receiver<Prefilled>,
    pub guard: CancelOnDrop,
}

pub struct CancelOnDrop {
    conn: Arc<Conn>,
    call: CallId,
    armed: bool,
}

impl CancelOnDrop {
    /// The call completed: nothing left to cancel.
    pub fn done(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.conn.cancel(self.call);
        }
    }
}

impl RemoteWorker {
    /// Connects and shakes hands; the connection's reader runs on the current runtime.
    pub async fn connect(addr: SocketAddr) -> Result<RemoteWorker, ConnectError> {
        let io = |source| ConnectError::Io { addr, source };
        let stream = TcpStream::connect(addr).await.map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        let (mut rd, mut wr) = stream.into_split();
        wire::write(&mut wr, &ToWorker::Hello { protocol: PROTOCOL_VERSION }).await.map_err(io)?;
        let info = match tokio::time::timeout(HANDSHAKE, wire::read::<_, FromWorker>(&mut rd)).await {
            Ok(Ok(Some(FromWorker::Hello(info)))) => info,
            _ => return Err(ConnectError::NoHandshake(addr)),
        };
        if info.protocol != PROTOCOL_VERSION {
            return Err(ConnectError::Version { addr, theirs: info.protocol });
        }
        let (out, mut outbox) = mpsc::channel::<ToWorker>(QUEUE);
        let conn = Arc::new(Conn {
            info,
            addr,
            out,
            pending: Mutex::default(),
            next_call: AtomicU64::new(1),
            active: AtomicUsize::new(0),
            alive: AtomicBool::new(true),
        });
        tokio::spawn(async move {
            while let Some(msg) = outbox.recv().await {
                if wire::write(&mut wr, &msg).await.is_err() {
                    return;
                }
            }
        });
        let reader = conn.clone();
        tokio::spawn(async move {
            while let Ok(Some(msg)) = wire::read::<_, FromWorker>(&mut rd).await {
                reader.deliver(msg);
            }
            reader.lost();
        });
        Ok(RemoteWorker { conn })
    }

    pub fn name(&self) -> &str {
        &self.conn.info.name
    }

    pub fn role(&self) -> Role {
        self.conn.info.role
    }

    pub fn info(&self) -> &WorkerInfo {
        &self.conn.info
    }

    pub fn addr(&self) -> SocketAddr {
        self.conn.addr
    }

    pub fn load(&self) -> usize {
        self.conn.active.load(Ordering::Relaxed)
    }

    /// False once the connection is lost; the router stops choosing this worker.
    pub fn is_alive(&self) -> bool {
        self.conn.alive.load(Ordering::SeqCst)
    }

    /// Where this worker receives KV over `transport` ("tcp" or "shm"), if it does.
    pub fn kv_addr(&self, transport: &str) -> Option<KvAddr> {
        match transport {
            "shm" => self.conn.info.kv_shm.clone().map(KvAddr::Shm),
            _ => self.conn.info.kv_tcp_port.map(|p| KvAddr::Tcp(SocketAddr::new(self.conn.addr.ip(), p))),
        }
    }

    /// Prefill and decode there; events go to `events`.
    pub fn generate_into(&self, req: GenerateRequest, events: EventSender) -> Result<(), ServeError> {
        self.stream_call(events, |call| ToWorker::Generate { call, req })
    }

    /// Prefill there, sending the KV to `to`.
    pub fn prefill_to(&self, req: GenerateRequest, to: KvAddr) -> Result<PrefillCall, ServeError> {
        let (tx, rx) = oneshot::channel();
        let call = self.conn.call(Pending::Prefill(tx), |call| ToWorker::Prefill { call, req, to })?;
        self.conn.active.fetch_add(1, Ordering::Relaxed);
        Ok(PrefillCall { result: rx, guard: CancelOnDrop { conn: self.conn.clone(), call, armed: true } })
    }

    pub fn reserve(
        &self,
        id: RequestId,
        prompt_len: usize,
    ) -> Result<oneshot::Receiver<Result<(), ServeError>>, ServeError> {
        let (tx, rx) = oneshot::channel();
        self.conn.call(Pending::Reserve(tx), |call| ToWorker::Reserve { call, id, prompt_len })?;
        Ok(rx)
    }

    pub fn finish_import(
        &self,
        id: RequestId,
        prompt: Vec<u32>,
        first: u32,
        params: SamplingParams,
        events: EventSender,
    ) -> Result<(), ServeError> {
        self.stream_call(events, |call| ToWorker::FinishImport { call, id, prompt, first, params })
    }

    pub fn abort_import(&self, id: RequestId) {
        let _ = self.conn.send(ToWorker::AbortImport { id });
    }

    pub async fn stats(&self) -> Option<WorkerStats> {
        let (tx, rx) = oneshot::channel();
        self.conn.call(Pending::Stats(tx), |call| ToWorker::Stats { call }).ok()?;
        rx.await.ok().flatten()
    }

    /// A call whose events stream to `events`; a client that leaves cancels it.
    fn stream_call(&self, events: EventSender, msg: impl FnOnce(CallId) -> ToWorker) -> Result<(), ServeError> {
        let watch = events.clone();
        let call = self.conn.call(Pending::Stream(events), msg)?;
        self.conn.active.fetch_add(1, Ordering::Relaxed);
        let conn = self.conn.clone();
        tokio::spawn(async move {
            watch.closed().await;
            conn.cancel(call);
        });
        Ok(())
    }
}

impl Conn {
    fn send(&self, msg: ToWorker) -> Result<(), ServeError> {
        if !self.alive.load(Ordering::SeqCst) {
            return Err(self.gone());
        }
        self.out.try_send(msg).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                ServeError::Overloaded(format!("the connection to worker {} is full", self.info.name))
            }
            mpsc::error::TrySendError::Closed(_) => self.gone(),
        })
    }

    fn gone(&self) -> ServeError {
        ServeError::NoWorker(format!("worker {} ({}) is disconnected", self.info.name, self.addr))
    }

    /// Registers `pending` under a new call id, then sends the call.
    fn call(&self, pending: Pending, msg: impl FnOnce(CallId) -> ToWorker) -> Result<CallId, ServeError> {
        let call = self.next_call.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(call, pending);
        if let Err(e) = self.send(msg(call)) {
            self.lock().remove(&call);
            return Err(e);
        }
        Ok(call)
    }

    /// The caller of `call` left: forget it and tell the worker, if still running.
    fn cancel(&self, call: CallId) {
        if let Some(p) = self.lock().remove(&call) {
            self.finished(&p);
            let _ = self.send(ToWorker::Cancel { call });
        }
    }

    fn finished(&self, p: &Pending) {
        if matches!(p, Pending::Stream(_) | Pending::Prefill(_)) {
            self.active.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn deliver(&self, msg: FromWorker) {
        match msg {
            FromWorker::Event { call, event } => self.deliver_event(call, event),
            FromWorker::Prefilled { call, result, kv_bytes } => {
                if let Some(Pending::Prefill(tx)) = self.take(call) {
                    self.active.fetch_sub(1, Ordering::Relaxed);
                    let _ = tx.send(result.map(|f| (f, kv_bytes)));
                }
            }
            FromWorker::Reserved { call, result } => {
                if let Some(Pending::Reserve(tx)) = self.take(call) {
                    let _ = tx.send(result);
                }
            }
            FromWorker::Stats { call, stats } => {
                if let Some(Pending::Stats(tx)) = self.take(call) {
                    let _ = tx.send(stats);
                }
            }
            FromWorker::Hello(_) => {}
        }
    }

    fn deliver_event(&self, call: CallId, event: Event) {
        let last = !matches!(event, Event::Token(_));
        let mut pending = self.lock();
        let Some(Pending::Stream(events)) = pending.get(&call) else { return };
        let delivered = events.send(event).is_ok();
        if last || !delivered {
            if let Some(p) = pending.remove(&call) {
                self.finished(&p);
            }
            drop(pending);
            if !delivered && !last {
                let _ = self.send(ToWorker::Cancel { call });
            }
        }
    }

    fn take(&self, call: CallId) -> Option<Pending> {
        self.lock().remove(&call)
    }

    /// The connection is gone: every call in flight fails.
    fn lost(&self) {
        self.alive.store(false, Ordering::SeqCst);
        let drained: Vec<Pending> = self.lock().drain().map(|(_, p)| p).collect();
        for p in drained {
            self.finished(&p);
            if let Pending::Stream(events) = p {
                let _ = events.send(Event::Failed(self.gone()));
            }
            // Dropped one-shot senders tell their waiters the worker is gone.
        }
        eprintln!("pdserve: lost worker {} ({})", self.info.name, self.addr);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<CallId, Pending>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}
