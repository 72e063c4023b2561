//! A stand-in for the forward pass, for simulated workers and the twin: a step takes
//! the time a fitted cost model predicts for its shape, and each sampled token depends
//! only on the sequence before it. Everything else — the scheduler, chunked prefill,
//! the block pool, the prefix cache, preemption, KV export and import — is the engine's
//! own code, so a simulated worker batches and runs out of blocks exactly as a real one.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The work of one step, in the terms the cost model is linear in.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    /// Tokens computed (prompt chunks and decode tokens).
    pub tokens: f64,
    /// Attention pairs of prompt chunks: for each computed token, the positions it
    /// attends to.
    pub pairs: f64,
    /// Attention pairs of single-token (decode) rows, which read the cache once per
    /// token instead of sharing the reads across a chunk.
    pub decode_pairs: f64,
    /// Rows of logits computed and sampled.
    pub logits: f64,
    /// Single-token (decode) rows; not a term of the linear cost, but where the
    /// measured decode steps correct it ([`DecodeTable`]).
    pub decodes: f64,
}

impl StepShape {
    /// A sequence's share: `n` tokens from position `start`, sampled or not.
    pub fn chunk(start: usize, n: usize, logits: bool) -> StepShape {
        let logits = f64::from(u8::from(logits));
        let (s, k) = (start as f64, n as f64);
        // Token j (0-based) attends to start + j + 1 positions.
        let pairs = k * s + k * (k + 1.0) / 2.0;
        match n {
            1 => StepShape { tokens: 1.0, pairs: 0.0, decode_pairs: pairs, logits, decodes: 1.0 },
            _ => StepShape { tokens: k, pairs, decode_pairs: 0.0, logits, decodes: 0.0 },
        }
    }

    /// A sequence's part of a step as the engine runs it: `n` tokens from position
    /// `start`, the last `logits` of them sampled. A verified draft (several rows
    /// sampled) is a chunk with a logits row for each: its rows share one context,
    /// as a prompt chunk's do (not each its own, as decode rows), and each gets the
    /// logits a decode row would. `pdserve profile` times such steps and logs how far
    /// this price is off.
    pub fn part(start: usize, n: usize, logits: usize) -> StepShape {
        match n {
            1 => StepShape::chunk(start, 1, logits == 1),
            _ => StepShape { logits: logits as f64, ..StepShape::chunk(start, n, false) },
        }
    }

    /// A decode step of `batch` sequences, each at `context` positions.
    pub fn decode(batch: usize, context: usize) -> StepShape {
        (0..batch).map(|_| StepShape::chunk(context, 1, true)).sum()
    }

    /// A lone prefill chunk of `n` tokens after `context` computed ones, sampled at its end.
    pub fn prefill(context: usize, n: usize) -> StepShape {
        StepShape::chunk(context, n, true)
    }
}

impl std::ops::Add for StepShape {
    type Output = StepShape;

    fn add(self, o: StepShape) -> StepShape {
        StepShape {
            tokens: self.tokens + o.tokens,
            pairs: self.pairs + o.pairs,
            decode_pairs: self.decode_pairs + o.decode_pairs,
            logits: self.logits + o.logits,
            decodes: self.decodes + o.decodes,
        }
    }
}

impl StepShape {
    /// The share of its tokens that are prompt chunks' (the rest are decode rows).
    pub fn prompt_share(&self) -> f64 {
        match self.tokens > 0.0 {
            true => ((self.tokens - self.decodes) / self.tokens).clamp(0.0, 1.0),
            false => 0.0,
        }
    }
}

impl std::iter::Sum for StepShape {
    fn sum<I: Iterator<Item = StepShape>>(iter: I) -> StepShape {
        iter.fold(StepShape::default(), |a, b| a + b)
    }
}

/// Seconds a step takes: a fixed part (reading the weights, launching the step) plus
/// parts linear in its tokens, attention pairs (of chunks and of decode rows) and
/// logits rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepCost {
    pub fixed_s: f64,
    pub token_s: f64,
    pub pair_s: f64,
    pub decode_pair_s: f64,
    pub logits_s: f64,
}

