//! The engine: sequences in, sampled tokens out, one scheduler step at a time.
//!
//! The caller (a worker, or the CLI) owns the loop: `add` requests, call `step` while
//! `has_work`, route each [`StepOutput`] to its client, `cancel` when a client goes
//! away. Dropping a sequence drops its block table, which returns every block.

mod draft;
mod lanes;
mod scheduler;
mod sequence;
mod speculate;
mod stages;
mod transfer;

pub use crate::pipeline::{PassCost, PassTimes};
pub use draft::DraftModel;
pub use pdserve_types::{FinishReason, KvFrame};
pub use speculate::SpecConfig;
pub use stages::{
    parts_of, KvParts, LocalStages, NextStages, PartSent, StageCosts, StageLost, StagePart, StageRows, StageRunner,
    TierSlots,
};
pub use transfer::{CachedKv, KvImport};

use crate::grammar::{Grammars, MaskClock};
use crate::kernels::Isa;
use crate::kvcache::KvStorage;
use crate::model::{ForwardScratch, Model};
use crate::threadpool::ThreadPool;
use crate::tiers::{TierBytes, TierConfig, TierError};
use crate::timed::TimedModel;
use pdserve_kv::{BlockPool, Place, PoolStats, TierCounters};
use pdserve_types::TokenOut;
use pdserve_types::{DecodeSteps, KvDtype, PrefillSteps, RequestId, SamplingParams, SpecTotals};
use sequence::Sequence;
use std::collections::VecDeque;
use std::sync::Arc;

pub const BLOCK_SIZE: usize = 16;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Compute threads (the calling thread counts as one).
    pub threads: usize,
    /// KV blocks of `BLOCK_SIZE` tokens.
    pub num_blocks: usize,
    /// How the KV cache stores its values (check it fits the model with
    /// [`crate::kvcache::check_dtype`] first).
    pub kv_dtype: KvDtype,
    /// Tokens per step: decodes first, then prefill chunks fill the rest.
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    pub max_seqs: usize,
    /// Salt mixed into prefix-cache hashes (e.g. a model or adapter id).
    pub cache_salt: u64,
    /// Objectives the steps keep running decodes within (none: every step fills its
    /// token budget; see [`Objectives`]).
    pub objectives: Option<Objectives>,
    /// Speculative decoding by n-gram lookup (none: one token a step).
    pub speculation: Option<SpecConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads: 1,
            num_blocks: 1024,
            kv_dtype: KvDtype::F16,
            max_batch_tokens: 512,
            max_seqs: 64,
            cache_salt: 0,
            objectives: None,
            speculation: None,
        }
    }
}

/// Latency objectives a worker's steps keep. A step computes beside its decodes only
/// the prompt tokens the decodes' TPOT slack pays for, or what the queued prompts
/// need to keep their TTFT: a prompt on a busy mixed worker is spread over the
/// decodes' steps instead of stalling them (what a dedicated prefill worker buys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Objectives {
    pub ttft_s: f64,
    pub tpot_s: f64,
}

impl Objectives {
    /// From the milliseconds the CLI's `--slo-ttft-ms` and `--slo-tpot-ms` take.
    pub fn from_ms(ttft_ms: f64, tpot_ms: f64) -> Self {
        Objectives { ttft_s: ttft_ms / 1e3, tpot_s: tpot_ms / 1e3 }
    }
}

/// Why a request was refused; no state was changed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the context length {context}")]
    TooLong { prompt: usize, max_tokens: usize, context: usize },
    #[error("the request needs {needed} KV blocks but the cache has {total}")]
    TooLargeForCache { needed: usize, total: usize },
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
    #[error("request {0} already exists")]
    Duplicate(RequestId),
    #[error("request {0} is unknown")]
    Unknown(RequestId),
    #[error("no free KV blocks for the transfer")]
    NoBlocks,
    #[error("the prefix to keep for the transfer is no longer cached here")]
    NotCached,
    #[error("KV frame does not fit: {0}")]
    BadFrame(String),
    #[error("cancelled: the receiver of the prefill is gone")]
    Cancelled,
    #[error("grammar: {0}")]
    Grammar(String),
    #[error(transparent)]
    Stage(#[from] StageLost),
}

