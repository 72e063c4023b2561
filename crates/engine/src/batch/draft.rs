//! Drafting with a second, smaller model of the target's vocabulary.
//!
//! The draft model keeps a KV cache of its own (its own pool, blocks and dtype as
//! the target's), one table per sequence, kept beside the sequence so that whatever
//! drops the sequence drops its draft K/V too. The draft model computes a prompt's
//! chunks in the steps that compute them, and a prefill engine ships the prompt's
//! draft K/V after the target's (a decode engine that received it computes none).
//! Before a step, each sequence that drafts brings its draft cache up to its tokens
//! (the tokens sampled since it last drafted) and then runs the draft model greedily
//! one token a pass, all drafting sequences batched in each pass. The target
//! verifies the draft as it verifies an n-gram draft: a greedy draft is a single
//! choice, so keeping a drafted token exactly when the target's own sample equals it
//! leaves the target's output, greedy or sampled, what plain decoding gives.
//!
//! After the step, the draft cache is valid as far as the sequence's computed
//! tokens: drafted tokens the target rejected are cut off the next time the sequence
//! drafts ([`DraftKv::roll_back`]).

use super::sequence::Sequence;
use crate::kernels::Isa;
use crate::kvcache::KvStorage;
use crate::model::{ForwardScratch, Model, SeqBatch};
use crate::threadpool::ThreadPool;
use pdserve_kv::{block_hashes, BlockPool, BlockTable};
use pdserve_types::{DecodeSteps, KvDtype, KvFrame, StepFit};
use std::sync::Arc;

/// A draft model for an engine's speculation, shared by every engine that drafts
/// with it (the weights are read-only).
#[derive(Clone)]
pub struct DraftModel {
    model: Arc<Model>,
    name: String,
}

impl DraftModel {
    /// `draft` (named `name`, its file's) drafts for `target` when their vocabularies
    /// have one size; the caller checks that the tokens themselves agree (the
    /// tokenizers live above the engine).
    pub fn new(draft: Arc<Model>, name: impl Into<String>, target: &Model) -> Result<DraftModel, String> {
        let (d, t) = (draft.cfg.vocab_size, target.cfg.vocab_size);
        if d != t {
            return Err(format!("the draft model's vocabulary has {d} tokens, the target's {t}"));
        }
        Ok(DraftModel { model: draft, name: name.into() })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Its name and the shape of its K/V: what two workers that hand requests to each
    /// other must agree on, since a prefill worker ships its draft K/V.
    pub fn signature(&self) -> String {
        let c = &self.model.cfg;
        format!("{} ({} layers, {} KV heads of {})", self.name, c.n_layers, c.n_kv_heads, c.head_dim)
    }

    /// Values of one layer's block of K (or V): a draft K/V frame's size.
    pub fn block_values(&self, block_size: usize) -> usize {
        let c = &self.model.cfg;
        c.n_kv_heads * block_size * c.head_dim
    }
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DraftModel({})", self.signature())
    }
}

impl PartialEq for DraftModel {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.model, &other.model)
    }
}

impl Eq for DraftModel {}

/// What a drafting pass costs: its fixed part, and a drafted token's row in it (a
/// part per row and one per token the row attends over).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DraftCost {
    pub pass: f64,
    per_row: f64,
    per_context: f64,
}

impl DraftCost {
    /// What a timed draft model's passes cost, by its profiled step cost: a decode
    /// row at context `c` attends over `c + 1` positions and has logits.
    pub(crate) fn of_step(step: &crate::timed::StepCost) -> DraftCost {
        DraftCost {
            pass: step.fixed_s,
            per_row: step.token_s + step.logits_s + step.decode_pair_s,
            per_context: step.decode_pair_s,
        }
    }

    /// A drafted token's row at `context`.
    pub fn row(&self, context: usize) -> f64 {
        self.per_row + self.per_context * context as f64
    }
}

