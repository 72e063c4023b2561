//! Request migration: a request whose worker is lost mid-stream moves to another
//! worker and the client's stream goes on.
//!
//! The router keeps the tokens it has forwarded. When the stream fails with
//! [`ServeError::WorkerLost`] (or [`ServeError::KvLost`]: its KV never landed on
//! its decode worker), the request is routed again with its prompt plus those
//! tokens (token replay: the new worker prefills them, no KV is recovered) and
//! `max_tokens` less what was sent. Each token depends only on the tokens before it
//! under greedy decoding, so the client sees no duplicate, no gap, and the text an
//! uninterrupted run gives. Sampled requests continue validly, but from a new random
//! stream. Every request may move at most `max` times.
//!
//! A worker that leaves decode hands its running sequences back
//! ([`ServeError::Moved`]); each is routed again the same way, but prefilled on that
//! worker, whose prefix cache holds the sequence's KV: only the last partial block is
//! computed, and the rest is shipped to the new decoder (no re-prefill). Like a
//! stale-epoch refusal below, this is planned and not counted against `max`.
//!
//! A call refused for a stale epoch ([`ServeError::StaleEpoch`]: its worker switched
//! role after the router looked) is routed again the same way, with the router's view
//! updated by the refusal. Nothing ran for it, so this is not counted against `max`;
//! it is bounded on its own by [`REROUTES`].

use crate::relay::forward;
use crate::Router;
use pdserve_protocol::{Event, Generate, GenerateRequest, ServeError, TokenStream, Usage};
use pdserve_types::{DraftRecord, RequestId, TokenId};
use std::sync::Arc;
use tokio::time::Instant;
use tracing::Instrument;

/// The label for a call refused because its worker switched role.
const STALE_EPOCH: &str = "stale_epoch";
/// The label for a sequence handed back by a worker that left decode.
const ROLE_SWITCH: &str = "role_switch";
/// Re-routes per request after stale-epoch refusals: each one teaches the router a
/// newer role, so more would mean roles changing faster than requests are routed.
const REROUTES: u32 = 4;

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
        let mut reroutes = REROUTES;
        let first = loop {
            match self.router.generate(req.clone()) {
                Err(ServeError::StaleEpoch { .. }) if reroutes > 0 => {
                    reroutes -= 1;
                    self.router.telemetry.migrated(STALE_EPOCH);
                }
                other => break other?,
            }
        };
        let (client, stream) = TokenStream::for_request(&req.params);
        self.router.signals.arrived(req.prompt.len(), req.params.max_tokens as usize);
        let job = Job {
            router: self.router.clone(),
            left: self.max,
            reroutes,
            sent: Vec::new(),
            drafts: None,
            req,
            attempts: 0,
            moves: 0,
            arrived: Instant::now(),
            first: None,
        };
        let rt = self.router.runtime.clone();
        rt.spawn(job.run(first, client).instrument(tracing::Span::current()));
        Ok(stream)
    }

    fn ready(&self) -> bool {
        self.router.ready()
    }
}

/// The request `req` routed again (the `attempt`th time) after `sent` went to its
/// client: its prompt extended by them and its limits less them (token replay), with
/// the drafts record its last worker handed back. Before the first token it starts
/// over as it came, under a new id.
fn replayed(req: &GenerateRequest, attempt: u32, sent: &[TokenId], drafts: Option<DraftRecord>) -> GenerateRequest {
    let mut req = req.clone();
    req.id = RequestId(req.id.0.wrapping_add(0x9e37_79b9_7f4a_7c15_u64.wrapping_mul(u64::from(attempt))));
    let done = sent.len() as u32;
    if done == 0 {
        return req;
    }
    req.prompt.extend_from_slice(sent);
    req.params.max_tokens = req.params.max_tokens.saturating_sub(done);
    req.params.min_tokens = req.params.min_tokens.saturating_sub(done);
    req.params.prompt_logprobs = None;
    req.params.embed = None;
    // The new worker's matcher consumes the tokens sent before going on.
    if let Some(g) = req.params.grammar.as_mut() {
        g.replayed += done;
    }
    req.params.drafts_so_far = drafts;
    req
}

/// One request as the client sees it, across the workers that serve it.
struct Job {
    router: Arc<Router>,
    /// The request as the client sent it.
    req: GenerateRequest,
    /// Tokens forwarded to the client so far.
    sent: Vec<TokenId>,
    /// Its record of drafted tokens, as its worker last said (on its stream, or
    /// handing it back).
    drafts: Option<DraftRecord>,
    /// Moves still allowed.
    left: u32,
    /// Re-routes after stale-epoch refusals still allowed.
    reroutes: u32,
    /// Times it was routed again, and how many of those replayed sent tokens.
    attempts: u32,
    moves: u32,
    /// When it came, and when its first token left (the planner's signals).
    arrived: Instant,
    first: Option<Instant>,
}

