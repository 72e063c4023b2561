//! The OpenAI wire format, both ways: request bodies for `/v1/completions` and
//! `/v1/chat/completions`, and what a streamed chunk means for the measurement.
//!
//! Every request streams with usage (`stream_options.include_usage`), sets
//! `max_tokens = min_tokens = N` and `ignore_eos` so that servers which honour them
//! (pdserve, vLLM, llama-server) produce exactly N tokens, and is greedy unless
//! `--temperature` says otherwise.

use crate::error::BenchError;
use crate::prompt::{ids_to_text, PromptKind};
use crate::sse::SseEvent;
use crate::workload::RequestSpec;
use serde_json::{json, Value};
use std::str::FromStr;

/// Which API the load goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    Completions,
    Chat,
}

impl FromStr for Endpoint {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "completions" => Ok(Self::Completions),
            "chat" => Ok(Self::Chat),
            _ => Err(BenchError::BadFlag(format!("unknown endpoint {s:?}: expected completions or chat"))),
        }
    }
}

impl Endpoint {
    /// Path under the API base (`.../v1`).
    pub fn path(self) -> &'static str {
        match self {
            Self::Completions => "/completions",
            Self::Chat => "/chat/completions",
        }
    }
}

/// Everything about a request body that is not the workload.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BodyOptions {
    pub endpoint: Endpoint,
    pub prompt_kind: PromptKind,
    /// The `model` field; omitted when `None`.
    pub model: Option<String>,
    pub temperature: f64,
    /// Ask for the generated ids (vLLM's `return_token_ids`): generated replies go
    /// back into later turns.
    #[serde(default)]
    pub token_ids: bool,
}

impl BodyOptions {
    /// Chat takes messages, i.e. text.
    pub fn validate(&self) -> Result<(), BenchError> {
        if self.endpoint == Endpoint::Chat && self.prompt_kind == PromptKind::Ids {
            return Err(BenchError::BadFlag("chat requests carry text: use --prompt text with --endpoint chat".into()));
        }
        if self.token_ids && (self.endpoint, self.prompt_kind) != (Endpoint::Completions, PromptKind::Ids) {
            let why = "generated replies go back as token ids: use --endpoint completions --prompt ids";
            return Err(BenchError::BadFlag(why.into()));
        }
        Ok(())
    }

    /// The JSON body of one request.
    pub fn body(&self, spec: &RequestSpec) -> Value {
        let n = spec.output_len;
        let mut body = json!({
            "max_tokens": n,
            "min_tokens": n,
            "ignore_eos": true,
            "temperature": self.temperature,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let p = &spec.prompt;
        let (key, value) = match (self.endpoint, self.prompt_kind) {
            (Endpoint::Completions, _) if spec.text.is_some() => ("prompt", json!(spec.text.as_deref())),
            (Endpoint::Chat, _) if spec.text.is_some() => {
                ("messages", json!([{"role": "user", "content": spec.text.as_deref()}]))
            }
            (Endpoint::Completions, PromptKind::Ids) => ("prompt", json!(p.ids())),
            (Endpoint::Completions, PromptKind::Text) => ("prompt", json!(ids_to_text(&p.ids()))),
            (Endpoint::Chat, _) => ("messages", chat_messages(&p.prefix, &p.body)),
        };
        body[key] = value;
        if let Some(m) = &self.model {
            body["model"] = json!(m);
        }
        if self.token_ids {
            body["return_token_ids"] = json!(true);
        }
        body
    }
}

/// A shared prefix becomes the system message, the rest the user message.
fn chat_messages(prefix: &[u32], body: &[u32]) -> Value {
    let mut msgs = Vec::new();
    if !prefix.is_empty() {
        msgs.push(json!({"role": "system", "content": ids_to_text(prefix)}));
    }
    msgs.push(json!({"role": "user", "content": ids_to_text(body)}));
    Value::Array(msgs)
}

/// Token counts a server reported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// What one SSE event means for the measurement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamItem {
    /// `data: [DONE]`.
    Done,
    /// A chunk: does it carry generated text, does it finish a choice, does it say
    /// usage, and the ids it carries (where the server returns them).
    Chunk { content: bool, finished: bool, usage: Option<Usage>, ids: Vec<u32> },
    /// The server reported an error in-band.
    Error(String),
}

/// Interprets one event. Anything unparseable is an error of the request, not a panic.
pub fn interpret(ev: &SseEvent) -> StreamItem {
    let data = ev.data.trim();
    if ev.event == "error" {
        return StreamItem::Error(format!("error event: {}", clip(data)));
    }
    if data == "[DONE]" {
        return StreamItem::Done;
    }
    let v: Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(_) => return StreamItem::Error(format!("chunk is not JSON: {}", clip(data))),
    };
    if let Some(e) = v.get("error") {
        let msg = e.get("message").and_then(Value::as_str).map_or_else(|| e.to_string(), str::to_string);
        return StreamItem::Error(format!("server error: {}", clip(&msg)));
    }
    let choices = v.get("choices").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
    let content = choices.iter().any(has_text);
    let finished = choices.iter().any(|c| c.get("finish_reason").is_some_and(|f| !f.is_null()));
    let usage = v.get("usage").filter(|u| u.is_object()).map(|u| Usage {
        prompt_tokens: u.get("prompt_tokens").and_then(Value::as_u64),
        completion_tokens: u.get("completion_tokens").and_then(Value::as_u64),
    });
    let ids = choices
        .iter()
        .filter_map(|c| c.get("token_ids")?.as_array())
        .flatten()
        .filter_map(|id| u32::try_from(id.as_u64()?).ok())
        .collect();
    StreamItem::Chunk { content, finished, usage, ids }
}

