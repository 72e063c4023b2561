//! The planner: a controller that gives each worker the role the traffic needs.
//!
//! Every tick it reads the traffic of the last window ([`signals`]) and what the
//! workers measured of themselves (prefill pace, decode step times), asks the
//! [`model`] for the goodput of each role vector at the SLOs, and switches roles in
//! place when another vector is predicted to do clearly better, for long enough,
//! and not too soon after the last switch. Every decision is logged with its inputs
//! and counted in `pdserve_planner_decisions_total{from,to,reason}`.

mod fleet;
pub mod model;
pub mod signals;

pub use fleet::{Boxed, Fleet, Measures, Member};
use model::{predict, Prediction, Rates, Shape, Slo};
use pdserve_protocol::ServeError;
use pdserve_types::{Assignment, DecodeSteps, PrefillSteps, Role};
use signals::Traffic;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How the planner decides.
#[derive(Debug, Clone, Copy)]
pub struct PlannerConfig {
    pub slo: Slo,
    /// How often it looks.
    pub tick: Duration,
    /// A better vector must be predicted this much better (relative goodput)...
    pub margin: f64,
    /// ...on this many ticks in a row...
    pub hold: u32,
    /// ...and this long after the last switch.
    pub cooldown: Duration,
    /// A worker leaving decode whose sequences have not finished by then goes back.
    pub drain: Duration,
}

impl PlannerConfig {
    pub fn new(slo: Slo) -> Self {
        PlannerConfig {
            slo,
            tick: Duration::from_secs(1),
            margin: 0.15,
            hold: 3,
            cooldown: Duration::from_secs(15),
            drain: Duration::from_secs(60),
        }
    }
}

/// Goodput differences below this many requests per second are noise.
const MIN_GAIN: f64 = 0.02;

/// Goodputs this close to `top` are taken as equal: the model's attainments are
/// not finer than a percent.
fn tie(top: f64) -> f64 {
    MIN_GAIN.max(0.01 * top)
}

/// A decision to move from one vector to another, and what it rests on.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub from: Shape,
    pub to: Shape,
    pub now: Prediction,
    pub then: Prediction,
    pub reason: &'static str,
}

/// What the running shape measurably served over the window, where it alone
/// served it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// The share of requests it met both SLOs for.
    pub attained: f64,
    /// Those requests per second.
    pub goodput: f64,
    /// Whether the prefill queues hold at most one long prompt per worker now.
    pub queue_clear: bool,
}

impl Measured {
    /// The running shape served the whole window in time and nothing piles up in
    /// front of it: whatever the model says of the rate, it keeps up. A saturated
    /// closed loop looks like this (its clients send as fast as they are served); an
    /// open-loop overload does not for long, its queue growing within a tick or two.
    fn keeps_up(&self) -> bool {
        self.attained >= 1.0 - ATTAINMENT_NOISE && self.queue_clear
    }
}

/// The best of `shapes` for the traffic, if clearly better than `current`, or if
/// `current` measurably misses the SLOs and the best is predicted to serve them
/// with room.
pub fn best_move(
    current: Shape,
    shapes: &[Shape],
    predict: impl Fn(Shape) -> Prediction,
    margin: f64,
    measured: Option<Measured>,
) -> Option<Decision> {
    let now = predict(current);
    // Taking a worker from a role is safe only if those left keep up.
    let fits = |p: &Prediction| p.utilisation < 0.9 || now.utilisation >= OVERLOADED;
    let scored: Vec<(Shape, Prediction)> =
        shapes.iter().map(|&s| (s, predict(s))).filter(|(s, p)| *s == current || fits(p)).collect();
    let top = scored.iter().map(|(_, p)| p.goodput).fold(0.0, f64::max);
    // Shapes within noise of the best serve the same traffic. The fewest prefill
    // workers among them sit at the prefill queue's edge, the most at the decoders':
    // the least strained is the one the next shift of traffic leaves serving.
    let (to, then) = scored
        .into_iter()
        .filter(|(_, p)| p.goodput >= top - tie(top))
        .min_by(|a, b| a.1.strain.total_cmp(&b.1.strain).then(a.0.cmp(&b.0)))?;
    // Saturated, a closed loop's arrivals follow what it serves, so the model calls
    // the running shape overloaded and scores it near nothing while it measurably
    // serves part of its requests in time. Trading it for another shape predicted
    // overloaded too must beat what it serves, not that score: otherwise the two
    // scores' noise moves the workers back and forth. So must trading it for any
    // shape while it measurably keeps up: otherwise the planner leaves a shape that
    // serves everything for one predicted to serve less, and comes back.
    // With nothing measured yet (a shape just switched to, or too few requests
    // ended), a shape predicted overloaded is not moved to: its score is the
    // model's guess at a backlog, and so is the one it would beat. A closed loop
    // stepping up its concurrency fills the window with one burst of arrivals that
    // reads as an overload of every shape for a tick or two.
    let worth = match measured {
        Some(m) if then.utilisation >= OVERLOADED || m.keeps_up() => now.goodput.max(m.goodput),
        None if then.utilisation >= OVERLOADED => return None,
        _ => now.goodput,
    };
    let gain = then.goodput - worth > MIN_GAIN;
    let better = then.goodput > worth * (1.0 + margin);
    // The margin keeps the planner from trading a shape that serves for another on
    // a prediction's noise. Leaving one that measurably misses for one predicted to
    // serve with room is no such trade: the way back would need the new one to miss.
    let missing = measured.is_some_and(|m| {
        m.attained < 1.0 - ATTAINMENT_NOISE
            && then.strain < 1.0
            && then.ttft_attained * then.tpot_attained >= m.attained + ATTAINMENT_NOISE
    });
    let moves = to != current && gain && (better || missing);
    moves.then(|| Decision { from: current, to, now, then, reason: reason(&now, &then) })
}