impl StepCost {
    pub fn seconds(&self, s: &StepShape) -> f64 {
        let linear = self.token_s * s.tokens
            + self.pair_s * s.pairs
            + self.decode_pair_s * s.decode_pairs
            + self.logits_s * s.logits;
        (self.fixed_s + linear).max(0.0)
    }

    /// The coefficients in the order [`StepShape::terms`] lists the shape's parts.
    pub fn coefficients(&self) -> [f64; 5] {
        [self.fixed_s, self.token_s, self.pair_s, self.decode_pair_s, self.logits_s]
    }

    pub fn from_coefficients(c: [f64; 5]) -> StepCost {
        StepCost { fixed_s: c[0], token_s: c[1], pair_s: c[2], decode_pair_s: c[3], logits_s: c[4] }
    }
}

impl StepShape {
    /// 1 (for the fixed part), then tokens, chunk pairs, decode pairs, logits rows.
    pub fn terms(&self) -> [f64; 5] {
        [1.0, self.tokens, self.pairs, self.decode_pairs, self.logits]
    }
}

/// Where a profile's timed decode steps differ from the linear cost: the residual
/// (timed − linear) at each timed (batch, context), interpolated between them and
/// held at the grid's edges. One line through every step cannot follow how a small
/// batch's decode time grows with context (steeply up to a few hundred positions, then
/// slower), and a request's TPOT is made of exactly those steps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeTable {
    /// Ascending, from 1 or more (below the first, the residual shrinks to none at
    /// batch 0).
    batches: Vec<f64>,
    /// Ascending.
    contexts: Vec<f64>,
    /// `residual_s[i][j]`: at `batches[i]` and `contexts[j]`.
    residual_s: Vec<Vec<f64>>,
}

impl DecodeTable {
    /// From timed points `(batch, context, residual seconds)`, the repeats of one point
    /// averaged; `None` unless they cover every batch at every context.
    pub fn from_points(points: &[(usize, usize, f64)]) -> Option<DecodeTable> {
        let axis = |f: fn(&(usize, usize, f64)) -> usize| {
            let mut v: Vec<usize> = points.iter().map(f).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let (batches, contexts) = (axis(|p| p.0), axis(|p| p.1));
        let mut residual_s = vec![vec![0.0; contexts.len()]; batches.len()];
        for (i, &b) in batches.iter().enumerate() {
            for (j, &c) in contexts.iter().enumerate() {
                let at: Vec<f64> = points.iter().filter(|p| p.0 == b && p.1 == c).map(|p| p.2).collect();
                if at.is_empty() {
                    return None;
                }
                residual_s[i][j] = at.iter().sum::<f64>() / at.len() as f64;
            }
        }
        let floats = |v: Vec<usize>| v.into_iter().map(|x| x as f64).collect();
        (!batches.is_empty() && batches[0] > 0).then(|| DecodeTable {
            batches: floats(batches),
            contexts: floats(contexts),
            residual_s,
        })
    }

    /// Seconds to add to a step of `decodes` decode rows at a mean `context`.
    pub fn seconds(&self, decodes: f64, context: f64) -> f64 {
        if decodes <= 0.0 || self.batches.is_empty() {
            return 0.0;
        }
        let row = |i: usize| lerp_at(&self.contexts, &self.residual_s[i], context);
        let (i, w) = bracket(&self.batches, decodes);
        // Below the smallest timed batch the residual shrinks to none at batch 0.
        if decodes < self.batches[0] {
            return row(0) * decodes / self.batches[0];
        }
        row(i) * (1.0 - w) + row((i + 1).min(self.batches.len() - 1)) * w
    }
}

/// The index below `x` in ascending `axis` and the weight of the one above, held at
/// the ends.
fn bracket(axis: &[f64], x: f64) -> (usize, f64) {
    let last = axis.len() - 1;
    match axis.iter().rposition(|&a| a <= x) {
        None => (0, 0.0),
        Some(i) if i == last => (last, 0.0),
        Some(i) => (i, (x - axis[i]) / (axis[i + 1] - axis[i])),
    }
}

fn lerp_at(axis: &[f64], values: &[f64], x: f64) -> f64 {
    let (i, w) = bracket(axis, x);
    values[i] * (1.0 - w) + values[(i + 1).min(values.len() - 1)] * w
}

/// How a timed engine spends a step's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// Sleeps it: a worker process that must look real to its peers.
    Wall,
    /// Only counts it ([`crate::batch::Engine::take_charged`]); the caller advances a
    /// virtual clock.
    Virtual,
}

