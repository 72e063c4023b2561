//! Speculative decoding by n-gram lookup: what to draft, and how much of it a step
//! verifies.
//!
//! A decoding sequence's draft is the run of tokens that followed the latest earlier
//! occurrence of its last few tokens (in its prompt or its own output): prompt lookup
//! and history lookup in one search. The step runs the last sampled token and the
//! draft as one chunk with logits at every row; the sequence then samples row by row
//! exactly as plain decoding would, keeping each drafted token its own sample matched
//! (see `finish_step`). How many drafted tokens a step verifies is an economic choice
//! made from measurements: each sequence's acceptance so far, and the engine's fit of
//! its step times ([`plan_drafts`]).

use pdserve_types::{DraftRecord, StepFit};

/// The n-gram lengths looked up, longest first: a longer match predicts better.
const NGRAM_MAX: usize = 4;
const NGRAM_MIN: usize = 2;

/// Speculation settings of an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecConfig {
    /// The most tokens drafted for one sequence in one step.
    pub max_draft: usize,
    /// Verify every draft whole (within the step's room), as vLLM and llama.cpp do,
    /// instead of what [`plan_drafts`] finds worth it: what the measured rule is
    /// compared against, and what makes a test's drafts independent of step timings.
    pub verify_all: bool,
    /// Draft with this model instead of by n-gram lookup.
    pub draft: Option<super::draft::DraftModel>,
}

/// Up to `max` tokens that followed the latest earlier occurrence of the last `n`
/// tokens of `tokens`, for `n` from 4 down to 2 (empty when none recurs), and `n`
/// (0 for none).
fn matched(tokens: &[u32], max: usize) -> (&[u32], usize) {
    if max == 0 {
        return (&[], 0);
    }
    for n in (NGRAM_MIN..=NGRAM_MAX).rev() {
        let Some(tail_at) = tokens.len().checked_sub(n) else { continue };
        let tail = &tokens[tail_at..];
        // The latest start `i < tail_at` whose n tokens equal the tail.
        if let Some(i) = (0..tail_at).rev().find(|&i| &tokens[i..i + n] == tail) {
            let from = i + n;
            return (&tokens[from..(from + max).min(tokens.len())], n);
        }
    }
    (&[], 0)
}

/// A sequence's n-gram draft: from the longer match of its own tokens and the
/// worker's pool (its own on a tie, as the nearer context). A short match in the
/// sequence's own text ("of the") predicts less than the pool's longer one.
pub fn draft(tokens: &[u32], pool: &NgramPool, max: usize) -> Vec<u32> {
    let (own, n) = matched(tokens, max);
    if n >= POOL_NGRAM {
        return own.to_vec();
    }
    let pooled = pool.draft(tokens, max);
    if pooled.is_empty() {
        own.to_vec()
    } else {
        pooled
    }
}

/// The n-gram length the worker's shared pool keys on.
const POOL_NGRAM: usize = 3;
/// Slots of the pool (16 bytes each: 1 MiB).
const POOL_SLOTS: usize = 1 << 16;

/// Continuations seen in every request on one worker: a fixed table from the hash of
/// [`POOL_NGRAM`] tokens to the token that followed them last (llama.cpp's
/// `ngram-mod` idea). A request whose own tokens have no match drafts from what the
/// worker's other requests said after the same words: a document several users quote,
/// code an agent sends again in a new request. Memory is fixed; a newer n-gram takes an
/// older one's slot.
#[derive(Default)]
pub struct NgramPool {
    /// Empty until the first request is learnt (an engine without n-gram drafts
    /// holds none).
    slots: Vec<(u64, u32)>,
}

impl NgramPool {
    /// Learns the continuations of `tokens[from..]` (each token after the n before it).
    pub fn learn(&mut self, tokens: &[u32], from: usize) {
        if self.slots.is_empty() {
            self.slots = vec![(0, 0); POOL_SLOTS];
        }
        for i in from.max(POOL_NGRAM)..tokens.len() {
            let key = ngram_key(&tokens[i - POOL_NGRAM..i]);
            self.slots[key as usize % POOL_SLOTS] = (key, tokens[i]);
        }
    }

