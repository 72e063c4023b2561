//! Tool calling on chat, as the OpenAI API defines it: `tools` (functions with JSON
//! Schema parameters), `tool_choice` and `parallel_tool_calls` in; `tool_calls` and
//! `finish_reason: "tool_calls"` out; `role: "tool"` results back in the next turn.
//!
//! The tools are described to the model in a system message (see [`Tools::prompt`]),
//! and a call is written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`:
//! the convention most open chat models are tuned on. A reply is a tool call when it
//! starts with that tag, so streaming and whole responses decide alike.
//!
//! - `"auto"` (the default with tools): the model writes prose or calls, unconstrained;
//!   calls it writes are parsed.
//! - `"required"`: the reply is constrained to calls, each naming a tool, its
//!   arguments valid against that tool's `parameters`: exactly one, so the reply ends
//!   when the call is complete, unless `parallel_tool_calls: true` allows up to
//!   [`MAX_PARALLEL_CALLS`]. (llama-server's default; a small model told it may call
//!   again writes the same call twice and runs into `max_tokens`.)
//! - `{"type": "function", "function": {"name": ...}}`: the same, for that tool alone.
//! - `"none"`: the tools are not shown to the model and nothing is parsed.

use crate::errors::ApiError;
use pdserve_types::{Grammar, GrammarSpec};
use serde_json::{json, Map, Value};

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";
/// Calls in one constrained reply at most.
pub const MAX_PARALLEL_CALLS: usize = 8;

#[derive(Debug, Clone)]
pub struct Tools {
    functions: Vec<Function>,
    choice: ToolChoice,
    parallel: bool,
}

#[derive(Debug, Clone)]
struct Function {
    name: String,
    description: Option<String>,
    parameters: Value,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum ToolChoice {
    None,
    Auto,
    Required,
    /// The index of the one function to call.
    Named(usize),
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments object, as JSON text.
    pub arguments: String,
}

/// The request's tools, if it has any; every malformed form is a 400.
pub fn parse(tools: Option<&Value>, choice: Option<&Value>, parallel: Option<bool>) -> Result<Option<Tools>, ApiError> {
    let functions = match tools {
        None | Some(Value::Null) => {
            let harmless = match choice {
                None | Some(Value::Null) => true,
                Some(Value::String(s)) => s == "none" || s == "auto",
                Some(_) => false,
            };
            return if harmless {
                Ok(None)
            } else {
                Err(ApiError::invalid("tool_choice", "tool_choice needs `tools`"))
            };
        }
        Some(Value::Array(list)) => list.iter().map(function).collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(ApiError::invalid("tools", "tools must be a list of {\"type\": \"function\", ...}")),
    };
    if functions.is_empty() {
        return Err(ApiError::invalid("tools", "tools must not be an empty list"));
    }
    if let Some(dup) = functions.iter().enumerate().find(|(i, f)| functions[..*i].iter().any(|g| g.name == f.name)) {
        return Err(ApiError::invalid("tools", format!("two tools are named `{}`", dup.1.name)));
    }
    let choice = tool_choice(choice, &functions)?;
    Ok(Some(Tools { functions, choice, parallel: parallel.unwrap_or(false) }))
}

fn function(v: &Value) -> Result<Function, ApiError> {
    let bad = |msg: &str| ApiError::invalid("tools", msg.to_string());
    if v.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("each tool needs \"type\": \"function\""));
    }
    let f = v.get("function").filter(|f| f.is_object()).ok_or_else(|| bad("each tool needs a `function` object"))?;
    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if name.is_empty() || name.len() > 64 || !name.chars().all(valid) {
        return Err(bad("a function name must be 1 to 64 letters, digits, underscores or dashes"));
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p) if p.is_object() => p.clone(),
        Some(_) => return Err(bad("a function's `parameters` must be a JSON schema object")),
    };
    let description = f.get("description").and_then(Value::as_str).map(String::from);
    Ok(Function { name: name.to_string(), description, parameters })
}

