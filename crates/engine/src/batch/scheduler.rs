//! One scheduler step: continuous batching under a token budget. Decoding sequences go
//! first (one token each, and the drafts speculation verifies), then running prefills
//! continue, then waiting requests are admitted in arrival order with chunked prefill.
//! When blocks run out, the most recently admitted sequence is preempted and will be
//! recomputed later.

use super::draft::DraftCost;
use super::sequence::Sequence;
use super::speculate::{self, Acceptance, Candidate, PlainStep, Verify};
use super::stages::Pass;
use super::transfer::Stored;
use super::{Compute, Engine, StepOutput, BLOCK_SIZE};
use crate::kvcache::KvStorage;
use crate::model::{Pool, Scoring, SeqBatch};
use crate::threadpool::DisjointMut;
use crate::timed::{self, StepShape};
use pdserve_kv::{block_hashes, BlockHash, BlockTable, ImmutableBlock, Move, Place};
use pdserve_types::{FinishReason, RequestId, TokenOut};
use std::sync::Mutex;

/// The share of an objective the held steps aim at: their times leave out the
/// host's work around them (streaming each token, routing).
const AIM: f64 = 0.95;

/// The share of the TTFT objective by which a held prompt's first token is due
/// when it cannot wait for the decodes to end. Aimed at the objective's edge, the
/// held prompts pile up until the first of them must go at full pace, and the
/// decodes beside it stall; half of it left the most margin on the planner
/// benchmark's traces (docs/benchmarks.md, "A prompt held no longer than it can
/// wait").
const TTFT_AIM: f64 = 0.5;

/// The prompt tokens a step must take, beside decodes whose steps take `step_s`,
/// to compute `pace` tokens a second: `a` tokens make the step last
/// `step_s + fixed + a × per_token`. `None` when no step is fast enough.
fn tokens_a_step(pace: f64, step_s: f64, (fixed, per_token): (f64, f64)) -> Option<usize> {
    if pace <= 0.0 {
        return Some(0);
    }
    let room = 1.0 - pace * per_token;
    (room > 0.0).then(|| (pace * (step_s + fixed) / room).ceil() as usize)
}

/// What a layer hook learns about each sequence in the step.
pub(crate) struct LayerSeq {
    pub blocks: Vec<u32>,
    /// This step finishes the sequence's pending tokens (its K/V are then complete).
    pub last_chunk: bool,
}

/// One running sequence's share of a step.
pub(crate) struct Planned {
    /// Index into `running`.
    pub seq: usize,
    pub n: usize,
    pub logits: bool,
    /// Drafted tokens verified after the last sampled one (its `verify` chunk); every
    /// row then has logits.
    pub draft: usize,
}

impl Planned {
    pub(super) fn new(seq: usize, n: usize, logits: bool) -> Self {
        Planned { seq, n, logits, draft: 0 }
    }

    /// Rows of the chunk whose logits the step computes: its last, or all of a draft's.
    fn logit_rows(&self) -> usize {
        if self.draft > 0 {
            self.n
        } else {
            usize::from(self.logits)
        }
    }
}

impl Engine {
    /// Runs one batch and returns one output per sequence that sampled a token.
    pub fn step(&mut self) -> Vec<StepOutput> {
        self.step_with(&mut |_, _, _| true)
    }

