//! A worker process's control server: takes calls from routers over TCP and runs
//! each on the worker it serves (any [`Worker`]: an engine, or a simulated one).
//!
//! Every connection owns what its calls started: it may release or decode only the
//! reservations it made, and when it closes, its calls are cancelled and those
//! reservations released.
//!
//! Past the handshake every message a router sends must carry the MAC of its place
//! in the session (see [`control`]): one that does not closes the connection before
//! it is parsed, let alone run.

use crate::asks::Ask;
use crate::control::{
    self, Answer, CallId, Capability, FromWorker, Handshake, Op, SessionMac, ToWorker, PROTOCOL_VERSION,
};
use pdserve_kv_transfer::slots::{LogEvery, Pending, PortSlots, Refused};
use pdserve_kv_transfer::{auth, ClusterKey, KvTarget, TransportKind};
use pdserve_protocol::{Capabilities, Event, GenerateRequest, KvDestination, ServeError, TokenStream, Worker};
use pdserve_types::{lock, Epoch, RequestId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

/// Replies queued per connection before the sender waits.
const OUTBOX: usize = 1024;
/// How long a router may say nothing (it pings twice a second) before its
/// connection is taken for dead: a frozen or cut-off host sends no FIN, and its
/// session's reservations and paused streams are freed now, not by their TTLs.
const SILENT_ROUTER: std::time::Duration = std::time::Duration::from_secs(10);
/// Router connections that proved the token, served at once; more are closed
/// (connections still proving it have a budget of their own: `PortSlots`).
const MAX_CONNECTIONS: usize = 64;
/// Reservations one connection may hold at once.
const MAX_HELD: usize = 256;
/// Later stages a prefill's K/V may go to: past any group a worker would form.
const MAX_STAGES: usize = 64;
/// How long a new connection has to prove it holds the cluster token.
const HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(10);

/// One worker offered to routers.
pub struct WorkerServer {
    worker: Arc<dyn Worker>,
    key: ClusterKey,
    connections: Arc<PortSlots>,
    /// Connections closed on a message that failed its MAC, logged at most once a while.
    forged: LogEvery,
    /// Set when `serve` stops taking routers; its stats say so from then on.
    stopping: AtomicBool,
    /// Calls running and frames not yet written, across sessions.
    owed: Arc<AtomicUsize>,
}

/// One call running or one frame queued: counted in the server's `owed` while it lives.
struct Owing(Arc<AtomicUsize>);

impl Owing {
    fn new(owed: &Arc<AtomicUsize>) -> Owing {
        owed.fetch_add(1, Ordering::SeqCst);
        Owing(owed.clone())
    }
}

impl Drop for Owing {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A frame in a session's outbox, owed until the writer wrote it (or dropped it with
/// the connection).
struct Frame {
    msg: FromWorker,
    _owing: Owing,
}

impl WorkerServer {
    /// Serves `worker` to routers that prove `key`.
    pub fn new(worker: Arc<dyn Worker>, key: ClusterKey) -> Arc<WorkerServer> {
        let connections = PortSlots::new(MAX_CONNECTIONS);
        let (forged, stopping, owed) = (LogEvery::new(), Default::default(), Default::default());
        Arc::new(WorkerServer { worker, key, connections, forged, stopping, owed })
    }

    /// Calls still running and frames not yet written to their routers. A stopping
    /// worker waits for 0 as well as for an idle engine: a request's last frames may
    /// still be queued after the engine let it go, and exiting would drop them.
    pub fn owed(&self) -> usize {
        self.owed.load(Ordering::SeqCst)
    }

    /// What a router learns once it proved the token: who this is, and this worker's
    /// answer to the router's nonce.
    fn handshake(&self, router_nonce: &[u8]) -> Handshake {
        let kv = TransportKind::ALL.into_iter().filter_map(|via| match self.worker.kv_target(via) {
            Some(KvTarget::Remote(addr)) => Some(addr),
            _ => None,
        });
        let proof = self.key.prove(control::WORKER_LABEL, router_nonce).to_vec();
        Handshake {
            protocol: PROTOCOL_VERSION,
            info: self.worker.info().clone(),
            kv: kv.collect(),
            capabilities: Capability::of(&*self.worker),
            proof,
        }
    }

    /// Accepts routers until `shutdown` resolves.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let pending = match self.connections.knock(peer.ip()) {
                            Ok(p) => p,
                            Err(why) => {
                                self.refused(peer, why);
                                continue;
                            }
                        };
                        let _ = stream.set_nodelay(true);
                        tracing::debug!(%peer, "router connected");
                        let me = self.clone();
                        tokio::spawn(async move { me.session(stream, pending).await });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        // Out of descriptors, most likely: back off instead of spinning.
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                },
                _ = &mut shutdown => {
                    self.stopping.store(true, Ordering::SeqCst);
                    return;
                }
            }
        }
    }

    /// Challenges a new connection; once it answered right, the router's nonce and
    /// the session's MACs (`(send, receive)`, none with the insecure key).
    async fn authenticate(
        &self,
        rd: &mut OwnedReadHalf,
        wr: &mut OwnedWriteHalf,
    ) -> Option<(Vec<u8>, Option<(SessionMac, SessionMac)>)> {
        let nonce = auth::nonce();
        control::write(wr, &FromWorker::Challenge { nonce: nonce.to_vec() }, None).await.ok()?;
        let hello = tokio::time::timeout(HANDSHAKE, control::read_at_most::<_, ToWorker>(rd, control::MAX_HELLO)).await;
        match hello {
            Ok(Ok(Some(ToWorker::Hello { proof, nonce: theirs, .. })))
                if self.key.verify(control::ROUTER_LABEL, &nonce, &proof) =>
            {
                let session = control::session(&self.key, &nonce, &theirs, control::WORKER_LABEL);
                Some((theirs, session))
            }
            _ => {
                let peer = rd.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                tracing::warn!(%peer, "refused a router: no handshake or a wrong cluster token");
                None
            }
        }
    }

    /// Logs a refused connection, at most once a while: a reconnect loop must not
    /// fill the log.
    fn refused(&self, peer: std::net::SocketAddr, why: Refused) {
        if let Some(quiet) = self.connections.log_refusal() {
            tracing::warn!(%peer, ?why, refused_since_last = quiet, "a router connection refused");
        }
    }

    async fn session(self: Arc<Self>, stream: TcpStream, pending: Pending) {
        let (mut rd, mut wr) = stream.into_split();
        let Some((router_nonce, session)) = self.authenticate(&mut rd, &mut wr).await else { return };
        let (mut sealing, mut opening) = session.unzip();
        let _slot = match pending.admit() {
            Ok(slot) => slot,
            Err(why) => return self.refused(rd.peer_addr().unwrap_or(([0, 0, 0, 0], 0).into()), why),
        };
        // The first sealed message: the router checks it, so a relay cannot rewrite
        // what this worker says it is or where it takes KV.
        let hello = FromWorker::Hello(self.handshake(&router_nonce));
        if control::write(&mut wr, &hello, sealing.as_mut()).await.is_err() {
            return;
        }
        let (out, mut outbox) = mpsc::channel::<Frame>(OUTBOX);
        let writer = tokio::spawn(async move {
            // A frame stays owed until written: `_owing` drops after the write.
            while let Some(Frame { msg, _owing }) = outbox.recv().await {
                if control::write(&mut wr, &msg, sealing.as_mut()).await.is_err() {
                    return;
                }
            }
        });
        let held = Mutex::new(Some(HashMap::new()));
        let s = Arc::new(Session { srv: self, out, calls: Mutex::default(), paces: Mutex::default(), held });
        loop {
            match tokio::time::timeout(SILENT_ROUTER, control::read::<_, ToWorker>(&mut rd, opening.as_mut())).await {
                Ok(Ok(Some(msg))) => s.clone().handle(msg),
                Ok(Ok(None)) => break,
                Ok(Err(e)) if auth::is_forged(&e) => {
                    if let Some(quiet) = s.srv.forged.due() {
                        let peer = rd.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                        tracing::warn!(%peer, error = %e, forged_since_last = quiet, "dropping a router connection: a message failed its MAC");
                    }
                    break;
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "dropping a router connection");
                    break;
                }
                Err(_) => {
                    tracing::warn!(silent_s = SILENT_ROUTER.as_secs(), "a router went silent; dropping its connection");
                    break;
                }
            }
        }
        s.close();
        writer.abort();
    }
}

