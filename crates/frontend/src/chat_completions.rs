//! `POST /v1/chat/completions`: messages in (rendered with the model's chat template),
//! a `chat.completion` out.

use crate::extract::ApiJson;
use crate::generation::{Output, TokenInfo};
use crate::openai::{
    ChatChoice, ChatCompletion, ChatDelta, ChatLogprobs, ChatMessageOut, ChatRequest, ChatTokenLogprob, ChatTopLogprob,
    FunctionCall, ToolCall, Usage,
};
use crate::request_id::Tagged;
use crate::sse::{data, finish_reason, to_json, Format};
use crate::tools::{Call, Tools};
use crate::{errors::ApiError, AppState};
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use pdserve_protocol::Usage as TokenUsage;
use pdserve_text::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::sync::Arc;

pub async fn handler(
    State(app): State<Arc<AppState>>,
    Extension(tagged): Extension<Tagged>,
    body: Result<ApiJson<ChatRequest>, ApiError>,
) -> Response {
    let tracker = app.tracker(&tagged);
    let valid = crate::validate_blocking(&app, body, |v, req| v.chat(req)).await;
    crate::run(app, tagged, tracker, valid, move |id, v| ChatFormat {
        id: format!("chatcmpl-{id}"),
        created: crate::unix_now(),
        model: v.model.clone(),
        tokenizer: v.tokenizer.clone(),
        prompt_field: v.prompt_logprobs,
        token_ids: v.token_ids,
        prompt_ids: v.prompts.first().filter(|_| v.token_ids).map(|p| p.ids.clone()).unwrap_or_default(),
        tools: v.tools.clone(),
        held: HashMap::new(),
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
    /// vLLM's `return_token_ids` was asked for: the prompt's ids and the output's.
    token_ids: bool,
    /// The prompt's ids (empty unless `token_ids`).
    prompt_ids: Vec<u32>,
    /// The tools offered, when the reply may be calls.
    tools: Option<Arc<Tools>>,
    /// Streamed text held back per choice while it may still be a tool call.
    held: HashMap<u32, Output>,
}

impl ChatFormat {
    fn object(&self, object: &'static str, choices: Vec<ChatChoice>, usage: Option<Usage>) -> ChatCompletion {
        let (id, model, prompt_token_ids) = (self.id.clone(), self.model.clone(), None);
        ChatCompletion { id, object, created: self.created, model, choices, usage, prompt_token_ids }
    }

    /// The ids generated in `out`, when they were asked for.
    fn ids(&self, out: &Output) -> Option<Vec<u32>> {
        self.token_ids.then(|| out.ids.clone())
    }

    /// The prompt's ids, when they were asked for.
    fn prompt_token_ids(&self) -> Option<Vec<u32>> {
        self.token_ids.then(|| self.prompt_ids.clone())
    }

    fn chunk_of(&self, index: u32, delta: ChatDelta, out: Option<&Output>) -> String {
        self.chunk_ending(index, delta, out, out.and_then(|o| finish_reason(o.finish)))
    }

    fn chunk_ending(&self, index: u32, delta: ChatDelta, out: Option<&Output>, finish: Option<&'static str>) -> String {
        let choice = ChatChoice {
            index,
            message: None,
            delta: Some(delta),
            logprobs: out.and_then(|o| self.logprobs(&o.tokens)),
            finish_reason: finish,
            prompt_logprobs: out.and_then(|o| self.prompt_scores(o)),
            token_ids: out.and_then(|o| self.ids(o)),
        };
        let mut chunk = self.object("chat.completion.chunk", vec![choice], None);
        // The preamble (no output yet) is each choice's first chunk.
        chunk.prompt_token_ids = self.prompt_token_ids().filter(|_| out.is_none());
        to_json(&chunk)
    }

    fn prompt_scores(&self, o: &Output) -> Option<Vec<Option<serde_json::Value>>> {
        let scores = o.prompt.as_deref().filter(|_| self.prompt_field)?;
        Some(crate::completions::vllm_prompt_logprobs(&self.tokenizer, scores))
    }

    fn logprobs(&self, tokens: &[TokenInfo]) -> Option<ChatLogprobs> {
        (!tokens.is_empty()).then(|| ChatLogprobs { content: token_logprobs(&self.tokenizer, tokens) })
    }

    /// The reply's calls, when it is calls.
    fn calls(&self, text: &str) -> Option<Vec<Call>> {
        self.tools.as_ref()?.calls(text)
    }

    fn tool_calls(&self, index: u32, calls: Vec<Call>, streamed: bool) -> Vec<ToolCall> {
        let call = |(i, c): (usize, Call)| ToolCall {
            index: streamed.then_some(i as u32),
            id: format!("call_{}_{index}_{i}", self.id.trim_start_matches("chatcmpl-")),
            kind: "function",
            function: FunctionCall { name: c.name, arguments: c.arguments },
        };
        calls.into_iter().enumerate().map(call).collect()
    }

    /// The chunks of a streamed step when the reply may be tool calls: text is held
    /// while it may still become a call, sent as content once it cannot, and sent as
    /// `tool_calls` deltas when the reply ends as calls.
    fn tool_chunks(&mut self, index: u32, step: &Output) -> Vec<String> {
        let Some(tools) = self.tools.clone() else { return vec![self.content_chunk(index, step)] };
        let Some(held) = self.held.get_mut(&index) else { return vec![self.content_chunk(index, step)] };
        held.text.push_str(&step.text);
        held.tokens.extend(step.tokens.iter().cloned());
        held.ids.extend_from_slice(&step.ids);
        held.finish = step.finish;
        if step.prompt.is_some() {
            held.prompt.clone_from(&step.prompt);
        }
        let prose = !tools.may_call(&held.text);
        if step.finish.is_none() && !prose {
            return Vec::new();
        }
        let held = self.held.remove(&index).unwrap_or_default();
        match self.calls(&held.text).filter(|_| step.finish.is_some()) {
            Some(calls) => {
                let delta = ChatDelta { tool_calls: Some(self.tool_calls(index, calls, true)), ..Default::default() };
                vec![self.chunk_ending(index, delta, Some(&held), Some("tool_calls"))]
            }
            None => vec![self.content_chunk(index, &held)],
        }
    }

    fn content_chunk(&self, index: u32, step: &Output) -> String {
        let content = (!step.text.is_empty()).then(|| step.text.clone());
        self.chunk_of(index, ChatDelta { content, ..Default::default() }, Some(step))
    }
}

/// Each token's text (lossy for partial characters), exact bytes and logprob, with its
/// top alternatives: the shape the chat API's `logprobs.content` and the Responses
/// API's `output_text.logprobs` share.
pub(crate) fn token_logprobs(tokenizer: &Tokenizer, tokens: &[TokenInfo]) -> Vec<ChatTokenLogprob> {
    let token = |id: u32| {
        let bytes = tokenizer.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    };
    let scored = |t: &TokenInfo| {
        let top = t.top.iter().map(|&(id, logprob)| {
            let (token, bytes) = token(id);
            ChatTopLogprob { token, logprob, bytes }
        });
        let (text, bytes) = token(t.token);
        ChatTokenLogprob { token: text, logprob: t.logprob, bytes, top_logprobs: top.collect() }
    };
    tokens.iter().map(scored).collect()
}

impl Format for ChatFormat {
    fn preamble(&mut self, index: u32) -> Option<String> {
        if self.tools.is_some() {
            self.held.insert(index, Output::default());
        }
        let delta = ChatDelta { role: Some("assistant"), content: Some(String::new()), ..Default::default() };
        Some(data(&self.chunk_of(index, delta, None)))
    }

    fn chunk(&mut self, index: u32, step: &Output) -> Vec<String> {
        self.tool_chunks(index, step).iter().map(|c| data(c)).collect()
    }

    fn usage_chunk(&self, usage: TokenUsage) -> String {
        to_json(&self.object("chat.completion.chunk", Vec::new(), Some(usage.into())))
    }

    fn response(&mut self, choices: &[(u32, Output)], usage: TokenUsage) -> String {
        let list = choices
            .iter()
            .map(|(index, all)| {
                let calls = self.calls(&all.text).filter(|_| all.finish.is_some());
                let finish = finish_reason(all.finish).or(Some("stop"));
                let message = match calls {
                    Some(calls) => ChatMessageOut {
                        role: "assistant",
                        content: None,
                        tool_calls: Some(self.tool_calls(*index, calls, false)),
                    },
                    None => ChatMessageOut { role: "assistant", content: Some(all.text.clone()), tool_calls: None },
                };
                ChatChoice {
                    index: *index,
                    finish_reason: if message.tool_calls.is_some() { Some("tool_calls") } else { finish },
                    message: Some(message),
                    delta: None,
                    logprobs: self.logprobs(&all.tokens),
                    prompt_logprobs: self.prompt_scores(all),
                    token_ids: self.ids(all),
                }
            })
            .collect();
        let mut response = self.object("chat.completion", list, Some(usage.into()));
        response.prompt_token_ids = self.prompt_token_ids();
        to_json(&response)
    }
}
