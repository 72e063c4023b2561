//! What a grammar may cost, checked on its source before anything compiles it.
//!
//! llguidance's compiler recurses once per `$ref` of a JSON schema and once per rule
//! of a Lark grammar on the way down a chain, so a chain a few hundred links long
//! overflows a thread's stack, which no code can catch: the process aborts. The JSON
//! text's own nesting is bounded where it is parsed (serde's recursion limit), but a
//! chain of references is flat text. So the longest chain of references is measured
//! here, iteratively, and refused past [`MAX_CHAIN`]; compiles also run on threads
//! with a stack far deeper than that bound needs (see `compiler`).

use super::GrammarError;
use pdserve_types::GrammarSpec;
use serde_json::Value;
use std::collections::HashMap;

/// The largest grammar source: a schema, regular expression or Lark grammar. Its
/// compile time grows with it (a 2 MB alternation took minutes).
pub const MAX_GRAMMAR_BYTES: usize = 64 * 1024;
/// The longest chain of `$ref`s or rules. Chains of ~630 overflowed a 2 MiB stack.
pub const MAX_CHAIN: usize = 128;

/// Refuses a grammar too large, too deeply chained, or made of references that only
/// point at each other.
pub fn check(spec: &GrammarSpec) -> Result<(), GrammarError> {
    let text = match spec {
        GrammarSpec::JsonSchema(t) | GrammarSpec::Regex(t) | GrammarSpec::Lark(t) => t,
    };
    if text.len() > MAX_GRAMMAR_BYTES {
        return Err(invalid(format!("the grammar is {} bytes, over the limit of {MAX_GRAMMAR_BYTES}", text.len())));
    }
    let chain = match spec {
        GrammarSpec::JsonSchema(t) => {
            let schema: Value = serde_json::from_str(t).map_err(|e| invalid(format!("schema: {e}")))?;
            schema_chain(&schema)?
        }
        GrammarSpec::Lark(t) => lark_chain(t),
        GrammarSpec::Regex(_) => 0,
    };
    if chain > MAX_CHAIN {
        return Err(invalid(format!("the grammar chains {chain} references deep, over the limit of {MAX_CHAIN}")));
    }
    Ok(())
}

fn invalid(m: String) -> GrammarError {
    GrammarError::Invalid(m)
}

/// A directed graph over nodes `0..n`, built from names.
#[derive(Default)]
struct Graph {
    ids: HashMap<String, usize>,
    edges: Vec<Vec<usize>>,
}

impl Graph {
    fn node(&mut self, name: &str) -> usize {
        if let Some(&i) = self.ids.get(name) {
            return i;
        }
        self.ids.insert(name.to_string(), self.edges.len());
        self.edges.push(Vec::new());
        self.edges.len() - 1
    }

    /// The most edges on a path from `start` that repeats no node, cutting each
    /// cycle where it closes (a recursion compiles once), without recursion.
    fn longest_from(&self, start: usize) -> usize {
        let mut best: Vec<Option<usize>> = vec![None; self.edges.len()];
        let mut on_path = vec![false; self.edges.len()];
        // (node, index of the next edge to follow)
        let mut stack = vec![(start, 0)];
        on_path[start] = true;
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            if let Some(&to) = self.edges[node].get(*next) {
                *next += 1;
                if best[to].is_none() && !on_path[to] {
                    on_path[to] = true;
                    stack.push((to, 0));
                }
                continue;
            }
            let deepest = self.edges[node].iter().filter_map(|&to| best[to].map(|d| d + 1)).max();
            best[node] = Some(deepest.unwrap_or(0));
            on_path[node] = false;
            stack.pop();
        }
        best[start].unwrap_or(0)
    }
}

/// The longest chain of local `$ref`s from the schema's root; an error for refs
/// that only point at each other (`a` is `b` and `b` is `a`: no schema at all).
fn schema_chain(root: &Value) -> Result<usize, GrammarError> {
    let mut g = Graph::default();
    let start = g.node("#");
    let mut todo = vec![("#".to_string(), start)];
    while let Some((ptr, id)) = todo.pop() {
        let Some(node) = resolve(root, &ptr) else { continue };
        for target in local_refs(node) {
            pure_ref_cycle(root, &target)?;
            let known = g.ids.contains_key(&target);
            let to = g.node(&target);
            g.edges[id].push(to);
            if !known {
                todo.push((target, to));
            }
        }
    }
    Ok(g.longest_from(start))
}

