//! A simulated worker on a virtual clock, for the twin (`pdserve sim`, `pdserve plan`).
//!
//! It is this crate's worker loop around a timed engine, run as a task of a paused
//! tokio runtime: the engine's scheduler, block pool, prefix cache, reservations and
//! role fencing are the real ones, and only the compute and the KV link are modelled.
//! A step sleeps the time its shape costs on the profile; a handoff's transfer sleeps
//! what the profile's link takes for the prompt's bytes, overlapped layer by layer
//! with the prefill as the real transports overlap it. No frame is moved.

use crate::machine::{LinkModel, Machine};
use crate::worker_loop;
use crate::{lock, or_release, Command, Counted, Defer};
use pdserve_engine::batch::{Engine, EngineConfig};
use pdserve_engine::tiers::{TierConfig, TierError};
use pdserve_engine::timed::TimedModel;
use pdserve_kv::BlockPool;
use pdserve_kv_transfer::{HandoffToken, Inboxes, KvTarget, TransportKind};
use pdserve_protocol::{
    DecodeHandoff, EventSender, GenerateRequest, KvCursor, KvDestination, KvEventLog, KvEvents, Prefilled, PrefixPeer,
    Reply, Reserved, RoleState, RoleSwitch, ServeError, Worker, WorkerInfo, WorkerStats,
};
use pdserve_types::{Assignment, Epoch, RequestId, Role};

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::sync::oneshot;

/// Commands a simulated worker queues before refusing more (as a real one).
const QUEUE: usize = 4096;

/// What a simulated worker is.
pub struct SimOptions {
    pub name: String,
    pub role: Role,
    pub model_name: String,
    pub engine: EngineConfig,
    /// The timed stand-in of the model (its clock must be virtual).
    pub timed: TimedModel,
    /// Bytes of K and V one prompt token moves in a handoff (the real model's).
    pub kv_bytes_per_token: f64,
    /// Bytes the draft model's K and V of one prompt token add to a handoff that
    /// carries them (0 without a draft model).
    pub draft_kv_bytes_per_token: f64,
    /// The link of each transport the router may send KV over.
    pub links: Vec<(TransportKind, LinkModel)>,
    /// The machine it shares with other simulated workers.
    pub machine: Arc<Machine>,
    /// Host and disk tiers below its pool, sized in blocks of the real model; a
    /// copy back costs what `timed.restore` says.
    pub tiers: TierConfig,
}

/// A handle to a simulated worker; the loop lives as long as a handle does.
#[derive(Clone)]
pub struct SimWorker {
    inner: Arc<Inner>,
}

struct Inner {
    info: WorkerInfo,
    role: RoleState,
    tx: mpsc::Sender<Command>,
    active: Arc<AtomicUsize>,
    prefill_tokens: Arc<AtomicUsize>,
    kv_bytes_per_token: f64,
    draft_kv_bytes_per_token: f64,
    layers: usize,
    links: Vec<(TransportKind, LinkModel)>,
    /// Reservations granted and not yet decoded or released.
    imports: Mutex<HashSet<RequestId>>,
    /// Stands in for an in-process receiver; nothing is ever sent to it.
    inboxes: Inboxes,
    pool: BlockPool,
    /// Peers' fetches waiting for the engine (served after a layer of its step).
    exports: worker_loop::Exports,
}

impl SimWorker {
    /// Starts the worker's loop as a task of the current (paused) runtime; fails only
    /// when its disk tier cannot be opened.
    pub fn spawn(opts: SimOptions) -> Result<SimWorker, TierError> {
        let (layers, threads) = (opts.timed.n_layers, opts.engine.threads.max(1));
        let kv_dtype = opts.engine.kv_dtype;
        let engine = Engine::timed(opts.timed, opts.engine, Vec::new()).with_tiers(&opts.tiers)?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let active = Arc::new(AtomicUsize::new(0));
        let pool = engine.block_pool().clone();
        let exports = worker_loop::Exports::default();
        let clock = (opts.machine, threads, layers);
        let loop_ = worker_loop::run_virtual(engine, rx, active.clone(), clock, exports.clone());
        tokio::spawn(loop_);
        let info =
            WorkerInfo::new(opts.name, opts.model_name, opts.role).with_kv(kv_dtype, opts.kv_bytes_per_token as u64);
        let inner = Inner {
            role: RoleState::new(info.role),
            info,
            tx,
            active,
            prefill_tokens: Arc::default(),
            kv_bytes_per_token: opts.kv_bytes_per_token,
            draft_kv_bytes_per_token: opts.draft_kv_bytes_per_token,
            layers,
            links: opts.links,
            imports: Mutex::default(),
            inboxes: Inboxes::new(1),
            pool,
            exports,
        };
        Ok(SimWorker { inner: Arc::new(inner) })
    }
}

