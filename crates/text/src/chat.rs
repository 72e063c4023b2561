//! Chat templates: turning a conversation into the prompt text a model was trained on.
//!
//! Models ship their own Jinja template (GGUF `tokenizer.chat_template`,
//! tokenizer_config.json `chat_template`). We compile it once with minijinja, set up the
//! way Hugging Face transformers renders templates so the prompt matches byte for byte:
//! `trim_blocks` and `lstrip_blocks` on, a template's final newline dropped, and the
//! extras templates rely on: `raise_exception`, `strftime_now`, a Python-style `tojson`
//! and the common Python string and dict methods (`.strip()`, `.items()`, ...).

use crate::tokenizer::Tokenizer;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind, State, Value};
use pdserve_types::civil::civil_from_days;
use serde::{Deserialize, Serialize};

const NAME: &str = "chat";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, `[{"type": "function", "function": {"name",
    /// "arguments"}}]` with the arguments as an object, for templates that render
    /// them (see [`ChatTemplate::writes_tool_calls`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), tool_calls: None }
    }
}

/// Why a template could not be used. `Render` errors usually come from the request (a
/// template may `raise_exception` when roles do not alternate), so callers can report
/// them to the client.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template does not compile: {0}")]
    Compile(#[source] minijinja::Error),
    #[error("chat template failed: {0}")]
    Render(#[source] minijinja::Error),
}

#[derive(Debug)]
enum Kind {
    Jinja(Box<Environment<'static>>),
    ChatMl,
}

/// A compiled chat template, cheap to render many times and shareable across threads.
#[derive(Debug)]
pub struct ChatTemplate {
    kind: Kind,
    bos: String,
    eos: String,
    /// The template renders a `tools` list and writes calls as `<tool_call>` blocks.
    tool_calls: bool,
}

impl ChatTemplate {
    /// Compiles `source`. `bos` and `eos` are the texts templates see as `bos_token`
    /// and `eos_token`.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(py_method);
        env.add_template_owned(NAME, source.to_string()).map_err(ChatError::Compile)?;
        let tool_calls = source.contains("tools") && source.contains("<tool_call>");
        Ok(ChatTemplate { kind: Kind::Jinja(Box::new(env)), bos: bos.into(), eos: eos.into(), tool_calls })
    }

    /// ChatML (`<|im_start|>role\ncontent<|im_end|>\n` per message), for models that
    /// ship no template. It is the format most small instruct models (SmolLM, Qwen)
    /// use, so it is the least-bad guess; a model trained on another format will still
    /// answer, less well. Rendered in Rust, so it cannot fail.
    pub fn fallback_chatml() -> Self {
        ChatTemplate { kind: Kind::ChatMl, bos: String::new(), eos: String::new(), tool_calls: false }
    }

    /// The tokenizer's own template with its BOS and EOS texts, or ChatML without one.
    pub fn for_tokenizer(tok: &Tokenizer) -> Result<Self, ChatError> {
        let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or_default();
        match tok.chat_template() {
            Some(source) => Self::new(source, &text(tok.bos_id()), &text(tok.eos_id())),
            None => Ok(Self::fallback_chatml()),
        }
    }

    /// The prompt for `messages`; with `add_generation_prompt`, ending with the header
    /// of the assistant turn the model is to write.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, ChatError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Whether the model's own template shows the model a `tools` list and writes
    /// calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Hermes and
    /// Qwen style), the format pdserve parses. Other templates get the tools in a
    /// system message instead.
    pub fn writes_tool_calls(&self) -> bool {
        self.tool_calls
    }

    /// [`render`](Self::render), with `tools` (OpenAI's list of function definitions)
    /// given to the template as `tools`.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with(messages, tools, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`render_with_tools`](Self::render_with_tools), with `extra` variables for the
    /// template beside the standard ones (a request's `chat_template_kwargs`, such as
    /// Qwen 3's `enable_thinking`). The standard ones win over an extra of the same
    /// name.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatError> {
        let env = match &self.kind {
            Kind::Jinja(env) => env,
            Kind::ChatMl => return Ok(render_chatml(messages, add_generation_prompt)),
        };
        let template = env.get_template(NAME).map_err(ChatError::Render)?;
        let ctx = context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
            ..Value::from_serialize(extra)
        };
        template.render(ctx).map_err(ChatError::Render)
    }
}

