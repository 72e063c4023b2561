//! One model across several processes: a stage group (`pdserve worker --group G
//! --layers A..B`), its head behind `pdserve frontend`, answers greedy prompts, and
//! scores and embeds a prompt, as one process does, in 2 and 3 stages. A stage killed mid-stream takes the group out of
//! the set: its requests move to another worker and end with their full greedy text,
//! no block stays used, and the group serves again once the stage is back. "Hosts"
//! whose memory is capped (a cgroup each) below what the whole model takes run it
//! across 2 and 3 of them in the ranges `pdserve split` chooses for their memory, with
//! one process's greedy text, mixed or as a prefill group handing to a decode group cut
//! elsewhere. A stage of a decode or a prefill group killed loses no request, and a
//! prefill worker fetches a prefix only a decode group caches.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::net::Net;
use common::{
    complete, eventually, fleet_records, golden_prompts, http, ip, metric, nats, one_process, settle_used_blocks,
    spawn_announced, start, start_in, worker, Proc,
};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A head's wait for a stage's answer (the worker crate's `CALL_TIMEOUT`).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A later stage of group `g` holding `layers`, on `listen`.
fn stage(layers: &str, listen: &str) -> Proc {
    let args = ["--listen", listen, "--threads", "1", "--kv-blocks", "512"];
    start(&[&["worker", "--role", "mixed", "--group", "g", "--layers", layers][..], &args].concat())
}

/// The head of group `g` holding `layers`, with the later stages `stages`.
fn head(layers: &str, stages: &[&Proc]) -> Proc {
    head_with(layers, stages, &["--role", "mixed"])
}

/// [`head`] with more arguments, its role among them (and `--kv-blocks`, else 512).
fn head_with(layers: &str, stages: &[&Proc], more: &[&str]) -> Proc {
    let blocks: &[&str] = if more.contains(&"--kv-blocks") { &[] } else { &["--kv-blocks", "512"] };
    let mut args: Vec<String> = ["worker", "--group", "g", "--layers", layers]
        .into_iter()
        .chain(["--listen", "127.0.0.1:0", "--threads", "1"])
        .chain(blocks.iter().copied())
        .chain(more.iter().copied())
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

/// A prompt's scores (vLLM's `prompt_logprobs`) and its embedding, as served at `addr`.
fn scores_and_embedding(addr: SocketAddr, prompt: &Value) -> (Value, Value) {
    let body = json!({"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1});
    let (status, text) = http(addr, "POST", "/v1/completions", Some(&body));
    assert_eq!(status, 200, "{text}");
    let scores = serde_json::from_str::<Value>(&text).unwrap()["choices"][0]["prompt_logprobs"].clone();
    let (status, text) = http(addr, "POST", "/v1/embeddings", Some(&json!({"input": prompt})));
    assert_eq!(status, 200, "{text}");
    let embedding = serde_json::from_str::<Value>(&text).unwrap()["data"][0]["embedding"].clone();
    assert!(scores.as_array().is_some_and(|s| s.len() > 1) && embedding.as_array().is_some_and(|e| e.len() == 576));
    (scores, embedding)
}

#[test]
fn a_model_split_across_two_and_three_processes_answers_as_one_process_does() {
    let prompts = golden_prompts();
    let one = one_process();
    let want: Vec<String> = prompts.iter().map(|p| complete(one.addr, p, 24)).collect();
    let scored = scores_and_embedding(one.addr, &prompts[0]);
    drop(one);
    // Two stages sending every step whole, three in micro-batches and lanes where
    // they pay (an even split: a stage's two lane passes then take less than a step).
    for (cuts, whole) in [(&["0..14", "15..29"][..], true), (&["0..9", "10..19", "20..29"], false)] {
        let later: Vec<Proc> = cuts[1..].iter().map(|l| stage(l, "127.0.0.1:0")).collect();
        let more: &[&str] = if whole { &["--role", "mixed", "--no-micro-batches"] } else { &["--role", "mixed"] };
        let h = head_with(cuts[0], &later.iter().collect::<Vec<_>>(), more);
        assert!(h.logged("stage group whole"), "{cuts:?}");
        let fe = frontend(&[&h]);
        for (p, w) in prompts.iter().zip(&want) {
            assert_eq!(&complete(fe.addr, p, 24), w, "{cuts:?}: prompt {p}");
        }
        assert!(scores_and_embedding(fe.addr, &prompts[0]) == scored, "{cuts:?}: prompt scores or embedding");
        // At once, their decodes in lanes (the stages' costs were timed by now).
        let at_once: Vec<String> = std::thread::scope(|s| {
            let asked: Vec<_> = prompts.iter().map(|p| s.spawn(|| complete(fe.addr, p, 24))).collect();
            asked.into_iter().map(|a| a.join().unwrap()).collect()
        });
        assert_eq!(at_once, want, "{cuts:?}: at once");
        assert_eq!(settle_used_blocks(fe.addr), 0.0, "{cuts:?}");
        let lanes = metric(fe.addr, "pdserve_stage_lane_steps_total", "");
        assert_eq!(lanes > 0.0, !whole, "{cuts:?}: {lanes} steps in lanes");
        // Every step went through the later stages: a residual-stream row (576 values
        // of f32) out per token computed, every decoded token among them.
        let rows = metric(fe.addr, "pdserve_stage_rows_total", "");
        let bytes = metric(fe.addr, "pdserve_stage_activation_bytes_total", "");
        let decoded = 2 * 23 * prompts.len();
        assert!(rows >= decoded as f64, "{cuts:?}: {rows} rows for {decoded} decoded tokens");
        assert!(bytes >= rows * 576.0 * 4.0, "{cuts:?}: {bytes} bytes for {rows} rows");
        // Each stage's compute is timed by its layers. Where every step went whole,
        // what the head waited is the later stages' compute and the links' share; in
        // micro-batches the stages compute at once, and the links are measured on the
        // steps that went whole (the first ones, before two sizes of pass were timed).
        let waited = metric(fe.addr, "pdserve_stage_seconds_total", "");
        let mut later = 0.0;
        for (i, layers) in cuts.iter().enumerate() {
            let s = metric(fe.addr, "pdserve_stage_compute_seconds_total", &format!("layers=\"{layers}\""));
            assert!(s > 0.0, "{cuts:?}: no compute time for stage {layers}");
            later += if i > 0 { s } else { 0.0 };
        }
        let link = metric(fe.addr, "pdserve_stage_link_seconds_total", "");
        let pipelined = metric(fe.addr, "pdserve_stage_pipelined_steps_total", "");
        assert!(link > 0.0 && link < waited, "{cuts:?}: {link} of {waited} on the links");
        if whole {
            assert_eq!(pipelined, 0.0, "{cuts:?}");
            assert!((later + link - waited).abs() < 1e-6 * waited.max(1.0), "{cuts:?}: {later} + {link} ≠ {waited}");
        }
        let per_token = metric(fe.addr, "pdserve_stage_activation_bytes_per_token", "");
        assert!((per_token - bytes / rows).abs() < 1e-6 * per_token, "{cuts:?}: {per_token} per token");
    }
}

/// Over NATS the head is given no addresses: the later stages announce themselves
/// (under keys of their own, so no frontend takes one for a worker) and the head
/// takes its group's. A frontend that follows the fleet sees the head alone and
/// answers as one process does; a stage that leaves takes the group out, and one
/// started anew (another port) brings it back.
#[test]
fn a_head_finds_its_stages_in_the_fleet() {
    let n = nats();
    let prompts = golden_prompts();
    let want = reference(&prompts, 16);
    let fleet = ["--nats", n.url.as_str()];
    let later = |layers: &str| {
        start(
            &[
                &["worker", "--role", "mixed", "--group", "g", "--layers", layers][..],
                &fleet,
                &["--listen", "127.0.0.1:0", "--threads", "1", "--kv-blocks", "512"],
            ]
            .concat(),
        )
    };
    let mut s2 = later("20..29");
    let _s1 = later("10..19");
    let h = start(
        &[
            &["worker", "--role", "mixed", "--group", "g", "--layers", "0..9"][..],
            &fleet,
            &["--listen", "127.0.0.1:0", "--threads", "1", "--kv-blocks", "512"],
        ]
        .concat(),
    );
    eventually("the head finds its stages", || h.logged("stage group whole: serving"));
    let fe = start(&["frontend", "--nats", &n.url, "--mode", "aggregated", "--port", "0"]);
    eventually("the frontend takes the head", || metric(fe.addr, "pdserve_worker_role", "") >= 1.0);
    assert_eq!(fleet_records(&n.url).len(), 1, "later stages are not workers");
    for (p, w) in prompts.iter().zip(&want) {
        assert_eq!(&complete(fe.addr, p, 16), w, "prompt {p}");
    }
    s2.child.kill().unwrap();
    s2.child.wait().unwrap();
    eventually("the head sees the stage gone", || h.logged("it closed the connection"));
    let _s2 = later("20..29");
    eventually("the group re-forms with the new stage", || h.log_count("stage group whole: serving") >= 2);
    // The frontend takes the head back at its next look at the head's stats.
    let one = json!({"prompt": "Hi", "max_tokens": 1});
    eventually("the frontend routes to the group again", || {
        common::http(fe.addr, "POST", "/v1/completions", Some(&one)).0 == 200
    });
    for (p, w) in prompts.iter().zip(&want) {
        assert_eq!(&complete(fe.addr, p, 16), w, "prompt {p}, after the stage moved");
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

/// `count` prompts of 40 ordinary tokens, other ones for another `salt`.
fn long_prompts(count: u32, salt: u32) -> Vec<Value> {
    prompts_of(count, 40, salt)
}

/// `count` prompts of `len` ordinary tokens, other ones for another `salt`.
fn prompts_of(count: u32, len: u32, salt: u32) -> Vec<Value> {
    let prompt = |r: u32| json!((0..len).map(|i| 1000 + (i * 7919 + r * salt) % 30000).collect::<Vec<_>>());
    (0..count).map(prompt).collect()
}

/// Sends every prompt for `n` greedy tokens at once through the frontend at `fe`, and
/// returns once one runs on the group `head` heads (in `role`); each thread answers
/// its text.
fn stream_onto_group(
    fe: SocketAddr,
    (head, role): (&Proc, &str),
    prompts: &[Value],
    n: u32,
) -> Vec<JoinHandle<String>> {
    let send = |p: &Value| {
        let p = p.clone();
        std::thread::spawn(move || complete(fe, &p, n))
    };
    let requests = prompts.iter().map(send).collect();
    let on_head = format!("{role}@{}\",state=\"running\"", head.addr);
    eventually("a request runs on the group", || metric(fe, "pdserve_worker_requests", &on_head) > 0.0);
    requests
}

/// Kills stage `s` while `requests` stream from the group `head` heads (behind the
/// frontend at `fe`): each ends with its text in `want`, and no block stays used.
fn kill_under_streams(
    s: &mut Proc,
    (head, fe): (&Proc, SocketAddr),
    requests: Vec<JoinHandle<String>>,
    want: &[String],
) {
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    for (r, w) in requests.into_iter().zip(want) {
        assert_eq!(&r.join().unwrap(), w, "a request lost tokens when its stage died");
    }
    // The first report is the death itself; a transfer or step that finds the stage
    // gone later reports it again, with the requests already ended.
    let lost: Vec<String> =
        head.log.lock().unwrap().iter().filter(|l| l.contains("stage group lost a stage")).cloned().collect();
    let first = lost.first().expect("the stage died after the requests ended");
    assert!(!first.contains("requests=0"), "no request was on the group when its stage died: {lost:#?}");
    assert_eq!(settle_used_blocks(fe), 0.0);
}

#[test]
fn a_stage_killed_mid_stream_moves_its_requests_and_the_group_comes_back() {
    let prompts = long_prompts(4, 131);
    let n = 160;
    let want = reference(&prompts, n);
    // A fixed port, so the stage comes back where the head looks for it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let mut s = stage("15..29", &listen);
    let h = head("0..14", &[&s]);
    let whole = worker("mixed");
    let fe = frontend(&[&h, &whole]);
    let requests = stream_onto_group(fe.addr, (&h, "mixed"), &prompts, n);
    kill_under_streams(&mut s, (&h, fe.addr), requests, &want);
    // Back on its port: the group re-forms and serves again.
    let _s = stage("15..29", &listen);
    eventually("the group re-forms", || h.logged("stage group whole: serving"));
    for (p, w) in prompts.iter().zip(&want) {
        assert_eq!(&complete(fe.addr, p, n), w);
    }
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
}

/// Disaggregated, a stage of a decode group killed while the group decodes: each
/// request moves to the other decode worker (replayed from its tokens) and ends with
/// its full greedy text, and no block stays used anywhere. Then a stage of a prefill
/// group killed while the group prefills: each prompt is prefilled again on the other
/// prefill worker, with the same text.
#[test]
fn a_stage_killed_in_a_decode_or_a_prefill_group_loses_no_request() {
    let disaggregated = |workers: &[&Proc]| {
        let list = workers.iter().map(|w| w.addr.to_string()).collect::<Vec<_>>().join(",");
        // No shedding: the long prompts' predicted wait may pass the default limit.
        start(&["frontend", "--workers", &list, "--mode", "disaggregated", "--max-queue-seconds", "0", "--port", "0"])
    };
    let prompts = long_prompts(4, 173);
    let n = 160;
    let want = reference(&prompts, n);
    let (prefill, decode) = (worker("prefill"), worker("decode"));
    let mut s = stage("15..29", "127.0.0.1:0");
    let h = head_with("0..14", &[&s], &["--role", "decode"]);
    let fe = disaggregated(&[&prefill, &h, &decode]);
    let requests = stream_onto_group(fe.addr, (&h, "decode"), &prompts, n);
    kill_under_streams(&mut s, (&h, fe.addr), requests, &want);
    drop((fe, h, decode, prefill));

    // The stage is stopped first, so the group's first prefill waits on it (its host
    // still answers the link's probes) until the kill.
    let prompts = prompts_of(6, 200, 211);
    let want = reference(&prompts, 8);
    let (decode, prefill) = (worker("decode"), worker("prefill"));
    let mut s = stage("15..29", "127.0.0.1:0");
    let h = head_with("0..14", &[&s], &["--role", "prefill"]);
    let fe = disaggregated(&[&h, &prefill, &decode]);
    let pid = s.child.id() as i32;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let send = |p: &Value| {
        let (p, fe) = (p.clone(), fe.addr);
        std::thread::spawn(move || complete(fe, &p, 8))
    };
    let requests: Vec<JoinHandle<String>> = prompts.iter().map(send).collect();
    // A prefill is on the group, its step waiting on the stopped stage (the head's
    // stats count a prefill's tokens until it answers, even mid-step).
    let on_head = format!("prefill@{}\"", h.addr);
    eventually("a prefill waits on the group", || {
        metric(fe.addr, "pdserve_worker_queued_prompt_tokens", &on_head) > 0.0
    });
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    for (r, w) in requests.into_iter().zip(&want) {
        assert_eq!(&r.join().unwrap(), w, "a request lost tokens when its prefill stage died");
    }
    // The prefills on the group failed as lost, and each started over elsewhere.
    assert!(h.logged("prefill failed kind=\"worker_lost\""), "no prefill was on the group when its stage died");
    let started_over = metric(fe.addr, "pdserve_requests_migrated_total", "prefill_failed");
    assert!(started_over >= 1.0, "{started_over} prefills started over");
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
}

/// A group's head with host and disk tiers and a small pool: a prompt pushed out of
/// the pool by others comes back from the tiers (the later stage's layers from its
/// own), and its text is one process's.
#[test]
fn a_groups_tiers_give_back_a_prompt_pushed_out_of_its_pool() {
    let prompts = prompts_of(5, 200, 43);
    let want = reference(&prompts[..1], 8).remove(0);
    let dir = std::env::temp_dir().join(format!("pdserve-group-disk-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let s = stage("15..29", "127.0.0.1:0");
    // A 48-block pool, a host tier of 5 blocks of the whole model (368,640 bytes
    // each) and a disk tier of about 135: as in the tiers test of one worker.
    let tiers = ["--kv-blocks", "48", "--kv-host-gb", "0.002", "--kv-disk-gb", "0.05", "--kv-disk-dir"];
    let h = head_with("0..14", &[&s], &[&["--role", "mixed"][..], &tiers, &[dir.to_str().unwrap()]].concat());
    let fe = frontend(&[&h]);
    assert_eq!(complete(fe.addr, &prompts[0], 8), want);
    for p in &prompts[1..] {
        complete(fe.addr, p, 8);
    }
    assert_eq!(complete(fe.addr, &prompts[0], 8), want, "the prompt's K/V from the tiers");
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
    let restored = |tier: &str| {
        metric(fe.addr, "pdserve_kv_tier_blocks_total", &format!("tier=\"{tier}\",direction=\"restored\""))
    };
    assert!(restored("host") + restored("disk") >= 12.0, "{} + {}", restored("host"), restored("disk"));
    drop((fe, h));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The token ids of `n` greedy tokens after `prompt`, as served at `addr`.
fn completion_ids(addr: SocketAddr, prompt: &Value, n: u32) -> Vec<Value> {
    let req =
        json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    let (status, body) = http(addr, "POST", "/v1/completions", Some(&req));
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["choices"][0]["token_ids"].as_array().unwrap().clone()
}

/// Disaggregated, a conversation's first turn decodes on a group, so only the group
/// caches its answer; the next turn's prefill worker fetches those blocks from the
/// group (its head's layers from the head, the rest from the stage) rather than
/// recompute them, and the turn's text is one process's.
#[test]
fn a_prefill_worker_fetches_what_a_decode_group_caches() {
    let first = prompts_of(1, 300, 17).remove(0);
    let one = one_process();
    let answer = completion_ids(one.addr, &first, 80);
    let question = prompts_of(1, 20, 5).remove(0);
    let second = json!([&first.as_array().unwrap()[..], &answer, &question.as_array().unwrap()[..]].concat());
    let want = complete(one.addr, &second, 16);
    drop(one);
    let prefill = worker("prefill");
    let s = stage("15..29", "127.0.0.1:0");
    let h = head_with("0..14", &[&s], &["--role", "decode"]);
    let list = format!("{},{}", prefill.addr, h.addr);
    let fe =
        start(&["frontend", "--workers", &list, "--mode", "disaggregated", "--kv-transport", "tcp", "--port", "0"]);
    assert_eq!(completion_ids(fe.addr, &first, 80), answer);
    // The group caches the prompt and all but the last answer token: 23 whole blocks.
    eventually("the index sees the group's blocks", || metric(fe.addr, "pdserve_kv_index_blocks", "") >= 23.0);
    assert_eq!(complete(fe.addr, &second, 16), want);
    let fetched = metric(fe.addr, "pdserve_kv_fetched_tokens_total", "");
    assert!(metric(fe.addr, "pdserve_kv_fetches_total", "outcome=\"fetched\"") >= 1.0, "no fetch");
    // The prefill worker lacked the blocks past its own prompt's 18.
    assert_eq!(fetched, (23.0 - 18.0) * 16.0, "{fetched} tokens fetched");
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
}

/// A memory cgroup capped at `bytes` (v2 where the unified hierarchy has the memory
/// controller, else v1's), removed when dropped; a process joins it before it execs.
struct Capped {
    dir: PathBuf,
}

impl Capped {
    fn new(name: &str, bytes: u64) -> Capped {
        assert_eq!(unsafe { libc::geteuid() }, 0, "capping memory needs root (cgroups)");
        let v2 = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers").is_ok_and(|c| c.contains("memory"));
        let root = if v2 { "/sys/fs/cgroup" } else { "/sys/fs/cgroup/memory" };
        let dir = PathBuf::from(root).join(format!("pdserve-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir(&dir);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("cannot make cgroup {}: {e}", dir.display()));
        let write = |file: &str| std::fs::write(dir.join(file), bytes.to_string());
        if v2 {
            write("memory.max").unwrap();
            let _ = write("memory.swap.max");
        } else {
            write("memory.limit_in_bytes").unwrap();
            // No swap to spill into either, where the kernel accounts it.
            let _ = write("memory.memsw.limit_in_bytes");
        }
        Capped { dir }
    }

    /// `pdserve ARGS…` run inside this cgroup.
    fn command(&self) -> Command {
        let procs = self.dir.join("cgroup.procs");
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            &format!("echo $$ > {} && exec \"$0\" \"$@\"", procs.display()),
            env!("CARGO_BIN_EXE_pdserve"),
        ]);
        cmd
    }

    /// `pdserve ARGS…` inside this cgroup and network namespace `ns`: a host.
    fn start_in(&self, ns: &str, args: &[&str]) -> Proc {
        let procs = self.dir.join("cgroup.procs");
        let mut cmd = Command::new("sh");
        let enter = format!("echo $$ > {} && exec \"$0\" \"$@\"", procs.display());
        cmd.args(["-c", &enter, ip(), "netns", "exec", ns, env!("CARGO_BIN_EXE_pdserve")]);
        spawn_announced(cmd, args, &[])
    }
}

impl Drop for Capped {
    fn drop(&mut self) {
        // Its processes are killed first (they are dropped before it); an exiting one
        // may hold it for a moment.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Below what the whole default model takes in one process (about 160 MB of its own
/// memory at start), above what each stage below takes: about 3 MB a layer, and 68 MB
/// more for the first stage's embeddings and output head, so it gets fewer layers.
const CAP: u64 = 130 << 20;

#[test]
fn hosts_capped_below_the_models_size_run_it_across_two_and_three_of_them() {
    let prompts = golden_prompts();
    let want = reference(&prompts, 16);
    // The whole model does not fit one capped host.
    let alone = Capped::new("whole", CAP);
    let out = alone.command().args(["generate", "--prompt", "Hi", "--max-tokens", "2"]).output().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(9), "the whole model was not killed for memory under the cap: {out:?}");
    drop(alone);
    // The ranges `pdserve split` chooses for hosts of 100 MB each for weights and K/V
    // (the cap less the process's own), run on them.
    for memory in ["0.1,0.1", "0.1,0.1,0.1"] {
        let cuts = split(memory);
        let cuts: Vec<&str> = cuts.iter().map(String::as_str).collect();
        assert_eq!(cuts.len(), memory.split(',').count());
        let cuts = &cuts[..];
        // Each host a network namespace on one bridge and a memory cgroup.
        let net = Net::new(cuts.len());
        let hosts: Vec<Capped> = (0..cuts.len()).map(|i| Capped::new(&format!("host{i}"), CAP)).collect();
        let (h, later) = capped_group(&net, &hosts, (0, "g", "mixed"), cuts);
        let fe = frontend(&[&h]);
        for (p, w) in prompts.iter().zip(&want) {
            assert_eq!(&complete(fe.addr, p, 16), w, "{cuts:?}: prompt {p}");
        }
        drop((fe, h, later));
        drop(net);
    }
}

/// The `--layers` `pdserve split` gives nodes of `memory_gb` (comma separated) with
/// the tests' 64 KV blocks.
fn split(memory_gb: &str) -> Vec<String> {
    let text = split_with(&["--memory-gb", memory_gb]).unwrap();
    let ranges = text.lines().filter_map(|l| l.split("--layers ").nth(1)?.split_whitespace().next());
    ranges.map(String::from).collect()
}

/// What `pdserve split ARGS --kv-blocks 64` prints, or its error.
fn split_with(args: &[&str]) -> Result<String, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve")).arg("split").args(args).args(["--kv-blocks", "64"]).output();
    let out = out.unwrap();
    match out.status.success() {
        true => Ok(String::from_utf8(out.stdout).unwrap()),
        false => Err(String::from_utf8(out.stderr).unwrap()),
    }
}

/// Given the links, `split` makes the node with the cheapest hops to the others the
/// head, unless it cannot hold the embeddings and output head.
#[test]
fn split_heads_the_group_with_the_best_linked_node_that_holds_the_embeddings() {
    // Node 2 is 0.1 ms (a round trip) from both others, which are 5 ms apart.
    let links = "0-1=5:1,0-2=0.1:1,1-2=0.1:1";
    let text = split_with(&["--memory-gb", "0.1,0.1,0.1", "--link", links]).unwrap();
    let heads: Vec<&str> = text.lines().filter(|l| l.contains("--layers")).map(|l| &l[..6]).collect();
    assert_eq!(heads, ["node 2", "node 0", "node 1"], "{text}");
    // Each later stage: a round trip and a 576-value row each way at 1 GB/s.
    assert!(text.lines().next().unwrap().contains("the head") && text.contains("links: 0.209 ms"), "{text}");
    // 30 MB cannot hold the default model's embeddings and head: node 0 heads.
    let text = split_with(&["--memory-gb", "0.1,0.1,0.03", "--link", links]).unwrap();
    assert!(text.starts_with("node 0 (0.1 GB, the head)"), "{text}");
    for bad in ["0-1=5", "0-0=1:1", "0-1=-1:1", "0-3=1:1", "0-1=1:0"] {
        let err = split_with(&["--memory-gb", "0.1,0.1,0.1", "--link", bad]).unwrap_err();
        assert_eq!(err.trim().lines().count(), 1, "{bad}: {err}");
        assert!(err.contains("--link"), "{bad}: {err}");
    }
}

/// `pdserve split --nats` places a group on the fleet's nodes by the memory each says
/// its host has available: two workers in cgroups capped at 800 and 500 MB, each
/// reporting its cap less what it holds.
#[test]
fn split_places_a_group_on_the_fleets_nodes_by_their_available_memory() {
    let n = nats();
    let caps = [("big", 800_000_000u64), ("small", 500_000_000)];
    let hosts: Vec<Capped> = caps.iter().map(|&(id, cap)| Capped::new(&format!("split-{id}"), cap)).collect();
    let _workers: Vec<Proc> = hosts
        .iter()
        .zip(caps)
        .map(|(h, (id, _))| {
            let flags = ["--role", "mixed", "--threads", "1", "--kv-blocks", "64", "--listen", "127.0.0.1:0"];
            spawn_announced(h.command(), &[&["worker", "--nats", &n.url, "--node-id", id][..], &flags].concat(), &[])
        })
        .collect();
    let memory = |id: &str| {
        let records = fleet_records(&n.url);
        records.iter().find(|r| r["node_id"] == id).and_then(|r| r["memory_available"].as_u64()).unwrap_or(0)
    };
    eventually("both nodes say what memory they have", || memory("big") > 0 && memory("small") > 0);
    for (id, cap) in caps {
        assert!(memory(id) < cap, "{id}: {} bytes available under a cap of {cap}", memory(id));
    }
    let text = split_with(&["--nats", &n.url]).unwrap();
    let placed: Vec<&str> = text.lines().filter(|l| l.contains("--layers")).collect();
    assert_eq!(placed.len(), 2, "{text}");
    assert!(placed.iter().any(|l| l.starts_with("node big (")), "{text}");
    assert!(placed.iter().any(|l| l.starts_with("node small (")), "{text}");
    let one = split_with(&["--nats", &n.url, "--nodes", "big"]).unwrap();
    assert!(one.starts_with("node big (") && one.contains("--layers 0..29"), "{one}");
    // One line of error, after the log's line on reaching NATS.
    let err = split_with(&["--nats", &n.url, "--nodes", "big,nope"]).unwrap_err();
    assert_eq!(err.trim().lines().last(), Some("error: no node nope in the fleet"), "{err}");
}

/// Group `name` in `role` on the capped hosts `at..` of `net`, one stage a host:
/// its head (ready) and its later stages.
fn capped_group(
    net: &Net,
    hosts: &[Capped],
    (at, name, role): (usize, &str, &str),
    cuts: &[&str],
) -> (Proc, Vec<Proc>) {
    let flags = ["--role", role, "--group", name, "--threads", "1", "--kv-blocks", "64"];
    let on = |i: usize, args: &[&str]| {
        let listen = format!("{}:0", net.ip(at + i));
        hosts[at + i].start_in(net.ns(at + i), &[args, &flags, &["--listen", &listen]].concat())
    };
    let later: Vec<Proc> = (1..cuts.len()).map(|i| on(i, &["worker", "--layers", cuts[i]])).collect();
    let mut head = vec!["worker", "--layers", cuts[0]];
    let addrs: Vec<String> = later.iter().map(|p| p.addr.to_string()).collect();
    addrs.iter().for_each(|a| head.extend(["--stage", a.as_str()]));
    let h = on(0, &head);
    assert!(h.logged("stage group whole"), "{name}: {cuts:?}");
    (h, later)
}

/// Disaggregated across groups cut apart: a prefill group on 2 capped hosts hands
/// each prompt's K/V to a decode group on 3 others, and the text is one process's.
/// Every layer goes from the stage that computed it straight to the stage that holds
/// it: the prefill group's later stage sends its own layers as parts of the handoff
/// (to two decode stages), and the decode group's later stages take theirs
/// themselves, none through either head.
#[test]
fn a_prefill_group_on_two_capped_hosts_hands_to_a_decode_group_on_three() {
    let prompts = golden_prompts();
    let want = reference(&prompts, 16);
    let net = Net::new(5);
    let hosts: Vec<Capped> = (0..5).map(|i| Capped::new(&format!("pd{i}"), CAP)).collect();
    let (p, _p_later) = capped_group(&net, &hosts, (0, "p", "prefill"), &["0..9", "10..29"]);
    let (d, _d_later) = capped_group(&net, &hosts, (2, "d", "decode"), &["0..5", "6..17", "18..29"]);
    let list = format!("{},{}", p.addr, d.addr);
    let fe =
        start(&["frontend", "--workers", &list, "--mode", "disaggregated", "--kv-transport", "tcp", "--port", "0"]);
    for (pr, w) in prompts.iter().zip(&want) {
        assert_eq!(&complete(fe.addr, pr, 16), w, "prompt {pr}");
    }
    // Whole blocks of all 30 layers moved (768 bytes a token a layer, f16).
    let moved = metric(fe.addr, "pdserve_kv_transfer_bytes_total", "tcp");
    let blocks_of_every_layer = 30.0 * 16.0 * 768.0;
    assert!(moved > 0.0 && moved % blocks_of_every_layer == 0.0, "{moved} bytes moved");
    // The frontend refreshes workers' stats once a second.
    let parts = || metric(fe.addr, "pdserve_stage_kv_parts_total", "");
    eventually("a part of every prompt's handoff counted", || parts() >= prompts.len() as f64);
    let relayed = metric(fe.addr, "pdserve_stage_kv_relayed_layers_total", "");
    assert_eq!(relayed, 0.0, "{relayed} layers went through the prefill group's head");
    let direct = || metric(fe.addr, "pdserve_stage_kv_direct_total", "");
    eventually("every handoff taken by the decode stages themselves", || direct() >= prompts.len() as f64);
    let written = metric(fe.addr, "pdserve_stage_kv_written_frames_total", "");
    assert_eq!(written, 0.0, "{written} frames went through the decode group's head");
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
}

/// A stage whose host drops off the network without a word (its cable pulled: no
/// reset reaches the head, whose call is left unanswered) is found lost in seconds,
/// not at the 60 s call timeout: each request ends with its full greedy text on the
/// other worker, no block stays used, and the group serves again once the cable is
/// back.
#[test]
fn a_stage_whose_host_vanishes_without_a_reset_is_found_lost_in_seconds() {
    let prompts = long_prompts(3, 331);
    let n = 160;
    let want = reference(&prompts, n);
    let net = Net::new(2);
    let flags = ["worker", "--role", "mixed", "--group", "g", "--threads", "1", "--kv-blocks", "512"];
    let stage_at = format!("{}:7301", net.ip(1));
    let _s = start_in(net.ns(1), &[&flags[..], &["--layers", "15..29", "--listen", &stage_at]].concat());
    let head_at = format!("{}:0", net.ip(0));
    let h =
        start_in(net.ns(0), &[&flags[..], &["--layers", "0..14", "--stage", &stage_at, "--listen", &head_at]].concat());
    assert!(h.logged("stage group whole"));
    let whole = worker("mixed");
    let fe = frontend(&[&h, &whole]);
    let requests = stream_onto_group(fe.addr, (&h, "mixed"), &prompts, n);
    let cut = Instant::now();
    net.cable(1, false);
    for (r, w) in requests.into_iter().zip(&want) {
        assert_eq!(&r.join().unwrap(), w, "a request lost tokens when its stage's host vanished");
    }
    // Well inside the call timeout: the kernel's probes found the host gone.
    let took = cut.elapsed();
    assert!(took < CALL_TIMEOUT / 2, "the requests ended {took:?} after the cut");
    assert!(h.logged("stage group lost a stage"), "the stage's host was cut after the requests ended");
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
    net.cable(1, true);
    eventually("the group re-forms", || h.logged("stage group whole: serving"));
    for (p, w) in prompts.iter().zip(&want) {
        assert_eq!(&complete(fe.addr, p, n), w);
    }
    assert_eq!(settle_used_blocks(fe.addr), 0.0);
}