impl Worker for SimWorker {
    fn info(&self) -> &WorkerInfo {
        &self.inner.info
    }

    fn load(&self) -> usize {
        self.inner.active.load(Ordering::Relaxed)
    }

    fn is_alive(&self) -> bool {
        !self.inner.tx.is_closed()
    }

    fn generate(&self, req: GenerateRequest, events: EventSender) -> Result<(), ServeError> {
        self.inner.fence(req.fence, Role::decodes)?;
        self.inner.send_counted(Command::Generate(req, events))
    }

    fn kv_target(&self, via: TransportKind) -> Option<KvTarget> {
        self.inner.link(via)?;
        Some(match pdserve_kv_transfer::remote(via) {
            None => pdserve_kv_transfer::in_proc(self.inner.inboxes.clone()),
            // Never connected to: the link is modelled.
            Some(t) => KvTarget::Remote(t.modelled(&self.inner.info.name)),
        })
    }

    fn reserve(&self, id: RequestId, prompt_len: usize, fence: Option<Epoch>) -> Reply<'_, Reserved> {
        Box::pin(self.reserve_keeping(id, prompt_len, Vec::new(), fence))
    }

    fn prefill(&self, req: GenerateRequest, to: KvDestination) -> Reply<'static, Prefilled> {
        let inner = self.inner.clone();
        Box::pin(async move {
            inner.fence(req.fence, Role::prefills)?;
            inner.prefill(req, 0, to).await
        })
    }

    fn decode(&self, h: DecodeHandoff, events: EventSender) -> Result<(), ServeError> {
        if !lock(&self.inner.imports).remove(&h.id) {
            return Err(crate::no_transfer(h.id));
        }
        self.inner.send_counted(Command::Decode(h, events))
    }

    fn release(&self, id: RequestId) {
        self.inner.release(id);
    }

    fn stats(&self) -> Reply<'_, WorkerStats> {
        Box::pin(async move {
            let (reply, rx) = oneshot::channel();
            self.inner.send(Command::Stats(reply))?;
            let mut s = rx.await.map_err(|_| self.inner.stopped())?;
            s.queued_prompt_tokens += self.inner.prefill_tokens.load(Ordering::Relaxed);
            s.assignment = Some(self.inner.role.get());
            Ok(s)
        })
    }

    fn prefix_peer(&self) -> Option<&dyn PrefixPeer> {
        Some(self)
    }

    fn kv_event_log(&self) -> Option<&dyn KvEventLog> {
        Some(self)
    }

    fn role_switch(&self) -> Option<&dyn RoleSwitch> {
        Some(self)
    }
}

impl SimWorker {
    /// A reservation whose first tokens, `keep`, the engine's own cache holds.
    fn reserve_keeping(
        &self,
        id: RequestId,
        prompt_len: usize,
        keep: Vec<u32>,
        fence: Option<Epoch>,
    ) -> impl std::future::Future<Output = Result<Reserved, ServeError>> + Send + 'static {
        let inner = self.inner.clone();
        async move {
            inner.fence(fence, Role::decodes)?;
            if !lock(&inner.imports).insert(id) {
                return Err(ServeError::Invalid(format!("{id} already has a reservation")));
            }
            // From here every way out but success releases the blocks (a dropped future too).
            let guard = Defer::new({
                let inner = inner.clone();
                move || inner.release(id)
            });
            let (reply, rx) = oneshot::channel();
            // A simulated engine heads no group.
            inner.send(Command::Reserve { id, prompt_len, keep, direct: false, reply })?;
            let (draft_worth, _) = rx.await.map_err(|_| inner.stopped())??;
            if !lock(&inner.imports).contains(&id) {
                return Err(ServeError::Internal(format!("the reservation of {id} was released")));
            }
            guard.disarm();
            Ok(Reserved::whole(HandoffToken::random(), draft_worth))
        }
    }
}

