//! `pdserve bench load`: load one OpenAI-compatible server over a sweep of points and
//! report every request, a summary per point and a Markdown table.

pub mod markdown;

use crate::arrivals::{ArrivalKind, Arrivals};
use crate::calibrate::{self, Calibration};
use crate::client::{first_model, metrics_page, Client};
use crate::error::BenchError;
use crate::metrics::{PrefixHits, Speculation};
use crate::metrics::{Slo, Summary};
use crate::openai::BodyOptions;
use crate::phases::PhaseResult;
use crate::point::{Bounds, Issue, PointPlan};
use crate::record::RequestRecord;
use crate::report::json;
use crate::report::markdown::one_line;
use crate::reuse::SentBlocks;
use crate::runner::run_point;
use crate::target::Target;
use crate::workload::Workload;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::time::Instant as Clock;

/// What varies from point to point.
#[derive(Clone, Debug)]
pub enum Sweep {
    /// Closed loop at each concurrency.
    Concurrency(Vec<usize>),
    /// Open loop at each rate (requests per second).
    Rates { rates: Vec<f64>, kind: ArrivalKind, burstiness: f64 },
    /// One point: the trace's own arrival times, sped up.
    Trace { speedup: f64 },
    /// One point: the workload's phases, end to end (they set their own length).
    Phases,
}

impl Sweep {
    /// From the flags: a trace replays its timestamps, rates give an open loop, else a
    /// closed loop at the given concurrencies (default 1).
    pub fn from_flags(
        concurrency: Option<Vec<usize>>,
        rates: Vec<f64>,
        kind: ArrivalKind,
        burstiness: f64,
        trace_speedup: Option<f64>,
        phases: bool,
    ) -> Result<Self, BenchError> {
        let given = usize::from(concurrency.is_some())
            + usize::from(!rates.is_empty())
            + usize::from(trace_speedup.is_some())
            + usize::from(phases);
        if given > 1 {
            return Err(BenchError::BadFlag("give one of --concurrency, --rate, --trace or --phase".into()));
        }
        Ok(match (trace_speedup, rates.is_empty()) {
            _ if phases => Self::Phases,
            (Some(speedup), _) => Self::Trace { speedup },
            (None, false) => Self::Rates { rates, kind, burstiness },
            (None, true) => Self::Concurrency(concurrency.unwrap_or_else(|| vec![1])),
        })
    }
}

/// Everything `bench load` needs.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub url: String,
    pub allow_remote: bool,
    /// `model: None` asks the server's `/v1/models` for its first model.
    pub body: BodyOptions,
    pub workload: Workload,
    pub sweep: Sweep,
    /// Request bound per point (closed loop: at least 2 × concurrency).
    pub requests: usize,
    /// Time bound per point, seconds.
    pub seconds: f64,
    pub timeout: Duration,
    pub slo: Slo,
    /// Requests sent one at a time before measuring (not recorded).
    pub warmup: usize,
    /// Also run every point against an instant in-process server.
    pub calibrate: bool,
    pub out: Option<PathBuf>,
}

/// One measured point.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PointResult {
    pub plan: PointPlan,
    pub summary: Summary,
    /// A shifting workload's summary per phase (empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhaseResult>,
    pub records: Vec<RequestRecord>,
    /// When the point began, in Unix seconds, so that a server's own log lines (its
    /// planner's switches) can be placed on the records' clock. Absent on the twin,
    /// whose clock is virtual.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_unix_s: Option<f64>,
    /// The role switches the server's planner made while the point ran, where the
    /// server reports them (the twin does; a real server logs them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub switches: Vec<SwitchRecord>,
}

/// A role switch the planner made, on a point's clock.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SwitchRecord {
    /// Seconds from the point's start, as the records' `start_s`.
    pub at_s: f64,
    /// The role vectors before and after (`2M`, `1P:1D`).
    pub from: String,
    pub to: String,
    pub reason: String,
}

impl PointResult {
    /// A point's result from its records, split per phase when the workload has them.
    pub fn of(plan: &PointPlan, w: &Workload, records: Vec<RequestRecord>, slo: Slo) -> Self {
        let summary = Summary::of(&records, slo);
        let phases = crate::phases::split(&w.spans(), &records, slo);
        Self { plan: plan.clone(), summary, phases, records, started_unix_s: None, switches: Vec::new() }
    }
}

/// The output of `bench load`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LoadReport {
    pub url: String,
    pub model: Option<String>,
    pub workload: String,
    pub body: BodyOptions,
    pub points: Vec<PointResult>,
    pub calibration: Vec<Calibration>,
}

