//! results.md of `bench compare`: set-up, one table per workload, crossovers, ratios,
//! the client floor and the plots.

use super::CompareReport;
use crate::report::markdown::{floor_cells, header, num, summary_cells};
use std::fmt::Write;
use std::path::PathBuf;

/// The whole Markdown report.
pub fn render(r: &CompareReport, plots: &[PathBuf]) -> String {
    let mut s = String::new();
    setup(&mut s, r);
    tables(&mut s, r);
    crossovers(&mut s, r);
    ratios(&mut s, r);
    floor(&mut s, r);
    if !plots.is_empty() {
        s.push_str("\n### Plots\n\n");
        for p in plots {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let _ = writeln!(s, "- [{name}](plots/{name})");
        }
    }
    s
}

fn setup(s: &mut String, r: &CompareReport) {
    let _ = writeln!(s, "## bench compare: budget {} threads, model {}, {} cores\n", r.budget, r.model, r.cores);
    let _ = writeln!(
        s,
        "Each point: up to {} requests or {} s (closed loop: at least 2 × concurrency requests). Goodput SLO: TTFT ≤ {} ms and TPOT ≤ {} ms.\n",
        r.requests_per_point, r.seconds_per_point, r.slo.ttft_ms, r.slo.tpot_ms
    );
    s.push_str("| topology | command |\n|---|---|\n");
    for run in &r.runs {
        let cmd = match (&run.command, &run.topology.url) {
            (Some(c), _) => format!("`{c}`"),
            (None, Some(u)) => format!("external server at {u}"),
            (None, None) => "not started".into(),
        };
        let status = run.error.as_ref().map(|e| format!(" — **failed**: {e}")).unwrap_or_default();
        let _ = writeln!(s, "| {} | {cmd}{status} |", run.topology.name);
    }
    s.push('\n');
    for w in &r.workloads {
        let _ = writeln!(s, "- **{}**: {}", w.name.name(), w.description);
    }
}

fn tables(s: &mut String, r: &CompareReport) {
    let x = if r.x_name == "rate" { "rate" } else { "C" };
    for w in r.workloads.iter().map(|i| &i.name) {
        let _ = write!(s, "\n### {}\n\n{}", w.name(), header(&["topology", x]));
        for run in &r.runs {
            let Some(wr) = run.workloads.iter().find(|wr| wr.workload == *w) else { continue };
            if let Some(e) = &wr.error {
                let _ = writeln!(s, "| {} | — | failed: {e} |", run.topology.name);
            }
            for p in &wr.points {
                let xv = p.plan.x().map_or("—".into(), |v| format!("{v}"));
                let _ = writeln!(s, "| {} | {xv} | {} |", run.topology.name, summary_cells(&p.summary));
            }
        }
    }
}

fn crossovers(s: &mut String, r: &CompareReport) {
    if r.analysis.crossovers.is_empty() {
        return;
    }
    let x = if r.x_name == "rate" { "rate" } else { "C" };
    s.push_str("\n### Crossover: where the best disaggregated topology overtakes the best replicated one for good\n\n");
    s.push_str("| workload | metric | crossover |\n|---|---|---|\n");
    for c in &r.analysis.crossovers {
        let _ = writeln!(s, "| {} | {} | {} |", c.workload, c.metric.label(), c.describe(x));
    }
}

fn ratios(s: &mut String, r: &CompareReport) {
    let a = &r.analysis;
    if !a.family_ratios.is_empty() {
        s.push_str("\n### Disaggregated ÷ replicated (best of each), from C = 8\n\n");
        s.push_str("| workload | point | p99 ITL ratio (< 1: disaggregated better) | goodput ratio (> 1: disaggregated better) |\n|---|---|---|---|\n");
        for f in &a.family_ratios {
            let _ =
                writeln!(s, "| {} | {} | {} | {} |", f.workload, f.x, num(f.itl_p99_ratio, 2), num(f.goodput_ratio, 2));
        }
    }
    if !a.auto_vs_best.is_empty() {
        s.push_str("\n### auto and auto-planner as % of the best of replicated and disaggregated\n\n");
        s.push_str("| workload | point | auto: output throughput % | auto: goodput % | planner: output throughput % | planner: goodput % |\n|---|---|---|---|---|---|\n");
        for v in &a.auto_vs_best {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                v.workload,
                v.x,
                num(v.throughput_pct, 0),
                num(v.goodput_pct, 0),
                num(v.planner_throughput_pct, 0),
                num(v.planner_goodput_pct, 0)
            );
        }
    }
}

fn floor(s: &mut String, r: &CompareReport) {
    let Some(c) = &r.calibration else { return };
    let [t50, t99, i50, i99, busy] = floor_cells(&c.summary);
    let _ = writeln!(
        s,
        "\n### Client overhead\n\nAgainst an instant in-process server ({}): TTFT p50/p99 {t50}/{t99} ms, ITL p50/p99 {i50}/{i99} ms, client busy {busy} ms per request (mean).",
        c.label
    );
}