    /// [`step`](Self::step) with a hook called after each layer's K/V are written.
    /// A hook returning `false` abandons the step: nothing advances, and the caller
    /// cancels what it no longer wants (partial K/V are overwritten if it resumes).
    pub(crate) fn step_with(
        &mut self,
        on_layer: &mut dyn FnMut(usize, Stored<'_>, &[LayerSeq]) -> bool,
    ) -> Vec<StepOutput> {
        let started = std::time::Instant::now();
        self.check_stages();
        // Planning includes the draft model's passes (drafts, and prompts followed).
        let mut plan = self.schedule();
        let planning_s = started.elapsed().as_secs_f64();
        // Before the forward pass writes into the blocks this step was given.
        self.settle_moves();
        let mut out = self.take_landed();
        match self.lane_step(&mut plan, on_layer, started) {
            Some(landed) => out.extend(landed),
            None => {
                // A lane in flight lands before the stages take a step whole.
                out.extend(self.land_beside(&mut plan, started));
                out.extend(self.run_plan(&plan, on_layer, planning_s));
            }
        }
        self.stalled = plan.is_empty() && out.is_empty();
        out
    }

    /// Runs `plan` through the model (and a group's later stages) and samples it.
    fn run_plan(
        &mut self,
        plan: &[Planned],
        on_layer: &mut dyn FnMut(usize, Stored<'_>, &[LayerSeq]) -> bool,
        planning_s: f64,
    ) -> Vec<StepOutput> {
        if plan.is_empty() {
            return Vec::new();
        }
        let (ids, gathered) = self.pass_of(plan);
        let batch = seq_batches(&self.running, plan, &ids, &gathered);
        let timing = self.start_timing(plan);
        let rows = tracing::enabled!(tracing::Level::TRACE).then(|| self.step_rows(plan));
        // The scratch leaves `self` for the step so the logits can be sampled in place.
        let mut scratch = std::mem::take(&mut self.scratch);
        let tiers = self.tiers.as_ref();
        let layer = &mut |l, kv: &KvStorage| on_layer(l, Stored { kv, tiers }, &ids);
        let logits = match &self.compute {
            Compute::Model(m) => match self.next.as_mut() {
                None => m.forward(self.isa, &self.pool, &batch, &mut self.kv, &mut scratch, layer),
                Some(next) => {
                    let pass = Pass { isa: self.isa, pool: &self.pool, batch: &batch };
                    next.forward(m, pass, &mut self.kv, &mut scratch, layer)
                }
            }
            .map(Logits::Rows),
            Compute::Timed(t) => {
                let shape: StepShape =
                    batch.iter().map(|b| StepShape::part(b.start_pos, b.tokens.len(), b.logits)).sum();
                let (seconds, idle) = t.step_seconds(&shape);
                let seconds = seconds + self.timed_draft_seconds(plan) + self.timed_draft_prompt_seconds(plan);
                self.charged += seconds;
                self.idle += idle;
                self.charged_prefill += seconds * shape.prompt_share();
                let per_layer = seconds / t.n_layers.max(1) as f64;
                // Layer by layer, so an export streams its frames as a real prefill does.
                let done = (0..t.n_layers).all(|l| {
                    timed::spend(t.clock, per_layer);
                    layer(l, &self.kv)
                });
                done.then_some(Logits::Timed)
            }
        };
        drop(batch);
        let pass_s = timing.started.elapsed().as_secs_f64();
        let out = match logits {
            Some(logits) => self.finish_pass(plan, gathered, logits, &timing),
            None => Vec::new(),
        };
        if let Some((decodes, drafted, prompt)) = rows {
            let (planning_ms, pass_ms) = (planning_s * 1e3, pass_s * 1e3);
            tracing::trace!(planning_ms, pass_ms, decodes, drafted, prompt, sampled = out.len(), "step");
        }
        self.scratch = scratch;
        out
    }

    /// What a pass of `plan` needs beside its tokens: each sequence's blocks (and
    /// whether the step ends its pending tokens), and what it gathers.
    pub(super) fn pass_of(&self, plan: &[Planned]) -> (Vec<LayerSeq>, Vec<Gathered>) {
        let seq = |p: &Planned| &self.running[p.seq];
        let ids = plan.iter().map(|p| LayerSeq { blocks: table_ids(seq(p)), last_chunk: p.logits }).collect();
        (ids, plan.iter().map(|p| Gathered::for_seq(seq(p))).collect())
    }

    /// A step's decodes, the drafted tokens they verify, and its prompt tokens: what
    /// the step's trace says of its size.
    fn step_rows(&self, plan: &[Planned]) -> (usize, usize, usize) {
        let (prompts, decodes): (Vec<&Planned>, Vec<&Planned>) =
            plan.iter().partition(|p| !self.running[p.seq].is_decoding());
        let drafted = decodes.iter().map(|p| p.draft).sum();
        (decodes.len(), drafted, prompts.iter().map(|p| p.n).sum())
    }

    /// What the step's time is recorded against, taken just before its pass.
    fn start_timing(&self, plan: &[Planned]) -> StepTiming {
        StepTiming {
            // A step of one token per sequence (and its verified draft), every row
            // sampled, decodes only: a drafted row costs what a decode row does.
            decoding: plan.iter().all(|p| p.n == 1 + p.draft && p.logits && self.running[p.seq].is_decoding()),
            // A step of prompt chunks only prefills only.
            prefilling: plan.iter().all(|p| !self.running[p.seq].is_decoding()),
            rows: plan.iter().map(|p| p.n).sum(),
            // The tokens the step's rows attend over: a decode step's cost grows with them.
            context: plan.iter().map(|p| (0..p.n).map(|j| self.running[p.seq].computed + j).sum::<usize>()).sum(),
            started: std::time::Instant::now(),
            charged: self.charged,
        }
    }

    /// After a pass that ran to the end: keeps the prompt scores and pooled hidden
    /// states, samples the logits and records how long the step took.
    pub(super) fn finish_pass(
        &mut self,
        plan: &[Planned],
        gathered: Vec<Gathered>,
        logits: Logits<'_>,
        timing: &StepTiming,
    ) -> Vec<StepOutput> {
        for (p, got) in plan.iter().zip(gathered) {
            let (scores, pooled) = got.into_parts();
            let s = &mut self.running[p.seq];
            s.prompt_scores.extend(scores);
            if !pooled.is_empty() {
                s.embedding = pooled;
            }
        }
        let out = self.finish_step(plan, logits);
        self.record_step(timing);
        out
    }

    /// Records how long the step took: the sequences' clocks advance by it, and a
    /// decode-only or prefill-only step feeds its fit.
    fn record_step(&mut self, timing: &StepTiming) {
        // A timed engine's step took what its model said, on any clock.
        let took = match self.compute {
            Compute::Model(_) => timing.started.elapsed().as_secs_f64(),
            Compute::Timed(_) => self.charged - timing.charged,
        };
        self.last_step_s = took;
        if timing.decoding {
            self.decode_steps.record(timing.rows, timing.context, took);
        } else if timing.prefilling && timing.rows > 0 {
            self.prefill_steps.record(timing.rows, took);
        }
    }

    fn schedule(&mut self) -> Vec<Planned> {
        let took = std::mem::take(&mut self.last_step_s);
        self.running.iter_mut().chain(self.waiting.iter_mut()).for_each(|s| s.age(took));
        let mut budget = self.cfg.max_batch_tokens;
        // Prompt tokens this step may take beside its decodes.
        let mut prompts = self.prompt_allowance().unwrap_or(usize::MAX);
        let mut plan = Vec::new();
        // Decodes first, then their drafts, then prompts: beside a prompt's chunk a
        // drafted row adds little to a step's time, so the drafts take their rows
        // before the chunk does, and are priced in a step that holds it.
        let mut blocked = self.plan_running(&mut plan, &mut budget, None);
        budget -= self.add_drafts(&mut plan, budget, prompts);
        blocked |= self.plan_running(&mut plan, &mut budget, Some(&mut prompts));
        if !blocked {
            self.admit(&mut plan, budget.min(prompts));
        }
        // After admitting: a prompt computed whole in its first step is followed too.
        self.draft_prompts(&plan);
        plan
    }

    /// Plans the running decodes (`prompts` None), or the running prompts within
    /// `prompts` tokens, out of `budget`. Returns whether one found no blocks.
    fn plan_running(&mut self, plan: &mut Vec<Planned>, budget: &mut usize, mut prompts: Option<&mut usize>) -> bool {
        let mut blocked = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let s = &self.running[i];
            let decoding = s.is_decoding();
            let allowed = prompts.as_deref().map_or(*budget, |&p| p.min(*budget));
            let n = s.pending().min(allowed);
            if s.paused || s.in_lane || n == 0 || decoding != prompts.is_none() {
                i += 1;
                continue;
            }
            if self.reserve(i, s.computed + n, !decoding) {
                self.spec.decodes += u64::from(decoding);
                let s = &self.running[i];
                plan.push(Planned::new(i, n, s.computed + n == s.tokens.len()));
                *budget -= n;
                if let Some(p) = prompts.as_deref_mut() {
                    *p -= n;
                }
            } else {
                // Out of blocks: a prefill waits, a decode preempted itself. The
                // sequences after it still run (decodes that finish free the blocks
                // it waits for; stopping here left running decodes unscheduled behind
                // a waiting prefill for good), but no newcomer is admitted: it would
                // take those blocks first.
                blocked = true;
            }
            i += 1;
        }
        blocked
    }

    /// The prompt tokens the step would take within `limit` were no drafts verified:
    /// the running prompts', then the waiting ones' as slots allow.
    fn prompt_rows(&self, limit: usize) -> usize {
        let prompt = |s: &&Sequence| !s.paused && !s.in_lane && !s.is_decoding();
        let running = self.running.iter().filter(prompt).map(Sequence::pending);
        let slots = self.cfg.max_seqs.saturating_sub(self.running.iter().filter(|s| !s.paused).count());
        let waiting = self.waiting.iter().take(slots).map(Sequence::pending);
        running.chain(waiting).sum::<usize>().min(limit)
    }

    /// Each planned decode's draft (what its grammar forces, else its n-gram lookup,
    /// else up to `max_draft` tokens of the draft model's) with its index in `plan`,
    /// and the candidates [`speculate::plan_drafts`] weighs.
    fn propose_drafts(
        &mut self,
        plan: &[Planned],
        max_draft: usize,
        draft_cost: Option<DraftCost>,
    ) -> (Vec<(usize, Proposal)>, Vec<Candidate>) {
        let context = self.context_length();
        let (pooled, forced_rate, by_model_rate) = (self.acceptance.rate(), self.forced.rate(), self.by_model.rate());
        let decoding: Vec<bool> = plan.iter().map(|p| p.n == 1 && self.running[p.seq].is_decoding()).collect();
        let by_model: Vec<bool> = plan
            .iter()
            .zip(&decoding)
            .map(|(p, &d)| d && self.has_draft_model() && self.drafts_by_model(p.seq))
            .collect();
        let (vocab, timed) = (self.vocab_size(), self.timed_speculation());
        let (mut drafted, mut cands) = (Vec::new(), Vec::new());
        for (k, p) in plan.iter().enumerate() {
            if !decoding[k] {
                continue;
            }
            let s = &mut self.running[p.seq];
            // The token after the draft is sampled too: leave room for it.
            let max = max_draft.min(s.tokens_left().saturating_sub(1)).min(context.saturating_sub(s.tokens.len()));
            // What a grammar forces is drafted first; its record is the worker's.
            let mut forced = s.constraint.as_mut().map(|c| c.forced()).unwrap_or_default();
            forced.truncate(max);
            s.draft_forced = !forced.is_empty();
            let rate = match (s.draft_forced, by_model[k]) {
                (true, _) => forced_rate,
                (false, true) => s.acceptance.rate_from(by_model_rate),
                (false, false) => s.acceptance.rate_from(pooled),
            };
            // A draft model's token is its row of a pass; the pass is the step's.
            let row = draft_cost.map_or(0.0, |c| c.row(s.computed));
            let (proposal, draft_cost, passes) = match (s.draft_forced, by_model[k], timed) {
                (true, _, _) => (Proposal::Ready(forced), 0.0, false),
                // A timed draft model drafts as its profile says. Beside one, a request
                // that drafts by lookup drafts as the lookup's measured figures say,
                // and nothing where the twin was given none.
                (false, true, Some(t)) => (Proposal::Ready(t.draft(&s.tokens, max, vocab)), row, true),
                (false, false, Some(t)) if t.draft_step.is_some() => {
                    let lookup = t.lookup().map(|l| l.draft(&s.tokens, max, vocab)).unwrap_or_default();
                    (Proposal::Ready(lookup), 0.0, false)
                }
                (false, true, None) => (Proposal::Model(max), row, true),
                // A timed lookup: free, as a real one nearly is.
                (false, false, Some(t)) => (Proposal::Ready(t.draft(&s.tokens, max, vocab)), 0.0, false),
                (false, false, None) => {
                    self.ngrams.learn(&s.tokens, s.pooled);
                    s.pooled = s.tokens.len();
                    (Proposal::Ready(speculate::draft(&s.tokens, &self.ngrams, max)), 0.0, false)
                }
            };
            if proposal.len() > 0 {
                cands.push(Candidate { drafted: proposal.len(), rate, context: s.computed + 1, draft_cost, passes });
                drafted.push((k, proposal));
            }
        }
        (drafted, cands)
    }

    /// Gives the step's decodes the drafted tokens [`speculate::plan_drafts`] finds
    /// worth verifying, within `room` rows and the blocks free now (a draft never
    /// preempts anyone), in a step that may take up to `prompts` prompt tokens. Returns
    /// the rows added.
    fn add_drafts(&mut self, plan: &mut [Planned], room: usize, prompts: usize) -> usize {
        let Some(spec) = self.cfg.speculation.as_ref() else { return 0 };
        let (max_draft, verify_all) = (spec.max_draft, spec.verify_all);
        let timed_without = matches!(self.compute, Compute::Timed(_)) && self.timed_speculation().is_none();
        if timed_without || room == 0 {
            return 0;
        }
        // Until the fit can tell a row's cost from a step's, every other step verifies
        // nothing: the fit needs steps of both sizes (drafts of one length give one
        // size), and drafts that keep failing must not be verified whole for good.
        // After, a long run of steps that verify nothing ends in one that explores.
        let verify = match verify_all {
            true => Verify::Plan,
            false => self.exploration.next(self.decode_steps.tells_rows_apart()),
        };
        if verify == Verify::Skip {
            return 0;
        }
        // The draft model's cost, fitted once for the step.
        let draft_cost = self.draft_pass_cost();
        let (drafted, cands) = self.propose_drafts(plan, max_draft, draft_cost);
        if cands.is_empty() {
            return 0;
        }
        let joining = self.prompt_rows(room.min(prompts));
        let plain = PlainStep {
            rows: plan.iter().map(|p| p.n).sum::<usize>() + joining,
            context: plan.iter().map(|p| self.running[p.seq].computed).sum(),
            yields: plan.iter().filter(|p| p.logits).count(),
        };
        // Without a fit every draft is verified whole; while exploring, in up to as
        // many extra rows as the step has (or a whole draft's): a second size for the
        // fit, not a step many times dearer than a plain one.
        let fit = (verify == Verify::Plan && !verify_all).then(|| self.decode_steps.fit()).flatten();
        let room = if verify == Verify::Explore { room.min(plain.rows.max(max_draft)) } else { room };
        let pass_cost = draft_cost.map_or(0.0, |c| c.pass);
        let take = speculate::plan_drafts(fit.as_ref(), plain, &cands, room, pass_cost);
        if !verify_all {
            self.exploration.verified(take.iter().any(|&n| n > 0));
        }
        let chosen = drafted.into_iter().zip(take).filter(|&(_, n)| n > 0).map(|((k, p), n)| (k, p, n)).collect();
        let mut added = 0;
        for (k, draft) in self.make_drafts(plan, chosen) {
            let p = &mut plan[k];
            let s = &mut self.running[p.seq];
            let fits = s.table.as_mut().is_some_and(|t| t.ensure_capacity(s.computed + 1 + draft.len()).is_ok());
            if !fits {
                continue;
            }
            s.verify.clear();
            s.verify.push(s.tokens[s.computed]);
            s.verify.extend_from_slice(&draft);
            p.draft = draft.len();
            p.n += draft.len();
            added += draft.len();
        }
        added
    }

    /// The draft model computes the step's prompt chunks beside the target, so that
    /// its cache is ready when the sequence decodes (here, or on the decode engine a
    /// prompt is exported to: see `Engine::export_draft`).
    fn draft_prompts(&mut self, plan: &[Planned]) {
        if !self.has_draft_model() {
            return;
        }
        let mut upto: Vec<(usize, usize)> = Vec::new();
        for p in plan {
            if !self.running[p.seq].is_decoding() && self.drafts_by_model(p.seq) {
                upto.push((p.seq, self.running[p.seq].computed + p.n));
            }
        }
        if let (Some(d), false) = (self.drafter.as_mut(), upto.is_empty()) {
            d.follow(self.isa, &self.pool, &mut self.running, &upto, self.cfg.max_batch_tokens);
        }
    }

    /// A draft model drafts here: a real one, or a timed engine's profiled one.
    pub(super) fn has_draft_model(&self) -> bool {
        self.drafter.is_some() || self.timed_speculation().is_some_and(|t| t.draft_step.is_some())
    }

    /// What drafting by model costs `s`: the draft model's passes, and the seconds
    /// it takes to compute what its cache lacks of `s`'s tokens. A real draft model's
    /// are measured (`None` until they are); a timed one's are its profile's, which
    /// caches no prompt.
    fn model_draft_costs(&self, s: &Sequence) -> Option<(DraftCost, f64)> {
        let cost = self.draft_pass_cost()?;
        if let Some(d) = self.drafter.as_ref() {
            return Some((cost, d.lacks(s) as f64 * d.prompt_cost()?));
        }
        let t = self.timed_speculation()?;
        Some((cost, t.draft_prompt_seconds(s.computed, s.tokens.len() - s.computed)))
    }

    /// What a drafting pass of the draft model costs: measured (`None` until it is),
    /// or a timed engine's profiled one.
    fn draft_pass_cost(&self) -> Option<DraftCost> {
        match self.drafter.as_ref() {
            Some(d) => d.cost(),
            None => self.timed_speculation()?.draft_step.map(|step| DraftCost::of_step(&step)),
        }
    }

    /// Whether `running[seq]` drafts with the draft model, deciding it the first
    /// time it is asked: until the engine has measured what the decision needs (its
    /// decode steps, the draft model's passes and a prompt it followed), yes.
    fn drafts_by_model(&mut self, seq: usize) -> bool {
        if let Some(by_model) = self.running[seq].model_drafts {
            return by_model;
        }
        let by_model = self.model_drafts_pay(seq).unwrap_or(true);
        self.running[seq].model_drafts = Some(by_model);
        by_model
    }

    /// [`speculate::price_model_drafts`] for `running[seq]` beside the decodes running
    /// now; `None` while something it weighs is unmeasured.
    fn model_drafts_pay(&self, seq: usize) -> Option<bool> {
        let s = &self.running[seq];
        let (cost, prompt_s) = self.model_draft_costs(s)?;
        let price = self.price_drafts(s.id, s.tokens.len(), cost, self.expected_output(s))?;
        tracing::debug!(
            request = s.id.0,
            by_model = price.pays(prompt_s),
            prompt_ms = prompt_s * 1e3,
            saved_ms_per_token = price.saved_per_token * 1e3,
            verified = price.verified,
            output = price.output,
            decodes = price.decodes,
            "draft model or lookup"
        );
        Some(price.pays(prompt_s))
    }

    /// What the draft model's K/V of a `prompt_len`-token prompt reserved here would
    /// save this engine's decodes, in seconds, were the prompt computed elsewhere (a
    /// prefill worker's): what its drafts save a token beside the decodes running now,
    /// over the tokens this engine's requests output on average. `None` while
    /// something it weighs is unmeasured (the K/V is then worth having).
    pub(super) fn drafts_worth(&self, id: RequestId, prompt_len: usize) -> Option<f64> {
        let cost = self.draft_pass_cost()?;
        let output = match self.outputs {
            (0, _) => return None,
            (n, tokens) => tokens as f64 / n as f64,
        };
        let price = self.price_drafts(id, prompt_len, cost, output)?;
        // Every draft verified: worth whatever it costs.
        let worth = Some((price.output * price.saved_per_token).max(0.0)).filter(|w| w.is_finite())?;
        let (verified, decodes) = (price.verified, price.decodes);
        tracing::debug!(request = id.0, worth_ms = worth * 1e3, verified, decodes, "draft K/V worth");
        Some(worth)
    }

    /// What drafting by model saves a token of sequence `id` of `tokens` (running
    /// here or not yet) beside the other decodes running now, with the draft model's
    /// passes costing `cost`; `None` while something it weighs is unmeasured.
    fn price_drafts(&self, id: RequestId, tokens: usize, cost: DraftCost, output: f64) -> Option<Priced> {
        let spec = self.cfg.speculation.as_ref().filter(|_| self.has_draft_model())?;
        if spec.verify_all {
            // Every draft verified, as vLLM and llama.cpp do: every sequence drafts.
            return Some(Priced { saved_per_token: f64::INFINITY, verified: spec.max_draft, output, decodes: 0 });
        }
        // A fit that cannot tell a row from a step charges every row alike, and
        // drafts would seem to save nothing.
        let fit = self.decode_steps.tells_rows_apart().then(|| self.decode_steps.fit()).flatten()?;
        let others = self.running.iter().filter(|r| r.id != id && !r.paused && r.is_decoding());
        let contexts: Vec<usize> = others.map(|r| r.computed).chain([tokens]).collect();
        let drafting = speculate::ModelDrafting {
            prompt_s: 0.0,
            output,
            drafted: spec.max_draft,
            rate: self.by_model.rate(),
            pass_s: cost.pass,
            row_s: cost.row(tokens),
        };
        let price = speculate::price_model_drafts(&fit, &contexts, &drafting);
        let decodes = contexts.len() - 1;
        Some(Priced { saved_per_token: price.saved_per_token, verified: price.verified, output, decodes })
    }

    /// The tokens `s` is expected to output still: the mean of the requests that
    /// finished here, within its limit.
    fn expected_output(&self, s: &Sequence) -> f64 {
        let left = s.tokens_left() as f64;
        match self.outputs {
            (0, _) => left,
            (n, tokens) => left.min(tokens as f64 / n as f64),
        }
    }

    /// What a timed engine's draft model took to draft the step's drafts.
    fn timed_draft_seconds(&self, plan: &[Planned]) -> f64 {
        let Some(spec) = self.timed_speculation() else { return 0.0 };
        // Only drafts the model made took its passes: not a lookup's, nor a grammar's.
        let by_model =
            |p: &&Planned| self.running[p.seq].model_drafts == Some(true) && !self.running[p.seq].draft_forced;
        let drafted: Vec<&Planned> = plan.iter().filter(|p| p.draft > 0).filter(by_model).collect();
        let passes = drafted.iter().map(|p| p.draft).max().unwrap_or(0);
        let context = drafted.iter().map(|p| self.running[p.seq].computed).sum::<usize>() / drafted.len().max(1);
        spec.draft_seconds(drafted.len(), passes, context)
    }

    /// What a timed engine's draft model took to compute the step's prompt chunks of
    /// the sequences that draft by model.
    fn timed_draft_prompt_seconds(&self, plan: &[Planned]) -> f64 {
        let Some(spec) = self.timed_speculation() else { return 0.0 };
        let following = plan.iter().map(|p| (p, &self.running[p.seq]));
        let following = following.filter(|(_, s)| !s.is_decoding() && s.model_drafts == Some(true));
        following.map(|(p, s)| spec.draft_prompt_seconds(s.computed, p.n)).sum()
    }

    /// How a timed engine's drafts fare (`None` for a real model, or a timed one
    /// without speculation).
    pub(super) fn timed_speculation(&self) -> Option<crate::timed::TimedSpeculation> {
        match &self.compute {
            Compute::Timed(t) => t.speculation,
            Compute::Model(_) => None,
        }
    }

    /// The drafts chosen, `n` tokens of each at most: lookups as they are, and the
    /// draft model's made now, all of them together.
    fn make_drafts(&mut self, plan: &[Planned], chosen: Vec<(usize, Proposal, usize)>) -> Vec<(usize, Vec<u32>)> {
        let want: Vec<(usize, usize)> = chosen
            .iter()
            .filter(|(_, p, _)| matches!(p, Proposal::Model(_)))
            .map(|&(k, _, n)| (plan[k].seq, n))
            .collect();
        let made = match self.drafter.as_mut() {
            Some(d) if !want.is_empty() => {
                d.draft(self.isa, &self.pool, &mut self.running, &want, self.cfg.max_batch_tokens)
            }
            _ => Vec::new(),
        };
        let mut made = made.into_iter();
        chosen
            .into_iter()
            .map(|(k, p, n)| {
                let mut draft = match p {
                    Proposal::Ready(d) => d,
                    Proposal::Model(_) => made.next().unwrap_or_default(),
                };
                draft.truncate(n);
                (k, draft)
            })
            .filter(|(_, d)| !d.is_empty())
            .collect()
    }

    /// With [`Objectives`](super::Objectives): the prompt tokens a step may compute
    /// beside its decodes, each decode keeping its TPOT objective. Every decode
    /// that can still meet it spares the slack it has left spread over its
    /// remaining steps; the step takes the least of those at the engine's own
    /// prefill pace, or more where the prompts in line need more to keep their TTFT
    /// objective ([`Self::ttft_pace`]). `None` (no limit) without objectives, such decodes or
    /// a measured prefill pace, and when no allowance keeps a prompt's TTFT.
    /// Before any decode-only step it is 0, so that one times them.
    fn prompt_allowance(&self) -> Option<usize> {
        let obj = self.cfg.objectives?;
        let decodes = || self.running.iter().filter(|s| !s.paused && s.is_decoding());
        let rows = decodes().count();
        if rows == 0 {
            return None;
        }
        let prefill = self.prefill_steps.fit()?;
        // With no decode step timed yet, this one decodes alone and times them.
        let Some(fit) = self.decode_steps.fit() else { return Some(0) };
        let context: usize = decodes().map(|s| s.computed).sum();
        let step_s = fit.seconds(rows as f64, context as f64);
        let (mut spare, mut held) = (f64::INFINITY, 0.0_f64);
        for s in decodes() {
            if let Some(per_step) = s.spare_per_step(obj.tpot_s * AIM, step_s) {
                spare = spare.min(per_step);
                held = held.max(s.tokens_left() as f64 * step_s);
            }
        }
        if !spare.is_finite() || prefill.1 <= 0.0 {
            return None;
        }
        let floor = tokens_a_step(self.ttft_pace(obj.ttft_s, held, prefill)?, step_s, prefill)?;
        // The decodes' own rows come out of the same step budget.
        Some(((spare / prefill.1) as usize).max(floor).min(self.cfg.max_batch_tokens.saturating_sub(rows)))
    }

    /// The prompt tokens a second held steps must compute for every prompt in line
    /// to keep its TTFT objective: 0 when each can wait for the decodes to end
    /// (`held` seconds) and then for the prompts ahead of it at the full pace
    /// (`fixed` + `per_token` a token); else enough for the most pressed one's
    /// first token by [`TTFT_AIM`] of the objective.
    /// Holding the first prompt holds every one behind it. `None` (hold nothing)
    /// once a prompt has waited that share, and when a preempted answer (a decode
    /// recomputing its tokens) is in line.
    fn ttft_pace(&self, ttft_s: f64, held: f64, (fixed, per_token): (f64, f64)) -> Option<f64> {
        let prompts = self.running.iter().filter(|s| !s.paused && !s.is_decoding()).chain(&self.waiting);
        let prefill_s = |n: usize| n.div_ceil(self.cfg.max_batch_tokens.max(1)) as f64 * fixed + n as f64 * per_token;
        let (mut ahead, mut tokens, mut pace, mut can_wait) = (held, 0, 0.0_f64, true);
        for p in prompts {
            let left = ttft_s * TTFT_AIM - p.waited_s;
            if p.generated() > 0 || left <= 0.0 {
                return None;
            }
            ahead += prefill_s(p.pending());
            can_wait &= p.waited_s + ahead <= ttft_s;
            tokens += p.pending();
            pace = pace.max(tokens as f64 / left);
        }
        Some(if can_wait { 0.0 } else { pace })
    }

    /// Makes room for `tokens` in running sequence `i`. A decode that cannot grow
    /// preempts the newest sequence (possibly itself); a prefill waits, but first
    /// takes the table of a waiting sequence that holds one (a fetched prefix): that
    /// one is not admitted while a prefill is blocked, so each would wait on the
    /// other for ever. Its full blocks stay cached for when it is admitted.
    fn reserve(&mut self, i: usize, tokens: usize, is_prefill: bool) -> bool {
        loop {
            let Some(table) = self.running[i].table.as_mut() else { return false };
            if table.ensure_capacity(tokens).is_ok() {
                return true;
            }
            if is_prefill {
                let Some(holder) = self.waiting.iter_mut().rev().find(|s| s.table.is_some()) else { return false };
                holder.preempt();
                continue;
            }
            // The last sequence from `i` on, but none whose row is in a lane's flight.
            let j = (i..self.running.len()).rev().find(|&j| !self.running[j].in_lane).unwrap_or(i);
            let mut victim = self.running.remove(j);
            victim.preempt();
            self.waiting.push_front(victim);
            if j == i {
                return false;
            }
        }
    }

    /// Admits waiting sequences in arrival order while budget, slots and blocks last.
    /// Paused sequences keep their blocks but not their slots.
    fn admit(&mut self, plan: &mut Vec<Planned>, mut budget: usize) {
        let mut busy = self.running.iter().filter(|s| !s.paused).count();
        while budget > 0 && busy < self.cfg.max_seqs {
            let Some(mut s) = self.waiting.pop_front() else { break };
            if s.table.is_none() {
                let hashes = self.shareable_hashes(&s);
                // A running prefill is computing the blocks this prompt would compute
                // next: it waits (and those behind it, first come first served) and
                // finds them cached, instead of computing them a second time.
                if self.running.iter().any(|r| r.computing(&hashes)) {
                    self.waiting.push_front(s);
                    break;
                }
                self.attach_prefix(&mut s, hashes);
            }
            let n = s.pending().min(budget);
            let fits = s.table.as_mut().is_some_and(|t| t.ensure_capacity(s.computed + n).is_ok());
            if !fits {
                // Strict FCFS: nobody overtakes the head of the queue.
                s.preempt();
                self.waiting.push_front(s);
                break;
            }
            budget -= n;
            plan.push(Planned::new(self.running.len(), n, s.computed + n == s.tokens.len()));
            self.running.push(s);
            busy += 1;
        }
    }

    /// The hashes of the whole blocks of `s` a cache may serve: all but the last
    /// token, which is always computed so the step yields logits. A request that
    /// scores or pools its prompt computes all of it: cached positions have neither.
    fn shareable_hashes(&self, s: &Sequence) -> Vec<BlockHash> {
        let usable = match s.params.whole_prompt() {
            true => 0,
            false => (s.tokens.len() - 1) / BLOCK_SIZE * BLOCK_SIZE,
        };
        block_hashes(&s.tokens[..usable], BLOCK_SIZE, self.cfg.cache_salt)
    }

    /// Starts the sequence's block table from the longest cached prefix of its
    /// shareable blocks `hashes`.
    fn attach_prefix(&mut self, s: &mut Sequence, hashes: Vec<BlockHash>) {
        let hits = self.cached_chain(&hashes);
        let table = BlockTable::with_prefix(&self.blocks, self.cfg.cache_salt, hits);
        s.computed = table.cached_prefix_tokens();
        s.cached_tokens = s.computed;
        s.table = Some(table);
        s.prompt_hashes = hashes;
    }

    /// The longest cached prefix of the chain `hashes`, as pool blocks: a chain may
    /// alternate between the pool and the lower tiers, whose blocks are copied back.
    pub(super) fn cached_chain(&mut self, hashes: &[BlockHash]) -> Vec<ImmutableBlock> {
        self.cached_chain_from(hashes, 0)
    }

    /// [`Engine::cached_chain`] of the blocks of `hashes` from index `start` on:
    /// those before are not looked at, so none of them is copied back. A chained
    /// hash names its whole prefix, so the run found is the prompt's all the same.
    pub(super) fn cached_chain_from(&mut self, hashes: &[BlockHash], start: usize) -> Vec<ImmutableBlock> {
        let Some(rest) = hashes.get(start..) else { return Vec::new() };
        let mut hits = self.blocks.match_prefix(rest);
        while self.restore_lower(hashes, start, &mut hits) > 0 {
            hits.extend(self.blocks.match_prefix(&hashes[start + hits.len()..]));
        }
        hits
    }

    /// Extends a pool hit (of `hashes` from index `start`) with the blocks right
    /// after it that the host or disk tier holds, copied back into fresh pool
    /// blocks. The allocation may evict, and so move, tier blocks: each is looked
    /// up again after the moves are made. Returns how many blocks came back.
    fn restore_lower(&mut self, hashes: &[BlockHash], start: usize, hits: &mut Vec<ImmutableBlock>) -> usize {
        if self.tiers.is_none() {
            return 0;
        }
        let from = start + hits.len();
        let found = self.blocks.lower_prefix(&hashes[from..]).len().min(self.blocks.available());
        let Ok(blocks) = self.blocks.allocate_many(found) else { return 0 };
        self.settle_moves();
        let Some(tiers) = self.tiers.as_mut() else { return 0 };
        // A timed engine's copies take the profile's time on its clock.
        let charge = match &self.compute {
            Compute::Timed(t) => Some((t.restore, t.clock)),
            Compute::Model(_) => None,
        };
        let mut modelled = 0.0;
        for (i, block) in blocks.into_iter().enumerate() {
            let at = from + i;
            let Some((_, place)) = self.blocks.locate_lower(hashes[at]) else { break };
            if !tiers.restore(place, &mut self.kv, block.id().0) {
                break;
            }
            if let Some(next) = self.next.as_mut() {
                next.owe(Move { from: place, to: Place::Device(block.id()) });
            }
            modelled += charge.map_or(0.0, |(cost, _)| cost.seconds(place));
            hits.push(block.complete(hashes[at], at.checked_sub(1).map(|p| hashes[p])));
        }
        if let Some((_, clock)) = charge {
            self.charged += modelled;
            timed::spend(clock, modelled);
        }
        start + hits.len() - from
    }

    fn finish_step(&mut self, plan: &[Planned], logits: Logits<'_>) -> Vec<StepOutput> {
        for p in plan.iter().filter(|p| p.draft == 0) {
            let s = &mut self.running[p.seq];
            s.computed += p.n;
            if let Some(t) = s.table.as_mut() {
                t.commit(&s.tokens[..s.computed]);
            }
        }
        let sampled: Vec<(usize, usize)> = plan.iter().filter(|p| p.logits).map(|p| (p.seq, p.logit_rows())).collect();
        let results = self.sample_all(&sampled, logits);
        // A verified draft's accepted tokens are computed; the blocks only rejected
        // ones took go back.
        for p in plan.iter().filter(|p| p.draft > 0) {
            let s = &mut self.running[p.seq];
            match s.draft_forced {
                true => self.forced.add(s.last_record),
                false => {
                    self.acceptance.add(s.last_record);
                    s.acceptance.add(s.last_record);
                    if s.model_drafts == Some(true) {
                        self.by_model.add(s.last_record);
                    }
                }
            }
            self.spec.drafted += p.draft as u64;
            self.spec.accepted += s.last_record.accepted;
            self.spec.verified_steps += 1;
            if let Some(t) = s.table.as_mut() {
                t.commit(&s.tokens[..s.computed]);
                t.truncate(s.tokens.len());
            }
        }
        let mut done: Vec<usize> =
            sampled.iter().zip(&results).filter(|(_, (_, fin))| *fin).map(|(&(i, _), _)| i).collect();
        done.sort_unstable();
        for i in done.into_iter().rev() {
            let s = self.running.remove(i);
            self.outputs.0 += 1;
            self.outputs.1 += s.generated() as u64;
        }
        results.into_iter().flat_map(|(o, _)| o).collect()
    }

    /// Samples running sequences `seqs` (distinct indices, each with its rows of
    /// logits) in parallel: each touches only its own sequence, so the split changes
    /// nothing.
    fn sample_all(&mut self, seqs: &[(usize, usize)], logits: Logits<'_>) -> Vec<(Vec<StepOutput>, bool)> {
        let (vocab, context) = (self.vocab_size(), self.context_length());
        let logits = match logits {
            Logits::Rows(rows) => rows,
            Logits::Timed => {
                let eog = &self.eog;
                let next = |s: &mut Sequence| {
                    let sampled =
                        TokenOut { token: timed::next_token(&s.tokens, vocab), logprob: 0.0, top: Vec::new() };
                    record(s, sampled, eog, context)
                };
                let sample = |s: &mut Sequence, rows: usize| match rows {
                    1 => {
                        let (out, fin) = next(s);
                        (vec![out], fin)
                    }
                    _ => verify_with(s, 0..rows, |s, _| next(s)),
                };
                return seqs.iter().map(|&(i, rows)| sample(&mut self.running[i], rows)).collect();
            }
        };
        let eog = &self.eog;
        let mut results: Vec<Option<(Vec<StepOutput>, bool)>> = (0..seqs.len()).map(|_| None).collect();
        let first_row: Vec<usize> = seqs.iter().scan(0, |at, &(_, n)| Some(std::mem::replace(at, *at + n))).collect();
        let running = DisjointMut::new(&mut self.running[..]);
        let rows = DisjointMut::new(logits);
        let slots = DisjointMut::new(&mut results[..]);
        self.pool.run(seqs.len(), &|k| {
            let ((i, n), at) = (seqs[k], first_row[k]);
            // SAFETY: sequence indices are distinct, and rows `at..at + n` and slot `k`
            // belong to task `k` alone.
            let (s, rows, slot) = unsafe {
                (&mut running.part(i..i + 1)[0], rows.part(at * vocab..(at + n) * vocab), &mut slots.part(k..k + 1)[0])
            };
            *slot = Some(match n {
                1 => {
                    let (out, fin) = sample_next(s, rows, eog, context);
                    (vec![out], fin)
                }
                _ => verify_draft(s, rows, vocab, eog, context),
            });
        });
        results.into_iter().flatten().collect()
    }
}

/// What a pass gathers for one planned sequence besides its logits: prompt scores
/// and pooled hidden states.
#[derive(Default)]
pub(super) struct Gathered {
    scores: Mutex<Vec<TokenOut>>,
    pooled: Mutex<Vec<f32>>,
}

impl Gathered {
    /// A pooling sequence's rows are added onto its sum so far, one row after another
    /// whatever the chunking, so its embedding does not depend on it.
    pub(super) fn for_seq(s: &Sequence) -> Gathered {
        Gathered { pooled: Mutex::new(s.embedding.clone()), ..Gathered::default() }
    }