    /// Up to `max` tokens after `tokens`, each what followed the n tokens before it
    /// last time the pool saw them; empty when it never saw the last n.
    pub fn draft(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        let Some(start) = tokens.len().checked_sub(POOL_NGRAM).filter(|_| !self.slots.is_empty()) else {
            return Vec::new();
        };
        let mut window: Vec<u32> = tokens[start..].to_vec();
        let mut draft = Vec::new();
        while draft.len() < max {
            let key = ngram_key(&window[window.len() - POOL_NGRAM..]);
            let (k, next) = self.slots[key as usize % POOL_SLOTS];
            if k != key {
                break;
            }
            draft.push(next);
            window.push(next);
        }
        draft
    }
}

/// A 64-bit hash of an n-gram (never 0, the empty slot's key).
fn ngram_key(tokens: &[u32]) -> u64 {
    let h = tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3));
    (h ^ (h >> 29)).max(1)
}

/// A sequence's record of drafted tokens: each verified one was either accepted or
/// the first rejected of its draft.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Acceptance {
    pub tried: u64,
    pub accepted: u64,
}

impl From<DraftRecord> for Acceptance {
    fn from(d: DraftRecord) -> Self {
        Acceptance { tried: d.tried, accepted: d.accepted }
    }
}

impl From<Acceptance> for DraftRecord {
    fn from(a: Acceptance) -> Self {
        DraftRecord { tried: a.tried, accepted: a.accepted }
    }
}

impl Acceptance {
    /// The chance the next drafted token is accepted given the ones before it were,
    /// with one success and one failure assumed before any evidence.
    pub fn rate(&self) -> f64 {
        self.rate_from(0.5)
    }

    /// [`Acceptance::rate`] with `prior` (say, the worker's rate over all its
    /// requests) standing for two tokens of evidence before this record's own.
    pub fn rate_from(&self, prior: f64) -> f64 {
        (self.accepted as f64 + 2.0 * prior) / (self.tried as f64 + 2.0)
    }

    pub fn add(&mut self, other: Acceptance) {
        self.tried += other.tried;
        self.accepted += other.accepted;
    }

    /// Records a verified draft of `verified` tokens of which the first `accepted`
    /// were kept (a draft cut short by the end of the output counts what it reached).
    pub fn record(&mut self, verified: usize, accepted: usize) {
        self.accepted += accepted as u64;
        self.tried += (accepted + usize::from(accepted < verified)) as u64;
    }
}

/// Steps in a row that had drafts and verified none, after which a step explores.
/// An exploring step costs at most about twice a plain one, so exploring once in this
/// many steps costs at most about 1.5 % of the time where nothing is worth verifying.
pub const EXPLORE_AFTER: u32 = 64;

/// What a step does with its drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Nothing: the step gives the fit a plain step's time.
    Skip,
    /// The drafts from their start, in up to as many extra rows as the step has or a
    /// whole draft's: a step of another size for the fit, and evidence of acceptance.
    Explore,
    /// What [`plan_drafts`] finds worth it.
    Plan,
}

/// When a step explores instead of following the plan. While the decode fit cannot
/// tell a row's cost from a step's, every other step explores. After that, a step
/// explores once [`EXPLORE_AFTER`] steps in a row had drafts and verified none: a fit
/// misled by a few noisy early steps, or a poor acceptance record, would otherwise stop
/// speculation for good, since only verified drafts can correct either.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Exploration {
    skipped_last: bool,
    idle: u32,
}

impl Exploration {
    /// This step's choice; `measured`: the fit tells rows apart.
    pub fn next(&mut self, measured: bool) -> Verify {
        if !measured {
            self.skipped_last = !self.skipped_last;
            return if self.skipped_last { Verify::Skip } else { Verify::Explore };
        }
        if self.idle >= EXPLORE_AFTER {
            Verify::Explore
        } else {
            Verify::Plan
        }
    }

