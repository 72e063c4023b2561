//! Answers: one JSON body, or server-sent events — `data: {json}\n\n` per chunk, an
//! optional usage chunk, then `data: [DONE]\n\n` — over all the choices of a request
//! (several prompts, `n` choices each), interleaved as their tokens come.
//!
//! The response body owns the [`Generation`]s, which own the token streams: when the
//! client disconnects, hyper drops the body and with it the streams, and every choice
//! is cancelled on every hop behind us. A stream that fails midway ends with an error
//! event and `[DONE]`, never a bare end of stream.

use crate::errors::ApiError;
use crate::generation::{Generation, Output};
use crate::lifecycle::Lifecycle;
use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use pdserve_protocol::{FinishReason, ServeError, Usage};
use serde::Serialize;
use std::collections::VecDeque;
use std::convert::Infallible;

/// How one endpoint writes its events, its whole responses and its errors. Streamed
/// events are whole SSE frames: OpenAI's are `data:` lines ([`data`]), Anthropic's
/// name their event.
pub trait Format: Send + 'static {
    /// Frames sent before choice `index`'s first text (chat's assistant role).
    fn preamble(&mut self, _index: u32) -> Option<String> {
        None
    }
    /// The frames carrying `step` of choice `index`: usually one; none while a format
    /// holds text back (a reply that may be a tool call).
    fn chunk(&mut self, index: u32, step: &Output) -> Vec<String>;
    /// The last chunk's JSON when the client asked for usage: no choices, only usage.
    fn usage_chunk(&self, usage: Usage) -> String;
    /// The frames that end a stream whose choices all finished: OpenAI's usage chunk
    /// (when asked for) and `[DONE]`.
    fn ending(&mut self, usage: Usage, include_usage: bool) -> Vec<String> {
        let usage = include_usage.then(|| data(&self.usage_chunk(usage)));
        usage.into_iter().chain([DONE.to_string()]).collect()
    }
    /// The frames that end a stream that failed after its status line went out: the
    /// error in-band, as vLLM sends it, and `[DONE]`.
    fn failure(&mut self, e: &ApiError) -> Vec<String> {
        vec![data(&to_json(&e.body())), DONE.to_string()]
    }
    /// An error answered instead of a response, in the API's own shape.
    fn error_response(e: ApiError) -> Response
    where
        Self: Sized,
    {
        e.into_response()
    }
    /// The whole, non-streamed response; `choices` in index order.
    fn response(&mut self, choices: &[(u32, Output)], usage: Usage) -> String;
}

/// OpenAI's end of a stream.
const DONE: &str = "data: [DONE]\n\n";

/// One OpenAI SSE frame: `data: {json}`.
pub fn data(json: &str) -> String {
    format!("data: {json}\n\n")
}

/// One choice of a request.
pub struct Choice {
    /// Its place in the response's `choices`.
    pub index: u32,
    /// Which of the request's prompts it answers.
    pub prompt: usize,
    pub generation: Generation,
}

/// JSON text of a response object. Our response types always serialize, so the
/// fallback is unreachable in practice; it keeps the stream well-formed regardless.
pub fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| format!(r#"{{"error":{{"message":"{e}"}}}}"#))
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(reason: Option<FinishReason>) -> Option<&'static str> {
    reason.map(|r| match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    })
}

/// A request's usage: each prompt counted once (with the best cache hit among its
/// choices), every choice's completion tokens.
fn total(parts: &[(usize, Usage)]) -> Usage {
    let mut by_prompt: Vec<(usize, Usage)> = Vec::new();
    let mut sum = Usage::default();
    for &(prompt, u) in parts {
        sum.completion_tokens += u.completion_tokens;
        match by_prompt.iter_mut().find(|(p, _)| *p == prompt) {
            Some((_, seen)) => seen.cached_tokens = seen.cached_tokens.max(u.cached_tokens),
            None => by_prompt.push((prompt, u)),
        }
    }
    for (_, u) in by_prompt {
        sum.prompt_tokens += u.prompt_tokens;
        sum.cached_tokens += u.cached_tokens;
    }
    sum
}

/// Waits for every choice, then answers with one JSON body (503 if the server's
/// grace period ends first).
pub async fn whole<F: Format>(choices: Vec<Choice>, mut format: F, life: Lifecycle) -> Result<Response, ApiError> {
    let all = futures_util::future::join_all(choices.into_iter().map(|mut c| async move {
        let out = c.generation.collect().await;
        (c, out)
    }));
    let done = tokio::select! {
        done = all => done,
        _ = life.cut_signal() => return Err(ApiError::Serve(ServeError::ShuttingDown)),
    };
    let mut outs = Vec::with_capacity(done.len());
    let mut usages = Vec::with_capacity(done.len());
    let mut failure = None;
    for (c, out) in &done {
        match out {
            Ok(_) => usages.push((c.prompt, c.generation.usage())),
            Err(e) => failure = failure.or(Some(e.clone())),
        }
    }
    if let Some(e) = failure {
        for (mut c, _) in done {
            c.generation.failed(e.kind());
        }
        return Err(e);
    }
    for (c, out) in done {
        if let Ok(o) = out {
            outs.push((c.index, o));
        }
    }
    outs.sort_by_key(|(i, _)| *i);
    let body = format.response(&outs, total(&usages));
    Ok(([(CONTENT_TYPE, "application/json")], body).into_response())
}

