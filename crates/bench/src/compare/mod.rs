//! `pdserve bench compare`: every topology of a compute budget, one after another on
//! this machine, each swept over the same workloads and points with the same prompts;
//! then tables, plots and crossovers (see docs/bench.md). The topologies take turns
//! workload by workload, each on a fresh server: the drift of a machine over a long
//! run then falls between workloads, not between the topologies compared on one.

pub mod analyze;
pub mod markdown;
pub mod plots;
pub mod reuse;
pub mod suite;

use crate::calibrate::{self, Calibration};
use crate::client::{first_model, Client};
use crate::error::BenchError;
use crate::load::{measure, plans, runtime, warm_up, PointResult, Sweep};
use crate::metrics::Slo;
use crate::openai::BodyOptions;
use crate::point::PointPlan;
use crate::process::ServerProcess;
use crate::prompt::TokenRange;
use crate::report::json;
use crate::reuse::SentBlocks;
use crate::target::Target;
use crate::topology::{self, Topology};
use analyze::Analysis;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;
use suite::Named;

/// Everything `bench compare` needs.
#[derive(Clone, Debug)]
pub struct CompareOptions {
    /// Total compute threads every topology gets.
    pub budget: usize,
    pub workloads: Vec<Named>,
    /// Concurrencies (closed loop) or rates (open loop).
    pub sweep: Sweep,
    pub requests_per_point: usize,
    pub seconds_per_point: f64,
    /// Topology names to keep (empty: all of the budget).
    pub topologies: Vec<String>,
    pub peer_url: Option<String>,
    pub allow_remote: bool,
    pub out: PathBuf,
    /// `--model` of `pdserve serve`.
    pub model: String,
    /// `--kv-blocks` of `pdserve serve`, when set.
    pub kv_blocks: Option<usize>,
    /// Extra arguments appended to every `pdserve serve`.
    pub serve_args: Vec<String>,
    pub body: BodyOptions,
    pub range: TokenRange,
    pub seed: u64,
    pub slo: Slo,
    pub timeout: Duration,
    pub startup_timeout: Duration,
    pub warmup: usize,
    /// The `pdserve` binary to start (default: the running executable).
    pub exe: Option<PathBuf>,
    /// An earlier results.json of the same sweep: its runs of the topologies not
    /// selected here are kept instead of measured.
    pub reuse: Option<PathBuf>,
}

/// One topology's measurements.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct TopologyRun {
    pub topology: Topology,
    /// The command line it ran with (absent for a peer).
    pub command: Option<String>,
    /// Why it could not be measured, if it could not.
    pub error: Option<String>,
    pub workloads: Vec<WorkloadRun>,
}

/// One topology × workload.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct WorkloadRun {
    pub workload: Named,
    pub error: Option<String>,
    pub points: Vec<PointResult>,
}

/// A workload of the comparison and what it is.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct WorkloadInfo {
    pub name: Named,
    pub description: String,
}

/// The output of `bench compare` (results.json).
#[derive(Clone, Debug, serde::Serialize)]
pub struct CompareReport {
    pub budget: usize,
    pub model: String,
    pub cores: usize,
    /// "concurrency" or "rate".
    pub x_name: String,
    pub xs: Vec<f64>,
    pub workloads: Vec<WorkloadInfo>,
    pub slo: Slo,
    pub requests_per_point: usize,
    pub seconds_per_point: f64,
    pub calibration: Option<Calibration>,
    pub runs: Vec<TopologyRun>,
    pub analysis: Analysis,
}