    /// After a step that had drafts: whether it verified any.
    pub fn verified(&mut self, any: bool) {
        self.idle = if any { 0 } else { self.idle + 1 };
    }
}

/// A decoding sequence that has a draft this step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Tokens drafted (the most it may verify).
    pub drafted: usize,
    /// Its [`Acceptance::rate`].
    pub rate: f64,
    /// Tokens its next row attends over.
    pub context: usize,
    /// Seconds each of its drafted tokens costs to draft (its row of a draft model's
    /// pass; 0 for a lookup), paid for every token verified.
    pub draft_cost: f64,
    /// Its draft is the draft model's: its `j`-th token needs the step's `j`-th
    /// drafting pass, whose fixed cost the drafting sequences share.
    pub passes: bool,
}

/// The step as planned without drafts: its rows, the tokens they attend over in all,
/// and the tokens it yields.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlainStep {
    pub rows: usize,
    pub context: usize,
    pub yields: usize,
}

/// How many drafted tokens of each candidate to verify, within `room` extra rows.
///
/// The `j`-th drafted token of a sequence yields a token with chance `rate^j` (all
/// before it accepted) and costs a row: `per_row` plus `per_context` for each token
/// it attends over, and its draft cost. A draft model's tokens also need passes: the
/// `j`-th token of any sequence needs the `j`-th pass, which costs `pass_cost` however
/// many sequences draft in it.
///
/// What is maximised is the product of the step's sequences' token rates (the sum of
/// their logs): a drafted token raises one sequence's rate, and its row slows every
/// sequence in the step. With one sequence this is the step's tokens per second; with
/// many it does not let a step be slowed for a few sequences' drafts where the others
/// only wait (so the median request never pays for its neighbours' drafts). For each
/// number of passes, tokens are taken best value first while each raises that
/// product, the passes' cost paid up front; the best plan wins (the fewest passes on a
/// tie). So a large batch, whose step is already long, verifies little or nothing, a
/// single sequence with a good record verifies its whole draft, and sequences that
/// draft together share what a pass costs. With no `fit` (the engine's steps cannot
/// tell a row's cost from the step's fixed cost yet, or every draft is to be verified)
/// drafts are verified whole, in order, within `room`.
pub fn plan_drafts(
    fit: Option<&StepFit>,
    plain: PlainStep,
    cands: &[Candidate],
    room: usize,
    pass_cost: f64,
) -> Vec<usize> {
    let Some(fit) = fit else {
        let mut left = room;
        return cands
            .iter()
            .map(|c| {
                let n = c.drafted.min(left);
                left -= n;
                n
            })
            .collect();
    };
    best_plan(fit, plain, cands, room, pass_cost).take
}

/// A plan of what each candidate verifies, with what the step is then expected to
/// yield and to take.
struct DraftPlan {
    take: Vec<usize>,
    /// The sum of the logs of the sequences' expected token rates, less what every
    /// plan of the step shares: what [`plan_drafts`] maximises.
    score: f64,
    /// The candidates' expected tokens (one each without drafts), and the step's
    /// seconds.
    tokens: f64,
    seconds: f64,
}

