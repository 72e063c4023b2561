//! Turns a request's [`TokenStream`] into text: detokenizes with a
//! [`StreamDecoder`] (never splitting a character), hides end-of-generation and other
//! special tokens, applies stop strings, counts tokens and records latencies.
//!
//! [`Generation`] owns the stream. Dropping it (the client went away, or a stop string
//! ended the text) drops the stream, which cancels the request on every hop behind us.

use crate::errors::ApiError;
use crate::metrics::{Metrics, Outcome, Phase, PrefixHit};
use crate::observe::{Observer, RequestRecord};
use crate::stop::StopMatcher;
use pdserve_protocol::{Event, FinishReason, ServeError, TokenOut, TokenStream, Trace, Usage};
use pdserve_text::tokenizer::{StreamDecoder, Tokenizer};
use pdserve_types::{SamplingParams, TokenId};
use std::sync::Arc;
use std::time::Instant;

/// One generated token with what the client may ask to see about it.
#[derive(Debug, Clone)]
pub struct TokenInfo {
    pub token: TokenId,
    pub logprob: f32,
    pub top: Vec<(TokenId, f32)>,
    /// Characters of completion text decoded before this token.
    pub text_offset: usize,
}

/// Text and tokens, either one step of the stream or the whole answer.
#[derive(Debug, Default)]
pub struct Output {
    pub text: String,
    /// Filled only when the request asked for logprobs.
    pub tokens: Vec<TokenInfo>,
    /// The ids generated, filled only when the request asked for them.
    pub ids: Vec<TokenId>,
    /// The prompt's scores (tokens 2.. given those before), when asked for.
    pub prompt: Option<Vec<TokenOut>>,
    pub finish: Option<FinishReason>,
    /// The stop string that ended the text, if one did.
    pub stop: Option<String>,
    /// The prompt's pooled hidden states, when the request asked for them.
    pub embedding: Option<Vec<f32>>,
}

impl Output {
    fn append(&mut self, step: Output) {
        self.text.push_str(&step.text);
        self.tokens.extend(step.tokens);
        self.ids.extend(step.ids);
        self.prompt = step.prompt.or(self.prompt.take());
        self.finish = step.finish.or(self.finish);
        self.stop = step.stop.or(self.stop.take());
        self.embedding = step.embedding.or(self.embedding.take());
    }

    /// Nothing a client would see.
    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
            && self.tokens.is_empty()
            && self.ids.is_empty()
            && self.prompt.is_none()
            && self.finish.is_none()
            && self.embedding.is_none()
    }
}

/// Latencies and the outcome of one request. Recorded as tokens arrive; the outcome
/// on drop, `cancelled` unless something else was decided, with one log line.
pub struct Tracker {
    metrics: Metrics,
    mode: Arc<str>,
    /// The request's span: the log line carries its id, route and workers.
    span: tracing::Span,
    start: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    outcome: Option<Outcome>,
    /// Why the request failed, as `ServeError::kind` or the API error's type.
    error: Option<&'static str>,
    /// Counts the request as open until it is answered.
    _open: crate::lifecycle::Open,
    /// What the router learns on the way.
    trace: Trace,
    /// Told when the request is accepted and when it ends.
    observer: Option<(Arc<dyn Observer>, RequestRecord)>,
    /// The model and prompt tokens, once the request is accepted.
    accepted: Option<(String, usize)>,
}

impl Tracker {
    pub(crate) fn new(metrics: Metrics, mode: Arc<str>, span: tracing::Span, open: crate::lifecycle::Open) -> Self {
        let start = Instant::now();
        Tracker {
            // Always kept: the token counters need to know which workers ran it.
            trace: Trace::new(),
            observer: None,
            accepted: None,
            metrics,
            mode,
            span,
            start,
            first: None,
            last: None,
            tokens: 0,
            outcome: None,
            error: None,
            _open: open,
        }
    }

    /// Reports the request to `observer` (accepted, then finished) as `record`.
    pub(crate) fn observed(mut self, observer: Arc<dyn Observer>, record: RequestRecord) -> Self {
        self.observer = Some((observer, record));
        self
    }

    /// Where the router notes what it learns about the request.
    pub(crate) fn trace(&self) -> Trace {
        self.trace.clone()
    }

    /// The request is valid and about to run: `model` is the name it asked for,
    /// `served` the model's first name, which labels its token counts (one series
    /// whatever alias a client uses).
    pub(crate) fn accepted(&mut self, model: &str, served: &str, prompt_tokens: usize) {
        self.accepted = Some((served.to_string(), prompt_tokens));
        if let Some((observer, record)) = &mut self.observer {
            record.model = Some(model.to_string());
            record.prompt_tokens = prompt_tokens;
            observer.accepted(record);
        }
    }

    /// Notes why the request failed, for its log line.
    pub fn error(&mut self, kind: &'static str) {
        self.error.get_or_insert(kind);
    }

