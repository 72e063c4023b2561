//! A fake worker behind the real [`Worker`] surface: no model, deterministic tokens,
//! KV blocks counted like an engine's, and real KV transfer (small frames through
//! the real transports, presenting the real tokens). Router, handoff and control
//! protocol tests run on it in milliseconds, and faults are switches.
//!
//! Each token depends only on the tokens before it, as a greedy model's would, so a
//! request gives the same tokens aggregated, disaggregated, moved between fakes, or
//! resumed from its prompt plus the tokens it had already generated.

use pdserve_kv::{BlockHash, Tier};
use pdserve_kv_transfer::{Frame, HandoffId, Inbox, Inboxes, KvTarget, Links, TransportKind};
use pdserve_protocol::{
    unsupported, DecodeHandoff, Event, EventSender, FinishReason, GenerateRequest, KvCursor, KvDestination, KvEventLog,
    KvEvents, Prefilled, Reply, Reserved, RoleState, RoleSwitch, ServeError, TokenOut, Usage, Worker, WorkerInfo,
    WorkerStats,
};
use pdserve_types::{lock, Assignment, DraftRecord, Epoch, PoolStats, RequestId, Role};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;

/// Tokens per block, as the engines page.
const BLOCK: usize = 16;
/// Frames a fake prefill sends per prompt block (one per "layer").
const LAYERS: u32 = 2;

/// How a fake behaves; every field may be changed while it runs.
#[derive(Debug)]
pub struct Knobs {
    /// Time every prefill takes whatever its length.
    pub prefill_fixed: Duration,
    /// Time per prompt token of a prefill.
    pub prefill_per_token: Duration,
    /// Time between generated tokens.
    pub token_interval: Duration,
    /// Prefills fail (after their delay).
    pub fail_prefill: AtomicBool,
    /// The next this many transfers into this worker are lost (as a frame it cannot
    /// take loses one): their decodes fail with [`ServeError::KvLost`].
    pub lose_transfers: AtomicUsize,
    /// Requests it generates speculate: after each token its stream says their
    /// record of drafts, the one they brought and two drafts tried a token, one of
    /// them accepted.
    pub drafts: bool,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            prefill_fixed: Duration::ZERO,
            prefill_per_token: Duration::from_micros(20),
            token_interval: Duration::from_millis(1),
            fail_prefill: AtomicBool::new(false),
            lose_transfers: AtomicUsize::new(0),
            drafts: false,
        }
    }
}

/// The token at `position` (0 = the first generated) of a request for `prompt`.
pub fn token_at(prompt: &[u32], position: usize) -> u32 {
    tokens_after(prompt).nth(position).unwrap_or_default()
}

