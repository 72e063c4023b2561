//! Structured outputs: the request fields that constrain what the model writes, as
//! OpenAI, vLLM and llama-server name them, turned into one [`Grammar`]:
//!
//! - `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`
//!   (any JSON object), or `{"type": "json_schema", "json_schema": {"name", "schema",
//!   "strict"}}` (the schema's language; `strict` is accepted and always holds);
//! - vLLM's `guided_json` (a schema, as an object or as JSON text), `guided_regex`,
//!   `guided_choice` (a list of strings), `guided_grammar` (Lark, in llguidance's
//!   dialect), and the same four as `structured_outputs: {"json" | "regex" |
//!   "choice" | "grammar": ...}`;
//! - llama-server's `json_schema` (a schema object).
//!
//! One request gives at most one of these: two are a 400, since we could not tell
//! which one the client meant. Whether the grammar compiles is checked by the caller.

use crate::errors::ApiError;
use crate::openai::CommonParams;
use pdserve_types::{Grammar, GrammarSpec};
use serde_json::Value;

/// The grammar the request's fields ask for, if any, and the field that asked.
pub fn grammar(c: &CommonParams) -> Result<Option<(&'static str, Grammar)>, ApiError> {
    let mut found: Vec<(&'static str, GrammarSpec)> = Vec::new();
    if let Some(v) = &c.response_format {
        if let Some(spec) = response_format(v)? {
            found.push(("response_format", spec));
        }
    }
    let guided = [
        ("guided_json", &c.guided_json, Kind::Json),
        ("guided_regex", &c.guided_regex, Kind::Regex),
        ("guided_choice", &c.guided_choice, Kind::Choice),
        ("guided_grammar", &c.guided_grammar, Kind::Lark),
        ("json_schema", &c.json_schema, Kind::Json),
    ];
    for (param, v, kind) in guided {
        if let Some(v) = v {
            found.push((param, kind.spec(param, v)?));
        }
    }
    if let Some(v) = &c.structured_outputs {
        found.push(("structured_outputs", structured_outputs(v)?));
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop().map(|(param, spec)| (param, Grammar::new(spec)))),
        _ => {
            let names: Vec<&str> = found.iter().map(|(p, _)| *p).collect();
            let msg = format!("give one output constraint, not several: {}", names.join(", "));
            Err(ApiError::invalid(found[1].0, msg))
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Json,
    Regex,
    Choice,
    Lark,
}

impl Kind {
    fn spec(self, param: &'static str, v: &Value) -> Result<GrammarSpec, ApiError> {
        match self {
            Kind::Json => Ok(GrammarSpec::JsonSchema(schema_text(param, v)?)),
            Kind::Regex => Ok(GrammarSpec::Regex(text(param, v, "a regular expression")?)),
            Kind::Lark => Ok(GrammarSpec::Lark(text(param, v, "a grammar")?)),
            Kind::Choice => choice(param, v),
        }
    }
}

fn response_format(v: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    const P: &str = "response_format";
    let kind = v.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonSchema(r#"{"type":"object"}"#.into()))),
        Some("json_schema") => {
            let Some(js) = v.get("json_schema").filter(|j| j.is_object()) else {
                return Err(ApiError::invalid(P, "response_format of type json_schema needs a `json_schema` object"));
            };
            if js.get("name").is_some_and(|n| !n.is_string()) {
                return Err(ApiError::invalid(P, "response_format.json_schema.name must be a string"));
            }
            match js.get("schema") {
                // OpenAI allows leaving the schema out: any JSON.
                None | Some(Value::Null) => Ok(Some(GrammarSpec::JsonSchema("{}".into()))),
                Some(s) => Ok(Some(GrammarSpec::JsonSchema(schema_text(P, s)?))),
            }
        }
        Some(other) => Err(ApiError::invalid(
            P,
            format!("unknown response_format type `{other}`; use text, json_object or json_schema"),
        )),
        None => Err(ApiError::invalid(P, "response_format needs a `type`: text, json_object or json_schema")),
    }
}

fn structured_outputs(v: &Value) -> Result<GrammarSpec, ApiError> {
    const P: &str = "structured_outputs";
    let Some(o) = v.as_object() else {
        return Err(ApiError::invalid(P, "structured_outputs must be an object"));
    };
    let kinds = [("json", Kind::Json), ("regex", Kind::Regex), ("choice", Kind::Choice), ("grammar", Kind::Lark)];
    let given: Vec<_> = kinds.iter().filter(|(k, _)| o.get(*k).is_some_and(|x| !x.is_null())).collect();
    match given.as_slice() {
        [(k, kind)] => kind.spec(P, &o[*k]),
        [] => Err(ApiError::invalid(P, "structured_outputs needs one of json, regex, choice or grammar")),
        _ => Err(ApiError::invalid(P, "structured_outputs takes one of json, regex, choice or grammar, not several")),
    }
}

/// A schema given as an object (or a boolean) or as JSON text, as JSON text.
fn schema_text(param: &'static str, v: &Value) -> Result<String, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.to_string()),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(parsed) if parsed.is_object() || parsed.is_boolean() => Ok(parsed.to_string()),
            _ => Err(ApiError::invalid(param, format!("{param} is a string but not a JSON schema"))),
        },
        _ => Err(ApiError::invalid(param, format!("{param} must be a JSON schema object"))),
    }
}