/// [`plan_drafts`] given a fit.
fn best_plan(fit: &StepFit, plain: PlainStep, cands: &[Candidate], room: usize, pass_cost: f64) -> DraftPlan {
    // Every (candidate, j) with its expected tokens and its cost, best value first.
    let mut options: Vec<(usize, usize, f64, f64)> = Vec::new();
    for (i, c) in cands.iter().enumerate() {
        for j in 1..=c.drafted {
            let cost = fit.per_row + fit.per_context * (c.context + j) as f64 + c.draft_cost;
            options.push((i, j, c.rate.powi(j as i32), cost));
        }
    }
    options.sort_by(|a, b| (b.2 * a.3).total_cmp(&(a.2 * b.3)).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
    let most = cands.iter().filter(|c| c.passes).map(|c| c.drafted).max().unwrap_or(0);
    let fewest = if pass_cost > 0.0 { 0 } else { most };
    let mut best = within_passes(fit, plain, cands, &options, room, fewest, pass_cost);
    for passes in fewest + 1..=most {
        let plan = within_passes(fit, plain, cands, &options, room, passes, pass_cost);
        if plan.score > best.score {
            best = plan;
        }
    }
    best
}

/// [`plan_drafts`] for at most `passes` drafting passes, over its sorted `options`,
/// the passes it uses charged.
fn within_passes(
    fit: &StepFit,
    plain: PlainStep,
    cands: &[Candidate],
    options: &[(usize, usize, f64, f64)],
    room: usize,
    passes: usize,
    pass_cost: f64,
) -> DraftPlan {
    // Each candidate's expected tokens this step (one without drafts), and how many
    // sequences the step's time divides.
    let mut tokens = vec![1.0; cands.len()];
    let sequences = plain.yields.max(cands.len()).max(1) as f64;
    let mut take = vec![0; cands.len()];
    let plain_seconds = fit.seconds(plain.rows as f64, plain.context as f64);
    let mut seconds = plain_seconds + passes as f64 * pass_cost;
    let mut left = room;
    for &(i, j, gain, cost) in options {
        // A draft is verified from its start: token j only after token j - 1; a draft
        // model's token j only within the passes.
        if left == 0 || take[i] != j - 1 || (cands[i].passes && j > passes) {
            continue;
        }
        if (1.0 + gain / tokens[i]).ln() <= sequences * (1.0 + cost / seconds).ln() {
            continue;
        }
        take[i] = j;
        tokens[i] += gain;
        seconds += cost;
        left -= 1;
    }
    // The passes the plan uses, which may be fewer than it paid for.
    let used = cands.iter().zip(&take).filter(|(c, _)| c.passes).map(|(_, &n)| n).max().unwrap_or(0);
    let seconds = seconds - (passes - used) as f64 * pass_cost;
    let score = tokens.iter().map(|t| t.ln()).sum::<f64>() - sequences * seconds.ln();
    DraftPlan { take, score, tokens: tokens.iter().sum(), seconds }
}

/// What a sequence's drafts from a draft model would cost it up front and save it
/// later: what [`price_model_drafts`] weighs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelDrafting {
    /// Seconds the draft model takes to compute the sequence's prompt (what its cache
    /// lacks of it).
    pub prompt_s: f64,
    /// Tokens the sequence is expected to output.
    pub output: f64,
    /// The most tokens it drafts a step, and the chance each is accepted.
    pub drafted: usize,
    pub rate: f64,
    /// A drafting pass's fixed seconds, and a drafted token's row in it.
    pub pass_s: f64,
    pub row_s: f64,
}

/// Whether a sequence should draft with the draft model (whose prompt compute it
/// then pays) rather than by lookup, which costs nothing up front
/// ([`DraftPrice::pays`], with the figures it weighed). Its drafts save,
/// on each token it outputs, what a step of `contexts` decodes (its own among them)
/// that all draft by model, planned as [`plan_drafts`] plans, saves per token over a
/// plain step; that saving over its expected output must exceed the prompt's
/// compute. Both are machine time: on a worker whose decodes share its cores, the
/// prompt's compute is time every decode beside it waits, and what drafts save is
/// time none of them waits. So a long prompt with a short answer, or a batch whose
/// steps already share their weights among many rows (where drafts save little),
/// drafts by lookup.
pub fn price_model_drafts(fit: &StepFit, contexts: &[usize], m: &ModelDrafting) -> DraftPrice {
    let n = contexts.len().max(1);
    let plain = PlainStep { rows: n, context: contexts.iter().sum(), yields: n };
    let cand = |&context: &usize| Candidate {
        drafted: m.drafted,
        rate: m.rate,
        context: context + 1,
        draft_cost: m.row_s,
        passes: true,
    };
    let cands: Vec<Candidate> = contexts.iter().map(cand).collect();
    let plan = best_plan(fit, plain, &cands, n * m.drafted, m.pass_s);
    let plain_per_token = fit.seconds(n as f64, plain.context as f64) / n as f64;
    let saved_per_token = plain_per_token - plan.seconds / plan.tokens.max(1.0);
    DraftPrice {
        saved_per_token,
        verified: plan.take.last().copied().unwrap_or(0),
        pays: m.output * saved_per_token > m.prompt_s,
    }
}

