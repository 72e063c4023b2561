//! `pdserve sim`: a serving topology and a workload on a virtual clock.
//!
//! The fleet is [`SimWorker`]s (the real worker loop, scheduler and block pool around
//! a timed engine) behind the real [`Router`] — its modes, policies, `auto`'s cost
//! model, the handoff with its deadlines, and the planner — all on a paused tokio
//! runtime whose clock jumps from one timer to the next. The load is `bench load`'s
//! own runner and workloads, and the output its own records and summaries, so a
//! prediction and a measurement compare field by field.

use crate::group::{row_and_weights, GroupShape};
use crate::profile::Profile;
use crate::TwinError;
use pdserve_bench::load::{PointResult, SwitchRecord};
use pdserve_bench::metrics::{PrefixHits, Slo};
use pdserve_bench::point::PointPlan;
use pdserve_bench::record::RequestRecord;
use pdserve_bench::reuse::SentBlocks;
use pdserve_bench::runner::{run_point, Server};
use pdserve_bench::workload::{RequestSpec, Workload};
use pdserve_engine::batch::{EngineConfig, Objectives};
use pdserve_engine::tiers::TierConfig;
use pdserve_engine::timed::Clock;
use pdserve_kv_transfer::TransportKind;
use pdserve_planner::{model, Actuator, Applied, Direct, Fleet, Made, Member, Planner, PlannerConfig};
use pdserve_protocol::{Event, Generate, GenerateRequest, Phase, PrefillRoute, Telemetry, TokenStream, Worker};
use pdserve_router::{Admission, Deadlines, Migrating, Mode, PolicyKind, Router};
use pdserve_types::{RequestId, Role, SamplingParams};
use pdserve_worker::{CoRun, Machine, SimOptions, SimWorker};
use std::cell::Cell;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

/// A serving topology, in `pdserve serve`'s terms.
#[derive(Debug, Clone)]
pub struct Topology {
    pub mode: Mode,
    /// Each worker's starting role.
    pub roles: Vec<Role>,
    pub policy: PolicyKind,
    /// Compute threads per worker (picks the profile's shape).
    pub threads: usize,
    /// KV blocks per worker (default: the profile's).
    pub kv_blocks: Option<usize>,
    pub via: TransportKind,
    /// The planner's objectives, when it runs.
    pub planner: Option<model::Slo>,
    /// The objectives each worker's steps keep (`serve --protect-tpot`).
    pub objectives: Option<Objectives>,
    /// Whether the workers share one machine (`serve`'s topology) or each has its
    /// own (a fleet of nodes).
    pub shared_machine: bool,
    /// Each worker's host and disk tiers (none by default), in the real model's
    /// blocks; copies back cost the profile's [`Profile::tiers`].
    pub tiers: TierConfig,
    /// Whether a worker may fetch a prefix a peer caches (`serve`'s default) rather
    /// than recompute it.
    pub prefix_fetch: bool,
    /// Every worker a stage group of this shape, each stage on a node of its own
    /// (none: every worker holds the whole model).
    pub group: Option<GroupShape>,
    /// What the router refuses rather than queues (`serve`'s `--max-queue-seconds`
    /// by default): a refused request is shed as `bench load` sees a 429, and the
    /// closed loop waits its `Retry-After`.
    pub admission: Admission,
}

impl Topology {
    /// A short name: `agg×2`, `1P1D`, `auto 2M + planner`.
    pub fn label(&self) -> String {
        let count = |r: Role| self.roles.iter().filter(|&&x| x == r).count();
        let (p, d, m) = (count(Role::Prefill), count(Role::Decode), count(Role::Mixed));
        let base = match self.mode {
            Mode::Aggregated => format!("aggregated×{m}"),
            Mode::Disaggregated => format!("{p}P{d}D"),
            Mode::Auto if m > 0 => format!("auto {m}M"),
            Mode::Auto => format!("auto {p}P{d}D"),
        };
        let base = match self.group {
            Some(g) => format!("{base} of {}-stage groups", g.stages),
            None => base,
        };
        match self.planner {
            Some(_) => format!("{base} + planner"),
            None => base,
        }
    }
}

