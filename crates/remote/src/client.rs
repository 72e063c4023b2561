//! The router's handle on a worker in another process: the [`Worker`] surface, each
//! operation carried as a call over one control connection.
//!
//! Cancellation crosses the hop like any other: when a caller drops a stream or a
//! pending reply, a `Cancel` goes to the worker, which drops its own stream or future
//! (and so cancels the work in its engine). A lost connection fails every call in
//! flight. So does a message from the worker that fails its session MAC: the
//! connection is closed as lost.

use crate::control::{
    self, Answer, CallId, Capability, FromWorker, Handshake, Op, SessionMac, ToWorker, PROTOCOL_VERSION,
};
use pdserve_kv_transfer::slots::LogEvery;
use pdserve_kv_transfer::{auth, ClusterKey, HandoffToken, KvTarget, TransportKind};
use pdserve_protocol::{
    pace, DecodeHandoff, Event, EventSender, GenerateRequest, KvDestination, KvEventLog, LinkProbe, Prefilled,
    PrefixPeer, Reply, Reserved, RoleSwitch, ServeError, Worker, WorkerInfo, WorkerStats,
};
use pdserve_types::{Epoch, RequestId};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// Calls queued for the connection before callers are told the worker is overloaded.
const QUEUE: usize = 4096;
const HANDSHAKE: Duration = Duration::from_secs(10);
/// How often the router asks a worker whether it is there.
const PING_EVERY: Duration = Duration::from_millis(500);
/// A worker silent this long (five missed pings) is taken for lost: it gets no new
/// work and its calls in flight fail, so the router can go elsewhere. Checked each
/// ping, so a worker that froze is out within 2.5–3 s.
const SILENCE: Duration = Duration::from_millis(2500);

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot connect to worker {addr}: {source}")]
    Io { addr: SocketAddr, source: std::io::Error },
    #[error("worker {0} did not answer the handshake")]
    NoHandshake(SocketAddr),
    #[error("worker {addr} speaks protocol {theirs}, this build speaks {PROTOCOL_VERSION}")]
    Version { addr: SocketAddr, theirs: u32 },
    #[error("worker {0} refused this router's cluster token")]
    Refused(SocketAddr),
    #[error("worker {0} could not prove it holds the cluster token")]
    Impostor(SocketAddr),
    #[error("the handshake of worker {0} failed its MAC: something between rewrote it")]
    Forged(SocketAddr),
}

/// Connections closed on a worker's message that failed its MAC, logged at most once
/// a while across every worker.
static FORGED: LogEvery = LogEvery::new();

enum Pending {
    /// `paced`: the worker was asked to hold the events back until `events` drains.
    Stream { events: EventSender, paced: bool },
    /// `counted`: the call counts toward the worker's load while it runs.
    Reply { tx: oneshot::Sender<Result<Answer, ServeError>>, counted: bool },
}

impl Pending {
    fn counted(&self) -> bool {
        matches!(self, Pending::Stream { .. } | Pending::Reply { counted: true, .. })
    }
}

struct Conn {
    hello: Handshake,
    addr: SocketAddr,
    out: mpsc::Sender<ToWorker>,
    pending: Mutex<HashMap<CallId, Pending>>,
    next_call: AtomicU64,
    /// Streams and prefills in flight: the router's load signal.
    active: AtomicUsize,
    /// Requests the worker itself last said it holds, from every router (the fleet
    /// bucket carries it): other frontends' work counts too.
    reported: AtomicUsize,
    alive: AtomicBool,
    /// Woken when the connection is lost.
    lost: tokio::sync::Notify,
    /// When the worker was last heard from, in milliseconds since `epoch`.
    heard: AtomicU64,
    epoch: std::time::Instant,
}

/// A cheap handle to a worker process.
#[derive(Clone)]
pub struct RemoteWorker {
    conn: Arc<Conn>,
}

