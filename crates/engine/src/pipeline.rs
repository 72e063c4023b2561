//! Pipelining a stage group's step: its rows cut into micro-batches that follow one
//! another through the stages, so a stage computes one while the stage before it
//! computes the next. Whether that pays is the stages' own measured costs' to say: a
//! pass that costs mostly a fixed time (decoding a few rows reads every weight, however
//! few the rows) costs nearly as much for half the rows, and cutting the step in two
//! would pay that fixed time twice on every stage; a pass that costs mostly per row (a
//! prompt's chunk, a large batch) halves with its rows, and the stages then overlap.

use pdserve_types::PrefillSteps;
use std::ops::Range;

/// A pass's measured time: a fixed part and a part per row.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PassCost {
    pub fixed: f64,
    pub per_row: f64,
}

impl PassCost {
    fn of(self, rows: usize) -> f64 {
        self.fixed + self.per_row * rows as f64
    }

    /// This pass, then `next` on the same stage.
    pub fn then(self, next: PassCost) -> PassCost {
        PassCost { fixed: self.fixed + next.fixed, per_row: self.per_row + next.per_row }
    }
}

/// A stage's passes so far, by their rows: the running sums a step's pace is fitted
/// from.
#[derive(Debug, Clone, Copy, Default)]
pub struct PassTimes(PrefillSteps);

impl PassTimes {
    pub fn record(&mut self, rows: usize, seconds: f64) {
        self.0.record(rows, seconds);
    }

    /// The passes' seconds together.
    pub fn seconds(&self) -> f64 {
        self.0.seconds
    }

    /// The passes' cost, once passes of more than one size tell its fixed part from
    /// its part per row.
    pub fn cost(&self) -> Option<PassCost> {
        let p = &self.0;
        let (n, x) = (p.steps as f64, p.tokens as f64);
        if n * p.tokens_sq - x * x <= 1e-6 * n * p.tokens_sq {
            return None;
        }
        p.fit().map(|(fixed, per_row)| PassCost { fixed, per_row })
    }
}

/// How many micro-batches a step of `rows` rows goes through in: the count, up to one
/// per stage, whose pipeline is predicted to end soonest, from each stage's pass cost
/// (`stages`, the head's first) and a hop's (`hop`, which every micro-batch pays
/// between two stages). 1, the step whole, on a tie or where a cost is not known.
pub fn micro_batches(stages: &[Option<PassCost>], hop: Option<PassCost>, rows: usize) -> usize {
    let (Some(costs), Some(hop)) = (stages.iter().copied().collect::<Option<Vec<_>>>(), hop) else { return 1 };
    let most = costs.len().min(rows).max(1);
    let end = |m: usize| makespan(&costs, hop, &even(rows, m));
    (2..=most).map(|m| (m, end(m))).fold((1, end(1)), |best, (m, t)| if t < best.1 { (m, t) } else { best }).0
}

/// The micro-batches [`micro_batches`] takes for a step of `rows` rows through
/// `stages` (every cost known) and when the last leaves the last stage: what a stage
/// group's step is predicted to take (the twin's clock for a group).
pub fn soonest(stages: &[PassCost], hop: PassCost, rows: usize) -> (usize, f64) {
    let known: Vec<Option<PassCost>> = stages.iter().copied().map(Some).collect();
    let m = micro_batches(&known, Some(hop), rows);
    (m, makespan(stages, hop, &even(rows, m)))
}

/// How many lanes a group's decodes of `rows` rows go in, pipelined across steps;
/// `None` where they go whole. Each step sends one lane's rows into the later stages
/// and lands the oldest lane's, so while the head computes one lane the others are in
/// the later stages, and a lane's next step starts as soon as its tokens are sampled.
/// A round (every sequence one token on) then takes the longer of a lane's way
/// through the stages and the busiest stage's passes, one a lane, against one whole
/// step's way through them; the count (2 up to one a stage) whose round is shortest is
/// taken where that is shorter, from the stages' measured costs (the head's first).
/// Each pass of a lane pays a stage's fixed time again, so a stage far slower than the
/// others keeps the decodes whole; a slow link favours lanes (one crosses it while
/// the head computes another).
pub fn lanes(stages: &[Option<PassCost>], hop: Option<PassCost>, rows: usize) -> Option<usize> {
    let (Some(costs), Some(hop)) = (stages.iter().copied().collect::<Option<Vec<_>>>(), hop) else { return None };
    lanes_round(&costs, hop, rows).map(|(lanes, _)| lanes)
}

