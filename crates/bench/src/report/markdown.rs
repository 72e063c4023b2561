//! Markdown tables: one row per point, the metrics of docs/bench.md; `bench load`
//! and `bench compare` build their reports of these pieces.

use crate::metrics::Summary;
use std::fmt::Write;

/// A number with `d` decimals, or an em dash when there is none.
pub fn num(v: Option<f64>, d: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.d$}"),
        _ => "—".into(),
    }
}

/// A client floor's figures (TTFT p50, p99, ITL p50, p99, client ms per request).
pub fn floor_cells(s: &Summary) -> [String; 5] {
    [s.ttft_ms.p50, s.ttft_ms.p99, s.itl_ms.p50, s.itl_ms.p99, s.client_busy_ms.mean].map(|v| num(v, 3))
}

/// The columns of a summary row (after the row's own label columns).
pub const SUMMARY_HEADER: &str = "req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p99 ms | E2E p50 ms | goodput req/s (SLO %) | client ms/req | reused prompt blocks | ok | failed (shed, timed out)";

/// One summary as table cells.
pub fn summary_cells(s: &Summary) -> String {
    format!(
        "{} | {} | {} | {} | {} | {} | {} | {} | {} ({}) | {} | {} | {} | {} ({}, {})",
        num(Some(s.request_throughput), 2),
        num(Some(s.output_token_throughput), 1),
        num(s.ttft_ms.p50, 0),
        num(s.ttft_ms.p99, 0),
        num(s.tpot_ms.p50, 1),
        num(s.tpot_ms.p99, 1),
        num(s.itl_ms.p99, 1),
        num(s.e2e_ms.p50, 0),
        num(Some(s.goodput), 2),
        num(Some(s.slo_attainment_pct), 0),
        num(s.client_busy_ms.mean, 3),
        reuse(s),
        s.ok,
        s.failed,
        s.shed,
        s.timed_out
    )
}

/// `R/B (P %)`: prompt blocks sent earlier in the run, of all the point's blocks.
fn reuse(s: &Summary) -> String {
    let b = s.prompt_blocks;
    format!("{}/{} ({:.0} %)", b.reused, b.blocks, b.percent())
}

/// `| a | b |` header and separator for `labels` followed by the summary columns.
pub fn header(labels: &[&str]) -> String {
    let cols = labels.len() + SUMMARY_HEADER.split(" | ").count();
    format!("| {} | {SUMMARY_HEADER} |\n|{}\n", labels.join(" | "), "---|".repeat(cols))
}

/// The progress log line printed after each point.
pub fn one_line(label: &str, s: &Summary, wall_s: f64) -> String {
    let mut line = format!(
        "{label}: {} ok, {} failed ({} shed, {} timed out) in {wall_s:.1} s; {} req/s, {} out tok/s, TTFT p50/p99 {}/{} ms, TPOT p50/p99 {}/{} ms, goodput {} req/s ({}%)",
        s.ok,
        s.failed,
        s.shed,
        s.timed_out,
        num(Some(s.request_throughput), 2),
        num(Some(s.output_token_throughput), 1),
        num(s.ttft_ms.p50, 0),
        num(s.ttft_ms.p99, 0),
        num(s.tpot_ms.p50, 1),
        num(s.tpot_ms.p99, 1),
        num(Some(s.goodput), 2),
        num(Some(s.slo_attainment_pct), 0),
    );
    let _ = write!(line, "; prompt blocks sent before: {}", reuse(s));
    if let Some(r) = s.replies {
        let _ = write!(line, "; replies in the history: {} of {} generated", r.generated, r.in_history);
    }
    if let Some(h) = s.prefix_hits {
        let pct = h.realized_pct().map_or("-".to_string(), |p| format!("{p:.1} %"));
        let _ = write!(line, "; cached tokens predicted/realized {:.0}/{:.0} ({pct})", h.predicted, h.realized);
        if h.from_host + h.from_disk > 0.0 {
            let _ = write!(line, ", of which from host RAM {:.0}, from disk {:.0}", h.from_host, h.from_disk);
        }
        if h.fetched > 0.0 {
            let _ = write!(line, ", fetched from peers {:.0}", h.fetched);
        }
    }
    if let Some(sp) = s.speculation {
        let pct = sp.accepted_pct().map_or("-".to_string(), |p| format!("{p:.1} %"));
        let _ = write!(line, "; drafted tokens verified/accepted {:.0}/{:.0} ({pct})", sp.drafted, sp.accepted);
    }
    if let Some(e) = &s.first_error {
        let _ = write!(line, "; first error: {e}");
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Slo;
    use crate::record::RequestRecord;

    #[test]
    fn rows_have_as_many_cells_as_the_header() {
        let s = Summary::of(&[RequestRecord::succeeded(0, 0.0, vec![0.1, 0.2], 2, 0.3)], Slo::default());
        let h = header(&["topology", "C"]);
        let row = format!("| x | 1 | {} |", summary_cells(&s));
        let count = |l: &str| l.matches('|').count();
        let lines: Vec<&str> = h.lines().collect();
        assert_eq!(count(lines[0]), count(&row));
        assert_eq!(count(lines[1]), count(&row));
        assert_eq!(num(None, 2), "—");
        assert_eq!(num(Some(1.234), 1), "1.2");
        assert!(one_line("C=1", &s, 1.0).contains("1 ok, 0 failed (0 shed, 0 timed out)"));
    }
}
