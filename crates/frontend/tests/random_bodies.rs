//! Thousands of random request bodies against the frontend over a scripted backend:
//! each gets a whole answer or an OpenAI error with a 4xx status, never a 5xx, a cut
//! connection or a panic, and the server serves a good request after all of them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Script, Server};
use pdserve_testkit::bodies::{check, endpoints, Draws};
use serde_json::json;
use std::collections::BTreeMap;

/// Bodies drawn per endpoint.
const CASES: usize = 700;

#[tokio::test]
async fn random_bodies_get_an_answer_or_an_openai_error() {
    let s = Server::start(Script::Reply("{\"a\": 1} fine".into())).await;
    let mut draws = Draws::new(0x5eed_f00d);
    let mut seen = BTreeMap::<(&str, u16), usize>::new();
    for endpoint in endpoints() {
        for _ in 0..CASES {
            let body = draws.body(&endpoint);
            let status = check(&s.post(endpoint.path, &body.to_string()).await, &body);
            *seen.entry((endpoint.path, status)).or_default() += 1;
        }
    }
    eprintln!("statuses: {seen:?}");
    // The draws get past validation on every endpoint, and are refused on every one.
    for endpoint in endpoints() {
        for status in [200, 400] {
            assert!(seen.get(&(endpoint.path, status)).is_some_and(|&n| n > 10), "{status}: {seen:?}");
        }
    }
    let r = s.post_json("/v1/completions", &json!({"prompt": "Hello"})).await;
    assert_eq!(r.status, 200, "{}", r.text());
}