/// One router connection and everything its calls hold.
struct Session {
    srv: Arc<WorkerServer>,
    out: mpsc::Sender<Frame>,
    /// Calls in progress, so `Cancel` (or the connection closing) stops them.
    calls: Mutex<HashMap<CallId, AbortHandle>>,
    /// Whether the router asked each stream call to hold its events back.
    paces: Mutex<HashMap<CallId, watch::Sender<bool>>>,
    /// Reservations this connection asked for and has neither decoded nor released;
    /// `None` once the connection closed.
    held: Mutex<Option<HashMap<RequestId, Hold>>>,
}

/// A reservation as its connection sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Asked for; the worker has not answered yet.
    Reserving,
    Held,
}

impl Session {
    fn worker(&self) -> &dyn Worker {
        &*self.srv.worker
    }

    /// One more call or frame owed to this session's router.
    fn owing(&self) -> Owing {
        Owing::new(&self.srv.owed)
    }

    /// Queues `msg` for the writer; an error means the connection is gone.
    async fn send(&self, msg: FromWorker) -> Result<(), ()> {
        self.out.send(Frame { msg, _owing: self.owing() }).await.map_err(drop)
    }

    /// Queues `msg` if the outbox has room; dropped otherwise.
    fn try_send(&self, msg: FromWorker) {
        let _ = self.out.try_send(Frame { msg, _owing: self.owing() });
    }