/// A `$ref`'s target: a JSON pointer after `#`, or the root.
fn resolve<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    let pointer = percent_decode(pointer);
    if pointer.is_empty() {
        Some(root)
    } else {
        root.pointer(&pointer)
    }
}

/// `%25`-style escapes in a reference (a URI fragment); others pass as they are.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).and_then(|&c| hex(c)), b.get(i + 2).and_then(|&c| hex(c))) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, ..) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every local `$ref` inside `node`, not entering the definitions it carries (those
/// are reached through references, or not at all).
fn local_refs(node: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![node];
    while let Some(v) = todo.pop() {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get("$ref") {
                    if r.starts_with('#') {
                        out.push(r.clone());
                    }
                }
                let children = o.iter().filter(|(k, _)| !matches!(k.as_str(), "$defs" | "definitions"));
                todo.extend(children.map(|(_, c)| c));
            }
            Value::Array(a) => todo.extend(a),
            _ => {}
        }
    }
    out
}

/// Keywords that do not constrain the output: a schema of these and a `$ref` is
/// exactly its target.
const NO_CONSTRAINT: [&str; 8] = ["$ref", "$defs", "definitions", "title", "description", "$comment", "$schema", "$id"];

/// Follows `target` through schemas that are nothing but a reference; an error if
/// that comes back around.
fn pure_ref_cycle(root: &Value, target: &str) -> Result<(), GrammarError> {
    let mut seen = vec![target.to_string()];
    let mut at = target.to_string();
    loop {
        let Some(Value::Object(o)) = resolve(root, &at) else { return Ok(()) };
        let Some(Value::String(next)) = o.get("$ref") else { return Ok(()) };
        if o.keys().any(|k| !NO_CONSTRAINT.contains(&k.as_str())) {
            return Ok(());
        }
        if seen.contains(next) {
            return Err(invalid(format!("schema: `$ref` {next} refers to itself without defining anything")));
        }
        if seen.len() > MAX_CHAIN {
            return Ok(()); // the chain's own bound refuses it
        }
        seen.push(next.clone());
        at = next.clone();
    }
}

/// The longest chain of rule references from `start` (or the first rule) of a Lark
/// grammar. A rough reading of the syntax: a rule is `name:` at a line's start (with
/// an optional `?`/`!` and `.priority`), its body runs to the next rule, and quoted
/// strings and `/regexes/` are skipped. Good enough to bound a chain; llguidance's
/// own parser decides what the grammar means.
fn lark_chain(src: &str) -> usize {
    let rules = lark_rules(src);
    let mut g = Graph::default();
    for (name, _) in &rules {
        g.node(name);
    }
    for (name, body) in &rules {
        let from = g.ids[name.as_str()];
        for word in identifiers(body) {
            if let Some(&to) = g.ids.get(word) {
                g.edges[from].push(to);
            }
        }
    }
    let start = g.ids.get("start").copied().or(rules.first().map(|_| 0));
    start.map_or(0, |s| g.longest_from(s))
}

/// Each rule's name and body text.
fn lark_rules(src: &str) -> Vec<(String, String)> {
    let mut rules: Vec<(String, String)> = Vec::new();
    for line in src.lines() {
        match rule_head(line) {
            Some((name, rest)) => rules.push((name.to_string(), rest.to_string())),
            None => {
                if let Some((_, body)) = rules.last_mut() {
                    body.push('\n');
                    body.push_str(line);
                }
            }
        }
    }
    rules
}

/// `name: rest` (`?name`, `!name`, `name.2`) at the start of a line.
fn rule_head(line: &str) -> Option<(&str, &str)> {
    let t = line.trim_start();
    let t = t.strip_prefix(['?', '!']).unwrap_or(t);
    let end = t.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))?;
    let (name, rest) = t.split_at(end);
    let rest = rest.strip_prefix('.').map_or(rest, |r| r.trim_start_matches(|c: char| c.is_ascii_digit()));
    let rest = rest.trim_start().strip_prefix(':')?;
    (!name.is_empty() && !name.starts_with(|c: char| c.is_ascii_digit())).then_some((name, rest))
}