/// One token for one request.
#[derive(Debug, Clone)]
pub struct StepOutput {
    pub id: RequestId,
    pub sampled: TokenOut,
    /// Set on the request's last token; the sequence is gone from the engine.
    pub finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// With a request's first token, when it asked: each prompt token from the second
    /// on, scored given the tokens before it.
    pub prompt_logprobs: Option<Vec<TokenOut>>,
    /// With a request's first token, when it asked: its prompt's pooled final hidden
    /// states.
    pub embedding: Option<Vec<f32>>,
    /// Why the output stopped matching its grammar, if it did: the request ends in
    /// this error, never with an answer its grammar refuses.
    pub broken: Option<String>,
}

#[derive(Debug, Clone, Copy)]
pub struct EngineStats {
    pub waiting: usize,
    pub running: usize,
    /// Prompt tokens not computed yet, of waiting and running sequences.
    pub queued_prompt_tokens: usize,
    pub blocks: PoolStats,
    /// Token masks computed for constrained sequences, and their total seconds.
    pub masks: (u64, f64),
    /// Steps that decoded only (the planner fits its decode cost to them).
    pub decode_steps: DecodeSteps,
    /// Steps that prefilled only (the planner takes a prefill worker's pace from them).
    pub prefill_steps: PrefillSteps,
    /// Blocks the lower tiers took and gave back (all zero without tiers).
    pub tiers: TierCounters,
    /// Drafted tokens verified and accepted, since the engine started.
    pub spec: SpecTotals,
    /// The draft model's cache, when a draft model drafts.
    pub draft_blocks: Option<PoolStats>,
}

/// What computes a step's tokens.
pub(crate) enum Compute {
    Model(Arc<Model>),
    /// A cost model's time and deterministic tokens (simulated workers).
    Timed(Box<TimedModel>),
}

pub struct Engine {
    compute: Compute,
    cfg: EngineConfig,
    isa: Isa,
    pool: ThreadPool,
    kv: KvStorage,
    blocks: BlockPool,
    scratch: ForwardScratch,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    importing: Vec<KvImport>,
    eog: Vec<u32>,
    next_seed: u64,
    /// Compiles constrained requests' grammars; without it they are refused.
    grammars: Option<Arc<Grammars>>,
    /// How long this engine's constraints took to compute their masks.
    masks: Arc<MaskClock>,
    decode_steps: DecodeSteps,
    prefill_steps: PrefillSteps,
    /// Seconds of modelled compute not yet taken by [`Engine::take_charged`].
    charged: f64,
    /// Core-seconds its threads sat idle in those steps ([`Engine::take_idle`]).
    idle: f64,
    /// The part of `charged` spent on prompt chunks ([`Engine::take_charged_prefill`]).
    charged_prefill: f64,
    /// Prompt tokens of draft-model K/V exported since [`Engine::take_draft_shipped`].
    draft_shipped: usize,
    /// The last step found nothing it could compute (see [`Engine::stalled`]).
    stalled: bool,
    /// Host and disk stores below the pool ([`Engine::with_tiers`]).
    tiers: Option<TierBytes>,
    /// How long the last step took: the sequences' clocks advance by it.
    last_step_s: f64,
    spec: SpecTotals,
    /// Every request's n-gram drafts together (where a new request's acceptance
    /// starts), and the drafts grammars forced.
    acceptance: speculate::Acceptance,
    forced: speculate::Acceptance,
    /// The draft model's drafts alone: what a sequence deciding whether to draft
    /// with it expects.
    by_model: speculate::Acceptance,
    /// Requests that finished here and the tokens they output: what a new one is
    /// expected to output, where its limit allows.
    outputs: (u64, u64),
    /// The draft model's cache and pass times, when a draft model drafts.
    drafter: Option<draft::Drafter>,
    /// What every request on this engine said after each few words (n-gram drafts).
    ngrams: speculate::NgramPool,
    /// When a step verifies drafts whatever the fit says (see `add_drafts`).
    exploration: speculate::Exploration,
    /// The pipeline stages after this engine's model, when it is a group's head.
    next: Option<stages::Next>,
}

