//! Token streams of River and Wind requests that ask for `stream`: the API's SSE
//! chunks become Leaves on `infer.stream.<request_id>`, the first token at once (it is
//! the time to first token the caller sees), then a few at a time (at most
//! [`BATCH_TOKENS`] or [`BATCH_AGE`] apart), and are put together into the response
//! object the result Leaf carries, as if the request had not streamed.

use pdserve_fleet::forest::{Api, ForestRequest, Leaf};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

/// Tokens (streamed chunks) per stream Leaf at most.
pub const BATCH_TOKENS: usize = 16;
/// How long a streamed token waits for others before its Leaf goes out.
pub const BATCH_AGE: Duration = Duration::from_millis(20);

/// One choice's text so far, and how it ended.
#[derive(Default)]
struct Choice {
    text: String,
    finish: Option<Value>,
}

/// Puts streamed chunks together and sends them on as stream Leaves.
pub struct Assembler<'a> {
    req: &'a ForestRequest,
    source: &'static str,
    choices: BTreeMap<u64, Choice>,
    /// Text not yet sent, per choice, with its token count.
    pending: BTreeMap<u64, (String, usize, Option<Value>)>,
    since: Option<Instant>,
    seq: u64,
    first: Option<Value>,
    usage: Value,
}

impl<'a> Assembler<'a> {
    pub fn new(req: &'a ForestRequest, source: &'static str) -> Self {
        Assembler {
            req,
            source,
            choices: BTreeMap::new(),
            pending: BTreeMap::new(),
            since: None,
            seq: 0,
            first: None,
            usage: Value::Null,
        }
    }

    /// Takes one chunk; the stream Leaves now due.
    pub fn push(&mut self, chunk: Value) -> Vec<Leaf> {
        if !chunk["usage"].is_null() {
            self.usage = chunk["usage"].clone();
        }
        for c in chunk["choices"].as_array().into_iter().flatten() {
            let index = c["index"].as_u64().unwrap_or(0);
            let text = match self.req.api {
                Api::ChatCompletions => c["delta"]["content"].as_str(),
                Api::Completions => c["text"].as_str(),
            };
            let finish = c.get("finish_reason").filter(|f| !f.is_null()).cloned();
            let choice = self.choices.entry(index).or_default();
            choice.text.push_str(text.unwrap_or(""));
            choice.finish = finish.clone().or(choice.finish.take());
            let p = self.pending.entry(index).or_default();
            p.0.push_str(text.unwrap_or(""));
            p.1 += usize::from(text.is_some_and(|t| !t.is_empty()));
            p.2 = finish.or(p.2.take());
            self.since.get_or_insert_with(Instant::now);
        }
        self.first.get_or_insert(chunk);
        let first = self.seq == 0 && self.pending.values().any(|p| p.1 > 0);
        let full = self.pending.values().any(|p| p.1 >= BATCH_TOKENS || p.2.is_some());
        if first || full {
            self.flush()
        } else {
            Vec::new()
        }
    }

    /// When the oldest unsent token is due, if any.
    pub fn due(&self) -> Option<Instant> {
        self.since.map(|t| t + BATCH_AGE)
    }

    /// A stream Leaf per choice with unsent text.
    pub fn flush(&mut self) -> Vec<Leaf> {
        self.since = None;
        let subject = format!("infer.stream.{}", self.req.request_id);
        let pending = std::mem::take(&mut self.pending);
        pending
            .into_iter()
            .filter(|(_, (text, _, finish))| !text.is_empty() || finish.is_some())
            .map(|(index, (delta, tokens, finish))| {
                self.seq += 1;
                let data = json!({"request_id": self.req.request_id, "seq": self.seq, "index": index,
                                  "delta": delta, "tokens": tokens, "finish_reason": finish,
                                  "context": self.req.context});
                Leaf::new(subject.clone(), self.source, data)
            })
            .collect()
    }

    /// The response object a non-streamed request would have got.
    pub fn response(&self) -> Value {
        let first = self.first.clone().unwrap_or(Value::Null);
        let choices: Vec<Value> = self
            .choices
            .iter()
            .map(|(index, c)| match self.req.api {
                Api::ChatCompletions => json!({"index": index, "message": {"role": "assistant", "content": c.text},
                                               "logprobs": null, "finish_reason": c.finish}),
                Api::Completions => {
                    json!({"index": index, "text": c.text, "logprobs": null, "finish_reason": c.finish})
                }
            })
            .collect();
        let object = match self.req.api {
            Api::ChatCompletions => "chat.completion",
            Api::Completions => "text_completion",
        };
        let mut o = Map::new();
        for k in ["id", "created", "model"] {
            o.insert(k.into(), first[k].clone());
        }
        o.insert("object".into(), Value::from(object));
        o.insert("choices".into(), Value::Array(choices));
        o.insert("usage".into(), self.usage.clone());
        Value::Object(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_fleet::forest::parse_river;

    #[test]
    fn chunks_batch_into_leaves_and_assemble_the_response() {
        let req =
            parse_river(br#"{"messages": [], "stream": true, "nimsforest": {"request_id": "s-1"}}"#, &[]).unwrap();
        let mut a = Assembler::new(&req, "test");
        let chunk = |text: &str, finish: Value| json!({"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]});
        let first = a.push(chunk("ab", Value::Null));
        assert_eq!((first.len(), first[0].data["tokens"].as_u64()), (1, Some(1)), "the first token goes at once");
        let mut leaves = Vec::new();
        for _ in 1..=BATCH_TOKENS {
            leaves.extend(a.push(chunk("ab", Value::Null)));
        }
        assert_eq!(leaves.len(), 1, "a full batch goes out at once");
        assert_eq!(leaves[0].data["tokens"], BATCH_TOKENS);
        assert!(a.push(chunk("c", Value::Null)).is_empty() && a.due().is_some());
        let last = a.push(chunk("", json!("stop")));
        assert_eq!((last.len(), last[0].data["delta"].as_str()), (1, Some("c")));
        assert_eq!(last[0].subject, "infer.stream.s-1");
        a.push(json!({"choices": [], "usage": {"completion_tokens": 17}}));
        let r = a.response();
        assert_eq!(r["choices"][0]["message"]["content"], "ab".repeat(BATCH_TOKENS + 1) + "c");
        assert_eq!(
            (r["choices"][0]["finish_reason"].as_str(), r["object"].as_str()),
            (Some("stop"), Some("chat.completion"))
        );
        assert_eq!(r["usage"]["completion_tokens"], 17);
    }
}
