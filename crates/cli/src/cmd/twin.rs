//! `pdserve profile` and `pdserve sim`: the twin's calibration and its simulator.

use super::http::AdmissionArgs;
use super::serve::TopologyArgs;
use super::workload::WorkloadArgs;
use anyhow::Context;
use pdserve_bench::compare::{CompareOptions, CompareReport};
use pdserve_bench::load::markdown;
use pdserve_bench::load::{plans, LoadReport};
use pdserve_bench::metrics::Slo;
use pdserve_bench::openai::{BodyOptions, Endpoint};
use pdserve_bench::prompt::PromptKind;
use pdserve_bench::report::json;
use pdserve_bench::topology::Topology as Served;
use pdserve_engine::batch::Objectives;
use pdserve_kv_transfer::TransportKind;
use pdserve_planner::model;
use pdserve_twin::group::{self, GroupShape, StageLink};
use pdserve_twin::measure;
use pdserve_twin::profile::{Profile, SpecProfile};
use pdserve_twin::sim::{simulate, SimSpec, Topology};
use pdserve_twin::versus;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct ProfileArgs {
    /// `default`, a model `pdserve pull --list` names, or a path to a GGUF file or
    /// safetensors directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// Compute threads of each worker shape to time (e.g. 1,2).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// KV blocks of 16 tokens per worker the profile states (the simulator's default;
    /// `pdserve serve` gives 1024).
    #[arg(long, default_value_t = 1024)]
    kv_blocks: usize,
    /// Instead of timing this machine, fit the step costs of this profile again to
    /// the points it holds (a profile whose points were timed elsewhere, as the
    /// derived GPU profiles' by scripts/gpu_step_times.py).
    #[arg(long, value_name = "PROFILE")]
    refit: Option<PathBuf>,
    /// Where to write the profile (JSON).
    #[arg(long)]
    out: PathBuf,
}

