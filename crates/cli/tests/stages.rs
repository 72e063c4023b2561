//! One model across several processes: a stage group (`pdserve worker --group G
//! --layers A..B`), its head behind `pdserve frontend`, answers greedy prompts as one
//! process does, in 2 and 3 stages. A stage killed mid-stream takes the group out of
//! the set: its requests move to another worker and end with their full greedy text,
//! no block stays used, and the group serves again once the stage is back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{complete, eventually, golden_prompts, one_process, settle_used_blocks, start, worker, Proc};
use serde_json::{json, Value};
use std::time::Duration;

/// A later stage of group `g` holding `layers`, on `listen`.
fn stage(layers: &str, listen: &str) -> Proc {
    let args = ["--listen", listen, "--threads", "1", "--kv-blocks", "512"];
    start(&[&["worker", "--role", "mixed", "--group", "g", "--layers", layers][..], &args].concat())
}

/// The head of group `g` holding `layers`, with the later stages `stages`.
fn head(layers: &str, stages: &[&Proc]) -> Proc {
    let mut args: Vec<String> = ["worker", "--role", "mixed", "--group", "g", "--layers", layers]
        .into_iter()
        .chain(["--listen", "127.0.0.1:0", "--threads", "1", "--kv-blocks", "512"])
        .map(String::from)
        .collect();
    for s in stages {
        args.extend(["--stage".to_string(), s.addr.to_string()]);
    }
    start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn frontend(workers: &[&Proc]) -> Proc {
    let list = workers.iter().map(|w| w.addr.to_string()).collect::<Vec<_>>().join(",");
    start(&["frontend", "--workers", &list, "--mode", "aggregated", "--port", "0"])
}

fn reference(prompts: &[Value], n: u32) -> Vec<String> {
    let one = one_process();
    prompts.iter().map(|p| complete(one.addr, p, n)).collect()
}

#[test]
fn a_model_split_across_two_and_three_processes_answers_as_one_process_does() {
    let prompts = golden_prompts();
    let want = reference(&prompts, 24);
    for cuts in [&["0..14", "15..29"][..], &["0..5", "6..20", "21..29"]] {
        let later: Vec<Proc> = cuts[1..].iter().map(|l| stage(l, "127.0.0.1:0")).collect();
        let h = head(cuts[0], &later.iter().collect::<Vec<_>>());
        assert!(h.logged("stage group whole"), "{cuts:?}");
        let fe = frontend(&[&h]);
        for (p, w) in prompts.iter().zip(&want) {
            assert_eq!(&complete(fe.addr, p, 24), w, "{cuts:?}: prompt {p}");
        }
        assert_eq!(settle_used_blocks(fe.addr), 0.0, "{cuts:?}");
    }
}

#[test]
fn a_head_without_its_stages_or_with_a_wrong_split_is_refused_or_waits() {
    // A head told of no later stage is a start-up error; so is a later stage told of one.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["worker", "--role", "mixed", "--group", "g", "--layers", "0..14", "--listen", "127.0.0.1:0"])
        .args(["--insecure"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs --stage ADDR"));
    // Layers that leave a gap: the head says why and takes no request.
    let s = stage("20..29", "127.0.0.1:0");
    let h = head("0..14", &[&s]);
    assert!(h.logged("do not cover 0..29 once each"));
}

#[test]
fn a_stage_killed_mid_stream_moves_its_requests_and_the_group_comes_back() {
    let prompt = json!((0..40u32).map(|i| 1000 + (i * 7919) % 30000).collect::<Vec<_>>());
    let n = 160;
    let want = reference(std::slice::from_ref(&prompt), n).remove(0);
    // A fixed port, so the stage comes back where the head looks for it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let mut s = stage("15..29", &listen);
    let h = head("0..14", &[&s]);
    let whole = worker("mixed");
    let fe = frontend(&[&h, &whole]);
    let addr = fe.addr;
    let requests: Vec<_> = (0..4)
        .map(|_| {
            let p = prompt.clone();
            std::thread::spawn(move || complete(addr, &p, n))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1000));
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    for r in requests {
        assert_eq!(r.join().unwrap(), want, "a request lost tokens when its stage died");
    }
    assert!(h.logged("stage group lost a stage"), "the stage died after the requests ended");
    assert!(!h.logged("requests=0"), "no request was on the group when its stage died");
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
    // Back on its port: the group re-forms and serves again.
    let _s = stage("15..29", &listen);
    eventually("the group re-forms", || h.logged("stage group whole: serving"));
    for _ in 0..4 {
        assert_eq!(complete(fe.addr, &prompt, n), want);
    }
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
}