impl RemoteWorker {
    /// Connects, and both sides prove they hold `key`; the connection's tasks run on
    /// the current runtime.
    pub async fn connect(addr: SocketAddr, key: &ClusterKey) -> Result<RemoteWorker, ConnectError> {
        let io = |source| ConnectError::Io { addr, source };
        let stream = TcpStream::connect(addr).await.map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        let (mut rd, mut wr) = stream.into_split();
        let (hello, mut sealing, opening) = handshake(&mut rd, &mut wr, key, addr).await?;
        let (out, mut outbox) = mpsc::channel::<ToWorker>(QUEUE);
        let conn = Arc::new(Conn {
            hello,
            addr,
            out,
            pending: Mutex::default(),
            next_call: AtomicU64::new(1),
            active: AtomicUsize::new(0),
            reported: AtomicUsize::new(0),
            alive: AtomicBool::new(true),
            lost: tokio::sync::Notify::new(),
            heard: AtomicU64::new(0),
            epoch: std::time::Instant::now(),
        });
        tokio::spawn(async move {
            while let Some(msg) = outbox.recv().await {
                if control::write(&mut wr, &msg, sealing.as_mut()).await.is_err() {
                    return;
                }
            }
        });
        // The reader and the heartbeat hold the connection weakly: once no handle
        // (and no call in flight) holds it, it is dropped, its writer ends and the
        // socket closes, so the worker frees its session and connection slot.
        let reading = tokio::spawn(read_replies(rd, opening, Arc::downgrade(&conn), addr));
        tokio::spawn(heartbeat(Arc::downgrade(&conn), reading.abort_handle()));
        Ok(RemoteWorker { conn })
    }

    pub fn addr(&self) -> SocketAddr {
        self.conn.addr
    }

    /// Resolves once the connection is lost.
    pub async fn lost(&self) {
        loop {
            let woken = self.conn.lost.notified();
            if !self.conn.alive.load(Ordering::SeqCst) {
                return;
            }
            woken.await;
        }
    }

    /// A call whose events stream to `events`; a client that leaves cancels it.
    fn stream_call(&self, events: EventSender, op: Op) -> Result<(), ServeError> {
        let watch = events.clone();
        let call = self.conn.call(Pending::Stream { events, paced: false }, op)?;
        let conn = self.conn.clone();
        tokio::spawn(async move {
            watch.closed().await;
            conn.cancel(call);
        });
        Ok(())
    }

    /// A call answered once; dropping the future cancels it.
    fn reply_call(&self, op: Op, counted: bool) -> Reply<'static, Answer> {
        let conn = self.conn.clone();
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            let call = conn.call(Pending::Reply { tx, counted }, op)?;
            let guard = CancelOnDrop { conn: conn.clone(), call, armed: true };
            let answer = rx.await.map_err(|_| conn.gone());
            guard.disarm();
            answer?
        })
    }

    /// A call answered with one kind of answer, which `pick` takes out; any other kind
    /// is an error of the worker's.
    fn ask<T: Send + 'static>(
        &self,
        op: Op,
        counted: bool,
        pick: fn(Answer) -> Result<T, Answer>,
    ) -> Reply<'static, T> {
        let answer = self.reply_call(op, counted);
        Box::pin(async move { pick(answer.await?).map_err(|other| unexpected(&other)) })
    }

    /// An [`Op::Ask`] (`crate::asks`), its answer read as a `T`.
    pub(crate) fn ask_value<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        ask: serde_json::Value,
    ) -> Reply<'static, T> {
        let answer = self.ask(Op::Ask(ask), false, |a| match a {
            Answer::Value(v) => Ok(v),
            a => Err(a),
        });
        Box::pin(async move {
            serde_json::from_value(answer.await?)
                .map_err(|e| ServeError::Internal(format!("the worker answered with an unexpected value: {e}")))
        })
    }

    /// A reservation whose first tokens, `keep`, the worker's own cache holds.
    fn reserve_call(
        &self,
        id: RequestId,
        prompt_len: usize,
        keep: Vec<u32>,
        fence: Option<Epoch>,
    ) -> Reply<'_, Reserved> {
        self.ask(Op::Reserve { id, prompt_len, fence, keep }, false, |a| match a {
            Answer::Reserved(r) => Ok(r),
            // What a reservation that keeps its own answers: no draft K/V comes.
            Answer::Token(token) => Ok(Reserved::whole(token, Some(0.0))),
            a => Err(a),
        })
    }

    /// A prefill whose KV goes to `to`, the first `imported` prompt tokens' K/V
    /// taken from this connection's reservation `req.id`.
    fn prefill_call(&self, req: GenerateRequest, imported: usize, to: KvDestination) -> Reply<'static, Prefilled> {
        let KvTarget::Remote(addr) = to.target else {
            return Box::pin(async { Err(ServeError::Internal("a worker process cannot send KV in-process".into())) });
        };
        let (token, draft_worth, stages) = (to.token, to.draft_worth, to.stages);
        self.ask(Op::Prefill { req, to: addr, token, imported, draft_worth, stages }, true, |a| match a {
            Answer::Prefilled(p) => Ok(*p),
            a => Err(a),
        })
    }

    /// Records the load the worker reported for itself (all routers' requests); the
    /// policies then see the larger of it and this router's own calls in flight.
    pub fn report_load(&self, requests: usize) {
        self.conn.reported.store(requests, Ordering::Relaxed);
    }

    /// Whether the worker announced `c` at the handshake.
    fn has(&self, c: Capability) -> bool {
        self.conn.hello.capabilities.contains(&c)
    }
}