/// Runs the comparison, writing results.json (after every topology), results.md and
/// plots/*.svg under `out`, and printing the Markdown to stdout.
pub fn run_compare(opts: &CompareOptions) -> Result<CompareReport, BenchError> {
    opts.body.validate()?;
    if matches!(opts.sweep, Sweep::Trace { .. } | Sweep::Phases) {
        return Err(BenchError::BadFlag("bench compare sweeps concurrencies or rates, not a trace or phases".into()));
    }
    let plans = plans(&opts.sweep, opts.requests_per_point, opts.seconds_per_point, None)?;
    let topologies = selected(opts)?;
    let exe = match &opts.exe {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| BenchError::Runtime(format!("cannot find pdserve: {e}")))?,
    };
    let mut report = empty_report(opts, &plans);
    reuse_earlier(opts, &mut report, &topologies)?;
    let logs = opts.out.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| BenchError::io(&logs, e))?;
    tracing::info!(
        "bench compare: {} topologies × {} workloads × {} points, up to {} s or {} requests per point",
        topologies.len(),
        opts.workloads.len(),
        plans.len(),
        opts.seconds_per_point,
        opts.requests_per_point
    );
    runtime()?.block_on(async {
        report.calibration = calibration(opts, &plans).await;
        // What each topology's server was sent, for the prefix reuse a point may
        // expect: a peer's cache outlives each workload; a started server is fresh.
        let mut sent: HashMap<String, SentBlocks> = HashMap::new();
        for &w in &opts.workloads {
            for t in &topologies {
                let sent = sent.entry(t.name.clone()).or_default();
                let run = run_topology(opts, &exe, t, &plans, &logs, w, sent).await;
                if let Some(e) = &run.error {
                    tracing::warn!("{} {}: {e}", t.name, w.name());
                }
                add_run(&mut report.runs, run);
                reuse::sort_runs(&mut report.runs, opts.budget);
                report.analysis = Analysis::of(&report);
                json::write(&opts.out.join("results.json"), &report)?;
            }
        }
        Ok::<_, BenchError>(())
    })?;
    report.analysis = Analysis::of(&report);
    write_outputs(opts, &report)?;
    Ok(report)
}

fn selected(opts: &CompareOptions) -> Result<Vec<Topology>, BenchError> {
    let mut all = topology::for_budget(opts.budget)?;
    for t in &mut all {
        if opts.model != "default" {
            t.serve_args.extend(["--model".to_string(), opts.model.clone()]);
        }
        if let Some(k) = opts.kv_blocks {
            t.serve_args.extend(["--kv-blocks".to_string(), k.to_string()]);
        }
        if t.family == topology::Family::Planner {
            let slo = [("--slo-ttft-ms", opts.slo.ttft_ms), ("--slo-tpot-ms", opts.slo.tpot_ms)];
            t.serve_args.extend(slo.iter().flat_map(|(flag, ms)| [flag.to_string(), ms.to_string()]));
        }
        t.serve_args.extend(opts.serve_args.iter().cloned());
    }
    if let Some(url) = &opts.peer_url {
        Target::parse(url, opts.allow_remote)?;
        if !opts.topologies.is_empty() && !opts.topologies.iter().any(|t| t == "peer") {
            let msg = "--peer-url is given but --topologies does not name `peer`: add it, or drop --peer-url";
            return Err(BenchError::BadFlag(msg.into()));
        }
        all.push(Topology::peer(url));
    }
    topology::select(all, &opts.topologies)
}

/// With `--reuse`: the earlier runs of the topologies not selected, checked to be of
/// the same sweep.
fn reuse_earlier(opts: &CompareOptions, report: &mut CompareReport, selected: &[Topology]) -> Result<(), BenchError> {
    let Some(path) = &opts.reuse else { return Ok(()) };
    let names = reuse::merge(report, reuse::Earlier::load(path)?, selected)?;
    let list = if names.is_empty() { "none".to_string() } else { names.join(", ") };
    tracing::info!("bench compare: reused from {}: {list}", path.display());
    Ok(())
}

fn empty_report(opts: &CompareOptions, plans: &[PointPlan]) -> CompareReport {
    let x_name = match opts.sweep {
        Sweep::Rates { .. } => "rate",
        _ => "concurrency",
    };
    CompareReport {
        budget: opts.budget,
        model: opts.model.clone(),
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        x_name: x_name.into(),
        xs: plans.iter().filter_map(PointPlan::x).collect(),
        workloads: opts
            .workloads
            .iter()
            .map(|w| WorkloadInfo { name: *w, description: w.workload(opts.seed, opts.range).describe() })
            .collect(),
        slo: opts.slo,
        requests_per_point: opts.requests_per_point,
        seconds_per_point: opts.seconds_per_point,
        calibration: None,
        runs: Vec::new(),
        analysis: Analysis::default(),
    }
}

