//! One forward step over a batch, whatever the architecture: embedding, the layers
//! (each architecture's own file), the final norm and the logits. Every token of every
//! sequence goes through the same row-wise kernels, and attention reads each sequence's
//! own blocks.

use super::blocks::norm_rows;
use super::{Head, Model};
use crate::kernels::{fit, Isa};
use crate::kvcache::KvStorage;
use crate::threadpool::ThreadPool;
use pdserve_types::TokenOut;
use std::sync::Mutex;

/// One sequence's part of a step: new tokens at positions `start_pos..`.
pub struct SeqBatch<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// The sequence's cache blocks, covering every position up to the last new token.
    pub blocks: &'a [u32],
    /// How many of the last new tokens get logits: 0, 1 (the next token's), or every
    /// row of a verified draft.
    pub logits: usize,
    /// Score the tokens that follow the first rows (prompt logprobs).
    pub score: Option<Scoring<'a>>,
    /// Pool the first rows' final hidden states (an embedding of the prompt).
    pub pool: Option<Pool<'a>>,
}

impl<'a> SeqBatch<'a> {
    /// A part that computes and yields `logits` rows, scoring and pooling nothing.
    pub fn plain(tokens: &'a [u32], start_pos: usize, blocks: &'a [u32], logits: usize) -> Self {
        SeqBatch { tokens, start_pos, blocks, logits, score: None, pool: None }
    }
}

/// Where a sequence's part puts its rows' normed final hidden states (an
/// embedding of its prompt), into `out`.
pub struct Pool<'a> {
    pub rows: Pooled,
    pub out: &'a Mutex<Vec<f32>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pooled {
    /// The first `n` rows are added to `out` (mean pooling: divided once the prompt
    /// is done).
    Sum(usize),
    /// Row `i` replaces `out` (the prompt's last position, for last-token pooling).
    Row(usize),
}

/// Which tokens the rows of a sequence's part predict: row `j` is scored against
/// `targets[j]`, with `top` alternatives, into `out`.
pub struct Scoring<'a> {
    pub targets: &'a [u32],
    pub top: usize,
    pub out: &'a Mutex<Vec<TokenOut>>,
}

/// Rows whose logits are computed at once when scoring a prompt: bounds the logits
/// buffer (rows × vocabulary) whatever the chunk size.
const SCORE_ROWS: usize = 16;

/// Buffers reused across steps, so the hot path does not allocate once warmed up.
#[derive(Default)]
pub struct ForwardScratch {
    /// The residual stream, `tokens × hidden`.
    pub(super) x: Vec<f32>,
    pub(super) h: Vec<f32>,
    pub(super) qkv: Vec<f32>,
    pub(super) attn: Vec<f32>,
    pub(super) proj: Vec<f32>,
    pub(super) head: Vec<f32>,
    pub(super) mlp: super::blocks::MlpScratch,
    pub(super) moe: super::moe::MoeScratch,
    pub(super) lin: super::linear::LinearScratch,
    logits: Vec<f32>,
    last: Vec<f32>,
}

impl ForwardScratch {
    /// Bytes its buffers hold (their capacity): what the largest step it served took.
    pub fn bytes(&self) -> usize {
        let own = [&self.x, &self.h, &self.qkv, &self.attn, &self.proj, &self.head, &self.logits, &self.last];
        own.iter().map(|v| 4 * v.capacity()).sum::<usize>() + self.mlp.bytes() + self.moe.bytes() + self.lin.bytes()
    }
}

/// The bytes of [`ForwardScratch`] a step of `rows` rows through `cfg`'s layers takes,
/// logits aside: per row, f32 values of the residual stream and its normed copy, the
/// queries, keys and values, the attention's output and its projection, the
/// feed-forward's gate, up and activation (a mixture's router scores and expert
/// slots too), and a matmul's int8 activations of the widest input with their scales
/// (three 4-byte words per 32 values); and one head's values, for the q/k norms.
pub fn step_bytes(cfg: &crate::config::ModelConfig, rows: usize) -> usize {
    let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
    let ffn = cfg.moe.as_ref().map_or(cfg.ffn_hidden, |m| m.expert_ffn);
    let moe = cfg.moe.as_ref().map_or(0, |m| m.experts + (2 + m.used) * cfg.hidden);
    let f32s = 3 * cfg.hidden + q + (q + 2 * kv) + 3 * ffn + moe;
    let widest = cfg.hidden.max(q).max(ffn);
    rows * (4 * f32s + widest + widest.div_ceil(32) * 12) + 4 * cfg.head_dim
}

/// The rows of `x` (every row of a step, `hidden` values each) that get logits: of
/// each part, given as (its rows, its logits rows), the last logits rows, in order.
pub fn logit_rows<'x>(
    parts: impl IntoIterator<Item = (usize, usize)> + 'x,
    x: &'x [f32],
    hidden: usize,
) -> impl Iterator<Item = &'x [f32]> {
    let mut end = 0;
    parts.into_iter().map(move |(rows, logits)| {
        end += rows;
        &x[(end - logits.min(rows)) * hidden..end * hidden]
    })
}

