//! A model cut into pipeline stages computes what the whole model does, bit for bit:
//! each stage loads only its layers (the first also the embeddings and the output
//! head), the residual stream goes from one stage's pass to the next one's and the last
//! one's rows back to the first for their logits, and each stage keeps the K/V of its
//! own layers. Checked on the real default model (SmolLM2, 30 layers) and
//! Gemma 3 270M (18 layers, a global layer every sixth, so a cut can fall either side of
//! one), prefilled in chunks and then decoded greedily. An engine whose model is the
//! first stage and whose later stages run behind [`NextStages`] serves requests as an
//! engine with the whole model does, token for token, and a lost stage ends its step
//! without advancing anything; its prompt scores and embeddings are the whole
//! engine's too (the last stage returns every prompt row of a part that asks for
//! them). A group hands a prompt's K/V to another engine (a whole
//! one or a group cut elsewhere) as one engine does: every layer's frames, from the
//! stage that computed them to the stage that holds them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{
    Engine, EngineConfig, EngineError, LocalStages, NextStages, PassCost, StageCosts, StageLost, StagePart,
    StageRunner, StepOutput, TierSlots,
};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::format::gguf::GgufFile;
use pdserve_engine::kernels::Isa;
use pdserve_engine::kvcache::KvStorage;
use pdserve_engine::model::{logit_rows, step_bytes, ForwardScratch, LayerRange, Model, SeqBatch, StageOut};
use pdserve_engine::threadpool::ThreadPool;
use pdserve_engine::tiers::TierConfig;
use pdserve_kv::Move;
use pdserve_types::{KvDtype, KvFrame, StageTotals};
use pdserve_types::{Pooling, RequestId, SamplingParams, TokenOut};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const DECODE: usize = 8;

struct Stage {
    model: Model,
    kv: KvStorage,
    scratch: ForwardScratch,
}

fn stages(name: &str, cuts: &[(usize, usize)], n_blocks: usize) -> Vec<Stage> {
    let file = GgufFile::open(&pdserve_engine::models::require_known_model(name)).unwrap();
    let cfg = ModelConfig::from_gguf(&file.header).unwrap();
    cuts.iter()
        .map(|&(first, last)| {
            let model = Model::load_stage(&file, cfg.clone(), LayerRange { first, last }).unwrap();
            let kv = model.kv_storage(n_blocks, 16, KvDtype::F16);
            Stage { model, kv, scratch: ForwardScratch::default() }
        })
        .collect()
}

/// Every logits row of a chunked prefill and a greedy decode, through `stages` in turn
/// (the last one's final rows back to the first, which holds the output head).
fn run(stages: &mut [Stage], prompt: &[u32], chunk: usize, blocks: &[u32]) -> Vec<Vec<f32>> {
    let pool = ThreadPool::new(1);
    let isa = Isa::detect();
    let h = stages[0].model.cfg.hidden;
    let (mut tokens, mut pos, mut out) = (prompt.to_vec(), 0, Vec::new());
    while out.len() < DECODE + prompt.len().div_ceil(chunk) {
        let n = if pos < prompt.len() { chunk.min(prompt.len() - pos) } else { 1 };
        let batch = [SeqBatch::plain(&tokens[pos..pos + n], pos, blocks, 1)];
        let mut x = Vec::new();
        let mut logits = None;
        for st in stages.iter_mut() {
            match st.model.forward_stage(isa, &pool, &batch, &x, &mut st.kv, &mut st.scratch, &mut |_, _| true) {
                Some(StageOut::Hidden(rows)) => x = rows.to_vec(),
                Some(StageOut::Logits(l)) => logits = Some(l.to_vec()),
                None => panic!("a stage stopped"),
            }
        }
        let logits = logits.unwrap_or_else(|| {
            let last: Vec<f32> = logit_rows([(n, 1)], &x, h).flatten().copied().collect();
            let first = &mut stages[0];
            first
                .model
                .head_logits(isa, &pool, &batch, &last, &mut first.scratch)
                .expect("the first stage has the head")
                .to_vec()
        });
        if pos + n >= prompt.len() {
            tokens.push(argmax(&logits));
        }
        out.push(logits);
        pos += n;
    }
    out
}

fn check(name: &str, total: usize, splits: &[&[(usize, usize)]], prompt: &[u32]) {
    let n_blocks = (prompt.len() + DECODE).div_ceil(16);
    let blocks: Vec<u32> = (0..n_blocks as u32).rev().collect();
    let mut whole = stages(name, &[(0, total - 1)], n_blocks);
    let expected = run(&mut whole, prompt, 7, &blocks);
    let whole_bytes = whole[0].model.weight_bytes();
    for split in splits {
        let mut parts = stages(name, split, n_blocks);
        let got = run(&mut parts, prompt, 7, &blocks);
        assert_eq!(got.len(), expected.len());
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert!(g == e, "{name} {split:?}: logits row {i} differs");
        }
        let held: usize = parts.iter().map(|p| p.model.weight_bytes()).sum();
        assert_eq!(held, whole_bytes, "{name} {split:?}: the stages together hold more than the model");
        assert!(parts.iter().all(|p| p.model.weight_bytes() < whole_bytes));
    }
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 1 + (i * 7919) % 4000).collect()
}