impl Worker for RemoteWorker {
    fn info(&self) -> &WorkerInfo {
        &self.conn.hello.info
    }

    fn load(&self) -> usize {
        self.conn.active.load(Ordering::Relaxed).max(self.conn.reported.load(Ordering::Relaxed))
    }

    fn is_alive(&self) -> bool {
        self.conn.alive.load(Ordering::SeqCst)
    }

    fn generate(&self, req: GenerateRequest, events: EventSender) -> Result<(), ServeError> {
        self.stream_call(events, Op::Generate { req })
    }

    /// Reachable over TCP at the host the control connection uses, and over shared
    /// memory on the same host.
    fn kv_target(&self, via: TransportKind) -> Option<KvTarget> {
        let addr = self.conn.hello.kv.iter().find(|a| a.kind() == via)?;
        Some(KvTarget::Remote(addr.seen_at(self.conn.addr.ip())))
    }

    /// Any worker takes a reservation that keeps nothing of its own (an empty `keep`).
    fn reserve(&self, id: RequestId, prompt_len: usize, fence: Option<Epoch>) -> Reply<'_, Reserved> {
        self.reserve_call(id, prompt_len, Vec::new(), fence)
    }

    fn prefill(&self, req: GenerateRequest, to: KvDestination) -> Reply<'static, Prefilled> {
        self.prefill_call(req, 0, to)
    }

    fn decode(&self, handoff: DecodeHandoff, events: EventSender) -> Result<(), ServeError> {
        self.stream_call(events, Op::Decode { handoff })
    }

    fn release(&self, id: RequestId) {
        let _ = self.conn.send(ToWorker::Call { call: 0, op: Box::new(Op::Release { id }) });
    }

    fn stats(&self) -> Reply<'_, WorkerStats> {
        self.ask(Op::Stats, false, |a| match a {
            Answer::Stats(s) => Ok(*s),
            a => Err(a),
        })
    }

    fn prefix_peer(&self) -> Option<&dyn PrefixPeer> {
        self.has(Capability::PrefixPeer).then_some(self as &dyn PrefixPeer)
    }

    fn kv_event_log(&self) -> Option<&dyn KvEventLog> {
        self.has(Capability::KvEventLog).then_some(self as &dyn KvEventLog)
    }

    fn role_switch(&self) -> Option<&dyn RoleSwitch> {
        self.has(Capability::RoleSwitch).then_some(self as &dyn RoleSwitch)
    }

    fn link_probe(&self) -> Option<&dyn LinkProbe> {
        self.has(Capability::LinkProbe).then_some(self as &dyn LinkProbe)
    }
}

impl PrefixPeer for RemoteWorker {
    fn reserve_after(
        &self,
        id: RequestId,
        prompt_len: usize,
        keep: Vec<u32>,
        fence: Option<Epoch>,
    ) -> Reply<'_, HandoffToken> {
        let reserved = self.reserve_call(id, prompt_len, keep, fence);
        Box::pin(async move { Ok(reserved.await?.token) })
    }

    fn prefill_imported(&self, req: GenerateRequest, imported: usize, to: KvDestination) -> Reply<'static, Prefilled> {
        self.prefill_call(req, imported, to)
    }

    fn export_prefix(&self, id: RequestId, tokens: Vec<u32>, skip: usize, to: KvDestination) -> Reply<'static, usize> {
        let KvTarget::Remote(addr) = to.target else {
            return Box::pin(async { Err(ServeError::Internal("a worker process cannot send KV in-process".into())) });
        };
        self.ask(
            Op::ExportPrefix { id, tokens, skip, to: addr, token: to.token, stages: to.stages },
            false,
            |a| match a {
                Answer::Count(n) => Ok(n),
                a => Err(a),
            },
        )
    }

    fn generate_imported(&self, req: GenerateRequest, imported: usize, events: EventSender) -> Result<(), ServeError> {
        self.stream_call(events, Op::GenerateImported { req, imported })
    }
}