pub fn profile(a: ProfileArgs) -> anyhow::Result<()> {
    if let Some(from) = &a.refit {
        return refit(from, &a.out);
    }
    if a.threads.is_empty() || a.threads.contains(&0) {
        anyhow::bail!("--threads needs positive thread counts");
    }
    let m = super::load_model(&a.model)?;
    let spec = measure::Spec {
        model: m.model.clone(),
        name: m.name.clone(),
        threads: a.threads.clone(),
        kv_blocks: a.kv_blocks,
        machine: machine(),
        date: today(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        exe: std::env::current_exe().context("finding this binary")?,
        model_arg: a.model.clone(),
    };
    let p = measure::profile(&spec, &mut |line| eprintln!("{line}"))?;
    p.save(&a.out)?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// `pdserve profile --refit`: the fit of each shape's points, written to `out`.
fn refit(from: &std::path::Path, out: &std::path::Path) -> anyhow::Result<()> {
    let mut p = Profile::load(from)?;
    let errors = p.refit();
    if errors.is_empty() {
        anyhow::bail!("{} holds no timed points to fit", from.display());
    }
    for (threads, e) in errors {
        eprintln!("threads {threads}: median fit error {:.1} %", e * 100.0);
    }
    p.save(out)?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

#[derive(clap::Args)]
pub struct SimArgs {
    /// A profile written by `pdserve profile` (or a derived one).
    #[arg(long)]
    profile: PathBuf,
    #[command(flatten)]
    topology: TopologyArgs,
    #[command(flatten)]
    admission: AdmissionArgs,
    #[command(flatten)]
    work: WorkloadArgs,
    /// Write every simulated request and the summaries as JSON here (`bench load`'s
    /// format).
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    spec: TwinSpecArgs,
    /// Simulate every worker as a stage group of this many stages, one node each
    /// (`pdserve worker --group`), its KV blocks what the weights each node no longer
    /// holds free unless --kv-blocks says.
    #[arg(long, default_value_t = 1)]
    group_stages: usize,
    /// The link between a group's stages: loopback (the profile's timed TCP link; the
    /// stages then share the cores of the profile's machine, where it states them),
    /// 1gbe or 10gbe (loopback's cost plus the wire's, a host each).
    #[arg(long, default_value = "loopback")]
    stage_link: StageLink,
}

/// Speculative decoding in the twin, as a server measured it.
#[derive(clap::Args)]
struct TwinSpecArgs {
    /// Simulate workers that speculate, with drafts of this many tokens (the measured
    /// server's --spec-tokens).
    #[arg(long, requires = "spec_acceptance")]
    spec_tokens: Option<usize>,
    /// The share of drafted tokens the measured server accepted, 0 to 1: its
    /// pdserve_spec_accepted_tokens_total over pdserve_spec_draft_tokens_total.
    #[arg(long, requires = "spec_tokens")]
    spec_acceptance: Option<f64>,
    /// The share of the measured server's decode steps that had a draft, 0 to 1: its
    /// pdserve_spec_drafting_share [default: 1, a draft every step].
    #[arg(long, requires = "spec_tokens")]
    spec_drafting: Option<f64>,
    /// A profile of the draft model on the same machine (`pdserve profile --model
    /// DRAFT`): each draft pass costs what a decode step costs there [default: drafts
    /// are free, as an n-gram lookup nearly is].
    #[arg(long, requires = "spec_tokens")]
    spec_draft_profile: Option<PathBuf>,
    /// Beside a draft model, the share of a lookup's drafted tokens accepted, 0 to 1,
    /// as a `--speculative ngram` server measured it on the same workload: a request
    /// that drafts by lookup there drafts with it [default: such a request drafts
    /// nothing].
    #[arg(long, requires = "spec_draft_profile")]
    spec_lookup_acceptance: Option<f64>,
    /// That server's pdserve_spec_drafting_share, 0 to 1 [default: 1].
    #[arg(long, requires = "spec_lookup_acceptance")]
    spec_lookup_drafting: Option<f64>,
}

impl TwinSpecArgs {
    /// `profile` with the speculation these flags describe, checked.
    fn apply(&self, profile: Profile) -> anyhow::Result<Profile> {
        let (Some(tokens), Some(accepted_share)) = (self.spec_tokens, self.spec_acceptance) else {
            return Ok(profile);
        };
        if !(1..=32).contains(&tokens) {
            anyhow::bail!("--spec-tokens must be 1 to 32 (got {tokens})");
        }
        let drafting_share = self.spec_drafting.unwrap_or(1.0);
        let lookup = self.spec_lookup_acceptance.map(|a| (a, self.spec_lookup_drafting.unwrap_or(1.0)));
        let shares = [
            ("--spec-acceptance", Some(accepted_share)),
            ("--spec-drafting", Some(drafting_share)),
            ("--spec-lookup-acceptance", lookup.map(|l| l.0)),
            ("--spec-lookup-drafting", lookup.map(|l| l.1)),
        ];
        for (flag, share) in shares.into_iter().filter_map(|(f, s)| Some((f, s?))) {
            if !(0.0..=1.0).contains(&share) {
                anyhow::bail!("{flag} is a share, 0 to 1 (got {share})");
            }
        }
        let (draft_steps, draft_kv_bytes_per_token) = match &self.spec_draft_profile {
            Some(p) => {
                let draft = Profile::load(p)?;
                (draft.step_costs(), draft.model.kv_bytes_per_token)
            }
            None => (Vec::new(), 0.0),
        };
        let spec =
            SpecProfile { tokens, accepted_share, drafting_share, draft_steps, draft_kv_bytes_per_token, lookup };
        Ok(profile.with_speculation(spec))
    }
}

/// The simulator's topology for `serve`'s topology and admission flags, on
/// `profile`'s machine.
fn sim_topology(t: &TopologyArgs, admission: &AdmissionArgs, profile: &Profile, slo: Slo) -> anyhow::Result<Topology> {
    let roles = t.roles();
    // The profile's widest shape is the machine; its workers share it, as serve's do.
    let widest = profile.shapes.iter().map(|s| s.threads).max().unwrap_or(1);
    let threads = t.threads_per_worker.unwrap_or((widest / roles.len()).max(1));
    let tiers = t.tiers.config(profile.block_bytes())?;
    Ok(Topology {
        mode: t.mode,
        policy: t.policy,
        threads,
        // A byte budget counts blocks of the profile's (already dtype-scaled) bytes.
        kv_blocks: match t.kv_cache.kv_cache_gb {
            Some(_) => Some(t.kv_cache.blocks(None, 0, 0.0, profile.block_bytes() as f64)?),
            None => t.kv_blocks,
        },
        via: t.kv_transport.unwrap_or(TransportKind::Inproc),
        planner: t.planner.then_some(model::Slo::from_ms(slo.ttft_ms, slo.tpot_ms)),
        objectives: t.protect_tpot.then_some(Objectives::from_ms(slo.ttft_ms, slo.tpot_ms)),
        // Workers whose threads fit the profile's machine share it, as `serve`'s do;
        // more are a fleet, one machine each.
        shared_machine: threads * roles.len() <= widest,
        prefix_fetch: !t.no_kv_fetch,
        group: None,
        admission: admission.limits(),
        roles,
        tiers,
    })
}

pub fn sim(a: SimArgs) -> anyhow::Result<()> {
    a.topology.check()?;
    let profile = a.spec.apply(Profile::load(&a.profile)?.with_kv_dtype(a.topology.kv_cache.kv_cache_dtype))?;
    let slo = a.work.slo();
    let mut topology = sim_topology(&a.topology, &a.admission, &profile, slo)?;
    if a.group_stages == 0 {
        anyhow::bail!("--group-stages must be at least 1");
    }
    if a.group_stages > 1 {
        let link = a.stage_link.model(group::loopback(&profile)?);
        // Over loopback the stages are on one machine: they share the profile's cores
        // (where it states them; a host each otherwise).
        let cores = profile.cores.filter(|_| a.stage_link == StageLink::Loopback);
        let g = GroupShape { stages: a.group_stages, link, cores };
        let (memory, weights, block) = group::node_bytes(&profile, None)?;
        topology.kv_blocks = topology.kv_blocks.or(g.kv_blocks(memory, weights, block));
        topology.group = Some(g);
    }
    let workload = a.work.workload()?;
    let plans = plans(&a.work.sweep()?, a.work.requests, a.work.seconds, workload.trace_len())?;
    let started = Instant::now();
    let spec = SimSpec { profile: &profile, topology, workload: &workload, plans: &plans, slo, warmup: a.work.warmup };
    let points = simulate(&spec)?;
    let simulated: f64 = points.iter().map(|p| p.summary.duration_s).sum();
    let took = started.elapsed().as_secs_f64();
    eprintln!("simulated {simulated:.1} s in {took:.2} s ({:.0}× real time)", simulated / took.max(1e-9));
    let report = LoadReport {
        url: format!("sim: {} ({})", spec.topology.label(), a.profile.display()),
        model: Some(profile.model.name.clone()),
        workload: workload.describe(),
        body: BodyOptions {
            endpoint: Endpoint::Completions,
            prompt_kind: PromptKind::Ids,
            model: Some(profile.model.name.clone()),
            temperature: 0.0,
            token_ids: workload.generates_replies(),
        },
        points,
        calibration: Vec::new(),
    };
    if let Some(path) = &a.out {
        json::write(path, &report).with_context(|| format!("writing {}", path.display()))?;
    }
    print!("{}", markdown::load_report(&report));
    Ok(())
}

/// The CPU model and core count, for the profile's provenance.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split(':').nth(1)))
        .map_or("unknown CPU", str::trim)
        .to_string();
    format!("{cpu}, {} cores", super::generate::default_threads())
}

/// Today's date (UTC), from the system clock.
fn today() -> String {
    let days = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() / 86_400);
    let (y, m, d) = pdserve_types::civil::civil_from_days(days as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

#[derive(clap::Args)]
pub struct PlanArgs {
    /// A profile written by `pdserve profile` (or a derived one).
    #[arg(long)]
    profile: PathBuf,
    /// Nodes to plan for: each runs one worker on a machine of the profile's shape.
    #[arg(long)]
    nodes: usize,
    /// Compute threads per node (default: the profile's widest shape).
    #[arg(long)]
    threads: Option<usize>,
    /// How KV moves between nodes: tcp (the default), shm or inproc.
    #[arg(long, default_value = "tcp")]
    kv_transport: TransportKind,
    #[command(flatten)]
    work: WorkloadArgs,
    /// Plan stage groups too (the model split by layers across nodes, `pdserve worker
    /// --group`), their stages joined by this link: loopback, 1gbe or 10gbe.
    #[arg(long)]
    stage_link: Option<StageLink>,
    /// GB of memory a node has for the model's weights and its KV cache [default: the
    /// weights and the profile's blocks]. A node that cannot hold the weights gets
    /// no whole-model worker.
    #[arg(long)]
    node_memory_gb: Option<f64>,
    /// Write plan.json and plan.svg into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    spec: TwinSpecArgs,
}

/// The concurrencies a plan sweeps unless told otherwise.
const PLAN_SWEEP: [usize; 6] = [1, 2, 4, 8, 16, 32];

pub fn plan(a: PlanArgs) -> anyhow::Result<()> {
    let profile = a.spec.apply(Profile::load(&a.profile)?)?;
    if a.nodes == 0 {
        anyhow::bail!("--nodes must be at least 1");
    }
    if a.node_memory_gb.is_some_and(|gb| gb.is_nan() || gb <= 0.0) {
        anyhow::bail!("--node-memory-gb must be positive");
    }
    if !a.work.rate.is_empty() || a.work.trace.is_some() || !a.work.phase.is_empty() {
        anyhow::bail!("plan sweeps concurrency: give --concurrency, not --rate, --trace or --phase");
    }
    let widest = profile.shapes.iter().map(|s| s.threads).max().unwrap_or(1);
    let workload = a.work.workload()?;
    let spec = pdserve_twin::plan::PlanSpec {
        profile: &profile,
        nodes: a.nodes,
        threads: a.threads.unwrap_or(widest),
        workload: &workload,
        concurrency: a.work.concurrency.clone().unwrap_or(PLAN_SWEEP.to_vec()),
        requests: a.work.requests,
        slo: a.work.slo(),
        via: a.kv_transport,
        stage_link: a.stage_link,
        node_memory: a.node_memory_gb.map(|gb| gb * 1e9),
    };
    let p = pdserve_twin::plan::plan(&spec)?;
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        json::write(&dir.join("plan.json"), &p)?;
        let svg = dir.join("plan.svg");
        std::fs::write(&svg, pdserve_twin::plan::svg(&p)).with_context(|| format!("writing {}", svg.display()))?;
    }
    print!("{}", pdserve_twin::plan::markdown(&p));
    Ok(())
}

/// `serve`'s topology and admission flags alone, to read a compared topology's
/// command line.
#[derive(clap::Parser)]
struct ServeTopology {
    #[command(flatten)]
    t: TopologyArgs,
    #[command(flatten)]
    admission: AdmissionArgs,
}

/// `bench compare --sim`: simulates every topology `report` measured on `profile`,
/// writes predicted.json and predicted.md beside the measurements, and prints the
/// table of errors.
pub fn compare_sim(profile: &Profile, opts: &CompareOptions, report: &CompareReport) -> anyhow::Result<()> {
    let read = |served: &Served| -> Result<Topology, String> {
        // The model is the profile's; every other flag must be one `sim` knows.
        let mut args = vec!["serve".to_string()];
        let mut it = served.serve_args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                // The planner's and --protect-tpot's objectives are taken to be the
                // comparison's SLO, which sim takes.
                "--model" | "--slo-ttft-ms" | "--slo-tpot-ms" => _ = it.next(),
                _ => args.push(a.clone()),
            }
        }
        let parsed = <ServeTopology as clap::Parser>::try_parse_from(args)
            .map_err(|e| e.to_string().lines().next().unwrap_or_default().to_string())?;
        parsed.t.check().map_err(|e| e.to_string())?;
        sim_topology(&parsed.t, &parsed.admission, profile, opts.slo).map_err(|e| e.to_string())
    };
    let predicted = versus::predict(profile, opts, report, &read)?;
    json::write(&opts.out.join("predicted.json"), &predicted)?;
    let md = versus::markdown(&report.runs, &predicted);
    let path = opts.out.join("predicted.md");
    std::fs::write(&path, &md).with_context(|| format!("writing {}", path.display()))?;
    print!("\n## The twin's predictions ({})\n\n{md}", path.display());
    Ok(())
}
