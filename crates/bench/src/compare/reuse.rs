//! `bench compare --reuse FILE`: keep an earlier results.json's runs of the topologies
//! not measured this time, so one topology can be re-measured after a fix without
//! re-running the others. The earlier sweep must be this run's sweep.

use super::{CompareReport, TopologyRun, WorkloadInfo};
use crate::error::BenchError;
use crate::metrics::Slo;
use crate::topology::{self, Family, Topology};
use std::fmt::Display;
use std::path::{Path, PathBuf};

/// What `--reuse` reads of an earlier results.json; the rest (calibration, analysis)
/// comes from this run.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct Earlier {
    #[serde(skip)]
    pub path: PathBuf,
    pub budget: usize,
    pub x_name: String,
    pub xs: Vec<f64>,
    pub workloads: Vec<WorkloadInfo>,
    pub slo: Slo,
    pub requests_per_point: usize,
    pub seconds_per_point: f64,
    pub runs: Vec<TopologyRun>,
}

impl Earlier {
    pub fn load(path: &Path) -> Result<Self, BenchError> {
        let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
        let earlier: Self = serde_json::from_str(&text).map_err(|e| {
            BenchError::BadFlag(format!("--reuse {}: not a bench compare results.json: {e}", path.display()))
        })?;
        Ok(Self { path: path.to_path_buf(), ..earlier })
    }
}

/// Checks that `earlier` swept what `report` sweeps, then appends to `report` its runs
/// of the topologies not in `selected`, in their order. Returns their names.
pub fn merge(report: &mut CompareReport, earlier: Earlier, selected: &[Topology]) -> Result<Vec<String>, BenchError> {
    if let Some(d) = first_difference(&earlier, report) {
        return Err(BenchError::BadFlag(format!("--reuse {}: a different sweep: {d}", earlier.path.display())));
    }
    let kept: Vec<TopologyRun> =
        earlier.runs.into_iter().filter(|r| !selected.iter().any(|t| t.name == r.topology.name)).collect();
    let names = kept.iter().map(|r| r.topology.name.clone()).collect();
    report.runs.extend(kept);
    Ok(names)
}

/// The first of x_name, xs, workloads, budget, requests and seconds per point and SLO
/// that differs, as "what THERE there, HERE here".
fn first_difference(e: &Earlier, r: &CompareReport) -> Option<String> {
    let workloads = |w: &[WorkloadInfo]| w.iter().map(|i| i.name.name()).collect::<Vec<_>>().join(",");
    let xs = |v: &[f64]| v.iter().map(f64::to_string).collect::<Vec<_>>().join(",");
    let slo = |s: &Slo| format!("TTFT ≤ {} ms and TPOT ≤ {} ms", s.ttft_ms, s.tpot_ms);
    let (ew, rw) = (workloads(&e.workloads), workloads(&r.workloads));
    let same_slo = same(e.slo.ttft_ms, r.slo.ttft_ms) && same(e.slo.tpot_ms, r.slo.tpot_ms);
    differs("sweep", e.x_name == r.x_name, &e.x_name, &r.x_name)
        .or_else(|| differs(&r.x_name, same_all(&e.xs, &r.xs), xs(&e.xs), xs(&r.xs)))
        .or_else(|| differs("workloads", ew == rw, &ew, &rw))
        .or_else(|| differs("budget", e.budget == r.budget, e.budget, r.budget))
        .or_else(|| {
            let (a, b) = (e.requests_per_point, r.requests_per_point);
            differs("requests per point", a == b, a, b)
        })
        .or_else(|| {
            let (a, b) = (e.seconds_per_point, r.seconds_per_point);
            differs("seconds per point", same(a, b), a, b)
        })
        .or_else(|| differs("SLO", same_slo, slo(&e.slo), slo(&r.slo)))
}

fn differs(what: &str, equal: bool, there: impl Display, here: impl Display) -> Option<String> {
    (!equal).then(|| format!("{what} {there} there, {here} here"))
}

/// Equal up to JSON's float round trip.
fn same(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

fn same_all(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(&a, &b)| same(a, b))
}