    fn handle(self: Arc<Self>, msg: ToWorker) {
        match msg {
            // Answered once, before this session started.
            ToWorker::Hello { .. } => {}
            ToWorker::Ping => {
                self.try_send(FromWorker::Pong);
            }
            ToWorker::Call { call, op } => self.call(call, *op),
            ToWorker::Cancel { call } => {
                lock(&self.paces).remove(&call);
                if let Some(task) = lock(&self.calls).remove(&call) {
                    task.abort();
                }
            }
            ToWorker::Pace { call, paused } => {
                if let Some(pace) = lock(&self.paces).get(&call) {
                    pace.send_replace(paused);
                }
            }
        }
    }

    fn call(self: Arc<Self>, call: CallId, op: Op) {
        // Nothing from the wire is trusted: the same checks as the frontend's.
        let op = match checked(op) {
            Ok(op) => op,
            Err(e) => return self.refuse(call, e),
        };
        match op {
            Op::Generate { .. } | Op::Decode { .. } | Op::GenerateImported { .. } => {
                let (started, span) = self.start_stream(op);
                self.stream(call, started, span);
            }
            Op::ExportPrefix { id, tokens, skip, to, token, stages } => {
                let span = tracing::info_span!("export", %id, tokens = tokens.len(), skip);
                let to = KvDestination { stages, ..KvDestination::plain(KvTarget::Remote(to), token) };
                let done = match self.worker().peering() {
                    Ok(peer) => peer.export_prefix(id, tokens, skip, to),
                    Err(e) => Box::pin(std::future::ready(Err(e))),
                };
                let answer = async move {
                    let n = done.await.inspect_err(|e| tracing::warn!(kind = e.kind(), error = %e, "export failed"))?;
                    Ok(Answer::Count(n))
                };
                self.reply(call, tracing::Instrument::instrument(answer, span))
            }
            Op::Reserve { id, prompt_len, fence, keep } => self.reserve(call, id, prompt_len, fence, keep),
            Op::Prefill { req, to, token, imported, draft_worth, stages } => {
                let to = KvDestination { target: KvTarget::Remote(to), token, draft_worth, stages };
                self.prefill(call, req, to, imported)
            }
            // A reservation still being granted is released now too, not when its
            // answer comes: the router's next call for the same id (prefilling it
            // here instead) must find the worker without it.
            Op::Release { id } => {
                if lock(&self.held).as_mut().and_then(|h| h.remove(&id)).is_some() {
                    self.worker().release(id);
                }
            }
            op => {
                let s = self.clone();
                self.reply(call, async move { s.answer(op).await })
            }
        }
    }

