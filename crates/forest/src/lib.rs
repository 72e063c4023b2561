//! The River ingress (`pdserve frontend --nats URL --river`): inference requests a
//! NimsForest forest puts on its JetStream stream `RIVER` under `river.infer.>` are
//! taken by the durable pull consumer `infer-request-parser` (shared by every
//! frontend), served through this frontend's own OpenAI API, and answered with Leaves.
//! See `docs/nimsforest.md` for the formats and the delivery contract.
//!
//! Delivery: a message is acknowledged once its result Leaf is published (progress
//! acks keep it ours while it runs), so a frontend that dies mid-request leaves it
//! to another one. Which copy of a request runs is decided by its lease in the
//! bucket `INFER_REQ` (`pdserve_fleet::request_lease`): a copy of a finished request
//! is dropped, and a copy of a running one waits until it finishes, or takes over
//! once its runner stopped renewing.

mod leaf_stream;

use async_nats::jetstream::consumer::{pull, AckPolicy};
use async_nats::jetstream::message::{AckKind, Message};
use async_nats::jetstream::{self, stream};
use async_nats::Client;
use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use pdserve_fleet::forest::{self, ForestRequest, Leaf, Unusable};
use pdserve_fleet::request_lease as lease;
use pdserve_fleet::NatsConfig;
use pdserve_frontend::observe::{Observer, RequestRecord};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

const STREAM: &str = "RIVER";
const FILTER: &str = "river.infer.>";
const DURABLE: &str = "infer-request-parser";
const SOURCE: &str = "tree:infer-request-parser";
/// The source of lifecycle Leaves, which the API publishes for every ingress.
const LIFECYCLE_SOURCE: &str = "nim:pdserve";
/// The Wind subject of requests, and the queue group frontends share on it.
const SUBMIT: &str = "infer.request.submit";
const QUEUE: &str = "infer-router";
/// How long a message is ours without an ack (progress acks renew it): also how
/// long the requests of a frontend that died wait before another one takes them.
const ACK_WAIT: Duration = Duration::from_secs(10);
const PROGRESS_EVERY: Duration = lease::RENEW_EVERY;
/// Deliveries of one message before it is given up as failed.
const MAX_DELIVER: i64 = 5;
/// The pause before a message refused for a passing reason (overload) comes again,
/// times its deliveries so far.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// Requests from the River and the Wind served at once by this frontend: enough to
/// fill a worker's batches, few enough not to crowd out its HTTP clients.
const IN_FLIGHT: usize = 16;

/// What an API server does once it listens on `addr`: with `cfg`, consume the River
/// and the Wind, sending their requests to that address (loopback when it listens
/// on every interface), with the API's key if it has one.
pub fn after_bind(
    cfg: Option<NatsConfig>,
    observer: Option<Arc<LeafObserver>>,
    key: Option<String>,
    replies: Vec<String>,
) -> impl FnOnce(SocketAddr) {
    move |addr| {
        let Some(cfg) = cfg else { return };
        let api = match addr.ip().is_unspecified() {
            true => SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), addr.port()),
            false => addr,
        };
        tokio::spawn(async move {
            let bus = pdserve_fleet::Bus::connect_patiently(&cfg).await;
            run(bus.client(), cfg.replicas, (api, key.map(Arc::from)), observer, replies.into()).await
        });
    }
}

/// Publishes every request's lifecycle, whatever its ingress, as Leaves:
/// `infer.request.accepted`, then `completed`, `rejected` or `failed`.
pub struct LeafObserver {
    tx: tokio::sync::mpsc::Sender<Leaf>,
    /// Ingress requests waiting for their finished record, by request id.
    waiting: std::sync::Mutex<std::collections::HashMap<String, tokio::sync::oneshot::Sender<RequestRecord>>>,
}

/// Lifecycle Leaves waiting for NATS at most; more are dropped (and said so).
const LIFECYCLE_BACKLOG: usize = 4096;

