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

/// How one endpoint (completions or chat) writes its chunks and whole responses.
pub trait Format: Send + 'static {
    /// A chunk sent before choice `index`'s first text (chat's assistant role).
    fn preamble(&mut self, _index: u32) -> Option<String> {
        None
    }
    /// The streamed chunks carrying `step` of choice `index`: usually one; none while
    /// a format holds text back (a reply that may be a tool call).
    fn chunk(&mut self, index: u32, step: &Output) -> Vec<String>;
    /// The last chunk when the client asked for usage: no choices, only usage.
    fn usage_chunk(&self, usage: Usage) -> String;
    /// The whole, non-streamed response; `choices` in index order.
    fn response(&mut self, choices: &[(u32, Output)], usage: Usage) -> String;
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
            state.queue.push_back(frame(&p));
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

fn frame(json: &str) -> Bytes {
    Bytes::from(format!("data: {json}\n\n"))
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
                        for chunk in self.format.chunk(index, &out) {
                            self.queue.push_back(frame(&chunk));
                        }
                    }
                }
                Some(Step::End(prompt, usage)) => {
                    self.usages.push((prompt, usage));
                    self.open -= 1;
                    if self.open == 0 {
                        self.end(true);
                    }
                }
                // The status line is gone; report the error in-band, as vLLM does.
                Some(Step::Failed(e)) => {
                    self.queue.push_back(frame(&to_json(&e.body())));
                    self.end(false);
                }
                None => self.end(true),
            }
        }
    }

    fn end(&mut self, ok: bool) {
        if self.done {
            return;
        }
        if ok && self.include_usage {
            self.queue.push_back(frame(&self.format.usage_chunk(total(&self.usages))));
        }
        self.queue.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
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