/// Whether a move seen on `seen` ticks in a row is made now. A vector whose queue
/// grows without end is left at once for one predicted to keep up, hold and cooldown
/// notwithstanding: every tick spent there adds to a queue that outlasts the switch.
fn due(d: &Decision, seen: u32, hold: u32, cooling: bool) -> bool {
    urgent(d) || (seen >= hold && !cooling)
}

fn urgent(d: &Decision) -> bool {
    d.now.utilisation >= OVERLOADED && d.then.utilisation < 0.9
}

/// Attainment differences below this are noise.
const ATTAINMENT_NOISE: f64 = 0.05;

/// Whether what the running vector measurably attains bears a move out. A move for
/// TPOT's sake needs TPOT misses in the window: the decode line is fitted to the
/// contexts traffic had so far, and a step's time need not stay on that line at the
/// contexts new traffic brings, while what the workers now attain is measured.
/// (TTFT misses show only after a queue has built, too late to wait for.)
fn borne_out(d: &Decision, t: &Traffic) -> bool {
    d.reason != "tpot" || t.tpot_attained < d.then.tpot_attained - ATTAINMENT_NOISE
}

/// Predicted utilisation at which a vector's queue grows without end.
const OVERLOADED: f64 = 0.97;

fn reason(now: &Prediction, then: &Prediction) -> &'static str {
    if now.utilisation >= OVERLOADED {
        "overloaded"
    } else if then.ttft_attained - now.ttft_attained >= then.tpot_attained - now.tpot_attained {
        "ttft"
    } else {
        "tpot"
    }
}

/// When the planner last switched roles, and when it last chose to.
#[derive(Debug, Default)]
struct Switched {
    any: Option<Instant>,
    /// The last switch that was not urgent. An urgent one is made on the first tick
    /// that shows an overload, often mid-shift, so it starts no cooldown: the shape
    /// the shift settles on may follow it after the hold.
    chosen: Option<Instant>,
}

impl Switched {
    fn record(&mut self, urgent: bool) {
        let now = Instant::now();
        self.any = Some(now);
        if !urgent {
            self.chosen = Some(now);
        }
    }

    fn cooling(&self, cooldown: Duration) -> bool {
        self.chosen.is_some_and(|t| t.elapsed() < cooldown)
    }

    /// Whether the `window`'s requests are all the running shape's: two windows
    /// since the last switch (a request that ended in the window began within the
    /// one before).
    fn settled(&self, window: Duration) -> bool {
        self.any.is_none_or(|t| t.elapsed() >= 2 * window)
    }
}

/// What an [`Actuator`] answers: each move's outcome, in the order asked.
pub type Applied<'a> = Boxed<'a, Vec<Result<Assignment, ServeError>>>;

/// How a decision reaches the workers: in one process the fleet switches each one
/// itself ([`Direct`]); a fleet planner writes the roles where the workers take them.
pub trait Actuator: Send + Sync + 'static {
    /// Gives each worker of `moves` its role, as one step.
    fn apply<'a>(&'a self, fleet: &'a dyn Fleet, moves: &'a [(Member, Role)]) -> Applied<'a>;

    /// A decision was carried out (a fleet planner publishes it); nothing by default.
    fn made(&self, _made: &Made<'_>) {}
}

