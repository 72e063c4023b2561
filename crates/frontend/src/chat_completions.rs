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
    crate::run(app, tagged, tracker, valid, move |id, v| ChatFormat {
        id: format!("chatcmpl-{id}"),
        created: crate::unix_now(),
        model: v.model.clone(),
        tokenizer,
        prompt_field: v.prompt_logprobs,
    })
    .await
}

/// Writes `chat.completion` and `chat.completion.chunk` objects.
pub struct ChatFormat {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    /// vLLM's `prompt_logprobs` field was asked for.
    prompt_field: bool,
}

impl ChatFormat {
    fn object(&self, object: &'static str, choices: Vec<ChatChoice>, usage: Option<Usage>) -> ChatCompletion {
        ChatCompletion { id: self.id.clone(), object, created: self.created, model: self.model.clone(), choices, usage }
    }

    fn chunk_of(&self, index: u32, delta: ChatDelta, out: Option<&Output>) -> String {
        let choice = ChatChoice {
            index,
            message: None,
            delta: Some(delta),
            logprobs: out.and_then(|o| self.logprobs(&o.tokens)),
            finish_reason: out.and_then(|o| finish_reason(o.finish)),
            prompt_logprobs: out.and_then(|o| self.prompt_scores(o)),
        };
        to_json(&self.object("chat.completion.chunk", vec![choice], None))
    }

    fn prompt_scores(&self, o: &Output) -> Option<Vec<Option<serde_json::Value>>> {
        let scores = o.prompt.as_deref().filter(|_| self.prompt_field)?;
        Some(crate::completions::vllm_prompt_logprobs(&self.tokenizer, scores))
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
    fn preamble(&self, index: u32) -> Option<String> {
        Some(self.chunk_of(index, ChatDelta { role: Some("assistant"), content: Some(String::new()) }, None))
    }

    fn chunk(&mut self, index: u32, step: &Output) -> String {
        let content = (!step.text.is_empty()).then(|| step.text.clone());
        self.chunk_of(index, ChatDelta { role: None, content }, Some(step))
    }

    fn usage_chunk(&self, usage: TokenUsage) -> String {
        to_json(&self.object("chat.completion.chunk", Vec::new(), Some(usage.into())))
    }

    fn response(&mut self, choices: &[(u32, Output)], usage: TokenUsage) -> String {
        let list = choices
            .iter()
            .map(|(index, all)| ChatChoice {
                index: *index,
                message: Some(ChatMessageOut { role: "assistant", content: all.text.clone() }),
                delta: None,
                logprobs: self.logprobs(&all.tokens),
                finish_reason: finish_reason(all.finish).or(Some("stop")),
                prompt_logprobs: self.prompt_scores(all),
            })
            .collect();
        to_json(&self.object("chat.completion", list, Some(usage.into())))
    }
}
