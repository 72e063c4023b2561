#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The load generator against a tiny in-test SSE server with known delays: the
//! measured TTFT and ITL must match the injected ones (generous bounds: this checks
//! the measurement, not anyone's speed), and every kind of server misbehaviour must
//! become a failed record with its reason.

use axum::body::{Body, Bytes};
use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pdserve_bench::arrivals::ArrivalKind;
use pdserve_bench::client::Client;
use pdserve_bench::compare::suite::Named;
use pdserve_bench::compare::{run_compare, CompareOptions};
use pdserve_bench::lengths::LengthSpec;
use pdserve_bench::load::{plans, run_load, LoadOptions, Sweep};
use pdserve_bench::metrics::Slo;
use pdserve_bench::openai::{BodyOptions, Endpoint};
use pdserve_bench::prompt::{PromptKind, TokenRange};
use pdserve_bench::runner::run_point;
use pdserve_bench::target::Target;
use pdserve_bench::workload::{Source, Workload};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;

const TTFT_MS: u64 = 150;
const ITL_MS: u64 = 40;

/// Starts the server on its own thread and runtime; returns its address.
fn start_server() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let app = Router::new()
                .route("/{mode}/v1/completions", post(completions))
                .route("/{mode}/v1/chat/completions", post(completions))
                .route("/{mode}/v1/models", get(|| async { Json(json!({"data": [{"id": "test-model"}]})) }));
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    addr
}

fn frame(v: Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// `ok`: TTFT_MS, then a token every ITL_MS, usage, [DONE]; `fast`: the same without
/// delays; `linger`: `fast` but the body stays open 30 s after [DONE]. `status500`: an error status. `midstream`: two tokens then an in-band
/// error. `cut`: two tokens then EOF. `shed`: 429 with `Retry-After: 1`.
async fn completions(Path(mode): Path<String>, Json(req): Json<Value>) -> Response {
    if mode == "status500" {
        return (StatusCode::INTERNAL_SERVER_ERROR, "engine on fire").into_response();
    }
    if mode == "shed" {
        return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")], "queue full").into_response();
    }
    let n = req["max_tokens"].as_u64().unwrap();
    let chat = req.get("messages").is_some();
    let stream = futures_util::stream::unfold(0u64, move |i| {
        let mode = mode.clone();
        async move {
            let delay = match (mode.as_str(), i) {
                ("fast" | "linger", _) => 0,
                (_, 0) => TTFT_MS,
                _ => ITL_MS,
            };
            let limit = if ["ok", "fast", "linger"].contains(&mode.as_str()) { n } else { 2 };
            if i < limit {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                let choice = if chat { json!({"delta": {"content": "w"}}) } else { json!({"text": "w"}) };
                return Some((Ok::<_, std::convert::Infallible>(frame(json!({"choices": [choice]}))), i + 1));
            }
            let complete = mode == "ok" || mode == "fast" || mode == "linger";
            match (complete, mode.as_str(), i - limit) {
                (true, _, 0) => Some((
                    Ok(frame(json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}))),
                    i + 1,
                )),
                (true, _, 1) => Some((Ok(Bytes::from("data: [DONE]\n\n")), i + 1)),
                (_, "linger", 2) => {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    None
                }
                (_, "midstream", 0) => Some((Ok(frame(json!({"error": {"message": "out of KV blocks"}}))), i + 1)),
                _ => None,
            }
        }
    });
    ([("content-type", "text/event-stream")], Body::from_stream(stream)).into_response()
}

fn workload(output: u32) -> Workload {
    Workload {
        source: Source::Random { input: LengthSpec::Fixed(8), output: LengthSpec::Fixed(output) },
        range: TokenRange::default(),
        seed: 1,
    }
}

fn client(addr: SocketAddr, mode: &str, endpoint: Endpoint) -> Client {
    let prompt_kind = if endpoint == Endpoint::Chat { PromptKind::Text } else { PromptKind::Ids };
    Client {
        target: Target::parse(&format!("http://{addr}/{mode}"), false).unwrap(),
        body: BodyOptions { endpoint, prompt_kind, model: None, temperature: 0.0, token_ids: false },
        timeout: Duration::from_secs(30),
    }
}

