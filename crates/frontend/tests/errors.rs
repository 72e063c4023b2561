//! Bad input gets a 4xx with an OpenAI error body, never a panic, and the server keeps
//! serving (the reliability contract in docs/ARCHITECTURE.md).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{model, Script, Server, CONTEXT};
use serde_json::{json, Value};

async fn server() -> Server {
    Server::start(Script::Reply("fine".into())).await
}

/// A good request after the bad ones still works.
async fn still_serving(s: &Server) {
    let r = s.post_json("/v1/completions", &json!({"prompt": "Hello"})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["text"], "fine");
}

#[tokio::test]
async fn bad_completion_bodies_are_400() {
    let s = server().await;
    let vocab = model().tokenizer.vocab_size();
    let long_prompt = "word ".repeat(CONTEXT + 10);
    let cases: Vec<(&str, String, Option<&str>)> = vec![
        ("malformed JSON", r#"{"prompt": "x""#.into(), None),
        ("not an object", "[1, 2, 3]".into(), None),
        ("empty body", String::new(), None),
        ("missing prompt", json!({"max_tokens": 5}).to_string(), None),
        ("prompt of the wrong type", json!({"prompt": 5}).to_string(), None),
        ("temperature of the wrong type", json!({"prompt": "x", "temperature": "hot"}).to_string(), None),
        ("negative max_tokens", json!({"prompt": "x", "max_tokens": -1}).to_string(), Some("max_tokens")),
        ("zero max_tokens", json!({"prompt": "x", "max_tokens": 0}).to_string(), Some("max_tokens")),
        ("temperature 500", json!({"prompt": "x", "temperature": 500}).to_string(), Some("temperature")),
        ("top_p 0", json!({"prompt": "x", "top_p": 0}).to_string(), Some("top_p")),
        ("presence_penalty 3", json!({"prompt": "x", "presence_penalty": 3}).to_string(), Some("presence_penalty")),
        ("top_k -5", json!({"prompt": "x", "top_k": -5}).to_string(), Some("top_k")),
        ("logprobs 21", json!({"prompt": "x", "logprobs": 21}).to_string(), Some("logprobs")),
        (
            "min_tokens > max_tokens",
            json!({"prompt": "x", "min_tokens": 9, "max_tokens": 2}).to_string(),
            Some("min_tokens"),
        ),
        ("empty stop string", json!({"prompt": "x", "stop": ""}).to_string(), Some("stop")),
        ("n = 0", json!({"prompt": "x", "n": 0}).to_string(), Some("n")),
        ("too many choices", json!({"prompt": ["a", "b"], "n": 100}).to_string(), Some("n")),
        ("prompt_logprobs 21", json!({"prompt": "x", "prompt_logprobs": 21}).to_string(), Some("prompt_logprobs")),
        ("empty prompt", json!({"prompt": ""}).to_string(), Some("prompt")),
        ("empty id prompt", json!({"prompt": []}).to_string(), Some("prompt")),
        ("an empty prompt in a batch", json!({"prompt": ["a", ""]}).to_string(), Some("prompt")),
        ("an empty batch", json!({"prompt": [[1], []]}).to_string(), Some("prompt")),
        ("token id >= vocab", json!({"prompt": [1, vocab]}).to_string(), Some("prompt")),
        ("negative token id", json!({"prompt": [-1]}).to_string(), Some("prompt")),
        (
            "stop token id >= vocab",
            json!({"prompt": "x", "stop_token_ids": [vocab]}).to_string(),
            Some("stop_token_ids"),
        ),
        ("prompt over the context", json!({"prompt": long_prompt}).to_string(), Some("max_tokens")),
        (
            "prompt + max_tokens over the context",
            json!({"prompt": "x", "max_tokens": CONTEXT}).to_string(),
            Some("max_tokens"),
        ),
    ];
    for (what, body, param) in cases {
        let e = s.post("/v1/completions", &body).await.error(400);
        assert_eq!(e["type"], "invalid_request_error", "{what}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{what}: {e}");
        }
    }
    still_serving(&s).await;
}

#[tokio::test]
async fn context_error_reads_like_openai() {
    let s = server().await;
    let e = s.post_json("/v1/completions", &json!({"prompt": "x", "max_tokens": CONTEXT})).await.error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    assert!(e["message"].as_str().unwrap().contains(&format!("maximum context length is {CONTEXT} tokens")), "{e}");
}