/// Puts `runs` in the order of `topology::for_budget`, then `peer`, then any other
/// name; runs of equal rank keep their order.
pub fn sort_runs(runs: &mut [TopologyRun], budget: usize) {
    let order: Vec<String> =
        topology::for_budget(budget).map(|all| all.into_iter().map(|t| t.name).collect()).unwrap_or_default();
    runs.sort_by_key(|r| {
        let other = order.len() + usize::from(r.topology.family != Family::Peer);
        order.iter().position(|n| *n == r.topology.name).unwrap_or(other)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::analyze::Analysis;
    use crate::compare::suite::Named;
    use crate::compare::WorkloadRun;

    fn run(t: &Topology, command: &str) -> TopologyRun {
        let workloads = vec![WorkloadRun { workload: Named::Balanced, error: None, points: Vec::new() }];
        TopologyRun { topology: t.clone(), command: Some(command.into()), error: None, workloads }
    }

    fn report(runs: Vec<TopologyRun>) -> CompareReport {
        CompareReport {
            budget: 2,
            model: "m".into(),
            cores: 2,
            x_name: "concurrency".into(),
            xs: vec![1.0, 2.0, 4.0],
            workloads: vec![WorkloadInfo { name: Named::Balanced, description: "d".into() }],
            slo: Slo::default(),
            requests_per_point: 8,
            seconds_per_point: 0.3,
            calibration: None,
            runs,
            analysis: Analysis::default(),
        }
    }

    /// An earlier results.json with every topology of budget 2 and a peer first, read back.
    fn earlier(edit: impl FnOnce(&mut CompareReport)) -> Earlier {
        let mut runs = vec![run(&Topology::peer("http://127.0.0.1:1"), "old peer")];
        runs.extend(topology::for_budget(2).unwrap().iter().map(|t| run(t, &format!("old {}", t.name))));
        let mut old = report(runs);
        edit(&mut old);
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("pdserve-reuse-test-{}-{n}", std::process::id()));
        let path = dir.join("results.json");
        crate::report::json::write(&path, &old).unwrap();
        let e = Earlier::load(&path).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        e
    }

    fn names(runs: &[TopologyRun]) -> Vec<&str> {
        runs.iter().map(|r| r.topology.name.as_str()).collect()
    }

    #[test]
    fn keeps_the_unselected_runs_and_orders_all_of_them_canonically() {
        let selected = topology::select(topology::for_budget(2).unwrap(), &["replicated-rr".into()]).unwrap();
        let mut now = report(Vec::new());
        let reused = merge(&mut now, earlier(|_| ()), &selected).unwrap();
        assert_eq!(reused, vec!["peer", "single", "replicated-ll", "disagg-1p1d", "auto", "auto-planner"]);
        assert_eq!(names(&now.runs), reused);
        now.runs.push(run(&selected[0], "new replicated-rr"));
        sort_runs(&mut now.runs, 2);
        assert_eq!(
            names(&now.runs),
            vec!["single", "replicated-rr", "replicated-ll", "disagg-1p1d", "auto", "auto-planner", "peer"]
        );
        assert_eq!(now.runs[0].command.as_deref(), Some("old single"));
        assert_eq!(now.runs[1].command.as_deref(), Some("new replicated-rr"));
        assert_eq!(now.runs[6].topology.url.as_deref(), Some("http://127.0.0.1:1"));
    }

    #[test]
    fn a_different_sweep_names_its_first_difference() {
        let selected = topology::for_budget(2).unwrap();
        let fail = |edit: fn(&mut CompareReport)| {
            let mut now = report(Vec::new());
            let e = merge(&mut now, earlier(edit), &selected).unwrap_err().to_string();
            assert!(now.runs.is_empty());
            e
        };
        let e = fail(|r| r.xs.push(8.0));
        assert!(
            e.starts_with("--reuse ") && e.ends_with("a different sweep: concurrency 1,2,4,8 there, 1,2,4 here"),
            "{e}"
        );
        let e = fail(|r| {
            r.budget = 3;
            r.slo.ttft_ms = 1.0;
        });
        assert!(e.ends_with(": budget 3 there, 2 here"), "{e}");
        let e = fail(|r| r.slo.tpot_ms = 20.0);
        assert!(e.ends_with("SLO TTFT ≤ 5000 ms and TPOT ≤ 20 ms there, TTFT ≤ 5000 ms and TPOT ≤ 50 ms here"), "{e}");
        let e = fail(|r| r.workloads[0].name = Named::DecodeHeavy);
        assert!(e.ends_with("workloads decode-heavy there, balanced here"), "{e}");
        let e = fail(|r| r.x_name = "rate".into());
        assert!(e.ends_with("sweep rate there, concurrency here"), "{e}");
        let mut now = report(Vec::new());
        assert_eq!(merge(&mut now, earlier(|_| ()), &selected).unwrap(), vec!["peer"]);
    }
}
