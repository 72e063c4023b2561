//! Request bodies drawn at random from the API's fields, each given values of every
//! JSON type, edge numbers, odd text and nested structures, mixed with values a
//! client might plausibly send (so draws also get past validation). A test sends
//! thousands and [`check`]s each answer: a whole answer or an OpenAI error with a
//! 4xx status. The draws are seeded, so a failure names the body and recurs.

use crate::http::Reply;
use pdserve_types::rng::Rng;
use serde_json::{json, Map, Value};

/// The project's seeded generator, with the picks the draws need.
pub struct Draws(Rng);

impl Draws {
    pub fn new(seed: u64) -> Self {
        Draws(Rng::new(seed))
    }

    fn below(&mut self, n: usize) -> usize {
        self.0.range(0, n as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }

    /// A body for `endpoint`: its good body with a few fields changed, added or
    /// removed; now and then a body that is not an object at all.
    pub fn body(&mut self, endpoint: &Endpoint) -> Value {
        if self.chance(3) {
            return any_value(self, 0);
        }
        let mut body = endpoint.good.as_object().cloned().unwrap_or_default();
        for _ in 0..1 + self.below(4) {
            let field = self.pick(&endpoint.fields);
            match self.below(10) {
                0 => {
                    body.remove(field);
                }
                1..=4 => {
                    body.insert(field.to_string(), any_value(self, 0));
                }
                _ => {
                    body.insert(field.to_string(), plausible(field, self));
                }
            }
        }
        Value::Object(body)
    }
}

/// Values of every kind, at the edges of what each type holds.
fn any_value(rng: &mut Draws, depth: usize) -> Value {
    let nested = |rng: &mut Draws| {
        let n = rng.below(4);
        (0..n).map(|_| any_value(rng, depth + 1)).collect::<Vec<_>>()
    };
    match rng.below(if depth > 2 { 8 } else { 11 }) {
        0 => Value::Null,
        1 => json!(rng.chance(50)),
        2 => json!(rng.pick(&[0i64, 1, -1, 2, 7, 20, 21, 255, 512, 65_536, i32::MAX as i64, i64::MAX, i64::MIN])),
        3 => json!(rng.pick(&[u64::MAX, 1u64 << 32, 49_152, 49_151])),
        4 => json!(rng.pick(&[0.5f64, -0.0, 1e-300, 1e300, -1e300, 2.000001, 3.4e38, f64::MAX])),
        5 => json!(rng.pick(&["", "x", "hello world", "\u{0}", "é𝄞\u{202e}", "\n\n", "<|im_start|>", "{\"a\":"])),
        6 => json!("ab".repeat(rng.below(3000))),
        7 => json!(rng.pick(&["text", "json_object", "json_schema", "function", "user", "auto", "none", "required"])),
        8 => Value::Array(nested(rng)),
        9 => {
            let keys = ["type", "name", "schema", "json_schema", "content", "role", "text", "function", "a"];
            let m: Map<String, Value> = nested(rng).into_iter().map(|v| (rng.pick(&keys).to_string(), v)).collect();
            Value::Object(m)
        }
        _ => json!(vec![rng.below(50_000) as i64; rng.below(40)]),
    }
}

/// Values a client might plausibly send for `field`, so draws also reach the paths
/// behind validation (sampling, logprobs, constraints, tools, streaming).
fn plausible(field: &str, rng: &mut Draws) -> Value {
    let schema = || json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let tool = json!({"type": "function", "function": {"name": "f", "parameters": schema()}});
    let options: Vec<Value> = match field {
        "max_tokens" | "max_completion_tokens" | "min_tokens" => vec![json!(1), json!(4), json!(16), json!(100_000)],
        "temperature" | "top_p" | "min_p" => vec![json!(0), json!(0.7), json!(1.0), json!(2)],
        "top_k" | "seed" => vec![json!(-1), json!(0), json!(40)],
        "repetition_penalty" | "frequency_penalty" | "presence_penalty" => vec![json!(1.1), json!(-2), json!(2)],
        "n" => vec![json!(1), json!(2), json!(3)],
        "logprobs" => vec![json!(true), json!(0), json!(3), json!(20)],
        "top_logprobs" | "prompt_logprobs" => vec![json!(0), json!(2), json!(5)],
        "stop" => vec![json!("\n"), json!(["a", "b"]), json!(vec!["x"; 5])],
        "stop_token_ids" => vec![json!([2]), json!([0, 1])],
        "logit_bias" => vec![json!({"42": 100}), json!({"42": -100, "7": 3}), json!({"x": 1})],
        "stream" | "echo" | "ignore_eos" | "return_token_ids" | "parallel_tool_calls" => {
            vec![json!(true), json!(false)]
        }
        "stream_options" => vec![json!({"include_usage": true}), json!({"include_usage": false})],
        "response_format" => vec![
            json!({"type": "json_object"}),
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema()}}),
            json!({"type": "text"}),
        ],
        "guided_json" | "json_schema" => vec![schema(), json!(schema().to_string())],
        "guided_regex" => vec![json!("[a-z]{1,3}"), json!("(")],
        "guided_choice" => vec![json!(["yes", "no"]), json!([])],
        "guided_grammar" => vec![json!("start: \"a\" | \"b\""), json!("start: ")],
        "structured_outputs" => vec![json!({"choice": ["a"]}), json!({"regex": "b+"}), json!({"json": schema()})],
        "tools" => vec![json!([tool.clone()]), json!([tool.clone(), tool])],
        "tool_choice" => vec![json!("auto"), json!("required"), json!({"type": "function", "function": {"name": "f"}})],
        "prompt" => vec![json!("Hello"), json!(["a", "b"]), json!([1, 2, 3]), json!([[1], [2, 3]])],
        "messages" => vec![
            json!([{"role": "user", "content": "hi"}]),
            json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": null,
                    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "content": "3", "tool_call_id": "1"}]),
        ],
        "text" => vec![json!("Hello there"), json!(""), json!({"format": {"type": "json_object"}})],
        "input" => vec![
            json!("Hello"),
            json!([{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]),
            json!([{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c", "output": "3"}]),
        ],
        "instructions" => vec![json!("Be brief."), json!("")],
        "max_output_tokens" => vec![json!(1), json!(4), json!(100_000)],
        "store" => vec![json!(true), json!(false)],
        "pooling" => vec![json!("mean"), json!("last"), json!("cls")],
        "encoding_format" => vec![json!("float"), json!("base64"), json!("int8")],
        "dimensions" => vec![json!(8), json!(576)],
        "previous_response_id" => vec![json!("resp_none"), json!("")],
        "tokens" => vec![json!([1, 2, 3]), json!([])],
        "add_special_tokens" | "return_token_strs" => vec![json!(true), json!(false)],
        _ => vec![json!(null)],
    };
    rng.pick(&options)
}

/// The fields completions and chat share.
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "ignore_eos",
    "min_tokens",
    "n",
    "prompt_logprobs",
    "logit_bias",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "json_schema",
    "return_token_ids",
    "user",
];

/// An endpoint with a body: the fields it reads, and a good body to start from.
pub struct Endpoint {
    pub path: &'static str,
    fields: Vec<&'static str>,
    good: Value,
}

/// Every endpoint that takes a body.
pub fn endpoints() -> Vec<Endpoint> {
    let chat_only = ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice"];
    let tokenize = vec!["model", "prompt", "messages", "add_special_tokens", "return_token_strs"];
    vec![
        Endpoint {
            path: "/v1/completions",
            fields: [COMMON, &["prompt", "logprobs", "echo"]].concat(),
            good: json!({"prompt": "Hello", "max_tokens": 4}),
        },
        Endpoint {
            path: "/v1/chat/completions",
            fields: [COMMON, &chat_only, &["parallel_tool_calls"]].concat(),
            good: json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        },
        Endpoint {
            path: "/v1/responses",
            fields: vec![
                "model",
                "input",
                "instructions",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "max_output_tokens",
                "temperature",
                "top_p",
                "stream",
                "store",
                "previous_response_id",
                "text",
                "metadata",
            ],
            good: json!({"input": "hi", "max_output_tokens": 4}),
        },
        Endpoint {
            path: "/v1/embeddings",
            fields: vec!["model", "input", "encoding_format", "dimensions", "pooling", "user"],
            good: json!({"input": ["Hello", "there"]}),
        },
        Endpoint { path: "/tokenize", fields: tokenize, good: json!({"prompt": "Hello"}) },
        Endpoint { path: "/detokenize", fields: vec!["model", "tokens"], good: json!({"tokens": [1, 2]}) },
    ]
}

/// A whole answer: JSON, or SSE ending in `[DONE]` whose events are JSON (or named
/// events, each a JSON object of that `type`).
fn check_answer(reply: &Reply, body: &Value) {
    if reply.is_stream() && reply.text().starts_with("event: ") {
        for (name, v) in reply.named_events() {
            assert_eq!(v["type"], name.as_str(), "{body}: {v}");
        }
    } else if reply.is_stream() {
        for v in reply.chunks_of(body) {
            assert!(v.get("error").is_none() || v["error"]["message"].is_string(), "{body}: {v}");
        }
    } else {
        let v = reply.json_of(body);
        assert!(v.is_object(), "{body}: {v}");
    }
}

/// `reply` to `body` is a whole answer, or an OpenAI error with a 4xx status; returns
/// the status. A 5xx, a cut connection or a panic message fails.
pub fn check(reply: &Reply, body: &Value) -> u16 {
    match reply.status {
        200 => check_answer(reply, body),
        400..=499 => {
            let e = reply.error(reply.status);
            assert!(e["message"].as_str().is_some_and(|m| !m.contains("panicked")), "{body}: {e}");
        }
        other => panic!("answered {other} to {body}: {}", reply.text()),
    }
    reply.status
}