fn closed(c: usize, requests: usize) -> pdserve_bench::point::PointPlan {
    plans(&Sweep::Concurrency(vec![c]), requests, 60.0, None).unwrap().remove(0)
}

#[tokio::test]
async fn measured_ttft_and_itl_match_the_injected_delays() {
    let addr = start_server();
    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        let records = run_point(&client(addr, "ok", endpoint), &workload(5), &closed(2, 4), None).await;
        assert_eq!(records.len(), 4);
        for r in &records {
            assert!(r.ok, "{:?}", r.error);
            assert_eq!((r.output_tokens, r.input_tokens, r.chunk_times_s.len()), (5, 3, 5));
            let ttft = r.ttft_s.unwrap() * 1e3;
            assert!(ttft >= TTFT_MS as f64 - 5.0 && ttft < TTFT_MS as f64 + 400.0, "TTFT {ttft} ms");
            for itl in r.itls() {
                let itl = itl * 1e3;
                assert!(itl >= ITL_MS as f64 - 10.0 && itl < ITL_MS as f64 + 300.0, "ITL {itl} ms");
            }
            let tpot = r.tpot_s.unwrap() * 1e3;
            assert!(tpot >= ITL_MS as f64 - 5.0 && tpot < ITL_MS as f64 + 300.0, "TPOT {tpot} ms");
            assert!(r.e2e_s >= r.chunk_times_s[4]);
            assert!(r.client_busy_s >= 0.0 && r.client_busy_s < r.e2e_s);
        }
        // Closed loop at 2: the second pair starts after the first pair ends.
        assert!(records[2].start_s >= records[0].e2e_s.min(records[1].e2e_s) - 0.01);
    }
}

#[tokio::test]
async fn server_misbehaviour_becomes_failed_records_with_reasons() {
    let addr = start_server();
    let cases = [
        ("status500", "HTTP 500: engine on fire"),
        ("midstream", "server error: out of KV blocks"),
        ("cut", "ended without [DONE]"),
    ];
    for (mode, want) in cases {
        let records = run_point(&client(addr, mode, Endpoint::Completions), &workload(5), &closed(1, 2), None).await;
        assert_eq!(records.len(), 2);
        for r in &records {
            assert!(!r.ok);
            let e = r.error.as_deref().unwrap();
            assert!(e.contains(want), "{mode}: {e:?}");
        }
    }
    // Shed: counted apart, and a closed-loop client waits the Retry-After.
    let records = run_point(&client(addr, "shed", Endpoint::Completions), &workload(2), &closed(1, 2), None).await;
    assert!(records.iter().all(|r| !r.ok && r.shed == Some(1.0) && !r.timed_out), "{records:?}");
    assert!(records[1].start_s >= records[0].start_s + 1.0, "no back-off: {records:?}");
    let s = pdserve_bench::metrics::Summary::of(&records, Slo { ttft_ms: 1e3, tpot_ms: 1e3 });
    assert_eq!((s.failed, s.shed, s.timed_out), (2, 2, 0));
    // A body left open after [DONE]: the request is complete at [DONE].
    let t = std::time::Instant::now();
    let records = run_point(&client(addr, "linger", Endpoint::Completions), &workload(3), &closed(1, 1), None).await;
    assert!(records[0].ok, "{:?}", records[0].error);
    assert!(records[0].e2e_s < 1.0 && t.elapsed() < Duration::from_secs(10));
    // Nobody listening: a failed record, not a panic.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let records = run_point(&client(port, "ok", Endpoint::Completions), &workload(2), &closed(1, 1), None).await;
    assert_eq!(records[0].error.as_deref(), Some("connect: connection refused"));
}

