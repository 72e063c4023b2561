//! The serving topologies `bench compare` runs, all with the same compute budget
//! (total engine threads), and their `pdserve serve` command lines.
//!
//! At budget N: single = 1 worker × N threads; replicated = N mixed workers × 1
//! thread behind round-robin and behind least-loaded routing; disaggregated = every
//! split P + D = N, 1 thread each; auto = N mixed workers × 1 thread in `auto` mode;
//! auto-planner = the same under the planner (`--planner`, at the comparison's SLOs).
//! An external server (`--peer-url`) can be added as `peer`.

use crate::error::BenchError;

/// The family a topology belongs to, for crossovers and ratios.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Single,
    Replicated,
    Disaggregated,
    Auto,
    /// `auto` with the planner giving the workers their roles.
    Planner,
    Peer,
}

/// One topology to measure.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Topology {
    pub name: String,
    pub family: Family,
    /// `pdserve serve` arguments, without `--port`; empty for a peer.
    pub serve_args: Vec<String>,
    /// Set for a peer: the server is already running there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

impl Topology {
    fn served(name: String, family: Family, serve_args: Vec<String>) -> Self {
        Self { name, family, serve_args, url: None }
    }

    /// An external server.
    pub fn peer(url: &str) -> Self {
        Self { name: "peer".into(), family: Family::Peer, serve_args: Vec::new(), url: Some(url.to_string()) }
    }

    /// The full command line for `port` (for logs and the report).
    pub fn command(&self, program: &str, port: u16) -> Option<String> {
        self.url.is_none().then(|| format!("{program} serve {} --port {port}", self.serve_args.join(" ")))
    }
}

/// Every topology of a budget of `n` threads.
pub fn for_budget(n: usize) -> Result<Vec<Topology>, BenchError> {
    if n == 0 {
        return Err(BenchError::BadFlag("--budget must be at least 1 thread".into()));
    }
    let (ns, one) = (n.to_string(), "1");
    let mut all = vec![Topology::served(
        "single".into(),
        Family::Single,
        args(&["--mode", "aggregated", "--workers", "1", "--threads-per-worker", &ns]),
    )];
    if n >= 2 {
        for (suffix, policy) in [("rr", "round-robin"), ("ll", "least-loaded")] {
            let a = args(&["--mode", "aggregated", "--workers", &ns, "--threads-per-worker", one, "--policy", policy]);
            all.push(Topology::served(format!("replicated-{suffix}"), Family::Replicated, a));
        }
        for p in 1..n {
            let (ps, ds) = (p.to_string(), (n - p).to_string());
            let a = args(&["--mode", "disaggregated", "--prefill", &ps, "--decode", &ds, "--threads-per-worker", one]);
            all.push(Topology::served(format!("disagg-{p}p{}d", n - p), Family::Disaggregated, a));
        }
    }
    let a = args(&["--mode", "auto", "--workers", &ns, "--threads-per-worker", one]);
    all.push(Topology::served("auto".into(), Family::Auto, a.clone()));
    if n >= 2 {
        // Its SLO flags are the comparison's own, added where they are known.
        let planned = [a, args(&["--planner"])].concat();
        all.push(Topology::served("auto-planner".into(), Family::Planner, planned));
    }
    Ok(all)
}

/// Keeps the topologies named in `names` (exact names, or a family: `replicated`,
/// `disagg`), in budget order. An unknown name is an error listing the valid ones.
pub fn select(all: Vec<Topology>, names: &[String]) -> Result<Vec<Topology>, BenchError> {
    if names.is_empty() {
        return Ok(all);
    }
    for name in names {
        if !all.iter().any(|t| matches(t, name)) {
            let valid: Vec<&str> = all.iter().map(|t| t.name.as_str()).collect();
            return Err(BenchError::BadFlag(format!(
                "unknown topology {name:?} for this budget: expected one of {} (or replicated, disagg)",
                valid.join(", ")
            )));
        }
    }
    Ok(all.into_iter().filter(|t| names.iter().any(|n| matches(t, n))).collect())
}

fn matches(t: &Topology, name: &str) -> bool {
    t.name == name
        || (name == "replicated" && t.family == Family::Replicated)
        || (name == "disagg" && t.family == Family::Disaggregated)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_two_gives_the_six_topologies_with_their_command_lines() {
        let all = for_budget(2).unwrap();
        let cmd: Vec<String> = all.iter().map(|t| t.command("pdserve", 9000).unwrap()).collect();
        assert_eq!(
            cmd,
            vec![
                "pdserve serve --mode aggregated --workers 1 --threads-per-worker 2 --port 9000",
                "pdserve serve --mode aggregated --workers 2 --threads-per-worker 1 --policy round-robin --port 9000",
                "pdserve serve --mode aggregated --workers 2 --threads-per-worker 1 --policy least-loaded --port 9000",
                "pdserve serve --mode disaggregated --prefill 1 --decode 1 --threads-per-worker 1 --port 9000",
                "pdserve serve --mode auto --workers 2 --threads-per-worker 1 --port 9000",
                "pdserve serve --mode auto --workers 2 --threads-per-worker 1 --planner --port 9000",
            ]
        );
    }

    #[test]
    fn larger_budgets_get_every_split_and_budget_one_only_single_and_auto() {
        let names = |n| for_budget(n).unwrap().into_iter().map(|t| t.name).collect::<Vec<_>>();
        assert_eq!(
            names(3),
            vec!["single", "replicated-rr", "replicated-ll", "disagg-1p2d", "disagg-2p1d", "auto", "auto-planner"]
        );
        assert_eq!(names(1), vec!["single", "auto"]);
        assert!(for_budget(0).is_err());
    }

    #[test]
    fn selection_by_name_or_family() {
        let s = select(for_budget(3).unwrap(), &["disagg".into(), "single".into()]).unwrap();
        assert_eq!(s.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), vec!["single", "disagg-1p2d", "disagg-2p1d"]);
        let e = select(for_budget(2).unwrap(), &["disagg-2p2d".into()]).unwrap_err().to_string();
        assert!(e.contains("disagg-1p1d"), "{e}");
        assert_eq!(select(for_budget(2).unwrap(), &[]).unwrap().len(), 6);
        assert_eq!(Topology::peer("http://x").command("p", 1), None);
    }
}
