//! `bench compare --sim`: the simulator's prediction of every topology a comparison
//! measured, with the same workloads, points, seed and objectives, and the errors
//! point by point: how far to trust the twin on this machine, from one command.

use crate::profile::Profile;
use crate::sim::{simulate, SimSpec, Topology};
use crate::TwinError;
use pdserve_bench::compare::{CompareOptions, CompareReport, TopologyRun, WorkloadRun};
use pdserve_bench::load::{plans, PointResult};
use pdserve_bench::metrics::Summary;
use pdserve_bench::point::PointPlan;
use pdserve_bench::topology::Topology as Served;

/// Simulates every topology `report` measured (not a peer, not one that failed to
/// start). `topology` reads a served topology's arguments as the simulator's; a
/// topology it cannot read is kept with its error.
pub fn predict(
    profile: &Profile,
    opts: &CompareOptions,
    report: &CompareReport,
    topology: &dyn Fn(&Served) -> Result<Topology, String>,
) -> Result<Vec<TopologyRun>, TwinError> {
    let plans = plans(&opts.sweep, opts.requests_per_point, opts.seconds_per_point, None)
        .map_err(|e| TwinError::Invalid(e.to_string()))?;
    let mut out = Vec::new();
    for run in report.runs.iter().filter(|r| r.topology.url.is_none() && r.error.is_none()) {
        let served = &run.topology;
        let mut predicted = TopologyRun { topology: served.clone(), command: None, error: None, workloads: Vec::new() };
        match topology(served) {
            Ok(t) => {
                predicted.command = Some(format!("pdserve sim {}", served.serve_args.join(" ")));
                for measured in &run.workloads {
                    let w = measured.workload.workload(opts.seed, opts.range);
                    let labelled: Vec<PointPlan> = plans
                        .iter()
                        .map(|p| PointPlan { label: format!("sim {} {}", served.name, p.label), ..p.clone() })
                        .collect();
                    let spec = SimSpec {
                        profile,
                        topology: t.clone(),
                        workload: &w,
                        plans: &labelled,
                        slo: opts.slo,
                        warmup: opts.warmup,
                    };
                    let points = simulate(&spec)?;
                    predicted.workloads.push(WorkloadRun { workload: measured.workload, error: None, points });
                }
            }
            Err(e) => predicted.error = Some(e),
        }
        out.push(predicted);
    }
    Ok(out)
}

/// One measured point and its prediction.
struct Pair<'a> {
    topology: &'a str,
    workload: String,
    point: String,
    measured: &'a Summary,
    predicted: &'a Summary,
}

/// Reads one measure from a summary.
type Read = fn(&Summary) -> Option<f64>;

/// The measures compared.
const MEASURES: [(&str, Read); 5] = [
    ("goodput req/s", |s| Some(s.goodput)),
    ("output tok/s", |s| Some(s.output_token_throughput)),
    ("TTFT mean ms", |s| s.ttft_ms.mean),
    ("TTFT p90 ms", |s| s.ttft_ms.p90),
    ("TPOT p50 ms", |s| s.tpot_ms.p50),
];

fn pairs<'a>(measured: &'a [TopologyRun], predicted: &'a [TopologyRun]) -> Vec<Pair<'a>> {
    let mut out = Vec::new();
    for p in predicted {
        let Some(m) = measured.iter().find(|m| m.topology.name == p.topology.name) else { continue };
        for (mw, pw) in m.workloads.iter().zip(&p.workloads) {
            for (mp, pp) in mw.points.iter().zip(&pw.points) {
                out.push(Pair {
                    topology: &p.topology.name,
                    workload: mw.workload.name().to_string(),
                    point: point_label(mp),
                    measured: &mp.summary,
                    predicted: &pp.summary,
                });
            }
        }
    }
    out
}

fn point_label(p: &PointResult) -> String {
    p.plan.label.rsplit(' ').next().unwrap_or_default().to_string()
}

/// Relative error of `predicted` against `measured`, when both exist and the
/// measurement is not zero.
fn error(measured: Option<f64>, predicted: Option<f64>) -> Option<f64> {
    match (measured, predicted) {
        (Some(m), Some(p)) if m.abs() > 1e-12 => Some((p - m) / m),
        _ => None,
    }
}