    fn into_parts(self) -> (Vec<TokenOut>, Vec<f32>) {
        use std::sync::PoisonError;
        (
            self.scores.into_inner().unwrap_or_else(PoisonError::into_inner),
            self.pooled.into_inner().unwrap_or_else(PoisonError::into_inner),
        )
    }
}

/// The forward pass's view of each planned sequence: the tokens it computes, where
/// its K/V go, what it scores and what it pools.
pub(super) fn seq_batches<'a>(
    running: &'a [Sequence],
    plan: &[Planned],
    ids: &'a [LayerSeq],
    gathered: &'a [Gathered],
) -> Vec<SeqBatch<'a>> {
    plan.iter()
        .zip(ids)
        .zip(gathered)
        .map(|((p, ls), g)| {
            let s = &running[p.seq];
            let score = s.score_targets(p.n).map(|targets| Scoring {
                targets,
                top: s.params.prompt_logprobs.unwrap_or(0) as usize,
                out: &g.scores,
            });
            let pool = s.pooled_rows(p.n).map(|rows| Pool { rows, out: &g.pooled });
            let tokens = if p.draft > 0 { &s.verify[..] } else { &s.tokens[s.computed..s.computed + p.n] };
            SeqBatch { tokens, start_pos: s.computed, blocks: &ls.blocks, logits: p.logit_rows(), score, pool }
        })
        .collect()
}