    /// Starts a call that answers with a stream of tokens.
    fn start_stream(&self, op: Op) -> (Result<TokenStream, ServeError>, tracing::Span) {
        match op {
            Op::Generate { req } => {
                let span = tracing::info_span!("generate", request_id = %req.tag);
                let (events, stream) = TokenStream::for_request(&req.params);
                let started = span.in_scope(|| self.worker().generate(req, events));
                (started.map(|()| stream), span)
            }
            Op::Decode { handoff } => {
                let span = tracing::info_span!("decode", request_id = %handoff.tag);
                // Only a reservation of this connection's own.
                if let Err(e) = self.own(handoff.id) {
                    return (Err(e), span);
                }
                let (events, stream) = TokenStream::for_request(&handoff.params);
                (self.worker().decode(handoff, events).map(|()| stream), span)
            }
            Op::GenerateImported { req, imported } => {
                let span = tracing::info_span!("generate", request_id = %req.tag, imported);
                let peer = self.own(req.id).and_then(|()| self.worker().peering());
                let started = peer.and_then(|peer| {
                    let (events, stream) = TokenStream::for_request(&req.params);
                    span.in_scope(|| peer.generate_imported(req, imported, events)).map(|()| stream)
                });
                (started, span)
            }
            _ => (Err(ServeError::Internal("not a streaming call".into())), tracing::Span::none()),
        }
    }

    /// Reserves blocks for `prompt_len` tokens (keeping the worker's own blocks of
    /// `keep`), held by this connection.
    fn reserve(self: Arc<Self>, call: CallId, id: RequestId, prompt_len: usize, fence: Option<Epoch>, keep: Vec<u32>) {
        // Noted before the call runs, so a release that overtakes its answer still
        // releases what the worker grants.
        if let Err(e) = self.expect_hold(id) {
            return self.reply(call, async move { Err(e) });
        }
        let s = self.clone();
        self.reply(call, async move {
            let granted = match keep.is_empty() {
                true => s.worker().reserve(id, prompt_len, fence).await.map(Answer::Reserved),
                false => match s.worker().peering() {
                    Ok(peer) => peer.reserve_after(id, prompt_len, keep, fence).await.map(Answer::Token),
                    Err(e) => Err(e),
                },
            };
            s.granted(id, granted.is_ok())?;
            granted
        })
    }

    /// Prefills `req` into `to`; an `imported` prefix is this connection's
    /// reservation, the worker's from here (it releases it on any failure).
    fn prefill(self: Arc<Self>, call: CallId, req: GenerateRequest, to: KvDestination, imported: usize) {
        let span = tracing::info_span!("prefill", request_id = %req.tag, prompt_tokens = req.prompt.len(), imported);
        let done = match imported {
            0 => self.worker().prefill(req, to),
            n if self.unhold(req.id) => match self.worker().peering() {
                Ok(peer) => peer.prefill_imported(req, n, to),
                Err(e) => {
                    // What an import refused always does: the reservation goes.
                    self.worker().release(req.id);
                    Box::pin(std::future::ready(Err(e)))
                }
            },
            _ => {
                let e = ServeError::Invalid(format!("this connection holds no reservation {}", req.id));
                return self.reply(call, async move { Err(e) });
            }
        };
        let answer = async move {
            let p = done.await.inspect_err(|e| tracing::warn!(kind = e.kind(), error = %e, "prefill failed"))?;
            tracing::debug!(prefill_ms = p.prefill_seconds * 1e3, kv_bytes = p.kv_bytes, "prefill done");
            Ok(Answer::Prefilled(Box::new(p)))
        };
        self.reply(call, tracing::Instrument::instrument(answer, span))
    }

    /// The answer of a call that only asks the worker.
    async fn answer(&self, op: Op) -> Result<Answer, ServeError> {
        let w = self.worker();
        Ok(match op {
            Op::Stats => {
                let mut stats = w.stats().await?;
                stats.stopping |= self.srv.stopping.load(Ordering::SeqCst);
                Answer::Stats(Box::new(stats))
            }
            Op::Ask(ask) => {
                let ask: Ask =
                    serde_json::from_value(ask).map_err(|e| ServeError::Invalid(format!("bad call: {e}")))?;
                Answer::Value(ask.answer(w).await?)
            }
            _ => return Err(ServeError::Internal("not a call that only asks".into())),
        })
    }

