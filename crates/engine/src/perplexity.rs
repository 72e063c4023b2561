//! Perplexity of a model on a text, measured as llama.cpp's `llama-perplexity` does,
//! so the two tools' figures compare: the text is tokenized once (BOS first where the
//! model adds one), cut into chunks of `ctx` tokens, each chunk's first token replaced
//! by BOS; within a chunk the first half is context and every later token is scored
//! by the logits of the position before it. PPL = exp(mean negative log-likelihood).

use crate::batch::BLOCK_SIZE as BLOCK;
use crate::kvcache::KvStorage;
use crate::loader::LoadedModel;
use crate::model::{ForwardScratch, Scoring, SeqBatch};
use crate::threadpool::ThreadPool;
use pdserve_types::KvDtype;
use std::sync::Mutex;

/// What [`perplexity`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Perplexity {
    pub ctx: usize,
    pub chunks: usize,
    /// Tokens scored over all chunks.
    pub scored: usize,
    pub ppl: f64,
    /// One standard error of `ppl`, from the spread of the tokens' log-likelihoods
    /// (llama.cpp's estimate).
    pub stderr: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    #[error("--ctx must be at least 4 and at most the model's context length {max}; got {ctx}")]
    BadContext { ctx: usize, max: usize },
    #[error("the text is {tokens} tokens, less than one chunk of {ctx}")]
    TooShort { tokens: usize, ctx: usize },
    #[error("the forward pass failed: {0}")]
    Forward(String),
    #[error("{0}")]
    Cache(String),
}

/// How [`perplexity`] runs: chunks of `ctx` tokens (at most `max_chunks` of them, all
/// when `None`) on `threads` threads, the KV cache stored as `kv_dtype`.
#[derive(Debug, Clone, Copy)]
pub struct PerplexityRun {
    pub ctx: usize,
    pub max_chunks: Option<usize>,
    pub threads: usize,
    pub kv_dtype: KvDtype,
}

/// Measures `m` on `text` as `run` says.
pub fn perplexity(m: &LoadedModel, text: &str, run: PerplexityRun) -> Result<Perplexity, PerplexityError> {
    let PerplexityRun { ctx, max_chunks, threads, kv_dtype } = run;
    crate::kvcache::check_dtype(&m.model.cfg, kv_dtype).map_err(PerplexityError::Cache)?;
    let max = m.model.cfg.context_length;
    if ctx < 4 || ctx > max {
        return Err(PerplexityError::BadContext { ctx, max });
    }
    let tokens =
        if m.tokenizer.add_bos() { m.tokenizer.encode_with_bos(text, false) } else { m.tokenizer.encode(text, false) };
    let chunks = (tokens.len() / ctx).min(max_chunks.unwrap_or(usize::MAX));
    if chunks == 0 {
        return Err(PerplexityError::TooShort { tokens: tokens.len(), ctx });
    }
    let pool = ThreadPool::new(threads.max(1));
    let (mut sum, mut sum2, mut n) = (0f64, 0f64, 0usize);
    for c in 0..chunks {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if let (true, Some(bos)) = (m.tokenizer.add_bos(), m.tokenizer.bos_id()) {
            chunk[0] = bos;
        }
        for nll in chunk_nll(m, &pool, &chunk, kv_dtype)? {
            (sum, sum2, n) = (sum + nll, sum2 + nll * nll, n + 1);
        }
    }
    let mean = sum / n as f64;
    let var = (sum2 / n as f64 - mean * mean).max(0.0);
    let ppl = mean.exp();
    let stderr = if n > 1 { ppl * (var / (n - 1) as f64).sqrt() } else { 0.0 };
    Ok(Perplexity { ctx, chunks, scored: n, ppl, stderr })
}

/// The negative log-likelihoods of the second half of `chunk`: the first half goes
/// in as context, then the rest is scored, each token by the row before it.
fn chunk_nll(
    m: &LoadedModel,
    pool: &ThreadPool,
    chunk: &[u32],
    kv_dtype: KvDtype,
) -> Result<Vec<f64>, PerplexityError> {
    let (model, ctx) = (&m.model, chunk.len());
    let first = ctx / 2;
    let n_blocks = ctx.div_ceil(BLOCK);
    let blocks: Vec<u32> = (0..n_blocks as u32).collect();
    let mut kv = KvStorage::with_dtype(&model.cfg, n_blocks, BLOCK, kv_dtype);
    let mut s = ForwardScratch::default();
    let isa = crate::kernels::Isa::detect();
    let stopped = || PerplexityError::Forward("the pass stopped early".into());
    let context =
        SeqBatch { tokens: &chunk[..first], start_pos: 0, blocks: &blocks, logits: 0, score: None, pool: None };
    model.forward(isa, pool, &[context], &mut kv, &mut s, &mut |_, _| true).ok_or_else(stopped)?;
    let out = Mutex::new(Vec::new());
    let score = Scoring { targets: &chunk[first + 1..], top: 0, out: &out };
    let rest = SeqBatch {
        tokens: &chunk[first..ctx - 1],
        start_pos: first,
        blocks: &blocks,
        logits: 0,
        score: Some(score),
        pool: None,
    };
    model.forward(isa, pool, &[rest], &mut kv, &mut s, &mut |_, _| true).ok_or_else(stopped)?;
    let scores = out.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    Ok(scores.iter().map(|t| -f64::from(t.logprob)).collect())
}