fn render_chatml(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str(&format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content));
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    out
}

/// Templates call this to reject a conversation they cannot format.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's `json.dumps` as transformers calls it: non-ASCII kept, `", "` and `": "`
/// separators, or one item per line with `indent`. (minijinja's own `tojson`
/// escapes HTML characters, which would change the prompt.)
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Accepted for compatibility; ours never escapes non-ASCII and keeps map order.
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json =
        serde_json::to_value(value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let (open, close, items): (char, char, Vec<(Option<&String>, &J)>) = match v {
        J::Array(a) => ('[', ']', a.iter().map(|x| (None, x)).collect()),
        J::Object(o) => ('{', '}', o.iter().map(|(k, x)| (Some(k), x)).collect()),
        scalar => return out.push_str(&scalar.to_string()),
    };
    out.push(open);
    for (i, (key, item)) in items.iter().enumerate() {
        out.push_str(if i == 0 {
            ""
        } else if indent.is_some() {
            ","
        } else {
            ", "
        });
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * (depth + 1)));
        }
        if let Some(k) = key {
            out.push_str(&J::from(k.as_str()).to_string());
            out.push_str(": ");
        }
        write_json(item, indent, depth + 1, out);
    }
    if let (Some(n), false) = (indent, items.is_empty()) {
        out.push('\n');
        out.push_str(&" ".repeat(n * depth));
    }
    out.push(close);
}

/// The Python methods templates call on strings and dicts, which Jinja gets from
/// Python itself.
fn py_method(_: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        return str_method(s, method, args);
    }
    if value.kind() == ValueKind::Map {
        return map_method(value, method, args);
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}

fn str_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    let arg = |i: usize| args.get(i).and_then(Value::as_str);
    let needed = |i: usize| arg(i).ok_or_else(|| Error::new(ErrorKind::MissingArgument, format!("str.{method}")));
    let set = arg(0).map(|c| c.chars().collect::<Vec<_>>());
    let strip_char = |c: char| set.as_ref().map_or(c.is_whitespace(), |set| set.contains(&c));
    Ok(match method {
        "strip" => s.trim_matches(strip_char).into(),
        "lstrip" => s.trim_start_matches(strip_char).into(),
        "rstrip" => s.trim_end_matches(strip_char).into(),
        "startswith" => s.starts_with(needed(0)?).into(),
        "endswith" => s.ends_with(needed(0)?).into(),
        "upper" => s.to_uppercase().into(),
        "lower" => s.to_lowercase().into(),
        "replace" => s.replace(needed(0)?, needed(1)?).into(),
        "split" => split(s, arg(0)).into(),
        "capitalize" => capitalize(s).into(),
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

/// `str.split()`: on whitespace runs without a separator, else on each separator.
fn split(s: &str, sep: Option<&str>) -> Vec<String> {
    match sep {
        Some(sep) if !sep.is_empty() => s.split(sep).map(str::to_string).collect(),
        _ => s.split_whitespace().map(str::to_string).collect(),
    }
}

fn capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars.flat_map(char::to_lowercase)).collect(),
        None => String::new(),
    }
}