#[tokio::test]
async fn bad_chat_bodies_are_400() {
    let s = server().await;
    let cases = [
        json!({"messages": []}),
        json!({"messages": "hi"}),
        json!({"messages": [{"content": "no role"}]}),
        json!({"messages": [{"role": "user", "content": 5}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
        json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
        json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 30}),
        json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}),
        json!({"messages": [{"role": "user", "content": "x"}], "n": 0}),
        json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
        json!({"messages": [{"role": "user", "content": "word ".repeat(CONTEXT)}]}),
    ];
    for body in cases {
        let e = s.post_json("/v1/chat/completions", &body).await.error(400);
        assert_eq!(e["type"], "invalid_request_error", "{body}");
    }
    still_serving(&s).await;
}

#[tokio::test]
async fn unknown_model_is_404() {
    let s = server().await;
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = json!({"model": "gpt-9", "prompt": "x", "messages": [{"role": "user", "content": "x"}]});
        let e = s.post_json(path, &body).await.error(404);
        assert_eq!(e["code"], "model_not_found");
        assert!(e["message"].as_str().unwrap().contains("gpt-9"));
    }
    still_serving(&s).await;
}

#[tokio::test]
async fn http_level_errors() {
    let s = server().await;
    let e = s.get("/v1/nothing").await.error(404);
    assert_eq!(e["code"], "not_found");
    let e = s.get("/v1/completions").await.error(405);
    assert_eq!(e["code"], "method_not_allowed");
    s.post("/metrics", "{}").await.error(405);

    let form = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
    s.raw(form.as_bytes()).await.error(415);

    let mut bad_utf8 = br#"{"prompt": "caf"#.to_vec();
    bad_utf8.extend_from_slice(&[0xC3, 0x28, 0xFF]);
    bad_utf8.extend_from_slice(br#""}"#);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        bad_utf8.len()
    );
    let e = s.raw(&[head.as_bytes(), &bad_utf8].concat()).await.error(400);
    assert!(e["message"].as_str().unwrap().contains("UTF-8"), "{e}");
    still_serving(&s).await;
}

#[tokio::test]
async fn body_over_the_limit_is_413() {
    let s = server().await;
    // Announced length over the limit: refused before the body is read.
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        pdserve_frontend::BODY_LIMIT + 1
    );
    s.raw(head.as_bytes()).await.error(413);

    // A chunked body that grows past the limit.
    let chunk = format!("{:x}\r\n{}\r\n", 1 << 20, "a".repeat(1 << 20));
    let mut req = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    for _ in 0..5 {
        req.extend_from_slice(chunk.as_bytes());
    }
    req.extend_from_slice(b"0\r\n\r\n");
    s.raw_eager(req).await.error(413);
    still_serving(&s).await;
}

/// Every truncation of a valid body, and a few type swaps in each field: only 4xx
/// or 200, never a 5xx or a dropped connection.
#[tokio::test]
async fn mangled_bodies_never_break_the_server() {
    let s = server().await;
    let good = json!({"model": model().name, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0.5, "stop": ["x"],
        "logprobs": 1, "stream": true, "stream_options": {"include_usage": true}, "seed": 7});
    let text = good.to_string();
    for cut in 0..text.len() {
        let r = s.post("/v1/completions", &text[..cut]).await;
        r.error(400);
    }
    let swaps = [json!(null), json!(-1), json!(1e300), json!("s"), json!([]), json!({}), json!(true), json!([[-5]])];
    for key in good.as_object().unwrap().keys() {
        for v in &swaps {
            let mut body: Value = good.clone();
            body[key] = v.clone();
            for path in ["/v1/completions", "/v1/chat/completions"] {
                let r = s.post_json(path, &body).await;
                assert!(r.status == 200 || (400..500).contains(&r.status), "{path} {body}: {} {}", r.status, r.text());
                if r.status != 200 {
                    r.error(r.status);
                }
            }
        }
    }
    still_serving(&s).await;
}

#[tokio::test]
async fn a_prompt_too_long_for_any_tokenization_is_refused_by_its_length() {
    let s = server().await;
    // 3.9 MB of text, under the body limit: refused by its length (the message says so),
    // without tokenizing it.
    let big = "a".repeat(3_900_000);
    let e = s.post_json("/v1/completions", &json!({"prompt": big})).await.error(400);
    assert!(e["message"].as_str().unwrap().contains("bytes"), "{e}");
    let e =
        s.post_json("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": big}]})).await.error(400);
    assert!(e["message"].as_str().unwrap().contains("bytes"), "{e}");
    still_serving(&s).await;
}
