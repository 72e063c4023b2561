//! The planner's cost model, from measured rates: given the traffic of the last
//! window and what the workers measured of themselves, the goodput each role vector
//! would give at the SLOs.
//!
//! Prefill is a queue: a prompt of `n` tokens takes `f + n × s` seconds of one
//! worker (`f` its share of a step's fixed cost, both measured from the workers' own
//! prefill steps where they took any), prompts wait as in an M/G/1 queue
//! (Pollaczek–Khinchine mean, exponential tail), and whatever is queued now delays
//! the next ones until the prefillers have worked it off; past its edge the queue
//! grows, and prompts miss once it passes their room (a swing it absorbs within
//! the TTFT objective costs nothing). Decode is a batch: a step of `B` sequences
//! takes `a + b·B`, where `b` is the per-sequence cost at the traffic's context
//! length (fitted to the workers' decode-only steps). Sequences share the steps as
//! jobs share a processor, so TPOT is `(a + b) / (1 − ρ)` with `ρ` the share of step
//! time the sequences' own parts take. A decoder also holds every sequence's KV, from
//! the reservation its prefill makes to its last token: a shape whose decoders would
//! run out of blocks is one whose requests fall back or wait, and scores nothing. A
//! mixed worker shares its time: decode advances only while it is not prefilling,
//! and each prompt chunk also pays for the decode step it rides with. Each sampled
//! request of the window is scored, so a bimodal mix counts as such rather than as
//! its mean.

use crate::signals::Traffic;
use pdserve_types::StepFit;

/// What the workers measured of themselves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    /// Prefill seconds per prompt token, on one worker...
    pub prefill_s_per_token: f64,
    /// ...and per prompt on a dedicated prefill worker, whatever its length (its
    /// share of a step's fixed cost).
    pub prefill_fixed_s: f64,
    /// Decode step seconds by batch size and context.
    pub step: StepFit,
    /// KV tokens one worker holds (0: unknown, not checked).
    pub kv_tokens: f64,
    /// Seconds of prefill queued now, over every worker, at the pace above.
    pub backlog_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    pub ttft_s: f64,
    pub tpot_s: f64,
}

impl Slo {
    /// From the milliseconds the CLI's `--slo-ttft-ms` and `--slo-tpot-ms` take.
    pub fn from_ms(ttft_ms: f64, tpot_ms: f64) -> Self {
        Slo { ttft_s: ttft_ms / 1e3, tpot_s: tpot_ms / 1e3 }
    }
}

/// How many workers serve in each role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shape {
    pub prefill: usize,
    pub decode: usize,
    pub mixed: usize,
}

impl Shape {
    pub fn workers(&self) -> usize {
        self.prefill + self.decode + self.mixed
    }

    /// The shapes the planner weighs for `n` workers: all mixed, and every split
    /// into dedicated prefill and decode workers.
    pub fn candidates(n: usize) -> Vec<Shape> {
        let mut all = vec![Shape { prefill: 0, decode: 0, mixed: n }];
        all.extend((1..n).map(|p| Shape { prefill: p, decode: n - p, mixed: 0 }));
        all
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.mixed {
            0 => write!(f, "{}P:{}D", self.prefill, self.decode),
            m => write!(f, "{m}M"),
        }
    }
}

/// The model's answer for one shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Requests per second that meet both SLOs.
    pub goodput: f64,
    pub ttft_attained: f64,
    pub tpot_attained: f64,
    /// Busiest fraction of time among the roles (≥ 1: the queue grows without end).
    pub utilisation: f64,
    /// How near its edge the nearest role runs: the larger of `utilisation` and the
    /// decoders' TPOT over its SLO, and over 1 where requests miss their SLOs. Of two
    /// shapes that serve the same traffic, the one with less strain keeps serving it
    /// when the traffic moves.
    pub strain: f64,
}

/// Prompt tokens per chunk of a mixed worker's steps (the engine's default batch).
const CHUNK: usize = 512;
/// Utilisation past which a queue is taken as unstable.
const STABLE_BELOW: f64 = 0.97;
/// Shares of requests missing their SLOs below this are noise.
const MISS_NOISE: f64 = 0.01;
/// Seconds over which a backlog's toll on TTFT is counted: the least a planner
/// holds a shape (its cooldown).
const BACKLOG_HORIZON_S: f64 = 15.0;
/// Standard deviations of Poisson noise in the sequences a decoder holds that its
/// blocks must also cover (about the 95th percentile).
const KV_SIGMAS: f64 = 1.65;

