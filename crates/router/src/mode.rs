//! Routing modes and the `auto` rule.

use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every request prefills and decodes on one worker.
    Aggregated,
    /// Every request prefills on a prefill worker and decodes elsewhere.
    Disaggregated,
    /// Per request: short prompts prefill locally on the decode worker, long ones
    /// remotely.
    Auto,
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "aggregated" => Ok(Mode::Aggregated),
            "disaggregated" => Ok(Mode::Disaggregated),
            "auto" => Ok(Mode::Auto),
            other => Err(format!("unknown mode `{other}` (expected aggregated, disaggregated or auto)")),
        }
    }
}

/// Prompts at most this long prefill on the decode worker: their prefill costs less
/// than a decode step's worth of interference plus the handoff's fixed overhead.
/// (A first rule; the live cost model of DESIGN §2 replaces it.)
pub const LOCAL_PREFILL_MAX_TOKENS: usize = 64;

/// The `auto` decision for a prompt of `prompt_len` uncached tokens when the chosen
/// decode worker has `decode_load` requests in flight: remote when the prompt is long
/// enough to disturb other sequences' decoding.
pub fn prefer_remote(prompt_len: usize, decode_load: usize) -> bool {
    prompt_len > LOCAL_PREFILL_MAX_TOKENS || (decode_load > 0 && prompt_len > LOCAL_PREFILL_MAX_TOKENS / 4)
}