impl Engine {
    /// `eog` lists the end-of-generation token ids (from the tokenizer).
    pub fn new(model: Arc<Model>, cfg: EngineConfig, eog: Vec<u32>) -> Self {
        let kv = model.kv_storage(cfg.num_blocks, BLOCK_SIZE, cfg.kv_dtype);
        Engine::with_compute(Compute::Model(model), kv, cfg, eog)
    }

    /// An engine whose steps take the time `t` predicts and sample deterministic
    /// tokens (see [`crate::timed`]); it runs single-threaded whatever `cfg` says.
    pub fn timed(t: TimedModel, cfg: EngineConfig, eog: Vec<u32>) -> Self {
        let kv = KvStorage::with_dims(t.n_layers, t.kv_values, cfg.num_blocks, BLOCK_SIZE);
        Engine::with_compute(Compute::Timed(Box::new(t)), kv, EngineConfig { threads: 1, ..cfg }, eog)
    }

    fn with_compute(compute: Compute, kv: KvStorage, cfg: EngineConfig, eog: Vec<u32>) -> Self {
        let draft = cfg.speculation.as_ref().and_then(|s| s.draft.as_ref());
        let drafter = draft
            .filter(|_| matches!(compute, Compute::Model(_)))
            .map(|d| draft::Drafter::new(d, cfg.num_blocks, BLOCK_SIZE, cfg.kv_dtype));
        Engine {
            drafter,
            exploration: speculate::Exploration::default(),
            next: None,
            ngrams: speculate::NgramPool::default(),
            kv,
            blocks: BlockPool::new(cfg.num_blocks, BLOCK_SIZE),
            pool: ThreadPool::new(cfg.threads),
            isa: Isa::detect(),
            scratch: ForwardScratch::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            importing: Vec::new(),
            next_seed: 0x5eed,
            compute,
            cfg,
            eog,
            grammars: None,
            masks: Arc::default(),
            decode_steps: DecodeSteps::default(),
            prefill_steps: PrefillSteps::default(),
            charged: 0.0,
            charged_prefill: 0.0,
            draft_shipped: 0,
            idle: 0.0,
            stalled: false,
            tiers: None,
            last_step_s: 0.0,
            spec: SpecTotals::default(),
            acceptance: speculate::Acceptance::default(),
            forced: speculate::Acceptance::default(),
            by_model: speculate::Acceptance::default(),
            outputs: (0, 0),
        }
    }

    /// Keeps the blocks the pool evicts in a host-RAM tier and then a disk tier
    /// (see [`crate::tiers`]), and copies them back when a prompt finds them there.
    /// Call before the first request: it replaces the (empty) pool.
    pub fn with_tiers(mut self, cfg: &TierConfig) -> Result<Self, TierError> {
        if cfg.is_empty() {
            return Ok(self);
        }
        self.tiers = Some(TierBytes::new(&self.kv, cfg)?);
        let disk = if cfg.disk_dir.is_some() { cfg.disk_blocks } else { 0 };
        self.blocks = BlockPool::with_tiers(self.cfg.num_blocks, BLOCK_SIZE, cfg.host_blocks, disk);
        let slots = self.tier_slots();
        if let Some(next) = self.next.as_mut() {
            next.slots = slots;
        }
        Ok(self)
    }

    /// The lower tiers' slots: (host, disk).
    pub(crate) fn tier_slots(&self) -> stages::TierSlots {
        let s = self.blocks.stats();
        (s.host.capacity, s.disk.capacity)
    }

    /// Drops every block only the prefix cache holds from the pool, down to the lower
    /// tiers when there are any (blocks in use stay).
    pub fn evict_cached(&mut self) {
        self.blocks.clear_cache();
        self.settle_moves();
    }

