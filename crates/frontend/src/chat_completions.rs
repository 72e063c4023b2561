//! `POST /v1/chat/completions`: messages in (rendered with the model's chat template),
//! a `chat.completion` out.

use crate::extract::ApiJson;
use crate::generation::{Output, TokenInfo};
use crate::openai::{
    ChatChoice, ChatCompletion, ChatDelta, ChatLogprobs, ChatMessageOut, ChatRequest, ChatTokenLogprob, ChatTopLogprob,
    Usage,
};
use crate::request_id::Tagged;
use crate::sse::{finish_reason, to_json, Format};
use crate::{errors::ApiError, AppState};
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use pdserve_engine::tokenizer::Tokenizer;
use pdserve_protocol::Usage as TokenUsage;
use std::sync::Arc;

pub async fn handler(
    State(app): State<Arc<AppState>>,
    Extension(tagged): Extension<Tagged>,
    body: Result<ApiJson<ChatRequest>, ApiError>,
) -> Response {
    let tracker = app.tracker(&tagged);
    let valid = crate::validate_blocking(&app, body, |v, req| v.chat(req)).await;
    let tokenizer = app.validator.tokenizer.clone();
    let model = app.validator.model_id.clone();
    crate::run(app, tagged, tracker, valid, move |id| ChatFormat {
        id: format!("chatcmpl-{id}"),
        created: crate::unix_now(),
        model,
        tokenizer,
    })
    .await
}

/// Writes `chat.completion` and `chat.completion.chunk` objects.
pub struct ChatFormat {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
}

impl ChatFormat {
    fn object(&self, object: &'static str, choices: Vec<ChatChoice>, usage: Option<Usage>) -> ChatCompletion {
        ChatCompletion { id: self.id.clone(), object, created: self.created, model: self.model.clone(), choices, usage }
    }

    fn chunk_of(&self, delta: ChatDelta, out: Option<&Output>) -> String {
        let choice = ChatChoice {
            index: 0,
            message: None,
            delta: Some(delta),
            logprobs: out.and_then(|o| self.logprobs(&o.tokens)),
            finish_reason: out.and_then(|o| finish_reason(o.finish)),
        };
        to_json(&self.object("chat.completion.chunk", vec![choice], None))
    }

    fn logprobs(&self, tokens: &[TokenInfo]) -> Option<ChatLogprobs> {
        if tokens.is_empty() {
            return None;
        }
        let content = tokens
            .iter()
            .map(|t| {
                let top = t.top.iter().map(|&(id, logprob)| {
                    let (token, bytes) = self.token(id);
                    ChatTopLogprob { token, logprob, bytes }
                });
                let (token, bytes) = self.token(t.token);
                ChatTokenLogprob { token, logprob: t.logprob, bytes, top_logprobs: top.collect() }
            })
            .collect();
        Some(ChatLogprobs { content })
    }

    /// A token's text (lossy for partial characters) and its exact bytes.
    fn token(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.tokenizer.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }
}

impl Format for ChatFormat {
    fn preamble(&self) -> Option<String> {
        Some(self.chunk_of(ChatDelta { role: Some("assistant"), content: Some(String::new()) }, None))
    }

    fn chunk(&self, step: &Output) -> String {
        let content = (!step.text.is_empty()).then(|| step.text.clone());
        self.chunk_of(ChatDelta { role: None, content }, Some(step))
    }

    fn usage_chunk(&self, usage: TokenUsage) -> String {
        to_json(&self.object("chat.completion.chunk", Vec::new(), Some(usage.into())))
    }

    fn response(&self, all: &Output, usage: TokenUsage) -> String {
        let choice = ChatChoice {
            index: 0,
            message: Some(ChatMessageOut { role: "assistant", content: all.text.clone() }),
            delta: None,
            logprobs: self.logprobs(&all.tokens),
            finish_reason: finish_reason(all.finish).or(Some("stop")),
        };
        to_json(&self.object("chat.completion", vec![choice], Some(usage.into())))
    }
}
