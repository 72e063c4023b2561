//! The head of a stage group: an engine whose model is the first pipeline stage (the
//! embeddings, the first layers and the output head) and whose later stages run
//! elsewhere. The head schedules, owns every block table and samples, as any engine
//! does; each step it runs its own layers, hands the residual stream and the step's
//! shape (each part's positions and block ids) to the stages after it, and samples from
//! the logits of the final rows the last one returns. A later stage keeps the K/V of its own layers under the same block
//! ids, so the head's block accounting (prefix cache included) holds for every stage.
//!
//! A stage that cannot be reached fails the step: nothing advances, the engine reports
//! the loss once ([`Engine::take_stage_lost`]), and its owner ends the sequences so the
//! router moves them. The next step tries the stages again; K/V a stage may have lost
//! meanwhile is not trusted, so the prefix cache is emptied first.

use super::lanes::Lane;
use super::transfer::write_frame;
use super::{Compute, Engine, EngineError, StepOutput, BLOCK_SIZE};
use crate::kernels::Isa;
use crate::kvcache::KvStorage;
use crate::model::{logit_rows, returned_rows, ForwardScratch, LayerRange, Model, SeqBatch, StageOut};
use crate::pipeline::{cut, lanes, micro_batches, PassCost, PassTimes};
use crate::threadpool::ThreadPool;
use crate::tiers::{TierBytes, TierConfig};
use pdserve_kv::{Move, Place};
use pdserve_types::{HandoffToken, KvAddr, KvDtype, KvFrame, RequestId, StageCompute, StageReceiver, StageTotals};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// The stages after this engine's own layers, together.
pub trait NextStages: Send {
    /// Runs the step whose parts are `parts` through the later stages, from `x` (every
    /// row of this stage's output), and puts the last stage's final residual rows that
    /// get logits (each part's last `logits` rows, in order) into `rows`.
    fn run(&mut self, parts: &[StagePart], x: &[f32], rows: &mut Vec<f32>) -> Result<(), StageLost>;

    /// Whether the stages were reached afresh since the last call (their K/V may be
    /// gone, so the head forgets its prefix cache).
    fn reconnected(&mut self) -> bool;

    /// Whether every stage can be reached now (trying those that could not, as often
    /// as the implementation sees fit).
    fn ready(&mut self) -> bool {
        true
    }

    /// The steps sent through these stages since they were made.
    fn totals(&self) -> StageTotals {
        StageTotals::default()
    }

    /// What the later stages' passes (in layer order) and a hop between two stages
    /// were measured to cost; no passes where the stages take no micro-batches.
    fn costs(&self) -> StageCosts {
        StageCosts::default()
    }

    /// Sends a micro-batch of a step (`parts`, from `x`, this engine's output rows for
    /// them) into the stages without waiting for it; only where [`NextStages::costs`]
    /// names passes.
    fn start(&mut self, parts: &[StagePart], x: &[f32]) -> Result<(), StageLost> {
        let _ = (parts, x);
        Err(StageLost("these stages take no micro-batches".into()))
    }

    /// Takes every micro-batch started since the last call through the rest of the
    /// stages, one behind another, and puts their last stage's rows that get logits
    /// into `rows`, in the order they started: the step's rows, as [`NextStages::run`]
    /// gives them.
    fn finish(&mut self, rows: &mut Vec<f32>) -> Result<(), StageLost> {
        let _ = rows;
        Err(StageLost("these stages take no micro-batches".into()))
    }

    /// Takes the oldest micro-batch started and not finished (a lane of decodes)
    /// through the rest of the stages and puts its last stage's rows that get logits
    /// into `rows`; those started after it stay in flight. Only where
    /// [`NextStages::costs`] names passes.
    fn finish_first(&mut self, rows: &mut Vec<f32>) -> Result<(), StageLost> {
        let _ = rows;
        Err(StageLost("these stages take no lanes".into()))
    }

    /// Sends on, without waiting, each micro-batch a stage has answered to the stage
    /// after it, so micro-batches in flight move stage to stage while the head
    /// computes; the head calls it between its own layers.
    fn relay(&mut self) -> Result<(), StageLost> {
        Ok(())
    }

    /// Layer `layer`'s K/V of `blocks` (the head's block ids, in the sequence's order)
    /// from the stage that holds it, as frames indexed from 0: a prefill group's
    /// export of the layers past its head's.
    fn read_kv(&mut self, layer: usize, blocks: &[u32]) -> Result<Vec<KvFrame>, StageLost>;

    /// Has every later stage send its own layers' K/V of `blocks` (indexed from 0, as
    /// [`NextStages::read_kv`] gives them) to the handoff's receiver itself, as a part
    /// beside the head's sink; says what each stage's part came to. Stages that
    /// cannot (in-process ones) send none: the head reads their layers.
    fn send_kv(&mut self, blocks: &[u32], to: &KvParts) -> Result<Vec<(LayerRange, PartSent)>, StageLost> {
        let _ = (blocks, to);
        Ok(Vec::new())
    }

