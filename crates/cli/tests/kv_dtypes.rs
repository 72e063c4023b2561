//! Quantized KV caches across processes: prefill and decode workers of one dtype hand
//! off over TCP and shared memory (and in-process within `serve`) with the tokens one
//! process of that dtype gives, moving 34/64 (q8_0) and 18/64 (q4_0) of f16's bytes;
//! a decode worker of another dtype than its prefill worker converts what it receives.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{complete, frontend, golden_prompts, metric, settle_used_blocks, start, worker_with, Proc};
use serde_json::Value;

fn worker_in(role: &str, dtype: &str) -> Proc {
    worker_with(role, &["--kv-cache-dtype", dtype])
}

fn serve_in(mode: &str, dtype: &str) -> Proc {
    let mut args = vec!["serve", "--mode", mode, "--threads-per-worker", "1", "--port", "0", "--kv-cache-dtype", dtype];
    if mode == "disaggregated" {
        args.extend(["--kv-transport", "inproc"]);
    }
    start(&args)
}

fn completions(p: &Proc, prompts: &[Value], max_tokens: u32) -> Vec<String> {
    prompts.iter().map(|x| complete(p.addr, x, max_tokens)).collect()
}

#[test]
fn every_dtype_hands_off_over_every_transport_with_its_own_tokens_and_bytes() {
    let prompts = &golden_prompts()[..3];
    let mut bytes = Vec::new();
    for dtype in ["f16", "q8_0", "q4_0"] {
        let want = completions(&serve_in("aggregated", dtype), prompts, 16);
        assert_eq!(completions(&serve_in("disaggregated", dtype), prompts, 16), want, "{dtype} inproc");
        let (p, d) = (worker_in("prefill", dtype), worker_in("decode", dtype));
        assert!(p.logged(&format!("KV blocks of {dtype}")), "the worker says its dtype");
        let mut moved = Vec::new();
        for transport in ["tcp", "shm"] {
            let fe = frontend(&[&p, &d], "disaggregated", transport);
            assert_eq!(completions(&fe, prompts, 16), want, "{dtype} over {transport}");
            moved.push(metric(fe.addr, "pdserve_kv_transfer_bytes_total", transport));
            assert_eq!(settle_used_blocks(fe.addr), 0.0, "{dtype} over {transport}");
        }
        assert_eq!(moved[0], moved[1], "{dtype}: both transports move the stored form");
        bytes.push(moved[0]);
    }
    // The same frames in each form: f16's bytes times the form's share.
    assert!(bytes[0] > 0.0);
    assert_eq!(bytes[1] / bytes[0], 34.0 / 64.0, "q8_0 on the wire");
    assert_eq!(bytes[2] / bytes[0], 18.0 / 64.0, "q4_0 on the wire");
}

#[test]
fn a_decode_worker_of_another_dtype_converts_what_it_receives() {
    let prompts = &golden_prompts()[..3];
    for (from, to) in [("f16", "q8_0"), ("q8_0", "f16")] {
        // The first token is the prefill worker's, computed over its own cache.
        let first = completions(&serve_in("aggregated", from), prompts, 1);
        let (p, d) = (worker_in("prefill", from), worker_in("decode", to));
        let fe = frontend(&[&p, &d], "disaggregated", "tcp");
        assert_eq!(completions(&fe, prompts, 1), first, "{from} -> {to}: first tokens");
        for (text, head) in completions(&fe, prompts, 16).iter().zip(&first) {
            assert!(text.starts_with(head.as_str()) && text.len() > head.len(), "{from} -> {to}: {text:?}");
        }
        let remote = metric(fe.addr, "pdserve_prefill_route_total", "remote");
        assert_eq!(remote as usize, 2 * prompts.len(), "{from} -> {to}: every prefill was handed off");
        assert_eq!(settle_used_blocks(fe.addr), 0.0, "{from} -> {to}");
    }
}