/// The points of a sweep, in order.
pub fn plans(
    sweep: &Sweep,
    requests: usize,
    seconds: f64,
    trace_len: Option<usize>,
) -> Result<Vec<PointPlan>, BenchError> {
    let plans: Vec<PointPlan> = match sweep {
        Sweep::Concurrency(cs) => cs
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                if c == 0 {
                    return Err(BenchError::BadFlag("concurrency must be at least 1".into()));
                }
                let (issue, bounds) = (Issue::Closed { concurrency: c }, Bounds::closed(c, requests, seconds));
                Ok(PointPlan { label: format!("C={c}"), issue, bounds, seed: i as u64 })
            })
            .collect::<Result<_, _>>()?,
        Sweep::Rates { rates, kind, burstiness } => rates
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                let arrivals = Arrivals::new(*kind, r, *burstiness)?;
                let bounds = Bounds::open(requests, seconds);
                Ok(PointPlan { label: format!("rate={r}/s"), issue: Issue::Open { arrivals }, bounds, seed: i as u64 })
            })
            .collect::<Result<_, BenchError>>()?,
        Sweep::Trace { speedup } => {
            if !(speedup.is_finite() && *speedup > 0.0) {
                return Err(BenchError::BadFlag(format!("trace speed-up must be positive, got {speedup}")));
            }
            let n = trace_len.ok_or_else(|| BenchError::BadFlag("trace replay needs --trace FILE".into()))?;
            let bounds = Bounds::open(requests.min(n), seconds);
            vec![PointPlan {
                label: format!("trace×{speedup}"),
                issue: Issue::Trace { speedup: *speedup },
                bounds,
                seed: 0,
            }]
        }
        Sweep::Phases => {
            let n = trace_len.ok_or_else(|| BenchError::BadFlag("a phased sweep needs --phase".into()))?;
            let bounds = Bounds::open(n, f64::INFINITY);
            vec![PointPlan { label: "phases".into(), issue: Issue::Trace { speedup: 1.0 }, bounds, seed: 0 }]
        }
    };
    if plans.is_empty() {
        return Err(BenchError::BadFlag("nothing to run: give at least one concurrency or rate".into()));
    }
    Ok(plans)
}

/// A single-threaded runtime: the client should take as little CPU from the server
/// under test as it can.
pub fn runtime() -> Result<tokio::runtime::Runtime, BenchError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Runtime(format!("starting the runtime: {e}")))
}

/// Runs `bench load`: measures and writes the JSON (the caller prints the table,
/// `load::markdown::load_report`).
pub fn run_load(opts: &LoadOptions) -> Result<LoadReport, BenchError> {
    opts.body.validate()?;
    let plans = plans(&opts.sweep, opts.requests, opts.seconds, opts.workload.trace_len())?;
    let target = Target::parse(&opts.url, opts.allow_remote)?;
    let report = runtime()?.block_on(async {
        let model = match &opts.body.model {
            Some(m) => Some(m.clone()),
            None => first_model(&target).await?,
        };
        let body = BodyOptions { model: model.clone(), ..opts.body.clone() };
        let client = Client { target, body, timeout: opts.timeout };
        let mut sent = SentBlocks::default();
        warm_up(&client, &opts.workload, opts.warmup, &mut sent).await?;
        let points = measure(&client, &opts.workload, &plans, opts.slo, &mut sent).await;
        let mut calibration = Vec::new();
        if opts.calibrate {
            for plan in &plans {
                calibration.push(calibrate::floor(&client.body, &opts.workload, plan).await?);
            }
        }
        let workload = opts.workload.describe();
        Ok::<_, BenchError>(LoadReport {
            url: opts.url.clone(),
            model,
            workload,
            body: client.body,
            points,
            calibration,
        })
    })?;
    if let Some(path) = &opts.out {
        json::write(path, &report)?;
        tracing::info!("wrote {}", path.display());
    }
    Ok(report)
}

/// Runs every point in order, logging one line per point to stderr. `sent` holds the
/// prompt blocks this server has seen earlier in the run.
pub async fn measure(
    client: &Client,
    w: &Workload,
    plans: &[PointPlan],
    slo: Slo,
    sent: &mut SentBlocks,
) -> Vec<PointResult> {
    let mut out = Vec::new();
    for plan in plans {
        let t = Instant::now();
        let before = metrics_page(&client.target).await;
        let started = unix_now();
        let records = run_point(client, w, plan, Some(crate::progress::Style::detect())).await;
        let mut point = PointResult::of(plan, w, records, slo);
        point.started_unix_s = Some(started);
        let before = before.as_deref();
        let before_hits = before.and_then(PrefixHits::scrape);
        if before_hits.is_some() {
            // pdserve's tier and speculation counters come with its once-a-second
            // worker stats.
            tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
        }
        let after = metrics_page(&client.target).await;
        let after = after.as_deref();
        point.summary.prefix_hits = after.and_then(PrefixHits::scrape).map(|a| a.since(before_hits));
        let before_spec = before.and_then(Speculation::scrape);
        point.summary.speculation = after.and_then(Speculation::scrape).map(|a| a.since(before_spec));
        for r in &point.records {
            point.summary.prompt_blocks += sent.record_sent(w, plan.seed, r);
        }
        tracing::info!("{}", one_line(&plan.label, &point.summary, t.elapsed().as_secs_f64()));
        for p in &point.phases {
            tracing::info!(
                "{}",
                one_line(&format!("  phase {}", p.span.label), &p.summary, p.span.end_s - p.span.start_s)
            );
        }
        out.push(point);
    }
    out
}

/// The wall clock in Unix seconds (0 on a clock set before 1970).
fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Sends `n` requests one at a time with prompts no point uses. Fails only if every
/// one of them fails: then measuring would only record that error.
pub async fn warm_up(client: &Client, w: &Workload, n: usize, sent: &mut SentBlocks) -> Result<(), BenchError> {
    let origin = Clock::now();
    let mut last_error = None;
    let mut ok = 0;
    for i in 0..n {
        let spec = w.request(u64::MAX, i);
        sent.record(&spec.prompt.ids());
        let rec = client.send(&spec, origin, None).await;
        if rec.ok {
            ok += 1;
        } else {
            last_error = rec.error;
        }
    }
    match last_error {
        Some(e) if ok == 0 => {
            Err(BenchError::Runtime(format!("warm-up requests to {} failed: {e}", client.target.url)))
        }
        _ => Ok(()),
    }
}