    fn token(&mut self) {
        let now = Instant::now();
        match self.last {
            None => self.metrics.ttft(&self.mode, (now - self.start).as_secs_f64()),
            Some(last) => self.metrics.itl(&self.mode, (now - last).as_secs_f64()),
        }
        self.first.get_or_insert(now);
        self.last = Some(now);
        self.tokens += 1;
    }

    /// Decides the outcome (the first decision sticks).
    pub fn finish(&mut self, outcome: Outcome) {
        self.outcome.get_or_insert(outcome);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or(Outcome::Cancelled);
        self.metrics.outcome(outcome);
        let ms = |t: Option<Instant>| t.map(|t| pdserve_types::millis(t - self.start));
        tracing::info!(
            parent: &self.span,
            mode = %self.mode,
            outcome = outcome.as_str(),
            error = self.error,
            tokens = self.tokens,
            ttft_ms = ms(self.first),
            duration_ms = pdserve_types::millis(self.start.elapsed()),
            "request finished"
        );
        self.count_tokens(outcome);
        self.report(outcome);
        if outcome != Outcome::Ok {
            return;
        }
        let end = self.last.unwrap_or_else(Instant::now);
        self.metrics.e2e(&self.mode, (end - self.start).as_secs_f64());
        if let (Some(first), true) = (self.first, self.tokens > 1) {
            self.metrics.tpot(&self.mode, (end - first).as_secs_f64() / (self.tokens - 1) as f64);
            self.metrics.phase(Phase::Decode, (end - first).as_secs_f64());
        }
    }
}

impl Tracker {
    /// Counts the request's tokens by the workers that ran it; nothing for a request
    /// no worker took.
    fn count_tokens(&self, outcome: Outcome) {
        let Some((model, prompt)) = self.accepted.as_ref().filter(|_| outcome != Outcome::Rejected) else { return };
        let t = self.trace.get();
        let Some(decode) = t.decode.as_deref() else { return };
        // A local prefill ran on the decode worker.
        let prefill = t.prefill.as_deref().unwrap_or(decode);
        self.metrics.tokens(model, (prefill, *prompt), (decode, self.tokens));
    }

    /// The finished record, to the observer.
    fn report(&mut self, outcome: Outcome) {
        let Some((observer, mut r)) = self.observer.take() else { return };
        r.add_trace(self.trace.get());
        r.outcome = Some(outcome.as_str());
        r.error = self.error;
        r.completion_tokens = self.tokens;
        let ms = |a: Instant, b: Instant| Some(pdserve_types::millis(b - a));
        let t = &mut r.timings;
        t.e2e_ms = ms(self.start, self.last.unwrap_or_else(Instant::now));
        if let (Some(first), Some(last)) = (self.first, self.last) {
            t.ttft_ms = ms(self.start, first);
            t.decode_ms = ms(first, last);
            t.tpot_ms = (self.tokens > 1)
                .then(|| pdserve_types::round_ms((last - first).as_secs_f64() / (self.tokens - 1) as f64));
        }
        observer.finished(&r);
    }
}

/// Token ids to text, with hidden tokens and stop strings applied.
struct TextStream {
    tokenizer: Arc<Tokenizer>,
    decoder: StreamDecoder<Arc<Tokenizer>>,
    stop: StopMatcher,
    stop_ids: Vec<TokenId>,
    min_tokens: usize,
    generated: usize,
    decoded_chars: usize,
}

impl TextStream {
    fn new(tokenizer: Arc<Tokenizer>, params: &SamplingParams) -> Self {
        TextStream {
            decoder: StreamDecoder::new(tokenizer.clone()),
            tokenizer,
            stop: StopMatcher::new(params.stop.strings.clone()),
            stop_ids: params.stop.token_ids.clone(),
            min_tokens: params.min_tokens as usize,
            generated: 0,
            decoded_chars: 0,
        }
    }

    /// End-of-generation, control and stop tokens are not shown as text.
    fn hidden(&self, id: TokenId) -> bool {
        self.tokenizer.is_eog(id) || self.tokenizer.is_special(id) || self.stop_ids.contains(&id)
    }

    /// The visible text `id` releases and whether a stop string ended the text.
    fn push(&mut self, id: TokenId) -> (String, bool) {
        self.generated += 1;
        if self.hidden(id) {
            return (String::new(), false);
        }
        let piece = self.decoder.push(id);
        self.decoded_chars += piece.chars().count();
        let r = self.stop.push(&piece, self.generated >= self.min_tokens);
        (r.text, r.stopped)
    }

    /// The text still held back at the end of the stream.
    fn finish(&mut self) -> String {
        let tail = self.decoder.finish();
        let r = self.stop.push(&tail, true);
        if r.stopped {
            r.text
        } else {
            r.text + &self.stop.finish()
        }
    }
}

/// A request in flight: pulls events and hands out [`Output`] steps.
pub struct Generation {
    /// `None` once finished; dropping it cancels the request downstream.
    stream: Option<TokenStream>,
    text: TextStream,
    /// The request's metrics and log line; one choice of a request carries it.
    tracker: Option<Tracker>,
    logprobs: bool,
    /// The generated ids are returned (`return_token_ids`).
    ids: bool,
    /// The generated tokens are not shown (a prompt-only `echo` request).
    silent: bool,
    usage: Usage,
    /// A step fetched ahead by [`Generation::prime`].
    primed: Option<Result<Option<Output>, ApiError>>,
}