/// A sequence's draft K/V: the draft model's cache of its first `computed` tokens.
pub(crate) struct DraftKv {
    table: BlockTable,
    computed: usize,
}

impl DraftKv {
    /// Forgets what the target did not keep: positions past the sequence's computed
    /// tokens hold drafted tokens that were rejected (or a step that was abandoned).
    /// What is left is the sequence's own `tokens`: its full blocks join the draft
    /// pool's prefix cache.
    fn roll_back(&mut self, tokens: &[u32], computed: usize) {
        // Sealed blocks hold the request's own final tokens (sealed from them, or
        // found in the pool's cache), however far the target has computed.
        let sealed = self.table.num_full_blocks() * super::BLOCK_SIZE;
        let keep = computed.max(sealed).min(self.computed);
        if self.computed > keep {
            self.computed = keep;
            self.table.truncate(keep);
        }
        self.table.commit(&tokens[..self.computed]);
    }
}

/// Draft blocks a decode engine reserved for the draft K/V of a transfer: the
/// prefill worker's draft model computed the prompt and ships it after the target's
/// layers (see [`Drafter::export`]).
pub(crate) struct DraftImport {
    table: BlockTable,
    ids: Vec<u32>,
    /// Which frames, `layer * blocks + index`, arrived.
    got: Vec<bool>,
}

impl DraftImport {
    /// Whether no frame of it arrived: the prefill side chose not to compute it.
    pub(crate) fn got_none(&self) -> bool {
        !self.got.contains(&true)
    }

    /// The draft cache of the imported `prompt`, once every frame of it arrived;
    /// else `None` (its blocks go back, and the draft model computes the prompt).
    pub(crate) fn finish(mut self, prompt: &[u32]) -> Option<DraftKv> {
        if !self.got.iter().all(|&g| g) {
            return None;
        }
        self.table.commit(prompt);
        Some(DraftKv { table: self.table, computed: prompt.len() })
    }
}

/// The most tokens a drafting sequence's cache lacks after a step that verified its
/// draft: its last drafted token and the token the target sampled after it.
const CATCH_UP: usize = 2;

/// An engine's draft model at work: its cache, its scratch and its passes' times.
pub(crate) struct Drafter {
    model: Arc<Model>,
    kv: KvStorage,
    blocks: BlockPool,
    scratch: ForwardScratch,
    /// The drafting passes' times over the tokens they computed, fitted as decode
    /// steps are.
    passes: DecodeSteps,
    /// Prompt tokens the draft model computed (none on a decode engine whose
    /// prefill engine shipped the prompt's draft K/V).
    prompt_tokens: u64,
    /// The tokens and seconds of the passes that followed prompts: what a prompt
    /// costs the draft model, a token.
    followed: (u64, f64),
}

/// One sequence's part of a drafting round: which running sequence, how many tokens
/// it wants drafted, and what it has so far.
struct Drafting {
    seq: usize,
    want: usize,
    draft: Vec<u32>,
    /// Still drafting (caught up, and its draft cache had room).
    live: bool,
}

