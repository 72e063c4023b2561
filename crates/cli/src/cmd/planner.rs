//! `pdserve planner --nats URL`: the planner of a fleet, in its own process.
//!
//! It follows the fleet like a frontend (connecting to each worker's control port
//! for its stats), reads the traffic every frontend publishes, and runs the same
//! planner as `serve --planner`. Its decisions do not go to the workers directly:
//! it writes them into the fleet bucket's plan key, which it holds a lease on, and
//! each worker takes the role named for it. Several planners may run; one holds the
//! lease and plans, the others wait and take over within seconds of its loss.

use super::fleet::NatsArgs;
use super::frontend::{follow_fleet, FleetNames, Target, Targets};
use pdserve_fleet::forest::Leaf;
use pdserve_fleet::{Bus, Lease, LeaseError, NatsConfig, NodeId, TrafficBatch, LEASE_GRACE, REFRESH};
use pdserve_planner::model::Slo;
use pdserve_planner::{Actuator, Applied, Fleet, Made, Member, Planner, PlannerConfig};
use pdserve_protocol::ServeError;
use pdserve_router::{Mode, Router};
use pdserve_telemetry::metrics::Metrics;
use pdserve_types::{Assignment, Role};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    nats: NatsArgs,
    /// The model the fleet serves (only its nodes are planned). Repeat for a fleet
    /// of several models: each model's nodes are planned apart, from that model's
    /// traffic [default: default].
    #[arg(long = "model")]
    models: Vec<String>,
    /// The time-to-first-token objective, in milliseconds.
    #[arg(long, default_value_t = 5000.0)]
    slo_ttft_ms: f64,
    /// The time-per-output-token objective, in milliseconds.
    #[arg(long, default_value_t = 50.0)]
    slo_tpot_ms: f64,
    /// This planner's name in the lease (default: host-pid).
    #[arg(long)]
    id: Option<String>,
    /// Serve `/metrics` (decisions, roles) on this address.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    #[command(flatten)]
    security: super::Security,
}

/// How long a worker has to take a written role before the switch counts as failed.
const TAKE_WAIT: Duration = Duration::from_secs(2);

pub fn run(a: Args) -> anyhow::Result<()> {
    let key = a.security.key()?;
    let Some(cfg) = a.nats.config("pdserve-planner", Some(&key)) else {
        anyhow::bail!("give --nats URL: the fleet's NATS server")
    };
    if !(a.slo_ttft_ms > 0.0 && a.slo_tpot_ms > 0.0) {
        anyhow::bail!("--slo-ttft-ms and --slo-tpot-ms must be positive");
    }
    let models = super::frontend::model_specs(&a.models)
        .iter()
        .map(|m| Ok(super::load_meta(m)?.name))
        .collect::<anyhow::Result<Vec<String>>>()?;
    let holder = a.id.clone().unwrap_or_else(default_id);
    let slo = Slo::from_ms(a.slo_ttft_ms, a.slo_tpot_ms);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async move {
        let metrics = Metrics::new();
        if let Some(addr) = a.metrics {
            let listener = tokio::net::TcpListener::bind(addr).await?;
            tracing::info!("pdserve planner: metrics at http://{}/metrics", listener.local_addr()?);
            tokio::spawn(pdserve_frontend::serve_metrics(listener, metrics.clone()));
        }
        // A router per model: its view of that model's workers is what its planner plans.
        let router = || {
            let r = Router::new([], Mode::Auto, Default::default(), tokio::runtime::Handle::current())
                .with_telemetry(Arc::new(metrics.clone()));
            Arc::new(r)
        };
        let targets: Targets = models
            .into_iter()
            .map(|model| Target { key: key.clone(), router: router(), metrics: metrics.clone(), model })
            .collect::<Vec<_>>()
            .into();
        let nodes = Arc::new(FleetNames::default());
        tokio::spawn(follow_fleet(cfg.clone(), targets.clone(), nodes.clone()));
        tokio::spawn(take_traffic(cfg.clone(), targets.clone()));
        let (stop, stopping) = tokio::sync::watch::channel(false);
        let pc = PlannerConfig::new(slo);
        let planning = tokio::spawn(lead_when_possible(cfg, holder.clone(), targets, nodes, pc, stopping));
        tracing::info!(holder = %holder, "pdserve planner: waiting for the lease");
        super::http::signal().await;
        tracing::info!("pdserve planner: stopping");
        // A lease held is given up, so a standby takes over at once.
        let _ = stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(3), planning).await;
        anyhow::Ok(())
    })
}