impl Generation {
    pub fn new(
        stream: TokenStream,
        tokenizer: Arc<Tokenizer>,
        params: &SamplingParams,
        prompt_tokens: usize,
        tracker: Option<Tracker>,
    ) -> Self {
        Generation {
            stream: Some(stream),
            text: TextStream::new(tokenizer, params),
            tracker,
            logprobs: params.logprobs,
            ids: false,
            silent: false,
            usage: Usage { prompt_tokens, completion_tokens: 0, cached_tokens: 0 },
            primed: None,
        }
    }

    /// Hands out the ids generated with each step.
    pub fn with_ids(mut self) -> Self {
        self.ids = true;
        self
    }

    /// Shows nothing of what is generated: the prompt (echoed) is the answer.
    pub fn silent(mut self) -> Self {
        self.silent = true;
        self
    }

    /// Waits for the first step and keeps it for [`Generation::next`]; an error here
    /// means the request failed before anything was sent.
    pub async fn prime(&mut self) -> Result<(), ApiError> {
        if self.primed.is_none() {
            let first = self.pull().await;
            if let Err(e) = &first {
                let e = e.clone();
                self.primed = Some(first);
                return Err(e);
            }
            self.primed = Some(first);
        }
        Ok(())
    }

    /// The next step, or `None` after the step that carried the finish reason.
    pub async fn next(&mut self) -> Result<Option<Output>, ApiError> {
        match self.primed.take() {
            Some(step) => step,
            None => self.pull().await,
        }
    }

    async fn pull(&mut self) -> Result<Option<Output>, ApiError> {
        let Some(stream) = self.stream.as_mut() else { return Ok(None) };
        // A record of drafts is the router's to keep, never the client's.
        let mut event = stream.next().await;
        while let Some(Event::Drafts(_)) = event {
            event = stream.next().await;
        }
        let step = match event {
            Some(Event::Prompt(scores)) => Output { prompt: Some(scores), ..Output::default() },
            Some(Event::Embedding(e)) => Output { embedding: Some(e), ..Output::default() },
            Some(Event::Token(t)) => self.on_token(t),
            Some(Event::Drafts(_)) => Output::default(), // skipped above
            Some(Event::Done { reason, usage }) => self.on_done(reason, usage),
            Some(Event::Failed(e)) => return Err(self.fail(e)),
            None => {
                return Err(self.fail(ServeError::Internal("the worker stopped without finishing the request".into())))
            }
        };
        if step.finish.is_some() {
            self.stream = None;
            if let Some(t) = &mut self.tracker {
                t.finish(Outcome::Ok);
            }
        }
        Ok(Some(step))
    }

    /// Everything until the end, as one output.
    pub async fn collect(&mut self) -> Result<Output, ApiError> {
        let mut all = Output::default();
        while let Some(step) = self.next().await? {
            all.append(step);
        }
        Ok(all)
    }

    /// Token counts so far (final once `next` returned the finish). When a stop
    /// string ends the text, the worker's `Done` never arrives, so `cached_tokens`
    /// stays 0 for that request.
    pub fn usage(&self) -> Usage {
        self.usage
    }

    fn on_token(&mut self, t: TokenOut) -> Output {
        if let Some(tr) = &mut self.tracker {
            tr.token();
        }
        if self.silent {
            return Output::default();
        }
        self.usage.completion_tokens += 1;
        let text_offset = self.text.decoded_chars;
        let (text, stopped) = self.text.push(t.token);
        let ids = if self.ids { vec![t.token] } else { Vec::new() };
        let tokens = match self.logprobs {
            true => vec![TokenInfo { token: t.token, logprob: t.logprob, top: t.top, text_offset }],
            false => Vec::new(),
        };
        let stop = self.text.stop.matched().filter(|_| stopped).map(String::from);
        Output { text, tokens, ids, prompt: None, finish: stopped.then_some(FinishReason::Stop), stop, embedding: None }
    }

    fn on_done(&mut self, reason: FinishReason, usage: Usage) -> Output {
        self.usage.cached_tokens = usage.cached_tokens;
        if let Some(t) = &self.tracker {
            t.metrics.prefix_hit(PrefixHit::Realized, usage.cached_tokens as u64);
        }
        if self.silent {
            return Output { finish: Some(FinishReason::Length), ..Output::default() };
        }
        let text = self.text.finish();
        Output { text, finish: Some(reason), stop: self.text.stop.matched().map(String::from), ..Output::default() }
    }

    fn fail(&mut self, e: ServeError) -> ApiError {
        self.stream = None;
        self.failed(e.kind());
        ApiError::Serve(e)
    }

    /// Marks the request failed (by this choice or another of the same request).
    pub fn failed(&mut self, kind: &'static str) {
        if let Some(t) = &mut self.tracker {
            t.error(kind);
            t.finish(Outcome::Error);
        }
    }
}
