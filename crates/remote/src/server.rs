//! A worker process's control server: takes calls from routers over TCP and runs
//! each on the worker it serves (any [`Worker`]: an engine, or a simulated one).
//!
//! Every connection owns what its calls started: it may release or decode only the
//! reservations it made, and when it closes, its calls are cancelled and those
//! reservations released.

use crate::control::{self, Answer, CallId, FromWorker, Handshake, Op, ToWorker, PROTOCOL_VERSION};
use pdserve_kv_transfer::{KvTarget, TransportKind};
use pdserve_protocol::{Event, KvDestination, ServeError, TokenStream, Worker};
use pdserve_types::RequestId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

/// Replies queued per connection before the sender waits.
const OUTBOX: usize = 1024;

/// One worker offered to routers.
pub struct WorkerServer {
    worker: Arc<dyn Worker>,
}

impl WorkerServer {
    pub fn new(worker: Arc<dyn Worker>) -> Arc<WorkerServer> {
        Arc::new(WorkerServer { worker })
    }

    /// What a router learns when it connects.
    fn handshake(&self) -> Handshake {
        let port = match self.worker.kv_target(TransportKind::Tcp) {
            Some(KvTarget::Remote(pdserve_kv_transfer::KvAddr::Tcp(a))) => Some(a.port()),
            _ => None,
        };
        let shm = match self.worker.kv_target(TransportKind::Shm) {
            Some(KvTarget::Remote(pdserve_kv_transfer::KvAddr::Shm(p))) => Some(p),
            _ => None,
        };
        Handshake { protocol: PROTOCOL_VERSION, info: self.worker.info().clone(), kv_tcp_port: port, kv_shm: shm }
    }

