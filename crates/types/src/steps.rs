//! Running sums over an engine's pure decode steps (no prompt tokens in the batch),
//! enough to fit the step time as a plane in the batch size and the context the
//! batch attends over: the planner's decode cost, measured rather than assumed.
//!
//! The context term matters: a decode step reads every cached token of every
//! sequence, so a worker that measured itself on 200-token contexts is several times
//! slower per sequence on 2,000-token ones. A fit blind to it extrapolates badly.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DecodeSteps {
    pub steps: u64,
    /// Sum of the batch sizes, and of their squares.
    pub rows: u64,
    pub rows_sq: u64,
    /// Sum of the step times, and of batch size × step time.
    pub seconds: f64,
    pub row_seconds: f64,
    /// Sum of the context tokens each step attended over (all its sequences), of
    /// their squares, of batch size × context, and of context × step time.
    #[serde(default)]
    pub context: f64,
    #[serde(default)]
    pub context_sq: f64,
    #[serde(default)]
    pub row_context: f64,
    #[serde(default)]
    pub context_seconds: f64,
}

/// A decode step's time: `fixed + per_row × rows + per_context × context tokens`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepFit {
    pub fixed: f64,
    pub per_row: f64,
    pub per_context: f64,
}

impl StepFit {
    /// Seconds for a step of `rows` sequences attending over `context` tokens in all.
    pub fn seconds(&self, rows: f64, context: f64) -> f64 {
        self.fixed + self.per_row * rows + self.per_context * context
    }
}

impl DecodeSteps {
    /// One step of `batch` sequences over `context` cached tokens in all.
    pub fn record(&mut self, batch: usize, context: usize, seconds: f64) {
        let (b, k) = (batch as u64, context as f64);
        self.steps += 1;
        self.rows += b;
        self.rows_sq += b * b;
        self.seconds += seconds;
        self.row_seconds += b as f64 * seconds;
        self.context += k;
        self.context_sq += k * k;
        self.row_context += b as f64 * k;
        self.context_seconds += k * seconds;
    }

    /// The sums of `self` less an earlier reading of the same counter.
    pub fn since(&self, earlier: &DecodeSteps) -> DecodeSteps {
        let less = |a: f64, b: f64| (a - b).max(0.0);
        DecodeSteps {
            steps: self.steps.saturating_sub(earlier.steps),
            rows: self.rows.saturating_sub(earlier.rows),
            rows_sq: self.rows_sq.saturating_sub(earlier.rows_sq),
            seconds: less(self.seconds, earlier.seconds),
            row_seconds: less(self.row_seconds, earlier.row_seconds),
            context: less(self.context, earlier.context),
            context_sq: less(self.context_sq, earlier.context_sq),
            row_context: less(self.row_context, earlier.row_context),
            context_seconds: less(self.context_seconds, earlier.context_seconds),
        }
    }

    pub fn add(&mut self, other: &DecodeSteps) {
        self.steps += other.steps;
        self.rows += other.rows;
        self.rows_sq += other.rows_sq;
        self.seconds += other.seconds;
        self.row_seconds += other.row_seconds;
        self.context += other.context;
        self.context_sq += other.context_sq;
        self.row_context += other.row_context;
        self.context_seconds += other.context_seconds;
    }

    /// Whether the steps were of more than one size, so a fit can tell what a row
    /// costs from what a step costs.
    pub fn tells_rows_apart(&self) -> bool {
        u128::from(self.steps) * u128::from(self.rows_sq) > u128::from(self.rows) * u128::from(self.rows)
    }

    /// The step time by least squares with every part non-negative: the best of the
    /// fits over each subset of the three parts that solves with no part below zero.
    /// Where the data cannot tell parts apart (one batch size, say), the fit that
    /// charges the batch size is preferred, as the cautious guess for larger batches.
    /// `None` before any step.
    pub fn fit(&self) -> Option<StepFit> {
        if self.steps == 0 || self.rows == 0 {
            return None;
        }
        let (n, r, k) = (self.steps as f64, self.rows as f64, self.context);
        // Normal equations of [1, rows, context] against the step time.
        let gram = [[n, r, k], [r, self.rows_sq as f64, self.row_context], [k, self.row_context, self.context_sq]];
        let rhs = [self.seconds, self.row_seconds, self.context_seconds];
        // Ties keep the first: fuller fits, then those charging rows.
        const SUBSETS: [&[usize]; 7] = [&[0, 1, 2], &[1, 2], &[0, 1], &[0, 2], &[1], &[0], &[2]];
        let mut best: Option<(f64, [f64; 3])> = None;
        for subset in SUBSETS {
            let Some(coef) = solve(&gram, &rhs, subset) else { continue };
            // Least squares leaves residual Σy² − β·X'y: the larger β·X'y, the better.
            let explained: f64 = (0..3).map(|i| coef[i] * rhs[i]).sum();
            if best.is_none_or(|(e, _)| explained > e * (1.0 + 1e-9)) {
                best = Some((explained, coef));
            }
        }
        best.map(|(_, [fixed, per_row, per_context])| StepFit { fixed, per_row, per_context })
    }
}