/// Predicts `shape` serving `t` with `rates`.
pub fn predict(shape: Shape, t: &Traffic, rates: &Rates, slo: &Slo) -> Prediction {
    let none = Prediction {
        goodput: 0.0,
        ttft_attained: 0.0,
        tpot_attained: 0.0,
        utilisation: f64::INFINITY,
        strain: f64::INFINITY,
    };
    if t.samples.is_empty() || t.rate <= 0.0 || shape.workers() == 0 {
        return Prediction { goodput: 0.0, ttft_attained: 1.0, tpot_attained: 1.0, utilisation: 0.0, strain: 0.0 };
    }
    let s = rates.prefill_s_per_token;
    let mean = |f: &dyn Fn(f64, f64) -> f64| {
        t.samples.iter().map(|&(i, o)| f(i as f64, o as f64)).sum::<f64>() / t.samples.len() as f64
    };
    let (mean_isl, mean_osl) = (mean(&|i, _| i), mean(&|_, o| o));
    // The context a decoding sequence attends over, averaged over its decode steps.
    let context = mean(&|i, o| o * (i + o / 2.0)) / mean_osl.max(1e-9);
    let (a, b) = (rates.step.fixed, rates.step.seconds(1.0, context) - rates.step.fixed);
    let (prefillers, decoders, mixed) = match shape.mixed {
        0 => (shape.prefill as f64, shape.decode as f64, false),
        m => (m as f64, m as f64, true),
    };
    if prefillers == 0.0 || decoders == 0.0 {
        return none;
    }
    // Decode first: sequences per decoder and the time a step takes.
    let per_decoder = t.rate / decoders * mean_osl;
    let prefill_busy = if mixed { t.rate / prefillers * mean_isl * s } else { 0.0 };
    // A dedicated prefiller pays each prompt's share of a step's fixed cost; on a
    // mixed worker a chunk rides a decode step, whose time `slow` counts instead.
    let fixed = if mixed { 0.0 } else { rates.prefill_fixed_s };
    let work = |isl: f64| fixed + isl * s;
    let mean_work = mean(&|i, _| work(i));
    let Some((batch, tpot)) = decode_batch(per_decoder, (a, b), prefill_busy) else {
        // How far past keeping up the decoders are, so that shapes that all fail
        // still rank.
        let decoding = (prefill_busy + per_decoder * b).max(1.0);
        return Prediction { utilisation: decoding, strain: decoding, ..none };
    };
    // Prefill: a queue. On a mixed worker each chunk rides along a decode step and
    // pays that step's time too.
    let step = a + b * batch;
    let slow = if mixed { 1.0 + step / (CHUNK as f64 * s) } else { 1.0 };
    let service = |isl: usize| work(isl as f64) * slow;
    let rho = t.rate / prefillers * mean_work * slow;
    // KV on a decoder: each prompt's blocks from the start of its prefill (a
    // handoff reserves them once its prefill has a slot, and a second slot is taken
    // about `rho` of the time), the output's as it grows.
    let prefill_hold = |i: f64| work(i) * slow * (1.0 + rho);
    let seqs = t.rate / decoders * mean(&|i, o| prefill_hold(i) + o * tpot);
    let tokens = t.rate / decoders * mean(&|i, o| i * (prefill_hold(i) + o * tpot) + o / 2.0 * o * tpot);
    let kv = kv_share(seqs, tokens, rates.kv_tokens);
    if kv >= 1.0 {
        return Prediction { utilisation: kv, strain: kv, ..none };
    }
    let late = backlog_toll(rates.backlog_s * slow / prefillers, rho);
    let ttft_attained = ttft_share(&t.samples, &service, rho, &late, slo.ttft_s);
    let step_alone = a + b * batch;
    // The router sends a prompt to a worker with nothing to do while there is one
    // (least loaded, or `auto`'s remote prefill), so a decoding request meets a
    // prefill on its own worker only when every other worker is busy too.
    let in_system = t.rate * mean(&|i, o| work(i) * slow + o * tpot);
    let crowded = if mixed { at_least(shape.mixed - 1, in_system) } else { 0.0 };
    // A request's own context weighs on every step it is in, in place of the mean's:
    // the long-prompt half of a bimodal mix steps slower than the batch's mean, and
    // can miss an objective the mean meets.
    let own = |(i, o): (usize, usize)| rates.step.per_context * ((i as f64 + o as f64 / 2.0) - context);
    let base = if mixed { step_alone } else { tpot };
    let prefills = mixed.then(|| Interference {
        busy: prefill_busy * crowded,
        arrivals: t.rate / prefillers * crowded,
        prompt_s: mean_isl * s,
    });
    let tpot_attained = tpot_share(&t.samples, &|x| base + own(x), prefills, slo.tpot_s);
    let utilisation = rho.max(prefill_busy).max(kv);
    judged(t.rate, (ttft_attained, tpot_attained), utilisation, tpot / slo.tpot_s)
}