#[tokio::test]
async fn open_loop_sends_on_schedule() {
    let addr = start_server();
    let sweep = Sweep::Rates { rates: vec![50.0], kind: ArrivalKind::Gamma, burstiness: 2.0 };
    let plan = plans(&sweep, 10, 60.0, None).unwrap().remove(0);
    let records = run_point(&client(addr, "ok", Endpoint::Completions), &workload(2), &plan, None).await;
    assert_eq!(records.len(), 10);
    assert!(records.iter().all(|r| r.ok));
    for w in records.windows(2) {
        assert!(w[1].scheduled_s.unwrap() >= w[0].scheduled_s.unwrap());
    }
    // Open loop does not wait for answers: all 10 start before the first (≥ 190 ms) ends
    // unless the gaps say otherwise.
    let last = records.last().unwrap();
    assert!(last.start_s - last.scheduled_s.unwrap() < 0.2, "sent late");
}

#[test]
fn bench_load_end_to_end_writes_json_and_refuses_unreachable_servers() {
    let addr = start_server();
    let dir = std::env::temp_dir().join(format!("pdserve-bench-test-{}", std::process::id()));
    let out = dir.join("load.json");
    let mut opts = load_options(addr, &out);
    let report = run_load(&opts).unwrap();
    assert_eq!(report.model.as_deref(), Some("test-model"));
    assert_eq!(report.points.len(), 2);
    assert_eq!(report.points[1].records.len(), 4);
    assert_eq!(report.points[1].summary.slo_attainment_pct, 100.0);
    assert_eq!(report.calibration.len(), 2);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(v["points"][0]["records"].as_array().unwrap().len(), 2);
    assert!(v["points"][0]["records"][0]["chunk_times_s"].is_array());
    // Each point says when it began, so a server's log lines can be placed on its clock.
    let began = |i: usize| v["points"][i]["started_unix_s"].as_f64().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!(began(0) <= began(1) && began(1) <= now && now - began(0) < 60.0, "{} {} {now}", began(0), began(1));

    a_shifting_workload_reports_each_phase(&opts, &out);

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    opts.url = format!("http://127.0.0.1:{port}");
    let e = run_load(&opts).unwrap_err().to_string();
    assert_eq!(e, format!("cannot reach http://127.0.0.1:{port}: connection refused"));
    std::fs::remove_dir_all(&dir).ok();
}

/// `bench load` against the test server's `ok` mode: two closed-loop points of two
/// requests, calibrated, written to `out`.
fn load_options(addr: SocketAddr, out: &std::path::Path) -> LoadOptions {
    LoadOptions {
        url: format!("http://{addr}/ok/v1"),
        allow_remote: false,
        body: BodyOptions {
            endpoint: Endpoint::Completions,
            prompt_kind: PromptKind::Ids,
            model: None,
            temperature: 0.0,
            token_ids: false,
        },
        workload: workload(3),
        sweep: Sweep::Concurrency(vec![1, 2]),
        requests: 2,
        seconds: 30.0,
        timeout: Duration::from_secs(30),
        slo: Slo { ttft_ms: 2000.0, tpot_ms: 500.0 },
        warmup: 1,
        calibrate: true,
        out: Some(out.to_path_buf()),
    }
}

/// A shifting workload: one point whose JSON and table hold each phase.
fn a_shifting_workload_reports_each_phase(opts: &LoadOptions, out: &std::path::Path) {
    let phased =
        LoadOptions { workload: two_phases().build().unwrap(), sweep: Sweep::Phases, calibrate: false, ..opts.clone() };
    let report = run_load(&phased).unwrap();
    let point = &report.points[0];
    let n: Vec<usize> = point.phases.iter().map(|p| p.summary.requests).collect();
    assert!(n.len() == 2 && n[0] > 0 && n[1] > 0 && n[0] + n[1] == point.records.len(), "{n:?}");
    assert!(point.records.iter().all(|r| r.ok && r.output_tokens == if r.scheduled_s < Some(0.5) { 2 } else { 3 }));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
    assert_eq!(v["points"][0]["phases"][1]["span"]["label"], "b");
    assert!(pdserve_bench::load::markdown::load_report(&report).contains("| phases › b |"));
}