/// A decode's draft this step: tokens found already, or up to this many for the
/// draft model to draft once the step's plan says how many it verifies.
enum Proposal {
    Ready(Vec<u32>),
    Model(usize),
}

impl Proposal {
    fn len(&self) -> usize {
        match self {
            Proposal::Ready(d) => d.len(),
            Proposal::Model(n) => *n,
        }
    }
}

/// The kind of a step and when it started: decode-only and prefill-only steps are
/// timed into their fits.
pub(super) struct StepTiming {
    pub decoding: bool,
    pub prefilling: bool,
    /// Tokens the step computes (all prompt tokens in a prefill-only step).
    pub rows: usize,
    pub context: usize,
    pub started: std::time::Instant,
    /// `charged` before the step (a timed engine's step took the difference).
    pub charged: f64,
}

/// What a step computed to sample from.
pub(super) enum Logits<'a> {
    /// One row of `vocab` logits per sampled sequence.
    Rows(&'a mut [f32]),
    /// Nothing: a timed engine's tokens follow from the sequence alone.
    Timed,
}

fn table_ids(s: &Sequence) -> Vec<u32> {
    s.table.as_ref().map(|t| t.block_ids().into_iter().map(|b| b.0).collect()).unwrap_or_default()
}

/// Samples the sequence's next token and decides whether it finished.
pub(crate) fn sample_next(s: &mut Sequence, row: &mut [f32], eog: &[u32], context: usize) -> (StepOutput, bool) {
    let stop_ids = &s.params.stop.token_ids;
    let min_reached = s.generated() >= s.params.min_tokens as usize;
    s.sampler.clear_bans();
    if !min_reached {
        s.sampler.ban(eog);
        s.sampler.ban(stop_ids);
    }
    let sampled = match s.constraint.as_mut() {
        None => s.sampler.sample(row, &s.history),
        Some(c) => match c.allowed() {
            Some(mask) => s.sampler.sample_masked(row, &s.history, Some(mask)),
            // A failed grammar allows nothing more: end the output with what it has.
            None => s.sampler.sample_masked(row, &s.history, Some(&only(eog.first().copied().unwrap_or(0)))),
        },
    };
    record(s, sampled, eog, context)
}

