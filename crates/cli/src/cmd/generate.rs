//! `pdserve generate`: one prompt through the engine, streamed to stdout.

use anyhow::{bail, Context};
use pdserve_engine::batch::{Engine, EngineConfig, FinishReason};
use pdserve_engine::chat::ChatMessage;
use pdserve_types::{RequestId, SamplingParams};
use std::io::Write;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// `default`, a model `pdserve pull --list` names, or a path to a GGUF file or
    /// safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// The prompt text (with --chat, the user's message).
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probabilities add up to this (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Sample among the k most likely tokens only (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Seed of the sampler: the same seed, prompt and settings give the same tokens.
    #[arg(long)]
    seed: Option<u64>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.prompt.is_empty() {
        bail!("--prompt is empty");
    }
    let m = super::load_model(&a.model)?;
    let prompt_ids = if a.chat {
        let text = m.chat.render(&[ChatMessage::new("user", a.prompt.clone())], true).context("chat template")?;
        m.tokenizer.encode(&text, true)
    } else if m.tokenizer.add_bos() {
        m.tokenizer.encode_with_bos(&a.prompt, false)
    } else {
        m.tokenizer.encode(&a.prompt, false)
    };
    let params = SamplingParams {
        max_tokens: a.max_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        ..Default::default()
    }
    .validate()?;
    let threads = a.threads.unwrap_or_else(default_threads);
    let cfg = EngineConfig { threads, ..Default::default() };
    let mut engine = Engine::new(m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec());
    engine.add(RequestId(1), prompt_ids.clone(), params)?;
    let mut dec = m.tokenizer.stream_decoder();
    let mut out = std::io::stdout().lock();
    let (start, mut first, mut n) = (Instant::now(), None, 0usize);
    while engine.has_work() {
        for o in engine.step() {
            first.get_or_insert_with(Instant::now);
            n += 1;
            let eog = o.finish == Some(FinishReason::Stop) && m.tokenizer.is_eog(o.sampled.token);
            if !eog {
                out.write_all(dec.push(o.sampled.token).as_bytes())?;
                out.flush()?;
            }
        }
    }
    out.write_all(dec.finish().as_bytes())?;
    writeln!(out)?;
    let first = first.unwrap_or(start);
    let decode_s = first.elapsed().as_secs_f64();
    eprintln!(
        "[{} prompt tokens, {} generated; prefill {:.0} tok/s, decode {:.1} tok/s, {} threads]",
        prompt_ids.len(),
        n,
        prompt_ids.len() as f64 / (first - start).as_secs_f64().max(1e-9),
        (n.saturating_sub(1)) as f64 / decode_s.max(1e-9),
        threads
    );
    Ok(())
}

pub fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