/// What a timed engine stands in for.
#[derive(Debug, Clone)]
pub struct TimedModel {
    pub vocab_size: usize,
    pub context_length: usize,
    /// Layers: a prefill exports its K/V one layer at a time, as a real one does.
    pub n_layers: usize,
    /// K (and V) values per token per layer that the stand-in stores and sends; the
    /// real model's figure divided by the scale the worker states.
    pub kv_values: usize,
    /// How long a step takes...
    pub step: StepTime,
    /// ...on this many threads.
    pub threads: usize,
    /// The core-seconds of compute a step holds: its time on one thread. A step on
    /// several threads leaves some of its cores idle part of the time (a small
    /// batch's decode is not twice as fast on two); serving's host work fits there
    /// first. `None`: every thread is busy the whole step.
    pub work: Option<StepTime>,
    /// What copying a block back from a lower tier costs (none without tiers).
    pub restore: RestoreCost,
    pub clock: Clock,
    /// How its drafts fare, when its engine speculates.
    pub speculation: Option<TimedSpeculation>,
    /// A stage group's pipelining, when it heads one.
    pub stages: Option<TimedStages>,
}

/// A stage group's steps as its head pipelines them: `whole`, the whole model's cost
/// on one node, its layers shared evenly by `stages` stages and its logits on the
/// head, with `hop` a round trip to a later
/// stage. A step [`crate::pipeline::micro_batches`] keeps whole costs what
/// [`TimedModel::step`] says (the group's line, hops included); one it cuts costs its
/// pipeline's span, and decodes that go in lanes a round of them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedStages {
    pub stages: usize,
    pub whole: StepCost,
    /// The part of `whole`'s fixed time a pass through every layer pays; the stages
    /// share it, and the rest (the output head's weights, the step around the
    /// layers) is the head's on every pass it makes.
    pub layers_fixed_s: f64,
    pub hop: crate::pipeline::PassCost,
    /// The cores the stages share, where they run on one machine (`None`: a host
    /// each). Fewer cores than stages cannot compute every stage's pass at once.
    pub cores: Option<usize>,
}

impl TimedStages {
    /// The pipelined span of a step of shape `s`, when it is cut; for a step of
    /// decodes alone, the round of lanes a head takes them in where that is
    /// shorter (every sequence one token on, as in the step).
    fn cut(&self, s: &StepShape) -> Option<f64> {
        let rows = s.tokens.round().max(1.0) as usize;
        let stages = self.passes(s, rows);
        let decodes = s.decodes >= 2.0 && s.decodes == s.tokens;
        if let Some((lanes, round)) = decodes.then(|| crate::pipeline::lanes_round(&stages, self.hop, rows)).flatten() {
            return Some(self.on_cores(round, &stages, &crate::pipeline::even(rows, lanes)));
        }
        let (m, span) = crate::pipeline::soonest(&stages, self.hop, rows);
        (m > 1).then(|| self.on_cores(span, &stages, &crate::pipeline::even(rows, m)))
    }

    /// `span`, the pipeline's over parts of `sizes` rows, or what the stages' cores
    /// take to compute every pass of it where they are fewer than the stages. A head
    /// chooses its lanes and micro-batches from the passes' costs alone, not knowing
    /// the cores, and so does the twin.
    fn on_cores(&self, span: f64, stages: &[crate::pipeline::PassCost], sizes: &[usize]) -> f64 {
        match self.cores {
            Some(c) if c < stages.len() => span.max(crate::pipeline::work(stages, sizes) / c.max(1) as f64),
            _ => span,
        }
    }

