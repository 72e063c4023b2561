//! `pdserve plan`: the advisor. For N nodes of a profile's worker shape it simulates
//! every topology — one node alone, all aggregated, every prefill:decode split, and
//! mixed workers under the planner — at each concurrency of a sweep, ranks them by predicted
//! goodput, and says in one sentence when to disaggregate.

use crate::group::{loopback, node_bytes, GroupShape, StageLink};
use crate::profile::Profile;
use crate::sim::{simulate, SimSpec, Topology};
use crate::TwinError;
use pdserve_bench::analysis::crossover::crossover;
use pdserve_bench::analysis::metric::Metric;
use pdserve_bench::load::{plans, Sweep};
use pdserve_bench::metrics::Slo;
use pdserve_bench::report::svg::{LinePlot, Series};
use pdserve_bench::workload::Workload;
use pdserve_engine::tiers::TierConfig;
use pdserve_kv_transfer::TransportKind;
use pdserve_planner::model;
use pdserve_router::{Admission, Mode, PolicyKind};
use pdserve_types::Role;
use pdserve_worker::LinkModel;
use serde::Serialize;

/// What to plan for.
pub struct PlanSpec<'a> {
    pub profile: &'a Profile,
    /// Nodes, one worker each, each on its own machine of the profile's shape.
    pub nodes: usize,
    /// Compute threads per node (a shape of the profile).
    pub threads: usize,
    pub workload: &'a Workload,
    pub concurrency: Vec<usize>,
    /// Requests per point at least (a point also sends at least 4 × its concurrency).
    pub requests: usize,
    pub slo: Slo,
    /// How KV moves between nodes.
    pub via: TransportKind,
    /// Plan stage groups too, their stages joined by this link.
    pub stage_link: Option<StageLink>,
    /// Bytes of memory a node has for the model's weights and its cache (default:
    /// the weights and the profile's blocks).
    pub node_memory: Option<f64>,
}

/// One topology's predictions.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub name: String,
    pub disaggregated: bool,
    /// Stages per worker (1: each holds the whole model).
    pub stages: usize,
    pub points: Vec<Predicted>,
    /// The best goodput over the sweep: what the ranking goes by.
    pub best_goodput: f64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Predicted {
    pub concurrency: usize,
    pub goodput: f64,
    pub slo_attainment_pct: f64,
    pub output_token_throughput: f64,
    pub ttft_p90_ms: Option<f64>,
    pub tpot_p50_ms: Option<f64>,
}

/// The advice.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub nodes: usize,
    pub threads: usize,
    pub workload: String,
    pub slo: Slo,
    /// Best first.
    pub candidates: Vec<Candidate>,
    /// The concurrency from which the best split beats all-aggregated for good.
    pub crossover: Option<usize>,
    pub decision: String,
}

/// Simulates every topology of `spec.nodes` nodes over the sweep.
pub fn plan(spec: &PlanSpec<'_>) -> Result<Plan, TwinError> {
    if spec.nodes == 0 || spec.concurrency.is_empty() {
        return Err(TwinError::Invalid("plan needs at least one node and one concurrency".into()));
    }
    let mut candidates = Vec::new();
    for (name, topology) in topologies(spec)? {
        let disaggregated = topology.mode == Mode::Disaggregated;
        let stages = topology.group.map_or(1, |g| g.stages);
        let mut points = Vec::new();
        for &c in &spec.concurrency {
            let n = spec.requests.max(4 * c);
            let plans = plans(&Sweep::Concurrency(vec![c]), n, 3600.0, None).map_err(invalid)?;
            let sim = SimSpec {
                profile: spec.profile,
                topology: topology.clone(),
                workload: spec.workload,
                plans: &plans,
                slo: spec.slo,
                warmup: 0,
            };
            let s = simulate(&sim)?.remove(0).summary;
            points.push(Predicted {
                concurrency: c,
                goodput: s.goodput,
                slo_attainment_pct: s.slo_attainment_pct,
                output_token_throughput: s.output_token_throughput,
                ttft_p90_ms: s.ttft_ms.p90,
                tpot_p50_ms: s.tpot_ms.p50,
            });
        }
        let best_goodput = points.iter().map(|p| p.goodput).fold(0.0, f64::max);
        candidates.push(Candidate { name, disaggregated, stages, points, best_goodput });
    }
    candidates.sort_by(|a, b| b.best_goodput.total_cmp(&a.best_goodput));
    let crossover = crossover_of(&candidates, &spec.concurrency);
    let mut decision = decide(&candidates, crossover, spec);
    if let Some(link) = spec.stage_link {
        decision = format!("{decision} {}", decide_split(&candidates, link));
    }
    Ok(Plan {
        nodes: spec.nodes,
        threads: spec.threads,
        workload: spec.workload.describe(),
        slo: spec.slo,
        candidates,
        crossover,
        decision,
    })
}