impl Drafter {
    /// A cache of `num_blocks`, in `dtype` where the draft model's heads allow it
    /// (else f16).
    pub fn new(model: &DraftModel, num_blocks: usize, block_size: usize, dtype: KvDtype) -> Self {
        let model = model.model.clone();
        let dtype = if crate::kvcache::check_dtype(&model.cfg, dtype).is_ok() { dtype } else { KvDtype::F16 };
        Drafter {
            kv: KvStorage::with_dtype(&model.cfg, num_blocks, block_size, dtype),
            blocks: BlockPool::new(num_blocks, block_size),
            model,
            scratch: ForwardScratch::default(),
            passes: DecodeSteps::default(),
            prompt_tokens: 0,
            followed: (0, 0.0),
        }
    }

    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens
    }

    /// Seconds the draft model takes a prompt token, from the prompts it followed;
    /// `None` before the first.
    pub fn prompt_cost(&self) -> Option<f64> {
        let (tokens, seconds) = self.followed;
        (tokens > 0).then(|| seconds / tokens as f64)
    }

    /// The tokens of `s` its draft cache lacks: all but what it holds, or, before it
    /// has one, what the draft pool does not cache of its tokens.
    pub fn lacks(&self, s: &Sequence) -> usize {
        let computed = match s.draft_kv.as_ref() {
            Some(d) => d.computed,
            None => self.start(&s.tokens).computed,
        };
        s.tokens.len().saturating_sub(computed)
    }

    /// Blocks for the draft K/V of a `prompt_len`-token transfer; `None` when the
    /// draft pool has no room (the draft model then computes the prompt here).
    pub fn reserve(&self, prompt_len: usize) -> Option<DraftImport> {
        let mut table = BlockTable::new(&self.blocks, 0);
        table.ensure_capacity(prompt_len).ok()?;
        let ids: Vec<u32> = table.block_ids().into_iter().map(|b| b.0).collect();
        let got = vec![false; ids.len() * self.model.cfg.n_layers];
        Some(DraftImport { table, ids, got })
    }

    /// Writes draft layer `layer`'s frame `f` into `imp`'s blocks.
    pub fn import_frame(&mut self, imp: &mut DraftImport, layer: usize, f: &KvFrame) -> Result<(), String> {
        let index = f.index as usize;
        let (Some(&block), true) = (imp.ids.get(index), layer < self.model.cfg.n_layers) else {
            return Err(format!("draft layer {layer} block {index} out of range"));
        };
        super::transfer::write_frame(&mut self.kv, layer, block, f)?;
        imp.got[layer * imp.ids.len() + index] = true;
        Ok(())
    }

    /// Brings the draft cache of `running[seq]` up to its first `upto` tokens, in
    /// passes of `budget` tokens; whether it got there (it stops where the draft
    /// pool has no room).
    pub fn complete(
        &mut self,
        isa: Isa,
        pool: &ThreadPool,
        running: &mut [Sequence],
        seq: usize,
        upto: usize,
        budget: usize,
    ) -> bool {
        let computed = |s: &Sequence| s.draft_kv.as_ref().map_or(0, |d| d.computed);
        loop {
            let before = computed(&running[seq]);
            self.follow(isa, pool, running, &[(seq, upto)], budget);
            let s = &mut running[seq];
            let now = computed(s);
            if now >= upto || now == before {
                // Its full blocks join the draft pool's cache.
                if let Some(d) = s.draft_kv.as_mut() {
                    d.roll_back(&s.tokens, s.computed);
                }
                return now >= upto;
            }
        }
    }

    /// Sends `s`'s draft K/V of its first `upto` tokens layer by layer, as frames
    /// numbered after the target's `target_layers`; false once the receiver refuses
    /// one.
    pub fn export(
        &self,
        s: &Sequence,
        upto: usize,
        target_layers: usize,
        on_frame: &mut dyn FnMut(KvFrame) -> bool,
    ) -> bool {
        let Some(d) = s.draft_kv.as_ref().filter(|d| d.computed >= upto) else { return true };
        let ids: Vec<u32> =
            d.table.block_ids().into_iter().take(upto.div_ceil(super::BLOCK_SIZE)).map(|b| b.0).collect();
        (0..self.model.cfg.n_layers).all(|l| {
            let blocks = ids.iter().map(|&b| self.kv.block(l, b));
            super::transfer::export_layer(target_layers + l, self.kv.dtype, blocks, on_frame)
        })
    }

    pub fn block_stats(&self) -> pdserve_kv::PoolStats {
        self.blocks.stats()
    }

    /// What drafting costs in draft-model time, from the fit of the passes' times once
    /// it tells rows apart: a pass's fixed part (its weights read once, shared by the
    /// sequences drafting in it) and a drafted token's row; before that, no fixed part
    /// and the mean over every token a pass computed. `None` before any timed pass.
    pub fn cost(&self) -> Option<DraftCost> {
        let p = &self.passes;
        if p.tells_rows_apart() {
            if let Some(StepFit { fixed, per_row, per_context }) = p.fit() {
                return Some(DraftCost { pass: fixed, per_row, per_context });
            }
        }
        (p.rows > 0).then(|| DraftCost { pass: 0.0, per_row: p.seconds / p.rows as f64, per_context: 0.0 })
    }

    /// Drafts up to `want` tokens for each `(running index, want)`, greedily, within
    /// `budget` tokens of catching up; returns each sequence's draft (empty where it
    /// is still catching up or its draft cache is full).
    pub fn draft(
        &mut self,
        isa: Isa,
        pool: &ThreadPool,
        running: &mut [Sequence],
        want: &[(usize, usize)],
        budget: usize,
    ) -> Vec<Vec<u32>> {
        // A draft model of a shorter context drafts nothing past it.
        let context = self.model.cfg.context_length;
        let mut work: Vec<Drafting> = want
            .iter()
            .map(|&(seq, want)| Drafting {
                seq,
                want,
                draft: Vec::new(),
                live: running[seq].tokens.len() + want <= context,
            })
            .collect();
        let mut left = budget;
        let mut first = true;
        while work.iter().any(|w| w.live && w.draft.len() < w.want) {
            let chunks = self.chunks(running, &mut work, first, &mut left);
            if chunks.is_empty() {
                break;
            }
            // Each pass is timed as a decode step is: its fixed part (the draft
            // model's weights read once) is shared by the sequences drafting in it. A
            // first pass that caught up on more than the last step's tokens (a prompt,
            // or steps that drafted nothing) is a prefill, not timed.
            let steady = chunks.iter().all(|(_, c)| c.len() <= CATCH_UP);
            let rows = chunks.iter().map(|(_, c)| c.len()).sum();
            let context = chunks.iter().map(|(k, _)| running[work[*k].seq].tokens.len()).sum();
            let started = std::time::Instant::now();
            self.pass(isa, pool, running, &mut work, &chunks);
            if steady {
                self.passes.record(rows, context, started.elapsed().as_secs_f64());
            }
            first = false;
        }
        work.into_iter().map(|w| w.draft).collect()
    }

    /// A sequence's draft cache, starting with what the draft pool still caches of its
    /// `tokens` (a prompt sent again, the turns before in a chat), all but the last
    /// token (which the draft model computes for its logits).
    fn start(&self, tokens: &[u32]) -> DraftKv {
        let size = self.blocks.block_size();
        let known = tokens.len().saturating_sub(1);
        let hit = self.blocks.match_prefix(&block_hashes(&tokens[..known], size, 0));
        let computed = hit.len() * size;
        DraftKv { table: BlockTable::with_prefix(&self.blocks, 0, hit), computed }
    }

    /// Brings each `(running index, upto)`'s draft cache up to its first `upto` tokens
    /// (a prompt chunk the target computes this step), `budget` tokens in all at most.
    pub fn follow(
        &mut self,
        isa: Isa,
        pool: &ThreadPool,
        running: &mut [Sequence],
        upto: &[(usize, usize)],
        budget: usize,
    ) {
        let mut work = Vec::new();
        let mut chunks = Vec::new();
        let mut left = budget;
        for &(seq, upto) in upto {
            if let Some((chunk, _)) = self.lag(&mut running[seq], upto, &mut left) {
                chunks.push((work.len(), chunk));
                work.push(Drafting { seq, want: 0, draft: Vec::new(), live: false });
            }
        }
        if !chunks.is_empty() {
            let started = std::time::Instant::now();
            self.pass(isa, pool, running, &mut work, &chunks);
            let tokens: usize = chunks.iter().map(|(_, c)| c.len()).sum();
            self.followed.0 += tokens as u64;
            self.followed.1 += started.elapsed().as_secs_f64();
        }
    }

    /// What `s`'s draft cache lacks of its first `upto` tokens (after cutting off what
    /// the target did not keep), at most `left` of them, taken from `left`, with room
    /// made for them; and whether that is all it lacks. `None` when there is nothing
    /// to compute or no room.
    fn lag(&self, s: &mut Sequence, upto: usize, left: &mut usize) -> Option<(Vec<u32>, bool)> {
        let d = s.draft_kv.get_or_insert_with(|| self.start(&s.tokens));
        d.roll_back(&s.tokens, s.computed);
        let lacks = upto.saturating_sub(d.computed);
        let n = lacks.min(*left);
        if n == 0 || d.table.ensure_capacity(d.computed + n).is_err() {
            return None;
        }
        *left -= n;
        Some((s.tokens[d.computed..d.computed + n].to_vec(), n == lacks))
    }

    /// Each live sequence's tokens for the next pass: first what its draft cache
    /// lacks of its tokens (within `left`; one that cannot catch up drafts nothing
    /// this step), then its last drafted token. Marks those it cannot hold dead.
    fn chunks(
        &self,
        running: &mut [Sequence],
        work: &mut [Drafting],
        first: bool,
        left: &mut usize,
    ) -> Vec<(usize, Vec<u32>)> {
        let mut chunks = Vec::new();
        for (k, w) in work.iter_mut().enumerate() {
            if !w.live || w.draft.len() >= w.want {
                continue;
            }
            let s = &mut running[w.seq];
            let chunk = if first {
                let upto = s.tokens.len();
                self.lag(s, upto, left).map(|(chunk, whole)| {
                    w.live = whole;
                    chunk
                })
            } else {
                let room = s.draft_kv.as_mut().is_some_and(|d| d.table.ensure_capacity(d.computed + 1).is_ok());
                w.draft.last().filter(|_| room).map(|&t| vec![t])
            };
            match chunk {
                Some(chunk) => chunks.push((k, chunk)),
                None => w.live = false,
            }
        }
        chunks
    }

    /// Runs one pass over `chunks` and appends each caught-up sequence's greedy token.
    fn pass(
        &mut self,
        isa: Isa,
        pool: &ThreadPool,
        running: &mut [Sequence],
        work: &mut [Drafting],
        chunks: &[(usize, Vec<u32>)],
    ) {
        let ids: Vec<Vec<u32>> = chunks
            .iter()
            .map(|(k, _)| {
                let d = running[work[*k].seq].draft_kv.as_ref();
                d.map(|d| d.table.block_ids().into_iter().map(|b| b.0).collect()).unwrap_or_default()
            })
            .collect();
        let batch: Vec<SeqBatch<'_>> = chunks
            .iter()
            .zip(&ids)
            .map(|((k, chunk), blocks)| {
                let w = &work[*k];
                let start_pos = running[w.seq].draft_kv.as_ref().map_or(0, |d| d.computed);
                SeqBatch { tokens: chunk, start_pos, blocks, logits: usize::from(w.live), score: None, pool: None }
            })
            .collect();
        let logits = self.model.forward(isa, pool, &batch, &mut self.kv, &mut self.scratch, &mut |_, _| true);
        let vocab = self.model.cfg.vocab_size;
        let mut rows = logits.map(|l| l.chunks_exact(vocab)).into_iter().flatten();
        for (k, chunk) in chunks {
            let w = &mut work[*k];
            let s = &mut running[w.seq];
            if let Some(d) = s.draft_kv.as_mut() {
                self.prompt_tokens += s.prompt_len.min(d.computed + chunk.len()).saturating_sub(d.computed) as u64;
                d.computed += chunk.len();
            }
            if w.live {
                if let Some(row) = rows.next() {
                    w.draft.push(crate::sampler::greedy_token(row));
                }
            }
        }
    }
}