/// Completions put text in `text`, chat in `delta.content` (or a reasoning field).
fn has_text(choice: &Value) -> bool {
    let nonempty = |v: Option<&Value>| v.and_then(Value::as_str).is_some_and(|s| !s.is_empty());
    let delta = choice.get("delta");
    nonempty(choice.get("text"))
        || nonempty(delta.and_then(|d| d.get("content")))
        || nonempty(delta.and_then(|d| d.get("reasoning_content")))
}

/// At most 200 characters of a server's text, for error records.
pub fn clip(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::Prompt;

    fn ev(data: &str) -> SseEvent {
        SseEvent { event: String::new(), data: data.into() }
    }

    fn spec() -> RequestSpec {
        RequestSpec {
            index: 0,
            prompt: Prompt { prefix: vec![0, 1], body: vec![2] },
            output_len: 4,
            ..Default::default()
        }
    }

    #[test]
    fn completion_bodies_carry_ids_or_text_and_exact_lengths() {
        let mut o = BodyOptions {
            endpoint: Endpoint::Completions,
            prompt_kind: PromptKind::Ids,
            model: Some("m".into()),
            temperature: 0.0,
            token_ids: false,
        };
        let b = o.body(&spec());
        assert_eq!(b["prompt"], json!([0, 1, 2]));
        assert_eq!((b["max_tokens"].clone(), b["min_tokens"].clone()), (json!(4), json!(4)));
        assert_eq!(b["ignore_eos"], json!(true));
        assert_eq!(b["stream_options"]["include_usage"], json!(true));
        assert_eq!(b["model"], json!("m"));
        o.prompt_kind = PromptKind::Text;
        o.model = None;
        let b = o.body(&spec());
        assert_eq!(b["prompt"], json!("the of and"));
        assert!(b.get("model").is_none() && b.get("return_token_ids").is_none());
        // Generated replies go back as ids: asked for, and only with id prompts.
        assert!(BodyOptions { token_ids: true, ..o.clone() }.validate().is_err());
        o.prompt_kind = PromptKind::Ids;
        o.token_ids = true;
        assert!(o.validate().is_ok());
        assert_eq!(o.body(&spec())["return_token_ids"], json!(true));
    }

    #[test]
    fn chat_bodies_put_the_prefix_in_the_system_message() {
        let o = BodyOptions {
            endpoint: Endpoint::Chat,
            prompt_kind: PromptKind::Text,
            model: None,
            temperature: 0.0,
            token_ids: false,
        };
        let b = o.body(&spec());
        assert_eq!(b["messages"][0]["role"], json!("system"));
        assert_eq!(b["messages"][0]["content"], json!("the of"));
        assert_eq!(b["messages"][1]["content"], json!("and"));
        assert!(BodyOptions { prompt_kind: PromptKind::Ids, ..o }.validate().is_err());
    }

    #[test]
    fn a_prompt_of_a_file_goes_as_it_is() {
        let text = RequestSpec { text: Some("Quote this.".into()), ..spec() };
        for (endpoint, kind) in [(Endpoint::Completions, PromptKind::Ids), (Endpoint::Chat, PromptKind::Text)] {
            let o = BodyOptions { endpoint, prompt_kind: kind, model: None, temperature: 0.0, token_ids: false };
            let b = o.body(&text);
            match endpoint {
                Endpoint::Completions => assert_eq!(b["prompt"], json!("Quote this.")),
                Endpoint::Chat => assert_eq!(b["messages"], json!([{"role": "user", "content": "Quote this."}])),
            }
        }
    }

    #[test]
    fn chunks_are_read_for_content_finish_and_usage() {
        let text = interpret(&ev(r#"{"choices":[{"index":0,"text":"Hi","finish_reason":null}]}"#));
        assert_eq!(text, StreamItem::Chunk { content: true, finished: false, usage: None, ids: vec![] });
        let delta = interpret(&ev(r#"{"choices":[{"delta":{"content":"x"},"finish_reason":"length"}]}"#));
        assert_eq!(delta, StreamItem::Chunk { content: true, finished: true, usage: None, ids: vec![] });
        let role = interpret(&ev(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#));
        assert_eq!(role, StreamItem::Chunk { content: false, finished: false, usage: None, ids: vec![] });
        let usage = interpret(&ev(r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}"#));
        let want = Usage { prompt_tokens: Some(5), completion_tokens: Some(7) };
        assert_eq!(usage, StreamItem::Chunk { content: false, finished: false, usage: Some(want), ids: vec![] });
        let null_usage = interpret(&ev(r#"{"choices":[{"text":"a"}],"usage":null}"#));
        assert_eq!(null_usage, StreamItem::Chunk { content: true, finished: false, usage: None, ids: vec![] });
        assert_eq!(interpret(&ev(" [DONE] ")), StreamItem::Done);
        let ids = interpret(&ev(r#"{"choices":[{"text":"a b","token_ids":[5,6]}]}"#));
        assert_eq!(ids, StreamItem::Chunk { content: true, finished: false, usage: None, ids: vec![5, 6] });
    }

    #[test]
    fn errors_in_band_are_errors() {
        let e = interpret(&ev(r#"{"error":{"message":"out of blocks","type":"server_error"}}"#));
        assert_eq!(e, StreamItem::Error("server error: out of blocks".into()));
        let e = interpret(&SseEvent { event: "error".into(), data: "boom".into() });
        assert_eq!(e, StreamItem::Error("error event: boom".into()));
        assert!(matches!(interpret(&ev("{not json")), StreamItem::Error(m) if m.starts_with("chunk is not JSON")));
        assert_eq!(clip(&"é".repeat(300)).chars().count(), 201);
    }
}