fn invalid(e: impl std::fmt::Display) -> TwinError {
    TwinError::Invalid(e.to_string())
}

/// All aggregated, one node alone, every split, and mixed workers under the planner;
/// with a stage link, groups of every size that divides the nodes. Where the model
/// does not fit one node, only the groups whose stages fit.
fn topologies(spec: &PlanSpec<'_>) -> Result<Vec<(String, Topology)>, TwinError> {
    let n = spec.nodes;
    let mut out = Vec::new();
    let memory = Memory::of(spec)?;
    if memory.as_ref().is_none_or(|m| m.blocks(1).is_some()) {
        out = whole_topologies(spec, memory.as_ref().and_then(|m| m.blocks(1)));
    }
    if let (Some(link), Some(m)) = (spec.stage_link, memory) {
        for k in (2..=n).filter(|&k| n.is_multiple_of(k)) {
            let group = GroupShape { stages: k, link: link.model(m.loopback), cores: None };
            let Some(blocks) = group.kv_blocks(m.node, m.weights, m.block) else { continue };
            let roles = vec![Role::Mixed; n / k];
            let t = Topology { group: Some(group), ..topology(spec, Mode::Aggregated, roles, Some(blocks)) };
            out.push((format!("aggregated ×{} of {k}-stage groups ({})", n / k, link.name()), t));
        }
    }
    if out.is_empty() {
        return Err(TwinError::Invalid(match spec.stage_link {
            Some(_) => "the model's weights do not fit the nodes, split as far as they go".into(),
            None => "the model's weights do not fit one node: give a stage link to plan stage groups".into(),
        }));
    }
    Ok(out)
}

/// A node's memory, in the terms a split needs.
struct Memory {
    node: f64,
    weights: f64,
    block: f64,
    loopback: LinkModel,
}

impl Memory {
    /// `None` where neither groups nor a node's memory were asked about.
    fn of(spec: &PlanSpec<'_>) -> Result<Option<Memory>, TwinError> {
        if spec.stage_link.is_none() && spec.node_memory.is_none() {
            return Ok(None);
        }
        let (node, weights, block) = node_bytes(spec.profile, spec.node_memory)?;
        let loopback = match spec.stage_link {
            Some(_) => loopback(spec.profile)?,
            None => LinkModel { latency_s: 0.0, bytes_per_s: 1.0 },
        };
        Ok(Some(Memory { node, weights, block, loopback }))
    }

    /// Blocks a worker of `stages` stages holds.
    fn blocks(&self, stages: usize) -> Option<usize> {
        let g = GroupShape { stages, link: self.loopback, cores: None };
        g.kv_blocks(self.node, self.weights, self.block)
    }
}

/// A topology of the plan's nodes, `kv_blocks` per worker (`None`: the profile's).
fn topology(spec: &PlanSpec<'_>, mode: Mode, roles: Vec<Role>, kv_blocks: Option<usize>) -> Topology {
    Topology {
        mode,
        roles,
        policy: PolicyKind::default(),
        threads: spec.threads,
        kv_blocks,
        via: spec.via,
        planner: None,
        objectives: None,
        shared_machine: false,
        prefix_fetch: true,
        group: None,
        tiers: TierConfig::default(),
        admission: Admission::default(),
    }
}