/// Both sides prove they hold `key`: the worker's challenge answered, its Hello
/// read and checked. Answers with the Hello and the session's sealing (ours) and
/// opening (theirs) MACs.
async fn handshake(
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    key: &ClusterKey,
    addr: SocketAddr,
) -> Result<(Handshake, Option<SessionMac>, Option<SessionMac>), ConnectError> {
    let challenge =
        match tokio::time::timeout(HANDSHAKE, control::read_at_most::<_, FromWorker>(rd, control::MAX_HELLO)).await {
            Ok(Ok(Some(FromWorker::Challenge { nonce }))) => nonce,
            _ => return Err(ConnectError::NoHandshake(addr)),
        };
    let ours = auth::nonce();
    let proof = key.prove(control::ROUTER_LABEL, &challenge).to_vec();
    let hello = ToWorker::Hello { protocol: PROTOCOL_VERSION, proof, nonce: ours.to_vec() };
    control::write(wr, &hello, None).await.map_err(|source| ConnectError::Io { addr, source })?;
    let (sealing, mut opening) = control::session(key, &challenge, &ours, control::ROUTER_LABEL).unzip();
    // The worker's Hello is its first sealed message. Its version is read before its
    // MAC, so a worker of another version is told apart from a forgery.
    let body = match tokio::time::timeout(HANDSHAKE, control::read_body(rd, control::MAX_MESSAGE)).await {
        Ok(Ok(Some(body))) => body,
        Ok(Ok(None)) | Ok(Err(_)) => return Err(ConnectError::Refused(addr)),
        Err(_) => return Err(ConnectError::NoHandshake(addr)),
    };
    let hello = match control::decode::<FromWorker>(&body) {
        Ok(FromWorker::Hello(h)) => h,
        Ok(_) => return Err(ConnectError::NoHandshake(addr)),
        Err(_) => return Err(ConnectError::Refused(addr)),
    };
    if hello.protocol != PROTOCOL_VERSION {
        return Err(ConnectError::Version { addr, theirs: hello.protocol });
    }
    if !key.verify(control::WORKER_LABEL, &ours, &hello.proof) {
        return Err(ConnectError::Impostor(addr));
    }
    if let Some(mac) = &mut opening {
        match tokio::time::timeout(HANDSHAKE, control::read_mac(rd, &body, mac)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if auth::is_forged(&e) => return Err(ConnectError::Forged(addr)),
            Ok(Err(_)) => return Err(ConnectError::Refused(addr)),
            Err(_) => return Err(ConnectError::NoHandshake(addr)),
        }
    }
    Ok((hello, sealing, opening))
}

/// Delivers the worker's messages to the calls they answer until the connection
/// closes or a message fails its MAC; then the connection is lost.
async fn read_replies(mut rd: OwnedReadHalf, mut opening: Option<SessionMac>, reader: Weak<Conn>, addr: SocketAddr) {
    let why = loop {
        match control::read::<_, FromWorker>(&mut rd, opening.as_mut()).await {
            Ok(Some(msg)) => {
                let Some(conn) = reader.upgrade() else { return };
                conn.heard();
                conn.deliver(msg);
            }
            Err(e) if auth::is_forged(&e) => {
                if let Some(quiet) = FORGED.due() {
                    tracing::warn!(%addr, error = %e, forged_since_last = quiet, "closing a worker connection: a message failed its MAC");
                }
                break "a message failed its MAC";
            }
            Ok(None) | Err(_) => break "the connection closed",
        }
    };
    if let Some(conn) = reader.upgrade() {
        conn.lost(why);
    }
}

/// Pings the worker every [`PING_EVERY`]; one silent for [`SILENCE`] (hung, stopped, or cut
/// off) is lost: its calls fail now rather than at their deadlines.
async fn heartbeat(conn: Weak<Conn>, reading: tokio::task::AbortHandle) {
    let mut tick = tokio::time::interval(PING_EVERY);
    loop {
        tick.tick().await;
        let Some(conn) = conn.upgrade().filter(|c| c.alive.load(Ordering::SeqCst)) else {
            // Dropped by every holder: stop reading too, so the socket closes now.
            reading.abort();
            return;
        };
        let silent = conn.epoch.elapsed().saturating_sub(Duration::from_millis(conn.heard.load(Ordering::SeqCst)));
        if silent > SILENCE {
            reading.abort();
            conn.lost("no answer to pings for 2.5 s");
            return;
        }
        let _ = conn.out.try_send(ToWorker::Ping);
    }
}

fn unexpected(a: &Answer) -> ServeError {
    ServeError::Internal(format!("the worker answered with an unexpected {a:?}"))
}

