//! The loop that owns an engine: commands in, one step, tokens out, repeat.

use crate::{Command, FrameSink};
use pdserve_engine::batch::{Engine, EngineError, KvFrame, KvParts, StepOutput};
use pdserve_protocol::{
    pace, DecodeHandoff, Event, EventSender, GenerateRequest, Prefilled, ServeError, Usage, WorkerStats,
};
use pdserve_types::{DraftRecord, RequestId, StageReceiver};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// The resolution of tokio's timers.
const TIMER_TICK: Duration = Duration::from_millis(1);
/// How long an idle loop sleeps before checking imports again.
const IDLE_POLL: Duration = Duration::from_millis(20);
/// A reservation whose transfer never completes is released after this long; the
/// router's own deadline normally aborts it much sooner.
const IMPORT_TTL: Duration = Duration::from_secs(120);
/// A sequence paused longer than this is cancelled: the router cuts a stalled client
/// off much sooner; this only bounds a caller that never resumes.
const PAUSED_TTL: Duration = Duration::from_secs(300);

/// A request this worker is producing tokens for.
struct Live {
    events: EventSender,
    /// Tokens generated so far, including one sampled by a prefill worker.
    generated: usize,
    /// Prompt tokens a prefill worker found cached, for a transferred sequence (this
    /// engine computed none of the prompt).
    cached_elsewhere: usize,
    /// Since when the sequence has been paused for its consumer to catch up.
    paused: Option<Instant>,
    /// The record of drafts last sent on the stream.
    drafts: Option<DraftRecord>,
}

/// A speculating sequence's record of drafts goes on its stream after every this many
/// tokens, where it changed: a lost worker's requests bring one this recent at worst
/// to their next worker, for an event every so many tokens.
const DRAFTS_EVERY: usize = 8;

/// A peer's fetch of a cached prefix, waiting for the engine.
pub(crate) struct Export {
    pub tokens: Vec<u32>,
    /// Leading tokens (whole blocks) the receiver holds: not sent.
    pub skip: usize,
    pub sink: FrameSink,
    /// Where a group's later stages send their layers themselves (between steps).
    pub parts: Option<KvParts>,
    pub reply: oneshot::Sender<Result<usize, ServeError>>,
}

impl Export {
    /// Serves it with `export`: the engine's between steps, or its pool's mid-step.
    fn serve(
        mut self,
        export: impl FnOnce(&[u32], usize, &mut dyn FnMut(KvFrame) -> bool) -> Result<usize, EngineError>,
    ) {
        let res = export(&self.tokens, self.skip, &mut |f| (self.sink)(f));
        let _ = self.reply.send(res.map_err(serve_error));
    }
}

/// Fetches waiting for the engine. The loop on the wall clock serves them between
/// two layers of a running step, so a fetch from a busy worker waits for one layer,
/// not a whole step (the virtual clock's loop after the modelled layer); between
/// steps it serves the rest, then copying back what lower tiers hold too.
/// [`Command::ServeExports`] wakes an idle loop.
#[derive(Clone, Default)]
pub(crate) struct Exports(Arc<Mutex<VecDeque<Export>>>, Arc<tokio::sync::Notify>);

impl Exports {
    pub fn push(&self, e: Export) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push_back(e);
        self.1.notify_one();
    }

    /// Returns once a fetch was pushed (at once if one came since the last call).
    async fn arrived(&self) {
        self.1.notified().await;
    }

    fn pop(&self) -> Option<Export> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).pop_front()
    }
}

pub(crate) struct Loop {
    engine: Engine,
    exports: Exports,
    streams: HashMap<RequestId, Live>,
    imports: HashMap<RequestId, Instant>,
    active: Arc<AtomicUsize>,
    /// Modelled seconds a timed engine computed outside `step` (a prefill's export),
    /// which a virtual clock still has to pass (0 between commands on the wall clock).
    owed: f64,
    /// Prompts in arrival order behind an exported prefill that waits for this
    /// engine's earlier prompts (see [`Loop::serve_in_order`]).
    behind: VecDeque<Command>,
    /// Why this stage group's head cannot serve now: a later stage is not reachable.
    incomplete: Option<String>,
}

