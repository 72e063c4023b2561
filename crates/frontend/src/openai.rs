//! The OpenAI wire format: request bodies as clients send them and the response
//! objects we send back. Nothing here is trusted; [`crate::validate`] turns requests
//! into a `ValidRequest`.
//!
//! Unknown request fields are ignored, as vLLM and OpenAI do, so clients that send
//! extras (`user`, `metadata`, ...) keep working. Integer fields are read as `i64` so
//! a negative value gets a message that names the field instead of a bare serde
//! error; the structured-output and tool fields are read as JSON values and checked
//! by [`crate::structured`] and [`crate::tools`], for the same reason.

use serde::{Deserialize, Serialize};

/// Sampling fields both endpoints share.
#[derive(Debug, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    /// vLLM's extension: token ids that end generation.
    pub stop_token_ids: Option<Vec<i64>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub n: Option<i64>,
    /// vLLM's extension: score the prompt's tokens, with this many alternatives.
    pub prompt_logprobs: Option<i64>,
    /// `{"token id": bias}`, each bias in [-100, 100].
    pub logit_bias: Option<serde_json::Value>,
    pub response_format: Option<serde_json::Value>,
    /// vLLM's structured-output fields.
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<serde_json::Value>,
    pub guided_choice: Option<serde_json::Value>,
    pub guided_grammar: Option<serde_json::Value>,
    pub structured_outputs: Option<serde_json::Value>,
    /// llama-server's schema field.
    pub json_schema: Option<serde_json::Value>,
    /// vLLM's extension: the prompt's and the output's token ids in the response.
    pub return_token_ids: Option<bool>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Number of top alternatives per token (OpenAI's integer form).
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub common: CommonParams,
}

impl crate::ForModel for CompletionRequest {
    fn model(&self) -> Option<&str> {
        self.common.model.as_deref()
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// Preferred over `max_tokens` when both are given.
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Extra variables for the model's chat template, as vLLM and llama.cpp's server
    /// take them (Qwen 3's `{"enable_thinking": false}`).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(flatten)]
    pub common: CommonParams,
    /// A `max_tokens` past the context's end is cut to it rather than refused
    /// (Anthropic's Messages: agents ask for more than a small model's context holds).
    #[serde(skip)]
    pub clamp_to_context: bool,
}

impl crate::ForModel for ChatRequest {
    fn model(&self) -> Option<&str> {
        self.common.model.as_deref()
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string, an array of strings, an array of token ids, or an array of token-id arrays")]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<i64>),
    IdBatch(Vec<Vec<i64>>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of strings")]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    /// Absent or null for assistant turns that only called tools.
    pub content: Option<Content>,
    /// An assistant turn's calls.
    pub tool_calls: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of content parts")]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

// ---- responses ----

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl From<pdserve_protocol::Usage> for Usage {
    fn from(u: pdserve_protocol::Usage) -> Self {
        Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: u.cached_tokens },
        }
    }
}

/// A completion response or one streamed chunk of it (`object` tells which).
#[derive(Debug, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's extension, when asked for: the prompt's scores (first entry null).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<Option<serde_json::Value>>>,
    /// vLLM's `return_token_ids`: the prompt's ids (in a choice's first part) and
    /// the ids generated (in this part).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// The legacy completions logprobs: parallel arrays, one entry per token. An echoed
/// prompt's first token has no logprob (null).
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<TopLogprobs>>,
    pub text_offset: Vec<usize>,
}

/// `{token_text: logprob}` for one position, written most likely first. Two ids can
/// share a text (partial characters both read as U+FFFD); the likelier one is kept.
#[derive(Debug, Default)]
pub struct TopLogprobs(pub Vec<(String, f32)>);

impl Serialize for TopLogprobs {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        for (i, (text, logprob)) in self.0.iter().enumerate() {
            if !self.0[..i].iter().any(|(seen, _)| seen == text) {
                map.serialize_entry(text, logprob)?;
            }
        }
        map.end()
    }
}

/// A chat response or one streamed chunk of it.
#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// vLLM's `return_token_ids`: the rendered prompt's ids (in a response, and in
    /// a stream's first chunk of each choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    /// Set in whole responses.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<ChatMessageOut>,
    /// Set in streamed chunks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<ChatDelta>,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's extension, when asked for: the prompt's scores (first entry null).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<Option<serde_json::Value>>>,
    /// vLLM's `return_token_ids`: the ids generated (in this part, when streamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// Null when the reply is tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Debug, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One call, whole in a response; in a stream, one delta per call carries it whole
/// (with its `index`), which the SDKs accumulate like any other delta.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCall {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments object as JSON text, as OpenAI sends it.
    pub arguments: String,
}

#[derive(Debug, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// vLLM's extension: the context length.
    pub max_model_len: usize,
}
