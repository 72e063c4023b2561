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

/// A prefix the pool evicted is found in the worker's host-RAM or disk tier: the
/// engine copies it back instead of computing it, and the router, which follows the
/// tiers' events too, predicted exactly that.
#[test]
fn prefixes_evicted_to_host_ram_and_disk_come_back_as_predicted() {
    let dir = std::env::temp_dir().join(format!("pdserve-kv-disk-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // A 48-block pool; a host tier of 5 blocks (368,640 bytes each) and a disk tier
    // of about 135: a 200-token prompt's 12 full blocks end up partly on each.
    let w = start(&[
        "worker",
        "--role",
        "mixed",
        "--listen",
        "127.0.0.1:0",
        "--threads",
        "1",
        "--kv-blocks",
        "48",
        "--kv-host-gb",
        "0.002",
        "--kv-disk-dir",
        dir.to_str().unwrap(),
        "--kv-disk-gb",
        "0.05",
    ]);
    let list = w.addr.to_string();
    let fe = start(&["frontend", "--workers", &list, "--mode", "aggregated", "--policy", "kv-aware", "--port", "0"]);
    let first = ids(0, 200);
    assert_eq!(cached(fe.addr, &first), 0);
    // Four other prompts fill the pool and push the first one's blocks out of it.
    for seed in 1..=4 {
        cached(fe.addr, &ids(seed, 200));
    }
    // Wait until the router's index has seen the moves (it follows every 20-100 ms).
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert_eq!(cached(fe.addr, &first), 192, "every full block but the last came back");
    // (This also waits for the once-a-second stats the tier figures come with.)
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
    let tiers = |direction: &str, tier: &str| {
        metric(fe.addr, "pdserve_kv_tier_blocks_total", &format!("tier=\"{tier}\",direction=\"{direction}\""))
    };
    assert!(tiers("restored", "host") + tiers("restored", "disk") >= 12.0);
    assert!(tiers("stored", "disk") > 0.0, "nothing went down to disk");
    assert!(metric(fe.addr, "pdserve_kv_blocks{", "state=\"cached\",tier=\"disk\"") > 0.0);
    let predicted = metric(fe.addr, "pdserve_prefix_hit_tokens_total", "predicted");
    let realized = metric(fe.addr, "pdserve_prefix_hit_tokens_total", "realized");
    assert_eq!((predicted, realized), (192.0, 192.0));
    assert_eq!(metric(fe.addr, "pdserve_prefix_hit_mismatch_total", ""), 0.0);
    drop(w);
    let _ = std::fs::remove_dir_all(&dir);
}
