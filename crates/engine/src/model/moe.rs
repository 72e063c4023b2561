//! A sparse mixture of experts (the feed-forward of Qwen 3 MoE, as the Switch and
//! Mixtral papers describe it and llama.cpp runs it): a router scores every expert for
//! each token, a softmax turns the scores into probabilities, the `used` most probable
//! experts are kept with their probabilities renormalized to sum to 1, and the token's
//! output is the weighted sum of those experts' SwiGLU networks.
//!
//! In a batch, each expert runs once over the rows of every token that chose it. A
//! token's output sums its experts in the order of their rank, so it does not depend
//! on which other tokens share the step.

use super::blocks::{weight, FeedForward, GatedMlp, MlpScratch};
use super::forward::{ForwardScratch, Step};
use super::linear::Linear;
use crate::config::{ModelConfig, MoeConfig};
use crate::format::{FormatError, TensorSource};
use crate::kernels::fit;

pub(super) struct Moe {
    /// `experts × hidden`: one score per expert.
    router: Linear,
    experts: Vec<GatedMlp>,
    used: usize,
}

/// Buffers of one mixture-of-experts pass.
#[derive(Default)]
pub(super) struct MoeScratch {
    scores: Vec<f32>,
    /// Per token, its chosen experts with their weights, best first.
    choice: Vec<(usize, f32)>,
    rows: Vec<usize>,
    input: Vec<f32>,
    output: Vec<f32>,
    /// `tokens × used × hidden`: each chosen expert's weighted output.
    slots: Vec<f32>,
    mlp: MlpScratch,
}

impl MoeScratch {
    /// Bytes its buffers hold.
    pub(super) fn bytes(&self) -> usize {
        let f32s = self.scores.capacity() + self.input.capacity() + self.output.capacity() + self.slots.capacity();
        4 * f32s + 16 * self.choice.capacity() + 8 * self.rows.capacity() + self.mlp.bytes()
    }
}

impl Moe {
    pub(super) fn load(
        src: &dyn TensorSource,
        cfg: &ModelConfig,
        m: &MoeConfig,
        l: usize,
    ) -> Result<Self, FormatError> {
        let router = Linear::load(src, &[weight(l, "ffn_gate_inp")], false)?;
        if (router.out_features, router.in_features) != (m.experts, cfg.hidden) {
            return Err(FormatError::Invalid(format!("layer {l} expert router: shape does not match the config")));
        }
        let experts = (0..m.experts).map(|e| GatedMlp::load_expert(src, cfg, l, e, m.expert_ffn));
        Ok(Moe { router, experts: experts.collect::<Result<_, _>>()?, used: m.used })
    }
}

/// The `used` most probable experts of one token's router scores, best first (the
/// lower index first among equals), with their softmax probabilities renormalized
/// over the chosen ones.
pub(super) fn route(scores: &[f32], used: usize, out: &mut Vec<(usize, f32)>) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let probs: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let first = out.len();
    out.extend(order.into_iter().take(used).map(|e| (e, probs[e] / total)));
    // As llama.cpp: the sum is kept away from zero by f16's smallest normal.
    let sum = out[first..].iter().map(|&(_, w)| w).sum::<f32>().max(6.103_515_6e-5);
    for (_, w) in &mut out[first..] {
        *w /= sum;
    }
}

impl FeedForward for Moe {
    fn forward(&self, step: &Step<'_, '_>, s: &mut ForwardScratch) {
        let (t, h, k) = (step.positions.len(), self.router.in_features, self.used);
        let m = &mut s.moe;
        fit(&mut m.scores, t * self.experts.len());
        self.router.forward(step.isa, step.pool, &s.h, t, &mut m.scores, &mut s.lin);
        m.choice.clear();
        for row in m.scores.chunks_exact(self.experts.len()) {
            route(row, k, &mut m.choice);
        }
        fit(&mut m.slots, t * k * h);
        for (e, expert) in self.experts.iter().enumerate() {
            // The (token, rank) slots that chose expert `e`.
            m.rows.clear();
            m.rows.extend((0..t * k).filter(|&i| m.choice[i].0 == e));
            if m.rows.is_empty() {
                continue;
            }
            m.input.clear();
            for &i in &m.rows {
                m.input.extend_from_slice(&s.h[i / k * h..(i / k + 1) * h]);
            }
            expert.forward_rows(step, &m.input, m.rows.len(), &mut m.output, &mut m.mlp, &mut s.lin);
            for (j, &i) in m.rows.iter().enumerate() {
                let w = m.choice[i].1;
                for (dst, src) in m.slots[i * h..(i + 1) * h].iter_mut().zip(&m.output[j * h..(j + 1) * h]) {
                    *dst = src * w;
                }
            }
        }
        fit(&mut s.proj, t * h);
        for (out, slots) in s.proj.chunks_exact_mut(h).zip(m.slots.chunks_exact(k * h)) {
            out.copy_from_slice(&slots[..h]);
            for slot in slots.chunks_exact(h).skip(1) {
                crate::kernels::ops::add_assign(out, slot);
            }
        }
    }

    fn size_bytes(&self) -> usize {
        self.router.size_bytes() + self.experts.iter().map(FeedForward::size_bytes).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::route;

    /// Router scores, experts used; the experts chosen, their weights.
    type Case = (&'static [f32], usize, &'static [usize], &'static [f32]);

    #[test]
    fn route_keeps_the_best_experts_with_weights_renormalized() {
        let cases: &[Case] = &[
            (&[0.0, 2.0, 1.0, 3.0], 2, &[3, 1], &[0.731_058_6, 0.268_941_4]),
            (&[1.0, 1.0, 0.0], 1, &[0], &[1.0]),
            (&[5.0, -5.0], 2, &[0, 1], &[0.999_954_6, 0.000_045_4]),
            (&[0.5; 4], 4, &[0, 1, 2, 3], &[0.25; 4]),
        ];
        for &(scores, used, experts, weights) in cases {
            let mut out = Vec::new();
            route(scores, used, &mut out);
            let got: Vec<usize> = out.iter().map(|&(e, _)| e).collect();
            assert_eq!(got, experts, "{scores:?}");
            for (&(_, w), &want) in out.iter().zip(weights) {
                assert!((w - want).abs() < 1e-6, "{scores:?}: {w} vs {want}");
            }
        }
    }
}