/// The tokens a fake generates after `prompt`, each a function of all before it.
pub fn tokens_after(prompt: &[u32]) -> impl Iterator<Item = u32> {
    let mut state = prompt.iter().fold(0x5eed_u64, |h, &t| absorb(h, t));
    std::iter::repeat_with(move || {
        let t = (state.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as u32 % 40_000 + 1000;
        state = absorb(state, t);
        t
    })
}

fn absorb(h: u64, t: u32) -> u64 {
    h.rotate_left(5) ^ u64::from(t)
}

/// Made-up scores of a prompt's tokens from the second on.
pub fn scores(prompt: &[u32]) -> Vec<TokenOut> {
    prompt.iter().skip(1).map(|&token| TokenOut { token, logprob: -1.0, top: Vec::new() }).collect()
}

/// A stand-in embedding of `prompt`: four values that follow from its tokens.
pub fn embedding(prompt: &[u32]) -> Vec<f32> {
    let sum: f32 = prompt.iter().map(|&t| t as f32).sum();
    vec![prompt.len() as f32, sum, 1.0, -1.0]
}

/// A model-free worker.
#[derive(Clone)]
pub struct FakeWorker {
    inner: Arc<Inner>,
}

struct Inner {
    info: WorkerInfo,
    role: RoleState,
    knobs: Mutex<Knobs>,
    total_blocks: usize,
    /// Blocks held by running requests and reservations.
    used: AtomicUsize,
    active: AtomicUsize,
    /// Requests streaming tokens: what a real worker's stats count as running (its
    /// prefills run whole between two stats answers, so they never show there).
    streaming: AtomicUsize,
    /// Requests this worker generated tokens for (whole, or after a transfer).
    served: AtomicUsize,
    alive: AtomicBool,
    /// Still connected, but its streams fail and its calls are refused as lost.
    lost_a_stage: AtomicBool,
    inboxes: Inboxes,
    links: Links,
    imports: Mutex<HashMap<RequestId, Import>>,
    /// The block hashes its "prefix cache" reports, and how often they were set.
    cached: Mutex<(Vec<BlockHash>, u64)>,
    /// The record of drafts each request it generated for brought, in order.
    brought: Mutex<Vec<Option<DraftRecord>>>,
}

struct Import {
    blocks: usize,
    receiving: Option<JoinHandle<bool>>,
}

impl FakeWorker {
    pub fn new(name: &str, role: Role, total_blocks: usize) -> FakeWorker {
        let info = WorkerInfo::new(name, "fake", role);
        FakeWorker {
            inner: Arc::new(Inner {
                role: RoleState::new(role),
                info,
                knobs: Mutex::default(),
                total_blocks,
                used: AtomicUsize::new(0),
                active: AtomicUsize::new(0),
                streaming: AtomicUsize::new(0),
                served: AtomicUsize::new(0),
                alive: AtomicBool::new(true),
                lost_a_stage: AtomicBool::new(false),
                inboxes: Inboxes::new(64),
                links: Links::default(),
                imports: Mutex::default(),
                cached: Mutex::default(),
                brought: Mutex::default(),
            }),
        }
    }

    /// Changes the fake's behaviour.
    pub fn knobs(&self, f: impl FnOnce(&mut Knobs)) {
        f(&mut lock(&self.inner.knobs));
    }

    /// Blocks held now (requests and reservations).
    pub fn used_blocks(&self) -> usize {
        self.inner.used.load(Ordering::SeqCst)
    }

    /// The record of drafts each request it was asked to generate for brought.
    pub fn drafts_brought(&self) -> Vec<Option<DraftRecord>> {
        lock(&self.inner.brought).clone()
    }

    /// Requests it generated tokens for so far.
    pub fn served(&self) -> usize {
        self.inner.served.load(Ordering::SeqCst)
    }

    /// From now on its KV events report exactly `hashes` cached (in the pool). The
    /// fake's generation does not read them: they steer a router's index only.
    pub fn holds(&self, hashes: Vec<BlockHash>) {
        let mut c = lock(&self.inner.cached);
        *c = (hashes, c.1 + 1);
    }

    /// The worker stops answering: it is no longer alive, and its streams fail.
    pub fn kill(&self) {
        self.inner.alive.store(false, Ordering::SeqCst);
    }

    /// The worker stays connected but answers as lost, as a stage group's head that
    /// lost a stage does: its streams fail and every call is refused.
    pub fn lose_a_stage(&self) {
        self.inner.lost_a_stage.store(true, Ordering::SeqCst);
    }
}

impl Inner {
    fn take_blocks(&self, tokens: usize) -> Result<usize, ServeError> {
        let n = tokens.div_ceil(BLOCK);
        let mut used = self.used.load(Ordering::SeqCst);
        loop {
            if used + n > self.total_blocks {
                return Err(ServeError::Overloaded(format!("{} has no room for {n} blocks", self.info.name)));
            }
            match self.used.compare_exchange(used, used + n, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Ok(n),
                Err(now) => used = now,
            }
        }
    }

    fn give_blocks(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::SeqCst);
    }

    fn check_alive(&self) -> Result<(), ServeError> {
        if self.lost_a_stage.load(Ordering::SeqCst) {
            return Err(ServeError::WorkerLost(format!("{} lost a stage", self.info.name)));
        }
        match self.alive.load(Ordering::SeqCst) {
            true => Ok(()),
            false => Err(ServeError::WorkerLost(format!("{} is dead", self.info.name))),
        }
    }

    fn interval(&self) -> Duration {
        lock(&self.knobs).token_interval
    }

    /// Streams tokens `from..max_tokens` of `prompt` to `events`, holding `blocks`
    /// until the end, the client's departure or the worker's death; with `drafts`,
    /// the record of drafts (grown from it) after each token.
    #[allow(clippy::too_many_arguments)]
    fn stream(
        self: Arc<Self>,
        prompt: Vec<u32>,
        from: usize,
        max: usize,
        blocks: usize,
        events: EventSender,
        cached: usize,
        drafts: Option<DraftRecord>,
    ) {
        self.active.fetch_add(1, Ordering::SeqCst);
        self.streaming.fetch_add(1, Ordering::SeqCst);
        self.served.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let mut tokens = tokens_after(&prompt).skip(from);
            for i in from..max {
                tokio::select! {
                    _ = tokio::time::sleep(self.interval()) => {}
                    _ = events.closed() => break,
                }
                if self.check_alive().is_err() {
                    let _ = events.send(Event::Failed(ServeError::WorkerLost(format!("{} died", self.info.name))));
                    break;
                }
                let t = TokenOut { token: tokens.next().unwrap_or_default(), logprob: -0.5, top: Vec::new() };
                if events.send(Event::Token(t)).is_err() {
                    break;
                }
                if let Some(base) = drafts {
                    let n = (i + 1 - from) as u64;
                    let _ = events
                        .send(Event::Drafts(DraftRecord { tried: base.tried + 2 * n, accepted: base.accepted + n }));
                }
                if i + 1 == max {
                    let usage = Usage { prompt_tokens: prompt.len(), completion_tokens: max, cached_tokens: cached };
                    let _ = events.send(Event::Done { reason: FinishReason::Length, usage });
                }
            }
            self.give_blocks(blocks);
            self.streaming.fetch_sub(1, Ordering::SeqCst);
            self.active.fetch_sub(1, Ordering::SeqCst);
        });
    }

    async fn prefill(self: Arc<Self>, req: GenerateRequest, to: KvDestination) -> Result<Prefilled, ServeError> {
        self.check_alive()?;
        self.role.fence(&self.info.name, req.fence, Role::prefills)?;
        self.active.fetch_add(1, Ordering::SeqCst);
        let _done = Decrement(&self.active);
        let (delay, fail) = {
            let k = lock(&self.knobs);
            let delay = k.prefill_fixed + k.prefill_per_token * req.prompt.len() as u32;
            (delay, k.fail_prefill.load(Ordering::SeqCst))
        };
        tokio::time::sleep(delay).await;
        self.check_alive()?;
        if fail {
            return Err(ServeError::Internal(format!("{} was told to fail prefills", self.info.name)));
        }
        let hid = HandoffId::from(req.id);
        let me = self.clone();
        let blocks = req.prompt.len().div_ceil(BLOCK) as u32;
        let sent = tokio::task::spawn_blocking(move || {
            let mut sink = me.links.open(&to.target, hid, to.token)?;
            for layer in 0..LAYERS {
                for index in 0..blocks {
                    sink.send(Frame {
                        handoff: hid,
                        layer,
                        index,
                        dtype: pdserve_types::KvDtype::F16,
                        k: vec![index as u16; 8],
                        v: vec![layer as u16; 8],
                    })?;
                }
            }
            sink.finish()
        })
        .await
        .map_err(|e| ServeError::Internal(e.to_string()))?;
        sent.map_err(|e| ServeError::Internal(format!("KV transfer: {e}")))?;
        Ok(Prefilled {
            token: TokenOut { token: token_at(&req.prompt, 0), logprob: -0.5, top: Vec::new() },
            finished: (req.params.max_tokens == 1).then_some(FinishReason::Length),
            prompt_tokens: req.prompt.len(),
            cached_tokens: 0,
            queued_seconds: 0.0,
            prefill_seconds: delay.as_secs_f64(),
            transfer_seconds: 0.0,
            kv_bytes: u64::from(blocks * LAYERS) * 32,
            draft_kv_tokens: 0,
            prompt_logprobs: req.params.prompt_logprobs.map(|_| scores(&req.prompt)),
            embedding: req.params.embed.map(|_| embedding(&req.prompt)),
        })
    }

    fn release(&self, id: RequestId) {
        if let Some(import) = lock(&self.imports).remove(&id) {
            if let Some(task) = import.receiving {
                task.abort();
                self.inboxes.forget(HandoffId::from(id));
            }
            self.give_blocks(import.blocks);
        }
    }
}

