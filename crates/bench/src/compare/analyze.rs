//! From the raw comparison to its conclusions: crossovers per workload × metric, the
//! disaggregated/replicated ratios from C ≥ 8, and auto against the better family.

use super::suite::Named;
use super::CompareReport;
use crate::analysis::crossover::{crossover, Crossover};
use crate::analysis::metric::Metric;
use crate::analysis::ratios::{auto_pct, ratio, AutoVsBest, FamilyRatio};
use crate::topology::Family;

/// The ratios are reported from this sweep value on (the "C ≥ 8").
pub const RATIO_FROM: f64 = 8.0;

/// Everything concluded from a comparison.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Analysis {
    pub crossovers: Vec<Crossover>,
    pub family_ratios: Vec<FamilyRatio>,
    pub auto_vs_best: Vec<AutoVsBest>,
}

impl CompareReport {
    /// A metric of one topology at one point, if measured.
    pub fn value(&self, topology: &str, w: Named, x: f64, m: Metric) -> Option<f64> {
        let run = self.runs.iter().find(|r| r.topology.name == topology)?;
        let wr = run.workloads.iter().find(|r| r.workload == w)?;
        let p = wr.points.iter().find(|p| p.plan.x() == Some(x))?;
        m.value(&p.summary)
    }

    /// The best value of a family at one point.
    pub fn best(&self, family: Family, w: Named, x: f64, m: Metric) -> Option<f64> {
        let names = self.runs.iter().filter(|r| r.topology.family == family).map(|r| r.topology.name.as_str());
        m.best(names.map(|n| self.value(n, w, x, m)))
    }

    /// `(x, value)` of one topology across the sweep, for plots.
    pub fn series(&self, topology: &str, w: Named, m: Metric) -> Vec<(f64, Option<f64>)> {
        self.xs.iter().map(|&x| (x, self.value(topology, w, x, m))).collect()
    }

    fn has(&self, family: Family) -> bool {
        self.runs.iter().any(|r| r.topology.family == family)
    }
}

impl Analysis {
    pub fn of(r: &CompareReport) -> Self {
        let mut a = Self::default();
        let both = r.has(Family::Disaggregated) && r.has(Family::Replicated);
        for w in r.workloads.iter().map(|i| i.name) {
            if both {
                for m in Metric::CROSSOVER {
                    let pts: Vec<_> =
                        r.xs.iter()
                            .map(|&x| (x, r.best(Family::Disaggregated, w, x, m), r.best(Family::Replicated, w, x, m)))
                            .collect();
                    a.crossovers.push(Crossover { workload: w.name().into(), metric: m, at: crossover(m, &pts) });
                }
                a.family_ratios.extend(family_ratios(r, w));
            }
            if r.has(Family::Auto) || r.has(Family::Planner) {
                a.auto_vs_best.extend(auto_vs_best(r, w));
            }
        }
        a
    }
}

fn family_ratios(r: &CompareReport, w: Named) -> Vec<FamilyRatio> {
    let f = |fam, x, m| r.best(fam, w, x, m);
    r.xs.iter()
        .filter(|&&x| x >= RATIO_FROM)
        .map(|&x| FamilyRatio {
            workload: w.name().into(),
            x,
            itl_p99_ratio: ratio(f(Family::Disaggregated, x, Metric::ItlP99), f(Family::Replicated, x, Metric::ItlP99)),
            goodput_ratio: ratio(
                f(Family::Disaggregated, x, Metric::Goodput),
                f(Family::Replicated, x, Metric::Goodput),
            ),
        })
        .collect()
}