    /// Each stage's pass over a step of shape `s` (`rows` rows), the head's first: an
    /// even share of the whole model's layers each, and the logits and the rest of a
    /// step's fixed time (the output head a head holds, the step around the layers)
    /// on the head.
    fn passes(&self, s: &StepShape, rows: usize) -> Vec<crate::pipeline::PassCost> {
        let (n, rows) = (self.stages.max(1) as f64, rows as f64);
        let logits = self.whole.logits_s * s.logits;
        let layers = (self.whole.seconds(s) - self.whole.fixed_s - logits).max(0.0) / rows / n;
        let layers_fixed = self.layers_fixed_s.clamp(0.0, self.whole.fixed_s);
        let later = crate::pipeline::PassCost { fixed: layers_fixed / n, per_row: layers };
        let head = crate::pipeline::PassCost {
            fixed: later.fixed + self.whole.fixed_s - layers_fixed,
            per_row: layers + logits / rows,
        };
        std::iter::once(head).chain(std::iter::repeat_n(later, self.stages.saturating_sub(1))).collect()
    }
}

/// A step's time by its shape: the fitted line, corrected where decode steps were
/// timed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTime {
    pub cost: StepCost,
    /// The timed decode steps' departures from `cost` (none: the line alone).
    pub decode_table: DecodeTable,
}

impl StepTime {
    pub fn line(cost: StepCost) -> StepTime {
        StepTime { cost, decode_table: DecodeTable::default() }
    }

    pub fn seconds(&self, s: &StepShape) -> f64 {
        let context = if s.decodes > 0.0 { s.decode_pairs / s.decodes - 1.0 } else { 0.0 };
        (self.cost.seconds(s) + self.decode_table.seconds(s.decodes, context)).max(0.0)
    }
}

impl TimedModel {
    /// Seconds a step of this shape takes, and the core-seconds its threads sit idle
    /// meanwhile.
    pub fn step_seconds(&self, s: &StepShape) -> (f64, f64) {
        let line = self.step.seconds(s);
        let seconds = self.stages.as_ref().and_then(|g| g.cut(s)).unwrap_or(line);
        let idle = self.work.as_ref().map_or(0.0, |w| self.threads as f64 * seconds - w.seconds(s));
        (seconds, idle.max(0.0))
    }
}

/// Seconds a timed engine charges to copy one block (every layer's K and V, at the
/// real model's size) back into its pool from each lower tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RestoreCost {
    pub host_block_s: f64,
    pub disk_block_s: f64,
}

impl RestoreCost {
    pub fn seconds(&self, from: pdserve_kv::Place) -> f64 {
        match from {
            pdserve_kv::Place::Host(_) => self.host_block_s,
            pdserve_kv::Place::Disk(_) => self.disk_block_s,
            pdserve_kv::Place::Device(_) => 0.0,
        }
    }
}

/// Ordinary tokens of the usual vocabularies start about here (ids below are special
/// or byte tokens, which a frontend may print as nothing).
const FIRST_TOKEN: u32 = 1000;
const TOKEN_SPAN: u32 = 1000;

/// The token a timed engine samples after `tokens`: a function of the last token and
/// the position alone, so a request replayed elsewhere continues the same way.
pub fn next_token(tokens: &[u32], vocab: usize) -> u32 {
    next_after(tokens.last().copied().unwrap_or(0), tokens.len(), vocab)
}