#[test]
fn smollm2_in_two_and_three_stages_computes_the_whole_models_logits() {
    check("smollm2-135m", 30, &[&[(0, 14), (15, 29)], &[(0, 0), (1, 20), (21, 29)]], &prompt(40));
}

#[test]
fn gemma3_stages_cut_either_side_of_a_global_layer() {
    check("gemma3-270m", 18, &[&[(0, 5), (6, 17)], &[(0, 4), (5, 11), (12, 17)]], &prompt(33));
}

/// What `pdserve split` keeps on every node for a step's working buffers
/// ([`step_bytes`]) covers what the stages' buffers take after a chunked prefill and
/// some decodes, and is within a tenth of what they take (the head also
/// holds a final row and its logits for the one row given logits).
#[test]
fn a_steps_buffers_take_what_split_keeps_for_them() {
    let chunk = 64;
    for (name, cuts) in [("smollm2-135m", &[(0, 9), (10, 19), (20, 29)]), ("gemma3-270m", &[(0, 5), (6, 11), (12, 17)])]
    {
        let mut parts = stages(name, cuts, 16);
        let blocks: Vec<u32> = (0..16).collect();
        run(&mut parts, &prompt(150), chunk, &blocks);
        for (i, p) in parts.iter().enumerate() {
            let cfg = &p.model.cfg;
            let logits = if i == 0 { 4 * (cfg.vocab_size + cfg.hidden) } else { 0 };
            let (took, kept) = (p.scratch.bytes(), step_bytes(cfg, chunk) + logits);
            assert!(took <= kept, "{name} stage {i}: a step took {took} bytes, split keeps {kept}");
            assert!(10 * kept <= 11 * took, "{name} stage {i}: split keeps {kept} bytes for {took}");
        }
    }
}

#[test]
fn a_stage_past_the_models_last_layer_is_refused() {
    let file = GgufFile::open(&pdserve_engine::models::require_known_model("smollm2-135m")).unwrap();
    let cfg = ModelConfig::from_gguf(&file.header).unwrap();
    let err = Model::load_stage(&file, cfg, LayerRange { first: 20, last: 30 }).err().unwrap();
    assert!(err.to_string().contains("past the model's last layer, 29"), "{err}");
}

fn argmax(row: &[f32]) -> u32 {
    (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a))).unwrap() as u32
}

const BLOCKS: usize = 64;

fn engine_cfg() -> EngineConfig {
    EngineConfig { threads: 1, num_blocks: BLOCKS, max_batch_tokens: 64, max_seqs: 8, ..Default::default() }
}

fn loaded(cuts: &[(usize, usize)]) -> Vec<Arc<Model>> {
    let file = GgufFile::open(&pdserve_engine::models::require_known_model("smollm2-135m")).unwrap();
    let cfg = ModelConfig::from_gguf(&file.header).unwrap();
    cuts.iter()
        .map(|&(first, last)| Arc::new(Model::load_stage(&file, cfg.clone(), LayerRange { first, last }).unwrap()))
        .collect()
}

/// A head engine over `cuts`, its later stages in this process behind `wrap`.
fn head_engine(cuts: &[(usize, usize)], wrap: impl FnOnce(LocalStages) -> Box<dyn NextStages>) -> Engine {
    head_engine_in(cuts, engine_cfg(), wrap)
}

/// [`head_engine`] configured as `cfg` says.
fn head_engine_in(
    cuts: &[(usize, usize)],
    cfg: EngineConfig,
    wrap: impl FnOnce(LocalStages) -> Box<dyn NextStages>,
) -> Engine {
    let mut models = loaded(cuts).into_iter();
    let head = models.next().unwrap();
    let rest = models.map(|m| StageRunner::new(m, cfg.num_blocks, KvDtype::F16, 1, 64)).collect();
    Engine::new(head, cfg, vec![]).with_next_stages(wrap(LocalStages::new(rest)))
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, logprobs: true, top_logprobs: 2, ..Default::default() }
        .validate()
        .unwrap()
}

/// Adds four prompts (two sharing a long prefix) and steps until idle.
fn serve(e: &mut Engine) -> BTreeMap<u64, Vec<StepOutput>> {
    let shared = prompt(37);
    let mut prompts = vec![shared.clone(), prompt(5), prompt(50)];
    prompts.push([shared, vec![11, 12, 13]].concat());
    serve_all(e, prompts)
}

/// Adds `prompts` and steps until idle.
fn serve_all(e: &mut Engine, prompts: Vec<Vec<u32>>) -> BTreeMap<u64, Vec<StepOutput>> {
    for (i, p) in prompts.into_iter().enumerate() {
        e.add(RequestId(i as u64), p, greedy(12)).unwrap();
    }
    let mut out: BTreeMap<u64, Vec<StepOutput>> = BTreeMap::new();
    for _ in 0..10_000 {
        if !e.has_work() {
            break;
        }
        for o in e.step() {
            out.entry(o.id.0).or_default().push(o);
        }
        assert_eq!(e.take_stage_lost(), None);
    }
    assert!(!e.has_work(), "the engine does not make progress");
    assert_eq!(e.stats().blocks.used, 0);
    out
}