impl LeafObserver {
    /// Starts the publisher on the current runtime.
    pub fn start(cfg: NatsConfig) -> Arc<LeafObserver> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Leaf>(LIFECYCLE_BACKLOG);
        tokio::spawn(async move {
            let client = pdserve_fleet::Bus::connect_patiently(&cfg).await.client();
            while let Some(leaf) = rx.recv().await {
                publish_all(&client, vec![leaf]).await;
            }
        });
        Arc::new(LeafObserver { tx, waiting: Default::default() })
    }

    /// The record of `request_id` once it finishes (its next attempt through the API).
    fn expect(&self, request_id: &str) -> tokio::sync::oneshot::Receiver<RequestRecord> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.waiting().insert(request_id.to_string(), tx);
        rx
    }

    fn forget(&self, request_id: &str) {
        self.waiting().remove(request_id);
    }

    fn waiting(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, tokio::sync::oneshot::Sender<RequestRecord>>> {
        self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn send(&self, subject: &str, r: &RequestRecord) {
        let leaf = Leaf::new(subject, LIFECYCLE_SOURCE, serde_json::to_value(r).unwrap_or_default());
        if self.tx.try_send(leaf).is_err() {
            tracing::warn!(request_id = %r.request_id, subject, "lifecycle Leaf dropped: NATS is behind");
        }
    }
}

impl Observer for LeafObserver {
    fn accepted(&self, r: &RequestRecord) {
        self.send("infer.request.accepted", r);
    }

    fn finished(&self, r: &RequestRecord) {
        let subject = match r.outcome {
            Some("ok") => "infer.request.completed",
            Some("rejected") => "infer.request.rejected",
            _ => "infer.request.failed",
        };
        self.send(subject, r);
        if let Some(tx) = self.waiting().remove(&r.request_id) {
            let _ = tx.send(r.clone());
        }
    }
}

/// Consumes the River until the process ends; the API answers at `api` (with its key).
pub async fn run(
    client: Client,
    replicas: usize,
    api: Api,
    observer: Option<Arc<LeafObserver>>,
    replies: Arc<[String]>,
) {
    loop {
        match consume(&client, replicas, api.clone(), observer.clone(), replies.clone()).await {
            Ok(()) => tracing::warn!("the River consumer ended; starting it again"),
            Err(e) => tracing::warn!(error = %e, "the River consumer failed; starting it again"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The API's address and key.
pub type Api = (SocketAddr, Option<Arc<str>>);

async fn consume(
    client: &Client,
    replicas: usize,
    api: Api,
    observer: Option<Arc<LeafObserver>>,
    replies: Arc<[String]>,
) -> anyhow::Result<()> {
    let js = jetstream::new(client.clone());
    // The forest's own settings, should it not have made the stream yet.
    let river = js
        .get_or_create_stream(stream::Config {
            name: STREAM.into(),
            subjects: vec!["river.>".into()],
            storage: stream::StorageType::File,
            retention: stream::RetentionPolicy::WorkQueue,
            max_age: Duration::from_secs(24 * 3600),
            max_messages: 100_000,
            discard: stream::DiscardPolicy::Old,
            num_replicas: replicas,
            ..Default::default()
        })
        .await?;
    let consumer = river
        .get_or_create_consumer(
            DURABLE,
            pull::Config {
                durable_name: Some(DURABLE.into()),
                filter_subject: FILTER.into(),
                ack_policy: AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                max_deliver: MAX_DELIVER,
                ..Default::default()
            },
        )
        .await?;
    let leases = lease::Leases::open(&js, replicas).await.map_err(|e| anyhow::anyhow!(e))?;
    let ctx = Arc::new(Ctx { client: client.clone(), leases, api, observer, replies });
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let submits = client.queue_subscribe(SUBMIT, QUEUE.into()).await?;
    let _wind = AbortOnDrop(tokio::spawn(wind(submits, ctx.clone(), slots.clone())));
    tracing::info!(
        stream = STREAM,
        consumer = DURABLE,
        submit = SUBMIT,
        "taking inference requests from the River and the Wind"
    );
    // Pulled no further ahead than it serves: a message queued here past its ack
    // wait is delivered again, and its copies only wait on each other.
    let mut messages = consumer.stream().max_messages_per_batch(IN_FLIGHT).messages().await?;
    while let Some(msg) = messages.next().await {
        let msg = msg?;
        let permit = slots.clone().acquire_owned().await?;
        let ctx = ctx.clone();
        tokio::spawn(async move {
            ctx.handle(msg).await;
            drop(permit);
        });
    }
    Ok(())
}

/// Takes Leaves from `infer.request.submit` (queue group [`QUEUE`]: each goes to one
/// frontend) until the subscription ends.
async fn wind(mut submits: async_nats::Subscriber, ctx: Arc<Ctx>, slots: Arc<Semaphore>) {
    while let Some(msg) = submits.next().await {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let ctx = ctx.clone();
        tokio::spawn(async move {
            ctx.handle_submit(msg).await;
            drop(permit);
        });
    }
}

/// Stops a task when the scope that started it ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Ctx {
    client: Client,
    leases: lease::Leases,
    api: Api,
    /// Gives each answer its request's record (timings, workers) for the result Leaf.
    observer: Option<Arc<LeafObserver>>,
    /// The subjects a request's `reply_to` may name (by prefix).
    replies: Arc<[String]>,
}

/// How serving a request through the API ended.
enum Served {
    /// 200: the OpenAI response object.
    Answer(Value),
    /// The request itself is wrong (a 4xx other than 429): its error message.
    Refused(String),
    /// Worth another try later (429, 503, a broken connection): why.
    Passing(String),
    /// Failed after tokens went out as stream Leaves: not tried again.
    Failed(String),
}

impl Ctx {
    /// One River message: rejected, dropped as a copy, served, or given back.
    async fn handle(&self, msg: Message) {
        let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
        let req = match forest::parse_river(&msg.payload, &self.replies) {
            Ok(r) => r,
            Err(u) => {
                self.publish_rejected(u, "river").await;
                return ack(&msg, AckKind::Term).await;
            }
        };
        let key = format!("req.{}", req.request_id);
        let mut lease = match self.leases.claim(&key, || ack(&msg, AckKind::Progress)).await {
            lease::Claim::Run(lease) => lease,
            lease::Claim::Finished => {
                tracing::info!(request_id = %req.request_id, "a finished River request came again; dropped");
                return ack(&msg, AckKind::Ack).await;
            }
            lease::Claim::Unknown => return ack(&msg, AckKind::Nak(Some(RETRY_AFTER))).await,
        };
        let late = msg.info().ok().and_then(|i| past_deadline(&req, i.published.unix_timestamp_nanos()));
        if let Some(late) = late {
            self.publish_rejected(unusable(&req, late), "river").await;
            self.leases.finish(lease).await;
            return ack(&msg, AckKind::Term).await;
        }
        let last_try = delivered >= MAX_DELIVER;
        match self.answer(&req, "river", Some(&msg), last_try, &mut lease).await {
            Answered::Finished(kind) => {
                self.leases.finish(lease).await;
                ack(&msg, kind).await;
            }
            Answered::Again => {
                self.leases.give_back(lease).await;
                ack(&msg, AckKind::Nak(Some(RETRY_AFTER * delivered.max(1) as u32))).await;
            }
            // The message is the new runner's (a redelivery) or a copy it waits on.
            Answered::Lost => {
                tracing::warn!(request_id = %req.request_id, "lease lost or unconfirmed; left to its next delivery")
            }
        }
    }

    /// One Leaf on `infer.request.submit` (at most once, as the Wind is): a NATS
    /// request gets `{"accepted": ...}` back at once, the answer comes as Leaves.
    async fn handle_submit(&self, msg: async_nats::Message) {
        let reply = |v: Value| {
            let (client, to) = (self.client.clone(), msg.reply.clone());
            async move {
                if let Some(to) = to {
                    let _ = client.publish(to, v.to_string().into()).await;
                }
            }
        };
        let parsed = Leaf::parse(&msg.payload, msg.subject.as_str()).map_err(|reason| Unusable {
            request_id: None,
            reason,
            context: Value::Null,
        });
        let req = match parsed.and_then(|leaf| forest::parse_submit(&leaf, &self.replies)) {
            Ok(r) => r,
            Err(u) => {
                reply(json!({"accepted": false, "request_id": u.request_id, "error": u.reason})).await;
                return self.publish_rejected(u, "wind").await;
            }
        };
        let key = format!("req.{}", req.request_id);
        let Some(mut lease) = self.leases.try_claim(&key).await else {
            // A copy (TreeHouses on several nodes send one each): the first answers.
            return reply(json!({"accepted": true, "request_id": req.request_id, "duplicate": true})).await;
        };
        if let Some(late) = past_deadline(&req, now_ns() - 1) {
            reply(json!({"accepted": false, "request_id": req.request_id, "error": late})).await;
            self.publish_rejected(unusable(&req, late), "wind").await;
            return self.leases.finish(lease).await;
        }
        reply(json!({"accepted": true, "request_id": req.request_id})).await;
        if !matches!(self.answer(&req, "wind", None, true, &mut lease).await, Answered::Lost) {
            self.leases.finish(lease).await;
        }
    }

    /// Serves an accepted request and publishes what came of it. `Again` (only when
    /// not `last_try`) when it may succeed later: overload, no worker.
    async fn answer(
        &self,
        req: &ForestRequest,
        ingress: &str,
        msg: Option<&Message>,
        last_try: bool,
        lease: &mut lease::Lease,
    ) -> Answered {
        let record = self.observer.as_ref().map(|o| o.expect(&req.request_id));
        let t0 = Instant::now();
        let served = self.serve_with_progress(req, ingress, msg, lease).await;
        let e2e_ms = pdserve_types::millis(t0.elapsed());
        // The API reports the request as its answer ends: a moment's wait at most.
        let record = match record {
            Some(rx) => tokio::time::timeout(Duration::from_secs(1), rx).await.ok().and_then(Result::ok),
            None => None,
        };
        if let Some(o) = &self.observer {
            o.forget(&req.request_id);
        }
        // The last look before anything goes out: a lease lost since is not answered.
        // A River message whose lease cannot be confirmed (NATS unreachable) is not
        // answered either: it is delivered again and its copy answers, where a
        // publish buffered until NATS is back could be a second answer. The Wind has
        // no second delivery, so there only a lease known lost stops the answer.
        let Some(served) = served else { return Answered::Lost };
        match self.leases.renew(lease).await {
            lease::Renewed::Held => {}
            lease::Renewed::Unknown if msg.is_none() => {}
            lease::Renewed::Lost | lease::Renewed::Unknown => return Answered::Lost,
        }
        match served {
            Served::Answer(mut response) => {
                if let Some(o) = response.as_object_mut() {
                    o.insert("request_id".into(), Value::from(req.request_id.as_str()));
                    o.insert("context".into(), req.context.clone());
                    o.insert("ingress".into(), Value::from(ingress));
                    let mut timings = json!({"e2e_ms": e2e_ms});
                    if let Some(r) = record {
                        timings = serde_json::to_value(&r.timings).unwrap_or(timings);
                        o.insert("route".into(), json!(r.route));
                        o.insert("prefill_node_id".into(), json!(r.prefill_node_id));
                        o.insert("decode_node_id".into(), json!(r.decode_node_id));
                    }
                    o.insert("timings".into(), timings);
                }
                self.publish(Leaf::new(req.reply_to.clone(), SOURCE, response)).await;
                Answered::Finished(AckKind::Ack)
            }
            // The API's own lifecycle Leaf (rejected) says why.
            Served::Refused(why) => {
                tracing::info!(request_id = %req.request_id, reason = %why, ingress, "request refused by the API");
                Answered::Finished(AckKind::Term)
            }
            Served::Failed(why) => {
                let data = event(req, json!({"error": why, "ingress": ingress}));
                self.publish(Leaf::new("infer.request.failed", SOURCE, data)).await;
                Answered::Finished(AckKind::Term)
            }
            Served::Passing(why) if !last_try => {
                tracing::warn!(request_id = %req.request_id, reason = %why, "request not served now; again later");
                Answered::Again
            }
            Served::Passing(why) => {
                let data = event(req, json!({"error": why, "ingress": ingress}));
                self.publish(Leaf::new("infer.request.failed", SOURCE, data)).await;
                Answered::Finished(AckKind::Term)
            }
        }
    }

    /// Serves `req`, telling JetStream every [`PROGRESS_EVERY`] that the message is
    /// still being worked on and renewing the lease; `None` (the call dropped, which
    /// cancels it) once the lease is lost.
    async fn serve_with_progress(
        &self,
        req: &ForestRequest,
        ingress: &str,
        msg: Option<&Message>,
        lease: &mut lease::Lease,
    ) -> Option<Served> {
        let call = serve(&self.api, req, ingress, &self.client);
        tokio::pin!(call);
        loop {
            tokio::select! {
                served = &mut call => return Some(served),
                _ = tokio::time::sleep(PROGRESS_EVERY) => {
                    if let Some(msg) = msg {
                        ack(msg, AckKind::Progress).await;
                    }
                    if self.leases.renew(lease).await == lease::Renewed::Lost {
                        return None;
                    }
                }
            }
        }
    }

    async fn publish_rejected(&self, u: Unusable, ingress: &str) {
        tracing::info!(request_id = ?u.request_id, reason = %u.reason, ingress, "request rejected");
        let data = json!({"request_id": u.request_id, "error": u.reason, "context": u.context, "ingress": ingress});
        self.publish(Leaf::new("infer.request.rejected", SOURCE, data)).await;
    }

    async fn publish(&self, leaf: Leaf) {
        publish_all(&self.client, vec![leaf]).await;
    }
}

fn now_ns() -> i128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i128)
}

fn unusable(req: &ForestRequest, reason: String) -> Unusable {
    Unusable { request_id: Some(req.request_id.clone()), reason, context: req.context.clone() }
}

/// What came of answering a request.
enum Answered {
    /// Its message is acknowledged with this.
    Finished(AckKind),
    /// Worth another try later.
    Again,
    /// Another frontend took it over, or (River) the lease could not be confirmed:
    /// nothing was sent, the message is left alone.
    Lost,
}

/// A lifecycle Leaf's data: the request's id, endpoint and context, and `extra`.
fn event(req: &ForestRequest, extra: Value) -> Value {
    let mut data = json!({"request_id": req.request_id, "api": req.api, "model": req.body.get("model"),
                          "priority": req.priority, "context": req.context});
    if let (Some(d), Value::Object(e)) = (data.as_object_mut(), extra) {
        d.extend(e);
    }
    data
}

async fn ack(msg: &Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        tracing::warn!(error = %e, "cannot acknowledge a River message");
    }
}

/// Why `req` may no longer start: its `deadline_ms` after `since` (ns since the
/// epoch: when the River took it, or when it arrived on the Wind) passed.
fn past_deadline(req: &ForestRequest, since: i128) -> Option<String> {
    let limit = req.deadline_ms?;
    let waited_ms = (now_ns() - since) / 1_000_000;
    (waited_ms >= i128::from(limit)).then(|| format!("deadline_ms {limit} passed before it started ({waited_ms} ms)"))
}

/// Sends `req` to the API on `api` (loopback), as a client would. A request that
/// asks for `stream` streams its tokens as Leaves on the way (see [`leaf_stream`]).
async fn serve((api, key): &Api, req: &ForestRequest, ingress: &str, client: &Client) -> Served {
    let api = *api;
    let streaming = req.body.get("stream") == Some(&Value::Bool(true));
    let mut body = req.body.clone();
    if let Some(o) = body.as_object_mut() {
        o.insert("stream".into(), Value::Bool(streaming));
        if streaming {
            o.insert("stream_options".into(), json!({"include_usage": true}));
        }
    }
    let request = hyper::Request::post(req.api.path())
        .header(hyper::header::HOST, api.to_string())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header("x-request-id", &req.request_id)
        .header("x-pdserve-ingress", ingress)
        .header("x-pdserve-context", req.context.to_string());
    let request = match key {
        Some(k) => request.header(hyper::header::AUTHORIZATION, format!("Bearer {k}")),
        None => request,
    };
    let request = request.body(Full::new(Bytes::from(body.to_string())));
    let Ok(request) = request else { return Served::Refused("the request cannot be sent".into()) };
    let sent = async {
        let stream = tokio::net::TcpStream::connect(api).await.map_err(|e| e.to_string())?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        sender.send_request(request).await.map_err(|e| e.to_string())
    };
    let resp = match sent.await {
        Ok(r) => r,
        Err(e) => return Served::Passing(format!("the API did not answer: {e}")),
    };
    let status = resp.status().as_u16();
    if status == 200 && streaming {
        return stream_leaves(resp.into_body(), req, client).await;
    }
    let bytes = match resp.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Served::Passing(format!("the API's answer broke off: {e}")),
    };
    if status == 200 {
        return match serde_json::from_slice(&bytes) {
            Ok(v) => Served::Answer(v),
            Err(e) => Served::Passing(format!("the API's answer is not JSON: {e}")),
        };
    }
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let msg = v["error"]["message"].as_str().unwrap_or("no message").to_string();
    match status {
        429 | 500..=599 => Served::Passing(format!("{status}: {msg}")),
        _ => Served::Refused(format!("{status}: {msg}")),
    }
}

