//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API
//! over the same path as chat completions.
//!
//! A Messages request is rewritten into the chat request it means (system prompt,
//! turns, `tool_use` blocks as an assistant's calls, `tool_result` blocks as tool
//! turns, tools and `tool_choice`, `stop_sequences`), then validated, routed and
//! generated exactly as `/v1/chat/completions` is: one path for templates, tools,
//! grammars, admission and metrics. Only the answer's shape is Anthropic's: a
//! `message` with `text` and `tool_use` blocks, its streaming events, and errors as
//! `{"type": "error", "error": {"type", "message"}}`.

use crate::extract::ApiJson;
use crate::generation::Output;
use crate::openai::ChatRequest;
use crate::request_id::Tagged;
use crate::sse::{to_json, Format};
use crate::tools::{Call, Held, Tools};
use crate::{errors::ApiError, AppState};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use pdserve_protocol::{FinishReason, Usage};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// `POST /v1/messages` as clients send it. Fields this server has no use for
/// (`metadata`, `service_tier`, ...) are ignored.
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub messages: Vec<InMessage>,
    pub system: Option<Blocks>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// Structured outputs: `{"format": {"type": "json_schema", "schema": ...}}`.
    pub output_config: Option<Value>,
}

impl crate::ForModel for MessagesRequest {
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

/// `POST /v1/messages/count_tokens`: a Messages request without `max_tokens`.
#[derive(Debug, Deserialize)]
pub struct CountRequest {
    #[serde(flatten)]
    pub request: MessagesRequest,
}

impl crate::ForModel for CountRequest {
    fn model(&self) -> Option<&str> {
        self.request.model.as_deref()
    }
}

#[derive(Debug, Deserialize)]
pub struct InMessage {
    pub role: String,
    pub content: Blocks,
}

/// Content as a string or as blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or an array of content blocks")]
pub enum Blocks {
    Text(String),
    Blocks(Vec<Value>),
}

/// The chat request a Messages request means; every malformed form is a 400.
fn to_chat(req: MessagesRequest, count_only: bool) -> Result<ChatRequest, ApiError> {
    if !count_only && req.max_tokens.is_none() {
        return Err(ApiError::invalid("max_tokens", "max_tokens: field required"));
    }
    let mut messages = Vec::new();
    if let Some(system) = req.system {
        messages.push(json!({"role": "system", "content": text_of(system, "system")?}));
    }
    for m in req.messages {
        messages.extend(turns(m)?);
    }
    // An empty list is no tools (Claude Code sends one), not chat's 400.
    let tools = req.tools.filter(|t| !t.is_empty());
    let tools = tools.map(|t| t.into_iter().map(tool).collect::<Result<Vec<_>, _>>()).transpose()?;
    let (tool_choice, parallel) = match req.tool_choice {
        Some(c) => choice(&c)?,
        None => (None, None),
    };
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    let fields = [
        ("model", req.model.map(Value::from)),
        ("max_tokens", req.max_tokens.map(Value::from)),
        ("stop", req.stop_sequences.map(Value::from)),
        ("temperature", req.temperature.map(Value::from)),
        ("top_p", req.top_p.map(Value::from)),
        ("top_k", req.top_k.map(Value::from)),
        ("stream", req.stream.map(Value::from)),
        ("tools", tools.map(Value::Array)),
        ("tool_choice", tool_choice),
        ("parallel_tool_calls", parallel.map(Value::from)),
        ("response_format", req.output_config.as_ref().map(response_format).transpose()?.flatten()),
    ];
    chat.extend(fields.into_iter().filter_map(|(k, v)| Some((k.to_string(), v?))));
    let mut chat: ChatRequest =
        serde_json::from_value(Value::Object(chat)).map_err(|e| ApiError::malformed(e.to_string()))?;
    // Agents ask for more tokens than a small model's context holds: up to its end.
    chat.clamp_to_context = true;
    Ok(chat)
}

/// `output_config.format` (a JSON schema the reply must follow) as chat's
/// `response_format`; `None` without a format.
fn response_format(config: &Value) -> Result<Option<Value>, ApiError> {
    const P: &str = "output_config";
    let Some(format) = config.get("format").filter(|f| !f.is_null()) else { return Ok(None) };
    match (format["type"].as_str(), format.get("schema")) {
        (Some("json_schema"), Some(schema)) => {
            Ok(Some(json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}})))
        }
        _ => Err(ApiError::invalid(P, "output_config.format must be {\"type\": \"json_schema\", \"schema\": ...}")),
    }
}

