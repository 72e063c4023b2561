//! Anthropic's Messages API end to end over real HTTP, with the real tokenizer and
//! chat template and a fake backend: the message and its streaming events, tool use
//! both ways, token counting, and errors in Anthropic's shape. A Messages request
//! renders to exactly the prompt its chat-completions twin renders to.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{model, Script, Server, CACHED};
use pdserve_protocol::ServeError;
use serde_json::{json, Value};

const ANSWER: &str = "The capital of France is Paris.";
const CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

fn reply(text: &str) -> Script {
    Script::Reply(text.to_string())
}

fn body(extra: Value) -> Value {
    let mut b = json!({
        "max_tokens": 64,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    });
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

fn weather_tool() -> Value {
    json!({"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
}

/// The events of an Anthropic SSE body: (event name, data), the name matching the
/// data's `type`.
fn events(r: &common::Reply) -> Vec<(String, Value)> {
    let text = r.text();
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.trim_end()
        .split("\n\n")
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap();
            let name = name.strip_prefix("event: ").unwrap_or_else(|| panic!("no event name: {e:?}")).to_string();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name.as_str(), "{e}");
            (name, data)
        })
        .collect()
}

/// An Anthropic error body with this status; its `error.type`.
fn error(r: &common::Reply, status: u16) -> String {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    v["error"]["type"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn a_message_renders_its_chat_twin_and_answers_as_a_message() {
    let s = Server::start(reply(ANSWER)).await;
    let r = s.post_json("/v1/messages", &body(json!({"model": model().name, "temperature": 0}))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!((v["type"].as_str(), v["role"].as_str()), (Some("message"), Some("assistant")));
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(v["content"], json!([{"type": "text", "text": ANSWER}]));
    assert_eq!((v["stop_reason"].as_str(), v["stop_sequence"].is_null()), (Some("end_turn"), true));
    let prompt = s.last_request().prompt;
    let u = &v["usage"];
    assert_eq!(u["cache_read_input_tokens"], CACHED);
    assert_eq!(u["input_tokens"].as_u64().unwrap() as usize + CACHED, prompt.len());
    assert_eq!(u["output_tokens"], model().tokenizer.encode(ANSWER, false).len() + 1);
    // The chat request it means renders to the same prompt.
    let twin = json!({"max_tokens": 64, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"}]});
    assert_eq!(s.post_json("/v1/chat/completions", &twin).await.status, 200);
    assert_eq!(s.last_request().prompt, prompt);
    // Sampling fields arrive as they would from chat.
    let r = s.post_json("/v1/messages", &body(json!({"top_k": 5, "top_p": 0.5, "max_tokens": 3}))).await;
    assert_eq!(r.json()["stop_reason"], "max_tokens");
    let params = s.last_request().params;
    assert_eq!((params.top_k, params.top_p, params.max_tokens), (5, 0.5, 3));
}

#[tokio::test]
async fn a_stop_sequence_that_ends_the_reply_is_named_whole_or_streamed() {
    let s = Server::start(reply(ANSWER)).await;
    let r = s.post_json("/v1/messages", &body(json!({"stop_sequences": ["zzz", " is"]}))).await;
    let v = r.json();
    assert_eq!(v["content"][0]["text"], "The capital of France");
    assert_eq!((v["stop_reason"].as_str(), v["stop_sequence"].as_str()), (Some("stop_sequence"), Some(" is")));
    let r = s.post_json("/v1/messages", &body(json!({"stop_sequences": [" is"], "stream": true}))).await;
    let delta = events(&r).into_iter().find(|(n, _)| n == "message_delta").unwrap().1;
    assert_eq!(delta["delta"], json!({"stop_reason": "stop_sequence", "stop_sequence": " is"}));
    let r = s.post_json("/v1/messages", &body(json!({"stop_sequences": ["zzz"]}))).await;
    assert_eq!((r.json()["stop_reason"].as_str(), r.json()["stop_sequence"].is_null()), (Some("end_turn"), true));
}

#[tokio::test]
async fn a_streamed_message_sends_anthropics_events_in_order() {
    let s = Server::start(reply(ANSWER)).await;
    let r = s.post_json("/v1/messages", &body(json!({"stream": true}))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.is_stream());
    let ev = events(&r);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "content_block_start", "ping"]);
    assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    assert!(names[3..names.len() - 3].iter().all(|n| *n == "content_block_delta"), "{names:?}");
    let start = &ev[0].1["message"];
    assert_eq!((start["content"].clone(), start["stop_reason"].is_null()), (json!([]), true));
    assert_eq!(start["usage"]["input_tokens"], s.last_request().prompt.len());
    let text: String = ev.iter().filter_map(|(_, d)| d["delta"]["text"].as_str()).collect();
    assert_eq!(text, ANSWER);
    let delta = &ev[ev.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(delta["usage"]["output_tokens"], model().tokenizer.encode(ANSWER, false).len() + 1);
}

#[tokio::test]
async fn a_reply_that_calls_a_tool_is_a_tool_use_block_whole_or_streamed() {
    let s = Server::start(reply(CALL)).await;
    let tools = json!({"tools": [weather_tool()], "tool_choice": {"type": "auto"}});
    let v = s.post_json("/v1/messages", &body(tools.clone())).await.json();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let block = &v["content"][0];
    assert_eq!((block["type"].as_str(), block["name"].as_str()), (Some("tool_use"), Some("get_weather")));
    assert_eq!(block["input"], json!({"city": "Paris"}));
    assert!(block["id"].as_str().unwrap().starts_with("toolu_"));

    let mut streamed = tools;
    streamed["stream"] = json!(true);
    let ev = events(&s.post_json("/v1/messages", &body(streamed)).await);
    let start = ev.iter().find(|(n, _)| n == "content_block_start").unwrap();
    assert_eq!(start.1["content_block"]["type"], "tool_use");
    assert_eq!(start.1["content_block"]["input"], json!({}));
    let json: String = ev.iter().filter_map(|(_, d)| d["delta"]["partial_json"].as_str()).collect();
    assert_eq!(serde_json::from_str::<Value>(&json).unwrap(), json!({"city": "Paris"}));
    assert!(ev.iter().all(|(_, d)| d["delta"]["type"] != "text_delta"), "no text around the call");
    assert_eq!(ev[ev.len() - 2].1["delta"]["stop_reason"], "tool_use");
}

#[tokio::test]
async fn tool_use_and_tool_result_blocks_render_as_chat_calls_and_results() {
    let s = Server::start(reply(ANSWER)).await;
    let messages = json!([
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C, sunny"}]}]},
    ]);
    let req = json!({"max_tokens": 32, "messages": messages, "tools": [weather_tool()]});
    assert_eq!(s.post_json("/v1/messages", &req).await.status, 200);
    let prompt = s.last_request().prompt;
    let twin = json!({"max_tokens": 32, "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city", "parameters": weather_tool()["input_schema"]}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "toolu_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"}]});
    assert_eq!(s.post_json("/v1/chat/completions", &twin).await.status, 200);
    assert_eq!(s.last_request().prompt, prompt);
    // What is counted is what would be sent.
    let r =
        s.post_json("/v1/messages/count_tokens", &json!({"messages": req["messages"], "tools": req["tools"]})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json(), json!({"input_tokens": prompt.len()}));
}

#[tokio::test]
async fn bad_requests_and_backend_errors_come_in_anthropics_shape() {
    let s = Server::start(reply(ANSWER)).await;
    let no_max = json!({"messages": [{"role": "user", "content": "Hi"}]});
    assert_eq!(error(&s.post_json("/v1/messages", &no_max).await, 400), "invalid_request_error");
    let image = body(json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}));
    assert_eq!(error(&s.post_json("/v1/messages", &image).await, 400), "invalid_request_error");
    let role = body(json!({"messages": [{"role": "tool", "content": "Hi"}]}));
    assert_eq!(error(&s.post_json("/v1/messages", &role).await, 400), "invalid_request_error");
    assert_eq!(error(&s.post("/v1/messages", "{not json").await, 400), "invalid_request_error");
    let model = body(json!({"model": "no-such-model"}));
    assert_eq!(error(&s.post_json("/v1/messages", &model).await, 404), "not_found_error");
    let choice = body(json!({"tools": [weather_tool()], "tool_choice": {"type": "tool"}}));
    assert_eq!(error(&s.post_json("/v1/messages/count_tokens", &choice).await, 400), "invalid_request_error");

    let busy = Server::start(Script::Refuse(ServeError::Overloaded("busy".into()))).await;
    let r = busy.post_json("/v1/messages", &body(json!({}))).await;
    assert_eq!(error(&r, 429), "rate_limit_error");
    assert!(r.header("retry-after").is_some());

    let lost = Server::start(Script::FailAfter(2, ServeError::Internal("worker lost".into()))).await;
    let ev = events(&lost.post_json("/v1/messages", &body(json!({"stream": true}))).await);
    let (name, last) = ev.last().unwrap();
    assert_eq!((name.as_str(), last["error"]["type"].as_str()), ("error", Some("api_error")));
    assert!(last["error"]["message"].as_str().unwrap().contains("worker lost"));
}

