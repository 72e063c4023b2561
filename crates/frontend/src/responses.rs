//! `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}` and
//! `GET /v1/responses/{id}/input_items`: OpenAI's Responses API over the same path as
//! chat completions.
//!
//! A Responses request is rewritten into the chat request it means (`instructions` as
//! the system prompt, `input` items as turns, `function_call` items as an assistant's
//! calls, `function_call_output` items as tool turns, function tools, `tool_choice`,
//! `text.format` as `response_format`), then validated, routed and generated exactly
//! as `/v1/chat/completions` is. Only the answer's shape is the Responses API's: a
//! `response` whose `output` holds a `message` or `function_call` items, its streaming
//! events, and the conversation kept (with `store`, the default) for a later
//! `previous_response_id`. Tools of other types (`web_search`, `custom`, `namespace`,
//! ...) are server-side tools this server does not have: they are left out of what
//! the model is shown.

use crate::extract::ApiJson;
use crate::generation::{Output, TokenInfo};
use crate::openai::ChatRequest;
use crate::request_id::Tagged;
use crate::response_store::{ResponseStore, Stored};
use crate::sse::{to_json, Format};
use crate::tools::{Call, Held, Tools};
use crate::{errors::ApiError, AppState};
use axum::extract::{Path, State};
use axum::response::Response;
use axum::{Extension, Json};
use pdserve_protocol::{FinishReason, Usage};
use pdserve_text::tokenizer::Tokenizer;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// `POST /v1/responses` as clients send it. Fields this server has no use for
/// (`reasoning`, `include`, `prompt_cache_key`, `truncation`, ...) are ignored.
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: Input,
    pub instructions: Option<String>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub stream: Option<bool>,
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    pub text: Option<Value>,
    pub metadata: Option<Value>,
    /// `message.output_text.logprobs` asks for each output token's logprob.
    pub include: Option<Vec<String>>,
    /// Alternatives per token with those logprobs, 0 to 20.
    pub top_logprobs: Option<i64>,
    /// The conversation before `input`, from `previous_response_id`.
    #[serde(skip)]
    history: Vec<Value>,
}

