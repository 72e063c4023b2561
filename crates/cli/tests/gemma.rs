//! Gemma 3 270M (Q4_K_M; local layers attend over a 512-token window) served end to
//! end: disaggregated, its KV moving over TCP, the greedy text is the aggregated
//! text, for every golden prompt including the one longer than the window.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{complete, start};
use serde_json::Value;

const GOLDEN: &str = include_str!("../../engine/tests/golden/gemma3-270m-q4_k_m.json");

fn prompts() -> Vec<Value> {
    let g: Value = serde_json::from_str(GOLDEN).unwrap();
    g["greedy"].as_array().unwrap().iter().map(|c| c["prompt_ids"].clone()).collect()
}

#[test]
fn gemma3_disaggregated_over_tcp_gives_the_aggregated_text() {
    let prompts = prompts();
    assert!(prompts.iter().any(|p| p.as_array().unwrap().len() > 512), "a prompt past the window");
    let aggregated = start(&["serve", "--model", "gemma3-270m", "--mode", "aggregated", "--port", "0"]);
    let want: Vec<String> = prompts.iter().map(|p| complete(aggregated.addr, p, 16)).collect();
    drop(aggregated);
    let split = ["serve", "--model", "gemma3-270m", "--mode", "disaggregated", "--kv-transport", "tcp", "--port", "0"];
    let disaggregated = start(&split);
    for (p, want) in prompts.iter().zip(&want) {
        assert_eq!(&complete(disaggregated.addr, p, 16), want, "prompt of {} ids", p.as_array().unwrap().len());
    }
    // Every prompt was prefilled on the prefill worker and its KV moved.
    let (_, metrics) = common::http(disaggregated.addr, "GET", "/metrics", None);
    let remote = format!("pdserve_prefill_route_total{{where=\"remote\"}} {}\n", prompts.len());
    assert!(metrics.contains(&remote), "{metrics}");
    assert!(!disaggregated.logged("panicked"));
}
