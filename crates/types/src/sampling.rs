use crate::{Grammar, TokenId};
use serde::{Deserialize, Serialize};

/// How to pick each next token and when to stop. Build one with struct update syntax
/// from `SamplingParams::default()`, then call [`SamplingParams::validate`]; engines
/// only accept validated parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Upper bound on generated tokens.
    pub max_tokens: u32,
    /// Generated tokens before EOS or stop strings may end the sequence.
    pub min_tokens: u32,
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// 1 disables nucleus sampling.
    pub top_p: f32,
    /// 0 disables min-p.
    pub min_p: f32,
    /// 1 disables; > 1 discourages tokens already in prompt or output (CTRL style).
    pub repetition_penalty: f32,
    /// OpenAI frequency penalty over generated tokens, in [-2, 2].
    pub frequency_penalty: f32,
    /// OpenAI presence penalty over generated tokens, in [-2, 2].
    pub presence_penalty: f32,
    /// Same seed, same prompt, same parameters: same tokens.
    pub seed: Option<u64>,
    /// Keep generating past the end-of-sequence token (benchmarks use this).
    pub ignore_eos: bool,
    /// Also report this many top alternatives per generated token (0 = only the chosen
    /// token's logprob when `logprobs` is set).
    pub top_logprobs: u32,
    /// Report the chosen token's logprob.
    pub logprobs: bool,
    /// Also score the prompt: each prompt token's logprob given the tokens before it,
    /// with this many top alternatives. Such a request computes its whole prompt (no
    /// prefix-cache reuse), since cached positions have no logits.
    #[serde(default)]
    pub prompt_logprobs: Option<u32>,
    /// Also return the prompt's final hidden states pooled into one vector (an
    /// embedding). Such a request too computes its whole prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embed: Option<Pooling>,
    pub stop: StopCondition,
    /// Added to the logits of these tokens before sampling (OpenAI's `logit_bias`,
    /// each in [-100, 100]); sorted by id, each id once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(TokenId, f32)>,
    /// The output must match this grammar: tokens that cannot continue it are
    /// masked before sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammar: Option<Grammar>,
    /// A moved request's drafts so far, set by the router that moves it (never from a
    /// client's body): its new worker plans the request's drafts from this record
    /// instead of learning it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafts_so_far: Option<DraftRecord>,
}

/// What a request's drafted tokens came to: each one verified was either accepted or
/// the first rejected of its draft.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraftRecord {
    pub tried: u64,
    pub accepted: u64,
}

/// How a prompt's final hidden states (after the output norm) become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The mean over every prompt token.
    Mean,
    /// The last prompt token's.
    Last,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Last => "last",
        }
    }
}

/// Extra ways to end generation besides EOS and `max_tokens`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StopCondition {
    /// Stop as soon as the decoded text contains one; the match itself is not returned.
    pub strings: Vec<String>,
    /// Stop after generating one of these ids; the id itself is not returned as text.
    pub token_ids: Vec<TokenId>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            min_tokens: 0,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
            ignore_eos: false,
            top_logprobs: 0,
            logprobs: false,
            prompt_logprobs: None,
            embed: None,
            stop: StopCondition::default(),
            logit_bias: Vec::new(),
            grammar: None,
            drafts_so_far: None,
        }
    }
}

/// Which parameter is out of range, in words a user can act on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid `{param}`: {reason}")]
pub struct SamplingError {
    pub param: &'static str,
    pub reason: String,
}

/// Most alternatives a request may ask for (OpenAI allows 20).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Stop strings per request (OpenAI allows 4; we are more generous).
pub const MAX_STOP_STRINGS: usize = 16;
/// Bytes of one stop string at most.
pub const MAX_STOP_BYTES: usize = 1024;
/// Largest `logit_bias` magnitude (OpenAI's range).
pub const MAX_LOGIT_BIAS: f32 = 100.0;
/// Biased tokens per request at most (OpenAI allows 300; vLLM more).
pub const MAX_LOGIT_BIAS_TOKENS: usize = 1024;
/// The most `stop_token_ids`: each is banned every step until `min_tokens`.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;

impl SamplingParams {
    /// Whether the request computes its whole prompt, taking nothing from a prefix
    /// cache: it scores the prompt or pools its hidden states, and cached positions
    /// have neither.
    pub fn whole_prompt(&self) -> bool {
        self.prompt_logprobs.is_some() || self.embed.is_some()
    }