/// The topologies of workers that each hold the whole model.
fn whole_topologies(spec: &PlanSpec<'_>, kv_blocks: Option<usize>) -> Vec<(String, Topology)> {
    let n = spec.nodes;
    let base = |mode, roles: Vec<Role>| topology(spec, mode, roles, kv_blocks);
    let mut out = vec![(format!("aggregated ×{n}"), base(Mode::Aggregated, vec![Role::Mixed; n]))];
    if n > 1 {
        // One node alone: what adding the others buys.
        out.push(("single node".into(), base(Mode::Aggregated, vec![Role::Mixed])));
    }
    for p in 1..n {
        let mut roles = vec![Role::Prefill; p];
        roles.extend(vec![Role::Decode; n - p]);
        out.push((format!("{p}P:{}D", n - p), base(Mode::Disaggregated, roles)));
    }
    if n > 1 {
        let slo = model::Slo::from_ms(spec.slo.ttft_ms, spec.slo.tpot_ms);
        let t = Topology { planner: Some(slo), ..base(Mode::Auto, vec![Role::Mixed; n]) };
        out.push((format!("{n} mixed + planner"), t));
    }
    out
}

/// Where the best split's goodput overtakes every other plan for good. A point where
/// nothing reaches 2 % of the best goodput seen anywhere beats nothing.
fn crossover_of(cands: &[Candidate], sweep: &[usize]) -> Option<usize> {
    let floor = 0.02 * cands.iter().map(|c| c.best_goodput).fold(0.0, f64::max);
    let best = |disagg: bool, i: usize| best_at(cands, disagg, i).filter(|&g| g >= floor);
    let points: Vec<(f64, Option<f64>, Option<f64>)> =
        sweep.iter().enumerate().map(|(i, &c)| (c as f64, best(true, i), best(false, i))).collect();
    crossover(Metric::Goodput, &points).map(|x| x as usize)
}

/// The advice in one sentence.
fn decide(cands: &[Candidate], crossover: Option<usize>, spec: &PlanSpec<'_>) -> String {
    let (lo, hi) = (spec.concurrency.iter().min().unwrap_or(&1), spec.concurrency.iter().max().unwrap_or(&1));
    let top = cands.first().map_or("nothing", |c| c.name.as_str());
    let best_split = crossover.and_then(|c| split_from(cands, c));
    match (crossover, best_split) {
        (Some(c), Some(split)) if c == *lo => {
            format!("Disaggregate ({split}) at every concurrency from {lo} to {hi}; the top plan overall is {top}.")
        }
        (Some(c), Some(split)) => format!(
            "Disaggregate ({split}) when {c} or more requests run at once; below that stay aggregated. \
             The top plan overall is {top}."
        ),
        _ => match ahead_at(cands) {
            None => format!("Do not disaggregate: no split beats {top} at any concurrency from {lo} to {hi}."),
            Some((split, at)) => format!(
                "Do not disaggregate: no split stays ahead of {top} up to {hi} concurrent requests \
                 ({split} leads at {at} only)."
            ),
        },
    }
}

/// Whether splitting the model into stage groups pays, in one sentence.
fn decide_split(cands: &[Candidate], link: StageLink) -> String {
    let best = |groups: bool| {
        cands.iter().filter(|c| (c.stages > 1) == groups).max_by(|a, b| a.best_goodput.total_cmp(&b.best_goodput))
    };
    match (best(true), best(false)) {
        (Some(g), None) => format!(
            "The model does not fit one node: only stage groups serve it, best {} ({:.2} req/s).",
            g.name, g.best_goodput
        ),
        (Some(g), Some(w)) if g.best_goodput > w.best_goodput => format!(
            "A stage split pays over {}: {} ({:.2} req/s) beats {} ({:.2}), its freed weights' memory holding more cache.",
            link.name(),
            g.name,
            g.best_goodput,
            w.name,
            w.best_goodput
        ),
        (Some(g), Some(w)) => format!(
            "A stage split does not pay over {}: the best group, {} ({:.2} req/s), trails {} ({:.2}).",
            link.name(),
            g.name,
            g.best_goodput,
            w.name,
            w.best_goodput
        ),
        (None, _) => format!("No stage group fits these nodes over {}.", link.name()),
    }
}