    /// Accepts routers until `shutdown` resolves.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let _ = stream.set_nodelay(true);
                        tracing::debug!(%peer, "router connected");
                        tokio::spawn(self.clone().session(stream));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        // Out of descriptors, most likely: back off instead of spinning.
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
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
                if control::write(&mut wr, &msg).await.is_err() {
                    return;
                }
            }
        });
        let held = Mutex::new(Some(HashMap::new()));
        let s = Arc::new(Session { srv: self, out, calls: Mutex::default(), held });
        loop {
            match control::read::<_, ToWorker>(&mut rd).await {
                Ok(Some(msg)) => s.clone().handle(msg),
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "dropping a router connection");
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
    out: mpsc::Sender<FromWorker>,
    /// Calls in progress, so `Cancel` (or the connection closing) stops them.
    calls: Mutex<HashMap<CallId, AbortHandle>>,
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

    fn handle(self: Arc<Self>, msg: ToWorker) {
        match msg {
            // The router compares versions and hangs up on a mismatch.
            ToWorker::Hello { .. } => {
                let _ = self.out.try_send(FromWorker::Hello(self.srv.handshake()));
            }
            ToWorker::Call { call, op } => self.call(call, *op),
            ToWorker::Cancel { call } => {
                if let Some(task) = lock(&self.calls).remove(&call) {
                    task.abort();
                }
            }
        }
    }

    fn call(self: Arc<Self>, call: CallId, op: Op) {
        match op {
            Op::Generate { req } => {
                let span = tracing::info_span!("generate", request_id = %req.tag);
                let (events, stream) = TokenStream::channel(req.params.max_tokens as usize + 4);
                let started = span.in_scope(|| self.worker().generate(req, events));
                self.stream(call, started.map(|()| stream), span);
            }
            Op::Decode { handoff } => {
                let id = handoff.id;
                let span = tracing::info_span!("decode", request_id = %handoff.tag);
                // Only a reservation of this connection's own.
                if !self.unhold(id) {
                    let e = ServeError::Invalid(format!("this connection holds no reservation {id}"));
                    return self.stream(call, Err(e), span);
                }
                let (events, stream) = TokenStream::channel(handoff.params.max_tokens as usize + 4);
                let started = self.worker().decode(handoff, events);
                self.stream(call, started.map(|()| stream), span);
            }
            Op::Reserve { id, prompt_len } => {
                // Noted before the call runs, so a release that overtakes its answer
                // still releases what the worker grants.
                if let Err(e) = self.expect_hold(id) {
                    return self.reply(call, async move { Err(e) });
                }
                let s = self.clone();
                self.reply(call, async move {
                    let granted = s.worker().reserve(id, prompt_len).await;
                    s.granted(id, granted.is_ok())?;
                    Ok(Answer::Token(granted?))
                })
            }
            Op::Prefill { req, to, token } => {
                let span = tracing::info_span!("prefill", request_id = %req.tag, prompt_tokens = req.prompt.len());
                let done = self.worker().prefill(req, KvDestination { target: KvTarget::Remote(to), token });
                let answer = async move {
                    let p =
                        done.await.inspect_err(|e| tracing::warn!(kind = e.kind(), error = %e, "prefill failed"))?;
                    tracing::debug!(prefill_ms = p.prefill_seconds * 1e3, kv_bytes = p.kv_bytes, "prefill done");
                    Ok(Answer::Prefilled(p))
                };
                self.reply(call, tracing::Instrument::instrument(answer, span))
            }
            Op::Release { id } => {
                if self.unhold(id) {
                    self.worker().release(id);
                }
            }
            Op::Stats => {
                let s = self.clone();
                self.reply(call, async move { Ok(Answer::Stats(s.worker().stats().await?)) })
            }
        }
    }

    /// Runs a call answered once, remembered so `Cancel` can stop it.
    fn reply(
        self: Arc<Self>,
        call: CallId,
        answer: impl std::future::Future<Output = Result<Answer, ServeError>> + Send + 'static,
    ) {
        let s = self.clone();
        let task = tokio::spawn(async move {
            let result = answer.await;
            lock(&s.calls).remove(&call);
            let _ = s.out.send(FromWorker::Reply { call, result }).await;
        });
        self.remember(call, task.abort_handle());
    }

    /// Streams a call's events back; aborting the task drops the stream, which
    /// cancels the request in the worker.
    fn stream(self: Arc<Self>, call: CallId, stream: Result<TokenStream, ServeError>, span: tracing::Span) {
        let s = self.clone();
        let pump = async move {
            match stream {
                Ok(stream) => s.pump(call, stream).await,
                Err(e) => {
                    tracing::warn!(kind = e.kind(), error = %e, "refused");
                    let _ = s.out.send(FromWorker::Event { call, event: Event::Failed(e) }).await;
                }
            }
            lock(&s.calls).remove(&call);
        };
        let task = tokio::spawn(tracing::Instrument::instrument(pump, span));
        self.remember(call, task.abort_handle());
    }

    async fn pump(&self, call: CallId, mut stream: TokenStream) {
        let mut tokens = 0usize;
        while let Some(event) = stream.next().await {
            match &event {
                Event::Token(_) => tokens += 1,
                Event::Done { .. } => tracing::debug!(tokens, "finished"),
                Event::Failed(e) => tracing::warn!(tokens, kind = e.kind(), error = %e, "failed"),
                Event::Prompt(_) => {}
            }
            let last = event.is_last();
            if self.out.send(FromWorker::Event { call, event }).await.is_err() || last {
                if !last {
                    tracing::debug!(tokens, "cancelled by the router");
                }
                return;
            }
        }
        let e = ServeError::Internal("the worker dropped the request".into());
        let _ = self.out.send(FromWorker::Event { call, event: Event::Failed(e) }).await;
    }

    /// Notes a reservation this connection asks for.
    fn expect_hold(&self, id: RequestId) -> Result<(), ServeError> {
        let mut held = lock(&self.held);
        let held = held.as_mut().ok_or_else(|| ServeError::Internal("the connection is closing".into()))?;
        if held.contains_key(&id) {
            return Err(ServeError::Invalid(format!("{id} is already reserved on this connection")));
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