    /// Takes over this connection's reservation `id` (the call that uses it runs).
    fn own(&self, id: RequestId) -> Result<(), ServeError> {
        match self.unhold(id) {
            true => Ok(()),
            false => Err(ServeError::Invalid(format!("this connection holds no reservation {id}"))),
        }
    }

    /// Answers a call that cannot run: an error event for a stream call, else an error
    /// reply.
    fn refuse(self: Arc<Self>, call: CallId, e: ServeError) {
        tracing::warn!(kind = e.kind(), error = %e, "refused a call");
        let msg = FromWorker::Reply { call, result: Err(e.clone()) };
        let event = FromWorker::Event { call, event: Event::Failed(e) };
        self.try_send(event);
        self.try_send(msg);
    }

    /// Runs a call answered once, remembered so `Cancel` can stop it.
    fn reply(
        self: Arc<Self>,
        call: CallId,
        answer: impl std::future::Future<Output = Result<Answer, ServeError>> + Send + 'static,
    ) {
        let (s, owing) = (self.clone(), self.owing());
        let task = tokio::spawn(async move {
            let _owing = owing;
            let result = answer.await;
            lock(&s.calls).remove(&call);
            let _ = s.send(FromWorker::Reply { call, result }).await;
        });
        self.remember(call, task.abort_handle());
    }

    /// Streams a call's events back; aborting the task drops the stream, which
    /// cancels the request in the worker.
    fn stream(self: Arc<Self>, call: CallId, stream: Result<TokenStream, ServeError>, span: tracing::Span) {
        let (s, owing) = (self.clone(), self.owing());
        let (pace, paced) = watch::channel(false);
        lock(&self.paces).insert(call, pace);
        let pump = async move {
            // Owed until the last frame is queued, where that frame takes over.
            let _owing = owing;
            match stream {
                Ok(stream) => s.pump(call, stream, paced).await,
                Err(e) => {
                    tracing::warn!(kind = e.kind(), error = %e, "refused");
                    let _ = s.send(FromWorker::Event { call, event: Event::Failed(e) }).await;
                }
            }
            lock(&s.calls).remove(&call);
            lock(&s.paces).remove(&call);
        };
        let task = tokio::spawn(tracing::Instrument::instrument(pump, span));
        self.remember(call, task.abort_handle());
    }

    /// Sends `stream`'s events while the router is not pacing it: held back, they
    /// pile up in the stream and the worker pauses the sequence.
    async fn pump(&self, call: CallId, mut stream: TokenStream, mut paced: watch::Receiver<bool>) {
        let mut tokens = 0usize;
        loop {
            // An error means the pace is gone with the call: nothing holds us back.
            let _ = paced.wait_for(|paused| !paused).await;
            let Some(event) = stream.next().await else { break };
            match &event {
                Event::Token(_) => tokens += 1,
                Event::Done { .. } => tracing::debug!(tokens, "finished"),
                Event::Failed(e) => tracing::warn!(tokens, kind = e.kind(), error = %e, "failed"),
                Event::Prompt(_) | Event::Embedding(_) | Event::Drafts(_) => {}
            }
            let last = event.is_last();
            if self.send(FromWorker::Event { call, event }).await.is_err() || last {
                if !last {
                    tracing::debug!(tokens, "cancelled by the router");
                }
                return;
            }
        }
        let e = ServeError::Internal("the worker dropped the request".into());
        let _ = self.send(FromWorker::Event { call, event: Event::Failed(e) }).await;
    }

    /// Notes a reservation this connection asks for.
    fn expect_hold(&self, id: RequestId) -> Result<(), ServeError> {
        let mut held = lock(&self.held);
        let held = held.as_mut().ok_or_else(|| ServeError::Internal("the connection is closing".into()))?;
        if held.contains_key(&id) {
            return Err(ServeError::Invalid(format!("{id} is already reserved on this connection")));
        }
        if held.len() >= MAX_HELD {
            return Err(ServeError::Overloaded(format!("this connection holds {MAX_HELD} reservations already")));
        }
        held.insert(id, Hold::Reserving);
        Ok(())
    }