/// The goodput of the best plan of one kind (split or aggregated) at sweep point
/// `i`; `None` where there is no plan of that kind.
fn best_at(cands: &[Candidate], disaggregated: bool, i: usize) -> Option<f64> {
    let kind = cands.iter().filter(|c| c.disaggregated == disaggregated);
    kind.filter_map(|c| c.points.get(i)).map(|p| p.goodput).reduce(f64::max)
}

/// The points where a split leads every aggregated plan, as "8, 16", with the
/// split that has the most goodput there; `None` where no split leads anywhere.
fn ahead_at(cands: &[Candidate]) -> Option<(&str, String)> {
    let sweep = &cands.first()?.points;
    let leads = |i: usize| match (best_at(cands, true, i), best_at(cands, false, i)) {
        (Some(split), Some(aggregated)) => split > aggregated,
        (split, _) => split.is_some(),
    };
    let at: Vec<String> = (0..sweep.len()).filter(|&i| leads(i)).map(|i| sweep[i].concurrency.to_string()).collect();
    let split = most_goodput(cands, |i, _| leads(i))?;
    (!at.is_empty()).then(|| (split, at.join(", ")))
}

/// The split to take from concurrency `from` on: the most goodput summed over those
/// points. The split of the best peak may lose there to another (a 2P:2D that
/// peaks at 4 requests and a 3P:1D that holds up at 16 and 32).
fn split_from(cands: &[Candidate], from: usize) -> Option<&str> {
    most_goodput(cands, |_, p| p.concurrency >= from)
}

/// The split with the most goodput summed over the sweep points `at` takes.
fn most_goodput(cands: &[Candidate], at: impl Fn(usize, &Predicted) -> bool) -> Option<&str> {
    let sum =
        |c: &Candidate| c.points.iter().enumerate().filter(|&(i, p)| at(i, p)).map(|(_, p)| p.goodput).sum::<f64>();
    let splits = cands.iter().filter(|c| c.disaggregated);
    splits.max_by(|a, b| sum(a).total_cmp(&sum(b))).map(|c| c.name.as_str())
}

/// Goodput against concurrency, one line per topology.
pub fn svg(p: &Plan) -> String {
    let series = p
        .candidates
        .iter()
        .map(|c| Series {
            name: c.name.clone(),
            points: c.points.iter().map(|q| (q.concurrency as f64, Some(q.goodput))).collect(),
        })
        .collect();
    LinePlot {
        title: format!("Predicted goodput, {} node(s) of {} thread(s)", p.nodes, p.threads),
        subtitle: format!("{}; SLO TTFT ≤ {} ms, TPOT ≤ {} ms", p.workload, p.slo.ttft_ms, p.slo.tpot_ms),
        x_label: "concurrent requests".into(),
        y_label: "goodput (req/s)".into(),
        log2_x: true,
        series,
    }
    .render()
}