/// What Claude Code sends: `max_tokens` past the context, an empty tool list, system
/// turns among the messages, a JSON schema in `output_config`, fields for thinking
/// and context management.
#[tokio::test]
async fn what_claude_code_sends_is_served() {
    let s = Server::start(reply(ANSWER)).await;
    let schema = json!({"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]});
    let req = body(json!({
        "max_tokens": 32000, "tools": [], "thinking": {"type": "adaptive"},
        "context_management": {"edits": []}, "metadata": {"user_id": "u"}, "output_config": {"effort": "high"},
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Title this."}],
    }));
    let r = s.post_json("/v1/messages", &req).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let sent = s.last_request();
    // Up to the context's end, not refused.
    assert_eq!(sent.params.max_tokens as usize, common::CONTEXT - sent.prompt.len());
    // A schema in output_config is a structured output (this server has no grammar
    // compiler, so it says so; the e2e suite's server follows the schema).
    let schema = body(json!({"output_config": {"format": {"type": "json_schema", "schema": schema}}}));
    let r = s.post_json("/v1/messages", &schema).await;
    assert_eq!(error(&r, 400), "invalid_request_error");
    assert!(r.text().contains("constrained outputs"), "{}", r.text());
    let bad = body(json!({"output_config": {"format": {"type": "xml"}}}));
    assert_eq!(error(&s.post_json("/v1/messages", &bad).await, 400), "invalid_request_error");
}
