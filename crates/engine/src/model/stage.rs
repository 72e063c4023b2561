//! A pipeline stage's share of a model: a contiguous range of its decoder layers. The
//! first stage also holds the token embeddings and the output head (final norm and
//! projection); a later stage takes the residual stream in and hands it on, the last
//! one back to the first for the logits.

use crate::format::FormatError;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// Layers `first..=last` of a model (the CLI's `--layers A..B`, both ends included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerRange {
    pub first: usize,
    pub last: usize,
}

impl LayerRange {
    /// Every layer of a model of `n` layers.
    pub fn whole(n: usize) -> Self {
        LayerRange { first: 0, last: n.saturating_sub(1) }
    }

    /// How many layers (never zero).
    pub fn count(self) -> usize {
        self.last + 1 - self.first
    }

    /// The layers' indices in the whole model.
    pub fn indices(self) -> Range<usize> {
        self.first..self.last + 1
    }

    /// Whether this range starts the model (so holds the embeddings).
    pub fn embeds(self) -> bool {
        self.first == 0
    }

    /// Whether this range ends a model of `total` layers (so holds the head).
    pub fn heads(self, total: usize) -> bool {
        self.last + 1 == total
    }

    /// This range, when it lies within a model of `total` layers.
    pub fn within(self, total: usize) -> Result<Self, FormatError> {
        if self.last < total {
            Ok(self)
        } else {
            Err(FormatError::Invalid(format!(
                "layers {self} are past the model's last layer, {}",
                total.saturating_sub(1)
            )))
        }
    }
}

impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.first, self.last)
    }
}

impl FromStr for LayerRange {
    type Err = String;

    /// `A..B` (layers A to B, both included) or a single layer `A`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("layers {s:?}: expected A..B (first and last layer, from 0)");
        let (a, b) = s.split_once("..").unwrap_or((s, s));
        let first: usize = a.trim().parse().map_err(|_| bad())?;
        let last: usize = b.trim().trim_start_matches('=').parse().map_err(|_| bad())?;
        if last < first {
            return Err(format!("layers {s:?}: the last layer comes before the first"));
        }
        Ok(LayerRange { first, last })
    }
}

/// Whether `ranges`, in any order, cover layers `0..total` exactly once, each: the
/// stages of a group that can serve. Returns them sorted by first layer when they do.
pub fn covering(ranges: &[LayerRange], total: usize) -> Option<Vec<LayerRange>> {
    let mut sorted = ranges.to_vec();
    sorted.sort_by_key(|r| r.first);
    let mut next = 0;
    for r in &sorted {
        if r.first != next {
            return None;
        }
        next = r.last + 1;
    }
    (next == total && total > 0).then_some(sorted)
}

/// Splits `total` layers into `stages` ranges whose sizes follow `weights` (each
/// stage's free memory, say), every stage getting at least one layer.
pub fn split(total: usize, weights: &[f64]) -> Option<Vec<LayerRange>> {
    let n = weights.len();
    if n == 0 || total < n || weights.iter().any(|w| !w.is_finite() || *w <= 0.0) {
        return None;
    }
    let sum: f64 = weights.iter().sum();
    let mut ranges = Vec::with_capacity(n);
    let (mut first, mut acc) = (0, 0.0);
    for (i, w) in weights.iter().enumerate() {
        acc += w;
        let left = n - i - 1;
        // Rounded at the running share, so the rounding errors do not add up.
        let end = ((acc / sum * total as f64).round() as usize).clamp(first + 1, total - left);
        ranges.push(LayerRange { first, last: end - 1 });
        first = end;
    }
    Some(ranges)
}

/// What a node of a group holds: the weights of its layers (`layers[i]`, bytes of
/// layer i) and, on the first, `first` bytes more (the embeddings and the output
/// head, and its logits rows), plus `kv` bytes of K/V per layer it holds and `step`
/// bytes of a step's working buffers, whatever its layers.
pub struct StageBytes<'a> {
    pub layers: &'a [f64],
    pub first: f64,
    pub kv: f64,
    pub step: f64,
}