/// Samples a verified draft's rows in order, as plain decoding would sample them one
/// step at a time: row `j` saw the last sampled token and the draft's first `j`
/// tokens, so it counts only while each of those was what the row before sampled.
/// The first sample that differs from the draft (or the one after a whole draft) is
/// the step's last token. Every emitted token is a plain sample of the right context,
/// so greedy output is unchanged and sampled output keeps its distribution (a draft
/// token is kept with exactly its probability) and, for a seed, its tokens.
fn verify_draft(
    s: &mut Sequence,
    rows: &mut [f32],
    vocab: usize,
    eog: &[u32],
    context: usize,
) -> (Vec<StepOutput>, bool) {
    verify_with(s, rows.chunks_exact_mut(vocab), |s, row| sample_next(s, row, eog, context))
}

/// [`verify_draft`] over `rows`, each sampled by `sample` in order.
fn verify_with<R>(
    s: &mut Sequence,
    rows: impl IntoIterator<Item = R>,
    mut sample: impl FnMut(&mut Sequence, R) -> (StepOutput, bool),
) -> (Vec<StepOutput>, bool) {
    let draft = std::mem::take(&mut s.verify);
    // The last sampled token's K/V are written.
    s.computed += 1;
    let (mut outs, mut accepted, mut finished) = (Vec::new(), 0, false);
    for (j, row) in rows.into_iter().enumerate() {
        let (out, fin) = sample(s, row);
        let token = out.sampled.token;
        outs.push(out);
        if fin {
            finished = true;
            break;
        }
        match draft.get(j + 1) {
            Some(&d) if d == token => {
                // Its K/V, written this step, are those of the right context.
                s.computed += 1;
                accepted += 1;
            }
            _ => break,
        }
    }
    let drafted = draft.len() - 1;
    let rejected = !finished && accepted < drafted;
    let mut record = Acceptance::default();
    record.record(accepted + usize::from(rejected), accepted);
    s.last_record = record;
    (outs, finished)
}