fn default_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    NodeId::sanitized(&format!("{}-{}", host.trim(), std::process::id())).to_string()
}

/// Feeds every frontend's traffic into the signals of its model's router (the first
/// model's where a batch names none), and their measured prefill paces into the
/// entries of the workers measured.
async fn take_traffic(cfg: NatsConfig, to: Targets) {
    let mut batches = pdserve_fleet::follow_traffic(cfg);
    while let Some(TrafficBatch { model, samples, prefill_pace, .. }) = batches.recv().await {
        let Some(t) = to.of(&model).or_else(|| to.iter().next().filter(|_| model.is_empty())) else { continue };
        for s in samples {
            t.router.signals.record(s);
        }
        for e in to.iter().flat_map(|t| t.router.workers().snapshot()) {
            if let Some(&pace) = prefill_pace.get(e.name()) {
                e.adopt_prefill_pace(pace);
            }
        }
    }
}

/// Waits for the lease, plans while it holds it, and waits again once it is lost,
/// until `stop` says so.
async fn lead_when_possible(
    cfg: NatsConfig,
    holder: String,
    targets: Targets,
    nodes: Arc<FleetNames>,
    pc: PlannerConfig,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let bus = tokio::select! {
        bus = Bus::connect_patiently(&cfg) => bus,
        _ = stop.changed() => return,
    };
    let mut said_who = String::new();
    while !*stop.borrow() {
        match Lease::take(&bus, &holder).await {
            Ok(Some(lease)) => lead(lease, bus.client(), &targets, &nodes, pc, &mut stop).await,
            Ok(None) => {
                let who = pdserve_fleet::read_plan(&bus).await.ok().flatten().map(|p| p.holder).unwrap_or_default();
                if who != said_who {
                    tracing::info!(holder = %who, "another planner holds the lease; standing by");
                    said_who = who;
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot reach the planner lease"),
        }
        tokio::select! {
            () = tokio::time::sleep(REFRESH) => {}
            _ = stop.changed() => {}
        }
    }
}

/// Plans each model's workers under `lease` until it is lost, renewing it every
/// [`REFRESH`], or until `stop`, which gives it up.
async fn lead(
    lease: Lease,
    nats: async_nats::Client,
    targets: &Targets,
    nodes: &Arc<FleetNames>,
    pc: PlannerConfig,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) {
    let holder = lease.plan().holder.clone();
    tracing::info!(holder = %holder, "took the planner lease; planning");
    let lease = Arc::new(tokio::sync::Mutex::new(lease));
    let act = Arc::new(ToBucket { lease: lease.clone(), nodes: nodes.clone(), nats, holder });
    let planners: Vec<_> = targets.iter().map(|t| Planner::spawn_with(t.router.clone(), pc, act.clone())).collect();
    let stop_planning = || planners.iter().for_each(|p| p.abort());
    let mut renewed = Instant::now();
    loop {
        tokio::select! {
            () = tokio::time::sleep(REFRESH) => {}
            _ = stop.changed() => {
                stop_planning();
                lease.lock().await.release().await;
                return tracing::info!("gave the planner lease up");
            }
        }
        let mut l = lease.lock().await;
        let outcome = match l.retain(|id| nodes.holds(id)).await {
            Ok(()) => l.renew().await,
            Err(e) => Err(e),
        };
        match outcome {
            Ok(()) => renewed = Instant::now(),
            Err(LeaseError::Lost) => {
                tracing::warn!("the planner lease was taken over; standing by");
                break;
            }
            Err(e) if renewed.elapsed() > LEASE_GRACE => {
                tracing::warn!(error = %e, "cannot renew the planner lease in time; standing by");
                break;
            }
            Err(e) => tracing::warn!(error = %e, "cannot renew the planner lease; retrying"),
        }
    }
    stop_planning();
}

/// Carries a decision out by writing it into the plan, then handing each worker its
/// role directly as well.
struct ToBucket {
    lease: Arc<tokio::sync::Mutex<Lease>>,
    nodes: Arc<FleetNames>,
    /// Where decisions go out as Leaves.
    nats: async_nats::Client,
    holder: String,
}

impl Actuator for ToBucket {
    fn apply<'a>(&'a self, fleet: &'a dyn Fleet, moves: &'a [(Member, Role)]) -> Applied<'a> {
        Box::pin(async move {
            let mut lease = self.lease.lock().await;
            let mut asked: Vec<Result<(NodeId, Assignment), ServeError>> = Vec::with_capacity(moves.len());
            for (m, role) in moves {
                let held = m.assignment.epoch;
                asked.push(match self.nodes.id_of(&m.name) {
                    // The next epoch after both what the worker holds and what an
                    // earlier plan asked of it.
                    Some(id) => {
                        let planned = lease.plan().roles.get(&id).map_or(held, |a| a.epoch.max(held));
                        Ok((id, Assignment::new(*role, planned.next())))
                    }
                    None => Err(ServeError::NoWorker(format!("{} is not in the fleet bucket", m.name))),
                });
            }
            let writes = asked.iter().filter_map(|a| a.as_ref().ok().cloned());
            if let Err(err) = lease.write(writes).await {
                let why = format!("the plan was not written: {err}");
                return moves.iter().map(|_| Err(ServeError::Internal(why.clone()))).collect();
            }
            drop(lease);
            let mut out = Vec::with_capacity(moves.len());
            for ((m, _), a) in moves.iter().zip(asked) {
                out.push(match a {
                    Ok((_, a)) => taken(fleet, &m.name, a).await,
                    Err(err) => Err(err),
                });
            }
            out
        })
    }

    /// Publishes the decision as a Leaf on [`DECISION_SUBJECT`], for the forest and
    /// for operators (`nats sub infer.planner.decision`). Best effort: a Leaf NATS
    /// cannot take is dropped, never waited for.
    fn made(&self, m: &Made<'_>) {
        let leaf = Leaf::new(DECISION_SUBJECT, DECISION_SOURCE, decision_data(m, &self.holder, &self.nodes));
        let nats = self.nats.clone();
        tokio::spawn(async move {
            if let Err(e) = nats.publish(DECISION_SUBJECT, leaf.to_bytes().into()).await {
                tracing::warn!(error = %e, "decision Leaf dropped");
            }
        });
    }
}