impl crate::ForModel for ResponsesRequest {
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

/// `input`: a user's text, or items.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or an array of input items")]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

impl Input {
    fn items(&self) -> Vec<Value> {
        match self {
            Input::Text(t) => vec![json!({"type": "message", "role": "user", "content": t})],
            Input::Items(items) => items.clone(),
        }
    }
}

/// The chat request a Responses request means; every malformed form is a 400.
fn to_chat(req: ResponsesRequest) -> Result<ChatRequest, ApiError> {
    let logprobs = wants_logprobs(&req);
    let mut messages = Vec::new();
    if let Some(i) = &req.instructions {
        messages.push(json!({"role": "system", "content": i}));
    }
    let conversation: Vec<Value> = req.history.iter().cloned().chain(req.input.items()).collect();
    messages.extend(turns(&conversation)?);
    let tools: Vec<Value> = req.tools.unwrap_or_default().iter().filter_map(function_tool).collect::<Result<_, _>>()?;
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    let fields = [
        ("model", req.model.map(Value::from)),
        ("max_tokens", req.max_output_tokens.map(Value::from)),
        ("temperature", req.temperature.map(Value::from)),
        ("top_p", req.top_p.map(Value::from)),
        ("stream", req.stream.map(Value::from)),
        ("tools", (!tools.is_empty()).then_some(Value::Array(tools))),
        ("tool_choice", req.tool_choice.as_ref().map(choice).transpose()?),
        ("parallel_tool_calls", req.parallel_tool_calls.map(Value::from)),
        ("response_format", req.text.as_ref().map(response_format).transpose()?.flatten()),
        ("logprobs", logprobs.then_some(Value::Bool(true))),
        ("top_logprobs", req.top_logprobs.filter(|_| logprobs).map(Value::from)),
    ];
    chat.extend(fields.into_iter().filter_map(|(k, v)| Some((k.to_string(), v?))));
    let mut chat: ChatRequest =
        serde_json::from_value(Value::Object(chat)).map_err(|e| ApiError::malformed(e.to_string()))?;
    // Agents ask for more tokens than a small model's context holds: up to its end.
    chat.clamp_to_context = true;
    Ok(chat)
}

/// Whether `include` asks for the output's logprobs.
fn wants_logprobs(req: &ResponsesRequest) -> bool {
    req.include.iter().flatten().any(|i| i == LOGPROBS)
}

/// The `include` value that asks for the output's logprobs.
const LOGPROBS: &str = "message.output_text.logprobs";

fn kind(item: &Value) -> &str {
    match item["type"].as_str() {
        Some(t) => t,
        None if item.get("role").is_some() => "message",
        None => "(untyped)",
    }
}

/// Items as chat turns: messages as they are (`developer` as `system`), calls joined
/// to the assistant turn they follow, call outputs as tool turns; reasoning items,
/// which this server never writes, are passed over.
fn turns(items: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out: Vec<Value> = Vec::new();
    for item in items {
        match kind(item) {
            "message" => out.push(message(item)?),
            "function_call" => {
                let call = call_of(item)?;
                match out.last_mut().filter(|t| t["role"] == "assistant") {
                    Some(turn) => match turn["tool_calls"].as_array_mut() {
                        Some(calls) => calls.push(call),
                        None => turn["tool_calls"] = json!([call]),
                    },
                    None => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let id =
                    item["call_id"].as_str().ok_or_else(|| bad_item("a function_call_output needs a `call_id`"))?;
                out.push(json!({"role": "tool", "tool_call_id": id, "content": text_of(&item["output"])?}));
            }
            "reasoning" => {}
            other => return Err(bad_item(&format!("`{other}` items are not supported"))),
        }
    }
    Ok(out)
}

fn bad_item(message: &str) -> ApiError {
    ApiError::invalid("input", format!("input: {message}"))
}

fn message(item: &Value) -> Result<Value, ApiError> {
    let role = match item["role"].as_str() {
        Some("developer") => "system",
        Some(r @ ("user" | "assistant" | "system")) => r,
        _ => return Err(bad_item("a message's role must be user, assistant, system or developer")),
    };
    Ok(json!({"role": role, "content": text_of(&item["content"])?}))
}

/// A message's content, or a call's output: a string or text parts, as one string.
fn text_of(content: &Value) -> Result<String, ApiError> {
    let parts = match content {
        Value::String(s) => return Ok(s.clone()),
        Value::Array(parts) => parts,
        _ => return Err(bad_item("content must be a string or a list of content parts")),
    };
    let texts = parts.iter().map(|p| match p["type"].as_str() {
        Some("input_text" | "output_text" | "text") => Ok(p["text"].as_str().unwrap_or_default()),
        Some("refusal") => Ok(p["refusal"].as_str().unwrap_or_default()),
        other => Err(bad_item(&format!("`{}` content is not supported: the model reads text", other.unwrap_or("?")))),
    });
    Ok(texts.collect::<Result<Vec<_>, _>>()?.join("\n"))
}

/// A `function_call` item as a chat call.
fn call_of(item: &Value) -> Result<Value, ApiError> {
    let (Some(id), Some(name)) = (item["call_id"].as_str(), item["name"].as_str()) else {
        return Err(bad_item("a function_call needs a `call_id` and a `name`"));
    };
    let arguments = item["arguments"].as_str().unwrap_or("{}");
    Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
}

/// A function tool (`name`, `description`, `parameters` at the top level) as chat's;
/// `None` for the other types, left out.
fn function_tool(t: &Value) -> Option<Result<Value, ApiError>> {
    if t["type"] != "function" {
        return None;
    }
    let Some(name) = t["name"].as_str() else {
        return Some(Err(ApiError::invalid("tools", "tools: every function needs a `name`")));
    };
    let mut function = json!({"name": name});
    for field in ["description", "parameters"] {
        if let Some(v) = t.get(field).filter(|v| !v.is_null()) {
            function[field] = v.clone();
        }
    }
    Some(Ok(json!({"type": "function", "function": function})))
}

/// `tool_choice` (`auto`, `none`, `required`, or `{"type": "function", "name"}`) as
/// chat's.
fn choice(c: &Value) -> Result<Value, ApiError> {
    match (c.as_str(), c["type"].as_str(), c["name"].as_str()) {
        (Some(s), _, _) => Ok(json!(s)),
        (None, Some("function"), Some(name)) => Ok(json!({"type": "function", "function": {"name": name}})),
        _ => Err(ApiError::invalid(
            "tool_choice",
            "tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
        )),
    }
}

/// `text.format` as chat's `response_format`; `None` for plain text.
fn response_format(text: &Value) -> Result<Option<Value>, ApiError> {
    if !text.is_object() {
        return Err(ApiError::invalid("text", "text must be an object: {\"format\": {...}}"));
    }
    let Some(format) = text.get("format").filter(|f| !f.is_null()) else { return Ok(None) };
    match format["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") if format.get("schema").is_some() => {
            let name = format["name"].as_str().unwrap_or("output");
            let schema = json!({"name": name, "schema": format["schema"], "strict": format["strict"]});
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(ApiError::invalid(
            "text",
            "text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"schema\": ...}",
        )),
    }
}

/// What a response echoes of its request.
fn echo(req: &ResponsesRequest) -> Value {
    let tools: Vec<Value> = req.tools.iter().flatten().filter(|t| t["type"] == "function").cloned().collect();
    json!({
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(false),
        "previous_response_id": req.previous_response_id,
        "store": req.store.unwrap_or(true),
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": req.text.clone().unwrap_or_else(|| json!({"format": {"type": "text"}})),
        "tool_choice": req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        "tools": tools,
        "truncation": "disabled",
        "metadata": req.metadata.clone().unwrap_or_else(|| json!({})),
    })
}

pub async fn create(
    State(app): State<Arc<AppState>>,
    Extension(tagged): Extension<Tagged>,
    body: Result<ApiJson<ResponsesRequest>, ApiError>,
) -> Response {
    let tracker = app.tracker(&tagged);
    // The earlier conversation is looked up here, before validation takes the body.
    let body = body.and_then(|ApiJson(mut req)| {
        if let Some(prev) = &req.previous_response_id {
            let stored = app.responses.get(prev).ok_or_else(|| {
                ApiError::invalid("previous_response_id", format!("no stored response with id `{prev}`"))
            })?;
            req.history = stored.conversation();
        }
        Ok(ApiJson(req))
    });
    let kept = body.as_ref().ok().map(|ApiJson(req)| {
        let input: Vec<Value> = req.history.iter().cloned().chain(req.input.items()).collect();
        (echo(req), req.store.unwrap_or(true).then_some(input))
    });
    let valid = crate::validate_blocking(&app, body, |v, req| v.chat(to_chat(req)?)).await;
    let store = app.responses.clone();
    crate::run(app, tagged, tracker, valid, move |id, v| {
        let (echo, input) = kept.unwrap_or_default();
        ResponsesFormat {
            id: format!("resp_{id}"),
            created_at: crate::unix_now(),
            model: v.model.clone(),
            echo,
            keep: input.map(|input| (store, input)),
            tools: v.tools.clone(),
            held: v.tools.as_ref().map(|_| Output::default()),
            text: None,
            calls: Vec::new(),
            finish: None,
            sequence: 0,
            tokenizer: v.tokenizer.clone(),
            logprobs: Vec::new(),
        }
    })
    .await
}

/// `GET /v1/responses/{id}`.
pub async fn get(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let stored = app.responses.get(&id).ok_or(ApiError::ResponseNotFound(id))?;
    Ok(Json(stored.response))
}

/// `GET /v1/responses/{id}/input_items`: the conversation's items before the
/// response, oldest first.
pub async fn input_items(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let stored = app.responses.get(&id).ok_or(ApiError::ResponseNotFound(id))?;
    let ids = |i: Option<&Value>| i.and_then(|v| v.get("id")).cloned().unwrap_or(Value::Null);
    let (first_id, last_id) = (ids(stored.input.first()), ids(stored.input.last()));
    Ok(Json(
        json!({"object": "list", "data": stored.input, "first_id": first_id, "last_id": last_id, "has_more": false}),
    ))
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    match app.responses.delete(&id) {
        true => Ok(Json(json!({"id": id, "object": "response", "deleted": true}))),
        false => Err(ApiError::ResponseNotFound(id)),
    }
}

/// Writes a `response`, or its streaming events, and keeps it when asked to.
pub struct ResponsesFormat {
    id: String,
    created_at: u64,
    model: String,
    echo: Value,
    /// Where the answer is kept, and the conversation before it (`store`).
    keep: Option<(Arc<ResponseStore>, Vec<Value>)>,
    tools: Option<Arc<Tools>>,
    /// Streamed text held back while it may still be a tool call (tools offered).
    held: Option<Output>,
    /// The message's text so far, once the reply is known to be a message.
    text: Option<String>,
    /// The reply's calls, once it is known to be calls.
    calls: Vec<Call>,
    finish: Option<FinishReason>,
    /// Events sent, for their `sequence_number`.
    sequence: u64,
    /// Reads the logprobs' tokens.
    tokenizer: Arc<Tokenizer>,
    /// The message's token logprobs so far, when they were asked for.
    logprobs: Vec<Value>,
}

impl ResponsesFormat {
    fn tag(&self) -> &str {
        self.id.trim_start_matches("resp_")
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.tag())
    }

    /// One event: its name is its object's `type`, numbered in order.
    fn event(&mut self, mut data: Value) -> String {
        data["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        format!("event: {}\ndata: {data}\n\n", data["type"].as_str().unwrap_or("message"))
    }

    fn message(&self, status: &str) -> Value {
        let content = match &self.text {
            Some(t) if status == "completed" => {
                json!([{"type": "output_text", "text": t, "annotations": [], "logprobs": self.logprobs}])
            }
            _ => json!([]),
        };
        json!({"type": "message", "id": self.message_id(), "status": status, "role": "assistant", "content": content})
    }

    fn call_item(&self, i: usize, c: &Call, arguments: &str, status: &str) -> Value {
        json!({
            "type": "function_call", "id": format!("fc_{}_{i}", self.tag()), "call_id": format!("call_{}_{i}", self.tag()),
            "name": c.name, "arguments": arguments, "status": status,
        })
    }

    fn output(&self) -> Vec<Value> {
        match self.calls.is_empty() {
            true => self.text.is_some().then(|| self.message("completed")).into_iter().collect(),
            false => {
                self.calls.iter().enumerate().map(|(i, c)| self.call_item(i, c, &c.arguments, "completed")).collect()
            }
        }
    }

    /// `completed`, or `incomplete` when `max_output_tokens` cut a message.
    fn status(&self) -> &'static str {
        match (self.calls.is_empty(), self.finish) {
            (true, Some(FinishReason::Length)) => "incomplete",
            _ => "completed",
        }
    }

    /// The response object; with `usage`, finished.
    fn object(&self, usage: Option<Usage>) -> Value {
        let (status, output) = match usage {
            Some(_) => (self.status(), self.output()),
            None => ("in_progress", Vec::new()),
        };
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": null,
            "incomplete_details": incomplete, "model": self.model, "output": output,
            "usage": usage.map(usage_json),
        });
        if let (Value::Object(r), Value::Object(echo)) = (&mut r, &self.echo) {
            r.extend(echo.clone());
        }
        r
    }

    /// Keeps the finished response, when asked to.
    fn keep(&mut self, response: &Value) {
        if let Some((store, input)) = self.keep.take() {
            store.put(self.id.clone(), Stored { response: response.clone(), input });
        }
    }

    /// `tokens`' logprobs, kept for the whole message and answered for a delta.
    fn scored(&mut self, tokens: &[TokenInfo]) -> Vec<Value> {
        let scored: Vec<Value> = crate::chat_completions::token_logprobs(&self.tokenizer, tokens)
            .into_iter()
            .map(|t| serde_json::to_value(t).unwrap_or_default())
            .collect();
        self.logprobs.extend(scored.iter().cloned());
        scored
    }

    /// Events that send `text` in the message, opening it first.
    fn text_events(&mut self, text: &str, logprobs: Vec<Value>) -> Vec<String> {
        let mut out = Vec::new();
        if self.text.is_none() {
            self.text = Some(String::new());
            let item = self.message("in_progress");
            out.push(self.event(json!({"type": "response.output_item.added", "output_index": 0, "item": item})));
            let part = json!({"type": "output_text", "text": "", "annotations": []});
            let added = json!({"type": "response.content_part.added", "item_id": self.message_id(), "output_index": 0, "content_index": 0, "part": part});
            out.push(self.event(added));
        }
        // A token without text (the end of turn) still brings its logprob.
        if !text.is_empty() || !logprobs.is_empty() {
            self.text.get_or_insert_default().push_str(text);
            let delta = json!({"type": "response.output_text.delta", "item_id": self.message_id(), "output_index": 0, "content_index": 0, "delta": text, "logprobs": logprobs});
            out.push(self.event(delta));
        }
        out
    }

    /// The events that close an open message.
    fn close_message(&mut self) -> Vec<String> {
        let Some(text) = self.text.clone() else { return Vec::new() };
        let id = self.message_id();
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        let item = self.message("completed");
        vec![
            self.event(json!({"type": "response.output_text.done", "item_id": id, "output_index": 0, "content_index": 0, "text": text, "logprobs": self.logprobs})),
            self.event(json!({"type": "response.content_part.done", "item_id": id, "output_index": 0, "content_index": 0, "part": part})),
            self.event(json!({"type": "response.output_item.done", "output_index": 0, "item": item})),
        ]
    }

    /// Each call as an item: added, its arguments as one delta, done.
    fn call_events(&mut self, calls: Vec<Call>) -> Vec<String> {
        let mut out = Vec::new();
        for (i, c) in calls.iter().enumerate() {
            let (added, done) =
                (self.call_item(i, c, "", "in_progress"), self.call_item(i, c, &c.arguments, "completed"));
            let id = done["id"].clone();
            out.push(self.event(json!({"type": "response.output_item.added", "output_index": i, "item": added})));
            out.push(self.event(json!({"type": "response.function_call_arguments.delta", "item_id": id, "output_index": i, "delta": c.arguments})));
            out.push(self.event(json!({"type": "response.function_call_arguments.done", "item_id": id, "output_index": i, "arguments": c.arguments})));
            out.push(self.event(json!({"type": "response.output_item.done", "output_index": i, "item": done})));
        }
        self.calls = calls;
        out
    }

    /// The calls of a finished reply, when it is calls.
    fn calls_of(&self, out: &Output) -> Option<Vec<Call>> {
        self.tools.as_ref()?.calls(&out.text).filter(|_| out.finish.is_some())
    }
}