fn tool_choice(v: Option<&Value>, functions: &[Function]) -> Result<ToolChoice, ApiError> {
    const P: &str = "tool_choice";
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            other => Err(ApiError::invalid(
                P,
                format!("unknown tool_choice `{other}`; use none, auto, required or a function"),
            )),
        },
        Some(o @ Value::Object(_)) => {
            let name = o.pointer("/function/name").and_then(Value::as_str);
            let Some(name) = name.filter(|_| o.get("type").and_then(Value::as_str) == Some("function")) else {
                return Err(ApiError::invalid(
                    P,
                    "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ));
            };
            match functions.iter().position(|f| f.name == name) {
                Some(i) => Ok(ToolChoice::Named(i)),
                None => Err(ApiError::invalid(P, format!("tool_choice names `{name}`, which is not among the tools"))),
            }
        }
        Some(_) => Err(ApiError::invalid(P, "tool_choice must be a string or an object")),
    }
}

impl Tools {
    /// Whether the model is shown the tools and its reply is read for calls.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The system message that describes the tools and how to call them.
    pub fn prompt(&self) -> String {
        let mut s = String::from(
            "You can call functions to answer the user. The functions, with JSON Schemas for their arguments:\n<tools>\n",
        );
        for tool in self.definitions().as_array().into_iter().flatten() {
            s.push_str(&tool.to_string());
            s.push('\n');
        }
        s.push_str("</tools>\nTo call a function, reply with nothing but one block per call:\n");
        s.push_str(&format!(
            "{CALL_OPEN}\n{{\"name\": \"<function name>\", \"arguments\": {{<arguments>}}}}\n{CALL_CLOSE}"
        ));
        s
    }

    /// The tools shown to the model, as OpenAI's list, for templates that render
    /// them.
    pub fn definitions(&self) -> Value {
        let list = self.shown().iter().map(|f| {
            let mut spec = json!({"name": f.name, "parameters": f.parameters});
            if let Some(d) = &f.description {
                spec["description"] = Value::from(d.as_str());
            }
            json!({"type": "function", "function": spec})
        });
        Value::Array(list.collect())
    }

    fn shown(&self) -> &[Function] {
        match self.choice {
            ToolChoice::Named(i) => &self.functions[i..=i],
            _ => &self.functions,
        }
    }

    /// The constraint of `required` and of a named function: the reply is calls only.
    pub fn grammar(&self) -> Result<Option<Grammar>, ApiError> {
        if !matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_)) {
            return Ok(None);
        }
        let mut defs = Map::new();
        let mut calls = Vec::new();
        for f in self.shown() {
            let mut params = f.parameters.clone();
            // Definitions move to the root, where `#/$defs/...` references resolve.
            if let Some(Value::Object(d)) = params.as_object_mut().and_then(|p| p.remove("$defs")) {
                for (k, v) in d {
                    if defs.get(&k).is_some_and(|old| old != &v) {
                        return Err(ApiError::invalid("tools", format!("two tools define `$defs/{k}` differently")));
                    }
                    defs.insert(k, v);
                }
            }
            calls.push(json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            }));
        }
        let mut schema = if calls.len() == 1 { calls.remove(0) } else { json!({"anyOf": calls}) };
        if !defs.is_empty() {
            schema["$defs"] = Value::Object(defs);
        }
        pdserve_text::grammar::compact_json(&mut schema);
        let more =
            if self.parallel { format!("(\"\\n\" call){{0,{}}}", MAX_PARALLEL_CALLS - 1) } else { String::new() };
        let lark = format!(
            "start: call {more}\ncall: {} %json {schema} {}\n",
            Value::from(format!("{CALL_OPEN}\n")),
            Value::from(format!("\n{CALL_CLOSE}"))
        );
        Ok(Some(Grammar::new(GrammarSpec::Lark(lark))))
    }

    /// Whether a reply that starts with `text` may still turn out to be a call.
    pub fn may_call(&self, text: &str) -> bool {
        let t = text.trim_start();
        self.active() && (t.starts_with(CALL_OPEN) || CALL_OPEN.starts_with(t))
    }

    /// The calls of a reply that is nothing but calls to known tools (whitespace
    /// aside), or `None`: then the reply is prose. A last call cut off unfinished
    /// (by `max_tokens`) is dropped when complete calls come before it.
    pub fn calls(&self, text: &str) -> Option<Vec<Call>> {
        if !self.active() {
            return None;
        }
        let mut rest = text.trim();
        let mut calls = Vec::new();
        while !rest.is_empty() {
            if !calls.is_empty() && cut_call(rest) {
                break;
            }
            let after = rest.strip_prefix(CALL_OPEN)?;
            let (body, tail) = after.split_once(CALL_CLOSE).unwrap_or((after, ""));
            let v: Value = serde_json::from_str(body.trim()).ok()?;
            let name = v.get("name")?.as_str()?;
            if !self.functions.iter().any(|f| f.name == name) {
                return None;
            }
            let args = v.get("arguments").filter(|a| a.is_object())?;
            calls.push(Call { name: name.to_string(), arguments: args.to_string() });
            rest = tail.trim_start();
        }
        (!calls.is_empty()).then_some(calls)
    }
}