/// The ranking as a Markdown table, then the sentence.
pub fn markdown(p: &Plan) -> String {
    let mut s = String::from("| rank | topology | best goodput req/s |");
    for q in p.candidates.first().map(|c| c.points.as_slice()).unwrap_or_default() {
        s += &format!(" C={} goodput (SLO %) |", q.concurrency);
    }
    s += "\n|---|---|---|";
    s += &"---|".repeat(p.candidates.first().map_or(0, |c| c.points.len()));
    for (i, c) in p.candidates.iter().enumerate() {
        s += &format!("\n| {} | {} | {:.2} |", i + 1, c.name, c.best_goodput);
        for q in &c.points {
            s += &format!(" {:.2} ({:.0}) |", q.goodput, q.slo_attainment_pct);
        }
    }
    s + &format!("\n\n{}\n", p.decision)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(name: &str, disaggregated: bool, goodput: &[(usize, f64)]) -> Candidate {
        let points: Vec<Predicted> = goodput
            .iter()
            .map(|&(concurrency, goodput)| Predicted {
                concurrency,
                goodput,
                slo_attainment_pct: 0.0,
                output_token_throughput: 0.0,
                ttft_p90_ms: None,
                tpot_p50_ms: None,
            })
            .collect();
        let best_goodput = points.iter().map(|p| p.goodput).fold(0.0, f64::max);
        let stages = name.split_once("-stage").and_then(|(a, _)| a.rsplit(' ').next()?.parse().ok()).unwrap_or(1);
        Candidate { name: name.into(), disaggregated, stages, points, best_goodput }
    }

    #[test]
    fn the_split_advice_weighs_the_best_group_against_the_best_whole_model_plan() {
        let whole = candidate("aggregated ×2", false, &[(4, 2.0), (8, 3.0)]);
        let slow = candidate("aggregated ×1 of 2-stage groups (1 GbE)", false, &[(4, 1.0), (8, 1.5)]);
        let roomy = candidate("aggregated ×1 of 2-stage groups (1 GbE)", false, &[(4, 1.0), (8, 3.5)]);
        let table: [(&[Candidate], &str); 4] = [
            (
                &[whole.clone(), slow.clone()],
                "does not pay over 1 GbE: the best group, aggregated ×1 of 2-stage groups (1 GbE) (1.50",
            ),
            (
                &[roomy.clone(), whole.clone()],
                "pays over 1 GbE: aggregated ×1 of 2-stage groups (1 GbE) (3.50 req/s) beats aggregated ×2",
            ),
            (
                std::slice::from_ref(&slow),
                "does not fit one node: only stage groups serve it, best aggregated ×1 of 2-stage groups",
            ),
            (std::slice::from_ref(&whole), "No stage group fits"),
        ];
        for (cands, want) in table {
            let said = decide_split(cands, StageLink::Gbe1);
            assert!(said.contains(want), "{said}");
        }
    }

    #[test]
    fn the_advice_names_the_split_that_wins_beyond_the_crossover_not_the_best_peak() {
        let cands = [
            candidate("aggregated ×4", false, &[(4, 0.18), (16, 0.09), (32, 0.0)]),
            candidate("2P:2D", true, &[(4, 0.17), (16, 0.05), (32, 0.06)]),
            candidate("3P:1D", true, &[(4, 0.15), (16, 0.13), (32, 0.07)]),
        ];
        assert_eq!(split_from(&cands, 16), Some("3P:1D"));
        assert_eq!(split_from(&cands, 4), Some("3P:1D"));
        assert_eq!(split_from(&cands[..2], 16), Some("2P:2D"));
        assert_eq!(split_from(&cands[..1], 16), None);
    }

    #[test]
    fn advice_against_a_split_names_the_points_where_it_leads_anyway() {
        let cands = [
            candidate("aggregated ×2", false, &[(4, 2.42), (8, 4.30), (16, 7.04), (32, 12.20)]),
            candidate("1P:1D", true, &[(4, 2.38), (8, 4.32), (16, 7.46), (32, 12.03)]),
            candidate("single node", false, &[(4, 2.22), (8, 3.72), (16, 5.73), (32, 8.32)]),
        ];
        assert_eq!(ahead_at(&cands), Some(("1P:1D", "8, 16".to_string())));
        assert_eq!(ahead_at(&[cands[0].clone(), cands[2].clone()]), None);
        let behind = candidate("1P:1D", true, &[(4, 1.0), (8, 1.0), (16, 1.0), (32, 1.0)]);
        assert_eq!(ahead_at(&[cands[0].clone(), behind]), None);
        // Two splits leading at different points: both points, and the split with
        // the more goodput there.
        let two = [
            candidate("aggregated ×2", false, &[(4, 2.0), (8, 4.0)]),
            candidate("1P:1D", true, &[(4, 2.1), (8, 3.0)]),
            candidate("2P:1D", true, &[(4, 1.0), (8, 4.5)]),
        ];
        assert_eq!(ahead_at(&two), Some(("2P:1D", "4, 8".to_string())));
    }
}
