//! The chat templates of the supported families (Qwen 3 with its thinking switch and
//! tools, Phi-3.5, Llama 3.1 and 3.2, Mistral Nemo, Gemma) rendered by pdserve's
//! minijinja set-up, against Python's jinja2 set up as Hugging Face transformers renders
//! them (`scripts/chat_oracle.py`, run by `scripts/make_oracle.sh`). Every case must
//! match byte for byte.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::chat::{ChatMessage, ChatTemplate};
use serde::Deserialize;
use std::path::PathBuf;

#[derive(Deserialize)]
struct Case {
    family: String,
    template: String,
    bos: String,
    eos: String,
    messages: Vec<ChatMessage>,
    tools: Option<serde_json::Value>,
    add_generation_prompt: bool,
    extra: serde_json::Map<String, serde_json::Value>,
    expected: String,
}

#[test]
fn every_family_renders_as_transformers_does() {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/oracle"));
    let text = std::fs::read_to_string(dir.join("chat.json"))
        .unwrap_or_else(|e| panic!("{}: {e}; run scripts/make_oracle.sh", dir.join("chat.json").display()));
    let cases: Vec<Case> = serde_json::from_str(&text).unwrap();
    let mut failures = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let source = std::fs::read_to_string(dir.join("templates").join(&c.template)).unwrap();
        let template = ChatTemplate::new(&source, &c.bos, &c.eos).unwrap_or_else(|e| panic!("{}: {e}", c.family));
        match template.render_with(&c.messages, c.tools.as_ref(), c.add_generation_prompt, &c.extra) {
            Ok(got) if got == c.expected => {}
            Ok(got) => failures.push(format!("case {i} ({}):\n  want {:?}\n  got  {:?}", c.family, c.expected, got)),
            Err(e) => failures.push(format!("case {i} ({}): {e:#}", c.family)),
        }
    }
    let families: std::collections::BTreeSet<&str> = cases.iter().map(|c| c.family.as_str()).collect();
    eprintln!("{} cases over {families:?}", cases.len());
    assert!(failures.is_empty(), "{} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}