fn mix(last: u32, len: usize) -> u64 {
    let mut x = u64::from(last).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (len as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^ (x >> 29)
}

/// [`next_token`] after `len` tokens ending in `last`.
fn next_after(last: u32, len: usize, vocab: usize) -> u32 {
    let x = mix(last, len);
    let span = u64::from(TOKEN_SPAN);
    let vocab = vocab.max(1) as u64;
    let first = if vocab > u64::from(FIRST_TOKEN) + span { u64::from(FIRST_TOKEN) } else { 0 };
    ((first + x % span) % vocab) as u32
}

/// How a timed engine's drafts fare (speculation in the twin): each drafted token is
/// right with this chance given that the ones before it were.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedSpeculation {
    pub per_token: f64,
    /// The share of a sequence's decode steps that have a draft (an n-gram lookup
    /// often finds none; a draft model always drafts).
    pub drafting: f64,
    /// What a pass of the draft model costs, when a draft model drafts (none: drafts
    /// are free, as a lookup nearly is).
    pub draft_step: Option<StepCost>,
    /// Beside a draft model, how the drafts of a request that drafts by lookup fare
    /// (none: such a request drafts nothing).
    pub lookup: Option<TimedLookup>,
}

/// A lookup's drafts as an n-gram server measured them: the per-token chance and the
/// share of steps with a draft, as [`TimedSpeculation`]'s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedLookup {
    pub per_token: f64,
    pub drafting: f64,
}

impl TimedSpeculation {
    /// From the share of drafted tokens a worker accepted (its
    /// `pdserve_spec_accepted_tokens_total` over `pdserve_spec_draft_tokens_total`)
    /// with drafts of `tokens`: the chance `a` with `(a + a² + … + a^K) / K` equal
    /// to the share, what whole drafts of `K` would show.
    pub fn from_share(share: f64, tokens: usize) -> Self {
        let k = tokens.max(1);
        let share_of = |a: f64| (1..=k).map(|j| a.powi(j as i32)).sum::<f64>() / k as f64;
        let (mut lo, mut hi) = (0.0, 1.0);
        for _ in 0..60 {
            let mid = (lo + hi) / 2.0;
            if share_of(mid) < share.clamp(0.0, 1.0) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        TimedSpeculation { per_token: (lo + hi) / 2.0, drafting: 1.0, draft_step: None, lookup: None }
    }

    /// How a lookup beside this draft model drafts: free, with the lookup's figures;
    /// `None` where the twin has none.
    pub fn lookup(&self) -> Option<TimedSpeculation> {
        let l = self.lookup?;
        Some(TimedSpeculation { per_token: l.per_token, drafting: l.drafting, draft_step: None, lookup: None })
    }

    /// Seconds the draft model's passes take for a step in which `rows` sequences
    /// draft up to `passes` tokens each over `context` tokens on average.
    pub fn draft_seconds(&self, rows: usize, passes: usize, context: usize) -> f64 {
        match self.draft_step {
            Some(step) if rows > 0 => passes as f64 * step.seconds(&StepShape::decode(rows, context)),
            _ => 0.0,
        }
    }

    /// Seconds the draft model takes to compute `n` prompt tokens after `start` (0
    /// without a draft model): a pass of its own, with no logits.
    pub fn draft_prompt_seconds(&self, start: usize, n: usize) -> f64 {
        match self.draft_step {
            Some(step) if n > 0 => step.seconds(&StepShape::chunk(start, n, false)),
            _ => 0.0,
        }
    }

    /// A draft of `max` tokens after `tokens`: what the engine will sample next, each
    /// token right with chance `per_token` (a hash of its position decides, so a run
    /// repeats); a wrong token is one the engine does not sample.
    pub fn draft(&self, tokens: &[u32], max: usize, vocab: usize) -> Vec<u32> {
        let (mut last, mut len) = (tokens.last().copied().unwrap_or(0), tokens.len());
        if unit(mix(last ^ 0x27d4_eb2f, len)) >= self.drafting {
            return Vec::new();
        }
        let mut draft = Vec::with_capacity(max);
        for _ in 0..max {
            let mut t = next_after(last, len, vocab);
            if unit(mix(last ^ 0x5bd1_e995, len)) >= self.per_token {
                t = (t + 1) % vocab.max(1) as u32;
            }
            draft.push(t);
            (last, len) = (t, len + 1);
        }
        draft
    }
}

/// A hash as a uniform number in [0, 1).
fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// Sleeps `seconds` on the calling thread (wall clock only).
pub(crate) fn spend(clock: Clock, seconds: f64) {
    if clock == Clock::Wall && seconds > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(seconds));
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_groups_decodes_are_priced_as_a_round_of_two_lanes() {
        // Each of two stages: 2 ms fixed and 0.25 ms a row; a hop 0.2 ms.
        let whole = StepCost { fixed_s: 0.004, token_s: 0.0005, ..StepCost::default() };
        let hop = crate::pipeline::PassCost { fixed: 0.0002, per_row: 0.0 };
        let g = TimedStages { stages: 2, whole, layers_fixed_s: 0.004, hop, cores: None };
        // Eight decodes whole take 4 + 0.2 + 4 ms; in lanes of four a round takes one
        // lane's way (2 + 1, 0.2, 2 + 1 ms), longer than a stage's two passes (6 ms).
        let got = g.cut(&StepShape::decode(8, 100)).unwrap();
        assert!((got - 0.0062).abs() < 1e-12, "{got}");
        // One decode has no second lane, and its pass is mostly fixed: not cut either.
        assert_eq!(g.cut(&StepShape::decode(1, 100)), None);
        // The logits are the head's: the output head is there.
        let g = TimedStages { whole: StepCost { logits_s: 0.0003, ..whole }, ..g };
        let [head, later] = g.passes(&StepShape::decode(8, 100), 8)[..] else { panic!("two stages") };
        assert!((head.per_row - later.per_row - 0.0003).abs() < 1e-12 && head.fixed == later.fixed, "{head:?}");
        // A prompt's chunk is cut in micro-batches, not lanes.
        let chunk = StepShape::prefill(0, 64);
        let (_, span) = crate::pipeline::soonest(&g.passes(&chunk, 64), hop, 64);
        assert_eq!(g.cut(&chunk), Some(span));
    }

