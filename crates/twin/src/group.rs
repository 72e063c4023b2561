//! Stage groups in the twin: a worker whose model is split by layers across nodes of
//! the profile's shape, one stage each, joined by a link.
//!
//! A group's head runs its layers, then calls each later stage in turn with the
//! residual stream and takes the answer back (a star), so a step it keeps whole costs
//! the whole model's compute (the stages take turns) plus two hops per later stage; a
//! step it cuts into micro-batches costs their pipeline's span. Every hop carries every row of the step but the last one back, which
//! carries only the rows that get logits. A stage holds its share of the layers, so
//! its K/V blocks are that much smaller, and the weights a node no longer holds
//! become cache.

use crate::profile::Profile;
use crate::TwinError;
use pdserve_engine::batch::PassCost;
use pdserve_engine::timed::{StepCost, TimedModel, TimedStages};
use pdserve_worker::LinkModel;
use std::str::FromStr;

/// A worker split into `stages` stages joined by `link`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupShape {
    pub stages: usize,
    /// One hop, head to a later stage or back.
    pub link: LinkModel,
    /// The cores its stages share, where they run on one machine (`None`: a node
    /// each).
    pub cores: Option<usize>,
}

impl GroupShape {
    /// Hops a step takes: to each later stage and back.
    pub fn hops(&self) -> usize {
        2 * self.stages.saturating_sub(1)
    }

    /// The group's step cost, from the whole model's on one node and the bytes of a
    /// residual row on the wire.
    pub fn step(&self, whole: StepCost, row_bytes: f64) -> StepCost {
        if self.stages <= 1 {
            return whole;
        }
        let hops = self.hops() as f64;
        let per_row = row_bytes / self.link.bytes_per_s.max(1.0);
        StepCost {
            fixed_s: whole.fixed_s + hops * self.link.latency_s,
            token_s: whole.token_s + (hops - 1.0) * per_row,
            logits_s: whole.logits_s + per_row,
            ..whole
        }
    }

    /// The timed model of a group of `whole`'s model: a step its head keeps whole
    /// costs [`Self::step`]; one it cuts into micro-batches (as a head does, from the
    /// stages' costs: here the whole model's layers shared evenly, the rest on the
    /// head, and a hop's round trip) costs its pipeline's span. `layers_fixed_s` is
    /// the fixed part of a pass through every layer alone, where the profile timed it
    /// (else the stages share the step's whole fixed part). Its threads' work stays
    /// the compute (they wait on the links, idle).
    pub fn timed(&self, mut whole: TimedModel, row_bytes: f64, layers_fixed_s: Option<f64>) -> TimedModel {
        if self.stages > 1 {
            let per_row = row_bytes / self.link.bytes_per_s.max(1.0);
            let hop = PassCost { fixed: 2.0 * self.link.latency_s, per_row: 2.0 * per_row };
            let cost = whole.step.cost;
            let layers_fixed_s = layers_fixed_s.unwrap_or(cost.fixed_s);
            let cores = self.cores;
            whole.stages = Some(TimedStages { stages: self.stages, whole: cost, layers_fixed_s, hop, cores });
        }
        whole.step.cost = self.step(whole.step.cost, row_bytes);
        whole
    }

    /// KV blocks the group holds when each node has `memory` bytes for the model's
    /// `weights` and its cache of `block_bytes` a block (every layer's): stages of
    /// equal shares, each with `memory` less its share of the weights for blocks its
    /// share the size. `None` when a stage's share of the weights does not fit.
    pub fn kv_blocks(&self, memory: f64, weights: f64, block_bytes: f64) -> Option<usize> {
        let n = self.stages.max(1) as f64;
        let free = memory - weights / n;
        (free > 0.0 && block_bytes > 0.0).then(|| (free / (block_bytes / n)) as usize)
    }
}

/// A link between a group's nodes, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageLink {
    /// This machine's loopback: the profile's timed TCP link.
    Loopback,
    /// Separate hosts on 1 or 10 Gbit Ethernet: the loopback's cost (the software's)
    /// plus the wire's.
    Gbe1,
    Gbe10,
}

/// Assumed per hop on the wire past loopback's: one-way latency through two NICs and
/// a switch, and TCP's goodput on the line rate. Not measured here.
const GBE1_WIRE: LinkModel = LinkModel { latency_s: 50e-6, bytes_per_s: 117e6 };
const GBE10_WIRE: LinkModel = LinkModel { latency_s: 20e-6, bytes_per_s: 1.17e9 };

impl FromStr for StageLink {
    type Err = String;

    fn from_str(s: &str) -> Result<StageLink, String> {
        match s {
            "loopback" => Ok(StageLink::Loopback),
            "1gbe" => Ok(StageLink::Gbe1),
            "10gbe" => Ok(StageLink::Gbe10),
            _ => Err(format!("unknown stage link {s:?} (loopback, 1gbe or 10gbe)")),
        }
    }
}