fn sampled(outs: &BTreeMap<u64, Vec<StepOutput>>) -> BTreeMap<u64, Vec<TokenOut>> {
    outs.iter().map(|(id, o)| (*id, o.iter().map(|o| o.sampled.clone()).collect())).collect()
}

#[test]
fn a_head_engine_with_its_later_stages_serves_what_a_whole_engine_does() {
    let whole = sampled(&serve(&mut Engine::new(loaded(&[(0, 29)]).remove(0), engine_cfg(), vec![])));
    assert!(whole.values().all(|t| t.len() == 12));
    for cuts in [&[(0, 14), (15, 29)][..], &[(0, 3), (4, 20), (21, 29)]] {
        let mut e = head_engine(cuts, |s| Box::new(s));
        let outs = serve(&mut e);
        assert_eq!(sampled(&outs), whole, "{cuts:?}");
        // The fourth prompt found the first one's blocks cached, on every stage.
        assert_eq!(outs[&3][0].cached_tokens, 32, "{cuts:?}");
    }
}

/// Later stages said to cost a second a row and nothing fixed, so a step of more
/// than one row always goes through in micro-batches, and decodes go in lanes (the
/// head's own passes cost more for more rows): the head's side of pipelining, in one
/// thread. As over a stage connection, no other call may go while micro-batches
/// (the second field counts them) are in flight; the third keeps the most that were
/// when a lane landed.
struct Pipelining(LocalStages, usize, Arc<AtomicUsize>);

impl Pipelining {
    fn new(s: LocalStages) -> Pipelining {
        Pipelining(s, 0, Arc::default())
    }

    fn clear(&self) -> Result<(), StageLost> {
        match self.1 {
            0 => Ok(()),
            n => Err(StageLost(format!("a call with {n} in flight"))),
        }
    }
}

impl NextStages for Pipelining {
    fn run(&mut self, parts: &[StagePart], x: &[f32], rows: &mut Vec<f32>) -> Result<(), StageLost> {
        self.clear()?;
        self.0.run(parts, x, rows)
    }

    fn reconnected(&mut self) -> bool {
        self.0.reconnected()
    }

    fn totals(&self) -> StageTotals {
        self.0.totals()
    }

    fn costs(&self) -> StageCosts {
        let per_row = Some(PassCost { fixed: 0.0, per_row: 1.0 });
        StageCosts { passes: self.0.costs().passes.iter().map(|_| per_row).collect(), hop: Some(PassCost::default()) }
    }

    fn start(&mut self, parts: &[StagePart], x: &[f32]) -> Result<(), StageLost> {
        self.1 += 1;
        self.0.start(parts, x)
    }

    fn finish(&mut self, rows: &mut Vec<f32>) -> Result<(), StageLost> {
        self.1 = 0;
        self.0.finish(rows)
    }

    fn finish_first(&mut self, rows: &mut Vec<f32>) -> Result<(), StageLost> {
        self.2.fetch_max(self.1, Ordering::Relaxed);
        self.1 = self.1.saturating_sub(1);
        self.0.finish_first(rows)
    }

    fn read_kv(&mut self, layer: usize, blocks: &[u32]) -> Result<Vec<KvFrame>, StageLost> {
        self.clear()?;
        self.0.read_kv(layer, blocks)
    }

    fn write_kv(&mut self, frames: &[(u32, KvFrame)]) -> Result<(), StageLost> {
        self.clear()?;
        self.0.write_kv(frames)
    }
}

#[test]
fn a_head_engine_in_micro_batches_serves_what_a_whole_engine_does() {
    let whole = sampled(&serve(&mut Engine::new(loaded(&[(0, 29)]).remove(0), engine_cfg(), vec![])));
    for cuts in [&[(0, 14), (15, 29)][..], &[(0, 3), (4, 20), (21, 29)]] {
        let mut e = head_engine(cuts, |s| Box::new(Pipelining::new(s)));
        assert_eq!(sampled(&serve(&mut e)), whole, "{cuts:?}");
        // Again, the head's passes timed at two sizes by now: every step of more than
        // one row's prompt goes in micro-batches (the decodes go in lanes).
        let before = e.stage_totals();
        assert_eq!(sampled(&serve(&mut e)), whole, "{cuts:?}, again");
        let t = e.stage_totals();
        assert!(
            t.pipelined > before.pipelined && t.pipelined - before.pipelined < t.steps - before.steps,
            "{cuts:?}: {t:?}"
        );
    }
}

