//! KV-aware routing across processes: two mixed worker processes behind a frontend
//! whose router follows their KV events. Every later turn of a conversation must land
//! on the worker that holds its history (its engine reuses all of it), and the
//! router's predicted cache hits must equal what the engines reused.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, metric, settle_used_blocks, start, worker};
use serde_json::{json, Value};

/// `n` token ids, different for every `seed`.
fn ids(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| 1000 + (seed * 7919 + i * 104_729) % 30_000).collect()
}

/// The prompt tokens the engine served from its cache.
fn cached(addr: std::net::SocketAddr, prompt: &[u32]) -> u64 {
    let req = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
    let (status, body) = http(addr, "POST", "/v1/completions", Some(&req));
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

#[test]
fn conversations_follow_their_cache_and_predictions_match_the_engines() {
    let (a, b) = (worker("mixed"), worker("mixed"));
    let list = format!("{},{}", a.addr, b.addr);
    let fe = start(&["frontend", "--workers", &list, "--mode", "aggregated", "--policy", "kv-aware", "--port", "0"]);
    let mut histories: Vec<Vec<u32>> = (0..4).map(|c| ids(c, 200)).collect();
    for turn in 0..4u32 {
        for (c, history) in histories.iter_mut().enumerate() {
            let before = history.len() as u64;
            let hit = cached(fe.addr, history);
            if turn > 0 {
                // Everything but the newest message was prefilled last turn, on the
                // worker the router sent it to: that worker must get it again.
                let full_blocks = (before - 100) / 16 * 16;
                assert!(hit >= full_blocks, "conversation {c} turn {turn}: {hit} cached of {full_blocks}");
            }
            history.extend(ids(100 + turn * 10 + c as u32, 100));
        }
    }
    let predicted = metric(fe.addr, "pdserve_prefix_hit_tokens_total", "predicted");
    let realized = metric(fe.addr, "pdserve_prefix_hit_tokens_total", "realized");
    assert!(predicted > 0.0);
    assert_eq!(predicted, realized, "every predicted hit was realized, and no other");
    assert_eq!(metric(fe.addr, "pdserve_prefix_hit_mismatch_total", ""), 0.0);
    assert!(metric(fe.addr, "pdserve_kv_index_lag_seconds_count", "") > 0.0);
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
}