/// One simulation: a topology, a workload and its points.
pub struct SimSpec<'a> {
    pub profile: &'a Profile,
    pub topology: Topology,
    pub workload: &'a Workload,
    pub plans: &'a [PointPlan],
    pub slo: Slo,
    /// Requests sent one at a time first, as `bench load` warms a server up.
    pub warmup: usize,
}

/// Runs the points in order against one simulated fleet, as `bench load` runs them
/// against one server.
pub fn simulate(spec: &SimSpec<'_>) -> Result<Vec<PointResult>, TwinError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| TwinError::Invalid(format!("starting the simulation's runtime: {e}")))?;
    rt.block_on(async {
        let server = SimServer::start(spec.profile, &spec.topology)?;
        // As `serve` does, admission knows every worker's blocks before the first request.
        server.router.poll_stats().await;
        let origin = Instant::now();
        // The prompt blocks sent before each request, as `bench load` counts them.
        let mut sent = SentBlocks::default();
        for i in 0..spec.warmup {
            let warm = spec.workload.request(u64::MAX, i);
            sent.record(&warm.prompt.ids());
            server.send(&warm, origin, None).await;
        }
        let mut out = Vec::new();
        for plan in spec.plans {
            let before = server.prefix_hits().await;
            let started = Instant::now();
            let records = run_point(&server, spec.workload, plan, None).await;
            let mut point = PointResult::of(plan, spec.workload, records, spec.slo);
            point.switches = server.switches.since(started);
            point.summary.prefix_hits = Some(server.prefix_hits().await.since(Some(before)));
            for r in &point.records {
                point.summary.prompt_blocks += sent.record_sent(spec.workload, plan.seed, r);
            }
            out.push(point);
        }
        server.check_idle().await;
        Ok(out)
    })
}

/// The simulated fleet behind its router, taking requests as a client would send them.
pub struct SimServer {
    router: Arc<Router>,
    /// The router's front, as `pdserve serve`'s HTTP layer calls it: it feeds the
    /// planner's signals and re-routes calls refused for a stale epoch.
    front: Migrating,
    hits: Arc<HitTally>,
    switches: Arc<Switches>,
    admission: Duration,
    /// A request not done by then is given up, as `bench load`'s client gives up
    /// (its default `--timeout-seconds`): a run always ends, and shows what hung.
    timeout: Duration,
    next_id: Cell<u64>,
}

/// The router's predicted and realized cached prompt tokens, and those fetched from
/// peers, summed as `serve`'s metrics sum them; nothing else is recorded.
#[derive(Default)]
struct HitTally(Mutex<PrefixHits>);

impl Telemetry for HitTally {
    fn phase(&self, _: Phase, _: f64) {}
    fn route(&self, _: PrefillRoute) {}
    fn kv_transfer_bytes(&self, _: TransportKind, _: u64) {}
    fn migrated(&self, _: &'static str) {}

    fn prefix_hit(&self, predicted: usize, realized: usize, _cause: Option<&'static str>) {
        let mut sums = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        sums.predicted += predicted as f64;
        sums.realized += realized as f64;
    }

    fn prefix_fetched(&self, tokens: usize, _seconds: f64, _fell_back: Option<&'static str>) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).fetched += tokens as f64;
    }
}

/// The planner's switches as `serve`'s planner makes them ([`Direct`]), each noted
/// at its virtual time: the real server logs them, the twin hands them to its points.
#[derive(Default)]
struct Switches(Mutex<Vec<(Instant, SwitchRecord)>>);

impl Switches {
    /// The switches made since `start`, on that point's clock; earlier ones are
    /// dropped (they belong to no point).
    fn since(&self, start: Instant) -> Vec<SwitchRecord> {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let noted = std::mem::take(&mut *all);
        let at = |t: Instant| t.saturating_duration_since(start).as_secs_f64();
        noted.into_iter().filter(|(t, _)| *t >= start).map(|(t, s)| SwitchRecord { at_s: at(t), ..s }).collect()
    }
}

impl Actuator for Switches {
    fn apply<'a>(&'a self, fleet: &'a dyn Fleet, moves: &'a [(Member, Role)]) -> Applied<'a> {
        Direct.apply(fleet, moves)
    }

    fn made(&self, made: &Made<'_>) {
        let d = made.decision;
        let s = SwitchRecord { at_s: 0.0, from: d.from.to_string(), to: d.to.to_string(), reason: d.reason.into() };
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push((Instant::now(), s));
    }
}