/// The final residual rows of `b`'s part a group's last stage sends back to its
/// first: every row where the part scores or pools its prompt, else those that get
/// logits.
pub fn returned_rows(b: &SeqBatch<'_>) -> usize {
    match b.score.is_some() || b.pool.is_some() {
        true => b.tokens.len(),
        false => b.logits.min(b.tokens.len()),
    }
}

/// What every layer of one forward pass shares: the kernels' ISA, the thread pool, the
/// batch and each of its tokens' absolute position.
pub(super) struct Step<'a, 'b> {
    pub isa: Isa,
    pub pool: &'a ThreadPool,
    pub batch: &'a [SeqBatch<'b>],
    pub positions: &'a [usize],
}

/// What one stage's pass yields.
pub enum StageOut<'s> {
    /// The logits rows the sequences asked for (a whole model).
    Logits(&'s mut [f32]),
    /// The residual stream after this stage's layers, every row of the batch: for the
    /// next stage, or from the last one the rows that get logits on the first
    /// ([`Model::head_logits`]).
    Hidden(&'s [f32]),
}

impl Model {
    /// Runs `batch` through the model, writing its K/V into `kv`. Returns the logits
    /// rows the sequences asked for, `vocab_size` values each, in batch order.
    /// `on_layer(l, kv)` is called once layer `l`'s K/V are written for the whole batch;
    /// returning `false` stops the pass there (a cancelled prefill) and yields `None`.
    /// The model must be whole (a stage runs through [`Model::forward_stage`]).
    pub fn forward<'s>(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        batch: &[SeqBatch<'_>],
        kv: &mut KvStorage,
        s: &'s mut ForwardScratch,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> Option<&'s mut [f32]> {
        debug_assert!(self.embd.is_some() && self.head.is_some(), "forward on a pipeline stage");
        match self.forward_stage(isa, pool, batch, &[], kv, s, on_layer)? {
            StageOut::Logits(rows) => Some(rows),
            StageOut::Hidden(_) => None,
        }
    }

    /// [`Model::forward`] for any stage: the first embeds the batch's tokens, a later one
    /// starts from `x_in`, the residual stream the stage before it yielded (every row of
    /// the batch). Layer `l` of `on_layer` and of `kv` counts from this stage's first.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_stage<'s>(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        batch: &[SeqBatch<'_>],
        x_in: &[f32],
        kv: &mut KvStorage,
        s: &'s mut ForwardScratch,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> Option<StageOut<'s>> {
        let h = self.cfg.hidden;
        let positions: Vec<usize> =
            batch.iter().flat_map(|b| (0..b.tokens.len()).map(move |j| b.start_pos + j)).collect();
        fit(&mut s.x, positions.len() * h);
        match &self.embd {
            Some(embd) => {
                for (i, tok) in batch.iter().flat_map(|b| b.tokens.iter()).enumerate() {
                    embd.row(*tok, &mut s.x[i * h..(i + 1) * h]);
                }
            }
            None => s.x.copy_from_slice(x_in.get(..positions.len() * h)?),
        }
        let step = Step { isa, pool, batch, positions: &positions };
        if !self.body.run(&self.cfg, &step, kv, s, on_layer) {
            return None;
        }
        Some(match &self.head {
            Some(head) if self.layers.heads(self.cfg.n_layers) => {
                StageOut::Logits(self.logits(head, isa, pool, batch, s))
            }
            _ => StageOut::Hidden(&s.x),
        })
    }

    /// The first stage's outputs of `batch` from `rows`, the final residual rows the
    /// last stage returned (each part's [`returned_rows`], in order): its logits rows,
    /// prompt scores and pooled rows, through the output norm and projection a whole
    /// model applies to the same rows, so the same values. `None` on a stage without
    /// the output head.
    pub fn head_logits<'s>(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        batch: &[SeqBatch<'_>],
        rows: &[f32],
        s: &'s mut ForwardScratch,
    ) -> Option<&'s mut [f32]> {
        let head = self.head.as_ref()?;
        s.x.clear();
        s.x.extend_from_slice(rows);
        Some(self.outputs(head, (isa, pool), batch, returned_rows, s))
    }

    /// A whole model's outputs of `batch`, from every row of the step in `s.x`.
    fn logits<'s>(
        &self,
        head: &Head,
        isa: Isa,
        pool: &ThreadPool,
        batch: &[SeqBatch<'_>],
        s: &'s mut ForwardScratch,
    ) -> &'s mut [f32] {
        self.outputs(head, (isa, pool), batch, |b| b.tokens.len(), s)
    }

    /// The logits rows, prompt scores and pooled rows of `batch` from the final
    /// residual rows in `s.x`, where each part has `rows_in(part)` rows (its last ones).
    fn outputs<'s>(
        &self,
        head: &Head,
        (isa, pool): (Isa, &ThreadPool),
        batch: &[SeqBatch<'_>],
        rows_in: impl Fn(&SeqBatch<'_>) -> usize,
        s: &'s mut ForwardScratch,
    ) -> &'s mut [f32] {
        s.last.clear();
        for row in logit_rows(batch.iter().map(|b| (rows_in(b), b.logits)), &s.x, self.cfg.hidden) {
            s.last.extend_from_slice(row);
        }
        self.score_rows(head, isa, pool, batch, &rows_in, s);
        self.pool_rows(head, pool, batch, &rows_in, s);
        self.project(head, isa, pool, s)
    }

    /// The logits of the rows in `s.last`: the output norm, the projection, the cap.
    fn project<'s>(&self, head: &Head, isa: Isa, pool: &ThreadPool, s: &'s mut ForwardScratch) -> &'s mut [f32] {
        let (h, v) = (self.cfg.hidden, self.cfg.vocab_size);
        let n = s.last.len() / h;
        norm_rows(pool, &s.last, &head.norm, self.cfg.rms_eps, h, &mut s.h);
        fit(&mut s.logits, n * v);
        head.lm_head.forward(isa, pool, &s.h[..n * h], n, &mut s.logits, &mut s.lin);
        self.soft_cap(&mut s.logits[..n * v]);
        &mut s.logits[..n * v]
    }

    /// Prompt scoring: logits for the rows that asked, a few rows at a time, each
    /// reduced at once to the logprob of the token that follows it. Every row goes
    /// through the same kernels as a sampled row, so scores do not depend on the batch.
    fn score_rows(
        &self,
        head: &Head,
        isa: Isa,
        pool: &ThreadPool,
        batch: &[SeqBatch<'_>],
        rows_in: &dyn Fn(&SeqBatch<'_>) -> usize,
        s: &mut ForwardScratch,
    ) {
        let (h, v) = (self.cfg.hidden, self.cfg.vocab_size);
        let mut start = 0;
        for b in batch {
            let first_row = start;
            start += rows_in(b);
            let Some(sc) = &b.score else { continue };
            let rows = sc.targets.len().min(b.tokens.len());
            let mut scores = Vec::with_capacity(rows);
            for lo in (0..rows).step_by(SCORE_ROWS) {
                let n = SCORE_ROWS.min(rows - lo);
                let x = &s.x[(first_row + lo) * h..(first_row + lo + n) * h];
                norm_rows(pool, x, &head.norm, self.cfg.rms_eps, h, &mut s.h);
                fit(&mut s.logits, n * v);
                head.lm_head.forward(isa, pool, &s.h[..n * h], n, &mut s.logits, &mut s.lin);
                self.soft_cap(&mut s.logits[..n * v]);
                for (j, row) in s.logits[..n * v].chunks_exact(v).enumerate() {
                    scores.push(crate::sampler::score(row, sc.targets[lo + j], sc.top));
                }
            }
            sc.out.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(scores);
        }
    }
}

impl Model {
    /// Embeddings: each pooling part's prompt rows through the output norm, summed
    /// into its sum, or its last row kept. The norm is the row-wise kernel every row
    /// takes, so a prompt's embedding does not depend on the batch.
    fn pool_rows(
        &self,
        head: &Head,
        pool: &ThreadPool,
        batch: &[SeqBatch<'_>],
        rows_in: &dyn Fn(&SeqBatch<'_>) -> usize,
        s: &mut ForwardScratch,
    ) {
        let h = self.cfg.hidden;
        let mut start = 0;
        for b in batch {
            let first_row = start;
            start += rows_in(b);
            let Some(p) = &b.pool else { continue };
            let (from, to) = match p.rows {
                Pooled::Sum(n) => (first_row, first_row + n.min(b.tokens.len())),
                Pooled::Row(i) if i < b.tokens.len() => (first_row + i, first_row + i + 1),
                Pooled::Row(_) => continue,
            };
            if to <= from {
                continue;
            }
            norm_rows(pool, &s.x[from * h..to * h], &head.norm, self.cfg.rms_eps, h, &mut s.h);
            let mut out = p.out.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            out.resize(h, 0.0);
            match p.rows {
                Pooled::Row(_) => out.copy_from_slice(&s.h[..h]),
                Pooled::Sum(_) => {
                    for row in s.h[..(to - from) * h].chunks_exact(h) {
                        out.iter_mut().zip(row).for_each(|(o, x)| *o += x);
                    }
                }
            }
        }
    }

    /// Final logit soft-capping, where the architecture has it.
    fn soft_cap(&self, logits: &mut [f32]) {
        if let Some(cap) = self.cfg.gemma3.as_ref().and_then(|g| g.final_logit_softcap) {
            for x in logits {
                *x = cap * (*x / cap).tanh();
            }
        }
    }
}
