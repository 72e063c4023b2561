//! Random request bodies (the testkit's draws) against `pdserve serve` with the real
//! model, disaggregated as by default: every one gets a whole answer or an OpenAI
//! error with a 4xx status, nothing panics anywhere along the handoff, and once idle
//! no worker holds a used KV block.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{settle_used_blocks, start};
use pdserve_testkit::bodies::{check, endpoints, Draws};
use pdserve_testkit::http::{post_request, send_blocking};
use std::collections::BTreeMap;

/// Bodies drawn per endpoint: the generating ones cost real decoding.
const CASES: usize = 200;

#[test]
fn random_bodies_through_the_real_engine_get_an_answer_or_an_openai_error() {
    // Bodies without max_tokens generate to the context's end: 1,024 tokens keeps
    // each within the client's patience on a busy machine (one drew ~4,000 tokens,
    // 105 s there) and still covers prompts that overflow the context.
    let s = start(&["serve", "--port", "0", "--max-model-len", "1024"]);
    let models = send_blocking(s.addr, &pdserve_testkit::http::get_request("/v1/models")).json();
    assert_eq!(models["data"][0]["max_model_len"], 1024, "{models}");
    let mut draws = Draws::new(0xd15a_66ed);
    let mut seen = BTreeMap::<(&str, u16), usize>::new();
    for endpoint in endpoints() {
        for _ in 0..CASES {
            let body = draws.body(&endpoint);
            let reply = send_blocking(s.addr, &post_request(endpoint.path, &body.to_string(), &[]));
            *seen.entry((endpoint.path, check(&reply, &body))).or_default() += 1;
        }
    }
    eprintln!("statuses: {seen:?}");
    for endpoint in endpoints() {
        assert!(seen.get(&(endpoint.path, 200)).is_some_and(|&n| n > 10), "{}: {seen:?}", endpoint.path);
    }
    assert_eq!(settle_used_blocks(s.addr), 0.0, "KV blocks still used once idle");
    assert!(!s.logged("panicked"), "a panic was logged");
}