/// The table of every point, measured against predicted, then the median absolute
/// error of each measure and how well the predictions rank the topologies.
pub fn markdown(measured: &[TopologyRun], predicted: &[TopologyRun]) -> String {
    let pairs = pairs(measured, predicted);
    let mut s = String::from("| topology | workload | point |");
    for (name, _) in MEASURES {
        s += &format!(" {name}: measured / predicted (error) |");
    }
    s += "\n|---|---|---|";
    s += &"---|".repeat(MEASURES.len());
    s.push('\n');
    for p in &pairs {
        s += &format!("| {} | {} | {} |", p.topology, p.workload, p.point);
        for (_, read) in MEASURES {
            let (m, q) = (read(p.measured), read(p.predicted));
            let e = error(m, q).map_or(String::new(), |e| format!(" ({:+.0} %)", e * 100.0));
            s += &format!(" {} / {}{e} |", fmt(m), fmt(q));
        }
        s.push('\n');
    }
    s += "\nMedian absolute error:";
    for (name, read) in MEASURES {
        let errs: Vec<f64> =
            pairs.iter().filter_map(|p| error(read(p.measured), read(p.predicted))).map(f64::abs).collect();
        match median(errs) {
            Some(e) => s += &format!(" {name} {:.1} %;", e * 100.0),
            None => s += &format!(" {name} —;"),
        }
    }
    s.pop();
    s += ".\n";
    for p in predicted {
        if let Some(e) = &p.error {
            s += &format!("\n{}: not simulated ({e})\n", p.topology.name);
        }
    }
    s += &rank_summary(&pairs);
    s
}

/// Per workload and point, whether the topology predicted best is the best measured
/// (the measured goodput of the predicted best against the measured best) and
/// Spearman's ρ between predicted and measured goodput across the topologies.
fn rank_summary(pairs: &[Pair<'_>]) -> String {
    let mut groups: Vec<(&str, &str)> = pairs.iter().map(|p| (p.workload.as_str(), p.point.as_str())).collect();
    groups.sort();
    groups.dedup();
    let (mut rhos, mut reached) = (Vec::new(), Vec::new());
    for (w, x) in groups {
        let cands: Vec<&Pair<'_>> = pairs.iter().filter(|p| p.workload == w && p.point == x).collect();
        if cands.len() < 2 {
            continue;
        }
        let m: Vec<f64> = cands.iter().map(|p| p.measured.goodput).collect();
        let q: Vec<f64> = cands.iter().map(|p| p.predicted.goodput).collect();
        let best_m = m.iter().copied().fold(0.0, f64::max);
        let pick = (0..q.len()).max_by(|&a, &b| q[a].total_cmp(&q[b])).unwrap_or(0);
        if best_m > 0.0 {
            reached.push(m[pick] / best_m);
        }
        if let Some(r) = spearman(&m, &q) {
            rhos.push(r);
        }
    }
    if reached.is_empty() {
        return String::new();
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let worst = reached.iter().copied().fold(1.0, f64::min);
    let rho = if rhos.is_empty() { "—".to_string() } else { format!("{:.2}", mean(&rhos)) };
    format!(
        "\nRanking, per workload and point: the predicted best topology reaches {:.0} % of the measured best's goodput on average ({:.0} % at worst); mean Spearman ρ between predicted and measured goodput {rho}.\n",
        mean(&reached) * 100.0,
        worst * 100.0
    )
}

fn fmt(v: Option<f64>) -> String {
    match v {
        Some(x) if x.abs() >= 100.0 => format!("{x:.0}"),
        Some(x) if x.abs() >= 1.0 => format!("{x:.2}"),
        Some(x) => format!("{x:.3}"),
        None => "—".into(),
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// Ranks of `v`, ties sharing their mean rank.
fn ranks(v: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
    let mut r = vec![0.0; v.len()];
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && v[order[j + 1]] == v[order[i]] {
            j += 1;
        }
        for &k in &order[i..=j] {
            r[k] = (i + j) as f64 / 2.0;
        }
        i = j + 1;
    }
    r
}

/// Spearman's ρ (Pearson's on the ranks); `None` when either side is constant.
fn spearman(a: &[f64], b: &[f64]) -> Option<f64> {
    let (ra, rb) = (ranks(a), ranks(b));
    let n = ra.len() as f64;
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let cov: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = ra.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = rb.iter().map(|y| (y - mb).powi(2)).sum();
    (va > 0.0 && vb > 0.0).then(|| cov / (va * vb).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spearman_of_orders_and_ties() {
        assert_eq!(spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 30.0]), Some(1.0));
        assert_eq!(spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]), Some(-1.0));
        assert_eq!(spearman(&[1.0, 1.0, 1.0], &[1.0, 2.0, 3.0]), None);
        assert_eq!(ranks(&[5.0, 1.0, 5.0]), vec![1.5, 0.0, 1.5]);
        assert_eq!(median(vec![3.0, 1.0, 2.0, 10.0]), Some(2.5));
        assert_eq!(error(Some(2.0), Some(2.5)), Some(0.25));
        assert_eq!(error(Some(0.0), Some(1.0)), None);
    }
}