/// The Wind subject of the planner's decisions, and the Leaves' source.
const DECISION_SUBJECT: &str = "infer.planner.decision";
const DECISION_SOURCE: &str = "nim:pdserve-planner";

/// A decision's Leaf data: the vectors, the predictions, the inputs, the outcomes.
fn decision_data(m: &Made<'_>, holder: &str, nodes: &FleetNames) -> serde_json::Value {
    let d = m.decision;
    let predicted = |p: &pdserve_planner::model::Prediction| {
        serde_json::json!({"goodput": p.goodput, "ttft_attained": p.ttft_attained,
            "tpot_attained": p.tpot_attained, "utilisation": p.utilisation, "strain": p.strain})
    };
    let (t, r) = (m.traffic, m.rates);
    let switched: Vec<serde_json::Value> = m
        .outcomes
        .iter()
        .map(|(worker, outcome)| {
            let node = nodes.id_of(worker).map(|id| id.to_string());
            match outcome {
                Ok(a) => serde_json::json!({"worker": worker, "node_id": node, "role": a.role, "epoch": a.epoch.0}),
                Err(e) => serde_json::json!({"worker": worker, "node_id": node, "error": e.to_string()}),
            }
        })
        .collect();
    serde_json::json!({
        "planner": holder,
        "from": d.from.to_string(),
        "to": d.to.to_string(),
        "reason": d.reason,
        "predicted": {"now": predicted(&d.now), "then": predicted(&d.then)},
        "traffic": {"rate": t.rate, "isl_p10_p50_p90": t.isl, "osl_p10_p50_p90": t.osl,
            "ttft_attained": t.ttft_attained, "tpot_attained": t.tpot_attained, "window_s": t.seconds},
        "measured": {"prefill_ms_per_token": r.prefill_s_per_token * 1e3, "step_ms": r.step.fixed * 1e3,
            "step_ms_per_seq": r.step.per_row * 1e3, "step_us_per_context_token": r.step.per_context * 1e6,
            "kv_tokens": r.kv_tokens},
        "switched": switched,
        "control_ms": m.control_ms,
    })
}

/// Hands `worker` its planned assignment `a` over its control connection too:
/// the plan is what survives (a restarted worker, a lost connection), this is the
/// fast path and the confirmation. Whichever reaches the worker first switches it;
/// the other finds the epoch taken and changes nothing.
async fn taken(fleet: &dyn Fleet, worker: &str, a: Assignment) -> Result<Assignment, ServeError> {
    tokio::time::timeout(TAKE_WAIT, fleet.assign(worker, a))
        .await
        .map_err(|_| ServeError::Timeout(format!("{worker} did not take {a} within {} s", TAKE_WAIT.as_secs())))?
}