/// The prediction from the shares of requests meeting each objective, the
/// utilisation and the decoders' TPOT over its objective. A shape that misses the
/// SLOs for some requests is past its edge, further the more it misses: a mixed
/// worker's prefills slow its decodes before any queue or batch is near full.
fn judged(rate: f64, (ttft_attained, tpot_attained): (f64, f64), utilisation: f64, tpot_strain: f64) -> Prediction {
    let attained = ttft_attained * tpot_attained;
    let missing = if attained < 1.0 - MISS_NOISE { 2.0 - attained } else { 0.0 };
    Prediction {
        goodput: rate * ttft_attained * tpot_attained,
        ttft_attained,
        tpot_attained,
        utilisation,
        strain: utilisation.max(tpot_strain).max(missing),
    }
}

/// The prefills a decoding request on a mixed worker meets: the share of time its
/// worker is busy prefilling, the arrivals of prompts there, and one prompt's
/// seconds.
struct Interference {
    busy: f64,
    arrivals: f64,
    prompt_s: f64,
}

/// The share of `samples` whose time per output token, `step(sample)` alone, stays
/// within `tpot_s`: on a dedicated decoder as it is, on a mixed worker with the
/// `prefills` it meets.
fn tpot_share(
    samples: &[(usize, usize)],
    step: &dyn Fn((usize, usize)) -> f64,
    prefills: Option<Interference>,
    tpot_s: f64,
) -> f64 {
    let ok = |x: (usize, usize)| match &prefills {
        None => soft_below(step(x), tpot_s),
        Some(p) => interfered(x.1, step(x), p.busy, p.arrivals, p.prompt_s, tpot_s),
    };
    samples.iter().map(|&x| ok(x)).sum::<f64>() / samples.len() as f64
}

/// The share of `samples` (prompt, output lengths) whose first token comes within
/// `ttft_s`: a prompt takes `service(isl)` once its turn comes, in a queue at
/// utilisation `rho`, behind a backlog that makes it late `late(room)` of the time.
/// Past the edge the steady wait is that of a queue at it, and what grows beyond it
/// is counted as the backlog.
fn ttft_share(
    samples: &[(usize, usize)],
    service: &dyn Fn(usize) -> f64,
    rho: f64,
    late: &dyn Fn(f64) -> f64,
    ttft_s: f64,
) -> f64 {
    let n = samples.len() as f64;
    let es = samples.iter().map(|&(i, _)| service(i)).sum::<f64>() / n;
    let es2 = samples.iter().map(|&(i, _)| service(i).powi(2)).sum::<f64>() / n;
    let steady_rho = rho.min(STABLE_BELOW);
    let wait = if es > 0.0 { steady_rho / (1.0 - steady_rho) * es2 / (2.0 * es) } else { 0.0 };
    let ttft_ok = |isl: usize| {
        let room = ttft_s - service(isl);
        let steady = match room {
            r if r <= 0.0 => 0.0,
            _ if wait <= 0.0 => 1.0,
            r => 1.0 - steady_rho * (-steady_rho * r / wait).exp(),
        };
        steady * (1.0 - late(room))
    };
    samples.iter().map(|&(i, _)| ttft_ok(i)).sum::<f64>() / n
}

/// The share of `capacity` KV tokens a decoder needs for `seqs` sequences holding
/// `tokens` on average, with room for the Poisson swing in their number.
fn kv_share(seqs: f64, tokens: f64, capacity: f64) -> f64 {
    if capacity <= 0.0 || seqs <= 0.0 {
        return 0.0;
    }
    tokens / seqs * (seqs + KV_SIGMAS * seqs.sqrt()) / capacity
}