/// What a job does with an event from its worker's stream.
enum Next {
    /// Sends it on to the client.
    Forward(Event),
    /// Nothing for the client (kept, or already had).
    Keep,
    /// Goes on with the request's stream from another worker.
    Moved(TokenStream),
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
            match self.on_event(ev) {
                Next::Forward(ev) => {
                    if !forward(&client, ev, stall).await {
                        return;
                    }
                }
                Next::Keep => {}
                Next::Moved(next) => inner = next,
            }
        }
    }

    fn on_event(&mut self, ev: Event) -> Next {
        let moved = |r: Result<TokenStream, ServeError>| match r {
            Ok(next) => Next::Moved(next),
            Err(e) => Next::Forward(Event::Failed(e)),
        };
        match ev {
            Event::Failed(e @ (ServeError::WorkerLost(_) | ServeError::KvLost(_))) if self.left > 0 => {
                self.left -= 1;
                moved(self.resume(&e.to_string(), e.kind(), None))
            }
            Event::Failed(ServeError::Moved { worker, drafts }) if self.reroutes > 0 => {
                moved(self.handed_back(&worker, drafts))
            }
            Event::Failed(e @ ServeError::StaleEpoch { .. }) if self.reroutes > 0 => {
                self.reroutes -= 1;
                moved(self.resume(&e.to_string(), STALE_EPOCH, None))
            }
            // The new worker scores the replayed prompt again: the client has its scores.
            Event::Prompt(_) | Event::Embedding(_) if self.moves > 0 => Next::Keep,
            // Kept for the next worker, should this one be lost.
            Event::Drafts(d) => {
                self.drafts = Some(d);
                Next::Keep
            }
            Event::Token(t) => {
                self.sent.push(t.token);
                self.first.get_or_insert_with(Instant::now);
                Next::Forward(Event::Token(t))
            }
            Event::Done { reason, usage } => {
                self.report(false);
                Next::Forward(Event::Done { reason, usage: self.usage(usage) })
            }
            Event::Failed(e) => {
                self.report(true);
                Next::Forward(Event::Failed(e))
            }
            other => Next::Forward(other),
        }
    }

    /// Routes the request again from `worker`, which left decode and handed it back
    /// with its record of drafts.
    fn handed_back(&mut self, worker: &str, drafts: Option<DraftRecord>) -> Result<TokenStream, ServeError> {
        self.reroutes -= 1;
        self.drafts = drafts.or(self.drafts);
        self.resume(&format!("{worker} left decode"), ROLE_SWITCH, Some(worker))
    }

    /// Routes the request again, its prompt extended by the tokens already sent; with
    /// `prefill_on`, prefilled there (where its KV is cached).
    fn resume(&mut self, why: &str, reason: &'static str, prefill_on: Option<&str>) -> Result<TokenStream, ServeError> {
        self.attempts += 1;
        let done = self.sent.len() as u32;
        let req = replayed(&self.req, self.attempts, &self.sent, self.drafts);
        if done > 0 {
            self.moves += 1;
        }
        match prefill_on {
            Some(_) => tracing::info!(reason = why, tokens_sent = done, "moving the request to another worker"),
            None => tracing::warn!(reason = why, tokens_sent = done, "moving the request to another worker"),
        }
        self.router.telemetry.migrated(reason);
        self.router.route(req, prefill_on)
    }

    /// Tells the planner's signals how the request went.
    fn report(&self, failed: bool) {
        let ttft = self.first.map(|f| (f - self.arrived).as_secs_f64());
        let n = self.sent.len();
        let tpot = self.first.filter(|_| n > 1).map(|f| f.elapsed().as_secs_f64() / (n - 1) as f64);
        self.router.signals.ended(n, self.req.params.max_tokens as usize, ttft, tpot, failed);
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
    use pdserve_types::SamplingParams;

    #[test]
    fn usage_counts_replayed_tokens_as_completion() {
        // 3 tokens before the move, 2 after: the final stream's usage says prompt 7
        // (4 + 3 replayed), completion 2; the client's request had 4 and got 5.
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let router = Arc::new(Router::new([], crate::Mode::Aggregated, Default::default(), rt.handle().clone()));
        let req = GenerateRequest {
            fence: None,
            id: RequestId(1),
            tag: pdserve_protocol::RequestTag("t".into()),
            prompt: vec![1, 2, 3, 4],
            params: Default::default(),
            trace: Default::default(),
        };
        let (arrived, first) = (Instant::now(), None);
        let sent = vec![9, 9, 9, 8, 8];
        let job = Job { router, req, sent, drafts: None, left: 0, reroutes: 0, attempts: 1, moves: 1, arrived, first };
        let u = job.usage(Usage { prompt_tokens: 7, completion_tokens: 2, cached_tokens: 6 });
        assert_eq!(u, Usage { prompt_tokens: 4, completion_tokens: 5, cached_tokens: 4 });
    }

    #[test]
    fn a_replayed_request_carries_its_tokens_limits_and_drafts_record() {
        let params = SamplingParams { max_tokens: 10, min_tokens: 4, ..Default::default() };
        let req = GenerateRequest {
            fence: None,
            id: RequestId(1),
            tag: pdserve_protocol::RequestTag("t".into()),
            prompt: vec![1, 2],
            params,
            trace: Default::default(),
        };
        let record = Some(DraftRecord { tried: 12, accepted: 9 });
        // (tokens sent, record handed back) → (prompt, max_tokens, min_tokens, record)
        type Case<'a> = (&'a [u32], Option<DraftRecord>, &'a [u32], u32, u32, Option<DraftRecord>);
        let table: [Case<'_>; 3] = [
            (&[7, 8, 9], record, &[1, 2, 7, 8, 9], 7, 1, record),
            (&[7], None, &[1, 2, 7], 9, 3, None),
            // Before its first token it starts over as it came.
            (&[], record, &[1, 2], 10, 4, None),
        ];
        for (sent, drafts, prompt, max, min, carried) in table {
            let r = replayed(&req, 1, sent, drafts);
            assert_ne!(r.id, req.id);
            assert_eq!((r.prompt.as_slice(), r.params.max_tokens, r.params.min_tokens), (prompt, max, min));
            assert_eq!(r.params.drafts_so_far, carried, "sent {sent:?}");
        }
    }
}