/// Cancels a call unless disarmed (its answer arrived).
struct CancelOnDrop {
    conn: Arc<Conn>,
    call: CallId,
    armed: bool,
}

impl CancelOnDrop {
    fn disarm(mut self) {
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

impl Conn {
    fn send(&self, msg: ToWorker) -> Result<(), ServeError> {
        if !self.alive.load(Ordering::SeqCst) {
            return Err(self.gone());
        }
        self.out.try_send(msg).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                ServeError::Overloaded(format!("the connection to worker {} is full", self.hello.info.name))
            }
            mpsc::error::TrySendError::Closed(_) => self.gone(),
        })
    }

    fn gone(&self) -> ServeError {
        ServeError::WorkerLost(format!("worker {} ({}) is disconnected", self.hello.info.name, self.addr))
    }

    /// Registers `pending` under a new call id, then sends the call.
    fn call(&self, pending: Pending, op: Op) -> Result<CallId, ServeError> {
        let call = self.next_call.fetch_add(1, Ordering::Relaxed);
        if pending.counted() {
            self.active.fetch_add(1, Ordering::Relaxed);
        }
        self.lock().insert(call, pending);
        if let Err(e) = self.send(ToWorker::Call { call, op: Box::new(op) }) {
            self.forget(call);
            return Err(e);
        }
        Ok(call)
    }

    /// Drops a call's bookkeeping; true if it was still pending.
    fn forget(&self, call: CallId) -> bool {
        let p = self.lock().remove(&call);
        if p.as_ref().is_some_and(Pending::counted) {
            self.active.fetch_sub(1, Ordering::Relaxed);
        }
        p.is_some()
    }

    /// The caller of `call` left: forget it and tell the worker, if still running.
    fn cancel(&self, call: CallId) {
        if self.forget(call) {
            let _ = self.send(ToWorker::Cancel { call });
        }
    }

    fn deliver(self: &Arc<Self>, msg: FromWorker) {
        match msg {
            FromWorker::Event { call, event } => self.deliver_event(call, event),
            FromWorker::Reply { call, result } => {
                let Some(p) = self.lock().remove(&call) else { return };
                if p.counted() {
                    self.active.fetch_sub(1, Ordering::Relaxed);
                }
                if let Pending::Reply { tx, .. } = p {
                    let _ = tx.send(result);
                }
            }
            FromWorker::Hello(_) | FromWorker::Challenge { .. } | FromWorker::Pong => {}
        }
    }

    fn deliver_event(self: &Arc<Self>, call: CallId, event: Event) {
        let last = event.is_last();
        let mut behind = None;
        let delivered = match self.lock().get_mut(&call) {
            Some(Pending::Stream { events, paced }) => {
                let sent = events.send(event).is_ok();
                if !*paced && events.unread() >= pace::PAUSE_AT {
                    *paced = true;
                    behind = Some(events.clone());
                }
                sent
            }
            _ => return,
        };
        if let Some(events) = behind.filter(|_| !last) {
            self.pace(call, events);
        }
        if last || !delivered {
            self.forget(call);
            if !delivered && !last {
                let _ = self.send(ToWorker::Cancel { call });
            }
        }
    }

    /// Holds stream `call` back at the worker until `events`' consumer catches up.
    fn pace(self: &Arc<Self>, call: CallId, events: EventSender) {
        let _ = self.send(ToWorker::Pace { call, paused: true });
        let conn = self.clone();
        tokio::spawn(async move {
            events.room(pace::RESUME_BELOW).await;
            if let Some(Pending::Stream { paced, .. }) = conn.lock().get_mut(&call) {
                *paced = false;
            } else {
                return;
            }
            let _ = conn.send(ToWorker::Pace { call, paused: false });
        });
    }

    fn heard(&self) {
        self.heard.store(self.epoch.elapsed().as_millis() as u64, Ordering::SeqCst);
    }

    /// The connection is gone: every call in flight fails.
    fn lost(&self, why: &str) {
        if !self.alive.swap(false, Ordering::SeqCst) {
            return;
        }
        self.lost.notify_waiters();
        let drained: Vec<Pending> = self.lock().drain().map(|(_, p)| p).collect();
        for p in drained {
            if p.counted() {
                self.active.fetch_sub(1, Ordering::Relaxed);
            }
            if let Pending::Stream { events, .. } = p {
                let _ = events.send(Event::Failed(self.gone()));
            }
            // Dropped reply senders tell their waiters the worker is gone.
        }
        tracing::warn!(worker = %self.hello.info.name, addr = %self.addr, reason = why, "lost a worker");
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<CallId, Pending>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