/// The lanes [`lanes`] takes for `rows` decodes and what a round of them takes, where
/// that is shorter than one step whole: the twin's clock for a group's decodes.
pub fn lanes_round(stages: &[PassCost], hop: PassCost, rows: usize) -> Option<(usize, f64)> {
    let whole = makespan(stages, hop, &[rows]);
    let round = |lanes: usize| {
        let sizes = even(rows, lanes);
        let widest = sizes.iter().copied().max().unwrap_or(0);
        let busiest = stages.iter().map(|c| sizes.iter().map(|&r| c.of(r)).sum::<f64>()).fold(0.0, f64::max);
        makespan(stages, hop, &[widest]).max(busiest)
    };
    let counts = 2..=stages.len().min(rows);
    counts.map(|l| (l, round(l))).filter(|&(_, t)| t < whole).min_by(|a, b| a.1.total_cmp(&b.1))
}

/// The compute of every stage's passes over micro-batches (or lanes) of `sizes`
/// rows each: what the stages' cores must do, wherever they do it.
pub(crate) fn work(stages: &[PassCost], sizes: &[usize]) -> f64 {
    stages.iter().map(|c| sizes.iter().map(|&r| c.of(r)).sum::<f64>()).sum()
}

/// `rows` cut into `m` runs as even as whole rows allow.
pub(crate) fn even(rows: usize, m: usize) -> Vec<usize> {
    (0..m).map(|j| (j + 1) * rows / m - j * rows / m).collect()
}

/// When the last micro-batch (of `sizes` rows each) leaves the last stage: each stage
/// takes the micro-batches in order, each micro-batch the stages in order, with a hop
/// before every stage but the first.
fn makespan(stages: &[PassCost], hop: PassCost, sizes: &[usize]) -> f64 {
    let mut done = vec![0.0f64; sizes.len()];
    for (i, stage) in stages.iter().enumerate() {
        let mut free = 0.0f64;
        for (j, &r) in sizes.iter().enumerate() {
            let arrives = if i == 0 { 0.0 } else { done[j] + hop.of(r) };
            free = free.max(arrives) + stage.of(r);
            done[j] = free;
        }
    }
    done.last().copied().unwrap_or(0.0)
}