impl PrefixPeer for SimWorker {
    fn reserve_after(
        &self,
        id: RequestId,
        prompt_len: usize,
        keep: Vec<u32>,
        fence: Option<Epoch>,
    ) -> Reply<'_, HandoffToken> {
        let reserved = self.reserve_keeping(id, prompt_len, keep, fence);
        Box::pin(async move { Ok(reserved.await?.token) })
    }

    fn prefill_imported(&self, req: GenerateRequest, imported: usize, to: KvDestination) -> Reply<'static, Prefilled> {
        let (inner, id) = (self.inner.clone(), req.id);
        let release = {
            let inner = inner.clone();
            move || inner.release(id)
        };
        Box::pin(or_release(release, async move {
            inner.fence(req.fence, Role::prefills)?;
            if !lock(&inner.imports).remove(&id) {
                return Err(crate::no_transfer(id));
            }
            inner.prefill(req, imported, to).await
        }))
    }

    /// The engine finds the cached prefix after the layer of its step that is
    /// running (or at once when idle) on the virtual clock; the profile's link then
    /// takes the model's bytes of it.
    fn export_prefix(&self, _id: RequestId, tokens: Vec<u32>, skip: usize, to: KvDestination) -> Reply<'static, usize> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let via = to.target.kind();
            let link = inner.link(via).ok_or_else(|| ServeError::Invalid(format!("no {via} link is modelled")))?;
            let (reply, rx) = oneshot::channel();
            inner.exports.push(worker_loop::Export { tokens, skip, sink: Box::new(|_| true), parts: None, reply });
            inner.send_surely(Command::ServeExports);
            let sent = rx.await.map_err(|_| inner.stopped())??;
            let tail = link.tail(sent as f64 * inner.kv_bytes_per_token, inner.layers, 0.0);
            tokio::time::sleep(Duration::from_secs_f64(tail)).await;
            Ok(sent)
        })
    }

    fn generate_imported(&self, req: GenerateRequest, imported: usize, events: EventSender) -> Result<(), ServeError> {
        // Refused (a role switch overtook the fetch): the reservation goes too.
        self.inner.fence(req.fence, Role::decodes).inspect_err(|_| self.inner.release(req.id))?;
        if !lock(&self.inner.imports).remove(&req.id) {
            return Err(crate::no_transfer(req.id));
        }
        self.inner.send_counted(Command::GenerateImported(req, imported, events))
    }
}

impl KvEventLog for SimWorker {
    fn kv_events(&self, after: KvCursor) -> Reply<'_, KvEvents> {
        let events = crate::events::since(&self.inner.pool, after);
        Box::pin(async move { Ok(events) })
    }
}

impl RoleSwitch for SimWorker {
    fn set_role(&self, to: Assignment) -> Reply<'_, Assignment> {
        let (_, now) = self.inner.role.switch(to);
        Box::pin(async move { Ok(now) })
    }

    fn move_decodes(&self) -> Reply<'_, usize> {
        let (command, rx) = crate::move_out(&self.inner.role, &self.inner.info.name);
        let asked = command.map_or(Ok(()), |c| self.inner.send(c));
        Box::pin(async move {
            asked?;
            rx.await.map_err(|_| self.inner.stopped())
        })
    }
}

impl Inner {
    /// Through the command queue, so it lands after the reservation it undoes.
    fn release(&self, id: RequestId) {
        lock(&self.imports).remove(&id);
        self.send_surely(Command::AbortImport(id));
    }

    fn link(&self, via: TransportKind) -> Option<LinkModel> {
        self.links.iter().find(|(k, _)| *k == via).map(|(_, l)| *l)
    }

    fn fence(&self, fence: Option<Epoch>, take: fn(Role) -> bool) -> Result<(), ServeError> {
        self.role.fence(&self.info.name, fence, take)
    }

    fn stopped(&self) -> ServeError {
        ServeError::WorkerLost(format!("worker {} stopped", self.info.name))
    }

