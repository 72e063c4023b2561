//! `perplexity` on the real model: the figure is exp of the mean negative
//! log-likelihood of each chunk's second half, computed here independently one token
//! at a time through the model's forward pass, with the KV cache in each of its
//! dtypes; bad arguments are errors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::kernels::Isa;
use pdserve_engine::kvcache::KvStorage;
use pdserve_engine::loader::{self, LoadedModel};
use pdserve_engine::model::{ForwardScratch, SeqBatch};
use pdserve_engine::perplexity::{perplexity, PerplexityError, PerplexityRun};
use pdserve_engine::threadpool::ThreadPool;
use pdserve_types::KvDtype;

const TEXT: &str = "The quick brown fox jumps over the lazy dog. Prefill and decode run on \
    separate workers, and the key-value cache moves between them over the network. \
    A router decides where each request goes, and a planner decides which role each \
    worker holds. The cache is kept in blocks of sixteen tokens, and blocks that hold \
    the same prefix are shared between requests. When the pool runs out of room, the \
    least recently used blocks are evicted to host memory and then to disk.";

fn model() -> LoadedModel {
    loader::load(&pdserve_engine::models::require_default_model()).unwrap()
}

/// The negative log-likelihoods of `chunk[first + 1..]`, one decode step per token.
fn stepwise_nll(m: &LoadedModel, chunk: &[u32], first: usize, dtype: KvDtype) -> Vec<f64> {
    let pool = ThreadPool::new(1);
    let n_blocks = chunk.len().div_ceil(16);
    let blocks: Vec<u32> = (0..n_blocks as u32).collect();
    let mut kv = KvStorage::with_dtype(&m.model.cfg, n_blocks, 16, dtype);
    let mut s = ForwardScratch::default();
    let mut nll = Vec::new();
    for p in 0..chunk.len() - 1 {
        let b =
            SeqBatch { tokens: &chunk[p..p + 1], start_pos: p, blocks: &blocks, logits: 1, score: None, pool: None };
        let logits = m.model.forward(Isa::detect(), &pool, &[b], &mut kv, &mut s, &mut |_, _| true).unwrap();
        if p >= first {
            let max = logits.iter().cloned().fold(f32::MIN, f32::max);
            let z = logits.iter().map(|x| f64::from(x - max).exp()).sum::<f64>().ln() + f64::from(max);
            nll.push(z - f64::from(logits[chunk[p + 1] as usize]));
        }
    }
    nll
}

fn run(ctx: usize, max_chunks: Option<usize>, kv_dtype: KvDtype) -> PerplexityRun {
    PerplexityRun { ctx, max_chunks, threads: 1, kv_dtype }
}

#[test]
fn perplexity_is_the_mean_likelihood_of_each_chunks_second_half() {
    let m = model();
    for dtype in KvDtype::ALL {
        check(&m, dtype);
    }
}

fn check(m: &LoadedModel, dtype: KvDtype) {
    let ctx = 32;
    // As llama.cpp: BOS first and at the head of every chunk where the model adds one.
    let bos = m.tokenizer.add_bos().then(|| m.tokenizer.bos_id().unwrap());
    let tokens = match bos {
        Some(_) => m.tokenizer.encode_with_bos(TEXT, false),
        None => m.tokenizer.encode(TEXT, false),
    };
    assert!(tokens.len() >= 2 * ctx, "the text must make two chunks");
    let got = perplexity(m, TEXT, run(ctx, Some(2), dtype)).unwrap();
    let mut nll = Vec::new();
    for c in 0..2 {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        nll.extend(stepwise_nll(m, &chunk, ctx / 2, dtype));
    }
    let want = (nll.iter().sum::<f64>() / nll.len() as f64).exp();
    assert_eq!((got.chunks, got.scored), (2, 2 * (ctx - 1 - ctx / 2)));
    assert!((got.ppl / want - 1.0).abs() < 1e-3, "{dtype}: perplexity {} but the stepwise pass gives {want}", got.ppl);
    assert!(got.ppl > 1.0 && got.stderr > 0.0 && got.stderr < got.ppl);
}

#[test]
fn bad_arguments_are_errors() {
    let m = model();
    let f16 = KvDtype::F16;
    assert!(matches!(perplexity(&m, TEXT, run(2, None, f16)), Err(PerplexityError::BadContext { .. })));
    assert!(matches!(perplexity(&m, TEXT, run(1 << 30, None, f16)), Err(PerplexityError::BadContext { .. })));
    assert!(matches!(perplexity(&m, "too short", run(64, None, f16)), Err(PerplexityError::TooShort { .. })));
}
