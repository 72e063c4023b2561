//! The stdout report of `bench load`, a table of the report module's rows.

use super::LoadReport;
use crate::report::markdown::{floor_cells, header, summary_cells};
use std::fmt::Write;

/// The stdout report of `bench load`.
pub fn load_report(r: &LoadReport) -> String {
    let mut out = String::new();
    let model = r.model.as_deref().unwrap_or("(none)");
    let _ = writeln!(out, "\n## bench load: {} (model {model})\n\nWorkload: {}.", r.url, r.workload);
    if let Some(p) = r.points.first() {
        let slo = p.summary.slo;
        let _ = writeln!(out, "Goodput SLO: TTFT ≤ {} ms and TPOT ≤ {} ms.\n", slo.ttft_ms, slo.tpot_ms);
    }
    out.push_str(&header(&["point"]));
    for p in &r.points {
        let _ = writeln!(out, "| {} | {} |", p.plan.label, summary_cells(&p.summary));
        for ph in &p.phases {
            let _ = writeln!(out, "| {} › {} | {} |", p.plan.label, ph.span.label, summary_cells(&ph.summary));
        }
    }
    for p in &r.points {
        if let Some(h) = p.summary.replies {
            let (label, n, of) = (&p.plan.label, h.generated, h.in_history);
            let _ = writeln!(out, "\n{label}: {n} of the {of} replies in the prompts' histories were generated.");
        }
    }
    if !r.calibration.is_empty() {
        out.push_str("\nClient floor (same points against an instant in-process server):\n\n");
        out.push_str("| point | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | client ms/req |\n|---|---|---|---|---|---|\n");
        for c in &r.calibration {
            let [t50, t99, i50, i99, busy] = floor_cells(&c.summary);
            let _ = writeln!(out, "| {} | {t50} | {t99} | {i50} | {i99} | {busy} |", c.label);
        }
    }
    out
}
