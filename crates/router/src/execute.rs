//! Running a [`Plan`]: the local executor (prefill and decode on one worker, after
//! a prefix fetch if planned) and the start of a [`Handoff`] (prefill on one worker,
//! decode on another). The cost book observes each through hooks fixed here, when
//! the plan starts: the prefill queue's ticket, the backlog's waiting guard, and the
//! [`Ending`] settled when the request ends.

use crate::cost::{self, KvMemory};
use crate::fetch::{self, Fetch, FetchCtx};
use crate::handoff::{self, Deadlines, Handoff};
use crate::index::PredictedHit;
use crate::place::{FetchPlan, Plan, Prefill};
use crate::policies::Ask;
use crate::workers::Entry;
use crate::{relay, Mode, Router, BLOCK_SIZE};
use pdserve_protocol::{Event, GenerateRequest, PrefillRoute, ServeError, TokenStream};
use pdserve_types::Role;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// How long `auto` waits for a full decode worker's blocks before prefilling there.
const AUTO_RESERVE: Duration = Duration::from_millis(500);

impl Router {
    /// Runs `plan`, made from a snapshot of `entries`, for `req`.
    pub(crate) fn execute(
        &self,
        plan: Plan,
        entries: &[Arc<Entry>],
        req: GenerateRequest,
        ask: &Ask<'_>,
    ) -> Result<TokenStream, ServeError> {
        let span = tracing::Span::current();
        let d = entries[plan.decode].clone();
        let fetch_of =
            |f: FetchPlan| Fetch { from: entries[f.from].clone(), tokens: f.tokens, keep: f.keep, seconds: f.seconds };
        let on = match &plan.prefill {
            Prefill::Local { .. } => &d,
            Prefill::Remote { on, .. } => &entries[*on],
        };
        let hit = Some(self.predict_hit(ask, on, plan.cached));
        let end = Ending { kv: d.kv.clone(), prompt: req.prompt.len(), hit, held: Default::default() };
        match plan.prefill {
            Prefill::Local { fetch } => {
                span.record("route", "local");
                req.trace.update(|t| t.route = Some(PrefillRoute::Local));
                self.telemetry.route(PrefillRoute::Local);
                self.local(&d, req, end, (plan.predicted, plan.cached), fetch.map(fetch_of))
            }
            Prefill::Remote { on, fetch, spare } => {
                let p = entries[on].clone();
                span.record("route", "remote");
                span.record("prefill", p.name());
                req.trace.update(|t| (t.route, t.prefill) = (Some(PrefillRoute::Remote), Some(p.name().to_string())));
                self.telemetry.route(PrefillRoute::Remote);
                let life = req.prompt.len() + req.params.max_tokens as usize;
                let waiting = d.backlog.enter_routed(req.prompt.len(), life).predicted(plan.predicted);
                let spare = spare.map(|i| entries[i].clone());
                let h = self.handoff((p, fetch.map(fetch_of)), d, spare, plan.cached);
                Ok(handoff::start(&self.runtime, h, req, waiting, end))
            }
        }
    }

    /// The predicted cache hit of `ask` prefilled on `e` with `cached` prompt tokens
    /// found there, to check when it ends.
    fn predict_hit(&self, ask: &Ask<'_>, e: &Entry, cached: usize) -> PredictedHit {
        let blocks = (cached / BLOCK_SIZE).min(ask.block_hashes.len());
        let hashes = &ask.block_hashes[..blocks];
        PredictedHit::new(self.index.clone(), e.name(), hashes, BLOCK_SIZE, self.telemetry.clone())
    }

    /// Prefill and decode on worker `d`, `cached` prompt tokens predicted found in
    /// its cache (or fetched first, with `fetch`). The first token is watched so
    /// `d`'s prompt queue and prefill rate stay measured (admission and `auto` read
    /// them): both count the tokens it computes.
    fn local(
        &self,
        d: &Arc<Entry>,
        mut req: GenerateRequest,
        end: Ending,
        (predicted, cached): (f64, usize),
        fetch: Option<Fetch>,
    ) -> Result<TokenStream, ServeError> {
        req.fence = Some(d.epoch());
        let (client, stream) = TokenStream::for_request(&req.params);
        let (inner_tx, inner) = TokenStream::for_request(&req.params);
        let (load, n) = (d.prefill.clone(), req.prompt.len());
        let todo = n - cached.min(n);
        let ahead = load.ahead();
        let ticket = load.admit(todo);
        let waiting = d.backlog.enter(n, n + req.params.max_tokens as usize).predicted(predicted);
        match (fetch, self.fetch.clone()) {
            (Some(f), Some(pace)) => {
                let ctx = FetchCtx { via: self.via, pace, telemetry: self.telemetry.clone() };
                self.runtime.spawn(fetch::run(f, d.clone(), req, inner_tx, ctx));
            }
            _ => d.worker.generate(req, inner_tx).map_err(|e| d.noted(e))?,
        }
        let started = Instant::now();
        let holder = end.holder();
        let on_first = move |first: &Event| {
            if matches!(first, Event::Token(_)) {
                load.observe(ahead, todo, started.elapsed());
                holder.keep(waiting.started());
            }
            drop(ticket);
        };
        let lost = d.clone();
        let on_end = move |out, cached| end.ended(out, cached);
        relay::relay(&self.runtime, inner, client, self.deadlines.client_stall, on_first, on_end, move || {
            lost.lost_one()
        });
        Ok(stream)
    }

    /// The handoff of a request prefilling on `p` and decoding on `d`.
    fn handoff(
        &self,
        (p, fetch): (Arc<Entry>, Option<Fetch>),
        d: Arc<Entry>,
        spare: Option<Arc<Entry>>,
        cached: usize,
    ) -> Handoff {
        // In auto a mixed worker out of blocks is not waited for: its own queue is
        // where the request would end up anyway, and joining it now keeps arrival
        // order (and frees the prefill slot for a handoff that can land). A worker
        // the planner made a decoder is waited for as in disaggregated mode: a long
        // prompt prefilled there would stall every sequence it decodes.
        let reserve = match self.mode {
            Mode::Auto if d.role() != Role::Decode => self.deadlines.reserve.min(AUTO_RESERVE),
            _ => self.deadlines.reserve,
        };
        Handoff {
            prefill: p,
            decode: d,
            spare,
            via: self.via,
            transfer: self.transfer.clone(),
            deadlines: Deadlines { reserve, ..self.deadlines },
            telemetry: self.telemetry.clone(),
            fetch: fetch.zip(self.fetch.clone()),
            cached,
        }
    }
}

/// What a routed request settles when it ends: the KV blocks it gives back on its
/// decode worker, and the cache hit predicted where it is prefilled.
pub struct Ending {
    kv: Arc<KvMemory>,
    prompt: usize,
    hit: Option<PredictedHit>,
    /// The prompt blocks it holds on its decode worker, counted by admission as
    /// taken until the request ends (or a block count shows them).
    held: cost::HeldSlot,
}

impl Ending {
    /// The prefill moved to a worker the prediction was not made for.
    pub(crate) fn unpredicted(self) -> Self {
        Ending { hit: None, ..self }
    }

    /// Where the request's held blocks go once its first token is out.
    pub(crate) fn holder(&self) -> cost::HeldSlot {
        self.held.clone()
    }

    /// Over after `out` output tokens; `cached` prompt tokens were reused if it finished.
    pub(crate) fn ended(self, out: usize, cached: Option<usize>) {
        self.held.release();
        self.kv.finished(self.prompt + out);
        if let (Some(hit), Some(cached)) = (self.hit, cached) {
            hit.check(cached);
        }
    }
}
