//! One forward step over a batch: every token of every sequence goes through the same
//! row-wise kernels, and attention reads each sequence's own blocks.

use super::Model;
use crate::kernels::attention::{self, AttnScratch, Queries};
use crate::kernels::ops::{add_assign, rms_norm, silu_mul, RopeTable};
use crate::kernels::Isa;
use crate::kvcache::KvStorage;
use crate::threadpool::{DisjointMut, ThreadPool};
use pdserve_types::TokenOut;
use std::cell::RefCell;
use std::sync::Mutex;

/// One sequence's part of a step: new tokens at positions `start_pos..`.
pub struct SeqBatch<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// The sequence's cache blocks, covering every position up to the last new token.
    pub blocks: &'a [u32],
    /// Whether to compute logits for the last new token.
    pub logits: bool,
    /// Score the tokens that follow the first rows (prompt logprobs).
    pub score: Option<Scoring<'a>>,
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
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    lin: super::linear::LinearScratch,
    logits: Vec<f32>,
    last: Vec<f32>,
}

/// Query tokens per attention work item: enough to reuse each converted cache block.
const ATTN_TILE: usize = 16;

thread_local! {
    static ATTN: RefCell<(AttnScratch, Vec<f32>, Vec<f32>)> = RefCell::default();
}

impl Model {
    /// Runs `batch` through the model, writing its K/V into `kv`. Returns the logits of
    /// the sequences that asked for them, `vocab_size` values each, in batch order.
    /// `on_layer(l, kv)` is called once layer `l`'s K/V are written for the whole batch;
    /// returning `false` stops the pass there (a cancelled prefill) and yields `None`.
    pub fn forward<'s>(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        batch: &[SeqBatch<'_>],
        kv: &mut KvStorage,
        s: &'s mut ForwardScratch,
        on_layer: &mut dyn FnMut(usize, &KvStorage) -> bool,
    ) -> Option<&'s mut [f32]> {
        let c = &self.cfg;
        let t: usize = batch.iter().map(|b| b.tokens.len()).sum();
        let positions: Vec<usize> =
            batch.iter().flat_map(|b| (0..b.tokens.len()).map(move |j| b.start_pos + j)).collect();
        let rope = RopeTable::new(c.head_dim, c.rope_theta, &positions);
        s.x.resize(t * c.hidden, 0.0);
        for (i, tok) in batch.iter().flat_map(|b| b.tokens.iter()).enumerate() {
            self.embed(*tok, &mut s.x[i * c.hidden..(i + 1) * c.hidden]);
        }
        for (l, layer) in self.layers.iter().enumerate() {
            self.attention_block(isa, pool, l, layer, batch, &positions, &rope, kv, s);
            if !on_layer(l, kv) {
                return None;
            }
            self.ffn_block(isa, pool, layer, t, s);
        }
        Some(self.logits(isa, pool, batch, s))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        l: usize,
        layer: &super::Layer,
        batch: &[SeqBatch<'_>],
        positions: &[usize],
        rope: &RopeTable,
        kv: &mut KvStorage,
        s: &mut ForwardScratch,
    ) {
        let c = &self.cfg;
        let (t, h, qd, kvd) = (positions.len(), c.hidden, c.q_dim(), c.kv_dim());
        let width = qd + 2 * kvd;
        norm_rows(pool, &s.x, &layer.attn_norm, c.rms_eps, h, &mut s.h);
        s.qkv.resize(t * width, 0.0);
        layer.qkv.forward(isa, pool, &s.h, t, &mut s.qkv, &mut s.lin);
        let mut i = 0;
        for b in batch {
            for j in 0..b.tokens.len() {
                let row = &mut s.qkv[i * width..(i + 1) * width];
                rope.apply(c.rope_style, i, &mut row[..qd + kvd]);
                // Queries meet f16 keys at f16 precision, as in llama.cpp.
                for x in &mut row[..qd] {
                    *x = half::f16::from_f32(*x).to_f32();
                }
                kv.write(l, b.blocks, b.start_pos + j, &row[qd..qd + kvd], &row[qd + kvd..]);
                i += 1;
            }
        }
        s.attn.resize(t * qd, 0.0);
        self.attend_all(isa, pool, l, batch, positions, kv, s);
        s.proj.resize(t * h, 0.0);
        layer.o.forward(isa, pool, &s.attn, t, &mut s.proj, &mut s.lin);
        add_assign(&mut s.x, &s.proj);
    }

    #[allow(clippy::too_many_arguments)]
    fn attend_all(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        l: usize,
        batch: &[SeqBatch<'_>],
        positions: &[usize],
        kv: &KvStorage,
        s: &mut ForwardScratch,
    ) {
        let c = &self.cfg;
        let (qd, hd, n_rep) = (c.q_dim(), c.head_dim, c.n_heads / c.n_kv_heads);
        let width = qd + 2 * c.kv_dim();
        // Work items: (first token index, token count, seq index, kv head).
        let mut items = Vec::new();
        let mut first = 0;
        for (si, b) in batch.iter().enumerate() {
            for start in (0..b.tokens.len()).step_by(ATTN_TILE) {
                let n = ATTN_TILE.min(b.tokens.len() - start);
                items.extend((0..c.n_kv_heads).map(|g| (first + start, n, si, g)));
            }
            first += b.tokens.len();
        }
        let layer_kv = kv.layer(l);
        let qkv = &s.qkv;
        let out = DisjointMut::new(&mut s.attn);
        let scale = 1.0 / (hd as f32).sqrt();
        pool.run(items.len(), &|i| {
            let (t0, n, si, g) = items[i];
            ATTN.with_borrow_mut(|(scr, q, o)| {
                let span = n_rep * hd;
                q.clear();
                for t in t0..t0 + n {
                    q.extend_from_slice(&qkv[t * width + g * span..t * width + (g + 1) * span]);
                }
                o.resize(n * span, 0.0);
                let qs = Queries { q, pos: &positions[t0..t0 + n], n_rep, scale };
                attention::attend(isa, &layer_kv, g, batch[si].blocks, &qs, o, scr);
                for (k, t) in (t0..t0 + n).enumerate() {
                    // SAFETY: items own distinct (token, kv head) pairs, so these
                    // ranges never overlap.
                    let dst = unsafe { out.part(t * qd + g * span..t * qd + (g + 1) * span) };
                    dst.copy_from_slice(&o[k * span..(k + 1) * span]);
                }
            });
        });
    }

    fn ffn_block(&self, isa: Isa, pool: &ThreadPool, layer: &super::Layer, t: usize, s: &mut ForwardScratch) {
        let c = &self.cfg;
        let (h, f) = (c.hidden, c.ffn_hidden);
        norm_rows(pool, &s.x, &layer.ffn_norm, c.rms_eps, h, &mut s.h);
        s.gu.resize(t * 2 * f, 0.0);
        layer.gate_up.forward(isa, pool, &s.h, t, &mut s.gu, &mut s.lin);
        s.act.resize(t * f, 0.0);
        let act = DisjointMut::new(&mut s.act);
        let gu = &s.gu;
        pool.for_ranges(t, pool.threads().min(t), &|r| {
            for i in r {
                // SAFETY: each task owns its rows.
                let dst = unsafe { act.part(i * f..(i + 1) * f) };
                silu_mul(&gu[i * 2 * f..i * 2 * f + f], &gu[i * 2 * f + f..(i + 1) * 2 * f], dst);
            }
        });
        s.proj.resize(t * h, 0.0);
        layer.down.forward(isa, pool, &s.act, t, &mut s.proj, &mut s.lin);
        add_assign(&mut s.x, &s.proj);
    }

    fn logits<'s>(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        batch: &[SeqBatch<'_>],
        s: &'s mut ForwardScratch,
    ) -> &'s mut [f32] {
        let (h, v) = (self.cfg.hidden, self.cfg.vocab_size);
        s.last.clear();
        let mut end = 0;
        for b in batch {
            end += b.tokens.len();
            if b.logits && !b.tokens.is_empty() {
                s.last.extend_from_slice(&s.x[(end - 1) * h..end * h]);
            }
        }
        self.score_rows(isa, pool, batch, s);
        let n = s.last.len() / h;
        norm_rows(pool, &s.last, &self.norm, self.cfg.rms_eps, h, &mut s.h);
        s.logits.resize(n * v, 0.0);
        self.lm_head.forward(isa, pool, &s.h[..n * h], n, &mut s.logits, &mut s.lin);
        &mut s.logits[..n * v]
    }

    /// Prompt scoring: logits for the rows that asked, a few rows at a time, each
    /// reduced at once to the logprob of the token that follows it. Every row goes
    /// through the same kernels as a sampled row, so scores do not depend on the batch.
    fn score_rows(&self, isa: Isa, pool: &ThreadPool, batch: &[SeqBatch<'_>], s: &mut ForwardScratch) {
        let (h, v) = (self.cfg.hidden, self.cfg.vocab_size);
        let mut start = 0;
        for b in batch {
            let first_row = start;
            start += b.tokens.len();
            let Some(sc) = &b.score else { continue };
            let rows = sc.targets.len().min(b.tokens.len());
            let mut scores = Vec::with_capacity(rows);
            for lo in (0..rows).step_by(SCORE_ROWS) {
                let n = SCORE_ROWS.min(rows - lo);
                let x = &s.x[(first_row + lo) * h..(first_row + lo + n) * h];
                norm_rows(pool, x, &self.norm, self.cfg.rms_eps, h, &mut s.h);
                s.logits.resize(n * v, 0.0);
                self.lm_head.forward(isa, pool, &s.h[..n * h], n, &mut s.logits, &mut s.lin);
                for (j, row) in s.logits[..n * v].chunks_exact(v).enumerate() {
                    scores.push(crate::sampler::score(row, sc.targets[lo + j], sc.top));
                }
            }
            sc.out.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(scores);
        }
    }
}

/// RMS-normalizes every row of `x` into `out`, rows split over the pool.
fn norm_rows(pool: &ThreadPool, x: &[f32], w: &[f32], eps: f32, h: usize, out: &mut Vec<f32>) {
    let t = x.len() / h;
    out.resize(x.len(), 0.0);
    let dst = DisjointMut::new(out);
    pool.for_ranges(t, pool.threads().min(t), &|r| {
        for i in r {
            // SAFETY: each task owns its rows.
            rms_norm(&x[i * h..(i + 1) * h], w, eps, unsafe { dst.part(i * h..(i + 1) * h) });
        }
    });
}