/// Phase `a` (2 output tokens) for the first half second, then phase `b` (3).
fn two_phases() -> pdserve_bench::workload::WorkloadFlags {
    let phase = |s: &str| s.parse::<pdserve_bench::phases::Phase>().unwrap();
    let phases = vec![phase("a:0.5:20:8/2"), phase("b:0.5:20:16/3")];
    pdserve_bench::workload::WorkloadFlags {
        input: LengthSpec::Fixed(8),
        output: LengthSpec::Fixed(3),
        shared_prefixes: 0,
        prefix_order: Default::default(),
        prefix_share: 1.0,
        prefix_len: 0,
        conversations: 0,
        turns: LengthSpec::Fixed(1),
        replies: Default::default(),
        trace: None,
        trace_block_size: 16,
        phases,
        range: TokenRange::default(),
        seed: 3,
    }
}

#[test]
fn bench_compare_against_a_peer_writes_every_output() {
    let addr = start_server();
    let dir = std::env::temp_dir().join(format!("pdserve-compare-test-{}", std::process::id()));
    let opts = CompareOptions {
        budget: 2,
        workloads: vec![Named::Balanced],
        sweep: Sweep::Concurrency(vec![1, 2]),
        requests_per_point: 2,
        seconds_per_point: 30.0,
        topologies: vec!["peer".into()],
        peer_url: Some(format!("http://{addr}/fast")),
        allow_remote: false,
        out: dir.clone(),
        model: "default".into(),
        kv_blocks: None,
        serve_args: Vec::new(),
        body: BodyOptions {
            endpoint: Endpoint::Completions,
            prompt_kind: PromptKind::Ids,
            model: None,
            temperature: 0.0,
            token_ids: false,
        },
        range: TokenRange::default(),
        seed: 0,
        slo: Slo::default(),
        timeout: Duration::from_secs(60),
        startup_timeout: Duration::from_secs(5),
        warmup: 1,
        exe: None,
        reuse: None,
    };
    let report = run_compare(&opts).unwrap();
    assert_eq!(report.runs.len(), 1);
    assert_eq!(report.runs[0].workloads[0].points.len(), 2);
    assert!(report.runs[0].workloads[0].points.iter().all(|p| p.summary.failed == 0));
    assert!(report.calibration.is_some());
    for f in ["results.json", "results.md", "plots/balanced-throughput.svg", "plots/balanced-ttft-p99.svg"] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let md = std::fs::read_to_string(dir.join("results.md")).unwrap();
    assert!(md.contains("| peer | 2 |"), "{md}");
    reuse_keeps_the_earlier_runs_not_selected(opts, &dir);
    std::fs::remove_dir_all(&dir).ok();
}

/// The peer's run of `dir/results.json`, renamed `single`, is reused; `peer` is measured again.
fn reuse_keeps_the_earlier_runs_not_selected(mut opts: CompareOptions, dir: &std::path::Path) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    v["runs"][0]["topology"] = json!({"name": "single", "family": "single", "serve_args": []});
    v["runs"][0]["command"] = json!("old single");
    let earlier = dir.join("earlier.json");
    std::fs::write(&earlier, v.to_string()).unwrap();
    opts.reuse = Some(earlier.clone());
    opts.requests_per_point = 3;
    let e = run_compare(&opts).unwrap_err().to_string();
    assert_eq!(e, format!("--reuse {}: a different sweep: requests per point 2 there, 3 here", earlier.display()));
    opts.requests_per_point = 2;
    let report = run_compare(&opts).unwrap();
    let names: Vec<&str> = report.runs.iter().map(|r| r.topology.name.as_str()).collect();
    assert_eq!(names, vec!["single", "peer"]);
    assert_eq!(report.runs[0].command.as_deref(), Some("old single"));
    assert!(report.runs[1].workloads[0].points.iter().all(|p| p.summary.failed == 0));
    let md = std::fs::read_to_string(dir.join("results.md")).unwrap();
    assert!(md.contains("| single | `old single` |") && md.contains("| single | 2 |"), "{md}");
}