/// The client floor at the largest point of the first workload (short: ≤ 128 requests).
async fn calibration(opts: &CompareOptions, plans: &[PointPlan]) -> Option<Calibration> {
    let (w, plan) = (opts.workloads.first()?, plans.last()?);
    let mut plan = plan.clone();
    plan.bounds.max_requests = plan.bounds.max_requests.min(128);
    plan.bounds.max_seconds = plan.bounds.max_seconds.min(20.0);
    plan.label = format!("{} {}", w.name(), plan.label);
    match calibrate::floor(&opts.body, &w.workload(opts.seed, opts.range), &plan).await {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::info!("calibration skipped: {e}");
            None
        }
    }
}

/// Adds one workload's run of a topology to that topology's run so far.
fn add_run(runs: &mut Vec<TopologyRun>, run: TopologyRun) {
    match runs.iter_mut().find(|r| r.topology.name == run.topology.name) {
        Some(r) => {
            r.workloads.extend(run.workloads);
            r.command = r.command.take().or(run.command);
            r.error = r.error.take().or(run.error);
        }
        None => runs.push(run),
    }
}

/// Starts (unless a peer), sweeps workload `w`, stops.
async fn run_topology(
    opts: &CompareOptions,
    exe: &std::path::Path,
    t: &Topology,
    plans: &[PointPlan],
    logs: &std::path::Path,
    w: Named,
    sent: &mut SentBlocks,
) -> TopologyRun {
    let mut run = TopologyRun { topology: t.clone(), command: None, error: None, workloads: Vec::new() };
    let mut server = None;
    let log = logs.join(format!("{}-{}.log", t.name, w.name()));
    let url = match &t.url {
        Some(url) => url.clone(),
        None => match ServerProcess::spawn(&t.name, exe, &t.serve_args, log) {
            Ok(mut s) => {
                run.command = t.command("pdserve", s.port);
                tracing::info!("{}: {}", t.name, run.command.as_deref().unwrap_or_default());
                if let Err(e) = s.wait_healthy(opts.startup_timeout).await {
                    run.error = Some(e.to_string());
                    return run;
                }
                let url = s.url();
                server = Some(s);
                *sent = SentBlocks::default();
                url
            }
            Err(e) => {
                run.error = Some(e.to_string());
                return run;
            }
        },
    };
    match sweep_workload(opts, t, &url, plans, w, sent).await {
        Ok(w) => run.workloads = vec![w],
        Err(e) => run.error = Some(e.to_string()),
    }
    if let Some(s) = server {
        if let Err(e) = s.stop(Duration::from_secs(60)).await {
            tracing::info!("{e}");
        }
    }
    run
}

async fn sweep_workload(
    opts: &CompareOptions,
    t: &Topology,
    url: &str,
    plans: &[PointPlan],
    named: Named,
    sent: &mut SentBlocks,
) -> Result<WorkloadRun, BenchError> {
    let target = Target::parse(url, opts.allow_remote)?;
    let model = match &opts.body.model {
        Some(m) => Some(m.clone()),
        None => first_model(&target).await?,
    };
    let client = Client { target, body: BodyOptions { model, ..opts.body.clone() }, timeout: opts.timeout };
    let w = named.workload(opts.seed, opts.range);
    if let Err(e) = warm_up(&client, &w, opts.warmup, sent).await {
        return Ok(WorkloadRun { workload: named, error: Some(e.to_string()), points: Vec::new() });
    }
    let labelled: Vec<PointPlan> = plans
        .iter()
        .map(|p| PointPlan { label: format!("{} {} {}", t.name, named.name(), p.label), ..p.clone() })
        .collect();
    let points = measure(&client, &w, &labelled, opts.slo, sent).await;
    Ok(WorkloadRun { workload: named, error: None, points })
}

fn write_outputs(opts: &CompareOptions, report: &CompareReport) -> Result<(), BenchError> {
    json::write(&opts.out.join("results.json"), report)?;
    let plot_files = plots::write_all(&opts.out.join("plots"), report)?;
    let md = markdown::render(report, &plot_files);
    let path = opts.out.join("results.md");
    std::fs::write(&path, &md).map_err(|e| BenchError::io(&path, e))?;
    tracing::info!("wrote {}/results.json, results.md and {} plots", opts.out.display(), plot_files.len());
    Ok(())
}