/// Counts frames until the sender finishes; true if every frame arrived.
async fn receive(mut inbox: Inbox) -> bool {
    loop {
        match inbox.recv().await {
            Ok(Some(_)) => {}
            Ok(None) => return true,
            Err(_) => return false,
        }
    }
}

struct Decrement<'a>(&'a AtomicUsize);

impl Drop for Decrement<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Worker for FakeWorker {
    fn info(&self) -> &WorkerInfo {
        &self.inner.info
    }

    fn load(&self) -> usize {
        self.inner.active.load(Ordering::SeqCst)
    }

    fn is_alive(&self) -> bool {
        self.inner.alive.load(Ordering::SeqCst)
    }

    fn generate(&self, req: GenerateRequest, events: EventSender) -> Result<(), ServeError> {
        self.inner.check_alive()?;
        self.inner.role.fence(&self.inner.info.name, req.fence, Role::decodes)?;
        let max = req.params.max_tokens as usize;
        let blocks = self.inner.take_blocks(req.prompt.len() + max)?;
        if req.params.prompt_logprobs.is_some() {
            let _ = events.send(Event::Prompt(scores(&req.prompt)));
        }
        if req.params.embed.is_some() {
            let _ = events.send(Event::Embedding(embedding(&req.prompt)));
        }
        lock(&self.inner.brought).push(req.params.drafts_so_far);
        let drafts = lock(&self.inner.knobs).drafts.then(|| req.params.drafts_so_far.unwrap_or_default());
        self.inner.clone().stream(req.prompt, 0, max, blocks, events, 0, drafts);
        Ok(())
    }

