//! The twin from the command line: `pdserve profile` times this machine with the real
//! model, `pdserve sim` simulates on that profile and writes `bench load`'s JSON, and
//! bad input gets a one-line error; sixteen simulated worker processes (`worker --engine
//! sim`) serve behind one frontend.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

fn pdserve(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pdserve")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

/// A new directory `pdserve-TAG-PID` holding a derived profile of the default model.
fn derived_in(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("pdserve-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let profile = dir.join("derived.json");
    common::derived_profile(&profile);
    (dir, profile)
}

/// The GPU profiles' step costs are the fit of the GPU steps they hold: refitting
/// them gives the same costs (so nobody edits one without the other), and a profile
/// without points is refused.
#[test]
fn the_gpu_profiles_are_the_fit_of_their_points() {
    let dir = std::env::temp_dir().join(format!("pdserve-refit-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../profiles/");
    for name in ["h100-llama3.1-8b.json", "h200-llama3.1-8b.json", "h200-llama3.1-70b-fp8.json"] {
        let from = format!("{root}{name}");
        let to = dir.join(name);
        let out = pdserve(&["profile", "--refit", &from, "--out", to.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("median fit error"));
        let read = |p: &str| serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(p).unwrap()).unwrap();
        let (was, now) = (read(&from), read(to.to_str().unwrap()));
        assert_eq!(was["provenance"]["kind"], "derived");
        assert!(was["shapes"][0]["points"].as_array().unwrap().len() >= 17, "{name}");
        for term in ["fixed_s", "token_s", "pair_s", "decode_pair_s", "logits_s"] {
            let (a, b) =
                (was["shapes"][0]["step"][term].as_f64().unwrap(), now["shapes"][0]["step"][term].as_f64().unwrap());
            assert!((a - b).abs() <= 1e-9 * a.abs().max(1e-12), "{name} {term}: {a} vs {b}");
        }
    }
    let mut bare: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{root}h100-llama3.1-8b.json")).unwrap()).unwrap();
    bare["shapes"][0]["points"] = serde_json::json!([]);
    let bare_path = dir.join("bare.json");
    std::fs::write(&bare_path, bare.to_string()).unwrap();
    let out =
        pdserve(&["profile", "--refit", bare_path.to_str().unwrap(), "--out", dir.join("h100.json").to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no timed points") && err.lines().count() == 1, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn profile_then_simulate() {
    let dir = std::env::temp_dir().join(format!("pdserve-twin-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let profile = dir.join("profile.json");
    let out = pdserve(&["profile", "--threads", "1", "--out", profile.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // It times steps that verify drafts and says how far its price of them is off.
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("verified drafts: their price off by") && log.contains("1×9 at 512: "), "{log}");
    let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    assert_eq!(p["provenance"]["kind"], "measured");
    // The machine's cores, which a stage group's stages over loopback share.
    assert!(p["cores"].as_u64().is_some_and(|c| c >= 1), "{}", p["cores"]);
    assert_eq!(p["model"]["n_layers"], 30);
    // What a stage group's model needs: the residual width, and the weights as loaded
    // (the 100 MB file with its tied embeddings held a second time as the output
    // head: 128 MB, what `pdserve bench engine` reports as weights).
    assert_eq!(p["model"]["hidden"], 576);
    assert!(p["model"]["weight_bytes"].as_f64().is_some_and(|b| (110e6..150e6).contains(&b)), "{}", p["model"]);
    let shape = &p["shapes"][0];
    assert_eq!(shape["threads"], 1);
    assert!(shape["points"].as_array().unwrap().len() >= 20);
    assert!(shape["step"]["token_s"].as_f64().unwrap() > 0.0, "{shape}");
    // A pass through the layers alone has a fixed part of its own, short of the
    // step's: the output head's weights and the step around the layers are the rest.
    let layers = shape["layers_fixed_s"].as_f64().unwrap_or(0.0);
    assert!(layers > 0.0 && layers < shape["step"]["fixed_s"].as_f64().unwrap(), "{shape}");
    let links: Vec<&str> = p["links"].as_array().unwrap().iter().map(|l| l["transport"].as_str().unwrap()).collect();
    assert_eq!(links, ["inproc", "tcp", "shm"]);
    // Each pair of step kinds timed side by side, never faster than alone.
    for pair in ["decode_beside_decode", "decode_beside_prefill", "prefill_beside_decode", "prefill_beside_prefill"] {
        assert!(p["co_run"][pair].as_f64().is_some_and(|f| f >= 1.0), "{pair}: {}", p["co_run"]);
    }

    let sim = dir.join("sim.json");
    let out = pdserve(&[
        "sim",
        "--profile",
        profile.to_str().unwrap(),
        "--mode",
        "disaggregated",
        "--concurrency",
        "1,4",
        "--input-len",
        "256",
        "--output-len",
        "32",
        "--requests",
        "12",
        "--out",
        sim.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("| C=4 |"), "{table}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sim).unwrap()).unwrap();
    for point in r["points"].as_array().unwrap() {
        let s = &point["summary"];
        assert_eq!(s["ok"], 12, "{s}");
        assert!(s["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
        for rec in point["records"].as_array().unwrap() {
            assert_eq!(rec["output_tokens"], 32);
        }
    }

    simulates_speculation(&profile);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Speculation as servers measured it: a draft model (the profile at `profile` stands
/// in for its own) and a lookup's figures beside it; a share past 1 is refused.
fn simulates_speculation(profile: &std::path::Path) {
    let p = profile.to_str().unwrap();
    let spec = |lookup: &str| {
        pdserve(&[
            "sim",
            "--profile",
            p,
            "--mode",
            "aggregated",
            "--concurrency",
            "1",
            "--input-len",
            "64",
            "--output-len",
            "16",
            "--requests",
            "2",
            "--spec-tokens",
            "4",
            "--spec-acceptance",
            "0.9",
            "--spec-draft-profile",
            p,
            "--spec-lookup-acceptance",
            lookup,
            "--spec-lookup-drafting",
            "0.5",
        ])
    };
    let ok = spec("0.7");
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let bad = spec("1.5");
    assert_eq!(bad.status.code(), Some(1));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--spec-lookup-acceptance is a share, 0 to 1 (got 1.5)"), "{err}");
}

#[test]
fn bad_input_gets_one_line() {
    let missing = pdserve(&["sim", "--profile", "/nonexistent/profile.json"]);
    assert_eq!(missing.status.code(), Some(1));
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.starts_with("error: ") && err.contains("/nonexistent/profile.json"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let odd = pdserve(&["sim", "--profile", "x.json", "--mode", "aggregated", "--prefill", "1"]);
    assert_eq!(odd.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&odd.stderr).contains("--prefill and --decode need"));
    let zero = pdserve(&["profile", "--threads", "0", "--out", "/tmp/never.json"]);
    assert_eq!(zero.status.code(), Some(1));
}

#[test]
fn sixteen_simulated_worker_processes_serve_behind_one_frontend() {
    let profile = std::env::temp_dir().join(format!("pdserve-derived-{}.json", std::process::id()));
    common::derived_profile(&profile);
    let p = profile.to_str().unwrap();
    let workers: Vec<common::Proc> = (0..16)
        .map(|i| {
            let role = if i < 4 { "prefill" } else { "decode" };
            let args = ["worker", "--engine", "sim", "--profile", p, "--role", role, "--listen", "127.0.0.1:0"];
            common::start(&args)
        })
        .collect();
    let fe = common::frontend(&workers.iter().collect::<Vec<_>>(), "disaggregated", "tcp");
    let addr = fe.addr;
    let clients: Vec<_> = (0..32u32)
        .map(|k| {
            std::thread::spawn(move || {
                let prompt: Vec<u32> = (0..200u32).map(|i| 1000 + (i * 31 + k * 7) % 30000).collect();
                let req = serde_json::json!({"prompt": prompt, "max_tokens": 12, "temperature": 0});
                let (status, body) = common::http(addr, "POST", "/v1/completions", Some(&req));
                assert_eq!(status, 200, "{body}");
                let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                v["usage"]["completion_tokens"].as_u64().unwrap()
            })
        })
        .collect();
    for c in clients {
        assert_eq!(c.join().unwrap(), 12, "a simulated worker generates exactly max_tokens");
    }
    // Every prompt was prefilled on a prefill process and its (scaled) KV moved,
    // accounted as the model's bytes: 200 tokens × 23,040 bytes each.
    assert_eq!(common::metric(addr, "pdserve_prefill_route_total", "remote"), 32.0);
    assert_eq!(common::metric(addr, "pdserve_kv_transfer_bytes_total", "tcp"), 32.0 * 200.0 * 23040.0);
    assert_eq!(common::settle_used_blocks(addr), 0.0);
    let _ = std::fs::remove_file(&profile);
}

#[test]
fn plan_ranks_every_topology_and_says_when_to_disaggregate() {
    let (dir, profile) = derived_in("plan-test");
    let out = pdserve(&[
        "plan",
        "--profile",
        profile.to_str().unwrap(),
        "--nodes",
        "3",
        "--concurrency",
        "1,8",
        "--input-len",
        "512",
        "--output-len",
        "64",
        "--requests",
        "16",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
    let names: Vec<&str> = p["candidates"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, ["1P:2D", "2P:1D", "3 mixed + planner", "aggregated ×3", "single node"], "{text}");
    let best: Vec<f64> =
        p["candidates"].as_array().unwrap().iter().map(|c| c["best_goodput"].as_f64().unwrap()).collect();
    assert!(best.windows(2).all(|w| w[0] >= w[1]), "ranked best first: {best:?}");
    let decision = p["decision"].as_str().unwrap();
    assert!(text.contains(decision) && decision.contains("isaggregate"), "{decision}");
    assert!(std::fs::read_to_string(dir.join("plan.svg")).unwrap().starts_with("<svg"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `plan --stage-link`: stage groups beside the whole-model topologies; nodes too
/// small for the weights get groups only, and without a link they are refused.
#[test]
fn plan_weighs_stage_groups_and_plans_only_groups_for_a_model_no_node_holds() {
    let (dir, profile) = derived_in("plan-groups");
    let plan = |extra: &[&str]| {
        let args = ["plan", "--profile", profile.to_str().unwrap(), "--nodes", "2", "--concurrency", "1,4"];
        let more = ["--input-len", "256", "--output-len", "16", "--requests", "8", "--out", dir.to_str().unwrap()];
        pdserve(&[&args[..], &more, extra].concat())
    };
    let names = || -> Vec<String> {
        let p: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
        p["candidates"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap().to_string()).collect()
    };
    let out = plan(&["--stage-link", "1gbe"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let all = names();
    assert!(all.iter().any(|n| n == "aggregated ×1 of 2-stage groups (1 GbE)"), "{all:?}");
    assert!(all.iter().any(|n| n == "aggregated ×2"), "{all:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("stage split"), "{}", String::from_utf8_lossy(&out.stdout));
    // 80 MB nodes: the 100 MB of weights fit two halves, not one node.
    let out = plan(&["--stage-link", "10gbe", "--node-memory-gb", "0.08"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(names(), ["aggregated ×1 of 2-stage groups (10 GbE)"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("does not fit one node"));
    let out = plan(&["--node-memory-gb", "0.08"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("give a stage link") && err.lines().count() == 1, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `bench compare --sim`: both topologies of a one-thread budget measured on the real
/// model, taking turns workload by workload, then simulated with the same requests;
/// the predictions sit beside the measurements with their errors. A bad profile is
/// refused before anything runs.
#[test]
fn compare_puts_the_twins_predictions_beside_the_measurements() {
    let (dir, profile) = derived_in("compare-sim");
    let run = |profile: &str| {
        pdserve(&[
            "bench",
            "compare",
            "--budget",
            "1",
            "--workloads",
            "balanced,shared-prefix",
            "--concurrency",
            "1",
            "--requests-per-point",
            "2",
            "--warmup",
            "0",
            "--sim",
            profile,
            "--out",
            dir.to_str().unwrap(),
        ])
    };
    let bad = run("/nonexistent/profile.json");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.starts_with("error: ") && err.contains("/nonexistent/profile.json"), "{err}");
    assert!(!dir.join("results.json").exists(), "it measured before reading the profile");
    let out = run(profile.to_str().unwrap());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Each topology on a fresh server per workload, the topologies in turn: a server
    // writes its log until it stops.
    let stopped = |log: &str| std::fs::metadata(dir.join("logs").join(log)).unwrap().modified().unwrap();
    let order = ["single-balanced.log", "auto-balanced.log", "single-shared-prefix.log", "auto-shared-prefix.log"];
    assert!(order.windows(2).all(|w| stopped(w[0]) <= stopped(w[1])), "servers not started in turn");
    let measured: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    for r in measured["runs"].as_array().unwrap() {
        let workloads: Vec<&str> =
            r["workloads"].as_array().unwrap().iter().map(|w| w["workload"].as_str().unwrap()).collect();
        assert_eq!(workloads, ["balanced", "shared-prefix"], "{}", r["topology"]);
    }
    let predicted: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("predicted.json")).unwrap()).unwrap();
    let runs = predicted.as_array().unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["topology"]["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["single", "auto"]);
    for r in runs {
        assert!(r["error"].is_null(), "{r}");
        let summary = &r["workloads"][0]["points"][0]["summary"];
        assert_eq!((summary["requests"].as_u64(), summary["ok"].as_u64()), (Some(2), Some(2)), "{summary}");
    }
    let md = std::fs::read_to_string(dir.join("predicted.md")).unwrap();
    assert!(md.contains("| single | balanced |") && md.contains("| auto | balanced |"), "{md}");
    assert!(md.contains("Median absolute error: goodput req/s"), "{md}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("The twin's predictions"));
    std::fs::remove_dir_all(&dir).unwrap();
}