/// [`price_model_drafts`]'s answer, with what it found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftPrice {
    /// Seconds drafting by model saves a token, and the tokens the sequence (the
    /// last of the step's decodes) verifies in its plan.
    pub saved_per_token: f64,
    pub verified: usize,
    /// The saving over the expected output exceeds the prompt's compute.
    pub pays: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exploration_alternates_until_measured_then_breaks_long_idle_runs() {
        let mut e = Exploration::default();
        // Before the fit tells rows apart: skip, explore, skip, ...
        let early: Vec<Verify> = (0..4).map(|_| e.next(false)).collect();
        assert_eq!(early, [Verify::Skip, Verify::Explore, Verify::Skip, Verify::Explore]);
        // Measured: the plan, until EXPLORE_AFTER steps with drafts verified none.
        for _ in 0..EXPLORE_AFTER {
            assert_eq!(e.next(true), Verify::Plan);
            e.verified(false);
        }
        assert_eq!(e.next(true), Verify::Explore);
        e.verified(true);
        assert_eq!(e.next(true), Verify::Plan);
        // A verified draft anywhere in the run starts the count again.
        for i in 0..2 * EXPLORE_AFTER {
            assert_eq!(e.next(true), Verify::Plan);
            e.verified(i % 50 == 49);
        }
    }

    #[test]
    fn a_lookup_follows_the_latest_longest_match() {
        // (tokens, max, draft)
        let cases: [(&[u32], usize, &[u32]); 7] = [
            (&[1, 2, 3, 9, 1, 2, 3], 2, &[9, 1]),
            // Latest occurrence wins.
            (&[1, 2, 5, 1, 2, 6, 1, 2], 3, &[6, 1, 2]),
            // The 4-gram match beats a later 2-gram one.
            (&[7, 1, 2, 3, 8, 0, 2, 3, 9, 7, 1, 2, 3], 1, &[8]),
            // Runs to the end of the tokens at most.
            (&[4, 4, 4], 5, &[4]),
            (&[1, 2, 3, 4], 3, &[]),
            (&[1], 3, &[]),
            (&[1, 2, 1, 2], 0, &[]),
        ];
        for (tokens, max, want) in cases {
            assert_eq!(matched(tokens, max).0, want, "{tokens:?}");
        }
    }

    #[test]
    fn the_pool_drafts_what_another_request_said_after_the_same_words() {
        let mut pool = NgramPool::default();
        // One request's tokens: ... 7 8 9 10 11 12 ...
        pool.learn(&[1, 2, 7, 8, 9, 10, 11, 12], 0);
        // Another ending in 7 8 9 gets the rest, as far as the pool knows it.
        assert_eq!(pool.draft(&[5, 7, 8, 9], 2), [10, 11]);
        assert_eq!(pool.draft(&[5, 7, 8, 9], 10), [10, 11, 12]);
        // Unknown words: nothing; too few tokens: nothing.
        assert!(pool.draft(&[4, 5, 6], 4).is_empty());
        assert!(pool.draft(&[8, 9], 4).is_empty());
        // A later continuation replaces the earlier one.
        pool.learn(&[7, 8, 9, 42], 3);
        assert_eq!(pool.draft(&[7, 8, 9], 1), [42]);
    }

    #[test]
    fn the_longer_match_drafts() {
        let mut pool = NgramPool::default();
        pool.learn(&[7, 8, 9, 10, 11], 0);
        // Its own 2-gram (8 9 … 8 9 → 5) against the pool's 3-gram (7 8 9 → 10).
        assert_eq!(draft(&[8, 9, 5, 1, 7, 8, 9], &pool, 2), [10, 11]);
        // Its own 3-gram wins a tie, as the nearer context.
        assert_eq!(draft(&[7, 8, 9, 6, 7, 8, 9], &pool, 2), [6, 7]);
        // Nothing in the pool: its own short match.
        assert_eq!(draft(&[1, 2, 3, 1, 2], &pool, 1), [3]);
        assert!(draft(&[1, 2, 3], &NgramPool::default(), 4).is_empty());
    }

    #[test]
    fn acceptance_counts_each_verified_token_once() {
        let mut a = Acceptance::default();
        assert_eq!(a.rate(), 0.5);
        a.record(4, 4); // all kept
        a.record(4, 1); // one kept, the second rejected, the rest never judged
        a.record(3, 0);
        assert_eq!(a, Acceptance { tried: 4 + 2 + 1, accepted: 5 });
        assert_eq!(a.rate(), 6.0 / 9.0);
        // A new request starts from its worker's record; its own soon outweighs it.
        let fresh = Acceptance::default();
        assert_eq!(fresh.rate_from(a.rate()), a.rate());
        let mut own = Acceptance::default();
        own.record(8, 8);
        own.record(8, 8);
        assert!(own.rate_from(0.1) > 0.85, "{}", own.rate_from(0.1));
    }

    #[test]
    fn drafts_are_verified_while_they_pay() {
        // A CPU-like step: weights read once per step dominate, a row costs 1/50 of it.
        let cpu = StepFit { fixed: 0.010, per_row: 0.0002, per_context: 0.0 };
        // A compute-bound step: a row costs as much as the whole step's fixed part.
        let bound = StepFit { fixed: 0.001, per_row: 0.001, per_context: 0.0 };
        let one = PlainStep { rows: 1, context: 100, yields: 1 };
        let cand = |drafted, rate| Candidate { drafted, rate, context: 100, draft_cost: 0.0, passes: false };
        // (fit, plain step, candidates, room, verified)
        type Case = (Option<StepFit>, PlainStep, Vec<Candidate>, usize, Vec<usize>);
        let cases: Vec<Case> = vec![
            // Cheap rows, good record: the whole draft.
            (Some(cpu), one, vec![cand(5, 0.8)], 16, vec![5]),
            // Cheap rows, poor record: the first token (worth 1/10 of one, for 1/50
            // of the step), not the second (1/100).
            (Some(cpu), one, vec![cand(5, 0.1)], 16, vec![1]),
            // Rows as dear as the step: only the likely first few.
            (Some(bound), one, vec![cand(5, 0.9)], 16, vec![3]),
            (Some(bound), one, vec![cand(5, 0.4)], 16, vec![0]),
            // A large batch's step is long per token: drafts no longer pay.
            (Some(bound), PlainStep { rows: 16, context: 1600, yields: 16 }, vec![cand(5, 0.6)], 16, vec![0]),
            // One of sixteen: its draft slows fifteen that only wait, so it verifies
            // its likeliest two tokens (the step's tokens per second alone would take
            // all five).
            (Some(cpu), PlainStep { rows: 16, context: 0, yields: 16 }, vec![cand(5, 0.8)], 16, vec![2]),
            // Better records first when room is short.
            (Some(cpu), one, vec![cand(4, 0.3), cand(4, 0.9)], 3, vec![0, 3]),
            // No fit: verify everything the room allows, in order.
            (None, one, vec![cand(3, 0.1), cand(3, 0.1)], 4, vec![3, 1]),
        ];
        for (fit, plain, cands, room, want) in cases {
            assert_eq!(plan_drafts(fit.as_ref(), plain, &cands, room, 0.0), want, "{fit:?} {plain:?} {cands:?}");
        }
    }

    #[test]
    fn a_draft_models_passes_are_shared_by_the_sequences_drafting_in_them() {
        // Cheap rows; a drafting pass costs 20 of them whoever drafts in it.
        let cpu = StepFit { fixed: 0.010, per_row: 0.0002, per_context: 0.0 };
        let four = PlainStep { rows: 4, context: 0, yields: 4 };
        let model = |rate| Candidate { drafted: 4, rate, context: 100, draft_cost: 0.0002, passes: true };
        // (candidates, verified)
        let cases: [(Vec<Candidate>, Vec<usize>); 4] = [
            // One sequence of four drafting alone does not pay for its passes.
            (vec![model(0.99)], vec![0]),
            // Four drafting together do.
            (vec![model(0.99); 4], vec![4; 4]),
            // A poor record rides along on the passes others pay for (its first token
            // costs only a row), and the passes stop sooner, as it waits through them
            // for little.
            (vec![model(0.99), model(0.99), model(0.99), model(0.3)], vec![2, 2, 2, 1]),
            // A lookup's draft needs no pass: taken as it would be without a model.
            (vec![Candidate { passes: false, draft_cost: 0.0, ..model(0.99) }], vec![4]),
        ];
        for (cands, want) in cases {
            assert_eq!(plan_drafts(Some(&cpu), four, &cands, 64, 0.004), want, "{cands:?}");
        }
        // Without a pass cost, the passes are not weighed: the rows alone decide.
        assert_eq!(plan_drafts(Some(&cpu), four, &[model(0.99)], 64, 0.0), [4]);
        // Passes are worth their cost while the tokens they add are likely: at 0.9
        // the fourth pass of four requests adds less than a step's mean.
        assert_eq!(plan_drafts(Some(&cpu), four, &[Candidate { drafted: 8, ..model(0.9) }; 4], 64, 0.004), [3; 4]);
    }

    #[test]
    fn a_draft_model_computes_a_prompt_only_where_its_drafts_repay_it() {
        // Weights read once per step dominate; a drafting pass costs a tenth of a step.
        let cpu = StepFit { fixed: 0.010, per_row: 0.0002, per_context: 0.0 };
        // Rows as dear as the step's fixed part: a batch's step is long per token.
        let bound = StepFit { fixed: 0.001, per_row: 0.001, per_context: 0.0 };
        let m =
            |prompt_s, output| ModelDrafting { prompt_s, output, drafted: 8, rate: 0.95, pass_s: 0.001, row_s: 0.0001 };
        // (fit, decodes' contexts, drafting, pays)
        let cases: [(StepFit, Vec<usize>, ModelDrafting, bool); 6] = [
            // Alone on a CPU-like step, its drafts save most of each 10 ms token: 128
            // tokens repay a 0.3 s prompt, not a 2 s one.
            (cpu, vec![100], m(0.3, 128.0), true),
            (cpu, vec![100], m(2.0, 128.0), false),
            // A short answer does not repay even the short prompt.
            (cpu, vec![100], m(0.3, 8.0), false),
            // Nothing to compute up front: any saving pays.
            (cpu, vec![100; 4], m(0.0, 1.0), true),
            // Where a step's rows cost what its weights do, drafts save nothing in a
            // batch of sixteen: lookups, whatever the prompt.
            (bound, vec![100; 16], m(0.0, 128.0), false),
            (bound, vec![100; 16], m(0.01, 1e6), false),
        ];
        for (fit, contexts, drafting, want) in cases {
            let price = price_model_drafts(&fit, &contexts, &drafting);
            assert_eq!(price.pays, want, "{fit:?} {} {drafting:?}: {price:?}", contexts.len());
        }
    }

    #[test]
    fn context_makes_long_rows_dearer() {
        let fit = StepFit { fixed: 0.002, per_row: 0.0005, per_context: 1e-6 };
        let plain = |context| PlainStep { rows: 1, context, yields: 1 };
        let at = |context| {
            let cand = Candidate { drafted: 8, rate: 0.5, context, draft_cost: 0.0, passes: false };
            plan_drafts(Some(&fit), plain(context), &[cand], 8, 0.0)
        };
        assert!(at(100)[0] > at(8000)[0], "{:?} {:?}", at(100), at(8000));
    }
}