/// Whether `rest` is the start of a call that never closed: its opening tag or part
/// of it, with no closing tag after.
fn cut_call(rest: &str) -> bool {
    let opening = rest.starts_with(CALL_OPEN) || CALL_OPEN.starts_with(rest);
    opening && !rest.contains(CALL_CLOSE)
}

/// What a streamed step of a reply that may be tool calls comes to.
pub enum Held {
    /// Still possibly calls: nothing to send yet.
    Waiting,
    /// The reply ended as these calls.
    Calls(Vec<Call>),
    /// Text to send: the reply is prose (what was held, with this step).
    Text(String),
}

/// Adds `step` to the text `held` back while the reply may still become calls (no
/// tools offered, or the reply known to be prose: `held` is `None` and the step's
/// text goes out as it is).
pub fn hold(
    tools: Option<&Tools>,
    held: &mut Option<crate::generation::Output>,
    step: &crate::generation::Output,
) -> Held {
    let Some(h) = held.as_mut() else { return Held::Text(step.text.clone()) };
    h.text.push_str(&step.text);
    h.finish = step.finish;
    if step.finish.is_none() && tools.is_some_and(|t| t.may_call(&h.text)) {
        return Held::Waiting;
    }
    let h = held.take().unwrap_or_default();
    match tools.and_then(|t| t.calls(&h.text)).filter(|_| h.finish.is_some()) {
        Some(calls) => Held::Calls(calls),
        None => Held::Text(h.text),
    }
}

/// An assistant turn's earlier calls (its `tool_calls`) as (name, arguments), the
/// arguments an object where their JSON text parses.
fn earlier_calls(calls: &Value) -> Result<Vec<(&str, Value)>, ApiError> {
    let bad = || ApiError::invalid("messages", "an assistant's tool_calls must be a list of function calls");
    let list = calls.as_array().ok_or_else(bad)?;
    list.iter()
        .map(|c| {
            let name = c.pointer("/function/name").and_then(Value::as_str).ok_or_else(bad)?;
            let args = match c.pointer("/function/arguments") {
                Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Value::from(s.as_str())),
                Some(v) => v.clone(),
                None => json!({}),
            };
            Ok((name, args))
        })
        .collect()
}

/// Earlier calls written as the model writes them, so the conversation reads as it
/// happened.
pub fn render_calls(calls: &Value) -> Result<String, ApiError> {
    let blocks = earlier_calls(calls)?
        .into_iter()
        .map(|(name, args)| format!("{CALL_OPEN}\n{}\n{CALL_CLOSE}", json!({"name": name, "arguments": args})));
    Ok(blocks.collect::<Vec<_>>().join("\n"))
}