#[test]
fn a_head_engine_decodes_in_lanes_what_a_whole_engine_does() {
    // Six sequences: three lanes of two through three stages.
    let shared = prompt(37);
    let mut prompts = vec![shared.clone(), prompt(5), prompt(50), [shared, vec![11, 12, 13]].concat()];
    prompts.extend([vec![7; 9], vec![8; 13]]);
    let whole =
        sampled(&serve_all(&mut Engine::new(loaded(&[(0, 29)]).remove(0), engine_cfg(), vec![]), prompts.clone()));
    for cuts in [&[(0, 14), (15, 29)][..], &[(0, 3), (4, 20), (21, 29)]] {
        let most = Arc::new(AtomicUsize::new(0));
        let mut e = head_engine(cuts, |s| Box::new(Pipelining(s, 0, most.clone())));
        assert_eq!(sampled(&serve_all(&mut e, prompts.clone())), whole, "{cuts:?}");
        let t = e.stage_totals();
        assert!(t.lanes > 11, "the decodes went in lanes: {t:?}");
        // A lane a stage: the head computes one while each later stage holds another.
        assert_eq!(most.load(Ordering::Relaxed), cuts.len(), "{cuts:?}: lanes in flight at once");
        // Each row once: the prompts less the 32 tokens the third and fourth found
        // cached (the first's), 11 decodes each.
        assert_eq!(t.rows, 37 + 5 + (50 - 32) + (40 - 32) + 9 + 13 + 6 * 11, "no row in flight went again");
    }
}

/// [`Pipelining`] whose connections are lost and made again once between two steps,
/// after `after` lanes landed and while others fly: what was in flight is gone
/// (computed, as a stage may have done before it went, and never answered), and the
/// stages say they were reached afresh. Their K/V stays, so the head's sequences can
/// go on from where they were.
struct Reconnecting {
    inner: Pipelining,
    after: u64,
    done: bool,
}

impl NextStages for Reconnecting {
    fn run(&mut self, parts: &[StagePart], x: &[f32], rows: &mut Vec<f32>) -> Result<(), StageLost> {
        self.inner.run(parts, x, rows)
    }

    /// Asked once at the start of every step.
    fn reconnected(&mut self) -> bool {
        if !self.done && self.inner.1 > 0 && self.inner.totals().lanes >= self.after {
            self.done = true;
            let _ = self.inner.finish(&mut Vec::new());
            return true;
        }
        self.inner.reconnected()
    }

    fn totals(&self) -> StageTotals {
        self.inner.totals()
    }

    fn costs(&self) -> StageCosts {
        self.inner.costs()
    }

    fn start(&mut self, parts: &[StagePart], x: &[f32]) -> Result<(), StageLost> {
        self.inner.start(parts, x)
    }

    fn finish(&mut self, rows: &mut Vec<f32>) -> Result<(), StageLost> {
        self.inner.finish(rows)
    }

    fn finish_first(&mut self, rows: &mut Vec<f32>) -> Result<(), StageLost> {
        self.inner.finish_first(rows)
    }

    fn read_kv(&mut self, layer: usize, blocks: &[u32]) -> Result<Vec<KvFrame>, StageLost> {
        self.inner.read_kv(layer, blocks)
    }

    fn write_kv(&mut self, frames: &[(u32, KvFrame)]) -> Result<(), StageLost> {
        self.inner.write_kv(frames)
    }
}

#[test]
fn lanes_sent_before_the_stages_were_reached_afresh_are_sent_again() {
    let whole = sampled(&serve(&mut Engine::new(loaded(&[(0, 29)]).remove(0), engine_cfg(), vec![])));
    let mut e = head_engine(&[(0, 14), (15, 29)], |s| {
        Box::new(Reconnecting { inner: Pipelining::new(s), after: 4, done: false })
    });
    assert_eq!(sampled(&serve(&mut e)), whole);
    assert!(e.stage_totals().lanes > 11, "the decodes went in lanes: {:?}", e.stage_totals());
}

#[test]
fn a_request_cancelled_while_its_lane_is_in_flight_leaves_the_others_whole() {
    let prompts = vec![prompt(37), prompt(5), prompt(50), prompt(20)];
    let whole =
        sampled(&serve_all(&mut Engine::new(loaded(&[(0, 29)]).remove(0), engine_cfg(), vec![]), prompts.clone()));
    let mut e = head_engine(&[(0, 14), (15, 29)], |s| Box::new(Pipelining::new(s)));
    for (i, p) in prompts.into_iter().enumerate() {
        e.add(RequestId(i as u64), p, greedy(12)).unwrap();
    }
    let mut out: BTreeMap<u64, Vec<TokenOut>> = BTreeMap::new();
    let mut cancelled = None;
    for _ in 0..10_000 {
        if !e.has_work() {
            break;
        }
        let lanes = e.stage_totals().lanes;
        let step = e.step();
        let landed: Vec<u64> = step.iter().map(|o| o.id.0).collect();
        step.into_iter().for_each(|o| out.entry(o.id.0).or_default().push(o.sampled));
        // After a lane landed, the running requests that sampled nothing are in flight.
        if cancelled.is_none() && lanes > 0 && e.stage_totals().lanes > lanes {
            let flying = (0..4).find(|id| !landed.contains(id) && out.get(id).is_some_and(|t| t.len() < 12));
            if let Some(id) = flying {
                assert!(e.cancel(RequestId(id)));
                cancelled = Some(id);
            }
        }
        assert_eq!(e.take_stage_lost(), None);
    }
    assert!(!e.has_work(), "the engine does not make progress");
    let cancelled = cancelled.expect("a request was in flight in a lane");
    assert_eq!(e.stats().blocks.used, 0);
    for (id, tokens) in &out {
        match *id == cancelled {
            true => assert_eq!(tokens[..], whole[id][..tokens.len()], "the cancelled request's tokens so far"),
            false => assert_eq!(tokens, &whole[id], "request {id}"),
        }
    }
}