    #[test]
    fn stages_on_fewer_cores_than_stages_take_turns_on_them() {
        // Three stages of 2 ms fixed and 0.5 ms a row of the whole model's layers
        // between them (1/6 ms each), a hop 0.2 ms.
        let whole = StepCost { fixed_s: 0.006, token_s: 0.0005, ..StepCost::default() };
        let hop = crate::pipeline::PassCost { fixed: 0.0002, per_row: 0.0 };
        let g = TimedStages { stages: 3, whole, layers_fixed_s: 0.006, hop, cores: None };
        let nine = StepShape::decode(9, 100);
        // A host each: three lanes of three, a round a lane's way (3 × 2.5 ms, 2 hops).
        let round = g.cut(&nine).unwrap();
        assert!((round - 0.0079).abs() < 1e-12, "{round}");
        // Two cores compute the round's nine passes of 2.5 ms two at a time at best.
        let two = TimedStages { cores: Some(2), ..g }.cut(&nine).unwrap();
        assert!((two - 0.01125).abs() < 1e-12, "{two}");
        // As many cores as stages change nothing.
        assert_eq!(TimedStages { cores: Some(3), ..g }.cut(&nine), Some(round));
    }

    #[test]
    fn the_fixed_time_outside_the_layers_is_the_heads_on_every_pass() {
        // The layers' passes pay 3 of a step's 4 ms fixed; the last 1 ms (the output
        // head, the step around the layers) is the head's.
        let whole = StepCost { fixed_s: 0.004, token_s: 0.0005, ..StepCost::default() };
        let hop = crate::pipeline::PassCost { fixed: 0.0002, per_row: 0.0 };
        let g = TimedStages { stages: 2, whole, layers_fixed_s: 0.003, hop, cores: None };
        let [head, later] = g.passes(&StepShape::decode(8, 100), 8)[..] else { panic!("two stages") };
        assert!((head.fixed - 0.0025).abs() < 1e-12 && (later.fixed - 0.0015).abs() < 1e-12, "{head:?} {later:?}");
        // In lanes of four the head is the busiest stage: two passes of 2.5 + 1 ms,
        // longer than a lane's way (3.5, 0.2, 1.5 + 1 ms).
        let got = g.cut(&StepShape::decode(8, 100)).unwrap();
        assert!((got - 0.007).abs() < 1e-12, "{got}");
        // A figure past the step's fixed time (a noisy fit) is taken as all of it.
        let over = TimedStages { layers_fixed_s: 0.005, ..g };
        let [head, later] = over.passes(&StepShape::decode(8, 100), 8)[..] else { panic!("two stages") };
        assert!(head.fixed == later.fixed && (head.fixed - 0.002).abs() < 1e-12, "{head:?}");
    }