/// Appends the sampled token to `s` and decides whether it finished.
fn record(s: &mut Sequence, sampled: TokenOut, eog: &[u32], context: usize) -> (StepOutput, bool) {
    let first = s.generated() == 0;
    let tok = sampled.token;
    s.tokens.push(tok);
    s.history.push(tok);
    let broken = s.constraint.as_mut().and_then(|c| c.broken(tok));
    let finish = if broken.is_some() { Some(FinishReason::Stop) } else { s.finish_reason(eog, context) };
    let prompt_logprobs = (first && s.params.prompt_logprobs.is_some()).then(|| std::mem::take(&mut s.prompt_scores));
    let embedding = if first { s.take_embedding() } else { None };
    let output = StepOutput {
        id: s.id,
        sampled,
        finish,
        prompt_tokens: s.prompt_len,
        cached_tokens: s.cached_tokens,
        prompt_logprobs,
        embedding,
        broken,
    };
    (output, finish.is_some())
}

/// A token mask that allows `token` alone.
fn only(token: u32) -> Vec<u32> {
    let mut words = vec![0; token as usize / 32 + 1];
    words[token as usize / 32] = 1 << (token % 32);
    words
}

/// What drafts by model would save a sequence: a token's saving, the drafted tokens
/// a step verifies, the tokens it is expected to output, and the other decodes the
/// saving was priced beside.
struct Priced {
    saved_per_token: f64,
    verified: usize,
    output: f64,
    decodes: usize,
}

impl Priced {
    /// Whether the saving over the expected output exceeds `prompt_s`, the draft
    /// model's compute of the prompt.
    fn pays(&self, prompt_s: f64) -> bool {
        self.output * self.saved_per_token > prompt_s
    }
}
