//! A stage group's decodes pipelined across steps. Taking turns, a group's stages
//! leave all but one idle; cutting a decode step in micro-batches does not help, since
//! each part pays a stage's fixed cost. Instead the running decodes go in lanes, up to
//! one a stage: each step sends one lane's rows into the later stages and then samples
//! the oldest lane's, which were in them meanwhile, so the head computes one lane while
//! the later stages compute the others (the head passes each on between its layers),
//! and a lane's next step starts as soon as its tokens are sampled.
//! [`crate::pipeline::lanes`] says, from the stages' measured costs, how many lanes
//! a round ends soonest in, if any ends sooner than a step whole.
//!
//! A sequence whose row is in flight is `in_lane`: no step schedules it and nothing
//! preempts it until its lane lands; a cancelled one's row is dropped when it lands.
//! Anything else that calls the stages (a transfer, tier copies, a step whole) lands
//! the lane first, so a stage connection never has a lane and another call in flight.
//! Each row is computed as it would be in any batch, so the tokens are a whole step's.

use super::scheduler::{seq_batches, LayerSeq, Logits, Planned, StepTiming};
use super::stages::Pass;
use super::transfer::Stored;
use super::{Compute, Engine, StepOutput};
use crate::kvcache::KvStorage;
use pdserve_types::RequestId;
use std::time::Instant;

/// A lane in flight: each of its sequences, with the position its row computes.
pub(crate) struct Lane {
    seqs: Vec<(RequestId, usize)>,
}

/// The hook a step's layers are shown to.
type OnLayer<'h> = dyn FnMut(usize, Stored<'_>, &[LayerSeq]) -> bool + 'h;

impl Engine {
    /// The step, where it goes in lanes: `plan` sent into the later stages as a lane
    /// (its share, while a round's lanes are still being filled), and the oldest lane
    /// landed and sampled once the round's lanes are all in flight. `None` where the
    /// step goes the usual way.
    pub(super) fn lane_step(
        &mut self,
        plan: &mut Vec<Planned>,
        on_layer: &mut OnLayer<'_>,
        started: Instant,
    ) -> Option<Vec<StepOutput>> {
        let width = self.lanes_take(plan)?;
        let next = self.next.as_mut()?;
        let flying = next.lanes.len();
        next.width = width;
        if flying + 1 < width {
            // The rest wait for the next steps, each of which starts a lane of its own.
            let left = plan.split_off(plan.len().div_ceil(width - flying));
            self.spec.decodes -= left.len() as u64;
        }
        if !self.start_lane(plan, on_layer) {
            self.drop_lanes();
            return Some(Vec::new());
        }
        let oldest = self.next.as_mut().filter(|n| n.lanes.len() >= width).and_then(|n| n.lanes.pop_front());
        Some(oldest.map(|l| self.land(l, started)).unwrap_or_default())
    }

    /// How many lanes `plan` goes in, if it goes as a lane: decodes only (no draft, no
    /// prompt, nothing scored or pooled), on a group head that owes its stages no tier
    /// copies, with a round's lanes in flight already or lanes predicted to pay.
    fn lanes_take(&self, plan: &[Planned]) -> Option<usize> {
        let (Compute::Model(_), Some(next)) = (&self.compute, self.next.as_ref()) else { return None };
        let decode = |p: &Planned| {
            let s = &self.running[p.seq];
            p.n == 1 && p.draft == 0 && p.logits && s.is_decoding() && !s.params.whole_prompt()
        };
        if plan.is_empty() || !plan.iter().all(decode) || next.owes_copies() {
            return None;
        }
        match next.lanes.is_empty() {
            true => next.lanes_for(plan.len()),
            false => Some(next.width),
        }
    }

    /// Runs `plan`'s rows through this engine's layers and sends them on as a lane.
    fn start_lane(&mut self, plan: &[Planned], on_layer: &mut OnLayer<'_>) -> bool {
        let (ids, gathered) = self.pass_of(plan);
        let batch = seq_batches(&self.running, plan, &ids, &gathered);
        let (Compute::Model(m), Some(next)) = (&self.compute, self.next.as_mut()) else { return false };
        let mut scratch = std::mem::take(&mut self.scratch);
        let tiers = self.tiers.as_ref();
        let layer = &mut |l, kv: &KvStorage| on_layer(l, Stored { kv, tiers }, &ids);
        let pass = Pass { isa: self.isa, pool: &self.pool, batch: &batch };
        let sent = next.start_lane(m, pass, &mut self.kv, &mut scratch, layer);
        drop(batch);
        self.scratch = scratch;
        if sent {
            let mut seqs = Vec::with_capacity(plan.len());
            for p in plan {
                let s = &mut self.running[p.seq];
                s.in_lane = true;
                seqs.push((s.id, s.computed));
            }
            if let Some(n) = self.next.as_mut() {
                n.lanes.push_back(Lane { seqs });
            }
        }
        sent
    }