/// A step's parts of `rows` rows each, cut into `m` micro-batches of rows as even as
/// whole rows allow: each micro-batch's (part, its rows) in order. A part may be cut
/// across two micro-batches; its later rows attend to its earlier ones, which every
/// stage has computed by then (a stage takes the micro-batches in order).
pub fn cut(rows: &[usize], m: usize) -> Vec<Vec<(usize, Range<usize>)>> {
    let sizes = even(rows.iter().sum(), m.max(1));
    let mut out = Vec::with_capacity(sizes.len());
    let (mut part, mut at) = (0, 0);
    for size in sizes {
        let (mut mb, mut left) = (Vec::new(), size);
        while left > 0 && part < rows.len() {
            let take = left.min(rows[part] - at);
            if take > 0 {
                mb.push((part, at..at + take));
            }
            (at, left) = (at + take, left - take);
            if at == rows[part] {
                (part, at) = (part + 1, 0);
            }
        }
        if !mb.is_empty() {
            out.push(mb);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMORY_BOUND: PassCost = PassCost { fixed: 0.004, per_row: 0.0001 };
    const PER_ROW: PassCost = PassCost { fixed: 0.0005, per_row: 0.001 };
    const HOP: PassCost = PassCost { fixed: 0.0001, per_row: 0.000_002 };
    const LIGHT: PassCost = PassCost { fixed: 0.0005, per_row: 0.0 };
    const EVEN: PassCost = PassCost { fixed: 0.002, per_row: 0.0005 };
    const OUTPUT_HEAD: PassCost = PassCost { fixed: 0.0025, per_row: 0.0004 };

    #[test]
    fn micro_batches_follow_what_a_pass_costs() {
        let two = |c| [Some(c), Some(c)];
        let three = |c| [Some(c), Some(c), Some(c)];
        // (each stage's pass, a hop, the step's rows, the micro-batches)
        type Case<'a> = (&'a [Option<PassCost>], Option<PassCost>, usize, usize);
        let cases: &[Case<'_>] = &[
            // A decode of a few rows costs its weights' reading: cutting it pays that twice.
            (&two(MEMORY_BOUND), Some(HOP), 4, 1),
            // A prompt's chunk costs per row: its halves overlap on two stages.
            (&two(PER_ROW), Some(HOP), 64, 2),
            (&three(PER_ROW), Some(HOP), 64, 3),
            // Never more micro-batches than rows, nor than stages.
            (&three(PER_ROW), Some(HOP), 2, 2),
            (&two(PER_ROW), Some(HOP), 1, 1),
            // A long step whose pass is nearly all fixed cost.
            (&two(PassCost { fixed: 0.05, per_row: 0.000_01 }), Some(HOP), 64, 1),
            // A cost not measured yet: the step whole.
            (&[Some(PER_ROW), None], Some(HOP), 64, 1),
            (&two(PER_ROW), None, 64, 1),
        ];
        for (i, &(stages, hop, rows, want)) in cases.iter().enumerate() {
            assert_eq!(micro_batches(stages, hop, rows), want, "case {i}");
        }
    }

    #[test]
    fn decodes_go_in_lanes_where_a_round_is_predicted_shorter() {
        let two = |c| [Some(c), Some(c)];
        let three = |c| [Some(c), Some(c), Some(c)];
        let heavy = PassCost { fixed: 0.004, per_row: 0.0002 };
        // (each stage's pass, a hop, the decodes, the lanes)
        type Case<'a> = (&'a [Option<PassCost>], Option<PassCost>, usize, Option<usize>);
        let cases: &[Case<'_>] = &[
            // Decodes that cost their weights' reading: each lane pays it again, but a
            // stage reads while the others do, so a round still ends sooner.
            (&two(MEMORY_BOUND), Some(HOP), 4, Some(2)),
            (&two(PER_ROW), Some(HOP), 16, Some(2)),
            // Three stages keep busiest with a lane each...
            (&three(PER_ROW), Some(HOP), 9, Some(3)),
            (&three(MEMORY_BOUND), Some(HOP), 6, Some(3)),
            // ...but no more lanes than sequences,
            (&three(PER_ROW), Some(HOP), 2, Some(2)),
            // nor a third lane that pays two heavy stages' fixed time once more than
            // its overlap saves.
            (&[Some(LIGHT), Some(heavy), Some(heavy)], Some(HOP), 8, Some(2)),
            // Stages alike take a lane each; but a head that also runs its output
            // head once a lane is busiest, and two lanes end its round sooner.
            (&three(EVEN), Some(HOP), 6, Some(3)),
            (&[Some(EVEN.then(OUTPUT_HEAD)), Some(EVEN), Some(EVEN)], Some(HOP), 6, Some(2)),
            // One sequence has no second lane; one stage has no other to overlap.
            (&two(MEMORY_BOUND), Some(HOP), 1, None),
            (&[Some(MEMORY_BOUND)], Some(HOP), 8, None),
            // A later stage far slower than the head: its two passes outlast a whole step.
            (&[Some(LIGHT), Some(PassCost { fixed: 0.01, per_row: 0.0001 })], Some(HOP), 4, None),
            // A slow link: one lane crosses it while the head computes the other.
            (&two(MEMORY_BOUND), Some(PassCost { fixed: 0.02, per_row: 0.0 }), 4, Some(2)),
            // A cost not measured yet.
            (&[Some(MEMORY_BOUND), None], Some(HOP), 4, None),
            (&two(MEMORY_BOUND), None, 4, None),
        ];
        for (i, &(stages, hop, rows, want)) in cases.iter().enumerate() {
            assert_eq!(lanes(stages, hop, rows), want, "case {i}");
        }
    }

    #[test]
    fn a_pass_cost_is_known_once_two_sizes_were_timed() {
        let mut t = PassTimes::default();
        assert_eq!(t.cost(), None);
        t.record(1, 0.0041);
        t.record(1, 0.0041);
        assert_eq!(t.cost(), None, "one size tells no fixed part apart");
        t.record(33, 0.0073);
        let c = t.cost().unwrap();
        assert!((c.fixed - 0.004).abs() < 1e-9 && (c.per_row - 0.0001).abs() < 1e-9, "{c:?}");
    }

    #[test]
    fn the_pipeline_overlaps_stages_and_pays_each_hop() {
        // Two stages of 1 s a row: 4 rows whole take 8 s; in two micro-batches, 6 s.
        let s = [PassCost { fixed: 0.0, per_row: 1.0 }; 2];
        let free = PassCost::default();
        assert_eq!(makespan(&s, free, &[4]), 8.0);
        assert_eq!(makespan(&s, free, &[2, 2]), 6.0);
        assert_eq!(makespan(&s, PassCost { fixed: 0.5, per_row: 0.0 }, &[2, 2]), 6.5);
    }

    #[test]
    fn a_cut_keeps_every_row_once_in_order() {
        // (each part's rows, the micro-batches, each micro-batch's rows by part)
        type Case<'a> = (&'a [usize], usize, &'a [&'a [(usize, Range<usize>)]]);
        let cases: &[Case<'_>] = &[
            (&[1, 1, 1, 1], 2, &[&[(0, 0..1), (1, 0..1)], &[(2, 0..1), (3, 0..1)]]),
            (&[64], 2, &[&[(0, 0..32)], &[(0, 32..64)]]),
            (&[5, 1, 2], 2, &[&[(0, 0..4)], &[(0, 4..5), (1, 0..1), (2, 0..2)]]),
            (&[3, 3], 3, &[&[(0, 0..2)], &[(0, 2..3), (1, 0..1)], &[(1, 1..3)]]),
            (&[2, 1], 1, &[&[(0, 0..2), (1, 0..1)]]),
        ];
        for &(rows, m, want) in cases {
            let got = cut(rows, m);
            let want: Vec<Vec<(usize, Range<usize>)>> = want.iter().map(|mb| mb.to_vec()).collect();
            assert_eq!(got, want, "{rows:?} in {m}");
        }
    }
}