/// Reads an SSE answer, publishing stream Leaves as tokens come, and returns the
/// whole response. Tokens were already sent when it fails: it fails for good.
async fn stream_leaves(mut body: hyper::body::Incoming, req: &ForestRequest, client: &Client) -> Served {
    let mut sse = pdserve_bench::sse::SseParser::new();
    let mut acc = leaf_stream::Assembler::new(req, SOURCE);
    loop {
        let due = acc.due();
        let frame = tokio::select! {
            f = body.frame() => f,
            _ = sleep_until(due) => {
                publish_all(client, acc.flush()).await;
                continue;
            }
        };
        let data = match frame {
            Some(Ok(f)) => f.into_data().unwrap_or_default(),
            Some(Err(e)) => return Served::Failed(format!("the token stream broke off: {e}")),
            None => return Served::Failed("the token stream ended without [DONE]".into()),
        };
        for line in sse.feed(&data).into_iter().map(|e| e.data) {
            if line == "[DONE]" {
                publish_all(client, acc.flush()).await;
                return Served::Answer(acc.response());
            }
            let chunk: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
            if let Some(msg) = chunk["error"]["message"].as_str() {
                return Served::Failed(format!("the token stream failed: {msg}"));
            }
            publish_all(client, acc.push(chunk)).await;
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn publish_all(client: &Client, leaves: Vec<Leaf>) {
    for leaf in leaves {
        if let Err(e) = client.publish(leaf.subject.clone(), leaf.to_bytes().into()).await {
            tracing::warn!(subject = %leaf.subject, error = %e, "cannot publish a Leaf");
        }
    }
}