fn text(param: &'static str, v: &Value, what: &str) -> Result<String, ApiError> {
    match v.as_str() {
        Some(s) if !s.is_empty() => Ok(s.to_string()),
        _ => Err(ApiError::invalid(param, format!("{param} must be {what}, as a non-empty string"))),
    }
}

/// The most strings a choice takes: past ~2,000 sharing a prefix, the grammar
/// engine cannot compute a step's mask (its items-in-a-row limit).
const MAX_CHOICES: usize = 1000;

/// One of the given strings exactly: a Lark alternation of string literals.
fn choice(param: &'static str, v: &Value) -> Result<GrammarSpec, ApiError> {
    let items =
        v.as_array().filter(|a| !a.is_empty()).and_then(|a| a.iter().map(Value::as_str).collect::<Option<Vec<_>>>());
    let Some(items) = items else {
        return Err(ApiError::invalid(param, format!("{param} must be a non-empty list of strings")));
    };
    if items.len() > MAX_CHOICES {
        return Err(ApiError::invalid(
            param,
            format!("{param} has {} items, over the limit of {MAX_CHOICES}", items.len()),
        ));
    }
    // JSON string escapes are valid Lark string literals.
    let alts: Vec<String> = items.iter().map(|s| Value::from(*s).to_string()).collect();
    Ok(GrammarSpec::Lark(format!("start: {}", alts.join(" | "))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params(v: Value) -> CommonParams {
        serde_json::from_value(v).unwrap()
    }

    fn spec(v: Value) -> Result<Option<GrammarSpec>, ApiError> {
        grammar(&params(v)).map(|g| g.map(|(_, g)| g.spec))
    }

    #[test]
    fn every_form_becomes_one_grammar() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let as_text = GrammarSpec::JsonSchema(schema.to_string());
        let forms = [
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
            json!({"guided_json": schema}),
            json!({"guided_json": schema.to_string()}),
            json!({"json_schema": schema}),
            json!({"structured_outputs": {"json": schema}}),
        ];
        for f in forms {
            assert_eq!(spec(f.clone()).unwrap(), Some(as_text.clone()), "{f}");
        }
        assert_eq!(spec(json!({"response_format": {"type": "text"}})).unwrap(), None);
        assert_eq!(spec(json!({})).unwrap(), None);
        assert!(matches!(
            spec(json!({"response_format": {"type": "json_object"}})),
            Ok(Some(GrammarSpec::JsonSchema(_)))
        ));
        assert_eq!(spec(json!({"guided_regex": "a+"})).unwrap(), Some(GrammarSpec::Regex("a+".into())));
        assert_eq!(
            spec(json!({"structured_outputs": {"choice": ["yes", "n\"o"]}})).unwrap(),
            Some(GrammarSpec::Lark(r#"start: "yes" | "n\"o""#.into()))
        );
    }

    #[test]
    fn bad_forms_are_400s_that_name_the_field() {
        let bad = [
            (json!({"response_format": {"type": "xml"}}), "response_format"),
            (json!({"response_format": {}}), "response_format"),
            (json!({"response_format": {"type": "json_schema"}}), "response_format"),
            (json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}), "response_format"),
            (json!({"guided_json": "not json"}), "guided_json"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_choice": [1, 2]}), "guided_choice"),
            (json!({"guided_regex": ""}), "guided_regex"),
            (json!({"structured_outputs": {"json": {}, "regex": "a"}}), "structured_outputs"),
            (json!({"structured_outputs": {}}), "structured_outputs"),
            (json!({"guided_regex": "a", "response_format": {"type": "json_object"}}), "guided_regex"),
        ];
        for (body, param) in bad {
            match spec(body.clone()) {
                Err(ApiError::Invalid { param: Some(p), .. }) => assert_eq!(p, param, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
    }
}