/// A system prompt's or a message's text blocks as one string.
fn text_of(content: Blocks, field: &'static str) -> Result<String, ApiError> {
    match content {
        Blocks::Text(t) => Ok(t),
        Blocks::Blocks(blocks) => {
            let texts = blocks.iter().map(|b| match kind(b) {
                "text" => Ok(b["text"].as_str().unwrap_or_default()),
                other => Err(ApiError::invalid(field, format!("{field}: a `{other}` block where text was expected"))),
            });
            Ok(texts.collect::<Result<Vec<_>, _>>()?.join("\n"))
        }
    }
}

fn kind(block: &Value) -> &str {
    block["type"].as_str().unwrap_or("(untyped)")
}

/// One Messages turn as chat turns: a user's `tool_result` blocks become tool turns
/// (before its text), an assistant's `tool_use` blocks its calls.
fn turns(m: InMessage) -> Result<Vec<Value>, ApiError> {
    const P: &str = "messages";
    // Claude Code sends system turns among the messages too.
    if !["user", "assistant", "system"].contains(&m.role.as_str()) {
        return Err(ApiError::invalid(
            P,
            format!("messages: role must be user, assistant or system, not `{}`", m.role),
        ));
    }
    let blocks = match m.content {
        Blocks::Text(t) => return Ok(vec![json!({"role": m.role, "content": t})]),
        Blocks::Blocks(b) => b,
    };
    let (mut out, mut text, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    for b in &blocks {
        match (kind(b), m.role.as_str()) {
            ("text", _) => text.push(b["text"].as_str().unwrap_or_default().to_string()),
            ("tool_use", "assistant") => calls.push(json!({
                "id": b["id"],
                "type": "function",
                "function": {"name": b["name"], "arguments": b["input"].to_string()},
            })),
            ("tool_result", "user") => {
                let content = match &b["content"] {
                    Value::String(s) => s.clone(),
                    Value::Array(parts) => {
                        parts.iter().filter_map(|p| p["text"].as_str()).collect::<Vec<_>>().join("\n")
                    }
                    _ => String::new(),
                };
                out.push(json!({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content}));
            }
            (other, role) => {
                return Err(ApiError::invalid(
                    P,
                    format!("messages: a `{other}` block in a {role} turn is not supported"),
                ))
            }
        }
    }
    if !text.is_empty() || !calls.is_empty() || out.is_empty() {
        let mut turn = json!({"role": m.role, "content": text.join("\n")});
        if !calls.is_empty() {
            turn["tool_calls"] = Value::Array(calls);
        }
        out.push(turn);
    }
    Ok(out)
}

/// An Anthropic tool (`name`, `description`, `input_schema`) as a function tool.
fn tool(t: Value) -> Result<Value, ApiError> {
    let name = t["name"].as_str().ok_or_else(|| ApiError::invalid("tools", "tools: every tool needs a `name`"))?;
    let schema = t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"}));
    let mut function = json!({"name": name, "parameters": schema});
    if let Some(d) = t.get("description") {
        function["description"] = d.clone();
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice` (`auto`, `any`, `tool` with a name, `none`) as chat's, and whether
/// calls may come several at once.
fn choice(c: &Value) -> Result<(Option<Value>, Option<bool>), ApiError> {
    let parallel = c["disable_parallel_tool_use"].as_bool().map(|d| !d);
    let chat = match c["type"].as_str() {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match c["name"].as_str() {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => return Err(ApiError::invalid("tool_choice", "tool_choice: type `tool` needs a `name`")),
        },
        _ => return Err(ApiError::invalid("tool_choice", "tool_choice: type must be auto, any, tool or none")),
    };
    Ok((Some(chat), parallel))
}

pub async fn handler(
    State(app): State<Arc<AppState>>,
    Extension(tagged): Extension<Tagged>,
    body: Result<ApiJson<MessagesRequest>, ApiError>,
) -> Response {
    let tracker = app.tracker(&tagged);
    let valid = crate::validate_blocking(&app, body, |v, req| v.chat(to_chat(req, false)?)).await;
    crate::run(app, tagged, tracker, valid, |id, v| MessagesFormat {
        id: format!("msg_{id}"),
        model: v.model.clone(),
        input_tokens: v.prompts.first().map_or(0, |p| p.ids.len()),
        tools: v.tools.clone(),
        held: v.tools.as_ref().map(|_| Output::default()),
        open: None,
        blocks: 0,
        finish: None,
        stop_sequence: None,
        called: false,
    })
    .await
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the chat template and
/// tools render them.
pub async fn count_tokens(State(app): State<Arc<AppState>>, body: Result<ApiJson<CountRequest>, ApiError>) -> Response {
    let counted = crate::validate_blocking(&app, body, |v, req| {
        let mut chat = to_chat(req.request, true)?;
        chat.common.stream = None;
        v.chat(chat)
    })
    .await;
    match counted {
        Ok(c) => Json(json!({"input_tokens": c.request.prompts.first().map_or(0, |p| p.ids.len())})).into_response(),
        Err(e) => error_response(e),
    }
}

/// An error in Anthropic's shape, with the status the error maps to.
pub fn error_response(e: ApiError) -> Response {
    let mut r = e.clone().into_response();
    *r.body_mut() = axum::body::Body::from(to_json(&error_body(&e)));
    r
}

/// `{"type": "error", "error": {"type", "message"}}`, the type from the status as
/// Anthropic's error list maps them.
fn error_body(e: &ApiError) -> Value {
    let kind = match e.status().as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.to_string()}})
}

/// Writes a `message`, or its streaming events.
pub struct MessagesFormat {
    id: String,
    model: String,
    input_tokens: usize,
    tools: Option<Arc<Tools>>,
    /// Streamed text held back while it may still be a tool call (tools offered).
    held: Option<Output>,
    /// The index of the content block open in the stream, if any.
    open: Option<usize>,
    /// Content blocks started in the stream.
    blocks: usize,
    finish: Option<FinishReason>,
    /// The stop sequence that ended the reply, if one did.
    stop_sequence: Option<String>,
    /// The reply was tool calls.
    called: bool,
}

#[derive(Serialize)]
struct MessageUsage {
    input_tokens: usize,
    output_tokens: usize,
    cache_read_input_tokens: usize,
    cache_creation_input_tokens: usize,
}

impl From<Usage> for MessageUsage {
    fn from(u: Usage) -> Self {
        MessageUsage {
            input_tokens: u.prompt_tokens.saturating_sub(u.cached_tokens),
            output_tokens: u.completion_tokens,
            cache_read_input_tokens: u.cached_tokens,
            cache_creation_input_tokens: 0,
        }
    }
}

/// One server-sent event: its name is its object's `type`.
fn event(data: &Value) -> String {
    format!("event: {}\ndata: {data}\n\n", data["type"].as_str().unwrap_or("message"))
}

impl MessagesFormat {
    fn stop_reason(&self) -> &'static str {
        match (self.called, self.finish, &self.stop_sequence) {
            (true, _, _) => "tool_use",
            (false, Some(FinishReason::Length), _) => "max_tokens",
            (false, _, Some(_)) => "stop_sequence",
            (false, _, None) => "end_turn",
        }
    }

    /// The calls of a finished reply, when it is calls.
    fn calls(&self, out: &Output) -> Option<Vec<Call>> {
        self.tools.as_ref()?.calls(&out.text).filter(|_| out.finish.is_some())
    }

    fn tool_use(&self, i: usize, c: &Call, input: Value) -> Value {
        json!({"type": "tool_use", "id": format!("toolu_{}_{i}", self.id.trim_start_matches("msg_")), "name": c.name, "input": input})
    }

    /// Events that send `text` in the text block, opening it first.
    fn text_events(&mut self, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        if self.open.is_none() {
            let index = self.start_block();
            out.push(event(
                &json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
            ));
        }
        if !text.is_empty() {
            let delta = json!({"type": "text_delta", "text": text});
            out.push(event(&json!({"type": "content_block_delta", "index": self.open, "delta": delta})));
        }
        out
    }

    fn start_block(&mut self) -> usize {
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some(index);
        index
    }

    fn stop_block(&mut self) -> Option<String> {
        self.open.take().map(|index| event(&json!({"type": "content_block_stop", "index": index})))
    }

    /// Each call as a `tool_use` block: start, its input as one JSON delta, stop.
    fn call_events(&mut self, calls: &[Call]) -> Vec<String> {
        let mut out = Vec::new();
        for (i, c) in calls.iter().enumerate() {
            let index = self.start_block();
            let block = self.tool_use(i, c, json!({}));
            out.push(event(&json!({"type": "content_block_start", "index": index, "content_block": block})));
            let delta = json!({"type": "input_json_delta", "partial_json": c.arguments});
            out.push(event(&json!({"type": "content_block_delta", "index": index, "delta": delta})));
            out.extend(self.stop_block());
        }
        out
    }
}

impl Format for MessagesFormat {
    fn preamble(&mut self, _index: u32) -> Option<String> {
        let message = json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        });
        let mut frames = event(&json!({"type": "message_start", "message": message}));
        // Without tools the reply is text from its first token.
        if self.held.is_none() {
            frames.extend(self.text_events(""));
        }
        frames.push_str(&event(&json!({"type": "ping"})));
        Some(frames)
    }

    fn chunk(&mut self, _index: u32, step: &Output) -> Vec<String> {
        self.finish = step.finish.or(self.finish);
        self.stop_sequence = step.stop.clone().or(self.stop_sequence.take());
        match crate::tools::hold(self.tools.as_deref(), &mut self.held, step) {
            Held::Waiting => Vec::new(),
            Held::Calls(calls) => {
                self.called = true;
                self.call_events(&calls)
            }
            Held::Text(text) => self.text_events(&text),
        }
    }

    fn usage_chunk(&self, _usage: Usage) -> String {
        String::new()
    }

    fn ending(&mut self, usage: Usage, _include_usage: bool) -> Vec<String> {
        // A reply held to its end as a possible call, that was not one.
        let held = self.held.take().filter(|h| !h.text.is_empty());
        let mut out: Vec<String> = held.map(|h| self.text_events(&h.text)).unwrap_or_default();
        out.extend(self.stop_block());
        let delta = json!({"stop_reason": self.stop_reason(), "stop_sequence": self.stop_sequence});
        let usage = serde_json::to_value(MessageUsage::from(usage)).unwrap_or_default();
        out.push(event(&json!({"type": "message_delta", "delta": delta, "usage": usage})));
        out.push(event(&json!({"type": "message_stop"})));
        out
    }

    fn failure(&mut self, e: &ApiError) -> Vec<String> {
        vec![event(&error_body(e))]
    }

    fn error_response(e: ApiError) -> Response {
        error_response(e)
    }

    fn response(&mut self, choices: &[(u32, Output)], usage: Usage) -> String {
        let empty = Output::default();
        let out = choices.first().map_or(&empty, |(_, o)| o);
        (self.finish, self.stop_sequence) = (out.finish, out.stop.clone());
        let content: Vec<Value> = match self.calls(out) {
            Some(calls) => {
                self.called = true;
                let input = |c: &Call| serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
                calls.iter().enumerate().map(|(i, c)| self.tool_use(i, c, input(c))).collect()
            }
            None => vec![json!({"type": "text", "text": out.text})],
        };
        to_json(&json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": self.stop_reason(), "stop_sequence": self.stop_sequence, "usage": MessageUsage::from(usage),
        }))
    }
}