    /// The worker answered a reservation. One released meanwhile (or whose connection
    /// closed) is given back at once.
    fn granted(&self, id: RequestId, ok: bool) -> Result<(), ServeError> {
        let mut held = lock(&self.held);
        let still_wanted = held.as_mut().is_some_and(|h| h.get(&id) == Some(&Hold::Reserving));
        match (ok, still_wanted) {
            (true, true) => {
                held.as_mut().map(|h| h.insert(id, Hold::Held));
                Ok(())
            }
            (true, false) => {
                drop(held);
                self.worker().release(id);
                Err(ServeError::Internal(format!("the reservation of {id} was released")))
            }
            (false, _) => {
                held.as_mut().map(|h| h.remove(&id));
                Ok(())
            }
        }
    }

    /// Takes a granted reservation back from this connection; false if it holds no
    /// such one. A reservation still being asked for is forgotten (its answer will
    /// release it).
    fn unhold(&self, id: RequestId) -> bool {
        lock(&self.held).as_mut().and_then(|h| h.remove(&id)) == Some(Hold::Held)
    }

    fn remember(&self, call: CallId, task: AbortHandle) {
        let mut calls = lock(&self.calls);
        calls.retain(|_, t| !t.is_finished());
        calls.insert(call, task);
    }

    /// The router is gone: cancel its calls and release its reservations.
    fn close(&self) {
        for (_, task) in lock(&self.calls).drain() {
            task.abort();
        }
        let held = lock(&self.held).take().unwrap_or_default();
        for id in held.into_keys() {
            self.worker().release(id);
        }
    }
}

/// Refuses K/V sent to more later stages than any group has.
fn few_stages(stages: &[pdserve_types::StageReceiver]) -> Result<(), ServeError> {
    match stages.len() {
        n if n > MAX_STAGES => Err(ServeError::Invalid(format!("K/V sent to {n} stages (at most {MAX_STAGES})"))),
        _ => Ok(()),
    }
}

/// An operation whose requests pass the checks every request passes at the frontend:
/// sampling values in range, a prompt that is not empty.
fn checked(op: Op) -> Result<Op, ServeError> {
    let valid = |mut req: GenerateRequest| {
        if req.prompt.is_empty() {
            return Err(ServeError::Invalid("the prompt is empty".into()));
        }
        req.params = req.params.validate().map_err(|e| ServeError::Invalid(e.to_string()))?;
        Ok(req)
    };
    Ok(match op {
        Op::Generate { req } => Op::Generate { req: valid(req)? },
        Op::Prefill { req, to, token, imported, draft_worth, stages } => {
            few_stages(&stages)?;
            Op::Prefill { req: valid(req)?, to, token, imported, draft_worth, stages }
        }
        Op::ExportPrefix { id, tokens, skip, to, token, stages } => {
            few_stages(&stages)?;
            Op::ExportPrefix { id, tokens, skip, to, token, stages }
        }
        Op::GenerateImported { req, imported } => Op::GenerateImported { req: valid(req)?, imported },
        Op::Decode { mut handoff } => {
            if handoff.prompt.is_empty() {
                return Err(ServeError::Invalid("the prompt is empty".into()));
            }
            handoff.params = handoff.params.validate().map_err(|e| ServeError::Invalid(e.to_string()))?;
            Op::Decode { handoff }
        }
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call's last frame is owed after the call's task ends, until the writer takes
    /// it, or the connection drops it with the outbox.
    #[test]
    fn a_queued_frame_is_owed_until_written_or_dropped() {
        let owed = Arc::new(AtomicUsize::new(0));
        let (out, mut outbox) = mpsc::channel::<Frame>(4);
        let call = Owing::new(&owed);
        let frame = |msg| Frame { msg, _owing: Owing::new(&owed) };
        out.try_send(frame(FromWorker::Pong)).unwrap();
        out.try_send(frame(FromWorker::Pong)).unwrap();
        drop(call);
        assert_eq!(owed.load(Ordering::SeqCst), 2, "both frames are queued");
        let written = outbox.try_recv().unwrap();
        assert_eq!(owed.load(Ordering::SeqCst), 2, "one is being written");
        drop(written);
        assert_eq!(owed.load(Ordering::SeqCst), 1);
        drop(outbox);
        assert_eq!(owed.load(Ordering::SeqCst), 0, "the connection's queue went with it");
    }
}