/// Six requests of different lengths: two at once, then one every third step, each
/// one's tokens by id.
fn staggered(e: &mut Engine) -> BTreeMap<u64, Vec<TokenOut>> {
    let asks: Vec<(Vec<u32>, u32)> =
        [(30, 3), (20, 12), (45, 5), (25, 9), (40, 2), (35, 7)].map(|(n, max)| (prompt(n), max)).into();
    let mut out: BTreeMap<u64, Vec<TokenOut>> = BTreeMap::new();
    let mut next = 0;
    for step in 0..10_000 {
        if next < asks.len() && (next < 2 || step % 3 == 0) {
            let (p, max) = asks[next].clone();
            e.add(RequestId(next as u64), p, greedy(max)).unwrap();
            next += 1;
        }
        if next == asks.len() && !e.has_work() {
            break;
        }
        e.step().into_iter().for_each(|o| out.entry(o.id.0).or_default().push(o.sampled));
        assert_eq!(e.take_stage_lost(), None);
    }
    assert_eq!(e.stats().blocks.used, 0);
    out
}

#[test]
fn requests_that_come_and_end_while_lanes_fly_get_a_whole_engines_tokens() {
    let whole = staggered(&mut Engine::new(loaded(&[(0, 29)]).remove(0), engine_cfg(), vec![]));
    for cuts in [&[(0, 14), (15, 29)][..], &[(0, 3), (4, 20), (21, 29)]] {
        let mut e = head_engine(cuts, |s| Box::new(Pipelining::new(s)));
        assert_eq!(staggered(&mut e), whole, "{cuts:?}");
        assert!(e.stage_totals().lanes > 0, "{cuts:?}");
    }
}

#[test]
fn a_pool_that_runs_out_preempts_no_sequence_whose_lane_is_in_flight() {
    // 14 blocks of 16 for four prompts of 40 to 48 tokens that grow by 12 each: the
    // decodes run out of blocks and preempt one another, lanes in flight.
    let distinct = |i: u32| prompt(40 + 3 * i as usize).into_iter().map(|t| t + 4000 * i).collect();
    let prompts: Vec<Vec<u32>> = (0..4).map(distinct).collect();
    let whole =
        sampled(&serve_all(&mut Engine::new(loaded(&[(0, 29)]).remove(0), engine_cfg(), vec![]), prompts.clone()));
    let cfg = EngineConfig { num_blocks: 14, ..engine_cfg() };
    let mut e = head_engine_in(&[(0, 14), (15, 29)], cfg, |s| Box::new(Pipelining::new(s)));
    for (i, p) in prompts.into_iter().enumerate() {
        e.add(RequestId(i as u64), p, greedy(12)).unwrap();
    }
    let (mut out, mut preempted): (BTreeMap<u64, Vec<TokenOut>>, usize) = (BTreeMap::new(), 0);
    for _ in 0..10_000 {
        if !e.has_work() {
            break;
        }
        // The queue grows only when a running sequence is preempted.
        let waiting = e.stats().waiting;
        e.step().into_iter().for_each(|o| out.entry(o.id.0).or_default().push(o.sampled));
        preempted += usize::from(e.stats().waiting > waiting);
        assert_eq!(e.take_stage_lost(), None);
    }
    assert_eq!(out, whole);
    assert_eq!(e.stats().blocks.used, 0);
    assert!(preempted > 0 && e.stage_totals().lanes > 0, "{preempted} preemptions, {:?}", e.stage_totals());
}

/// Later stages that fail the step after `ok` good ones, then come back.
struct Flaky {
    inner: LocalStages,
    ok: usize,
    failed: bool,
    down: bool,
}

impl NextStages for Flaky {
    fn run(&mut self, parts: &[StagePart], x: &[f32], rows: &mut Vec<f32>) -> Result<(), StageLost> {
        if self.ok == 0 && !self.failed {
            (self.failed, self.down) = (true, true);
            return Err(StageLost("stage 1 (layers 15..29) closed the connection".into()));
        }
        self.ok = self.ok.saturating_sub(1);
        self.inner.run(parts, x, rows)
    }

    fn reconnected(&mut self) -> bool {
        self.inner.reconnected() || std::mem::take(&mut self.down)
    }