    #[test]
    fn timed_drafts_are_right_as_often_as_the_share_measured() {
        for (share, tokens) in [(0.0, 4), (0.25, 8), (0.8, 4), (1.0, 1)] {
            let spec = TimedSpeculation::from_share(share, tokens);
            let a = spec.per_token;
            let got = (1..=tokens).map(|j| a.powi(j as i32)).sum::<f64>() / tokens as f64;
            assert!((got - share).abs() < 1e-9, "{share} {tokens}: {a} gives {got}");
        }
        // A draft that is always right is what the engine samples; one never right
        // is wrong at once.
        let tokens = [5u32, 17, 900];
        let always =
            TimedSpeculation { per_token: 1.0, drafting: 1.0, draft_step: None, lookup: None }.draft(&tokens, 3, 49152);
        let mut seq = tokens.to_vec();
        for &t in &always {
            assert_eq!(t, next_token(&seq, 49152));
            seq.push(t);
        }
        let never =
            TimedSpeculation { per_token: 0.0, drafting: 1.0, draft_step: None, lookup: None }.draft(&tokens, 3, 49152);
        assert_ne!(never[0], next_token(&tokens, 49152));
        // A lookup that finds nothing most of the time drafts about that often.
        let rare = TimedSpeculation { per_token: 1.0, drafting: 0.25, draft_step: None, lookup: None };
        let drafted = (0..4000u32).filter(|&t| !rare.draft(&[t, t + 1], 2, 49152).is_empty()).count();
        assert!((800..1200).contains(&drafted), "{drafted} of 4000");
    }
    use super::*;

    #[test]
    fn shapes_count_attention_pairs() {
        // Three tokens from scratch attend to 1, 2 and 3 positions.
        let prefill = StepShape { tokens: 3.0, pairs: 6.0, decode_pairs: 0.0, logits: 1.0, decodes: 0.0 };
        assert_eq!(StepShape::prefill(0, 3), prefill);
        // One decode token at 10 computed positions attends to 11.
        let decode = StepShape { tokens: 2.0, pairs: 0.0, decode_pairs: 22.0, logits: 2.0, decodes: 2.0 };
        assert_eq!(StepShape::decode(2, 10), decode);
    }

    #[test]
    fn cost_is_linear_in_the_shape() {
        let c = StepCost { fixed_s: 1.0, token_s: 2.0, pair_s: 3.0, decode_pair_s: 5.0, logits_s: 4.0 };
        let s = StepShape { tokens: 1.0, pairs: 1.0, decode_pairs: 1.0, logits: 1.0, decodes: 1.0 };
        assert_eq!(c.seconds(&s), 15.0);
        assert_eq!(c.seconds(&StepShape::default()), 1.0);
    }

    #[test]
    fn a_decode_table_meets_its_points_and_interpolates_between_them() {
        // Batches 1 and 4 at contexts 100 and 500; (4, 500) timed twice.
        let pts = [(1, 100, 1.0), (1, 500, 3.0), (4, 100, 2.0), (4, 500, 5.0), (4, 500, 7.0)];
        let t = DecodeTable::from_points(&pts).unwrap();
        assert_eq!(t.seconds(1.0, 100.0), 1.0);
        assert_eq!(t.seconds(4.0, 500.0), 6.0, "repeats are averaged");
        assert_eq!(t.seconds(1.0, 300.0), 2.0);
        assert_eq!(t.seconds(2.5, 100.0), 1.5);
        // Held at the edges of context and batch; none without decodes.
        assert_eq!(t.seconds(1.0, 50.0), 1.0);
        assert_eq!(t.seconds(1.0, 900.0), 3.0);
        assert_eq!(t.seconds(64.0, 500.0), 6.0);
        assert_eq!(t.seconds(0.0, 100.0), 0.0);
        // A hole in the grid gives no table.
        assert!(DecodeTable::from_points(&pts[..3]).is_none());
    }