/// Streams every choice's steps as they come. The choices' first steps are awaited
/// before the status line goes out, so a request that fails at once still gets its
/// proper HTTP error.
pub async fn streamed<F: Format>(
    mut choices: Vec<Choice>,
    format: F,
    include_usage: bool,
    life: Lifecycle,
) -> Result<Response, ApiError> {
    for c in &mut choices {
        if let Err(e) = c.generation.prime().await {
            for c in &mut choices {
                c.generation.failed(e.kind());
            }
            return Err(e);
        }
    }
    let mut state = SseState {
        steps: SelectAll::new(),
        format,
        include_usage,
        queue: VecDeque::new(),
        usages: Vec::new(),
        open: choices.len(),
        done: false,
        life,
    };
    for c in choices {
        if let Some(p) = state.format.preamble(c.index) {
            state.queue.push_back(Bytes::from(p));
        }
        state.steps.push(steps_of(c));
    }
    let body = Body::from_stream(stream::unfold(state, SseState::next_frame));
    Ok(([(CONTENT_TYPE, "text/event-stream"), (CACHE_CONTROL, "no-cache")], body).into_response())
}

/// What one choice's stream yields: a step, its end (with its usage), or a failure.
enum Step {
    Out(u32, Output),
    End(usize, Usage),
    Failed(ApiError),
}

fn steps_of(c: Choice) -> BoxStream<'static, Step> {
    let Choice { index, prompt, generation } = c;
    stream::unfold(Some(generation), move |g| async move {
        let mut g = g?;
        match g.next().await {
            Ok(Some(out)) => Some((Step::Out(index, out), Some(g))),
            Ok(None) => Some((Step::End(prompt, g.usage()), None)),
            Err(e) => Some((Step::Failed(e), None)),
        }
    })
    .boxed()
}

struct SseState<F> {
    steps: SelectAll<BoxStream<'static, Step>>,
    format: F,
    include_usage: bool,
    /// Frames ready to send.
    queue: VecDeque<Bytes>,
    usages: Vec<(usize, Usage)>,
    /// Choices not finished yet.
    open: usize,
    done: bool,
    /// Cuts the stream at the server's grace deadline.
    life: Lifecycle,
}

impl<F: Format> SseState<F> {
    async fn next_frame(mut self) -> Option<(Result<Bytes, Infallible>, Self)> {
        loop {
            if let Some(bytes) = self.queue.pop_front() {
                return Some((Ok(bytes), self));
            }
            if self.done {
                return None;
            }
            let step = tokio::select! {
                step = self.steps.next() => step,
                _ = self.life.cut_signal() => Some(Step::Failed(ApiError::Serve(ServeError::ShuttingDown))),
            };
            match step {
                Some(Step::Out(index, out)) => {
                    if !out.is_empty() {
                        let frames = self.format.chunk(index, &out);
                        self.queue.extend(frames.into_iter().map(Bytes::from));
                    }
                }
                Some(Step::End(prompt, usage)) => {
                    self.usages.push((prompt, usage));
                    self.open -= 1;
                    if self.open == 0 {
                        self.end(None);
                    }
                }
                // The status line is gone: the error goes in-band.
                Some(Step::Failed(e)) => self.end(Some(e)),
                None => self.end(None),
            }
        }
    }

    /// Ends the stream: every choice finished, or `failed`.
    fn end(&mut self, failed: Option<ApiError>) {
        if self.done {
            return;
        }
        let frames = match failed {
            None => self.format.ending(total(&self.usages), self.include_usage),
            Some(e) => self.format.failure(&e),
        };
        self.queue.extend(frames.into_iter().map(Bytes::from));
        self.done = true;
        // Whatever still runs is cancelled.
        self.steps = SelectAll::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_counts_each_prompt_once_and_every_completion() {
        let u = |p, c, k| Usage { prompt_tokens: p, completion_tokens: c, cached_tokens: k };
        let t = total(&[(0, u(10, 3, 0)), (0, u(10, 4, 8)), (1, u(5, 2, 0))]);
        assert_eq!((t.prompt_tokens, t.completion_tokens, t.cached_tokens), (15, 9, 8));
    }
}