    fn read_kv(&mut self, layer: usize, blocks: &[u32]) -> Result<Vec<KvFrame>, StageLost> {
        self.inner.read_kv(layer, blocks)
    }

    fn write_kv(&mut self, frames: &[(u32, KvFrame)]) -> Result<(), StageLost> {
        self.inner.write_kv(frames)
    }

    fn tiers(&mut self, slots: TierSlots, copies: &[Move]) -> Result<(), StageLost> {
        self.inner.tiers(slots, copies)
    }
}

#[test]
fn a_lost_stage_ends_the_step_and_the_stages_come_back_with_an_empty_prefix_cache() {
    let mut e = head_engine(&[(0, 14), (15, 29)], |s| Box::new(Flaky { inner: s, ok: 3, failed: false, down: false }));
    let p = prompt(40);
    e.add(RequestId(1), p.clone(), greedy(20)).unwrap();
    let mut produced = 0;
    let lost = loop {
        produced += e.step().len();
        if let Some(lost) = e.take_stage_lost() {
            break lost;
        }
    };
    assert!(lost.to_string().contains("closed the connection"), "{lost}");
    assert!(produced < 20);
    assert!(e.cancel(RequestId(1)));
    assert_eq!(e.stats().blocks.used, 0);
    // Back: the same prompt is computed whole again, none of it taken from the cache.
    e.add(RequestId(2), p, greedy(2)).unwrap();
    let first = loop {
        if let Some(o) = e.step().into_iter().next() {
            break o;
        }
    };
    assert_eq!(first.cached_tokens, 0);
}

/// A request's prompt scores and embedding.
type ScoredAndPooled = (Option<Vec<TokenOut>>, Option<Vec<f32>>);

/// Each request's prompt scores and embedding, beside a plain request, in chunks of
/// the engine's batch budget (64 rows: the 90-token prompts take two).
fn scored_and_pooled(e: &mut Engine) -> Vec<ScoredAndPooled> {
    let asks = [
        SamplingParams { prompt_logprobs: Some(2), ..greedy(3) },
        SamplingParams { embed: Some(Pooling::Mean), ..greedy(1) },
        SamplingParams { embed: Some(Pooling::Last), prompt_logprobs: Some(0), ..greedy(2) },
        greedy(4),
    ];
    for (i, params) in asks.into_iter().enumerate() {
        e.add(RequestId(i as u64), prompt(90 - i), params).unwrap();
    }
    let mut firsts: BTreeMap<u64, StepOutput> = BTreeMap::new();
    while e.has_work() {
        for o in e.step() {
            firsts.entry(o.id.0).or_insert(o);
        }
        assert_eq!(e.take_stage_lost(), None);
    }
    assert_eq!(e.stats().blocks.used, 0);
    firsts.into_values().map(|o| (o.prompt_logprobs, o.embedding)).collect()
}

#[test]
fn a_group_scores_and_pools_a_prompt_as_a_whole_engine_does() {
    let whole = scored_and_pooled(&mut engine_of(&[(0, 29)]));
    assert_eq!(whole[0].0.as_ref().map(Vec::len), Some(89), "every prompt token past the first is scored");
    assert!(whole[1].1.is_some() && whole[2].1.is_some() && whole[3] == (None, None));
    for cuts in [&[(0, 14), (15, 29)][..], &[(0, 3), (4, 20), (21, 29)]] {
        assert!(scored_and_pooled(&mut engine_of(cuts)) == whole, "{cuts:?}");
    }
}

/// `e` with a host tier of 2 blocks and a disk tier of 16 below it (in `dir`).
fn tiered(e: Engine, dir: &std::path::Path) -> Engine {
    let cfg = TierConfig { host_blocks: 2, disk_blocks: 16, disk_dir: Some(dir.to_path_buf()) };
    e.with_tiers(&cfg).unwrap()
}

/// Serves `prompts` one after the other, the pool's cache sent down to the tiers
/// after each: each one's tokens and the prompt tokens it found cached.
fn served_from_tiers(e: &mut Engine, prompts: &[Vec<u32>]) -> Vec<(Vec<TokenOut>, usize)> {
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        e.add(RequestId(i as u64), p.clone(), greedy(6)).unwrap();
        let mut got: (Vec<TokenOut>, Option<usize>) = (Vec::new(), None);
        while e.has_work() {
            for o in e.step() {
                got.1.get_or_insert(o.cached_tokens);
                got.0.push(o.sampled);
            }
            assert_eq!(e.take_stage_lost(), None);
        }
        out.push((got.0, got.1.unwrap()));
        e.evict_cached();
    }
    assert_eq!(e.stats().blocks.used, 0);
    out
}