/// A decision as carried out: what it rested on, and each worker's outcome.
pub struct Made<'a> {
    pub decision: &'a Decision,
    pub traffic: &'a Traffic,
    pub rates: &'a Rates,
    /// Each switched worker's name and what it holds now, or why it did not switch.
    pub outcomes: Vec<(String, Result<Assignment, ServeError>)>,
    /// From the decision to the last worker's answer.
    pub control_ms: f64,
}

/// Switches each worker over its own connection ([`Fleet::assign`]).
pub struct Direct;

impl Actuator for Direct {
    fn apply<'a>(&'a self, fleet: &'a dyn Fleet, moves: &'a [(Member, Role)]) -> Applied<'a> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(moves.len());
            for (m, role) in moves {
                out.push(fleet.assign(&m.name, m.assignment.switch(*role)).await);
            }
            out
        })
    }
}

/// The running controller.
pub struct Planner {
    fleet: Arc<dyn Fleet>,
    cfg: PlannerConfig,
    act: Arc<dyn Actuator>,
    /// Consecutive ticks on which some vector was clearly better.
    pending: u32,
    switched: Switched,
    /// Decode-only steps of workers that left the set, kept so the fit survives them.
    steps: BTreeMap<String, DecodeSteps>,
    /// Each worker's KV capacity in tokens, as its stats last said.
    kv_tokens: BTreeMap<String, usize>,
    /// Each worker's prefill-step sums when its pace was last taken, and that pace
    /// as `(fixed seconds a step, seconds a token)`, over at least
    /// [`PACE_FROM_TOKENS`] prompt tokens.
    prefill_pace: BTreeMap<String, (PrefillSteps, Option<(f64, f64)>)>,
    /// Earlier windows of traffic, one per window length, over the last [`MEMORY`].
    past: VecDeque<(Instant, Traffic)>,
}

/// Prompt tokens a worker's prefill pace is taken over: enough steps that one
/// prompt's length does not set it, few enough to follow the traffic's lengths.
const PACE_FROM_TOKENS: u64 = 32_768;

/// The traffic a tick weighs shapes by.
struct Seen<'a> {
    window: &'a Traffic,
    /// The newest [`RECENT`] seconds of it.
    recent: &'a Traffic,
    /// Whether the running shape falls behind the window.
    shifting: bool,
}

/// How far back the planner remembers traffic when it weighs a shape's strain.
const MEMORY: Duration = Duration::from_secs(60);
/// The newest part of the window, where a shift shows first...
const RECENT: Duration = Duration::from_secs(3);
/// ...and the requests it must hold to be judged by.
const RECENT_SAMPLES: usize = 30;

impl Planner {
    /// Starts planning the roles of `fleet`'s workers on its runtime.
    pub fn spawn(fleet: Arc<dyn Fleet>, cfg: PlannerConfig) {
        drop(Planner::spawn_with(fleet, cfg, Arc::new(Direct)));
    }

