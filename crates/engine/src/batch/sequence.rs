//! One request inside the engine: its tokens, its cache blocks, its sampler.

use super::draft::DraftKv;
use super::speculate::Acceptance;
use super::BLOCK_SIZE;
use crate::grammar::Constraint;
use crate::model::Pooled;
use crate::sampler::{Sampler, TokenHistory};
use pdserve_kv::{BlockHash, BlockTable};
use pdserve_types::{FinishReason, Pooling, RequestId, SamplingParams, TokenOut};

pub(crate) struct Sequence {
    pub id: RequestId,
    pub prompt_len: usize,
    /// Prompt followed by every generated token.
    pub tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache (always a prefix of `tokens`).
    pub computed: usize,
    /// `None` while waiting (never admitted, or preempted).
    pub table: Option<BlockTable>,
    pub params: SamplingParams,
    pub sampler: Sampler,
    pub history: TokenHistory,
    /// Prompt tokens served from the prefix cache at the last admission.
    pub cached_tokens: usize,
    /// Scores of prompt tokens 1.. so far, when the request asked for them.
    pub prompt_scores: Vec<TokenOut>,
    /// Not stepped while set: its consumer has fallen behind (it keeps its blocks).
    pub paused: bool,
    /// Its row is in a stage group's later stages (a lane in flight): not stepped,
    /// nor preempted, until the lane lands.
    pub in_lane: bool,
    /// The grammar state of a constrained request.
    pub constraint: Option<Constraint>,
    /// The chained hashes of the prompt's whole blocks it may share, from its last
    /// admission: what its prefill is adding to the prefix cache.
    pub prompt_hashes: Vec<BlockHash>,
    /// Engine step seconds it has waited for its first token here, and those since
    /// its first token (its answer's time so far, against the TPOT objective).
    pub waited_s: f64,
    pub decode_s: f64,
    /// This step's chunk when it verifies a draft: the last sampled token, then the
    /// drafted tokens.
    pub verify: Vec<u32>,
    /// How its n-gram drafts have fared; its last draft's record, and whether that
    /// draft was what its grammar forced.
    pub acceptance: Acceptance,
    pub last_record: Acceptance,
    pub draft_forced: bool,
    /// The draft model's K/V of its tokens, when a draft model drafts for it.
    pub draft_kv: Option<DraftKv>,
    /// On an engine with a draft model, whether it drafts with it (else by lookup):
    /// decided once, when its prompt is first followed or it first drafts
    /// (`speculate::price_model_drafts`).
    pub model_drafts: Option<bool>,
    /// Its tokens the worker's n-gram pool has learnt.
    pub pooled: usize,
    /// Its prompt's final hidden states pooled so far, when it asked for an
    /// embedding: their sum (mean pooling) or the last one.
    pub embedding: Vec<f32>,
}

impl Sequence {
    pub fn new(id: RequestId, prompt: Vec<u32>, params: SamplingParams, seed: u64) -> Self {
        // A moved request goes on from its record (its router brought it).
        let acceptance = params.drafts_so_far.map(Acceptance::from).unwrap_or_default();
        Sequence {
            id,
            prompt_len: prompt.len(),
            history: TokenHistory::new(&prompt),
            sampler: Sampler::new(&params, seed),
            tokens: prompt,
            computed: 0,
            table: None,
            params,
            cached_tokens: 0,
            prompt_scores: Vec::new(),
            paused: false,
            in_lane: false,
            constraint: None,
            prompt_hashes: Vec::new(),
            waited_s: 0.0,
            decode_s: 0.0,
            verify: Vec::new(),
            acceptance,
            last_record: Acceptance::default(),
            draft_forced: false,
            draft_kv: None,
            model_drafts: None,
            pooled: 0,
            embedding: Vec::new(),
        }
    }

    /// The prompt tokens the next `n` computed positions predict, if this request
    /// scores its prompt (position `p` predicts token `p + 1`).
    pub fn score_targets(&self, n: usize) -> Option<&[u32]> {
        self.params.prompt_logprobs?;
        if self.generated() > 0 {
            // Scored and sent with the first token already (this is a recompute).
            return None;
        }
        let from = (self.computed + 1).min(self.prompt_len);
        let to = (self.computed + n + 1).min(self.prompt_len);
        Some(&self.tokens[from..to])
    }