    /// Greedy decoding of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        SamplingParams { max_tokens, ..Default::default() }
    }

    /// Checks every range once, so downstream code can trust the values.
    pub fn validate(mut self) -> Result<Self, SamplingError> {
        let err = |param, reason: &str| Err(SamplingError { param, reason: reason.to_string() });
        let finite = |x: f32| x.is_finite();
        if self.max_tokens == 0 {
            return err("max_tokens", "must be at least 1");
        }
        if self.min_tokens > self.max_tokens {
            return err("min_tokens", "must not exceed max_tokens");
        }
        if !finite(self.temperature) || !(0.0..=100.0).contains(&self.temperature) {
            return err("temperature", "must be between 0 and 100");
        }
        if !finite(self.top_p) || self.top_p <= 0.0 || self.top_p > 1.0 {
            return err("top_p", "must be in (0, 1]");
        }
        if !finite(self.min_p) || !(0.0..=1.0).contains(&self.min_p) {
            return err("min_p", "must be in [0, 1]");
        }
        if !finite(self.repetition_penalty) || self.repetition_penalty <= 0.0 {
            return err("repetition_penalty", "must be greater than 0");
        }
        for (name, v) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if !finite(v) || !(-2.0..=2.0).contains(&v) {
                return err(name, "must be between -2 and 2");
            }
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return err("top_logprobs", "must be at most 20");
        }
        if self.prompt_logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return err("prompt_logprobs", "must be at most 20");
        }
        if self.stop.strings.len() > MAX_STOP_STRINGS {
            return err("stop", "at most 16 stop strings");
        }
        if self.stop.strings.iter().any(|s| s.is_empty()) {
            return err("stop", "stop strings must not be empty");
        }
        if self.stop.strings.iter().any(|s| s.len() > MAX_STOP_BYTES) {
            return err("stop", "a stop string may be at most 1024 bytes");
        }
        if self.stop.token_ids.len() > MAX_STOP_TOKEN_IDS {
            return err("stop_token_ids", "at most 1024 stop token ids");
        }
        // Sorted and distinct: the engine looks them up every step.
        self.stop.token_ids.sort_unstable();
        self.stop.token_ids.dedup();
        if self.logit_bias.len() > MAX_LOGIT_BIAS_TOKENS {
            return err("logit_bias", "at most 1024 biased tokens");
        }
        if self.logit_bias.iter().any(|&(_, b)| !b.is_finite() || b.abs() > MAX_LOGIT_BIAS) {
            return err("logit_bias", "each bias must be between -100 and 100");
        }
        if self.logit_bias.windows(2).any(|w| w[0].0 >= w[1].0) {
            return err("logit_bias", "token ids must be sorted and distinct");
        }
        if self.drafts_so_far.is_some_and(|d| d.accepted > d.tried) {
            return err("drafts_so_far", "cannot have accepted more drafted tokens than it tried");
        }
        Ok(self)
    }

    /// True when every step takes the most likely token (no randomness involved).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_greedy() {
        let p = SamplingParams::default().validate().unwrap();
        assert!(p.is_greedy());
    }

    #[test]
    fn rejects_out_of_range() {
        let bad = [
            SamplingParams { max_tokens: 0, ..Default::default() },
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { min_p: 1.5, ..Default::default() },
            SamplingParams { presence_penalty: 3.0, ..Default::default() },
            SamplingParams { top_logprobs: 21, ..Default::default() },
            SamplingParams { min_tokens: 20, max_tokens: 10, ..Default::default() },
            SamplingParams { logit_bias: vec![(5, 100.5)], ..Default::default() },
            SamplingParams { logit_bias: vec![(5, f32::NAN)], ..Default::default() },
            SamplingParams { logit_bias: vec![(5, 1.0), (5, 2.0)], ..Default::default() },
            SamplingParams {
                stop: StopCondition { token_ids: (0..=MAX_STOP_TOKEN_IDS as u32).collect(), ..Default::default() },
                ..Default::default()
            },
            SamplingParams { drafts_so_far: Some(DraftRecord { tried: 3, accepted: 4 }), ..Default::default() },
        ];
        for p in bad {
            assert!(p.clone().validate().is_err(), "{p:?} should be rejected");
        }
    }

    #[test]
    fn stop_token_ids_come_out_sorted_and_distinct() {
        let p = SamplingParams {
            stop: StopCondition { token_ids: vec![9, 2, 9, 5, 2], ..Default::default() },
            ..Default::default()
        };
        assert_eq!(p.validate().unwrap().stop.token_ids, vec![2, 5, 9]);
    }
}