    /// Starts planning, each decision carried out by `act`; stops when the handle is
    /// aborted.
    pub fn spawn_with(fleet: Arc<dyn Fleet>, cfg: PlannerConfig, act: Arc<dyn Actuator>) -> JoinHandle<()> {
        let rt = fleet.runtime();
        let mut p = Planner {
            fleet,
            cfg,
            act,
            pending: 0,
            switched: Switched::default(),
            steps: BTreeMap::new(),
            kv_tokens: BTreeMap::new(),
            prefill_pace: BTreeMap::new(),
            past: VecDeque::new(),
        };
        rt.spawn(async move {
            let mut tick = tokio::time::interval(p.cfg.tick);
            // A tick that ran long (slow stats) is not made up for with a burst: ticks
            // in a row on one window would count as a move held for seconds.
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                p.tick().await;
            }
        })
    }

    async fn tick(&mut self) {
        let members = self.fleet.members();
        if members.len() < 2 {
            return;
        }
        self.read_steps(&members).await;
        // Roles as they are now: reading the stats took a while, and another planner's
        // switch may have landed meanwhile.
        let members = self.now(&members);
        let Some(rates) = self.rates(&members) else { return };
        let slo = self.cfg.slo;
        let traffic = self.fleet.traffic(None, &slo);
        let current = shape_of(&members);
        let shapes = Shape::candidates(members.len());
        log_scores(current, &shapes, &traffic, &rates, &slo);
        let recent = self.fleet.traffic(Some(RECENT), &slo);
        self.remember(&traffic);
        // The running shape falling behind on the window itself: a shift under way.
        let shifting = predict(current, &traffic, &rates, &slo).utilisation >= OVERLOADED;
        let seen = Seen { window: &traffic, recent: &recent, shifting };
        let measured = self.measured(&traffic, &rates, members.len());
        let decision = best_move(current, &shapes, |s| self.weigh(s, &seen, &rates), self.cfg.margin, measured);
        let Some(d) = decision.filter(|d| borne_out(d, &traffic)) else {
            self.pending = 0;
            return;
        };
        // The ticks in a row that wanted a move, wherever to: while a shift fills the
        // window the best target drifts tick by tick, and the latest is the best.
        let seen = self.pending + 1;
        self.pending = seen;
        let cooling = self.switched.cooling(self.cfg.cooldown);
        if !due(&d, seen, self.cfg.hold, cooling) {
            return;
        }
        tracing::info!(
            from = %d.from, to = %d.to, reason = d.reason,
            goodput_now = d.now.goodput, goodput_then = d.then.goodput,
            ttft_attained = traffic.ttft_attained, tpot_attained = traffic.tpot_attained,
            rate = traffic.rate, isl_p50 = traffic.isl[1], isl_p90 = traffic.isl[2],
            osl_p50 = traffic.osl[1], osl_p90 = traffic.osl[2],
            prefill_ms_per_token = rates.prefill_s_per_token * 1e3,
            step_ms = rates.step.fixed * 1e3, step_ms_per_seq = rates.step.per_row * 1e3,
            step_us_per_context_token = rates.step.per_context * 1e6, kv_tokens = rates.kv_tokens,
            prefill_fixed_ms = rates.prefill_fixed_s * 1e3, backlog_s = rates.backlog_s, "planner: switching roles"
        );
        self.fleet.decided(&d.from.to_string(), &d.to.to_string(), d.reason);
        let (outcomes, control_ms) = self.apply(&members, d.to).await;
        self.act.made(&Made { decision: &d, traffic: &traffic, rates: &rates, outcomes, control_ms });
        self.pending = 0;
        self.switched.record(urgent(&d));
    }

    /// `shape`'s prediction for the window, its strain the worst of that, of the
    /// recent seconds' and of the remembered windows'. Traffic that swings comes
    /// back: of the shapes that serve the window, the one that serves both what
    /// comes and what came before is the one that needs no switch next. While a
    /// shift is under way, a shape must also serve the recent seconds: the window
    /// still holds the old traffic, and a planner that followed it alone would
    /// climb a worker a tick. Otherwise they count only toward strain: a burst the
    /// queue absorbs, which a planner that served it would chase half a swing late.
    fn weigh(&self, shape: Shape, seen: &Seen<'_>, rates: &Rates) -> Prediction {
        let slo = &self.cfg.slo;
        let (traffic, recent) = (seen.window, seen.recent);
        let mut p = predict(shape, traffic, rates, slo);
        let worst = self.past.iter().map(|(_, t)| predict(shape, t, rates, slo).strain).fold(0.0, f64::max);
        p.strain = p.strain.max(worst);
        if recent.samples.len() >= RECENT_SAMPLES {
            let r = predict(shape, recent, rates, slo);
            if seen.shifting {
                let share = |p: &Prediction, t: &Traffic| p.goodput / t.rate;
                p.goodput = traffic.rate * share(&p, traffic).min(share(&r, recent));
            }
            p.strain = p.strain.max(r.strain);
        }
        p
    }

    /// What the running shape served of the window, once the window's requests are
    /// its own and enough of them ended to judge by.
    fn measured(&self, traffic: &Traffic, rates: &Rates, workers: usize) -> Option<Measured> {
        let long_prompt = rates.prefill_fixed_s + traffic.isl[2] as f64 * rates.prefill_s_per_token;
        let queue_clear = rates.backlog_s <= workers as f64 * long_prompt;
        let m = Measured { attained: traffic.attained, goodput: traffic.rate * traffic.attained, queue_clear };
        (self.switched.settled(Duration::from_secs_f64(traffic.seconds)) && traffic.ended >= RECENT_SAMPLES)
            .then_some(m)
    }

    /// Keeps a window of traffic once a window length has passed since the last kept,
    /// and forgets those older than [`MEMORY`].
    fn remember(&mut self, traffic: &Traffic) {
        let now = Instant::now();
        let spacing = Duration::from_secs_f64(traffic.seconds.max(1.0));
        if self.past.back().is_none_or(|(at, _)| now - *at >= spacing) && !traffic.samples.is_empty() {
            self.past.push_back((now, traffic.clone()));
        }
        while self.past.front().is_some_and(|(at, _)| now - *at > MEMORY) {
            self.past.pop_front();
        }
    }

    /// Each worker's decode-only step sums and KV capacity, as its stats say.
    async fn read_steps(&mut self, members: &[Member]) {
        for m in members {
            if let Ok(s) = self.fleet.measures(&m.name).await {
                self.steps.insert(m.name.clone(), s.decode_steps);
                let (taken, pace) = self.prefill_pace.entry(m.name.clone()).or_default();
                let new = s.prefill_steps.since(taken);
                if new.tokens >= PACE_FROM_TOKENS {
                    (*taken, *pace) = (s.prefill_steps, new.fit());
                }
                self.kv_tokens.insert(m.name.clone(), s.kv_tokens);
            }
        }
    }

    /// The measured rates, once every one of them was measured.
    fn rates(&self, members: &[Member]) -> Option<Rates> {
        let mut all = DecodeSteps::default();
        for s in self.steps.values() {
            all.add(s);
        }
        let step = all.fit()?;
        let (fixed, prefill) = self.prefill_rates(members, step.fixed)?;
        // The smallest pool bounds what a decoder may be asked to hold.
        let kv = members.iter().filter_map(|m| self.kv_tokens.get(&m.name)).min().copied().unwrap_or(0);
        let backlog = self.fleet.prefill_backlog((fixed, prefill));
        Some(Rates {
            prefill_s_per_token: prefill,
            prefill_fixed_s: fixed,
            step,
            kv_tokens: kv as f64,
            backlog_s: backlog,
        })
    }

    /// A prompt's `(fixed seconds, seconds per token)` of prefill. From the workers'
    /// own prefill steps where they took any (the median worker's): those hold
    /// every cost a prompt brings, a step's fixed cost included, and nothing of the
    /// queues around them. Near the edge, where it matters, each step carries a
    /// prompt per slot, which share its fixed cost. Before any (workers that only
    /// ever mixed prefill into decode steps), the fastest pace the router timed
    /// against a queue, the closest to a worker prefilling alone, and the fixed cost
    /// the decode steps measured (`step_fixed`): a step pays it whatever it holds.
    fn prefill_rates(&self, members: &[Member], step_fixed: f64) -> Option<(f64, f64)> {
        let stepped: Vec<(f64, f64)> = members.iter().filter_map(|m| self.prefill_pace.get(&m.name)?.1).collect();
        let (fixed, pace) = match median(stepped.iter().map(|p| p.1).collect()) {
            Some(pace) => (median(stepped.iter().map(|p| p.0).collect()).unwrap_or(0.0), pace),
            None => (step_fixed, members.iter().filter_map(|m| m.timed_prefill).min_by(f64::total_cmp)?),
        };
        Some((fixed / self.fleet.prefill_slots() as f64, pace))
    }

    /// `members` with the roles and loads they have now (one that left the usable
    /// set is kept as it was).
    fn now(&self, members: &[Member]) -> Vec<Member> {
        let live = self.fleet.members();
        let now = |m: &Member| live.iter().find(|l| l.name == m.name).cloned().unwrap_or_else(|| m.clone());
        members.iter().map(now).collect()
    }

    /// Gives the workers the roles of `to`, moving as few as possible: prefill goes to
    /// those already prefilling, then to the least loaded. One that stops decoding
    /// hands its sequences to the decoders (or finishes them in place, see [`drain`]).
    /// Answers with each switched worker's outcome, and the milliseconds they took.
    async fn apply(&self, members: &[Member], to: Shape) -> (Vec<(String, Result<Assignment, ServeError>)>, f64) {
        let members = self.now(members);
        let mut order: Vec<&Member> = members.iter().collect();
        order.sort_by_key(|m| (m.assignment.role != Role::Prefill, m.load));
        let moves: Vec<(Member, Role)> = order
            .into_iter()
            .enumerate()
            .map(|(i, m)| match to.mixed {
                0 if i < to.prefill => (m.clone(), Role::Prefill),
                0 => (m.clone(), Role::Decode),
                _ => (m.clone(), Role::Mixed),
            })
            .filter(|(m, role)| m.assignment.role != *role)
            .collect();
        let asked = Instant::now();
        let outcomes = self.act.apply(&*self.fleet, &moves).await;
        let control_ms = pdserve_types::millis(asked.elapsed());
        let mut done = Vec::with_capacity(moves.len());
        for ((m, role), outcome) in moves.iter().zip(outcomes) {
            match &outcome {
                Ok(now) => tracing::info!(worker = m.name, to = %now, control_ms, "role switched"),
                Err(err) => tracing::warn!(worker = m.name, error = %err, "role switch refused"),
            }
            let from = m.assignment.role;
            if outcome.is_ok() && from.decodes() && !role.decodes() {
                let (fleet, act, name, limit) = (self.fleet.clone(), self.act.clone(), m.name.clone(), self.cfg.drain);
                self.fleet.runtime().spawn(async move { drain(fleet, act, name, from, limit).await });
            }
            done.push((m.name.clone(), outcome));
        }
        (done, control_ms)
    }
}

