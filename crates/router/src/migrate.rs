//! Request migration: a request whose worker is lost mid-stream moves to another
//! worker and the client's stream goes on.
//!
//! The router keeps the tokens it has forwarded. When the stream fails with
//! [`ServeError::WorkerLost`], the request is routed again with its prompt plus those
//! tokens (token replay: the new worker prefills them, no KV is recovered) and
//! `max_tokens` less what was sent. Each token depends only on the tokens before it
//! under greedy decoding, so the client sees no duplicate, no gap, and the text an
//! uninterrupted run gives. Sampled requests continue validly, but from a new random
//! stream. Every request may move at most `max` times.

use crate::relay::forward;
use crate::Router;
use pdserve_protocol::{Event, Generate, GenerateRequest, ServeError, TokenStream, Usage};
use pdserve_types::{RequestId, TokenId};
use std::sync::Arc;
use tracing::Instrument;

/// The label of `pdserve_requests_migrated_total` for a lost worker.
const WORKER_LOST: &str = "worker_lost";

/// The router, with requests moved off workers that are lost under them.
pub struct Migrating {
    router: Arc<Router>,
    max: u32,
}

impl Migrating {
    /// At most `max` moves per request; 0 turns migration off.
    pub fn new(router: Arc<Router>, max: u32) -> Self {
        Migrating { router, max }
    }
}

impl Generate for Migrating {
    fn generate(&self, req: GenerateRequest) -> Result<TokenStream, ServeError> {
        let first = self.router.generate(req.clone())?;
        if self.max == 0 {
            return Ok(first);
        }
        let (client, stream) = TokenStream::channel(req.params.max_tokens as usize + 4);
        let job = Job { router: self.router.clone(), left: self.max, sent: Vec::new(), req, moves: 0 };
        let rt = self.router.runtime.clone();
        rt.spawn(job.run(first, client).instrument(tracing::Span::current()));
        Ok(stream)
    }

    fn ready(&self) -> bool {
        self.router.ready()
    }
}

/// One request as the client sees it, across the workers that serve it.
struct Job {
    router: Arc<Router>,
    /// The request as the client sent it.
    req: GenerateRequest,
    /// Tokens forwarded to the client so far.
    sent: Vec<TokenId>,
    /// Moves still allowed.
    left: u32,
    moves: u32,
}

impl Job {
    async fn run(mut self, mut inner: TokenStream, client: pdserve_protocol::EventSender) {
        let stall = self.router.deadlines.client_stall;
        loop {
            let ev = tokio::select! {
                ev = inner.next() => ev,
                _ = client.closed() => return,
            };
            let Some(ev) = ev else { return };
            let ev = match ev {
                Event::Failed(ServeError::WorkerLost(why)) if self.left > 0 => match self.resume(&why) {
                    Ok(next) => {
                        inner = next;
                        continue;
                    }
                    Err(e) => Event::Failed(e),
                },
                // The new worker scores the replayed prompt again: the client has its scores.
                Event::Prompt(_) if self.moves > 0 => continue,
                Event::Token(t) => {
                    self.sent.push(t.token);
                    Event::Token(t)
                }
                Event::Done { reason, usage } => Event::Done { reason, usage: self.usage(usage) },
                other => other,
            };
            if !forward(&client, ev, stall).await {
                return;
            }
        }
    }

    /// Routes the request again, its prompt extended by the tokens already sent.
    fn resume(&mut self, why: &str) -> Result<TokenStream, ServeError> {
        self.left -= 1;
        self.moves += 1;
        let done = self.sent.len() as u32;
        let mut req = self.req.clone();
        req.id = RequestId(self.req.id.0.wrapping_add(0x9e37_79b9_7f4a_7c15_u64.wrapping_mul(u64::from(self.moves))));
        req.prompt.extend_from_slice(&self.sent);
        req.params.max_tokens = req.params.max_tokens.saturating_sub(done);
        req.params.min_tokens = req.params.min_tokens.saturating_sub(done);
        req.params.prompt_logprobs = None;
        // The new worker's matcher consumes the tokens sent before going on.
        if let Some(g) = req.params.grammar.as_mut() {
            g.replayed += done;
        }
        tracing::warn!(reason = why, tokens_sent = done, "worker lost mid-request; moving the request");
        self.router.telemetry.migrated(WORKER_LOST);
        self.router.generate(req)
    }

    /// The usage of the request as the client sent it: the replayed tokens count as
    /// completion, not prompt.
    fn usage(&self, last: Usage) -> Usage {
        if self.moves == 0 {
            return last;
        }
        Usage {
            prompt_tokens: self.req.prompt.len(),
            completion_tokens: self.sent.len(),
            cached_tokens: last.cached_tokens.min(self.req.prompt.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_counts_replayed_tokens_as_completion() {
        // 3 tokens before the move, 2 after: the final stream's usage says prompt 7
        // (4 + 3 replayed), completion 2; the client's request had 4 and got 5.
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let router = Arc::new(Router::new([], crate::Mode::Aggregated, Default::default(), rt.handle().clone()));
        let req = GenerateRequest {
            id: RequestId(1),
            tag: pdserve_protocol::RequestTag("t".into()),
            prompt: vec![1, 2, 3, 4],
            params: Default::default(),
            trace: Default::default(),
        };
        let job = Job { router, req, sent: vec![9, 9, 9, 8, 8], left: 0, moves: 1 };
        let u = job.usage(Usage { prompt_tokens: 7, completion_tokens: 2, cached_tokens: 6 });
        assert_eq!(u, Usage { prompt_tokens: 4, completion_tokens: 5, cached_tokens: 4 });
    }
}
