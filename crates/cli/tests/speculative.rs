//! Speculative decoding across the serving paths: `serve` aggregated and
//! disaggregated, and prefill and decode worker processes over TCP and shared
//! memory, give with `--speculative ngram` exactly the greedy text they give without
//! it, the decode worker's drafts are verified and partly accepted (its counters reach
//! `/metrics`), and no block is left used. The same with a draft model (the default
//! model drafting for itself), whose K/V the prefill worker ships with the target's
//! (the decode worker computes no prompt in the draft model); a draft model of
//! another vocabulary is refused at start-up, and workers that draft with different
//! draft models refuse each other when they connect.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{complete, eventually, frontend, golden_prompts, metric, settle_used_blocks, start, worker_with, Proc};
use serde_json::{json, Value};

const TOKENS: u32 = 40;

/// The golden prompts and one that asks for a copy of itself (drafts pay there).
fn prompts() -> Vec<Value> {
    let mut p = golden_prompts()[..3].to_vec();
    p.push(json!(
        "Repeat the list exactly.\n1. apples and pears\n2. bread and butter\n3. salt and pepper\n\nThe list again:\n1. apples"
    ));
    p
}

fn serve(mode: &str, spec: &[&str]) -> Proc {
    let mut args = vec!["serve", "--mode", mode, "--threads-per-worker", "1", "--port", "0"];
    if mode == "disaggregated" {
        args.extend(["--kv-transport", "inproc"]);
    }
    args.extend(spec);
    start(&args)
}

fn texts(p: &Proc) -> Vec<String> {
    prompts().iter().map(|x| complete(p.addr, x, TOKENS)).collect()
}

fn accepted(p: &Proc) -> f64 {
    metric(p.addr, "pdserve_spec_accepted_tokens_total", "")
}

// Every draft verified whole: what the measured rule verifies follows step timings,
// and the counters checked here must not.
const NGRAM: [&str; 6] = ["--speculative", "ngram", "--spec-tokens", "6", "--spec-verify", "all"];

#[test]
fn speculation_gives_the_plain_text_on_every_path() {
    let want = texts(&serve("aggregated", &[]));
    for mode in ["aggregated", "disaggregated"] {
        let s = serve(mode, &NGRAM);
        assert_eq!(texts(&s), want, "serve {mode}");
        assert_eq!(settle_used_blocks(s.addr), 0.0, "serve {mode}");
        // The counters are the workers' as they last reported (once a second).
        eventually(&format!("serve {mode}: a draft accepted"), || accepted(&s) > 0.0);
        let drafted = metric(s.addr, "pdserve_spec_draft_tokens_total", "");
        assert!(accepted(&s) < drafted, "serve {mode}: every draft accepted ({drafted})");
    }
    let (p, d) = (worker_with("prefill", &[]), worker_with("decode", &NGRAM));
    for transport in ["tcp", "shm"] {
        let fe = frontend(&[&p, &d], "disaggregated", transport);
        assert_eq!(texts(&fe), want, "worker processes over {transport}");
        assert_eq!(settle_used_blocks(fe.addr), 0.0, "over {transport}");
        eventually(&format!("over {transport}: the decode worker's counters"), || accepted(&fe) > 0.0);
    }
}

// The default model drafts for itself: its greedy drafts are the greedy text, so
// every draft of these greedy requests is accepted.
const DRAFT: [&str; 8] =
    ["--speculative", "draft", "--draft-model", "smollm2-135m", "--spec-tokens", "4", "--spec-verify", "all"];

/// The name of the worker in `role` (the only one).
fn worker_in(addr: std::net::SocketAddr, role: &str) -> String {
    let (_, text) = common::http(addr, "GET", "/metrics", None);
    let line =
        text.lines().find(|l| l.starts_with("pdserve_worker_role{") && l.contains(&format!("role=\"{role}\"}} 1")));
    let line = line.unwrap_or_else(|| panic!("no {role} worker: {text}"));
    line.split('"').nth(1).unwrap().to_string()
}

/// The prompt tokens the draft model computed on the prefill worker and on the
/// decode worker: the prefill worker's draft K/V goes with the target's, so the
/// decode worker computes none.
fn draft_prompt_tokens(addr: std::net::SocketAddr) -> (f64, f64) {
    let of =
        |role| metric(addr, "pdserve_spec_draft_prompt_tokens_total", &format!("worker=\"{}\"", worker_in(addr, role)));
    (of("prefill"), of("decode"))
}