/// How long the planner waits for a worker to answer while it drains.
const ASK_WAIT: Duration = Duration::from_millis(500);

/// Empties a worker that left decode: its sequences move to the decoders left (by
/// their KV), or, with none usable, finish in place; past `limit`, it gets its old
/// role back.
async fn drain(fleet: Arc<dyn Fleet>, act: Arc<dyn Actuator>, name: String, from: Role, limit: Duration) {
    let started = Instant::now();
    while started.elapsed() < limit {
        let others = fleet.members().iter().any(|o| o.name != name && o.assignment.role.decodes());
        if others {
            // Again each round: a reservation granted before the switch lands later.
            if let Ok(Err(err)) = tokio::time::timeout(ASK_WAIT, fleet.move_decodes(&name)).await {
                tracing::debug!(worker = name, error = %err, "decodes not handed back");
            }
        }
        // A prefill runs whole within one turn of the worker's loop, so its stats
        // never count one: whatever they count is a decode (a fenced prefill worker
        // takes no new ones).
        match fleet.measures(&name).await {
            Ok(s) if s.busy == 0 => {
                let s = started.elapsed().as_secs_f64();
                return tracing::info!(worker = name, drain_s = s, "decodes finished after the role switch");
            }
            Err(ServeError::Timeout(_)) | Ok(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(_) => return,
        }
    }
    tracing::warn!(worker = name, limit_s = limit.as_secs(), "decodes outlasted the drain limit; switching back");
    // Its assignment as it is now, after the switch away.
    let Some(now) = fleet.members().into_iter().find(|m| m.name == name) else {
        return tracing::warn!(worker = name, "switching back failed: the worker is no longer usable");
    };
    for outcome in act.apply(&*fleet, &[(now, from)]).await {
        if let Err(err) = outcome {
            tracing::warn!(worker = name, error = %err, "switching back failed");
        }
    }
}

/// The lower median: of two workers, the faster.
fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len().saturating_sub(1) / 2).copied()
}