    /// Waits for the disk tier's writes; with `uncache`, also drops its file from the
    /// page cache (see [`crate::tiers`]). Nothing to do without a disk tier.
    pub fn flush_tiers(&self, uncache: bool) -> std::io::Result<()> {
        self.tiers.as_ref().map_or(Ok(()), |t| t.flush(uncache))
    }

    /// Makes the copies the pool owes for its evictions: before anything writes
    /// into blocks just handed out, since they may be what was evicted.
    pub(crate) fn settle_moves(&mut self) {
        let Some(tiers) = self.tiers.as_mut() else { return };
        for m in self.blocks.take_moves() {
            tiers.apply(m, &self.kv);
            // A group's later stages copy their layers of the same block.
            if let Some(next) = self.next.as_mut() {
                next.owe(m);
            }
        }
        // A block whose disk bytes were lost is not cached any more: say so.
        for slot in tiers.take_lost() {
            self.blocks.forget_lower(Place::Disk(slot));
        }
    }

    pub(crate) fn vocab_size(&self) -> usize {
        match &self.compute {
            Compute::Model(m) => m.cfg.vocab_size,
            Compute::Timed(t) => t.vocab_size,
        }
    }

    pub(crate) fn context_length(&self) -> usize {
        match &self.compute {
            Compute::Model(m) => m.cfg.context_length,
            Compute::Timed(t) => t.context_length,
        }
    }

    /// Seconds of modelled compute since the last call (always 0 for a real model):
    /// what a virtual clock advances by after a timed engine's step.
    pub fn take_charged(&mut self) -> f64 {
        std::mem::take(&mut self.charged)
    }

    /// The part of the seconds [`Engine::take_charged`] takes that prompt chunks
    /// took (each step's time by its prompt tokens' share of its tokens): a neighbour
    /// on the same machine slows a prefill and a decode differently.
    pub fn take_charged_prefill(&mut self) -> f64 {
        std::mem::take(&mut self.charged_prefill)
    }

    /// Prompt tokens of the draft model's K/V the exported prefills since the last
    /// call sent beside the target's (a timed engine counts what a real one would send).
    pub fn take_draft_shipped(&mut self) -> usize {
        std::mem::take(&mut self.draft_shipped)
    }

    /// Core-seconds a timed engine's threads sat idle in the steps charged since the
    /// last call: where the host's other work fits without delaying them.
    pub fn take_idle(&mut self) -> f64 {
        std::mem::take(&mut self.idle)
    }

    /// Times of the token masks of this engine's constrained sequences.
    pub fn mask_clock(&self) -> &MaskClock {
        &self.masks
    }

    /// Serves constrained requests (`SamplingParams::grammar`) with `grammars`, which
    /// must be built from this model's tokenizer.
    pub fn with_grammars(mut self, grammars: Arc<Grammars>) -> Self {
        self.grammars = Some(grammars);
        self
    }