pub(crate) fn run(engine: Engine, rx: Receiver<Command>, active: Arc<AtomicUsize>, exports: Exports) {
    let mut l = Loop::new(engine, active, exports);
    loop {
        // A stalled engine waits for an event like an idle one: stepping again at once
        // would only spin a core.
        let first = if l.runnable() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => return,
            }
        } else {
            match rx.recv_timeout(IDLE_POLL) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        };
        l.check_group();
        let mut next = first;
        while let Some(c) = next {
            l.serve_in_order(c);
            next = rx.try_recv().ok();
        }
        l.serve_behind();
        // On the wall clock a command's modelled time has passed once handled.
        l.owed = 0.0;
        l.reap();
        l.pace();
        if l.engine.has_work() {
            // A group's head reads its later stages' K/V between steps only.
            let exports = (!l.engine.heads_group()).then(|| l.exports.clone());
            let outs = l.engine.step_serving(&mut |pool| {
                while let Some(x) = exports.as_ref().and_then(Exports::pop) {
                    x.serve(|tokens, skip, on_frame| pool.export(tokens, skip, on_frame));
                }
            });
            for out in outs {
                l.route(out);
            }
            l.check_group();
            if l.engine.heads_group() {
                l.serve_exports();
            }
        }
    }
}

/// [`run`] on a virtual clock (the twin): the loop is a task of a paused tokio runtime
/// and sleeps the time each step of its timed engine is modelled to take, so the
/// runtime's clock jumps from one event to the next.
pub(crate) async fn run_virtual(
    engine: Engine,
    mut rx: tokio::sync::mpsc::Receiver<Command>,
    active: Arc<AtomicUsize>,
    (machine, threads, layers): (Arc<crate::machine::Machine>, usize, usize),
    exports: Exports,
) {
    let mut l = Loop::new(engine, active, exports);
    // Where the last step ended exactly: tokio's timers fire on whole milliseconds, so
    // back-to-back steps are scheduled from here, not from when the timer fired.
    let mut ended: Option<Instant> = None;
    loop {
        let first = match (l.runnable(), l.engine.has_work()) {
            (true, _) => rx.try_recv().ok(),
            // A stalled step left the clock where it was: without this wait the task
            // would never yield, and time (and the imports it waits on) stand still.
            (false, true) => match tokio::time::timeout(IDLE_POLL, rx.recv()).await {
                Ok(Some(c)) => Some(c),
                Ok(None) => return,
                Err(_) => None,
            },
            (false, false) => match rx.recv().await {
                Some(c) => Some(c),
                None => return,
            },
        };
        let mut next = first;
        while let Some(c) = next {
            l.serve_in_order(c);
            next = rx.try_recv().ok();
        }
        l.serve_behind();
        l.reap();
        let mut outs = Vec::new();
        if l.engine.has_work() {
            outs = l.engine.step();
        }
        let spent = std::mem::take(&mut l.owed) + l.engine.take_charged();
        let idle = l.engine.take_idle();
        let prefill = l.engine.take_charged_prefill();
        if spent > 0.0 {
            let busy = machine.busy(threads, prefill / spent);
            let now = Instant::now();
            let start = ended.filter(|e| now.duration_since(*e) < TIMER_TICK).unwrap_or(now);
            let took = busy.seconds(spent, idle, outs.len());
            let end = start + Duration::from_secs_f64(took);
            l.sleep_serving(end, Duration::from_secs_f64(took / layers.max(1) as f64)).await;
            ended = Some(end);
        }
        for out in outs {
            l.route(out);
        }
    }
}