#[test]
fn a_draft_model_gives_the_plain_text_on_every_path() {
    let want = texts(&serve("aggregated", &[]));
    for mode in ["aggregated", "disaggregated"] {
        let s = serve(mode, &DRAFT);
        assert_eq!(texts(&s), want, "serve {mode}");
        assert_eq!(settle_used_blocks(s.addr), 0.0, "serve {mode}");
        eventually(&format!("serve {mode}: drafts accepted"), || accepted(&s) > 0.0);
        let drafted = metric(s.addr, "pdserve_spec_draft_tokens_total", "");
        assert_eq!(accepted(&s), drafted, "serve {mode}: a greedy self-draft rejected");
        if mode == "disaggregated" {
            eventually("serve: the prefill worker's draft prompts", || draft_prompt_tokens(s.addr).0 > 0.0);
            assert_eq!(draft_prompt_tokens(s.addr).1, 0.0, "serve: the decode worker computed a prompt's draft K/V");
        }
    }
    let (p, d) = (worker_with("prefill", &DRAFT), worker_with("decode", &DRAFT));
    for transport in ["tcp", "shm"] {
        let fe = frontend(&[&p, &d], "disaggregated", transport);
        assert_eq!(texts(&fe), want, "worker processes over {transport}");
        assert_eq!(settle_used_blocks(fe.addr), 0.0);
        eventually(&format!("over {transport}: the decode worker's counters"), || accepted(&fe) > 0.0);
        let (prefill, decode) = draft_prompt_tokens(fe.addr);
        assert!(prefill > 0.0, "over {transport}");
        assert_eq!(decode, 0.0, "over {transport}: the decode worker computed a prompt's draft K/V");
    }
}

#[test]
fn workers_that_draft_apart_refuse_each_other_at_the_handshake() {
    let (p, d) = (worker_with("prefill", &[]), worker_with("decode", &DRAFT));
    let fe = frontend(&[&p, &d], "disaggregated", "tcp");
    // Whichever connected first is in the set, the other refused, with why.
    eventually("the refusal", || fe.logged("worker not used"));
    let log = fe.log.lock().unwrap().clone();
    let line = log.iter().find(|l| l.contains("worker not used")).unwrap();
    // Either side may be named first.
    assert!(line.contains("drafts with") && line.contains("SmolLM2") && line.contains("no draft model"), "{line}");
    assert_eq!(metric(fe.addr, "pdserve_worker_up", ""), 1.0);
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused_at_start() {
    let args = ["serve", "--port", "0", "--speculative", "draft", "--draft-model", "gemma3-270m"];
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pdserve")).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    // Logs of the models' loading, then one line of error.
    let errors: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors, [err.lines().last().unwrap()], "{err}");
    assert!(errors[0].starts_with("error: the draft model's vocabulary is not the target's: 262144 tokens"), "{err}");
}

#[test]
fn bench_engine_measures_each_decode_figure_with_and_without_speculation() {
    let dir = std::env::temp_dir().join(format!("pdserve-bench-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (text, out) = (dir.join("text.txt"), dir.join("report.json"));
    let words = (0..400).map(|i| format!("line {i} of the text, with its own words {}", i * 7)).collect::<Vec<_>>();
    std::fs::write(&text, words.join("\n")).unwrap();
    let args = [
        "bench",
        "engine",
        "--threads",
        "1",
        "--prefill",
        "16",
        "--batch",
        "1,2",
        "--decode-prompt",
        "64",
        "--decode-tokens",
        "12",
        "--reps",
        "1",
        "--speculative",
        "ngram",
        "--spec-verify",
        "all",
        "--decode-quote",
        "--decode-text",
        text.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_pdserve")).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let decodes: Vec<(u64, bool)> = report["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == "decode")
        .inspect(|r| assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0, "{r}"))
        .map(|r| (r["batch"].as_u64().unwrap(), r["speculative"].as_bool().unwrap()))
        .collect();
    // Quoted passages: no one-token-prompt figure; each batch without, then with.
    assert_eq!(decodes, [(1, false), (1, true), (2, false), (2, true)], "{stdout}");
    assert_eq!(stdout.lines().filter(|l| l.trim_start().starts_with("speculative")).count(), 2, "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}