    /// Lands `lane`: its rows out of the later stages, its logits and its tokens
    /// sampled, as a step's.
    fn land(&mut self, lane: Lane, started: Instant) -> Vec<StepOutput> {
        for s in self.running.iter_mut().filter(|s| lane.seqs.iter().any(|(id, _)| *id == s.id)) {
            s.in_lane = false;
        }
        let Some(next) = self.next.as_mut() else { return Vec::new() };
        if !next.land_first() {
            self.drop_lanes();
            return Vec::new();
        }
        // The rows of sequences still here at the position they left from (a
        // cancelled one is gone).
        let width = next.landed_rows().len() / lane.seqs.len().max(1);
        let (mut plan, mut rows) = (Vec::new(), Vec::new());
        for (k, (id, pos)) in lane.seqs.iter().enumerate() {
            let Some(i) = self.running.iter().position(|s| s.id == *id && s.computed == *pos) else { continue };
            plan.push(Planned::new(i, 1, true));
            rows.extend_from_slice(&next.landed_rows()[k * width..(k + 1) * width]);
        }
        self.sample_lane(&plan, &rows, started)
    }

    /// Samples a landed lane's `plan` from its final `rows`.
    fn sample_lane(&mut self, plan: &[Planned], rows: &[f32], started: Instant) -> Vec<StepOutput> {
        if plan.is_empty() {
            return Vec::new();
        }
        let (ids, gathered) = self.pass_of(plan);
        let batch = seq_batches(&self.running, plan, &ids, &gathered);
        let (Compute::Model(m), Some(next)) = (&self.compute, self.next.as_mut()) else { return Vec::new() };
        let mut scratch = std::mem::take(&mut self.scratch);
        let pass = Pass { isa: self.isa, pool: &self.pool, batch: &batch };
        let logits = next.lane_logits(m, pass, rows, &mut scratch);
        drop(batch);
        // A lane's step is half a round, so it feeds no step-time fit.
        let timing =
            StepTiming { decoding: false, prefilling: false, rows: plan.len(), context: 0, started, charged: 0.0 };
        let out = match logits {
            Some(l) => self.finish_pass(plan, gathered, Logits::Rows(l), &timing),
            None => Vec::new(),
        };
        self.scratch = scratch;
        out
    }

    /// Lands every lane in flight, oldest first: their outputs.
    fn land_lanes(&mut self, started: Instant) -> Vec<StepOutput> {
        let mut out = Vec::new();
        while let Some(lane) = self.next.as_mut().and_then(|n| n.lanes.pop_front()) {
            out.extend(self.land(lane, started));
        }
        out
    }

    /// Lands the lanes in flight, if any, before `plan` goes whole: their outputs.
    /// The sequences they finish leave `running`, so `plan` (none of whose sequences
    /// is in a lane) is pointed at its sequences' places after them.
    pub(super) fn land_beside(&mut self, plan: &mut [Planned], started: Instant) -> Vec<StepOutput> {
        let ids: Vec<RequestId> = plan.iter().map(|p| self.running[p.seq].id).collect();
        let out = self.land_lanes(started);
        for (p, id) in plan.iter_mut().zip(ids) {
            p.seq = self.running.iter().position(|s| s.id == id).unwrap_or(p.seq);
        }
        out
    }

    /// Lands the lanes in flight before a call to the stages outside a step; the next
    /// step hands their outputs out.
    pub(super) fn settle_lanes(&mut self) {
        let out = self.land_lanes(Instant::now());
        if let Some(n) = self.next.as_mut() {
            n.landed.extend(out);
        }
    }

    /// What a lane landed outside a step sampled.
    pub(super) fn take_landed(&mut self) -> Vec<StepOutput> {
        self.next.as_mut().map(|n| std::mem::take(&mut n.landed)).unwrap_or_default()
    }

    /// Keeps `out` (taken by [`Engine::take_landed`]) for the next step to hand out.
    pub(super) fn keep_landed(&mut self, out: Vec<StepOutput>) {
        if let Some(n) = self.next.as_mut() {
            n.landed.splice(0..0, out);
        }
    }

    /// After a stage was lost: no lane is in flight any more.
    fn drop_lanes(&mut self) {
        self.running.iter_mut().for_each(|s| s.in_lane = false);
        if let Some(n) = self.next.as_mut() {
            n.drop_lanes();
        }
    }
}