fn usage_json(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

impl Format for ResponsesFormat {
    fn preamble(&mut self, _index: u32) -> Option<String> {
        let created = json!({"type": "response.created", "response": self.object(None)});
        let in_progress = json!({"type": "response.in_progress", "response": self.object(None)});
        let mut frames = self.event(created) + &self.event(in_progress);
        // Without tools the reply is a message from its first token.
        if self.held.is_none() {
            frames.extend(self.text_events("", Vec::new()));
        }
        Some(frames)
    }

    fn chunk(&mut self, _index: u32, step: &Output) -> Vec<String> {
        self.finish = step.finish.or(self.finish);
        let logprobs = self.scored(&step.tokens);
        match crate::tools::hold(self.tools.as_deref(), &mut self.held, step) {
            Held::Waiting => Vec::new(),
            Held::Calls(calls) => self.call_events(calls),
            Held::Text(text) => self.text_events(&text, logprobs),
        }
    }

    fn usage_chunk(&self, _usage: Usage) -> String {
        String::new()
    }

    fn ending(&mut self, usage: Usage, _include_usage: bool) -> Vec<String> {
        // A reply held to its end as a possible call, that was not one.
        let held = self.held.take().filter(|h| !h.text.is_empty());
        let mut out: Vec<String> = held.map(|h| self.text_events(&h.text, Vec::new())).unwrap_or_default();
        out.extend(self.close_message());
        let response = self.object(Some(usage));
        self.keep(&response);
        let kind = if response["status"] == "incomplete" { "response.incomplete" } else { "response.completed" };
        out.push(self.event(json!({"type": kind, "response": response})));
        out
    }

    fn failure(&mut self, e: &ApiError) -> Vec<String> {
        let mut response = self.object(None);
        response["status"] = json!("failed");
        response["error"] = json!({"code": e.kind(), "message": e.to_string()});
        vec![self.event(json!({"type": "response.failed", "response": response}))]
    }

    fn response(&mut self, choices: &[(u32, Output)], usage: Usage) -> String {
        let empty = Output::default();
        let out = choices.first().map_or(&empty, |(_, o)| o);
        self.finish = out.finish;
        match self.calls_of(out) {
            Some(calls) => self.calls = calls,
            None => {
                self.scored(&out.tokens);
                self.text = Some(out.text.clone());
            }
        }
        let response = self.object(Some(usage));
        self.keep(&response);
        to_json(&response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> ResponsesRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn items_become_chat_turns() {
        let req = request(json!({
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "reasoning", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
                      {"type": "function", "name": "get_time"}, {"type": "web_search"}],
            "tool_choice": {"type": "function", "name": "get_time"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "max_output_tokens": 50,
        }));
        let chat = to_chat(req).unwrap();
        let roles: Vec<&str> = chat.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "system", "user", "assistant", "tool", "tool"]);
        assert_eq!(chat.messages[3].tool_calls.as_ref().unwrap().as_array().unwrap().len(), 2);
        assert_eq!(chat.tools.unwrap().as_array().unwrap().len(), 2, "web_search is left out");
        assert_eq!(chat.tool_choice.unwrap()["function"]["name"], "get_time");
        assert_eq!(chat.common.response_format.unwrap()["json_schema"]["name"], "w");
        assert_eq!(chat.common.max_tokens, Some(50));
        assert!(chat.clamp_to_context);
    }

    #[test]
    fn malformed_requests_are_400s_naming_their_field() {
        let bad = [
            (json!({"input": [{"type": "input_image", "image_url": "x"}]}), "input"),
            (json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}), "input"),
            (json!({"input": [{"role": "robot", "content": "hi"}]}), "input"),
            (json!({"input": [{"type": "function_call", "name": "f"}]}), "input"),
            (json!({"input": [{"type": "function_call_output", "output": "x"}]}), "input"),
            (json!({"input": "hi", "tools": [{"type": "function"}]}), "tools"),
            (json!({"input": "hi", "tool_choice": {"type": "file_search"}}), "tool_choice"),
            (json!({"input": "hi", "text": {"format": {"type": "xml"}}}), "text"),
            (json!({"input": "hi", "text": "plain"}), "text"),
        ];
        for (body, param) in bad {
            match to_chat(request(body.clone())) {
                Err(ApiError::Invalid { param: Some(p), .. }) => assert_eq!(p, param, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    /// The default model's tokenizer, read once.
    fn tokenizer() -> Arc<Tokenizer> {
        static TOKENIZER: std::sync::OnceLock<Arc<Tokenizer>> = std::sync::OnceLock::new();
        let read = || {
            let path = pdserve_engine::models::require_default_model();
            pdserve_engine::loader::load_meta(&path).expect("the default model").tokenizer
        };
        TOKENIZER.get_or_init(read).clone()
    }

    fn format(tools: bool) -> ResponsesFormat {
        let tools = tools.then(|| {
            let list = json!([{"type": "function", "function": {"name": "get_time"}}]);
            Arc::new(crate::tools::parse(Some(&list), None, None).unwrap().unwrap())
        });
        ResponsesFormat {
            id: "resp_x".into(),
            created_at: 0,
            model: "m".into(),
            echo: json!({"store": true}),
            keep: Some((Arc::new(ResponseStore::default()), vec![json!({"role": "user", "content": "hi"})])),
            held: tools.as_ref().map(|_| Output::default()),
            tools,
            text: None,
            calls: Vec::new(),
            finish: None,
            sequence: 0,
            tokenizer: tokenizer(),
            logprobs: Vec::new(),
        }
    }

    fn step(text: &str, finish: Option<FinishReason>) -> Output {
        Output { text: text.into(), finish, ..Default::default() }
    }

    fn types(frames: &[String]) -> Vec<String> {
        frames.iter().map(|f| f.lines().next().unwrap().trim_start_matches("event: ").to_string()).collect()
    }

    #[test]
    fn a_streamed_message_opens_sends_closes_and_completes() {
        let mut f = format(false);
        let mut frames = vec![f.preamble(0).unwrap()];
        frames.extend(f.chunk(0, &step("Hel", None)));
        frames.extend(f.chunk(0, &step("lo", Some(FinishReason::Length))));
        frames.extend(f.ending(Usage { prompt_tokens: 3, completion_tokens: 2, cached_tokens: 1 }, false));
        let all: Vec<String> = frames.iter().flat_map(|f| f.split_inclusive("\n\n").map(String::from)).collect();
        assert_eq!(
            types(&all),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.incomplete",
            ]
        );
        let last: Value =
            serde_json::from_str(all.last().unwrap().lines().nth(1).unwrap().trim_start_matches("data: ")).unwrap();
        assert_eq!(last["sequence_number"], 9);
        assert_eq!(last["response"]["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(last["response"]["usage"]["input_tokens_details"]["cached_tokens"], 1);
        assert_eq!(last["response"]["incomplete_details"]["reason"], "max_output_tokens");
        assert!(f.keep.is_none(), "kept once, then the handle is gone");
    }

    #[test]
    fn a_reply_that_is_a_call_is_a_function_call_item_and_is_kept() {
        let mut f = format(true);
        let store = f.keep.as_ref().unwrap().0.clone();
        let call = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let body: Value =
            serde_json::from_str(&f.response(&[(0, step(call, Some(FinishReason::Stop)))], Usage::default())).unwrap();
        assert_eq!(body["status"], "completed");
        assert_eq!(body["output"][0]["type"], "function_call");
        assert_eq!(body["output"][0]["name"], "get_time");
        let kept = store.get("resp_x").unwrap();
        let conversation = kept.conversation();
        assert_eq!(conversation.len(), 2);
        assert_eq!(conversation[1]["call_id"], "call_x_0");
        let turns = turns(&conversation).unwrap();
        assert_eq!(turns[1]["tool_calls"][0]["function"]["name"], "get_time", "a kept call reads back as a call");
    }
}