    fn kv_target(&self, via: TransportKind) -> Option<KvTarget> {
        (via == TransportKind::Inproc).then(|| pdserve_kv_transfer::in_proc(self.inner.inboxes.clone()))
    }

    fn reserve(&self, id: RequestId, prompt_len: usize, fence: Option<Epoch>) -> Reply<'_, Reserved> {
        Box::pin(async move {
            self.inner.check_alive()?;
            self.inner.role.fence(&self.inner.info.name, fence, Role::decodes)?;
            let blocks = self.inner.take_blocks(prompt_len)?;
            let inbox = match self.inner.inboxes.expect(HandoffId::from(id)) {
                Ok(i) => i,
                Err(e) => {
                    self.inner.give_blocks(blocks);
                    return Err(ServeError::Internal(e.to_string()));
                }
            };
            let token = inbox.token();
            let receiving = Some(tokio::spawn(receive(inbox)));
            lock(&self.inner.imports).insert(id, Import { blocks, receiving });
            // It drafts nothing.
            Ok(Reserved::whole(token, Some(0.0)))
        })
    }

    fn prefill(&self, req: GenerateRequest, to: KvDestination) -> Reply<'static, Prefilled> {
        Box::pin(self.inner.clone().prefill(req, to))
    }

    fn decode(&self, h: DecodeHandoff, events: EventSender) -> Result<(), ServeError> {
        self.inner.check_alive()?;
        let Some(import) = lock(&self.inner.imports).remove(&h.id) else {
            return Err(ServeError::KvLost(format!("no transfer for {}", h.id)));
        };
        let lost = lock(&self.inner.knobs)
            .lose_transfers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let max = h.params.max_tokens as usize;
        let more = match self.inner.take_blocks(max) {
            Ok(n) => n,
            Err(e) => {
                self.inner.give_blocks(import.blocks);
                return Err(e);
            }
        };
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let arrived = match import.receiving {
                Some(task) => task.await.unwrap_or(false) && !lost,
                None => false,
            };
            if !arrived {
                inner.give_blocks(import.blocks + more);
                let _ = events.send(Event::Failed(ServeError::KvLost("the transfer did not complete".into())));
                return;
            }
            inner.stream(h.prompt, 1, max, import.blocks + more, events, h.cached_tokens, None);
        });
        Ok(())
    }

    fn release(&self, id: RequestId) {
        self.inner.release(id);
    }

    fn stats(&self) -> Reply<'_, WorkerStats> {
        Box::pin(async move {
            self.inner.check_alive()?;
            let used = self.used_blocks();
            let total = self.inner.total_blocks;
            let blocks = PoolStats { total, free: total - used, used, ..Default::default() };
            Ok(WorkerStats {
                waiting: 0,
                running: self.inner.streaming.load(Ordering::SeqCst),
                importing: lock(&self.inner.imports).len(),
                paused: 0,
                queued_prompt_tokens: 0,
                blocks,
                assignment: Some(self.inner.role.get()),
                ..Default::default()
            })
        })
    }

    fn kv_event_log(&self) -> Option<&dyn KvEventLog> {
        Some(self)
    }

    fn role_switch(&self) -> Option<&dyn RoleSwitch> {
        Some(self)
    }
}

impl KvEventLog for FakeWorker {
    fn kv_events(&self, after: KvCursor) -> Reply<'_, KvEvents> {
        Box::pin(async move {
            self.inner.check_alive()?;
            let (hashes, version) = lock(&self.inner.cached).clone();
            let cursor = KvCursor { instance: 1, seq: version };
            // Every change is a fresh snapshot: the fake keeps no event log.
            let snapshot = (after != cursor).then(|| hashes.into_iter().map(|h| (h, Tier::Device)).collect());
            Ok(KvEvents { snapshot, events: Vec::new(), cursor })
        })
    }
}

impl RoleSwitch for FakeWorker {
    fn set_role(&self, to: Assignment) -> Reply<'_, Assignment> {
        let now = self.inner.role.switch(to).1;
        Box::pin(async move { Ok(now) })
    }

    /// The fake's streams cannot be handed back: they finish where they run.
    fn move_decodes(&self) -> Reply<'_, usize> {
        Box::pin(async move { Err(unsupported(self, "cannot hand back its decodes")) })
    }
}
