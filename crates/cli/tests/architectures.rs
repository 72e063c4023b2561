//! Every architecture served end to end, on the random-weight files llama.cpp's
//! quantizer made (`scripts/make_oracle.sh`, target/oracle): disaggregated, the KV
//! moving over TCP, the greedy text is the aggregated text; a repeated prompt is
//! served from the prefix cache with the same text; a JSON schema constrains the
//! answer of each.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{complete, http, start};
use serde_json::{json, Value};
use std::path::PathBuf;

const ARCHS: [&str; 5] = ["llama", "qwen2", "qwen3", "qwen3moe", "phi3"];

fn oracle() -> (PathBuf, Vec<u64>) {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/oracle"));
    let manifest = std::fs::read_to_string(dir.join("oracle.json"))
        .unwrap_or_else(|e| panic!("{}: {e}; run scripts/make_oracle.sh", dir.join("oracle.json").display()));
    let m: Value = serde_json::from_str(&manifest).unwrap();
    (dir, m["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect())
}

fn cached_tokens(addr: std::net::SocketAddr, prompt: &Value) -> u64 {
    let req = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let (status, body) = http(addr, "POST", "/v1/completions", Some(&req));
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

#[test]
fn every_architecture_serves_disaggregated_as_aggregated() {
    let (dir, tokens) = oracle();
    let prompts: Vec<Value> = [5, 33, 64].iter().map(|&n| json!(tokens[..n])).collect();
    for arch in ARCHS {
        let model = dir.join(format!("{arch}-tiny-Q4_K_M.gguf"));
        let model = model.to_str().unwrap();
        let aggregated = start(&["serve", "--model", model, "--mode", "aggregated", "--port", "0"]);
        let want: Vec<String> = prompts.iter().map(|p| complete(aggregated.addr, p, 12)).collect();
        drop(aggregated);
        let split = ["serve", "--model", model, "--mode", "disaggregated", "--kv-transport", "tcp", "--port", "0"];
        let disaggregated = start(&split);
        for (p, want) in prompts.iter().zip(&want) {
            let n = p.as_array().unwrap().len();
            assert_eq!(&complete(disaggregated.addr, p, 12), want, "{arch}, prompt of {n} ids");
        }
        let (_, metrics) = http(disaggregated.addr, "GET", "/metrics", None);
        let remote = format!("pdserve_prefill_route_total{{where=\"remote\"}} {}\n", prompts.len());
        assert!(metrics.contains(&remote), "{arch}: {metrics}");
        // The longest prompt again: its full blocks come from the prefix cache.
        assert!(cached_tokens(disaggregated.addr, &prompts[2]) >= 48, "{arch}: no prefix-cache hit");
        assert_eq!(&complete(disaggregated.addr, &prompts[2], 12), &want[2], "{arch}, from the prefix cache");
        // Structured output: the answer parses and follows the schema.
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                            "additionalProperties": false});
        let req = json!({"prompt": prompts[0], "max_tokens": 24, "temperature": 0,
                         "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}});
        let (status, body) = http(disaggregated.addr, "POST", "/v1/completions", Some(&req));
        assert_eq!(status, 200, "{arch}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let choice = &v["choices"][0];
        if choice["finish_reason"] == "stop" {
            let answer: Value = serde_json::from_str(choice["text"].as_str().unwrap()).unwrap();
            assert!(answer["n"].is_i64(), "{arch}: {answer}");
        } else {
            assert_eq!(choice["finish_reason"], "length", "{arch}: {v}");
            assert!(choice["text"].as_str().unwrap().starts_with('{'), "{arch}: {v}");
        }
        assert!(!disaggregated.logged("panicked"), "{arch}");
    }
}