/// The planner's view of every shape on this tick, at debug level: goodput, the
/// shares meeting TTFT and TPOT, utilisation and strain.
fn log_scores(current: Shape, shapes: &[Shape], traffic: &Traffic, rates: &Rates, slo: &Slo) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    let scores: Vec<String> = shapes
        .iter()
        .map(|&s| {
            let p = predict(s, traffic, rates, slo);
            let (g, tt, tp, u, st) = (p.goodput, p.ttft_attained, p.tpot_attained, p.utilisation, p.strain);
            format!("{s}={g:.2}({tt:.2}/{tp:.2}/{u:.2}/{st:.2})")
        })
        .collect();
    tracing::debug!(
        current = %current, rate = traffic.rate, isl_p50 = traffic.isl[1], osl_p50 = traffic.osl[1],
        prefill_ms_per_token = rates.prefill_s_per_token * 1e3,
        step_ms = rates.step.fixed * 1e3, step_ms_per_seq = rates.step.per_row * 1e3,
        step_us_per_context_token = rates.step.per_context * 1e6, kv_tokens = rates.kv_tokens,
        prefill_fixed_ms = rates.prefill_fixed_s * 1e3, backlog_s = rates.backlog_s, predicted = %scores.join(" "), "planner tick"
    );
}

/// The role vector of `members`.
fn shape_of(members: &[Member]) -> Shape {
    let count = |r: Role| members.iter().filter(|m| m.assignment.role == r).count();
    let (prefill, decode, mixed) = (count(Role::Prefill), count(Role::Decode), count(Role::Mixed));
    // A vector that mixes mixed and dedicated workers is weighed as all mixed.
    match (prefill, decode) {
        (p, d) if mixed == 0 && p > 0 && d > 0 => Shape { prefill: p, decode: d, mixed: 0 },
        _ => Shape { prefill: 0, decode: 0, mixed: members.len() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pred(goodput: f64) -> Prediction {
        Prediction { goodput, ttft_attained: 1.0, tpot_attained: 1.0, utilisation: 0.5, strain: 0.5 }
    }

    /// The router's traffic window.
    const WINDOW: Duration = Duration::from_secs(12);

    const MIXED: Shape = Shape { prefill: 0, decode: 0, mixed: 2 };
    const SPLIT: Shape = Shape { prefill: 1, decode: 1, mixed: 0 };

    #[test]
    fn a_move_needs_a_clear_gain() {
        let shapes = [MIXED, SPLIT];
        let g = |mixed: f64, split: f64| move |s: Shape| pred(if s == MIXED { mixed } else { split });
        assert_eq!(best_move(MIXED, &shapes, g(1.0, 1.1), 0.15, None), None, "10 % is within the margin");
        let d = best_move(MIXED, &shapes, g(1.0, 1.3), 0.15, None).unwrap();
        assert_eq!((d.from, d.to), (MIXED, SPLIT));
        // Equal predictions never move, whichever shape holds now.
        assert_eq!(best_move(SPLIT, &shapes, g(1.0, 1.0), 0.15, None), None);
        assert_eq!(best_move(MIXED, &shapes, g(0.0, 0.01), 0.15, None), None, "gains below noise are not moves");
    }

    #[test]
    fn a_shape_that_measurably_misses_is_left_within_the_margin() {
        let shapes = [MIXED, SPLIT];
        let g = |split: Prediction| move |s: Shape| if s == MIXED { pred(1.0) } else { split };
        let seen = |attained| Some(Measured { attained, goodput: attained, queue_clear: false });
        let serves = pred(1.08);
        assert_eq!(best_move(MIXED, &shapes, g(serves), 0.15, seen(1.0)), None, "it serves: the margin holds");
        assert_eq!(best_move(MIXED, &shapes, g(serves), 0.15, seen(0.97)), None, "misses within noise");
        assert_eq!(best_move(MIXED, &shapes, g(serves), 0.15, seen(0.9)).unwrap().to, SPLIT);
        let edge = Prediction { strain: 1.02, ..serves };
        assert_eq!(best_move(MIXED, &shapes, g(edge), 0.15, seen(0.9)), None, "the target has no room");
        let short = Prediction { tpot_attained: 0.93, ..serves };
        assert_eq!(best_move(MIXED, &shapes, g(short), 0.15, seen(0.9)), None, "not clearly better than measured");
    }

    #[test]
    fn an_overloaded_shape_is_traded_for_another_only_for_more_than_it_measurably_serves() {
        // A saturated closed loop: both shapes past the edge, the running one scored
        // nothing, the other a little, while the running one serves 0.27 req/s in time.
        let shapes = [MIXED, SPLIT];
        let over = |goodput| Prediction { utilisation: 1.3, ..pred(goodput) };
        let g = |split: Prediction| move |s: Shape| if s == MIXED { over(0.0) } else { split };
        let serving = Some(Measured { attained: 0.2, goodput: 0.27, queue_clear: true });
        assert_eq!(best_move(MIXED, &shapes, g(over(0.24)), 0.15, serving), None, "less than it serves");
        // Nothing measured yet (a closed loop's step up reads as an overload of both
        // shapes for a tick or two): two guesses at a backlog are no grounds to move.
        assert_eq!(best_move(MIXED, &shapes, g(over(0.5)), 0.15, None), None, "nothing measured yet");
        assert_eq!(best_move(MIXED, &shapes, g(over(0.5)), 0.15, serving).unwrap().to, SPLIT, "clearly more");
        // A shape that keeps up is taken on its prediction, however much the running
        // one served of the window (a shift under way still holds the old traffic).
        let keeps_up = Prediction { utilisation: 0.8, ..pred(0.24) };
        assert_eq!(best_move(MIXED, &shapes, g(keeps_up), 0.15, serving).unwrap().to, SPLIT);
    }

    #[test]
    fn a_shape_that_serves_everything_with_no_queue_is_kept_whatever_its_score() {
        // A saturated closed loop on two mixed workers: scored overloaded at the
        // rate its own clients send, while it served the whole window in time with
        // the prefill queues empty. The split keeps up but is predicted to serve less.
        let shapes = [MIXED, SPLIT];
        let g = |s: Shape| match s == MIXED {
            true => Prediction { utilisation: 1.3, ..pred(0.0) },
            false => Prediction { utilisation: 0.8, ..pred(0.35) },
        };
        let seen = |attained, queue_clear| Some(Measured { attained, goodput: 1.33 * attained, queue_clear });
        assert_eq!(best_move(MIXED, &shapes, g, 0.15, seen(1.0, true)), None, "it keeps up");
        // A queue building up, or requests missed: an overload after all.
        assert_eq!(best_move(MIXED, &shapes, g, 0.15, seen(1.0, false)).unwrap().to, SPLIT);
        assert_eq!(best_move(MIXED, &shapes, g, 0.15, seen(0.2, true)).unwrap().to, SPLIT);
    }

    #[test]
    fn an_overloaded_vector_is_left_at_once_for_one_that_keeps_up() {
        let d = |now: f64, then: f64| Decision {
            from: MIXED,
            to: SPLIT,
            now: Prediction { utilisation: now, ..pred(0.1) },
            then: Prediction { utilisation: then, ..pred(1.0) },
            reason: "test",
        };
        assert!(due(&d(1.2, 0.6), 1, 3, true), "overloaded: no hold, no cooldown");
        assert!(!due(&d(1.2, 0.95), 1, 3, false), "the target would be near full too");
        assert!(!due(&d(0.8, 0.6), 2, 3, false), "not overloaded: the hold applies");
        assert!(!due(&d(0.8, 0.6), 3, 3, true), "and the cooldown");
        assert!(due(&d(0.8, 0.6), 3, 3, false));
    }

    #[tokio::test(start_paused = true)]
    async fn an_urgent_switch_starts_no_cooldown_and_every_switch_unsettles_the_window() {
        let cooldown = PlannerConfig::new(Slo { ttft_s: 1.0, tpot_s: 0.1 }).cooldown;
        let mut s = Switched::default();
        assert!(!s.cooling(cooldown) && s.settled(WINDOW), "no switch yet");
        s.record(true);
        assert!(!s.cooling(cooldown), "an urgent switch may be followed after the hold");
        assert!(!s.settled(WINDOW), "the window still holds the old shape's requests");
        tokio::time::advance(2 * WINDOW).await;
        assert!(s.settled(WINDOW));
        s.record(false);
        assert!(s.cooling(cooldown) && !s.settled(WINDOW));
        tokio::time::advance(cooldown).await;
        assert!(!s.cooling(cooldown));
    }

    #[test]
    fn a_move_for_tpot_waits_for_tpot_misses_to_be_measured() {
        let d = |reason| Decision { from: MIXED, to: SPLIT, now: pred(0.0), then: pred(1.0), reason };
        let seen = |tpot_attained| Traffic { tpot_attained, ..Traffic::default() };
        assert!(!borne_out(&d("tpot"), &seen(1.0)), "predicted misses the workers do not show");
        assert!(!borne_out(&d("tpot"), &seen(0.97)), "within noise");
        assert!(borne_out(&d("tpot"), &seen(0.6)));
        assert!(borne_out(&d("ttft"), &seen(1.0)), "queues show late: TTFT moves need no misses yet");
        assert!(borne_out(&d("overloaded"), &seen(1.0)));
    }

    #[test]
    fn of_shapes_serving_the_same_traffic_the_least_strained_is_taken() {
        // Sixteen workers, every split keeping up: few prefill workers run near the
        // prefill queue's edge, many near the decoders' TPOT.
        let shapes = Shape::candidates(16);
        let split = |p: usize| Shape { prefill: p, decode: 16 - p, mixed: 0 };
        let strained = |s: Shape| {
            let strain = match s.mixed {
                0 => 0.3 + 0.08 * (s.prefill as f64 - 6.0).abs(),
                _ => 2.0,
            };
            Prediction { strain, ..pred(if s.mixed == 0 { 10.0 } else { 1.0 }) }
        };
        let current = Shape { prefill: 0, decode: 0, mixed: 16 };
        assert_eq!(best_move(current, &shapes, strained, 0.15, None).unwrap().to, split(6));
        // A clearly better goodput still wins over less strain.
        let better = |s: Shape| match s == split(2) {
            true => Prediction { strain: 0.9, ..pred(10.5) },
            false => strained(s),
        };
        assert_eq!(best_move(current, &shapes, better, 0.15, None).unwrap().to, split(2));
        // Within a percent it is a tie.
        let tied = |s: Shape| match s == split(2) {
            true => Prediction { strain: 0.9, ..pred(10.05) },
            false => strained(s),
        };
        assert_eq!(best_move(current, &shapes, tied, 0.15, None).unwrap().to, split(6));
    }

    #[test]
    fn a_move_that_would_leave_survivors_near_full_is_not_made() {
        let shapes = [MIXED, SPLIT];
        let busy = |s: Shape| if s == SPLIT { Prediction { utilisation: 0.95, ..pred(2.0) } } else { pred(1.0) };
        assert_eq!(best_move(MIXED, &shapes, busy, 0.15, None), None);
    }
}
