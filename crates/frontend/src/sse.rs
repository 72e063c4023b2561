//! Server-sent events out: `data: {json}\n\n` per chunk, an optional usage chunk,
//! then `data: [DONE]\n\n`.
//!
//! The response body owns the [`Generation`], which owns the token stream: when the
//! client disconnects, hyper drops the body and with it the stream, and the request
//! is cancelled on every hop behind us.

use crate::errors::ApiError;
use crate::generation::{Generation, Output};
use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use pdserve_protocol::{FinishReason, Usage};
use serde::Serialize;
use std::collections::VecDeque;
use std::convert::Infallible;

/// How one endpoint (completions or chat) writes its chunks and whole responses.
pub trait Format: Send + 'static {
    /// A chunk sent before the first generated text (chat's assistant role).
    fn preamble(&self) -> Option<String> {
        None
    }
    /// One streamed chunk carrying `step`.
    fn chunk(&self, step: &Output) -> String;
    /// The last chunk when the client asked for usage: no choices, only usage.
    fn usage_chunk(&self, usage: Usage) -> String;
    /// The whole, non-streamed response.
    fn response(&self, all: &Output, usage: Usage) -> String;
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

/// Waits for everything, then answers with one JSON body.
pub async fn whole<F: Format>(mut generation: Generation, format: F) -> Result<Response, ApiError> {
    let all = generation.collect().await?;
    let body = format.response(&all, generation.usage());
    Ok(([(CONTENT_TYPE, "application/json")], body).into_response())
}

/// Streams the answer. The first step is awaited before the status line goes out,
/// so a request that fails at once still gets its proper HTTP error.
pub async fn streamed<F: Format>(
    mut generation: Generation,
    format: F,
    include_usage: bool,
) -> Result<Response, ApiError> {
    let first = generation.next().await?;
    let mut state = SseState { generation, format, include_usage, queue: VecDeque::new(), done: false };
    if let Some(p) = state.format.preamble() {
        state.queue.push_back(frame(&p));
    }
    state.on_step(first);
    let body = Body::from_stream(stream::unfold(state, SseState::next_frame));
    Ok(([(CONTENT_TYPE, "text/event-stream"), (CACHE_CONTROL, "no-cache")], body).into_response())
}

fn frame(json: &str) -> Bytes {
    Bytes::from(format!("data: {json}\n\n"))
}

struct SseState<F> {
    generation: Generation,
    format: F,
    include_usage: bool,
    /// Frames ready to send.
    queue: VecDeque<Bytes>,
    done: bool,
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
            match self.generation.next().await {
                Ok(step) => self.on_step(step),
                Err(e) => {
                    // The status line is gone; report the error in-band, as vLLM does.
                    self.queue.push_back(frame(&to_json(&e.body())));
                    self.end(false);
                }
            }
        }
    }

    fn on_step(&mut self, step: Option<Output>) {
        let Some(step) = step else { return self.end(true) };
        if !step.is_empty() {
            self.queue.push_back(frame(&self.format.chunk(&step)));
        }
        if step.finish.is_some() {
            self.end(true);
        }
    }

    fn end(&mut self, ok: bool) {
        if self.done {
            return;
        }
        if ok && self.include_usage {
            self.queue.push_back(frame(&self.format.usage_chunk(self.generation.usage())));
        }
        self.queue.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.done = true;
    }
}