/// `bench load`'s default per-request timeout.
const TIMEOUT: Duration = Duration::from_secs(600);

impl SimServer {
    /// Starts the workers and the router (and the planner) on the current runtime.
    /// Fails when the topology asks for tiers the profile has no timings of, or a
    /// disk tier cannot be opened.
    pub fn start(profile: &Profile, t: &Topology) -> Result<SimServer, TwinError> {
        if !t.tiers.is_empty() && profile.tiers.is_none() {
            return Err(TwinError::Invalid(
                "this profile has no KV tier timings (timed before tiers were): run `pdserve profile` again".into(),
            ));
        }
        // The profile's widest shape is its machine's cores.
        let cores = profile.shapes.iter().map(|s| s.threads).max().unwrap_or(1);
        let shared = Machine::new(cores, profile.co_run(), profile.host_token_s);
        let machine = || match t.shared_machine {
            true => shared.clone(),
            false => Machine::new(cores, CoRun::uniform(1.0), profile.host_token_s),
        };
        let timed = || -> Result<_, TwinError> {
            let whole = profile.timed(t.threads, Clock::Virtual);
            match t.group {
                Some(g) => Ok(g.timed(whole, row_and_weights(profile)?.0, profile.shape(t.threads).layers_fixed_s)),
                None => Ok(whole),
            }
        };
        let mut workers = Vec::with_capacity(t.roles.len());
        for (i, &role) in t.roles.iter().enumerate() {
            let opts = SimOptions {
                name: format!("{role}-{i}"),
                role,
                model_name: profile.model.name.clone(),
                engine: EngineConfig { objectives: t.objectives, ..profile.engine_config(t.threads, t.kv_blocks) },
                timed: timed()?,
                kv_bytes_per_token: profile.model.kv_bytes_per_token,
                draft_kv_bytes_per_token: profile
                    .model
                    .speculation
                    .as_ref()
                    .map_or(0.0, |s| s.draft_kv_bytes_per_token),
                links: profile.links(),
                machine: machine(),
                tiers: t.tiers.clone(),
            };
            let w = SimWorker::spawn(opts).map_err(|e| TwinError::Invalid(e.to_string()))?;
            workers.push(Arc::new(w) as Arc<dyn Worker>);
        }
        let hits = Arc::new(HitTally::default());
        let router = Router::new(workers, t.mode, Deadlines::default(), tokio::runtime::Handle::current())
            .with_policy(t.policy.build())
            .with_transport(t.via)
            .with_prefix_fetch(t.prefix_fetch)
            .with_limits(t.admission)
            .with_telemetry(hits.clone());
        let router = Arc::new(router);
        // Every policy, as `serve`: a history-blind pick still fetches a prefix a
        // peer caches, which only the index knows of.
        router.follow_kv_events();
        let switches = Arc::new(Switches::default());
        if let Some(slo) = t.planner {
            drop(Planner::spawn_with(router.clone(), PlannerConfig::new(slo), switches.clone()));
        }
        // Serve's stats reporter: admission's figures of blocks and decode steps.
        router.spawn_stats_poll(|_| ());
        // Serve's default `--max-migrations`.
        let front = Migrating::new(router.clone(), 1);
        let admission = Duration::from_secs_f64(profile.admission_s);
        Ok(SimServer { router, front, hits, switches, admission, timeout: TIMEOUT, next_id: Cell::new(1) })
    }

    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// Cached prompt tokens so far, as the router predicted them and as the engines
    /// reused them, and the part its workers copied back from their lower tiers:
    /// what `bench load` reads off `serve`'s metrics.
    pub async fn prefix_hits(&self) -> PrefixHits {
        let mut hits = *self.hits.0.lock().unwrap_or_else(PoisonError::into_inner);
        let block = pdserve_engine::batch::BLOCK_SIZE as f64;
        for e in self.router.workers().snapshot() {
            if let Ok(s) = e.worker.stats().await {
                hits.from_host += s.tiers.restored_host as f64 * block;
                hits.from_disk += s.tiers.restored_disk as f64 * block;
            }
        }
        hits
    }