/// The share of the next [`BACKLOG_HORIZON_S`] in which a prompt with `room`
/// seconds to spare misses its TTFT behind a backlog that holds each prefiller
/// `ahead` seconds now. Below the edge the backlog is worked off only with the time
/// new traffic leaves (`1 − rho`), so near it even a short one outlasts a shift: a
/// shape that just fell behind is left with a queue its steady state does not show.
/// Past the edge it grows by `rho − 1` seconds a second, and prompts miss from when
/// it passes their room: a swing the queue absorbs within the TTFT objective costs
/// nothing, one it does not costs the rest of the horizon.
fn backlog_toll(ahead: f64, rho: f64) -> impl Fn(f64) -> f64 {
    move |room: f64| {
        let room = room.max(0.0);
        let missing_for = match rho < 1.0 {
            true => (ahead - room).max(0.0) / (1.0 - rho),
            false if ahead >= room => BACKLOG_HORIZON_S,
            false => BACKLOG_HORIZON_S - (room - ahead) / (rho - 1.0),
        };
        (missing_for.max(0.0) / BACKLOG_HORIZON_S).min(1.0)
    }
}

/// The batch a decoder settles at with `load` = arrival rate × output length tokens
/// per second, and its TPOT, when a `busy` share of its time goes to prefills
/// (Little: B = load × TPOT, TPOT = (a + bB) / (1 − busy), B at least one). The
/// sequences' own parts alone load the worker as jobs sharing a processor, so TPOT
/// is also at least b / (1 − busy − load·b): the bound that matters when `a` is
/// small or not known apart from `b`. `None` when no batch keeps up.
fn decode_batch(load: f64, (a, b): (f64, f64), busy: f64) -> Option<(f64, f64)> {
    let free = 1.0 - busy;
    let spare = free - load * b;
    if free <= 1.0 - STABLE_BELOW || spare <= 1.0 - STABLE_BELOW {
        return None;
    }
    let batch = (load * a / spare).max(if load > 0.0 { 1.0 } else { 0.0 });
    Some((batch, ((a + b * batch) / free).max(b / spare)))
}

/// The chance that `k` or more of the requests in a system holding `held` on
/// average (Poisson) are there at once.
fn at_least(k: usize, held: f64) -> f64 {
    let (mut term, mut below) = ((-held).exp(), 0.0);
    for j in 0..k {
        below += term;
        term *= held / (j + 1) as f64;
    }
    (1.0 - below).clamp(0.0, 1.0)
}

/// The chance that a request of `osl` tokens decoding on a mixed worker meets the
/// TPOT `limit`. Its steps take `step` alone; every prompt prefilled there while it
/// decodes adds `prefill` seconds to its decode. It finds one under way with chance
/// `busy` and others arrive at `rate` while it runs: their count is taken as Poisson.
fn interfered(osl: usize, step: f64, busy: f64, rate: f64, prefill: f64, limit: f64) -> f64 {
    if step > limit {
        return 0.0;
    }
    let osl = osl.max(1) as f64;
    // Prefills a request can absorb and still meet the limit.
    let room = if prefill > 0.0 { ((limit - step) * osl / prefill).floor() as usize } else { usize::MAX };
    let mean = rate * osl * step + busy;
    let (mut term, mut sum) = ((-mean).exp(), 0.0);
    for k in 0..=room.min(64) {
        sum += term;
        term *= mean / (k + 1) as f64;
    }
    sum.min(1.0)
}