    /// The shape of one block of one layer of this engine's cache.
    pub fn kv_shape(&self) -> crate::kvcache::BlockShape {
        self.kv.block_shape()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Queues a request (FCFS). Fails without side effects on a bad request.
    pub fn add(&mut self, id: RequestId, prompt: Vec<u32>, params: SamplingParams) -> Result<(), EngineError> {
        self.check_new(id, &prompt, &params)?;
        let s = self.sequence(id, prompt, params)?;
        self.waiting.push_back(s);
        Ok(())
    }

    /// A new sequence with its own seed and, for a constrained request, its grammar's
    /// state after the tokens it already generated elsewhere.
    fn sequence(&mut self, id: RequestId, prompt: Vec<u32>, params: SamplingParams) -> Result<Sequence, EngineError> {
        let constraint = match (&params.grammar, &self.grammars) {
            (None, _) => None,
            (Some(_), None) => return Err(EngineError::Grammar("this engine has no grammar support".into())),
            (Some(g), Some(gs)) => {
                let c = gs.constraint(g, &prompt, self.masks.clone());
                Some(c.map_err(|e| EngineError::Grammar(e.to_string()))?)
            }
        };
        let seed = self.fresh_seed();
        let mut s = Sequence::new(id, prompt, params, seed);
        s.constraint = constraint;
        Ok(s)
    }

    fn check_new(&self, id: RequestId, prompt: &[u32], params: &SamplingParams) -> Result<(), EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= self.vocab_size()) {
            return Err(EngineError::BadToken(bad));
        }
        let context = self.context_length();
        let total = prompt.len() + params.max_tokens as usize;
        if total > context {
            return Err(EngineError::TooLong { prompt: prompt.len(), max_tokens: params.max_tokens as usize, context });
        }
        let needed = total.div_ceil(BLOCK_SIZE);
        if needed > self.cfg.num_blocks {
            return Err(EngineError::TooLargeForCache { needed, total: self.cfg.num_blocks });
        }
        if self.contains(id) {
            return Err(EngineError::Duplicate(id));
        }
        Ok(())
    }

    fn fresh_seed(&mut self) -> u64 {
        self.next_seed = self.next_seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        self.next_seed
    }

    fn contains(&self, id: RequestId) -> bool {
        self.waiting.iter().chain(&self.running).any(|s| s.id == id) || self.importing.iter().any(|i| i.id == id)
    }

    /// A running request's record of drafted tokens (what it brought with it
    /// included); none before it has one.
    pub fn draft_record(&self, id: RequestId) -> Option<pdserve_types::DraftRecord> {
        let s = self.running.iter().find(|s| s.id == id)?;
        (s.acceptance.tried > 0).then(|| s.acceptance.into())
    }

    /// Drops a request in any state; its blocks return to the pool at once.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let before = self.waiting.len() + self.running.len() + self.importing.len();
        self.waiting.retain(|s| s.id != id);
        self.running.retain(|s| s.id != id);
        self.importing.retain(|i| i.id != id);
        before != self.waiting.len() + self.running.len() + self.importing.len()
    }

    /// Whether a step would compute anything (paused sequences wait).
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || self.running.iter().any(|s| !s.paused)
    }

    /// Whether a prompt here still has tokens to compute (waiting, or part-way
    /// through a chunked prefill): what an exported prefill queues behind.
    pub fn prompts_pending(&self) -> bool {
        !self.waiting.is_empty() || self.running.iter().any(|s| s.computed < s.prompt_len)
    }

    /// The last step had work but could compute none of it: the head of the queue
    /// does not fit in the blocks left (they wait on imports or paused sequences).
    /// Only an outside event (a command, a reaped import) can change that, so a
    /// worker loop waits for one instead of stepping again at once.
    pub fn stalled(&self) -> bool {
        self.stalled
    }

    /// Stops stepping running request `id` (its client reads slower than it is
    /// generated) until [`Engine::resume`]; it keeps its blocks and its numerics.
    pub fn pause(&mut self, id: RequestId) -> bool {
        self.set_paused(id, true)
    }

    pub fn resume(&mut self, id: RequestId) -> bool {
        self.set_paused(id, false)
    }

    fn set_paused(&mut self, id: RequestId, paused: bool) -> bool {
        let s = self.running.iter_mut().find(|s| s.id == id);
        s.map(|s| s.paused = paused).is_some()
    }

    pub fn stats(&self) -> EngineStats {
        let left = |s: &Sequence| s.prompt_len.saturating_sub(s.computed);
        EngineStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            queued_prompt_tokens: self.waiting.iter().chain(self.running.iter()).map(left).sum(),
            blocks: self.blocks.stats(),
            masks: self.masks.totals(),
            decode_steps: self.decode_steps,
            prefill_steps: self.prefill_steps,
            tiers: self.tiers.as_ref().map(|t| t.counters()).unwrap_or_default(),
            spec: SpecTotals {
                draft_prompt_tokens: self.drafter.as_ref().map_or(0, |d| d.prompt_tokens()),
                ..self.spec
            },
            draft_blocks: self.drafter.as_ref().map(|d| d.block_stats()),
        }
    }

    /// The block pool, for metrics and prefix-cache events.
    pub fn block_pool(&self) -> &BlockPool {
        &self.blocks
    }

    /// Compute threads in use.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }
}