impl Loop {
    /// Waits for a modelled step to end at `end`, serving the fetches that come
    /// meanwhile from the pool after the layer (`layer` long) running when each came,
    /// as the wall-clock loop does. The step's own blocks are already cached here:
    /// a fetch of them mid-step is served at most a step early.
    async fn sleep_serving(&mut self, end: Instant, layer: Duration) {
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(end) => return,
                () = self.exports.arrived() => {
                    tokio::time::sleep_until((Instant::now() + layer).min(end)).await;
                    let pool = self.engine.cached_kv();
                    while let Some(x) = self.exports.pop() {
                        x.serve(|tokens, skip, on_frame| pool.export(tokens, skip, on_frame));
                    }
                }
            }
        }
    }

    pub(crate) fn new(engine: Engine, active: Arc<AtomicUsize>, exports: Exports) -> Loop {
        Loop {
            engine,
            exports,
            streams: HashMap::new(),
            imports: HashMap::new(),
            active,
            owed: 0.0,
            behind: VecDeque::new(),
            incomplete: None,
        }
    }

    /// A stage group's head: ends every request when a later stage is lost (the
    /// router moves them), and serves again once every stage answers.
    fn check_group(&mut self) {
        if let Some(lost) = self.engine.take_stage_lost() {
            tracing::warn!(error = %lost, requests = self.streams.len(), "stage group lost a stage; ending its requests");
            let ids: Vec<RequestId> = self.streams.keys().copied().collect();
            for id in ids {
                self.engine.cancel(id);
                if let Some(live) = self.streams.get(&id) {
                    let _ = live.events.send(Event::Failed(ServeError::WorkerLost(lost.to_string())));
                }
                self.untrack(id);
            }
            self.incomplete = Some(lost.to_string());
        }
        let ready = self.engine.stages_ready();
        match (&self.incomplete, ready) {
            (Some(_), true) => {
                tracing::info!("stage group whole: serving");
                self.incomplete = None;
            }
            (None, false) => self.incomplete = Some("a later stage is not reachable".into()),
            _ => {}
        }
    }

    /// Prompts are computed in the order they came, whether this engine's own or
    /// exported for a peer. An export runs alone, so one arriving while earlier
    /// prompts here still wait or prefill queues until they are done, and prompts
    /// arriving after it queue behind it: otherwise each export would cut in front
    /// of every local prompt, whose first token the router predicted from the queue
    /// it found. A stalled engine serves its queue at once: its prompts wait on
    /// blocks, which an export would not free by waiting.
    fn serve_in_order(&mut self, c: Command) {
        let waits = match c {
            Command::Prefill { .. } => !self.behind.is_empty() || self.prompts_ahead(),
            Command::Generate(..) | Command::GenerateImported(..) => !self.behind.is_empty(),
            _ => false,
        };
        match waits {
            true => self.behind.push_back(c),
            false => self.handle(c),
        }
    }

    /// Serves the queued prompts whose turn has come.
    fn serve_behind(&mut self) {
        while let Some(c) = self.behind.front() {
            if matches!(c, Command::Prefill { .. }) && self.prompts_ahead() {
                return;
            }
            if let Some(c) = self.behind.pop_front() {
                self.handle(c);
            }
        }
    }

    /// Requests of this engine's own queued in [`Loop::behind`], and their prompt tokens.
    fn queued_behind(&self) -> (usize, usize) {
        let prompts = self.behind.iter().filter_map(|c| match c {
            Command::Generate(req, _) => Some(req.prompt.len()),
            Command::GenerateImported(req, imported, _) => Some(req.prompt.len().saturating_sub(*imported)),
            _ => None,
        });
        prompts.fold((0, 0), |(n, t), p| (n + 1, t + p))
    }

    /// The refusal of new work while this stage group's head lacks a stage.
    fn not_whole(&self) -> Option<ServeError> {
        let why = self.incomplete.as_ref()?;
        Some(ServeError::WorkerLost(format!("stage group not whole: {why}")))
    }

    /// Whether the loop has something to do without a new command: a step to
    /// take, or a queued prompt whose turn came as the last step ended.
    fn runnable(&self) -> bool {
        (self.engine.has_work() && !self.engine.stalled()) || !self.behind.is_empty()
    }

    fn prompts_ahead(&self) -> bool {
        self.engine.prompts_pending() && !self.engine.stalled()
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Generate(req, events) => match self.not_whole() {
                Some(e) => {
                    self.done();
                    let _ = events.send(Event::Failed(e));
                }
                None => {
                    let added = self.engine.add(req.id, req.prompt, req.params);
                    self.start(req.id, added, events);
                }
            },
            Command::Prefill { req, imported, draft_worth, sink, parts, reply, sent } => {
                let first = self.prefill(req, (imported, draft_worth), (sink, parts), sent);
                self.done();
                let _ = reply.send(first);
            }
            Command::Reserve { id, prompt_len, keep, direct, reply } => {
                let res = match self.not_whole() {
                    Some(e) => Err(e),
                    None => self.engine.reserve_import_after(id, prompt_len, &keep).map_err(serve_error),
                };
                let res = res.and_then(|()| self.stage_receivers(id, direct));
                let res = res.map(|stages| (self.engine.draft_kv_worth(id), stages));
                if res.is_ok() {
                    self.imports.insert(id, Instant::now());
                }
                let _ = reply.send(res);
            }
            Command::Frame { id, frame, recycle } => {
                if self.engine.import_frame(id, &frame).is_err() {
                    // A bad frame poisons the transfer; the router sees the failure
                    // when finishing and falls back.
                    self.engine.abort_import(id);
                    self.imports.remove(&id);
                }
                // The buffers go back to the receiver's pool: the next frames decode
                // into memory already mapped instead of freshly allocated.
                recycle.recycle(frame.k, frame.v);
            }
            Command::Decode(h, events) => self.decode(h, events),
            Command::ServeExports => self.serve_exports(),
            Command::GenerateImported(req, imported, events) => {
                self.imports.remove(&req.id);
                let added = self.engine.add_imported(req.id, req.prompt, req.params, imported);
                self.start(req.id, added, events);
            }
            Command::AbortImport(id) => {
                self.engine.abort_import(id);
                self.imports.remove(&id);
            }
            Command::MoveOut { worker, reply } => {
                let _ = reply.send(self.move_out(&worker));
            }
            Command::Stats(reply) => {
                let _ = reply.send(self.stats());
            }
        }
    }

    /// The later stages that take their own layers of reservation `id` (none unless
    /// `direct`); the reservation is given up if they cannot be asked.
    fn stage_receivers(&mut self, id: RequestId, direct: bool) -> Result<Vec<StageReceiver>, ServeError> {
        if !direct {
            return Ok(Vec::new());
        }
        self.engine.expect_stage_kv(id).map_err(|e| {
            self.engine.abort_import(id);
            serve_error(e)
        })
    }

    /// Serves the peers' fetches waiting, between steps.
    fn serve_exports(&mut self) {
        while let Some(mut x) = self.exports.pop() {
            let parts = x.parts.take();
            x.serve(|tokens, skip, on_frame| {
                self.engine.with_kv_parts(parts, |e| e.export_cached(tokens, skip, on_frame))
            });
            // Blocks a timed engine copied back from a lower tier take its time.
            self.owed += self.engine.take_charged();
        }
    }

    /// Tracks request `id`'s stream once the engine took it, or fails it.
    fn start(&mut self, id: RequestId, added: Result<(), EngineError>, events: EventSender) {
        match added {
            Ok(()) => self.track(id, events, 0, 0),
            Err(e) => {
                self.done();
                let _ = events.send(Event::Failed(serve_error(e)));
            }
        }
    }

    /// Computes `req`'s prompt (after its first `imported` tokens) layer by layer into
    /// `sink`; answers with its first token and what it waited and took.
    fn prefill(
        &mut self,
        req: GenerateRequest,
        (imported, draft_worth): (usize, Option<f64>),
        (mut sink, parts): (FrameSink, Option<KvParts>),
        sent: Instant,
    ) -> Result<Prefilled, ServeError> {
        self.imports.remove(&req.id);
        if let Some(e) = self.not_whole() {
            self.engine.abort_import(req.id);
            return Err(e);
        }
        let started = Instant::now();
        // On a virtual clock the prefill starts after what this loop already owes: the
        // prefills handled before it in this turn.
        let ahead = self.owed;
        let (id, prompt, params, on_frame) = (req.id, req.prompt, req.params, &mut |f| sink(f));
        let res = self
            .engine
            .with_kv_parts(parts, |e| e.prefill_export_to(id, prompt, params, imported, draft_worth, on_frame));
        // A timed engine's prefill took what its model says, on either clock.
        let modelled = self.engine.take_charged();
        self.owed += modelled;
        let took = if modelled > 0.0 { modelled } else { started.elapsed().as_secs_f64() };
        let draft_kv_tokens = self.engine.take_draft_shipped();
        res.map_err(serve_error).and_then(whole).map(|o| Prefilled {
            queued_seconds: (started - sent).as_secs_f64() + ahead,
            prefill_seconds: took,
            draft_kv_tokens,
            ..prefilled(o)
        })
    }

    /// Turns reservation `h.id` into a running sequence that streams to `events`.
    fn decode(&mut self, h: DecodeHandoff, events: EventSender) {
        self.imports.remove(&h.id);
        match self.engine.finish_import(h.id, h.prompt, h.first, h.params) {
            Ok(true) => self.track(h.id, events, 1, h.cached_tokens),
            Ok(false) => self.done(),
            Err(e) => {
                // Refused before it took the reservation over (a prompt that differs, a
                // request its engine refuses): its TTL entry is gone, so free the
                // blocks now.
                self.engine.abort_import(h.id);
                self.done();
                let e = match e {
                    // A bad frame aborted the reservation: the router prefills again.
                    EngineError::Unknown(id) => ServeError::KvLost(format!("the transfer of {id} was aborted")),
                    e => serve_error(e),
                };
                let _ = events.send(Event::Failed(e));
            }
        }
    }

    fn stats(&self) -> WorkerStats {
        let s = self.engine.stats();
        let (waiting, queued_prompt_tokens) = self.queued_behind();
        WorkerStats {
            waiting: s.waiting + waiting,
            running: s.running,
            importing: self.imports.len(),
            paused: self.streams.values().filter(|l| l.paused.is_some()).count(),
            queued_prompt_tokens: s.queued_prompt_tokens + queued_prompt_tokens,
            blocks: s.blocks,
            grammar_masks: s.masks.0,
            grammar_mask_ns: (s.masks.1 * 1e9) as u64,
            // The handle fills it in: the loop does not know roles.
            assignment: None,
            decode_steps: s.decode_steps,
            prefill_steps: s.prefill_steps,
            tiers: s.tiers,
            // The server in front of it says so, when it stops.
            stopping: false,
            incomplete: self.incomplete.is_some(),
            spec: s.spec,
            draft_blocks: s.draft_blocks,
            stages: self.engine.stage_totals(),
        }
    }

    /// The sender counted the request in `active` when it queued the command.
    fn track(&mut self, id: RequestId, events: EventSender, generated: usize, cached_elsewhere: usize) {
        self.streams.insert(id, Live { events, generated, cached_elsewhere, paused: None, drafts: None });
    }

    /// A counted command ended without a stream to track.
    fn done(&self) {
        self.active.fetch_sub(1, Ordering::Relaxed);
    }

    fn untrack(&mut self, id: RequestId) {
        if self.streams.remove(&id).is_some() {
            self.active.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Ends every stream, and every request of this engine's own still queued behind
    /// an export, with [`ServeError::Moved`]: the engine drops the sequences, and
    /// their full blocks stay cached for the prefill that moves them on. Queued
    /// exports stay: they are a peer's, and run once the engine is empty.
    fn move_out(&mut self, worker: &str) -> usize {
        let moved = ServeError::Moved { worker: worker.to_string(), drafts: None };
        let mut queued = 0;
        for c in std::mem::take(&mut self.behind) {
            let events = match c {
                Command::Generate(_, events) => events,
                Command::GenerateImported(req, _, events) => {
                    self.engine.abort_import(req.id);
                    events
                }
                c => {
                    self.behind.push_back(c);
                    continue;
                }
            };
            let _ = events.send(Event::Failed(moved.clone()));
            self.done();
            queued += 1;
        }
        // In arrival order: the router re-places them in the order it hears of them,
        // and a simulated fleet must replay the same way every run.
        let mut ids: Vec<RequestId> = self.streams.keys().copied().collect();
        ids.sort_unstable();
        for &id in &ids {
            // The sequence's record of drafts goes with it, so its next worker need
            // not learn it again.
            let drafts = self.engine.draft_record(id);
            self.engine.cancel(id);
            if let Some(live) = self.streams.get(&id) {
                let _ = live.events.send(Event::Failed(ServeError::Moved { worker: worker.to_string(), drafts }));
            }
            self.untrack(id);
        }
        queued + ids.len()
    }

    /// Pauses sequences whose consumers fell behind and resumes those that caught up
    /// (see `pdserve_protocol::pace`).
    fn pace(&mut self) {
        let mut expired = Vec::new();
        for (&id, live) in &mut self.streams {
            let unread = live.events.unread();
            if live.paused.is_some_and(|since| since.elapsed() > PAUSED_TTL) {
                expired.push(id);
            } else if unread >= pace::PAUSE_AT {
                // Again each time: a preempted sequence comes back unpaused.
                if self.engine.pause(id) && live.paused.is_none() {
                    tracing::debug!(request = %id, unread, "paused: the client fell behind");
                    live.paused = Some(Instant::now());
                }
            } else if unread < pace::RESUME_BELOW && live.paused.take().is_some() {
                self.engine.resume(id);
            }
        }
        for id in expired {
            let e = ServeError::Timeout(format!("paused for {} s behind its client", PAUSED_TTL.as_secs()));
            if let Some(live) = self.streams.get(&id) {
                let _ = live.events.send(Event::Failed(e));
            }
            self.engine.cancel(id);
            self.untrack(id);
        }
    }

    /// Cancels requests whose clients left and imports that outlived their TTL.
    fn reap(&mut self) {
        let gone: Vec<RequestId> =
            self.streams.iter().filter(|(_, l)| l.events.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            self.engine.cancel(id);
            self.untrack(id);
        }
        let stale: Vec<RequestId> =
            self.imports.iter().filter(|(_, t)| t.elapsed() > IMPORT_TTL).map(|(id, _)| *id).collect();
        for id in stale {
            self.engine.abort_import(id);
            self.imports.remove(&id);
        }
    }

    fn route(&mut self, out: StepOutput) {
        let Some(live) = self.streams.get_mut(&out.id) else { return };
        live.generated += 1;
        if let Some(scores) = out.prompt_logprobs.clone() {
            let _ = live.events.send(Event::Prompt(scores));
        }
        if let Some(embedding) = out.embedding.clone() {
            let _ = live.events.send(Event::Embedding(embedding));
        }
        if let Some(why) = out.broken {
            // The token that broke the grammar is not sent: the output so far is all
            // the client gets, with the error.
            let _ = live.events.send(Event::Failed(grammar_broken(&why)));
            self.untrack(out.id);
            return;
        }
        let sent = live.events.send(Event::Token(out.sampled.clone())).is_ok();
        if live.generated.is_multiple_of(DRAFTS_EVERY) && out.finish.is_none() {
            let changed = self.engine.draft_record(out.id).filter(|d| live.drafts != Some(*d));
            if let Some(d) = changed {
                live.drafts = Some(d);
                let _ = live.events.send(Event::Drafts(d));
            }
        }
        if let Some(reason) = out.finish {
            let usage = Usage {
                prompt_tokens: out.prompt_tokens,
                completion_tokens: live.generated,
                cached_tokens: out.cached_tokens.max(live.cached_elsewhere),
            };
            // The sequence already left the engine; a gone client changes nothing.
            let _ = live.events.send(Event::Done { reason, usage });
            self.untrack(out.id);
        } else if !sent {
            self.engine.cancel(out.id);
            self.untrack(out.id);
        }
    }
}

fn prefilled(o: StepOutput) -> Prefilled {
    Prefilled {
        token: o.sampled,
        finished: o.finish,
        prompt_tokens: o.prompt_tokens,
        cached_tokens: o.cached_tokens,
        queued_seconds: 0.0,
        prefill_seconds: 0.0,
        transfer_seconds: 0.0,
        kv_bytes: 0,
        draft_kv_tokens: 0,
        prompt_logprobs: o.prompt_logprobs,
        embedding: o.embedding,
    }
}

/// A first token that already broke its grammar fails the prefill.
fn whole(o: StepOutput) -> Result<StepOutput, ServeError> {
    match &o.broken {
        Some(why) => Err(grammar_broken(why)),
        None => Ok(o),
    }
}

fn grammar_broken(why: &str) -> ServeError {
    ServeError::Internal(format!("the output can no longer match its grammar: {why}"))
}

/// Engine refusals in the terms the frontend maps to HTTP.
fn serve_error(e: EngineError) -> ServeError {
    match e {
        EngineError::TooLong { prompt, max_tokens, context } => {
            ServeError::ContextLength { context, prompt, needed: prompt + max_tokens }
        }
        EngineError::EmptyPrompt
        | EngineError::BadToken(_)
        | EngineError::TooLargeForCache { .. }
        | EngineError::Grammar(_) => ServeError::Invalid(e.to_string()),
        EngineError::NoBlocks | EngineError::NotCached => ServeError::Overloaded(e.to_string()),
        EngineError::Stage(lost) => ServeError::WorkerLost(lost.to_string()),
        EngineError::Duplicate(_) | EngineError::Unknown(_) | EngineError::BadFrame(_) | EngineError::Cancelled => {
            ServeError::Internal(e.to_string())
        }
    }
}