#[test]
fn a_groups_tiers_keep_and_give_back_what_a_whole_engines_do() {
    // Made private by the disk tier; its file is unlinked once made.
    let dir = std::env::temp_dir().join(format!("pdserve-stage-tiers-{}", std::process::id()));
    let p = prompt(70);
    // Another prompt, whose blocks are the ones the first one's left (so a block
    // copied back must be copied on every stage); then the first again, and one
    // sharing its first 48 tokens: found in the host and disk tiers (a host tier of 2).
    let other: Vec<u32> = prompt(70).iter().map(|t| t + 1).collect();
    let prompts = [p.clone(), other, [&p[..], &[7, 8, 9]].concat(), [&p[..48], &prompt(9)[..]].concat()];
    let mut whole = tiered(engine_of(&[(0, 29)]), &dir);
    let want = served_from_tiers(&mut whole, &prompts);
    assert_eq!(want.iter().map(|w| w.1).collect::<Vec<_>>(), [0, 0, 64, 48]);
    for cuts in [&[(0, 14), (15, 29)][..], &[(0, 3), (4, 20), (21, 29)]] {
        let mut e = tiered(engine_of(cuts), &dir);
        assert!(served_from_tiers(&mut e, &prompts) == want, "{cuts:?}");
        let t = e.stats().tiers;
        assert!(t.restored_host > 0 && t.restored_disk > 0, "{cuts:?}: {t:?}");
    }
}

#[test]
fn a_stage_that_comes_back_takes_the_heads_tiers_with_it() {
    // Made private by the disk tier; its file is unlinked once made.
    let dir = std::env::temp_dir().join(format!("pdserve-stage-tiers-{}", std::process::id()));
    let flaky = |s| Box::new(Flaky { inner: s, ok: 6, failed: false, down: false }) as Box<dyn NextStages>;
    let mut e = tiered(head_engine(&[(0, 14), (15, 29)], flaky), &dir);
    let p = prompt(40);
    // A prefill and five decode steps: the prompt's blocks go down to the tiers.
    assert_eq!(served_from_tiers(&mut e, std::slice::from_ref(&p))[0].1, 0);
    e.add(RequestId(8), prompt(20), greedy(2)).unwrap();
    while e.take_stage_lost().is_none() {
        e.step();
    }
    assert!(e.cancel(RequestId(8)));
    // Back: nothing the tiers held before is trusted.
    e.add(RequestId(9), p, greedy(1)).unwrap();
    let first = loop {
        if let Some(o) = e.step().into_iter().next() {
            break o;
        }
    };
    assert_eq!(first.cached_tokens, 0);
}

/// Whole engines and groups, by their cuts (one cut: a whole engine).
fn engine_of(cuts: &[(usize, usize)]) -> Engine {
    match cuts {
        [_] => Engine::new(loaded(cuts).remove(0), engine_cfg(), vec![]),
        _ => head_engine(cuts, |s| Box::new(s)),
    }
}

/// A group whose steps go in micro-batches, once its head timed two sizes of pass
/// (a warm-up prompt's chunks and its decode).
fn pipelining(cuts: &[(usize, usize)]) -> Engine {
    let mut e = head_engine(cuts, |s| Box::new(Pipelining::new(s)));
    e.add(RequestId(99), prompt(100), greedy(2)).unwrap();
    while e.has_work() {
        e.step();
    }
    e
}

/// What `from` prefills of `p` and `to` decodes after it: the tokens, and `from`'s
/// frames by (layer, index).
fn handed(from: &[(usize, usize)], to: &[(usize, usize)], p: &[u32]) -> (Vec<TokenOut>, Vec<(u32, u32)>) {
    handed_by(&mut engine_of(from), &mut engine_of(to), p)
}

fn handed_by(pe: &mut Engine, de: &mut Engine, p: &[u32]) -> (Vec<TokenOut>, Vec<(u32, u32)>) {
    let id = RequestId(7);
    let mut frames = Vec::new();
    let first = pe.prefill_export(id, p.to_vec(), greedy(12), &mut |f| {
        frames.push(f);
        true
    });
    let first = first.unwrap();
    assert_eq!(pe.stats().blocks.used, 0);
    de.reserve_import(id, p.len()).unwrap();
    frames.iter().for_each(|f| de.import_frame(id, f).unwrap());
    assert!(de.finish_import(id, p.to_vec(), first.sampled.token, greedy(12)).unwrap());
    let mut out = vec![first.sampled];
    while de.has_work() {
        out.extend(de.step().into_iter().map(|o| o.sampled));
        assert_eq!(de.take_stage_lost(), None);
    }
    assert_eq!(de.stats().blocks.used, 0);
    (out, frames.iter().map(|f| (f.layer, f.index)).collect())
}