impl StageLink {
    pub fn name(self) -> &'static str {
        match self {
            StageLink::Loopback => "loopback",
            StageLink::Gbe1 => "1 GbE",
            StageLink::Gbe10 => "10 GbE",
        }
    }

    /// The hop's model: `loopback`'s software cost, plus the wire's in series.
    pub fn model(self, loopback: LinkModel) -> LinkModel {
        let wire = match self {
            StageLink::Loopback => return loopback,
            StageLink::Gbe1 => GBE1_WIRE,
            StageLink::Gbe10 => GBE10_WIRE,
        };
        let seconds_per_byte = 1.0 / loopback.bytes_per_s.max(1.0) + 1.0 / wire.bytes_per_s;
        LinkModel { latency_s: loopback.latency_s + wire.latency_s, bytes_per_s: 1.0 / seconds_per_byte }
    }
}

/// What a group of the profile's model needs from it: the bytes of a residual row
/// on the wire and of the weights. A profile timed before groups were lacks them.
pub fn row_and_weights(profile: &Profile) -> Result<(f64, f64), TwinError> {
    let m = &profile.model;
    if m.hidden == 0 || m.weight_bytes == 0 {
        return Err(TwinError::Invalid(
            "this profile does not state the model's hidden size and weight bytes (timed before stage groups \
             were): run `pdserve profile` again"
                .into(),
        ));
    }
    // f32 values; the call's header (a part's shape and block ids) is a few bytes.
    Ok((m.hidden as f64 * 4.0, m.weight_bytes as f64))
}

/// A node's bytes for a group's cache: its memory (`node`, or by default the weights
/// and the profile's blocks beside them), the weights, and one block of every layer.
pub fn node_bytes(profile: &Profile, node: Option<f64>) -> Result<(f64, f64, f64), TwinError> {
    let (_, weights) = row_and_weights(profile)?;
    let block = profile.block_bytes() as f64;
    Ok((node.unwrap_or(weights + profile.model.kv_blocks as f64 * block), weights, block))
}

/// The profile's timed TCP link: a stage hop over loopback.
pub fn loopback(profile: &Profile) -> Result<LinkModel, TwinError> {
    let tcp = profile.links().into_iter().find(|(k, _)| *k == pdserve_kv_transfer::TransportKind::Tcp);
    tcp.map(|(_, l)| l).ok_or_else(|| TwinError::Invalid("this profile has no timed TCP link".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn a_step_adds_two_hops_per_later_stage_and_its_rows_on_each() {
        let whole = StepCost { fixed_s: 0.010, token_s: 0.001, pair_s: 1e-7, decode_pair_s: 2e-7, logits_s: 0.002 };
        let link = LinkModel { latency_s: 1e-4, bytes_per_s: 1e6 };
        // (stages, fixed, token, logits): a row of 1000 bytes is 1 ms on this link.
        for (stages, fixed, token, logits) in
            [(1, 0.010, 0.001, 0.002), (2, 0.0102, 0.002, 0.003), (3, 0.0104, 0.004, 0.003), (4, 0.0106, 0.006, 0.003)]
        {
            let s = GroupShape { stages, link, cores: None }.step(whole, 1000.0);
            assert!(close(s.fixed_s, fixed) && close(s.token_s, token) && close(s.logits_s, logits), "{stages}: {s:?}");
            assert_eq!((s.pair_s, s.decode_pair_s), (whole.pair_s, whole.decode_pair_s));
        }
    }

    #[test]
    fn a_split_frees_the_weights_a_node_no_longer_holds_for_cache() {
        let link = LinkModel { latency_s: 0.0, bytes_per_s: 1.0 };
        let g = |stages| GroupShape { stages, link, cores: None };
        // A node of 10 units, weights of 6, blocks of 1 unit (every layer's).
        assert_eq!(g(1).kv_blocks(10.0, 6.0, 1.0), Some(4));
        assert_eq!(g(2).kv_blocks(10.0, 6.0, 1.0), Some(14));
        assert_eq!(g(3).kv_blocks(10.0, 6.0, 1.0), Some(24));
        // Weights of 15 fit no node alone, two halves of 7.5 do.
        assert_eq!(g(1).kv_blocks(10.0, 15.0, 1.0), None);
        assert_eq!(g(2).kv_blocks(10.0, 15.0, 1.0), Some(5));
    }

    #[test]
    fn an_ethernet_hop_is_the_softwares_cost_then_the_wires() {
        let lo = LinkModel { latency_s: 30e-6, bytes_per_s: 2e9 };
        assert_eq!(StageLink::Loopback.model(lo), lo);
        let one = StageLink::Gbe1.model(lo);
        assert!(close(one.latency_s, 80e-6), "{one:?}");
        // A 16 KB row: 8 µs of copies and 140 µs on the wire.
        let row = 16384.0 / one.bytes_per_s;
        assert!(close(row, 16384.0 / 2e9 + 16384.0 / 117e6), "{row}");
        let ten = StageLink::Gbe10.model(lo);
        assert!(ten.bytes_per_s > one.bytes_per_s * 5.0 && ten.latency_s < one.latency_s);
        for (s, want) in
            [("loopback", Ok(StageLink::Loopback)), ("1gbe", Ok(StageLink::Gbe1)), ("10gbe", Ok(StageLink::Gbe10))]
        {
            assert_eq!(s.parse::<StageLink>(), want);
        }
        assert!("wifi".parse::<StageLink>().is_err());
    }
}
