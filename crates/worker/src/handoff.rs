//! The worker's half of a KV handoff: what a prefill returns and where its frames go.

use pdserve_engine::batch::KvFrame;
use pdserve_protocol::TokenOut;

/// Receives a prefill's frames, layer by layer, on the prefill worker's thread.
/// Returning `false` aborts the prefill at the next frame (the receiver is gone).
pub type FrameSink = Box<dyn FnMut(KvFrame) -> bool + Send>;

/// Takes an imported frame's buffers back (to the link's pool), so that the next
/// frames decode into memory already mapped instead of freshly allocated.
pub type FrameRecycler = std::sync::Arc<dyn Fn(KvFrame) + Send + Sync>;

/// The first generated token, sampled by the prefill worker.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FirstToken {
    pub token: TokenOut,
    /// The first token already ends the request (EOS, stop id or max_tokens 1).
    pub finished: Option<pdserve_protocol::FinishReason>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Seconds the prefill waited in the worker's queue, then computed.
    pub queued_seconds: f64,
    pub prefill_seconds: f64,
}