    /// Warns about every worker that still holds work or blocks after the run: an
    /// idle fleet holds none, so anything left is a request the run lost track of.
    pub async fn check_idle(&self) {
        // Give deadlines and cancellations their time, as a drained server would.
        tokio::time::sleep(Duration::from_secs(30)).await;
        for e in self.router.workers().snapshot() {
            if let Ok(s) = e.worker.stats().await {
                if s.blocks.used > 0 || s.running + s.waiting + s.importing > 0 {
                    tracing::warn!(
                        worker = e.name(),
                        running = s.running,
                        waiting = s.waiting,
                        importing = s.importing,
                        used_blocks = s.blocks.used,
                        "work left on a worker after the run"
                    );
                }
            }
        }
    }
}

impl Server for SimServer {
    async fn send(&self, spec: &RequestSpec, origin: Instant, scheduled_s: Option<f64>) -> RequestRecord {
        let sent = Instant::now();
        let start_s = sent.duration_since(origin).as_secs_f64();
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        tokio::time::sleep(self.admission).await;
        let req = sim_request(id, spec);
        let mut rec = RequestRecord {
            index: spec.index,
            start_s,
            scheduled_s,
            requested_output_tokens: spec.output_len,
            input_tokens: spec.prompt.len() as u64,
            ..RequestRecord::default()
        };
        let mut stream = match self.front.generate(req) {
            Ok(s) => s,
            Err(e) => {
                // What the HTTP layer answers with 429 and `Retry-After`.
                rec.shed = e.retry_after_s().map(|s| s as f64);
                rec.error = Some(e.to_string());
                rec.e2e_s = sent.elapsed().as_secs_f64();
                return rec;
            }
        };
        let mut chunks = Vec::new();
        if tokio::time::timeout(self.timeout, read_events(&mut stream, sent, &mut rec, &mut chunks)).await.is_err() {
            rec.timed_out = true;
            rec.error = Some(format!("timed out after {:.0} s", self.timeout.as_secs_f64()));
        }
        if !rec.ok && rec.error.is_none() {
            rec.error = Some("the stream ended without its last event".into());
        }
        rec.e2e_s = sent.elapsed().as_secs_f64();
        rec.chunk_times_s = chunks;
        rec.derive()
    }
}

/// Request `id` of `spec` as `bench load` sends it: exactly its output length in
/// tokens.
fn sim_request(id: u64, spec: &RequestSpec) -> GenerateRequest {
    let n = spec.output_len;
    GenerateRequest {
        id: RequestId(id),
        tag: format!("sim-{id}").as_str().into(),
        prompt: spec.prompt.ids(),
        // What `bench load` asks for: exactly n tokens.
        params: SamplingParams { max_tokens: n, min_tokens: n, ignore_eos: true, ..SamplingParams::default() },
        fence: None,
        trace: Default::default(),
    }
}

/// Reads the stream into `rec` until its last event: each token's time since `sent`
/// into `chunks`, its id into the reply.
async fn read_events(stream: &mut TokenStream, sent: Instant, rec: &mut RequestRecord, chunks: &mut Vec<f64>) {
    while let Some(ev) = stream.next().await {
        match ev {
            Event::Token(t) => {
                chunks.push(sent.elapsed().as_secs_f64());
                rec.reply_ids.push(t.token);
            }
            Event::Prompt(_) | Event::Embedding(_) | Event::Drafts(_) => {}
            Event::Done { usage, .. } => {
                rec.ok = true;
                rec.output_tokens = usage.completion_tokens as u64;
                break;
            }
            Event::Failed(e) => {
                rec.error = Some(e.to_string());
                break;
            }
        }
    }
}