    /// Writes each frame (its layer past the head's) into the given block of the stage
    /// that holds its layer: a decode group's import.
    fn write_kv(&mut self, frames: &[(u32, KvFrame)]) -> Result<(), StageLost>;

    /// Has every later stage that receives K/V itself expect its layers of handoff
    /// `handoff` into `blocks` (indexed from 0, as frames are): the receivers to
    /// name in the reservation. Stages that cannot (in-process ones) are not named:
    /// their layers come to the head, which writes them on.
    fn expect_kv(&mut self, handoff: u64, blocks: &[u32]) -> Result<Vec<StageReceiver>, StageLost> {
        let _ = (handoff, blocks);
        Ok(Vec::new())
    }

    /// Waits until every stage that expected `handoff` holds all of its layers of it
    /// (`Ok(Err(why))`: one's transfer failed); the stages forget it either way.
    fn await_kv(&mut self, handoff: u64) -> Result<Result<(), String>, StageLost> {
        let _ = handoff;
        Ok(Ok(()))
    }

    /// Has every stage that expected `handoff` give it up; once this returns, none
    /// writes another frame of it (its blocks may be handed out again).
    fn forget_kv(&mut self, handoff: u64) -> Result<(), StageLost> {
        let _ = handoff;
        Ok(())
    }

    /// Makes the head's lower-tier copies on every stage, in order, each of its own
    /// layers: a block down from the pool or the host tier, or (to a pool block) back
    /// up. Each stage keeps `slots` (host, disk) slots, as the head does.
    fn tiers(&mut self, slots: TierSlots, copies: &[Move]) -> Result<(), StageLost> {
        let _ = (slots, copies);
        Err(StageLost("these stages keep no K/V tiers".into()))
    }
}

/// Where a prefill group's later stages send their layers' K/V of a handoff
/// themselves: the receiver, the handoff and its token (the head's sink presented
/// the same), and the receiving group's stages that take their own layers (as the
/// head's sink sends them). Each stage's frames then cross one link, not two.
#[derive(Clone, Debug)]
pub struct KvParts {
    pub to: KvAddr,
    pub handoff: u64,
    pub token: HandoffToken,
    pub stages: Vec<StageReceiver>,
}

impl KvParts {
    /// Where layer `layer`'s frames go, and the token to present there.
    pub fn route(&self, layer: u32) -> (&KvAddr, HandoffToken) {
        match self.stages.iter().find(|s| s.holds(layer)) {
            Some(s) => (&s.to, s.token),
            None => (&self.to, self.token),
        }
    }
}

/// What one stage's part of a handoff came to.
#[derive(Clone, Debug, PartialEq)]
pub enum PartSent {
    /// Every frame of its layers is in the receiver's inbox.
    Delivered,
    /// It could not reach the receiver, and sent nothing: the head reads its layers
    /// and sends them itself.
    Unreachable(String),
    /// The part began and failed (the receiver gave the handoff up): so does the
    /// handoff.
    Failed(String),
}

/// A group's lower tiers, in slots of one block: (host, disk).
pub type TierSlots = (usize, usize);

/// What a group's later stages cost, as measured.
#[derive(Debug, Clone, Default)]
pub struct StageCosts {
    /// Each later stage's pass, in layer order (`None` until measured).
    pub passes: Vec<Option<PassCost>>,
    /// A hop of a micro-batch between two stages.
    pub hop: Option<PassCost>,
}

/// Why a step could not go through the later stages.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("pipeline stage lost: {0}")]
pub struct StageLost(pub String);

/// The later stages and what became of the last step through them.
pub(crate) struct Next {
    stages: Box<dyn NextStages>,
    lost: Option<StageLost>,
    /// The head's tier copies the stages have not made yet, and the tiers' slots.
    copies: Vec<Move>,
    pub(crate) slots: TierSlots,
    /// The last stage's rows of the step.
    rows: Vec<f32>,
    /// Seconds this engine spent in its own layers and the output head on those steps.
    head_s: f64,
    /// This engine's passes through its own layers, by their rows, and through its
    /// output head, by the rows given logits.
    own: PassTimes,
    head: PassTimes,
    /// The lanes of decodes in the later stages (oldest first) and how many a round
    /// of them has, and what a lane that landed outside a step (before a transfer)
    /// sampled, for the next step to hand out.
    pub(crate) lanes: VecDeque<Lane>,
    pub(crate) width: usize,
    pub(crate) landed: Vec<StepOutput>,
    /// Where the next export's later stages send their layers themselves.
    pub(crate) parts: Option<KvParts>,
}

/// What a pass needs from the engine besides the stages.
pub(crate) struct Pass<'a, 'b> {
    pub isa: Isa,
    pub pool: &'a ThreadPool,
    pub batch: &'a [SeqBatch<'b>],
}