fn map_method(map: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    let keys = || map.try_iter().map(|it| it.collect::<Vec<_>>());
    Ok(match method {
        "keys" => Value::from(keys()?),
        "values" => Value::from(keys()?.iter().map(|k| map.get_item(k)).collect::<Result<Vec<_>, _>>()?),
        "items" => Value::from(
            keys()?
                .into_iter()
                .map(|k| map.get_item(&k).map(|v| Value::from(vec![k, v])))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        "get" => {
            let key = args.first().cloned().unwrap_or_default();
            let found = map.get_item(&key)?;
            if found.is_undefined() {
                args.get(1).cloned().unwrap_or(Value::from(()))
            } else {
                found
            }
        }
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

/// `strftime_now(format)`: the current UTC time in strftime notation. Supports the
/// fields date-stamping templates use (`%d %b %Y` and friends; `%-d` unpadded).
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    strftime(&format, i64::try_from(secs).unwrap_or(0))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let pad = spec != Some('-');
        if !pad {
            spec = chars.next();
        }
        let num = |n: i64| {
            if pad {
                format!("{n:02}")
            } else {
                n.to_string()
            }
        };
        match spec {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&num(month)),
            Some('d') => out.push_str(&num(day)),
            Some('H') => out.push_str(&num(secs / 3600)),
            Some('M') => out.push_str(&num(secs / 60 % 60)),
            Some('S') => out.push_str(&num(secs % 60)),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => out.extend(['%', other]),
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn user(text: &str) -> Vec<ChatMessage> {
        vec![ChatMessage::new("user", text)]
    }

    #[test]
    fn renders_a_chatml_template() {
        let t = ChatTemplate::new(SMOL, "", "").unwrap();
        let out = t.render(&user("Hi"), true).unwrap();
        let want =
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(out, want);
        assert!(!t.render(&user("Hi"), false).unwrap().ends_with("assistant\n"));
    }

    /// The shape of Hermes- and Qwen-style templates' tool handling.
    const HERMES: &str = "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn tool_templates_see_the_tools_and_earlier_calls() {
        let t = ChatTemplate::new(HERMES, "", "").unwrap();
        assert!(t.writes_tool_calls() && !ChatTemplate::new(SMOL, "", "").unwrap().writes_tool_calls());
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls =
            Some(serde_json::json!([{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]));
        let out = t.render_with_tools(&[ChatMessage::new("user", "Hi"), call], Some(&tools), true).unwrap();
        assert!(out.starts_with("<|im_start|>system\n<tools>{") && out.contains(r#""name": "f""#), "{out}");
        assert!(out.contains("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>"), "{out}");
        // Without tools, the same template renders plain turns.
        assert!(!t.render(&user("Hi"), true).unwrap().contains("<tools>"));
    }

    #[test]
    fn fallback_matches_the_jinja_chatml() {
        let src = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let msgs = vec![ChatMessage::new("system", "S"), ChatMessage::new("user", "U")];
        let jinja = ChatTemplate::new(src, "", "").unwrap().render(&msgs, true).unwrap();
        assert_eq!(ChatTemplate::fallback_chatml().render(&msgs, true).unwrap(), jinja);
    }

    #[test]
    fn trims_blocks_like_transformers() {
        let src =
            "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}\n";
        let out = ChatTemplate::new(src, "", "").unwrap().render(&user("x"), false).unwrap();
        assert_eq!(out, "[x]\n");
    }

    #[test]
    fn errors_are_errors_not_panics() {
        assert!(matches!(ChatTemplate::new("{% for %}", "", ""), Err(ChatError::Compile(_))));
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&user("x"), true).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
        let t = ChatTemplate::new("{{ messages[0].content.nosuchmethod() }}", "", "").unwrap();
        assert!(matches!(t.render(&user("x"), true), Err(ChatError::Render(_))));
        let t = ChatTemplate::new("{{ messages[5].content.strip() }}", "", "").unwrap();
        assert!(t.render(&user("x"), true).is_err());
    }

    #[test]
    fn python_methods_and_tokens() {
        let src = "{{ bos_token }}{{ messages[0].content.strip().upper() }}|{{ messages[0].content.split()|length }}|{{ {'a': 1}.get('b', 'no') }}|{% for k, v in {'k': 2}.items() %}{{ k }}={{ v }}{% endfor %}{{ eos_token }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        assert_eq!(t.render(&user("  a b  "), false).unwrap(), "<s>A B|2|no|k=2</s>");
    }

    #[test]
    fn tojson_is_python_style() {
        let src = "{{ {'a': [1, 'é<'], 'b': none}|tojson }}|{{ [1]|tojson(indent=2) }}";
        let out = ChatTemplate::new(src, "", "").unwrap().render(&[], false).unwrap();
        assert_eq!(out, "{\"a\": [1, \"é<\"], \"b\": null}|[\n  1\n]");
    }

    #[test]
    fn strftime_formats_dates() {
        // 2024-07-26 13:25:09 UTC, a Friday.
        let t = 1_722_000_309;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%A %-d %B %H:%M:%S %%", t), "Friday 26 July 13:25:09 %");
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }
}