#[test]
fn a_group_hands_its_kv_to_a_group_cut_elsewhere_as_one_engine_does() {
    let p = prompt(45);
    let whole = [(0, 29)];
    let (want, order) = handed(&whole, &whole, &p);
    assert_eq!(want.len(), 12);
    // Every layer's blocks, layer by layer.
    let blocks = p.len().div_ceil(16) as u32;
    assert_eq!(order, (0..30).flat_map(|l| (0..blocks).map(move |b| (l, b))).collect::<Vec<_>>());
    let two: &[(usize, usize)] = &[(0, 14), (15, 29)];
    let three: &[(usize, usize)] = &[(0, 3), (4, 20), (21, 29)];
    for (from, to) in [(two, three), (&whole[..], three), (two, &whole[..]), (three, two)] {
        let (got, frames) = handed(from, to, &p);
        assert_eq!(got, want, "{from:?} → {to:?}");
        assert_eq!(frames, order, "{from:?} → {to:?}");
    }
    // A prefill group whose prompt goes in micro-batches sends each layer once, whole.
    let (mut pe, mut de) = (pipelining(two), engine_of(three));
    let before = pe.stage_totals().pipelined;
    let (got, frames) = handed_by(&mut pe, &mut de, &p);
    assert_eq!((got, frames), (want, order));
    assert_eq!(pe.stage_totals().pipelined, before + 1, "the prompt's one step went in micro-batches");
}

#[test]
fn a_group_hands_prompts_over_while_its_decodes_are_in_lanes() {
    let (p, whole) = (prompt(45), [(0, 29)]);
    let (want, _) = handed(&whole, &whole, &p);
    let others = vec![prompt(20).into_iter().map(|t| t + 4000).collect(), prompt(30)];
    let others_want =
        sampled(&serve_all(&mut Engine::new(loaded(&whole).remove(0), engine_cfg(), vec![]), others.clone()));
    let mut de = pipelining(&[(0, 3), (4, 20), (21, 29)]);
    for (i, o) in others.into_iter().enumerate() {
        de.add(RequestId(i as u64), o, greedy(12)).unwrap();
    }
    let mut out: BTreeMap<u64, Vec<TokenOut>> = BTreeMap::new();
    // Steps (a bounded number) until `done` holds.
    let step_until = |de: &mut Engine, out: &mut BTreeMap<u64, Vec<TokenOut>>, done: &dyn Fn(&Engine) -> bool| {
        for _ in 0..1000 {
            if done(de) {
                return;
            }
            de.step().into_iter().for_each(|o| out.entry(o.id.0).or_default().push(o.sampled));
            assert_eq!(de.take_stage_lost(), None);
        }
        panic!("the engine does not make progress");
    };
    step_until(&mut de, &mut out, &|de| de.stage_totals().lanes >= 2);
    // A lane is in flight: the import's writes to the later stages land it first.
    let (id, mut frames) = (RequestId(7), Vec::new());
    let first = engine_of(&whole).prefill_export(id, p.clone(), greedy(12), &mut |f| {
        frames.push(f);
        true
    });
    de.reserve_import(id, p.len()).unwrap();
    frames.iter().for_each(|f| de.import_frame(id, f).unwrap());
    let first = first.unwrap().sampled;
    assert!(de.finish_import(id, p, first.token, greedy(12)).unwrap());
    out.entry(7).or_default().push(first);
    // Another lane in flight: a prompt prefilled here for another worker sets the
    // batch aside, the lane landed first.
    let lanes = de.stage_totals().lanes;
    step_until(&mut de, &mut out, &|de| de.stage_totals().lanes >= lanes + 2);
    let q = prompt(33);
    let exported = de.prefill_export(RequestId(8), q.clone(), greedy(12), &mut |_| true).unwrap();
    assert_eq!(exported.sampled, handed(&whole, &whole, &q).0[0], "the exported prompt's first token");
    step_until(&mut de, &mut out, &|de| !de.has_work());
    assert_eq!(out.remove(&7).unwrap(), want);
    assert_eq!(out, others_want);
    assert_eq!(de.stats().blocks.used, 0);
}

#[test]
fn a_group_that_loses_a_stage_while_exporting_frees_its_blocks() {
    let mut e = head_engine(&[(0, 14), (15, 29)], |s| Box::new(Flaky { inner: s, ok: 0, failed: false, down: false }));
    let err = e.prefill_export(RequestId(1), prompt(40), greedy(4), &mut |_| true).unwrap_err();
    assert!(matches!(err, EngineError::Stage(_)), "{err}");
    assert!(e.take_stage_lost().is_some());
    assert_eq!(e.stats().blocks.used, 0);
}

/// The K/V of `p`'s cached whole blocks as `e` exports them to a peer, after it
/// served `p`.
fn cached_frames(mut e: Engine, p: &[u32]) -> Vec<KvFrame> {
    e.add(RequestId(3), p.to_vec(), greedy(2)).unwrap();
    while e.has_work() {
        e.step();
    }
    let mut frames = Vec::new();
    let sent = e.export_cached(p, 0, &mut |f| {
        frames.push(f);
        true
    });
    assert_eq!(sent.unwrap(), p.len() / 16 * 16);
    frames
}

#[test]
fn a_group_exports_a_cached_prefix_as_one_engine_does() {
    let p = prompt(50);
    let whole = cached_frames(engine_of(&[(0, 29)]), &p);
    assert_eq!(whole.len(), 30 * 3);
    for cuts in [&[(0, 14), (15, 29)][..], &[(0, 3), (4, 20), (21, 29)]] {
        assert!(cached_frames(engine_of(cuts), &p) == whole, "{cuts:?}");
    }
}