    /// What the next `n` computed positions add to the prompt's embedding, if this
    /// request asked for one and they include prompt positions.
    pub fn pooled_rows(&self, n: usize) -> Option<Pooled> {
        let pooling = self.params.embed?;
        if self.generated() > 0 || self.computed >= self.prompt_len {
            // Pooled and sent with the first token already (this is a recompute).
            return None;
        }
        let rows = n.min(self.prompt_len - self.computed);
        match pooling {
            Pooling::Mean => Some(Pooled::Sum(rows)),
            Pooling::Last => (self.computed + rows == self.prompt_len).then(|| Pooled::Row(rows - 1)),
        }
    }

    /// The prompt's embedding, once, with its first token: the mean divides the sum.
    pub fn take_embedding(&mut self) -> Option<Vec<f32>> {
        let pooling = self.params.embed?;
        let mut e = std::mem::take(&mut self.embedding);
        if pooling == Pooling::Mean {
            let n = self.prompt_len.max(1) as f32;
            e.iter_mut().for_each(|x| *x /= n);
        }
        Some(e)
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens it may still sample before `max_tokens` ends it.
    pub fn tokens_left(&self) -> usize {
        (self.params.max_tokens as usize).saturating_sub(self.generated())
    }

    /// Tokens still to run through the model before the next sample.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Whether its prefill is about to compute block `j` of the hash chain `hashes`:
    /// its next block to compute is the `j`-th, with that hash.
    pub fn computing(&self, hashes: &[BlockHash]) -> bool {
        let j = self.computed / BLOCK_SIZE;
        !self.paused
            && self.computed < self.prompt_len
            && hashes.get(j).is_some_and(|h| self.prompt_hashes.get(j) == Some(h))
    }

    /// Advances its clocks by a step of `seconds` it waited or decoded through. Its
    /// answer's time starts after its first token; the step that sampled that token
    /// (aged once it is sampled) counts in neither.
    pub fn age(&mut self, seconds: f64) {
        match self.generated() {
            0 => self.waited_s += seconds,
            1 => {}
            _ => self.decode_s += seconds,
        }
    }

    /// Seconds to spare a step, against a TPOT objective of `tpot_s`, for a decode
    /// whose remaining steps take `step_s` each: what its answer may still lose,
    /// spread over the tokens it has left. `None` once it cannot meet the objective.
    pub fn spare_per_step(&self, tpot_s: f64, step_s: f64) -> Option<f64> {
        let left = self.tokens_left().max(1);
        let intervals = (self.generated().saturating_sub(1) + left) as f64;
        let slack = tpot_s * intervals - self.decode_s - left as f64 * step_s;
        (slack > 0.0).then(|| slack / left as f64)
    }

    /// True once the prompt is in the cache and each step feeds one sampled token.
    pub fn is_decoding(&self) -> bool {
        self.computed >= self.prompt_len && self.pending() == 1
    }

    /// Whether the last token ends the sequence: an end-of-generation token (unless
    /// `ignore_eos`) or a stop id → Stop; `max_tokens` or the context → Length.
    pub fn finish_reason(&self, eog: &[u32], context: usize) -> Option<FinishReason> {
        let last = *self.tokens.last()?;
        // Before `min_tokens` these tokens were banned; one sampled all the same (every
        // token was banned) does not end the output early.
        let min_reached = self.generated() > self.params.min_tokens as usize;
        let stop_token = self.params.stop.token_ids.contains(&last);
        if min_reached && ((eog.contains(&last) && !self.params.ignore_eos) || stop_token) {
            Some(FinishReason::Stop)
        } else if self.generated() >= self.params.max_tokens as usize || self.tokens.len() >= context {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Forgets the cache (preemption by recompute): the tokens are kept and will be
    /// prefilled again, with the same numerics, on re-admission.
    pub fn preempt(&mut self) {
        self.table = None;
        self.draft_kv = None;
        self.computed = 0;
        // Recomputed positions are scored and pooled again, with the same numerics.
        self.prompt_scores.clear();
        self.embedding.clear();
        self.paused = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_types::StopCondition;

    /// Before `min_tokens`, end and stop tokens are banned; one sampled all the same
    /// (every token was banned) does not end the output.
    #[test]
    fn a_stop_token_ends_the_output_only_past_min_tokens() {
        let stop = StopCondition { token_ids: vec![7], ..Default::default() };
        let params = SamplingParams { max_tokens: 10, min_tokens: 2, stop, ..Default::default() };
        let mut s = Sequence::new(RequestId(1), vec![1, 2], params, 0);
        for (tok, want) in [(7, None), (2, None), (7, Some(FinishReason::Stop))] {
            s.tokens.push(tok);
            assert_eq!(s.finish_reason(&[2], 100), want, "after {:?}", &s.tokens[2..]);
        }
    }
}
