use crate::TokenId;
use serde::{Deserialize, Serialize};

/// One generated token with its logprobs, as the engine samples it and every hop
/// passes it on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenOut {
    pub token: TokenId,
    /// Log-softmax of the raw logits at `token`.
    pub logprob: f32,
    /// The requested number of most likely alternatives, most likely first (ties to
    /// the lower id); empty when none were asked for.
    pub top: Vec<(TokenId, f32)>,
}

/// Why a sequence stopped generating.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// An end-of-generation or stop token (or, decided by the frontend, a stop string).
    Stop,
    /// `max_tokens` or the context length.
    Length,
}
