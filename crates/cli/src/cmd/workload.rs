//! The workload flags `bench load` and `pdserve sim` share.

use pdserve_bench::arrivals::ArrivalKind;
use pdserve_bench::lengths::LengthSpec;
use pdserve_bench::load::Sweep;
use pdserve_bench::metrics::Slo;
use pdserve_bench::prompt::TokenRange;
use pdserve_bench::workload::{PrefixOrder, Replies, WorkloadFlags};
use std::path::PathBuf;

/// What `bench load` sends and how (and what `pdserve sim` simulates).
#[derive(clap::Args)]
pub struct WorkloadArgs {
    /// Closed loop at each of these concurrencies (default 1).
    #[arg(long, value_delimiter = ',')]
    pub concurrency: Option<Vec<usize>>,
    /// Open loop at each of these request rates (requests/s) instead.
    #[arg(long, value_delimiter = ',')]
    pub rate: Vec<f64>,
    /// Open-loop arrivals: poisson | gamma.
    #[arg(long, default_value = "poisson")]
    pub arrivals: ArrivalKind,
    /// Gamma shape (1 = Poisson, < 1 burstier).
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Prompt length: N, MIN..MAX (uniform) or MEAN~STD (normal).
    #[arg(long, default_value = "512")]
    pub input_len: LengthSpec,
    /// Output length, same forms (exact: min_tokens = max_tokens, ignore_eos).
    #[arg(long, default_value = "128")]
    pub output_len: LengthSpec,
    /// Number of shared system prefixes (0: none); each request = a prefix + --input-len.
    #[arg(long, default_value_t = 0)]
    pub shared_prefixes: usize,
    /// Tokens per shared prefix.
    #[arg(long, default_value_t = 1024)]
    pub prefix_len: usize,
    /// Which prefix a request takes: `random` (a seeded draw each) or `cycle` (request
    /// i takes prefix i mod N, an LRU's worst case).
    #[arg(long, default_value = "random")]
    pub prefix_order: PrefixOrder,
    /// The fraction of requests that take a shared prefix; the others take as many
    /// tokens of their own in its place (e.g. 0.9: one hot prefix in 90 % of requests).
    #[arg(long, default_value_t = 1.0)]
    pub prefix_share: f64,
    /// Chat users holding multi-turn conversations (0: single requests). Each turn's
    /// prompt is its conversation so far plus a new message of --input-len tokens.
    #[arg(long, default_value_t = 0)]
    pub conversations: usize,
    /// Turns per conversation, in the forms of --input-len.
    #[arg(long, default_value = "5..10")]
    pub turns: LengthSpec,
    /// What stands for a reply in a conversation's later turns: `random` tokens of
    /// its length (any server), or the reply the server `generated` (its token ids,
    /// asked for with vLLM's `return_token_ids`; completions with id prompts only).
    #[arg(long, default_value = "random")]
    pub replies: Replies,
    /// Replay a Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Tokens per trace hash id.
    #[arg(long, default_value_t = 512)]
    pub trace_block_size: usize,
    /// Replay the trace this many times faster.
    #[arg(long, default_value_t = 1.0)]
    pub trace_speedup: f64,
    /// A phase of a shifting workload, LABEL:SECONDS:RATE:ISL/OSL[+ISL/OSL][:sin=PERIOD];
    /// repeat it to play phases back to back as one point (they set its length).
    #[arg(long)]
    pub phase: Vec<pdserve_bench::phases::Phase>,
    /// Token ids are drawn from LO..HI (avoid the special tokens).
    #[arg(long, default_value = "1000..40000")]
    pub token_range: TokenRange,
    /// Seed of the workload: the same seed gives the same prompts and lengths.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Requests per point at most (closed loop: at least 2 × concurrency).
    #[arg(long, default_value_t = 100)]
    pub requests: usize,
    /// Seconds per point at most (issuing stops; requests in flight finish).
    #[arg(long, default_value_t = 120.0)]
    pub seconds: f64,
    /// Goodput SLO on TTFT.
    #[arg(long, default_value_t = 5000.0)]
    pub slo_ttft_ms: f64,
    /// Goodput SLO on TPOT.
    #[arg(long, default_value_t = 50.0)]
    pub slo_tpot_ms: f64,
    /// Requests sent one at a time before measuring.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
}

impl WorkloadArgs {
    pub fn workload(&self) -> anyhow::Result<pdserve_bench::workload::Workload> {
        let flags = WorkloadFlags {
            input: self.input_len,
            output: self.output_len,
            shared_prefixes: self.shared_prefixes,
            prefix_len: self.prefix_len,
            prefix_order: self.prefix_order,
            prefix_share: self.prefix_share,
            conversations: self.conversations,
            turns: self.turns,
            replies: self.replies,
            trace: self.trace.clone(),
            trace_block_size: self.trace_block_size,
            phases: self.phase.clone(),
            range: self.token_range,
            seed: self.seed,
        };
        Ok(flags.build()?)
    }

    pub fn sweep(&self) -> anyhow::Result<Sweep> {
        let trace_speedup = self.trace.as_ref().map(|_| self.trace_speedup);
        let (c, r) = (self.concurrency.clone(), self.rate.clone());
        let phased = !self.phase.is_empty();
        Ok(Sweep::from_flags(c, r, self.arrivals, self.burstiness, trace_speedup, phased)?)
    }

    pub fn slo(&self) -> Slo {
        Slo { ttft_ms: self.slo_ttft_ms, tpot_ms: self.slo_tpot_ms }
    }
}