/// Identifiers in a rule body, outside string literals and regexes.
fn identifiers(body: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let b = body.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            q @ (b'"' | b'/') => i = skip_quoted(b, i, q),
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                out.push(&body[start..i]);
            }
            _ => i += 1,
        }
    }
    out
}

/// The index just past a literal opened by `q` at `i` (backslash escapes honoured).
fn skip_quoted(b: &[u8], mut i: usize, q: u8) -> usize {
    i += 1;
    while i < b.len() && b[i] != q {
        i += if b[i] == b'\\' { 2 } else { 1 };
    }
    i + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ref_chain(n: usize) -> String {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            defs.insert(format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)}));
        }
        defs.insert(format!("d{n}"), json!({"type": "string"}));
        json!({"$defs": defs, "$ref": "#/$defs/d0"}).to_string()
    }

    fn rule_chain(n: usize) -> String {
        let mut s = String::from("start: r0\n");
        for i in 0..n {
            s += &format!("r{i}: r{} | \"x\"\n", i + 1);
        }
        s + &format!("r{n}: \"y\"\n")
    }

    #[test]
    fn chains_are_measured() {
        let cases: Vec<(GrammarSpec, usize)> = vec![
            (GrammarSpec::JsonSchema(r#"{"type":"object"}"#.into()), 0),
            (GrammarSpec::JsonSchema(ref_chain(10)), 11),
            (GrammarSpec::JsonSchema(ref_chain(1000)), 1001),
            // a recursive tree: one link, however deep the output nests
            (
                GrammarSpec::JsonSchema(
                    json!({"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
                           "$ref": "#/$defs/n"})
                    .to_string(),
                ),
                1,
            ),
            // wrapped in allOf, as the probe sent it
            (
                GrammarSpec::JsonSchema(
                    json!({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"allOf": [{"$ref": "#/$defs/c"}]}, "c": {"type": "integer"}},
                           "$ref": "#/$defs/a"})
                    .to_string(),
                ),
                3,
            ),
            (GrammarSpec::Lark(rule_chain(5)), 6),
            (GrammarSpec::Lark(rule_chain(1000)), 1001),
            (GrammarSpec::Lark("start: \"a b c\" | /r0|r1/ | start \"x\"".into()), 0),
            (GrammarSpec::Lark("?start.2: item+\nitem: NUM\n   | WORD\nNUM: /[0-9]+/\nWORD: /[a-z]+/".into()), 2),
        ];
        for (spec, want) in cases {
            let got = match &spec {
                GrammarSpec::JsonSchema(t) => schema_chain(&serde_json::from_str(t).unwrap()).unwrap(),
                GrammarSpec::Lark(t) => lark_chain(t),
                GrammarSpec::Regex(_) => 0,
            };
            assert_eq!(got, want, "{spec:?}");
        }
    }

    #[test]
    fn deep_large_and_empty_grammars_are_refused_before_compiling() {
        let refused = [
            (GrammarSpec::JsonSchema(ref_chain(1000)), "chains 1001 references deep"),
            (GrammarSpec::Lark(rule_chain(1000)), "chains 1001 references deep"),
            (GrammarSpec::Regex("a".repeat(MAX_GRAMMAR_BYTES + 1)), "over the limit of 65536"),
            (
                GrammarSpec::JsonSchema(
                    json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
                        .to_string(),
                ),
                "refers to itself",
            ),
            (
                GrammarSpec::JsonSchema(
                    json!({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}).to_string(),
                ),
                "refers to itself",
            ),
        ];
        for (spec, want) in refused {
            let e = check(&spec).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        for ok in [GrammarSpec::JsonSchema(ref_chain(MAX_CHAIN - 1)), GrammarSpec::Lark(rule_chain(MAX_CHAIN - 1))] {
            check(&ok).unwrap();
        }
    }
}