/// What a step's own layers are run with: the pass, the K/V and the scratch.
type Own<'p, 'a, 'b, 'x> = (&'p Pass<'a, 'b>, &'p mut KvStorage, &'x mut ForwardScratch);

impl Next {
    fn new(stages: Box<dyn NextStages>, slots: TierSlots) -> Next {
        let (own, head) = (PassTimes::default(), PassTimes::default());
        let (lanes, landed) = (VecDeque::new(), Vec::new());
        let (copies, rows, head_s, width, parts) = (Vec::new(), Vec::new(), 0.0, 0, None);
        Next { stages, lost: None, copies, slots, rows, head_s, own, head, lanes, width, landed, parts }
    }

    /// Runs `pass` through `head` then the later stages, whole or in micro-batches as
    /// the stages' measured costs say pays; `None` when a stage was lost (or
    /// `on_layer` stopped the pass).
    pub(crate) fn forward<'s>(
        &mut self,
        head: &Model,
        pass: Pass<'_, '_>,
        kv: &mut KvStorage,
        s: &'s mut ForwardScratch,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> Option<&'s mut [f32]> {
        self.copied().ok()?;
        let rows: Vec<usize> = pass.batch.iter().map(|b| b.tokens.len()).collect();
        match self.depth(pass.batch, rows.iter().sum()) {
            1 => self.whole(head, (&pass, kv, &mut *s), on_layer)?,
            m => self.pipelined(head, (&pass, kv, &mut *s), on_layer, &cut(&rows, m))?,
        }
        let started = Instant::now();
        let logits = head.head_logits(pass.isa, pass.pool, pass.batch, &self.rows, s);
        self.headed(pass.batch, started);
        logits
    }

    /// Counts an output head's pass over `batch`, begun at `started`.
    fn headed(&mut self, batch: &[SeqBatch<'_>], started: Instant) {
        let took = started.elapsed().as_secs_f64();
        self.head_s += took;
        // Scored and pooled rows make a pass of another kind, and a step of prompt
        // chunks that gives no logits reads none of the output head's weights.
        let rows: usize = batch.iter().map(|b| b.logits).sum();
        if rows > 0 && batch.iter().all(|b| b.score.is_none() && b.pool.is_none()) {
            self.head.record(rows, took);
        }
    }

    /// How many micro-batches a step of `batch` (`rows` rows) goes through in.
    fn depth(&self, batch: &[SeqBatch<'_>], rows: usize) -> usize {
        if batch.iter().any(|b| b.score.is_some() || b.pool.is_some()) {
            return 1;
        }
        let later = self.stages.costs();
        if later.passes.is_empty() {
            return 1;
        }
        let costs: Vec<Option<PassCost>> = std::iter::once(self.own.cost()).chain(later.passes).collect();
        micro_batches(&costs, later.hop, rows)
    }

    /// How many lanes decodes of `rows` rows go in, as the measured costs say.
    pub(crate) fn lanes_for(&self, rows: usize) -> Option<usize> {
        let later = self.stages.costs();
        if later.passes.is_empty() {
            return None;
        }
        // Each lane's landing runs the output head again: the head's pass pays it
        // (a step in micro-batches runs it once, after them all).
        let own = match (self.own.cost(), self.head.cost()) {
            (Some(own), Some(head)) => Some(own.then(head)),
            (own, _) => own,
        };
        let costs: Vec<Option<PassCost>> = std::iter::once(own).chain(later.passes).collect();
        lanes(&costs, later.hop, rows)
    }

    /// Whether tier copies wait to be made on the stages (a call of its own, which
    /// no step may have in flight).
    pub(crate) fn owes_copies(&self) -> bool {
        !self.copies.is_empty()
    }

    /// Runs `pass` (a lane's decodes) through `head` and sends it into the later
    /// stages without waiting; false when a stage was lost (or `on_layer` stopped it).
    pub(crate) fn start_lane(
        &mut self,
        head: &Model,
        pass: Pass<'_, '_>,
        kv: &mut KvStorage,
        s: &mut ForwardScratch,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> bool {
        let Some(x) = self.own_layers(head, (&pass, kv, s), pass.batch, on_layer) else { return false };
        self.sent(|st, _| st.start(&parts_of(pass.batch), x)).is_some()
    }

    /// The oldest lane's last rows, out of the later stages into `self.rows`; false
    /// (and the loss kept) when a stage was lost.
    pub(crate) fn land_first(&mut self) -> bool {
        self.sent(|st, rows| st.finish_first(rows)).is_some()
    }

    /// The output head over a landed lane's final `rows`: its logits, in `s`.
    pub(crate) fn lane_logits<'s>(
        &mut self,
        head: &Model,
        pass: Pass<'_, '_>,
        rows: &[f32],
        s: &'s mut ForwardScratch,
    ) -> Option<&'s mut [f32]> {
        let started = Instant::now();
        let logits = head.head_logits(pass.isa, pass.pool, pass.batch, rows, s);
        self.headed(pass.batch, started);
        logits
    }

    /// Forgets every lane in flight: what the stages hold of them is answered (or
    /// fails) and dropped, so no answer is left for a later step.
    pub(crate) fn drop_lanes(&mut self) {
        self.lanes.clear();
        let _ = self.stages.finish(&mut self.rows);
    }

    /// The final rows of the last lane landed.
    pub(crate) fn landed_rows(&self) -> &[f32] {
        &self.rows
    }

    /// The step whole through this engine's layers, then the later stages'.
    fn whole(
        &mut self,
        head: &Model,
        (pass, kv, s): Own<'_, '_, '_, '_>,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> Option<()> {
        let x = self.own_layers(head, (pass, kv, s), pass.batch, on_layer)?;
        self.sent(|st, rows| st.run(&parts_of(pass.batch), x, rows))
    }

    /// The step in the micro-batches of `plan`, each sent on to the stages as soon as
    /// this engine's layers computed it, so the next stage computes it while this one
    /// computes the next. Only the last micro-batch's layers are shown to `on_layer`:
    /// by then each of those layers holds every row's K/V of the step.
    fn pipelined(
        &mut self,
        head: &Model,
        (pass, kv, s): Own<'_, '_, '_, '_>,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
        plan: &[Vec<(usize, Range<usize>)>],
    ) -> Option<()> {
        for (j, mb) in plan.iter().enumerate() {
            let sub: Vec<SeqBatch<'_>> = mb.iter().map(|(p, r)| rows_of(&pass.batch[*p], r.clone())).collect();
            let mut unseen = |_: usize, _: &KvStorage| true;
            let layer: &mut dyn FnMut(usize, &KvStorage) -> bool =
                if j + 1 == plan.len() { &mut *on_layer } else { &mut unseen };
            let Some(x) = self.own_layers(head, (pass, &mut *kv, &mut *s), &sub, layer) else {
                // Stopped or lost: what is in flight is answered (or fails) first.
                let _ = self.stages.finish(&mut self.rows);
                return None;
            };
            self.sent(|st, _| st.start(&parts_of(&sub), x))?;
        }
        self.sent(|st, rows| st.finish(rows))
    }

    /// `batch` through this engine's layers: the residual stream for the next stage.
    fn own_layers<'x>(
        &mut self,
        head: &Model,
        (pass, kv, s): Own<'_, '_, '_, 'x>,
        batch: &[SeqBatch<'_>],
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> Option<&'x [f32]> {
        let started = Instant::now();
        let Next { stages, lost, .. } = self;
        // Between its layers the head passes on what the stages answered meanwhile.
        let mut layer = |l: usize, kv: &KvStorage| match stages.relay() {
            Ok(()) => on_layer(l, kv),
            Err(e) => {
                *lost = Some(e);
                false
            }
        };
        let out = head.forward_stage(pass.isa, pass.pool, batch, &[], kv, s, &mut layer)?;
        let took = started.elapsed().as_secs_f64();
        self.head_s += took;
        self.own.record(batch.iter().map(|b| b.tokens.len()).sum(), took);
        match out {
            StageOut::Hidden(x) => Some(x),
            StageOut::Logits(_) => {
                self.lost = Some(StageLost("the head stage holds the whole model".into()));
                None
            }
        }
    }

    /// What `send` did with the stages; a loss is kept for the engine to report.
    fn sent(&mut self, send: impl FnOnce(&mut dyn NextStages, &mut Vec<f32>) -> Result<(), StageLost>) -> Option<()> {
        match send(&mut *self.stages, &mut self.rows) {
            Ok(()) => Some(()),
            Err(e) => {
                self.lost = Some(e);
                None
            }
        }
    }
}

/// Rows `r` of `b`'s part: its positions from `r.start` on, and those of its rows
/// that get logits (its last ones).
fn rows_of<'b>(b: &SeqBatch<'b>, r: Range<usize>) -> SeqBatch<'b> {
    let n = b.tokens.len();
    let first_logit = n - b.logits.min(n);
    let logits = r.end.saturating_sub(first_logit.max(r.start));
    SeqBatch::plain(&b.tokens[r.clone()], b.start_pos + r.start, b.blocks, logits)
}

impl Next {
    /// Notes a stage lost outside a step (for the worker to end its requests, as a
    /// step's loss does); the error for the transfer that found it.
    fn lose(&mut self, e: StageLost) -> EngineError {
        self.lost = Some(e.clone());
        EngineError::Stage(e)
    }

    /// Makes the tier copies the stages owe, before anything reads or writes their
    /// blocks (a block just handed out may be what was evicted).
    fn copied(&mut self) -> Result<(), EngineError> {
        if self.copies.is_empty() {
            return Ok(());
        }
        let copies = std::mem::take(&mut self.copies);
        self.stages.tiers(self.slots, &copies).map_err(|e| self.lose(e))
    }

    /// Notes a copy the head made in its tiers, for the stages to make too.
    pub(crate) fn owe(&mut self, m: Move) {
        self.copies.push(m);
    }
}

impl Engine {
    /// Runs the layers after this engine's model (a first stage) through `stages`.
    pub fn with_next_stages(mut self, stages: Box<dyn NextStages>) -> Self {
        self.next = Some(Next::new(stages, self.tier_slots()));
        self
    }

    /// The loss of a stage the last step ran into, once; the sequences are still here,
    /// for the caller to end ([`Engine::cancel`]).
    pub fn take_stage_lost(&mut self) -> Option<StageLost> {
        self.next.as_mut()?.lost.take()
    }

    /// The steps through later stages, when this engine heads a group, with this
    /// engine's own compute first in [`StageTotals::compute`].
    pub fn stage_totals(&self) -> StageTotals {
        let Some(n) = self.next.as_ref() else { return StageTotals::default() };
        let mut t = n.stages.totals();
        if let Compute::Model(m) = &self.compute {
            let l = m.layers();
            t.compute.insert(0, StageCompute { first: l.first, last: l.last, seconds: n.head_s });
        }
        t
    }

    /// Whether this engine heads a stage group (its K/V past its own layers is its
    /// later stages').
    pub fn heads_group(&self) -> bool {
        self.next.is_some()
    }

    /// The loss of a stage the last step (or transfer) ran into, left for
    /// [`Engine::take_stage_lost`].
    pub(crate) fn stage_lost(&self) -> Option<&StageLost> {
        self.next.as_ref()?.lost.as_ref()
    }

    /// The model's layer count: past this engine's own where it heads a group.
    pub(crate) fn total_layers(&self) -> usize {
        match (&self.compute, &self.next) {
            (Compute::Model(m), Some(_)) => m.cfg.n_layers,
            _ => self.kv.n_layers,
        }
    }

    /// Sends the K/V of `blocks` in every later stage's layers through `on_frame`,
    /// layer by layer, after this engine's own: a prefill group's export. `Ok(false)`
    /// once `on_frame` refuses a frame.
    pub(crate) fn export_stages(
        &mut self,
        blocks: &[u32],
        on_frame: &mut dyn FnMut(KvFrame) -> bool,
    ) -> Result<bool, EngineError> {
        let (own, total) = (self.kv.n_layers, self.total_layers());
        // A call of its own: no lane may be in flight on the stages' connections.
        self.settle_lanes();
        let Some(next) = self.next.as_mut() else { return Ok(true) };
        next.copied()?;
        let sent = match next.parts.take() {
            Some(to) => next.stages.send_kv(blocks, &to).map_err(|e| next.lose(e))?,
            None => Vec::new(),
        };
        if sent.iter().any(|(_, s)| matches!(s, PartSent::Failed(_))) {
            return Ok(false);
        }
        let delivered = |l: usize| sent.iter().any(|(r, s)| *s == PartSent::Delivered && r.indices().contains(&l));
        for l in (own..total).filter(|&l| !delivered(l)) {
            let frames = next.stages.read_kv(l, blocks).map_err(|e| next.lose(e))?;
            if !frames.into_iter().all(&mut *on_frame) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Runs `f` with `to` as where a group's later stages send their layers of the
    /// export `f` makes themselves (see [`KvParts`]); on an engine heading no group,
    /// or where a stage cannot, the head sends them.
    pub fn with_kv_parts<T>(&mut self, to: Option<KvParts>, f: impl FnOnce(&mut Engine) -> T) -> T {
        if let Some(next) = self.next.as_mut() {
            next.parts = to;
        }
        let out = f(self);
        if let Some(next) = self.next.as_mut() {
            next.parts = None;
        }
        out
    }

    /// Writes `frames` (layers past this engine's own, each with its block) into the
    /// later stages that hold them: a decode group's import.
    pub(crate) fn import_stages(&mut self, frames: &[(u32, KvFrame)]) -> Result<(), EngineError> {
        let Some((_, f)) = frames.first() else { return Ok(()) };
        self.settle_lanes();
        let Some(next) = self.next.as_mut() else {
            return Err(EngineError::BadFrame(format!("layer {} of {}", f.layer, self.kv.n_layers)));
        };
        next.copied()?;
        next.stages.write_kv(frames).map_err(|e| next.lose(e))
    }

    /// Has the later stages that receive K/V themselves expect their layers of
    /// import `id` (after the reservation): the receivers the reservation names. The
    /// import then completes only once they hold them ([`Engine::finish_import`]).
    pub fn expect_stage_kv(&mut self, id: RequestId) -> Result<Vec<StageReceiver>, EngineError> {
        let at = self.importing.iter().position(|i| i.id == id).ok_or(EngineError::Unknown(id))?;
        if self.next.is_none() || self.importing[at].ids.is_empty() {
            return Ok(Vec::new());
        }
        self.settle_lanes();
        let Some(next) = self.next.as_mut() else { return Ok(Vec::new()) };
        // The stages write these blocks from now on: lower-tier copies go first.
        next.copied()?;
        let imp = &mut self.importing[at];
        let receivers = next.stages.expect_kv(id.0, &imp.ids).map_err(|e| next.lose(e))?;
        imp.direct = !receivers.is_empty();
        Ok(receivers)
    }

    /// Waits until the later stages hold their layers of import `id` (`forget`: has
    /// them give it up instead).
    pub(crate) fn settle_stage_kv(&mut self, id: RequestId, forget: bool) -> Result<(), EngineError> {
        self.settle_lanes();
        let Some(next) = self.next.as_mut() else { return Ok(()) };
        if forget {
            return next.stages.forget_kv(id.0).map_err(|e| next.lose(e));
        }
        match next.stages.await_kv(id.0) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(EngineError::BadFrame(format!("a later stage's K/V: {why}"))),
            Err(e) => Err(next.lose(e)),
        }
    }

    /// Whether the stages after this engine's own (if any) can all be reached.
    pub fn stages_ready(&mut self) -> bool {
        self.next.as_mut().is_none_or(|n| n.stages.ready())
    }

    /// Before a step through later stages: K/V they held may be gone if they were
    /// reached afresh, so nothing cached is matched any more.
    pub(crate) fn check_stages(&mut self) {
        let Some(next) = self.next.as_mut() else { return };
        if !next.stages.reconnected() {
            return;
        }
        // A stage that came back may have come back empty, its tiers too; a lane sent
        // before went on a connection that is gone.
        next.copies.clear();
        next.lanes.clear();
        self.running.iter_mut().for_each(|s| s.in_lane = false);
        self.blocks.clear_cache();
        self.blocks.forget_lower_all();
    }
}

/// One sequence's part of a step, as a later stage sees it: how many rows, from which
/// position, in which blocks, and how many of its last rows get logits. No tokens: a
/// later stage starts from the residual stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePart {
    pub rows: usize,
    pub start_pos: usize,
    pub logits: usize,
    pub blocks: Vec<u32>,
}

/// The parts of a step's batch.
pub fn parts_of(batch: &[SeqBatch<'_>]) -> Vec<StagePart> {
    let part = |b: &SeqBatch<'_>| StagePart {
        rows: b.tokens.len(),
        start_pos: b.start_pos,
        logits: returned_rows(b),
        blocks: b.blocks.to_vec(),
    };
    batch.iter().map(part).collect()
}

/// A later stage: its part of the model, the K/V of its layers (as many blocks as the
/// head's pool, under the head's block ids) and its threads.
pub struct StageRunner {
    model: Arc<Model>,
    kv: KvStorage,
    /// Its lower tiers, of its layers, once its head copies blocks there (with
    /// their slots), and where a disk tier's file goes.
    tiers: Option<(TierSlots, TierBytes)>,
    disk_dir: std::path::PathBuf,
    scratch: ForwardScratch,
    pool: ThreadPool,
    isa: Isa,
    /// Rows a step may have at most (the head's batch budget).
    max_rows: usize,
    /// The last stage's rows that get logits.
    last: Vec<f32>,
    zeros: Vec<u32>,
}

/// What a later stage's step yields.
pub enum StageRows<'a> {
    /// The residual stream for the next stage, every row.
    Hidden(&'a [f32]),
    /// The final residual rows that get logits on the head (the last stage's).
    Last(&'a [f32]),
}

impl StageRunner {
    pub fn new(model: Arc<Model>, num_blocks: usize, kv_dtype: KvDtype, threads: usize, max_rows: usize) -> Self {
        let kv = model.kv_storage(num_blocks, BLOCK_SIZE, kv_dtype);
        let (pool, isa) = (ThreadPool::new(threads), Isa::detect());
        // A directory of its own (the disk tier refuses one others can write).
        let disk_dir = std::env::temp_dir().join(format!("pdserve-stage-{}", std::process::id()));
        let (last, zeros, tiers) = (Vec::new(), Vec::new(), None);
        StageRunner { model, kv, tiers, disk_dir, scratch: ForwardScratch::default(), pool, isa, max_rows, last, zeros }
    }

    /// Makes the head's tier copies in this stage's layers, in order (see
    /// [`NextStages::tiers`]); checked whole before any is made. The tiers are made
    /// at the first copies, with the head's slots.
    pub fn copy_tiers(&mut self, slots: TierSlots, copies: &[Move]) -> Result<(), String> {
        if self.tiers.as_ref().is_none_or(|(s, _)| *s != slots) {
            let (host_blocks, disk_blocks) = slots;
            let cfg = TierConfig { host_blocks, disk_blocks, disk_dir: Some(self.disk_dir.clone()) };
            self.tiers = Some((slots, TierBytes::new(&self.kv, &cfg).map_err(|e| e.to_string())?));
        }
        let blocks = self.kv.num_blocks;
        let fits = |p: &Place| match *p {
            Place::Device(b) => (b.0 as usize) < blocks,
            Place::Host(s) => (s as usize) < slots.0,
            Place::Disk(s) => (s as usize) < slots.1,
        };
        // Down a tier (pool to host or disk, host to disk) or back into the pool.
        let way = |m: &Move| match (m.from, m.to) {
            (Place::Device(_), Place::Host(_) | Place::Disk(_)) | (Place::Host(_), Place::Disk(_)) => Some(false),
            (Place::Host(_) | Place::Disk(_), Place::Device(_)) => Some(true),
            _ => None,
        };
        if let Some(m) = copies.iter().find(|m| !fits(&m.from) || !fits(&m.to) || way(m).is_none()) {
            return Err(format!(
                "a tier copy from {:?} to {:?} with {blocks} blocks and slots {slots:?}",
                m.from, m.to
            ));
        }
        let Some((_, tiers)) = self.tiers.as_mut() else { return Ok(()) };
        for m in copies {
            match (m.to, way(m) == Some(true)) {
                (Place::Device(b), true) if !tiers.restore(m.from, &mut self.kv, b.0) => {
                    return Err(format!("cannot read back the block at {:?}", m.from));
                }
                (_, true) => {}
                (_, false) => tiers.apply(*m, &self.kv),
            }
        }
        Ok(())
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Runs one step of the head's from `x`. A step that does not fit this stage (a
    /// block it lacks, a position past the context, rows that are not the step's) is
    /// refused whole, before any K/V is written.
    pub fn run(&mut self, parts: &[StagePart], x: &[f32]) -> Result<StageRows<'_>, String> {
        let rows = self.check(parts, x.len())?;
        // Stand-in tokens: only their count is read past the first stage.
        self.zeros.resize(self.zeros.len().max(rows), 0);
        let zeros = &self.zeros;
        let batch: Vec<SeqBatch<'_>> =
            parts.iter().map(|p| SeqBatch::plain(&zeros[..p.rows], p.start_pos, &p.blocks, p.logits)).collect();
        let (s, h) = (&mut self.scratch, self.model.cfg.hidden);
        let x = match self.model.forward_stage(self.isa, &self.pool, &batch, x, &mut self.kv, s, &mut |_, _| true) {
            Some(StageOut::Hidden(x)) => &x[..rows * h],
            _ => return Err("this stage holds the output head: it is a group's first".into()),
        };
        let m = &self.model;
        if !m.layers().heads(m.cfg.n_layers) {
            return Ok(StageRows::Hidden(x));
        }
        self.last.clear();
        logit_rows(parts.iter().map(|p| (p.rows, p.logits)), x, h).for_each(|r| self.last.extend_from_slice(r));
        Ok(StageRows::Last(&self.last))
    }

    /// Layer `layer` (the model's numbering)'s K/V of `blocks`, as frames indexed from 0.
    pub fn read_kv(&self, layer: usize, blocks: &[u32]) -> Result<Vec<KvFrame>, String> {
        let l = self.local(layer)?;
        let (kv, layer) = (&self.kv, layer as u32);
        let frame = |(index, &b): (usize, &u32)| {
            let (k, v) = kv.block(l, self.block(b)?);
            Ok(KvFrame { layer, index: index as u32, dtype: kv.dtype, k: k.to_vec(), v: v.to_vec() })
        };
        blocks.iter().enumerate().map(frame).collect()
    }

    /// Writes frame `f` (its layer in the model's numbering) into block `block`.
    pub fn write_kv(&mut self, block: u32, f: &KvFrame) -> Result<(), String> {
        let (l, b) = (self.local(f.layer as usize)?, self.block(block)?);
        write_frame(&mut self.kv, l, b, f)
    }

    /// This stage's index of the model's layer `layer`.
    fn local(&self, layer: usize) -> Result<usize, String> {
        let r = self.model.layers();
        match r.indices().contains(&layer) {
            true => Ok(layer - r.first),
            false => Err(format!("layer {layer} is not this stage's ({r})")),
        }
    }

    fn block(&self, b: u32) -> Result<u32, String> {
        match (b as usize) < self.kv.num_blocks {
            true => Ok(b),
            false => Err(format!("block {b} of a pool of {}", self.kv.num_blocks)),
        }
    }

    /// The step's rows, when `parts` and `x_len` values of input fit this stage.
    fn check(&self, parts: &[StagePart], x_len: usize) -> Result<usize, String> {
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        if rows == 0 || rows > self.max_rows {
            return Err(format!("a step of {rows} rows (this stage takes 1 to {})", self.max_rows));
        }
        if x_len != rows * self.model.cfg.hidden {
            return Err(format!("{x_len} values of residual stream for {rows} rows of {}", self.model.cfg.hidden));
        }
        let context = self.model.cfg.context_length;
        for p in parts {
            let end = p.start_pos + p.rows;
            if p.rows == 0 || end > context || end > p.blocks.len() * BLOCK_SIZE || p.logits > p.rows {
                return Err(format!(
                    "a part of {} rows from position {} in {} blocks",
                    p.rows,
                    p.start_pos,
                    p.blocks.len()
                ));
            }
            if let Some(b) = p.blocks.iter().find(|&&b| b as usize >= self.kv.num_blocks) {
                return Err(format!("block {b} of a pool of {}", self.kv.num_blocks));
            }
        }
        Ok(rows)
    }
}

/// Later stages in this process, one after the other (tests, and measuring what a
/// split costs without a network). Micro-batches go through when the step ends, one
/// after the other: in one thread nothing overlaps, but the head's side of pipelining
/// is the same.
pub struct LocalStages {
    stages: Vec<StageRunner>,
    fresh: bool,
    /// Each stage's passes, and the micro-batches started and not yet finished.
    times: Vec<PassTimes>,
    started: Vec<(Vec<StagePart>, Vec<f32>)>,
    totals: StageTotals,
}

impl LocalStages {
    pub fn new(stages: Vec<StageRunner>) -> Self {
        let times = vec![PassTimes::default(); stages.len()];
        LocalStages { stages, fresh: true, times, started: Vec::new(), totals: StageTotals::default() }
    }

    fn holding(&mut self, layer: usize) -> Result<&mut StageRunner, StageLost> {
        let holds = |s: &&mut StageRunner| s.model.layers().indices().contains(&layer);
        self.stages.iter_mut().find(holds).ok_or_else(|| StageLost(format!("no stage holds layer {layer}")))
    }
}

impl LocalStages {
    /// `parts` through every stage, the last one's rows into `rows`.
    fn pass(&mut self, parts: &[StagePart], x: &[f32], rows: &mut Vec<f32>) -> Result<(), StageLost> {
        let mut input = x.to_vec();
        let n: usize = parts.iter().map(|p| p.rows).sum();
        self.totals.rows += n as u64;
        for (stage, times) in self.stages.iter_mut().zip(&mut self.times) {
            let started = Instant::now();
            let out = stage.run(parts, &input).map_err(StageLost)?;
            times.record(n, started.elapsed().as_secs_f64());
            match out {
                StageRows::Hidden(h) => input = h.to_vec(),
                StageRows::Last(l) => {
                    rows.clear();
                    rows.extend_from_slice(l);
                    return Ok(());
                }
            }
        }
        Err(StageLost("no stage holds the model's last layer".into()))
    }
}

impl NextStages for LocalStages {
    fn run(&mut self, parts: &[StagePart], x: &[f32], rows: &mut Vec<f32>) -> Result<(), StageLost> {
        self.totals.steps += 1;
        self.pass(parts, x, rows)
    }

    fn reconnected(&mut self) -> bool {
        std::mem::take(&mut self.fresh)
    }

    fn totals(&self) -> StageTotals {
        self.totals.clone()
    }

    /// No hop in one process.
    fn costs(&self) -> StageCosts {
        StageCosts { passes: self.times.iter().map(PassTimes::cost).collect(), hop: Some(PassCost::default()) }
    }

    fn start(&mut self, parts: &[StagePart], x: &[f32]) -> Result<(), StageLost> {
        self.started.push((parts.to_vec(), x.to_vec()));
        Ok(())
    }

    fn finish(&mut self, rows: &mut Vec<f32>) -> Result<(), StageLost> {
        let (mut all, mut one) = (Vec::new(), Vec::new());
        let started = std::mem::take(&mut self.started);
        if started.is_empty() {
            return Ok(());
        }
        for (parts, x) in &started {
            self.pass(parts, x, &mut one)?;
            all.extend_from_slice(&one);
        }
        self.totals.steps += 1;
        self.totals.pipelined += 1;
        *rows = all;
        Ok(())
    }

    fn finish_first(&mut self, rows: &mut Vec<f32>) -> Result<(), StageLost> {
        if self.started.is_empty() {
            return Err(StageLost("no lane in flight".into()));
        }
        let (parts, x) = self.started.remove(0);
        self.totals.steps += 1;
        self.totals.lanes += 1;
        self.pass(&parts, &x, rows)
    }

    fn read_kv(&mut self, layer: usize, blocks: &[u32]) -> Result<Vec<KvFrame>, StageLost> {
        self.holding(layer)?.read_kv(layer, blocks).map_err(StageLost)
    }

    fn write_kv(&mut self, frames: &[(u32, KvFrame)]) -> Result<(), StageLost> {
        frames.iter().try_for_each(|(b, f)| self.holding(f.layer as usize)?.write_kv(*b, f).map_err(StageLost))
    }

    fn tiers(&mut self, slots: TierSlots, copies: &[Move]) -> Result<(), StageLost> {
        self.stages.iter_mut().try_for_each(|s| s.copy_tiers(slots, copies).map_err(StageLost))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Later stages whose passes cost what they are told.
    struct Costing(Vec<PassCost>);

    impl NextStages for Costing {
        fn run(&mut self, _: &[StagePart], _: &[f32], _: &mut Vec<f32>) -> Result<(), StageLost> {
            Ok(())
        }

        fn reconnected(&mut self) -> bool {
            false
        }

        fn costs(&self) -> StageCosts {
            StageCosts { passes: self.0.iter().copied().map(Some).collect(), hop: Some(PassCost::default()) }
        }

        fn read_kv(&mut self, _: usize, _: &[u32]) -> Result<Vec<KvFrame>, StageLost> {
            Ok(Vec::new())
        }

        fn write_kv(&mut self, _: &[(u32, KvFrame)]) -> Result<(), StageLost> {
            Ok(())
        }
    }

    #[test]
    fn a_heads_lanes_count_its_output_head_once_a_lane() {
        let even = PassCost { fixed: 0.002, per_row: 0.0005 };
        let mut n = Next::new(Box::new(Costing(vec![even, even])), (0, 0));
        // Its own layers cost what each later stage's do: a lane a stage.
        for r in [2, 6] {
            n.own.record(r, even.fixed + even.per_row * r as f64);
        }
        assert_eq!(n.lanes_for(6), Some(3));
        // Its output head, run once a lane, makes it the busiest: two lanes.
        for r in [2, 6] {
            n.head.record(r, 0.0025 + 0.0004 * r as f64);
        }
        assert_eq!(n.lanes_for(6), Some(2));
    }
}