/// Least squares restricted to the columns in `subset`, by Gaussian elimination on
/// the normal equations; `None` when they are (nearly) singular or a part comes out
/// negative.
fn solve(gram: &[[f64; 3]; 3], rhs: &[f64; 3], subset: &[usize]) -> Option<[f64; 3]> {
    let m = subset.len();
    let mut a = [[0.0; 4]; 3];
    for (i, &si) in subset.iter().enumerate() {
        for (j, &sj) in subset.iter().enumerate() {
            a[i][j] = gram[si][sj];
        }
        a[i][m] = rhs[si];
    }
    for col in 0..m {
        let pivot = (col..m).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        a.swap(col, pivot);
        // Relative to the column's own scale, so seconds and token counts mix safely.
        let scale = gram[subset[col]][subset[col]];
        if a[col][col].abs() <= 1e-9 * scale {
            return None;
        }
        let pivot_row = a[col];
        for (row, r) in a.iter_mut().enumerate().take(m) {
            if row != col {
                let f = r[col] / pivot_row[col];
                for (x, p) in r[col..=m].iter_mut().zip(&pivot_row[col..=m]) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut coef = [0.0; 3];
    for (i, &si) in subset.iter().enumerate() {
        coef[si] = a[i][m] / a[i][i];
    }
    coef.iter().all(|&c| c >= 0.0).then_some(coef)
}

/// Running sums over an engine's prefill-only steps (every row a prompt chunk): the
/// prompt tokens they computed and the time they took, enough to fit a step's time
/// as a fixed cost plus a cost per token. That is a prefill worker's own pace,
/// nothing of the queues and transfers around its steps in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefillSteps {
    pub steps: u64,
    pub tokens: u64,
    pub seconds: f64,
    /// Sums of tokens² and of tokens × seconds, per step.
    pub tokens_sq: f64,
    pub token_seconds: f64,
}

impl PrefillSteps {
    pub fn record(&mut self, tokens: usize, seconds: f64) {
        self.steps += 1;
        self.tokens += tokens as u64;
        self.seconds += seconds;
        self.tokens_sq += (tokens * tokens) as f64;
        self.token_seconds += tokens as f64 * seconds;
    }

    /// The sums of `self` less an earlier reading of the same counter.
    pub fn since(&self, earlier: &PrefillSteps) -> PrefillSteps {
        PrefillSteps {
            steps: self.steps.saturating_sub(earlier.steps),
            tokens: self.tokens.saturating_sub(earlier.tokens),
            seconds: (self.seconds - earlier.seconds).max(0.0),
            tokens_sq: (self.tokens_sq - earlier.tokens_sq).max(0.0),
            token_seconds: (self.token_seconds - earlier.token_seconds).max(0.0),
        }
    }

    /// A step's `(fixed seconds, seconds per token)`, by least squares over steps of
    /// several sizes; steps all of one size tell no fixed cost apart, and give their
    /// mean pace with none.
    pub fn fit(&self) -> Option<(f64, f64)> {
        if self.tokens == 0 {
            return None;
        }
        let (n, x, y) = (self.steps as f64, self.tokens as f64, self.seconds);
        let spread = n * self.tokens_sq - x * x;
        let per_token = (n * self.token_seconds - x * y) / spread;
        if spread <= 1e-6 * n * self.tokens_sq || per_token <= 0.0 {
            return Some((0.0, y / x));
        }
        let fixed = ((y - per_token * x) / n).max(0.0);
        Some((fixed, (y - fixed * n) / x))
    }
}

#[cfg(test)]
mod tests {
    use super::PrefillSteps;

    #[test]
    fn prefill_steps_of_two_sizes_tell_the_fixed_cost_from_the_pace() {
        let mut p = PrefillSteps::default();
        for tokens in [2048, 4096, 2048, 4096, 8192] {
            p.record(tokens, 0.007 + tokens as f64 * 2e-5);
        }
        let (fixed, per_token) = p.fit().unwrap();
        assert!((fixed - 0.007).abs() < 1e-9 && (per_token - 2e-5).abs() < 1e-12, "{fixed} {per_token}");
        // One size only: its mean pace, no fixed cost.
        let mut one = PrefillSteps::default();
        one.record(2048, 0.05);
        one.record(2048, 0.05);
        assert_eq!(one.fit(), Some((0.0, 0.05 / 2048.0)));
        assert_eq!(PrefillSteps::default().fit(), None);
        let later = {
            let mut l = p;
            l.record(1024, 0.03);
            l
        };
        assert_eq!(later.since(&p).tokens, 1024);
    }

    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 + 1e-6 * b.abs()
    }

    #[test]
    fn the_fit_recovers_a_plane_and_differences_subtract() {
        let truth = StepFit { fixed: 0.002, per_row: 0.0012, per_context: 2.7e-6 };
        let mut s = DecodeSteps::default();
        for b in [1usize, 2, 4, 8, 16] {
            for per_seq in [100usize, 700, 2000] {
                s.record(b, b * per_seq, truth.seconds(b as f64, (b * per_seq) as f64));
            }
        }
        let f = s.fit().unwrap();
        assert!(
            close(f.fixed, truth.fixed) && close(f.per_row, truth.per_row) && close(f.per_context, truth.per_context),
            "{f:?}"
        );
        let early = s;
        s.record(4, 400, 0.01);
        let d = s.since(&early);
        assert_eq!((d.steps, d.rows, d.context), (1, 4, 400.0));
        assert_eq!(DecodeSteps::default().fit(), None);
    }

    #[test]
    fn one_batch_size_is_charged_per_row_and_context_still_shows() {
        // Batch 1 only, contexts growing as a sequence decodes: the fixed and per-row
        // parts cannot be told apart, the context part can.
        let mut s = DecodeSteps::default();
        for ctx in (100..600).step_by(10) {
            s.record(1, ctx, 0.003 + 3e-6 * ctx as f64);
        }
        let f = s.fit().unwrap();
        assert!(f.fixed == 0.0 && close(f.per_row, 0.003) && close(f.per_context, 3e-6), "{f:?}");
    }

    #[test]
    fn noise_that_tilts_a_part_below_zero_drops_that_part() {
        // Times that fall slightly with the context: no negative per-token cost.
        let mut s = DecodeSteps::default();
        for (b, ctx, t) in [(1, 100, 0.0040), (1, 900, 0.0039), (2, 200, 0.0060), (2, 1800, 0.0059)] {
            s.record(b, ctx, t);
        }
        let f = s.fit().unwrap();
        assert!(f.fixed >= 0.0 && f.per_row > 0.0 && f.per_context == 0.0, "{f:?}");
        assert!(close(f.seconds(1.0, 0.0) + f.per_row, 0.00595), "{f:?}");
    }
}

/// A stage group head's steps through its later stages since it started: what
/// `pdserve_stage_*` in `/metrics` report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageTotals {
    /// Steps sent through the later stages, and their rows (one per token computed).
    pub steps: u64,
    pub rows: u64,
    /// Bytes of residual stream sent to the stages and of their answers.
    pub bytes: u64,
    /// Seconds the head waited on them: their compute and the links both ways.
    pub seconds: f64,
    /// Seconds each stage spent computing its layers' share of those steps: the head
    /// first (its layers and the output head), then the later stages in layer order.
    #[serde(default)]
    pub compute: Vec<StageCompute>,
    /// Of the steps sent whole, the seconds waited beyond the later stages' compute:
    /// the hops' share. A step in micro-batches overlaps its hops with the stages'
    /// compute (and the head reads answers only once its own layers are done), so
    /// its wait has no such share to measure.
    #[serde(default)]
    pub link: f64,
    /// Steps among them that went through in micro-batches, one behind another.
    #[serde(default)]
    pub pipelined: u64,
    /// Steps among them that were a lane's: part of the group's decodes, sent into
    /// the later stages while another part was still in them (pipelining across steps).
    #[serde(default)]
    pub lanes: u64,
    /// Parts of K/V handoffs a later stage sent to the receiver itself.
    #[serde(default)]
    pub kv_parts: u64,
    /// Layers of K/V the head read from a later stage and sent on itself (a part
    /// that could not reach its receiver).
    #[serde(default)]
    pub kv_relayed_layers: u64,
    /// Handoffs into a decode group whose later stages each took their own layers
    /// straight from the sender.
    #[serde(default)]
    pub kv_direct: u64,
    /// Frames of later stages' layers the head received and wrote on to them (a
    /// sender that did not send them to the stages).
    #[serde(default)]
    pub kv_written_frames: u64,
}

/// One stage's compute time over a head's steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StageCompute {
    /// Its layers, inclusive.
    pub first: usize,
    pub last: usize,
    pub seconds: f64,
}

/// Speculative decoding's running totals on one engine since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecTotals {
    /// Drafted tokens verified, and those of them accepted.
    pub drafted: u64,
    pub accepted: u64,
    /// Drafts verified (a sequence's share of a step).
    pub verified_steps: u64,
    /// Sequences' decode steps, with a draft or without: `verified_steps` over this
    /// is how often a decode had a draft.
    #[serde(default)]
    pub decodes: u64,
    /// Prompt tokens the draft model computed: a decode worker whose prefill worker
    /// shipped the draft K/V with the target's computes none.
    #[serde(default)]
    pub draft_prompt_tokens: u64,
}