fn auto_vs_best(r: &CompareReport, w: Named) -> Vec<AutoVsBest> {
    let pct = |family, x, m| {
        let auto = r.best(family, w, x, m);
        auto_pct(auto, r.best(Family::Replicated, w, x, m), r.best(Family::Disaggregated, w, x, m))
    };
    r.xs.iter()
        .map(|&x| AutoVsBest {
            workload: w.name().into(),
            x,
            throughput_pct: pct(Family::Auto, x, Metric::Throughput),
            goodput_pct: pct(Family::Auto, x, Metric::Goodput),
            planner_throughput_pct: pct(Family::Planner, x, Metric::Throughput),
            planner_goodput_pct: pct(Family::Planner, x, Metric::Goodput),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::{TopologyRun, WorkloadInfo, WorkloadRun};
    use crate::load::{PointResult, Sweep};
    use crate::metrics::{Slo, Summary};
    use crate::topology::Topology;

    const XS: [usize; 5] = [1, 2, 4, 8, 16];

    /// A point with the given output throughput, goodput and p99 ITL.
    fn point(x: usize, tput: f64, goodput: f64, itl: f64) -> PointResult {
        let plan = crate::load::plans(&Sweep::Concurrency(vec![x]), 1, 1.0, None).unwrap().remove(0);
        let mut summary = Summary { output_token_throughput: tput, goodput, ..Summary::default() };
        summary.itl_ms.p99 = Some(itl);
        summary.ttft_ms.p99 = Some(1000.0 / tput);
        summary.tpot_ms.p99 = Some(itl);
        summary.ttft_ms.p50 = Some(500.0 / tput);
        summary.tpot_ms.p50 = Some(itl / 2.0);
        PointResult {
            plan,
            summary,
            phases: Vec::new(),
            records: Vec::new(),
            started_unix_s: None,
            switches: Vec::new(),
        }
    }

    fn run(name: &str, family: Family, values: [(f64, f64, f64); 5]) -> TopologyRun {
        let points = XS.iter().zip(values).map(|(&x, (t, g, i))| point(x, t, g, i)).collect();
        TopologyRun {
            topology: Topology { name: name.into(), family, serve_args: Vec::new(), url: None },
            command: None,
            error: None,
            workloads: vec![WorkloadRun { workload: Named::PrefillHeavy, error: None, points }],
        }
    }

    fn report() -> CompareReport {
        CompareReport {
            budget: 2,
            model: "m".into(),
            cores: 2,
            x_name: "concurrency".into(),
            xs: XS.map(|x| x as f64).to_vec(),
            workloads: vec![WorkloadInfo { name: Named::PrefillHeavy, description: "d".into() }],
            slo: Slo::default(),
            requests_per_point: 1,
            seconds_per_point: 1.0,
            calibration: None,
            runs: vec![
                // (throughput, goodput, ITL p99) at C = 1, 2, 4, 8, 16.
                run("replicated-rr", Family::Replicated, [(100.0, 2.0, 10.0); 5]),
                run(
                    "replicated-ll",
                    Family::Replicated,
                    [
                        (110.0, 2.0, 9.0),
                        (120.0, 2.0, 20.0),
                        (130.0, 1.0, 40.0),
                        (130.0, 0.5, 80.0),
                        (130.0, 0.1, 160.0),
                    ],
                ),
                run(
                    "disagg-1p1d",
                    Family::Disaggregated,
                    [(90.0, 1.0, 12.0), (100.0, 1.5, 12.0), (120.0, 2.5, 8.0), (125.0, 2.5, 8.0), (140.0, 2.5, 9.0)],
                ),
                run(
                    "auto",
                    Family::Auto,
                    [(110.0, 2.0, 9.0), (120.0, 2.0, 10.0), (130.0, 2.5, 8.0), (130.0, 2.5, 8.0), (70.0, 1.25, 9.0)],
                ),
            ],
            analysis: Analysis::default(),
        }
    }

    #[test]
    fn crossovers_compare_the_best_of_each_family() {
        let a = Analysis::of(&report());
        let at = |m: Metric| a.crossovers.iter().find(|c| c.metric == m).unwrap().at;
        // Best replicated throughput 110, 120, 130, 130, 130; disaggregated wins only at 16.
        assert_eq!(at(Metric::Throughput), Some(16.0));
        // Best replicated goodput 2, 2, 2, 2, 2 (round-robin); disaggregated from 4 on.
        assert_eq!(at(Metric::Goodput), Some(4.0));
        // Best replicated ITL p99 9, 10, 10, 10, 10; disaggregated 12, 12, 8, 8, 9.
        assert_eq!(at(Metric::ItlP99), Some(4.0));
        // TTFT p99 = 1000 / throughput here, so it follows throughput.
        assert_eq!(at(Metric::TtftP99), Some(16.0));
        assert_eq!(a.crossovers.len(), Metric::CROSSOVER.len());
    }

    #[test]
    fn ratios_from_c8_and_auto_against_the_better_family() {
        let a = Analysis::of(&report());
        let xs: Vec<f64> = a.family_ratios.iter().map(|f| f.x).collect();
        assert_eq!(xs, vec![8.0, 16.0]);
        assert_eq!(a.family_ratios[0].itl_p99_ratio, Some(0.8));
        assert_eq!(a.family_ratios[1].goodput_ratio, Some(1.25));
        let auto16 = a.auto_vs_best.iter().find(|v| v.x == 16.0).unwrap();
        assert_eq!((auto16.throughput_pct, auto16.goodput_pct), (Some(50.0), Some(50.0)));
        assert_eq!(a.auto_vs_best.iter().find(|v| v.x == 1.0).unwrap().throughput_pct, Some(100.0));
    }

    #[test]
    fn plots_and_markdown_cover_every_topology() {
        let mut r = report();
        r.analysis = Analysis::of(&r);
        let plots = crate::compare::plots::render_all(&r);
        assert_eq!(plots.len(), Metric::PLOTTED.len());
        assert!(plots.iter().any(|(name, _)| name == "prefill-heavy-ttft-p99.svg"));
        for (_, doc) in &plots {
            assert_eq!(doc.matches("<polyline").count(), 4);
        }
        let md = crate::compare::markdown::render(&r, &[]);
        assert!(md.contains("| prefill-heavy | goodput (requests/s within SLO) | C=4 |"), "{md}");
        assert!(md.contains("| prefill-heavy | 8 | 0.80 | 1.25 |"), "{md}");
        assert_eq!(md.matches("| auto | ").count(), 6, "{md}");
    }
}
