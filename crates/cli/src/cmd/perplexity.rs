//! `pdserve perplexity`: a model's perplexity on a text file, measured as llama.cpp's
//! `llama-perplexity` does (see `pdserve_engine::perplexity`).

use anyhow::Context;
use pdserve_engine::perplexity::PerplexityRun;

#[derive(clap::Args)]
pub struct Args {
    /// `default`, a model `pdserve pull --list` names, or a path to a GGUF file or
    /// safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// The text to measure on (UTF-8).
    #[arg(long)]
    file: std::path::PathBuf,
    /// Tokens per chunk; the second half of each is scored (llama.cpp's `-c`).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Measure the first N chunks only (llama.cpp's `--chunks`).
    #[arg(long)]
    chunks: Option<usize>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// How the KV cache stores K and V: f16 | q8_0 | q4_0 (llama.cpp's -ctk/-ctv).
    #[arg(long, default_value = "f16")]
    kv_cache_dtype: pdserve_types::KvDtype,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("cannot read {}", a.file.display()))?;
    let m = super::load_model(&a.model)?;
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let run = PerplexityRun { ctx: a.ctx, max_chunks: a.chunks, threads, kv_dtype: a.kv_cache_dtype };
    let p = pdserve_engine::perplexity::perplexity(&m, &text, run)?;
    println!(
        "{}: {} chunks of {} tokens, {} tokens scored, {} KV cache: PPL = {:.4} +/- {:.4}",
        m.name, p.chunks, p.ctx, p.scored, a.kv_cache_dtype, p.ppl, p.stderr
    );
    Ok(())
}