    #[test]
    fn a_step_adds_the_decode_tables_residual_for_its_decode_rows() {
        let table = DecodeTable::from_points(&[(1, 10, 0.5), (2, 10, 1.0)]).unwrap();
        let step = StepTime { cost: StepCost { token_s: 1.0, ..StepCost::default() }, decode_table: table };
        assert_eq!(step.seconds(&StepShape::decode(2, 10)), 3.0);
        // A prompt chunk beside one decode row: the chunk's linear cost, the row's residual.
        assert_eq!(step.seconds(&(StepShape::prefill(0, 4) + StepShape::decode(1, 10))), 5.5);
        assert_eq!(step.seconds(&StepShape::prefill(0, 4)), 4.0);
    }

    #[test]
    fn a_verified_draft_is_a_chunk_whose_every_row_gets_logits() {
        // A sequence at 10 positions verifying 2 drafted tokens: 3 rows over one
        // context, each sampled.
        let verify = StepShape::part(10, 3, 3);
        assert_eq!(verify, StepShape { logits: 3.0, ..StepShape::chunk(10, 3, false) });
        assert_eq!((verify.tokens, verify.pairs, verify.decode_pairs, verify.decodes), (3.0, 36.0, 0.0, 0.0));
        // A prompt chunk samples one row at most; a lone row is a decode row.
        assert_eq!(StepShape::part(10, 3, 1), StepShape::chunk(10, 3, true));
        assert_eq!(StepShape::part(10, 3, 0), StepShape::chunk(10, 3, false));
        assert_eq!(StepShape::part(10, 1, 1), StepShape::decode(1, 10));
        // Its price: three tokens, its pairs, three logits rows, no decode residual.
        let c = StepCost { fixed_s: 1.0, token_s: 2.0, pair_s: 0.5, decode_pair_s: 7.0, logits_s: 3.0 };
        let table = DecodeTable::from_points(&[(1, 10, 100.0), (3, 10, 100.0)]).unwrap();
        assert_eq!(StepTime { cost: c, decode_table: table }.seconds(&verify), 1.0 + 6.0 + 18.0 + 9.0);
    }

    #[test]
    fn threads_sit_idle_for_what_a_step_holds_less_than_them_all() {
        let timed = |work| TimedModel {
            vocab_size: 10,
            context_length: 100,
            n_layers: 1,
            kv_values: 1,
            step: StepTime::line(StepCost { token_s: 1.0, ..StepCost::default() }),
            threads: 2,
            work,
            restore: RestoreCost::default(),
            clock: Clock::Virtual,
            speculation: None,
            stages: None,
        };
        let one_thread = StepTime::line(StepCost { token_s: 1.5, ..StepCost::default() });
        // Two threads for 2 s against 3 s on one: a core-second idle.
        assert_eq!(timed(Some(one_thread)).step_seconds(&StepShape::decode(2, 10)), (2.0, 1.0));
        assert_eq!(timed(None).step_seconds(&StepShape::decode(2, 10)), (2.0, 0.0));
    }

    #[test]
    fn tokens_depend_on_the_sequence_and_stay_in_range() {
        let a = next_token(&[5, 6, 7], 49152);
        assert_eq!(a, next_token(&[9, 6, 7], 49152), "only the last token and the length count");
        assert!((1000..2000).contains(&a));
        let spread: std::collections::HashSet<u32> = (0..100).map(|i| next_token(&[i], 49152)).collect();
        assert!(spread.len() > 50, "tokens vary: {}", spread.len());
        assert!(next_token(&[1], 300) < 300);
    }
}