    fn send(&self, c: Command) -> Result<(), ServeError> {
        self.tx.try_send(c).map_err(|e| match e {
            TrySendError::Full(_) => ServeError::Overloaded(format!("worker {} queue is full", self.info.name)),
            TrySendError::Closed(_) => self.stopped(),
        })
    }

    fn send_counted(&self, c: Command) -> Result<(), ServeError> {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.send(c).inspect_err(|_| {
            self.active.fetch_sub(1, Ordering::Relaxed);
        })
    }

    /// Queues a command that must not be lost (a release), waiting for room.
    fn send_surely(&self, c: Command) {
        if let Err(TrySendError::Full(c)) = self.tx.try_send(c) {
            let tx = self.tx.clone();
            tokio::spawn(async move { tx.send(c).await });
        }
    }

    async fn prefill(
        self: Arc<Self>,
        req: GenerateRequest,
        imported: usize,
        to: KvDestination,
    ) -> Result<Prefilled, ServeError> {
        let via = to.target.kind();
        let link = self.link(via).ok_or_else(|| ServeError::Invalid(format!("no {via} link is modelled")))?;
        // Queued are the tokens to compute; all of them move.
        let (tokens, todo) = (req.prompt.len(), req.prompt.len() - imported.min(req.prompt.len()));
        // Counted until computed, or until this future is dropped (its caller gave up).
        let queued = Counted::add(&self.prefill_tokens, todo);
        let (reply, rx) = oneshot::channel();
        let sent_at = tokio::time::Instant::now();
        let (draft_worth, sink) = (to.draft_worth, Box::new(|_| true));
        let sent =
            self.send_counted(Command::Prefill { req, imported, draft_worth, sink, parts: None, reply, sent: sent_at });
        let answer = match sent {
            Ok(()) => rx.await.map_err(|_| self.stopped()).and_then(|r| r),
            Err(e) => Err(e),
        };
        let mut first = answer?;
        // The prefill ends its modelled wait and compute after it was sent (the loop
        // answers at once, also for a prefill queued behind others it took in the
        // same turn), and the receiver holds every byte after the link's tail. Both
        // deadlines count from the exact send time, so the timer's rounding to the
        // millisecond does not add up.
        let computed = sent_at + Duration::from_secs_f64(first.queued_seconds + first.prefill_seconds);
        tokio::time::sleep_until(computed).await;
        drop(queued);
        let bytes = tokens as f64 * self.kv_bytes_per_token;
        // The draft model's K/V goes after the target's last layer, overlapping nothing.
        let draft = first.draft_kv_tokens as f64 * self.draft_kv_bytes_per_token;
        let tail = link.tail(bytes, self.layers, first.prefill_seconds) + draft / link.bytes_per_s.max(1.0);
        tokio::time::sleep_until(computed + Duration::from_secs_f64(tail)).await;
        first.kv_bytes = (bytes + draft) as u64;
        first.transfer_seconds = tail;
        Ok(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::CoRun;

    #[test]
    fn a_full_machine_charges_host_work_per_token() {
        let m = Machine::new(2, CoRun::uniform(1.5), 0.001);
        let a = m.busy(1, 0.0);
        // Alone with a core to spare: the step's own time.
        assert_eq!(a.seconds(1.0, 0.0, 4), 1.0);
        let b = m.busy(1, 0.0);
        // Beside a busy worker, every core busy: slowed, plus the tokens' host work.
        assert!((b.seconds(1.0, 0.0, 4) - 1.504).abs() < 1e-12);
        drop((a, b));
        // One worker whose threads fill the machine pays the host work alone.
        assert!((m.busy(2, 0.0).seconds(1.0, 0.0, 2) - 1.002).abs() < 1e-12);
        // ...less what its threads leave idle, down to none.
        assert!((m.busy(2, 0.0).seconds(1.0, 0.0015, 2) - 1.0005).abs() < 1e-12);
        assert_eq!(m.busy(2, 0.0).seconds(1.0, 0.01, 2), 1.0);
    }

    #[test]
    fn a_step_is_slowed_by_what_its_neighbour_computes() {
        let co = CoRun {
            decode_beside_decode: 1.2,
            decode_beside_prefill: 1.0,
            prefill_beside_decode: 1.1,
            prefill_beside_prefill: 1.4,
        };
        let m = Machine::new(4, co, 0.0);
        let prefill = m.busy(1, 1.0);
        // A decode beside a prompt chunk, then a second prompt chunk beside it.
        assert_eq!(m.busy(1, 0.0).seconds(1.0, 0.0, 1), 1.0);
        assert!((m.busy(1, 1.0).seconds(1.0, 0.0, 1) - 1.4).abs() < 1e-12);
        drop(prefill);
        // Beside a decode and half of it prompt: the pairs by their shares.
        let decode = m.busy(1, 0.0);
        assert!((m.busy(1, 0.5).seconds(1.0, 0.0, 1) - 1.15).abs() < 1e-12);
        // Once the neighbour's step ends, the next runs alone.
        drop(decode);
        assert_eq!(m.busy(1, 1.0).seconds(1.0, 0.0, 1), 1.0);
        // Never faster than alone, whatever was measured.
        assert_eq!(CoRun::uniform(0.9).factor(0.3, 0.7), 1.0);
    }

    /// A worker whose steps cost 1 ms per token over 30 layers, on a fast link.
    fn worker(name: &str) -> SimWorker {
        use pdserve_engine::timed::{Clock, StepCost, StepTime};
        let timed = TimedModel {
            vocab_size: 49152,
            context_length: 8192,
            n_layers: 30,
            kv_values: 1,
            step: StepTime::line(StepCost { token_s: 1e-3, ..StepCost::default() }),
            threads: 1,
            work: None,
            restore: Default::default(),
            clock: Clock::Virtual,
            speculation: None,
            stages: None,
        };
        let fast = LinkModel { latency_s: 0.0, bytes_per_s: 1e15 };
        let opts = SimOptions {
            name: name.into(),
            role: Role::Mixed,
            model_name: "test".into(),
            engine: EngineConfig { num_blocks: 512, ..EngineConfig::default() },
            timed,
            kv_bytes_per_token: 1000.0,
            draft_kv_bytes_per_token: 0.0,
            links: vec![(TransportKind::Inproc, fast)],
            machine: Machine::new(2, CoRun::uniform(1.0), 0.0),
            tiers: TierConfig::default(),
        };
        SimWorker::spawn(opts).unwrap()
    }

    fn request(id: u64, prompt: Vec<u32>) -> GenerateRequest {
        let params = pdserve_types::SamplingParams { max_tokens: 1, ..Default::default() };
        GenerateRequest {
            id: RequestId(id),
            tag: format!("t-{id}").as_str().into(),
            prompt,
            params: params.validate().unwrap(),
            fence: None,
            trace: Default::default(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_fetch_from_a_busy_worker_waits_for_one_layer_of_its_step_not_all_of_it() {
        let (holder, receiver) = (worker("holder"), worker("receiver"));
        // 16 whole blocks cached on the holder.
        let prefix: Vec<u32> = (1000..1257).collect();
        let (tx, mut cached) = pdserve_protocol::TokenStream::channel(4);
        holder.generate(request(1, prefix.clone()), tx).unwrap();
        while let Some(e) = cached.next().await {
            if !matches!(e, pdserve_protocol::Event::Token(_)) {
                break;
            }
        }
        // A 2,000-token prompt: steps of 512 tokens, 0.512 s each, 17 ms a layer.
        let (tx, _busy) = pdserve_protocol::TokenStream::channel(4);
        holder.generate(request(2, (2000..4000).collect()), tx).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let asked = tokio::time::Instant::now();
        let token = receiver.reserve(RequestId(3), 256, None).await.unwrap().token;
        let to = KvDestination::plain(receiver.kv_target(TransportKind::Inproc).unwrap(), token);
        let sent = holder.export_prefix(RequestId(3), prefix[..256].to_vec(), 0, to).await.unwrap();
        assert_eq!(sent, 256);
        let waited = asked.elapsed().as_secs_f64();
        // One layer (and the timer's millisecond), not the step's remaining 0.41 s.
        assert!(waited <= 0.512 / 30.0 + 0.002, "the fetch waited {waited} s");
        receiver.release(RequestId(3));
    }

    /// When the first token of `stream` came, in seconds from `start`.
    async fn first_token_at(mut stream: pdserve_protocol::TokenStream, start: tokio::time::Instant) -> f64 {
        let e = stream.next().await.expect("the stream ended without a token");
        assert!(matches!(e, pdserve_protocol::Event::Token(_)), "{e:?}");
        start.elapsed().as_secs_f64()
    }

    #[tokio::test(start_paused = true)]
    async fn an_exported_prefill_takes_its_turn_among_the_workers_own_prompts() {
        let (worker, decode) = (worker("mixed"), worker("decode"));
        let start = tokio::time::Instant::now();
        // A local prompt of 1,024 tokens (two steps of 512, 0.512 s each), then an
        // export of 256 for a peer, then a local prompt of 256, all sent at once: the
        // export comes while the first prompt is half done.
        let (tx, first) = pdserve_protocol::TokenStream::channel(4);
        worker.generate(request(1, (1000..2024).collect()), tx).unwrap();
        let reserved = decode.reserve(RequestId(2), 256, None).await.unwrap();
        let to = KvDestination::reserved(decode.kv_target(TransportKind::Inproc).unwrap(), reserved);
        let export = tokio::spawn(worker.prefill(request(2, (3000..3256).collect()), to));
        // The export's command goes out when its task first runs.
        tokio::task::yield_now().await;
        let (tx, third) = pdserve_protocol::TokenStream::channel(4);
        worker.generate(request(3, (4000..4256).collect()), tx).unwrap();
        let (first, exported, third) = tokio::join!(first_token_at(first, start), export, first_token_at(third, start));
        let exported = exported.unwrap().unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 0.003;
        // Each waits for the ones sent before it, and only for those.
        assert!(close(first, 1.024), "the first local prompt's token came at {first} s");
        assert!(close(exported.queued_seconds, 1.024), "the export queued {} s", exported.queued_seconds);
        assert!(close(exported.queued_seconds + exported.prefill_seconds, 1.28));
        assert!(close(third, 1.536), "the later local prompt's token came at {third} s");
        decode.release(RequestId(2));
    }

    #[tokio::test(start_paused = true)]
    async fn prefills_sent_at_once_end_one_compute_apart() {
        let (prefill, decode) = (worker("prefill"), worker("decode"));
        let start = tokio::time::Instant::now();
        // 256 tokens at 1 ms each: 0.256 s of compute per prompt.
        let one = |id: u64| {
            let (p, d) = (prefill.clone(), decode.clone());
            async move {
                let reserved = d.reserve(RequestId(id), 256, None).await.unwrap();
                let to = KvDestination::reserved(d.kv_target(TransportKind::Inproc).unwrap(), reserved);
                let prompt = (0..256).map(|i| 1000 * id as u32 + i).collect();
                let first = p.prefill(request(id, prompt), to).await.unwrap();
                (first.queued_seconds, start.elapsed().as_secs_f64())
            }
        };
        let ((queued_a, a), (queued_b, b)) = tokio::join!(one(1), one(2));
        let (first, second) = (a.min(b), a.max(b));
        // The worker computes one prompt after the other, even when it takes both
        // commands in one turn of its loop: the second waits for the first.
        assert!((first - 0.256).abs() < 0.003, "first prefill ended at {first} s");
        assert!((second - 0.512).abs() < 0.003, "second prefill ended at {second} s");
        assert!((queued_a.max(queued_b) - 0.256).abs() < 0.003);
        decode.release(RequestId(1));
        decode.release(RequestId(2));
    }

    #[test]
    fn a_fast_link_hides_all_but_the_last_layer() {
        let l = LinkModel { latency_s: 0.001, bytes_per_s: 1e9 };
        // 1 GB over 10 layers in 10 s of compute: 0.1 s for the last layer.
        assert!((l.tail(1e9, 10, 10.0) - 0.101).abs() < 1e-9);
        // A slow link: 1 GB at 1e8 B/s takes 10 s; 9 s of it overlapped.
        let slow = LinkModel { latency_s: 0.0, bytes_per_s: 1e8 };
        assert!((slow.tail(1e9, 10, 10.0) - 1.0).abs() < 1e-9);
    }
}