impl StageBytes<'_> {
    /// The bytes node `i` of a group needs for `range`.
    pub fn of(&self, i: usize, range: LayerRange) -> f64 {
        self.layer_bytes(range) + self.fixed(i)
    }

    fn layer_bytes(&self, range: LayerRange) -> f64 {
        let weights: f64 = self.layers[range.indices()].iter().sum();
        weights + self.kv * range.count() as f64
    }

    /// What node `i` holds whatever its layers.
    fn fixed(&self, i: usize) -> f64 {
        self.step + if i == 0 { self.first } else { 0.0 }
    }

    /// Ranges for nodes of `memory` bytes each (the first the group's head): layers
    /// in proportion to what each can spare past what it holds whatever its range
    /// (the head's embeddings and output head), or why they cannot hold the model.
    pub fn ranges(&self, memory: &[f64]) -> Result<Vec<LayerRange>, String> {
        self.ranges_of(memory, &(0..memory.len()).collect::<Vec<_>>())
    }

    /// [`Self::ranges`] for nodes in group order whose names (in errors) are `nodes`.
    fn ranges_of(&self, memory: &[f64], nodes: &[usize]) -> Result<Vec<LayerRange>, String> {
        if let Some(i) = (0..memory.len()).find(|&i| memory[i] <= self.fixed(i)) {
            let (who, what) = match i {
                0 => ("the head", "the embeddings, output head and a step's buffers"),
                _ => ("a later stage", "a step's buffers"),
            };
            return Err(format!(
                "{who} (node {}, {:.0} MiB) cannot hold {what} ({:.0} MiB)",
                nodes[i],
                memory[i] / MIB,
                self.fixed(i) / MIB
            ));
        }
        let spare: Vec<f64> = memory.iter().enumerate().map(|(i, m)| m - self.fixed(i)).collect();
        let ranges = split(self.layers.len(), &spare).ok_or_else(|| {
            format!("{} nodes cannot split {} layers, one or more each", memory.len(), self.layers.len())
        })?;
        for (i, (&r, m)) in ranges.iter().zip(memory).enumerate() {
            let need = self.of(i, r);
            if need > *m {
                return Err(format!(
                    "node {} would need {:.0} MiB for layers {r}, past its {:.0} MiB: the model does not fit these nodes",
                    nodes[i],
                    need / MIB,
                    m / MIB
                ));
            }
        }
        Ok(ranges)
    }

    /// The nodes in group order (the head first) and their ranges, for nodes of
    /// `memory` bytes: the head is the first of `heads` (best first, see
    /// [`heads_by_links`]) under which the nodes hold the model, the others follow in
    /// the order given; or why the best head's group cannot hold it.
    pub fn place(&self, memory: &[f64], heads: &[usize]) -> Result<Placement, String> {
        let mut first_err = None;
        for &h in heads {
            let order: Vec<usize> = std::iter::once(h).chain((0..memory.len()).filter(|&i| i != h)).collect();
            let ordered: Vec<f64> = order.iter().map(|&i| memory[i]).collect();
            match self.ranges_of(&ordered, &order) {
                Ok(ranges) => return Ok((order, ranges)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        Err(first_err.unwrap_or_else(|| "no node to head the group".to_string()))
    }
}

/// Nodes in group order (the head first, numbered as given) and their ranges.
pub type Placement = (Vec<usize>, Vec<LayerRange>);

/// What a step's hops cost with node `h` heading a group whose hop from node i to
/// node j costs `hop[i][j]` (`None`: not known): every later stage's rows go out from
/// the head and come back to it, so the sum of its hops to the others, both ways;
/// infinite when one is not known.
pub fn head_cost(hop: &[Vec<Option<f64>>], h: usize) -> f64 {
    let both_ways = |k: usize| hop[h][k].zip(hop[k][h]).map_or(f64::INFINITY, |(out, back)| out + back);
    (0..hop.len()).filter(|&k| k != h).map(both_ways).sum()
}

/// The nodes best placed to head a group, best first, by [`head_cost`]: a node with a
/// hop not known ranks after every node whose hops are all known; ties keep the order
/// given.
pub fn heads_by_links(hop: &[Vec<Option<f64>>]) -> Vec<usize> {
    let cost: Vec<f64> = (0..hop.len()).map(|h| head_cost(hop, h)).collect();
    let mut heads: Vec<usize> = (0..hop.len()).collect();
    heads.sort_by(|&a, &b| cost[a].total_cmp(&cost[b]));
    heads
}

const MIB: f64 = (1 << 20) as f64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_follow_what_each_node_spares_and_refuse_what_does_not_fit() {
        // 10 layers of 10 bytes with 2 of K/V each; the head keeps 30 more.
        let b = StageBytes { layers: &[10.0; 10], first: 30.0, kv: 2.0, step: 0.0 };
        // 90 spare on the head, 60 on the second: 6 and 4 layers.
        assert_eq!(b.ranges(&[120.0, 60.0]), Ok(vec![r(0, 5), r(6, 9)]));
        assert_eq!(b.of(0, r(0, 5)), 102.0);
        // Equal nodes: the head takes fewer layers.
        assert_eq!(b.ranges(&[80.0, 80.0, 80.0]), Ok(vec![r(0, 1), r(2, 5), r(6, 9)]));
        // Too small in all: 150 needed, 140 there.
        let err = b.ranges(&[70.0, 70.0]).unwrap_err();
        assert!(err.contains("does not fit"), "{err}");
        // A head that cannot hold its own embeddings, more nodes than layers.
        assert!(b.ranges(&[20.0, 200.0]).unwrap_err().contains("the head"));
        assert!(b.ranges(&[200.0; 11]).is_err());
        // A step's buffers on every node come off what each spares (90 and 50 here),
        // and what fits without them may not with them.
        let with_steps = StageBytes { step: 10.0, ..b };
        assert_eq!(with_steps.ranges(&[130.0, 60.0]), Ok(vec![r(0, 5), r(6, 9)]));
        assert_eq!(with_steps.of(1, r(6, 9)), 58.0);
        assert!(b.ranges(&[120.0, 55.0]).is_ok());
        assert!(with_steps.ranges(&[120.0, 55.0]).unwrap_err().contains("node 1 would need"));
        assert!(with_steps.ranges(&[120.0, 10.0]).unwrap_err().contains("a later stage (node 1"));
    }

    #[test]
    fn the_head_is_the_node_with_the_cheapest_hops_that_holds_the_model() {
        let k = Some;
        // Node 1 is 1 ms from each other node; 0 and 2 are 5 ms apart.
        let star = vec![vec![None, k(1.0), k(5.0)], vec![k(1.0), None, k(1.0)], vec![k(5.0), k(1.0), None]];
        assert_eq!(heads_by_links(&star), vec![1, 0, 2]);
        // One-way figures add up both ways; an unknown hop ranks a node last.
        let uneven = vec![vec![None, k(1.0), k(1.0)], vec![k(9.0), None, None], vec![k(1.0), None, None]];
        assert_eq!(heads_by_links(&uneven), vec![0, 1, 2]);
        type Case<'a> = (&'a [f64], &'a [usize], Result<Placement, &'a str>);
        let table: &[Case] = &[
            // The best head holds it: it goes first, the rest in the order given.
            (&[80.0, 200.0, 80.0], &[1, 0, 2], Ok((vec![1, 0, 2], vec![r(0, 4), r(5, 7), r(8, 9)]))),
            // The best head cannot hold the embeddings: the next one heads.
            (&[120.0, 20.0, 60.0], &[1, 0, 2], Ok((vec![0, 1, 2], vec![r(0, 4), r(5, 5), r(6, 9)]))),
            // No head makes them hold the model: the best head's reason, naming nodes
            // as given.
            (&[40.0, 40.0], &[1, 0], Err("node 1 would need")),
            (&[20.0, 20.0], &[1, 0], Err("the head (node 1,")),
        ];
        let b = StageBytes { layers: &[10.0; 10], first: 30.0, kv: 2.0, step: 0.0 };
        for (memory, heads, want) in table {
            match (b.place(memory, heads), want) {
                (Ok(got), Ok(want)) => assert_eq!(&got, want, "{memory:?}"),
                (Err(e), Err(want)) => assert!(e.contains(want), "{memory:?}: {e}"),
                (got, want) => panic!("{memory:?}: {got:?}, want {want:?}"),
            }
        }
    }

    fn r(first: usize, last: usize) -> LayerRange {
        LayerRange { first, last }
    }

    #[test]
    fn parses_ranges_and_refuses_nonsense() {
        assert_eq!("0..14".parse(), Ok(r(0, 14)));
        assert_eq!("15..=29".parse(), Ok(r(15, 29)));
        assert_eq!("7".parse(), Ok(r(7, 7)));
        for bad in ["", "a..3", "3..1", "1..", "..4", "-1..2"] {
            assert!(bad.parse::<LayerRange>().is_err(), "{bad}");
        }
        assert_eq!(r(3, 9).to_string(), "3..9");
    }

    #[test]
    fn a_group_serves_once_its_ranges_cover_every_layer_once() {
        let table: &[(&[LayerRange], usize, bool)] = &[
            (&[r(0, 29)], 30, true),
            (&[r(15, 29), r(0, 14)], 30, true),
            (&[r(0, 9), r(10, 19), r(20, 29)], 30, true),
            (&[r(0, 14)], 30, false),
            (&[r(0, 15), r(15, 29)], 30, false),
            (&[r(0, 13), r(15, 29)], 30, false),
            (&[r(0, 14), r(15, 30)], 30, false),
            (&[], 30, false),
        ];
        for (ranges, total, serves) in table {
            assert_eq!(covering(ranges, *total).is_some(), *serves, "{ranges:?}");
        }
    }

    #[test]
    fn splits_follow_the_weights_and_give_every_stage_a_layer() {
        assert_eq!(split(30, &[1.0, 1.0]), Some(vec![r(0, 14), r(15, 29)]));
        assert_eq!(split(30, &[1.0, 2.0]), Some(vec![r(0, 9), r(10, 29)]));
        assert_eq!(split(3, &[100.0, 1.0, 1.0]), Some(vec![r(0, 0), r(1, 1), r(2, 2)]));
        assert_eq!(split(2, &[1.0, 1.0, 1.0]), None);
        assert_eq!(split(30, &[1.0, 0.0]), None);
        for total in 3..40 {
            let s = split(total, &[3.0, 1.0, 2.0]).unwrap();
            assert!(covering(&s, total).is_some(), "{total}: {s:?}");
        }
    }
}