/// Earlier calls as a chat template that renders tools reads them.
pub fn template_calls(calls: &Value) -> Result<Value, ApiError> {
    let list = earlier_calls(calls)?
        .into_iter()
        .map(|(name, args)| json!({"type": "function", "function": {"name": name, "arguments": args}}));
    Ok(Value::Array(list.collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time"}}])
    }

    fn tools(choice: Value) -> Tools {
        parse(Some(&weather()), Some(&choice), None).unwrap().unwrap()
    }

    #[test]
    fn malformed_tools_and_choices_are_400s() {
        let bad: [(Option<Value>, Option<Value>, &str); 8] = [
            (Some(json!("notalist")), None, "tools"),
            (Some(json!([])), None, "tools"),
            (Some(json!([{"type": "function"}])), None, "tools"),
            (Some(json!([{"type": "retrieval", "function": {"name": "a"}}])), None, "tools"),
            (Some(json!([{"type": "function", "function": {"name": "a b"}}])), None, "tools"),
            (Some(weather()), Some(json!({"type": "function", "function": {"name": "nope"}})), "tool_choice"),
            (Some(weather()), Some(json!("sometimes")), "tool_choice"),
            (None, Some(json!("required")), "tool_choice"),
        ];
        for (t, c, param) in bad {
            match parse(t.as_ref(), c.as_ref(), None) {
                Err(ApiError::Invalid { param: Some(p), .. }) => assert_eq!(p, param, "{t:?} {c:?}"),
                other => panic!("{t:?} {c:?}: {other:?}"),
            }
        }
        assert!(parse(None, Some(&json!("auto")), None).unwrap().is_none());
    }

    #[test]
    fn replies_are_calls_only_when_they_are_nothing_but_calls() {
        let t = tools(json!("auto"));
        let one = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let calls = t.calls(one).unwrap();
        assert_eq!(calls, vec![Call { name: "get_weather".into(), arguments: r#"{"city":"Oslo"}"#.into() }]);
        assert_eq!(t.calls(&format!("{one}\n{one}")).unwrap().len(), 2);
        assert_eq!(t.calls("It is sunny."), None);
        assert_eq!(t.calls(&format!("Sure! {one}")), None);
        assert_eq!(t.calls("<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>"), None);
        assert!(t.may_call("  <tool") && t.may_call("<tool_call>{") && !t.may_call("Hi"));
        assert_eq!(tools(json!("none")).calls(one), None);
    }

    #[test]
    fn complete_calls_survive_a_cut_last_call() {
        let t = tools(json!("required"));
        let one = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let table: [(&str, Option<usize>); 6] = [
            ("<tool_call>\n{\"name\": \"get_ti", None),
            (&format!("{one}\n<tool_call>\n{{\"name\": \"get_ti")[..], Some(1)),
            (&format!("{one}\n<tool_")[..], Some(1)),
            (&format!("{one}\n{one}")[..], Some(2)),
            (&format!("{one}\nand then some prose")[..], None),
            (&format!("{one}\n<tool_call>{{\"name\": \"get_time\", \"arguments\": 3}}</tool_call>")[..], None),
        ];
        for (text, calls) in table {
            assert_eq!(t.calls(text).map(|c| c.len()), calls, "{text}");
        }
    }

    #[test]
    fn a_forced_call_is_one_call_unless_parallel_calls_are_asked_for() {
        let grammar = |parallel| {
            let t = parse(Some(&weather()), Some(&json!("required")), parallel).unwrap().unwrap();
            match t.grammar().unwrap() {
                Some(Grammar { spec: GrammarSpec::Lark(g), .. }) => g,
                _ => panic!("no grammar"),
            }
        };
        assert!(!grammar(None).contains("{0,") && !grammar(Some(false)).contains("{0,"));
        assert!(grammar(Some(true)).contains("{0,7}"));
    }

    #[test]
    fn earlier_calls_render_as_text_or_for_templates() {
        let calls = json!([{"id": "c0", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}]);
        assert_eq!(
            render_calls(&calls).unwrap(),
            "<tool_call>\n{\"name\":\"get_time\",\"arguments\":{\"zone\":\"UTC\"}}\n</tool_call>"
        );
        let t = template_calls(&calls).unwrap();
        assert_eq!(t[0]["function"]["arguments"]["zone"], "UTC", "arguments become an object: {t}");
        assert!(render_calls(&json!("nope")).is_err() && template_calls(&json!([{"x": 1}])).is_err());
        let defs = tools(json!({"type": "function", "function": {"name": "get_time"}})).definitions();
        assert_eq!(defs.as_array().unwrap().len(), 1);
        assert_eq!(defs[0]["function"]["name"], "get_time");
    }

    #[test]
    fn required_and_named_choices_constrain_to_calls() {
        assert!(tools(json!("auto")).grammar().unwrap().is_none());
        let Some(Grammar { spec: GrammarSpec::Lark(all), .. }) = tools(json!("required")).grammar().unwrap() else {
            panic!("no grammar")
        };
        assert!(all.contains("anyOf") && all.contains("get_time"), "{all}");
        let named = tools(json!({"type": "function", "function": {"name": "get_time"}}));
        let Some(Grammar { spec: GrammarSpec::Lark(one), .. }) = named.grammar().unwrap() else { panic!("no grammar") };
        assert!(!one.contains("get_weather") && !one.contains("anyOf"), "{one}");
        assert!(!named.prompt().contains("get_weather"));
    }
}