/// 1 well under `limit`, 0 over it, linear across ±5 %: a step at the SLO would
/// flip between shapes on measurement noise. (At ±10 % a shape whose steps take
/// 92 % of the SLO, and every one of whose requests meets it, scored 0.89.)
fn soft_below(x: f64, limit: f64) -> f64 {
    ((1.05 * limit - x) / (0.1 * limit)).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine's figures, roughly: 1 ms per prompt token, steps of 2 ms + 1.2 ms
    /// per sequence + 2.7 µs per context token, 16k KV tokens per worker.
    const RATES: Rates = Rates {
        prefill_s_per_token: 0.001,
        step: StepFit { fixed: 0.002, per_row: 0.0012, per_context: 2.7e-6 },
        kv_tokens: 16384.0,
        prefill_fixed_s: 0.0,
        backlog_s: 0.0,
    };
    const SLO: Slo = Slo { ttft_s: 5.0, tpot_s: 0.05 };

    fn traffic(rate: f64, isl: usize, osl: usize) -> Traffic {
        Traffic { rate, samples: vec![(isl, osl); 20], ..Default::default() }
    }

    fn best(t: &Traffic) -> Shape {
        let shapes = Shape::candidates(2);
        let score = |s: &Shape| predict(*s, t, &RATES, &SLO).goodput;
        *shapes.iter().max_by(|a, b| score(a).total_cmp(&score(b))).unwrap()
    }

    #[test]
    fn long_prompts_with_short_answers_need_both_workers_prefilling() {
        // 2048-token prompts at 0.6/s: 1.2 s of prefill per second, more than one
        // worker has.
        let t = traffic(0.6, 2048, 32);
        assert_eq!(best(&t), Shape { prefill: 0, decode: 0, mixed: 2 });
        // One prefiller falls 0.23 s further behind every second: its queue passes
        // the TTFT objective within a few seconds and stays past it.
        let split = predict(Shape { prefill: 1, decode: 1, mixed: 0 }, &t, &RATES, &SLO);
        assert!(split.utilisation > 1.0 && split.ttft_attained < 0.15, "{split:?}");
    }

    #[test]
    fn the_long_prompt_half_of_a_bimodal_mix_misses_a_tpot_its_mean_meets() {
        // Half 2048/32, half 128/512, a sequence or less per decoder: the mean
        // sequence attends over about 480 tokens (a 4.5 ms step), a long prompt's
        // over about 2,060 (8.8 ms), against a 7 ms objective.
        let t = Traffic { rate: 0.05, samples: [(2048, 32), (128, 512)].repeat(10), ..Default::default() };
        let slo = Slo { ttft_s: 5.0, tpot_s: 0.007 };
        let split = predict(Shape { prefill: 1, decode: 1, mixed: 0 }, &t, &RATES, &slo);
        assert!((split.tpot_attained - 0.5).abs() < 0.01, "{split:?}");
        let mixed = predict(Shape { prefill: 0, decode: 0, mixed: 2 }, &t, &RATES, &slo);
        assert!(mixed.tpot_attained < 0.51, "{mixed:?}");
    }

    #[test]
    fn a_swing_the_queue_absorbs_within_the_ttft_objective_costs_nothing() {
        // Prompts of 51.5 ms (a GPU's) 3 % past one prefiller's pace: the queue grows
        // 0.03 s a second, 0.45 s over the horizon, far inside a 5 s objective. With
        // 2 s queued already it still fits; with 4.9 s most of the horizon misses.
        let t = traffic(20.0, 2000, 1);
        let slo = Slo { ttft_s: 5.0, tpot_s: 0.1 };
        let split = Shape { prefill: 1, decode: 1, mixed: 0 };
        let rates = |backlog_s| Rates { prefill_s_per_token: 2.575e-5, backlog_s, ..RATES };
        let fresh = predict(split, &t, &rates(0.0), &slo);
        assert!(fresh.utilisation > 1.0 && fresh.ttft_attained > 0.99, "{fresh:?}");
        assert!(predict(split, &t, &rates(2.0), &slo).ttft_attained > 0.99);
        assert!(predict(split, &t, &rates(4.9), &slo).ttft_attained < 0.5);
    }

    #[test]
    fn decode_latency_under_prefill_interference_asks_for_a_split() {
        // 1024-token prompts at 0.5/s with 128-token answers at a 10 ms TPOT SLO: a
        // mixed worker spends a quarter of its time prefilling, and a request that
        // meets one prefill misses; one dedicated prefill worker keeps up.
        let slo = Slo { ttft_s: 5.0, tpot_s: 0.010 };
        let t = traffic(0.5, 1024, 128);
        let score = |s| predict(s, &t, &RATES, &slo);
        let (mixed, split) =
            (score(Shape { prefill: 0, decode: 0, mixed: 2 }), score(Shape { prefill: 1, decode: 1, mixed: 0 }));
        assert!(split.goodput > mixed.goodput, "{split:?} against {mixed:?}");
    }

    #[test]
    fn decode_heavy_traffic_keeps_two_decoders() {
        // 0.8/s of 512-token answers at a 10 ms TPOT: one decoder's sequences would
        // take 90 % of its time and slow each other past the SLO; two share the load.
        let t = traffic(0.8, 128, 512);
        let slo = Slo { ttft_s: 5.0, tpot_s: 0.010 };
        let score = |s| predict(s, &t, &RATES, &slo).goodput;
        assert!(
            score(Shape { prefill: 0, decode: 0, mixed: 2 }) > 2.0 * score(Shape { prefill: 1, decode: 1, mixed: 0 })
        );
    }

    #[test]
    fn long_contexts_slow_decode_and_fill_the_decoders_blocks() {
        // 2048-token prompts with 32-token answers at 3.2/s on 16 workers (the twin's
        // prefill-heavy phase): one decoder would hold over a dozen 2k-token
        // sequences at once, more than its 16k tokens, and its steps over 2k contexts
        // miss a 10 ms TPOT. Sixteen mixed workers, each prefilling while most are
        // idle, beat every split, as they did on the twin (92 % of requests within
        // the SLOs against at most 21 % for any split).
        let t = traffic(3.2, 2048, 32);
        let slo = Slo { ttft_s: 5.0, tpot_s: 0.010 };
        let lone = predict(Shape { prefill: 15, decode: 1, mixed: 0 }, &t, &RATES, &slo);
        assert!(lone.goodput == 0.0 && lone.utilisation >= 1.0, "{lone:?}");
        let score = |s| predict(s, &t, &RATES, &slo).goodput;
        let all_mixed = score(Shape { prefill: 0, decode: 0, mixed: 16 });
        for s in Shape::candidates(16).into_iter().filter(|s| s.mixed == 0) {
            assert!(score(s) < all_mixed, "{s}");
        }
    }

    #[test]
    fn strain_ranks_shapes_that_serve_and_shapes_that_fail() {
        // 0.5/s of 512-token answers at a 10 ms TPOT on 16 workers: every split keeps
        // up, and more decoders run further from the TPOT edge.
        let slo = Slo { ttft_s: 5.0, tpot_s: 0.010 };
        let split = |p: usize| Shape { prefill: p, decode: 16 - p, mixed: 0 };
        let t = traffic(4.0, 128, 512);
        let strain = |s| predict(s, &t, &RATES, &slo).strain;
        assert!(
            strain(split(2)) < strain(split(8)) && strain(split(8)) < 1.0,
            "{} {}",
            strain(split(2)),
            strain(split(8))
        );
        // Ten times that: the decoders of every split fall behind, the fewer the
        // further, and still rank, so the least bad can be told.
        let t = traffic(40.0, 128, 512);
        let (few, many) = (predict(split(12), &t, &RATES, &slo), predict(split(4), &t, &RATES, &slo));
        assert!(few.goodput == 0.0 && many.goodput == 0.0, "{few:?} {many:?}");
        assert!(many.strain.is_finite() && 1.0 <= many.strain && many.strain < few.strain, "{few:?} {many:?}");
    }

    #[test]
    fn a_backlog_counts_against_the_shape_that_works_it_off_slowest() {
        // 1024-token prompts at 6.25/s on 16 workers: 8 prefillers are 80 % busy, 10
        // are 64 %, and with nothing queued both meet a 5 s TTFT for most prompts.
        // With 8 s of prompts queued per prefiller of 8, the 8 work it off at a fifth
        // of a second per second and every prompt of the next 15 s misses; 10 clear
        // their 6.4 s each in under 7 s.
        let t = traffic(6.25, 1024, 32);
        let split = |p: usize| Shape { prefill: p, decode: 16 - p, mixed: 0 };
        let with = |backlog_s: f64| {
            let rates = Rates { backlog_s, ..RATES };
            let g = |p| predict(split(p), &t, &rates, &SLO).goodput;
            (g(8), g(10))
        };
        let (eight, ten) = with(0.0);
        assert!(eight > 0.85 * ten && ten > 0.9 * t.rate, "{eight} {ten}");
        let (eight, ten) = with(64.0);
        assert!(eight < 0.5 * ten && ten > 0.4 * t.rate, "{eight} {ten}");
    }

    #[test]
    fn a_bimodal_mix_is_scored_per_request() {
        // Half the prompts cannot meet the TTFT SLO at all (their own prefill is
        // longer): attainment near one half, not what the mean length would give.
        let mut t = traffic(0.05, 100, 16);
        t.samples = [(100, 16), (8000, 16)].repeat(10);
        let p = predict(Shape { prefill: 0, decode: 0, mixed: 2 }, &t, &RATES, &Slo { ttft_s: 5.0, tpot_s: 0.1 });
        assert!((p.ttft_attained - 0.5).abs() < 0.05, "{p:?}");
    }

    #[test]
    fn no_traffic_predicts_nothing_to_gain() {
        let p = predict(Shape { prefill: 1, decode: 1, mixed: 0 }, &Traffic::default(), &RATES, &SLO);
        assert_eq!(p.goodput, 0.0);
        assert_eq!(Shape::candidates(3).len(), 3);
        assert_eq!(Shape { prefill: 1, decode: 2, mixed: 0 }.to_string(), "1P:2D");
    }
}
