//! Picks each next token from the model's logits: penalties, greedy or seeded random
//! sampling with top-k / top-p / min-p, and the logprobs reported to the client.
//!
//! Runs once per sequence per step, on the engine thread right after the forward pass,
//! so it allocates nothing after its first call (the returned `top` list aside) and
//! touches the vocabulary (49,152 logits for SmolLM2) only in a few vectorized passes.
//!
//! Order of operations in [`Sampler::sample`]:
//! 1. repetition penalty (CTRL) over every token of the prompt and the output:
//!    a positive logit is divided by the penalty, any other is multiplied by it;
//! 2. frequency and presence penalties (OpenAI) over output tokens:
//!    `logit -= frequency * count + presence * (count > 0)`;
//! 3. `logit_bias` is added to its tokens;
//! 4. banned ids (see [`Sampler::ban`]) become `-inf`, and so does every token a
//!    grammar's mask leaves out (see [`Sampler::sample_masked`]);
//! 5. greedy (temperature below 1e-5, or top_k = 1): the argmax, ties to the lowest id;
//! 6. otherwise: temperature, top-k, top-p (nucleus, at least one token kept), min-p
//!    (drop tokens whose probability is below `min_p` × the top one), then one draw
//!    from the renormalized distribution.
//!
//! The reported logprobs are the log-softmax of the *raw* logits, before any of the
//! above, as OpenAI and vLLM report them by default. NaN logits count as `-inf`.

mod math;

pub use pdserve_types::rng::Rng;

use math::{argmax, exp_det, lane_sum, max_value, weight, LogSoftmax};

/// The greedy choice of a row of logits: the largest, ties to the lowest id.
pub(crate) fn greedy_token(logits: &[f32]) -> u32 {
    argmax(logits) as u32
}
use pdserve_types::{SamplingParams, TokenOut};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// Temperatures below this are greedy: dividing by them would overflow, and the
/// distribution is a spike on the argmax anyway (vLLM uses the same cut-off).
const GREEDY_TEMPERATURE: f32 = 1e-5;
/// How many of the most likely tokens the nucleus search sorts first; it grows
/// fourfold until the nucleus fits, so peaked distributions never sort the vocabulary.
const NUCLEUS_FIRST_HEAD: usize = 64;
/// Weights per block in the full-vocabulary draw, which skips whole blocks by their sums.
const DRAW_BLOCK: usize = 256;

/// What the model has already seen, kept incrementally so penalties cost
/// O(distinct tokens) per step instead of O(sequence length).
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    /// One entry per distinct token, in first-seen order.
    seen: Vec<Seen>,
    index: HashMap<u32, usize>,
    n_output: usize,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    token: u32,
    in_prompt: bool,
    /// Times the token was generated (the prompt does not count).
    output_count: u32,
}

impl TokenHistory {
    pub fn new(prompt: &[u32]) -> Self {
        let mut h = TokenHistory::default();
        for &t in prompt {
            h.entry(t).in_prompt = true;
        }
        h
    }

    /// Records one generated token.
    pub fn push(&mut self, token: u32) {
        let e = self.entry(token);
        e.output_count = e.output_count.saturating_add(1);
        self.n_output += 1;
    }

    /// Generated tokens so far (what `min_tokens` is compared against).
    pub fn output_len(&self) -> usize {
        self.n_output
    }

    /// Times `token` was generated.
    pub fn output_count(&self, token: u32) -> u32 {
        self.index.get(&token).map_or(0, |&i| self.seen[i].output_count)
    }

    /// Whether `token` occurs in the prompt or the output.
    pub fn contains(&self, token: u32) -> bool {
        self.index.contains_key(&token)
    }

    /// Whether `token` occurs in the prompt.
    pub fn in_prompt(&self, token: u32) -> bool {
        self.index.get(&token).is_some_and(|&i| self.seen[i].in_prompt)
    }

    fn entry(&mut self, token: u32) -> &mut Seen {
        let seen = &mut self.seen;
        let i = *self.index.entry(token).or_insert_with(|| {
            seen.push(Seen { token, in_prompt: false, output_count: 0 });
            seen.len() - 1
        });
        &mut self.seen[i]
    }
}

/// The numeric parameters, copied out of [`SamplingParams`] once.
#[derive(Debug, Clone, Copy)]
struct Knobs {
    greedy: bool,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    repetition: f32,
    frequency: f32,
    presence: f32,
    top_logprobs: usize,
}

/// A token's logit and id, as the top-k heap holds them.
type Logit = (f32, u32);

/// A weighted candidate packed so that integer order is "heaviest first, then lowest
/// id": the weight's bits, inverted, above the id. Weights are never negative, and for
/// those the bit pattern orders like the value, so sorts compare plain integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key(u64);

impl Key {
    fn new(weight: f32, id: u32) -> Self {
        Key((u64::from(!weight.to_bits()) << 32) | u64::from(id))
    }

    fn weight(self) -> f32 {
        f32::from_bits(!((self.0 >> 32) as u32))
    }

    fn id(self) -> u32 {
        self.0 as u32
    }
}

/// Per-sequence sampler: the parameters, the random state, and scratch buffers that are
/// reused every step.
#[derive(Debug, Clone)]
pub struct Sampler {
    knobs: Knobs,
    rng: Rng,
    /// `logit_bias`, sorted by id.
    bias: Vec<(u32, f32)>,
    banned: Vec<u32>,
    /// The raw row while a mask is applied: masking touches most of the vocabulary,
    /// so one copy restores it faster than a list of saved values would.
    raw: Vec<f32>,
    /// Raw values of the logits we overwrote this step, restored before logprobs.
    saved: Vec<(u32, f32)>,
    cand: Vec<Key>,
    /// Top-k selection; its top is the weakest token kept so far.
    heap: BinaryHeap<Weakest>,
    /// Full-vocabulary weights, and their sums per [`DRAW_BLOCK`].
    weights: Vec<f32>,
    block_sums: Vec<f32>,
    /// Running top list of raw logits as (id, logit).
    top: Vec<(u32, f32)>,
}

impl Sampler {
    /// `params` must be validated; `fallback_seed` is used when the request set none
    /// (the engine passes something unique per request).
    pub fn new(params: &SamplingParams, fallback_seed: u64) -> Self {
        let knobs = Knobs {
            greedy: params.temperature < GREEDY_TEMPERATURE || params.top_k == 1,
            temperature: params.temperature,
            top_k: usize::try_from(params.top_k).unwrap_or(usize::MAX),
            top_p: params.top_p,
            min_p: params.min_p,
            repetition: params.repetition_penalty,
            frequency: params.frequency_penalty,
            presence: params.presence_penalty,
            top_logprobs: params.top_logprobs as usize,
        };
        Sampler {
            knobs,
            rng: Rng::new(params.seed.unwrap_or(fallback_seed)),
            bias: params.logit_bias.clone(),
            banned: Vec::new(),
            raw: Vec::new(),
            saved: Vec::new(),
            cand: Vec::new(),
            heap: BinaryHeap::new(),
            weights: Vec::new(),
            block_sums: Vec::new(),
            top: Vec::with_capacity(knobs.top_logprobs + 1),
        }
    }

    /// True when every step takes the argmax and the random state is never used.
    pub fn is_greedy(&self) -> bool {
        self.knobs.greedy
    }

    /// Masks `ids` (typically the EOS ids while fewer than `min_tokens` were generated)
    /// in every later [`sample`](Self::sample) until [`clear_bans`](Self::clear_bans).
    /// Ids outside the vocabulary are ignored; an id banned twice costs one more
    /// write and is restored in reverse like any other, so none is deduplicated here
    /// (that was quadratic in the ids, every step).
    pub fn ban(&mut self, ids: &[u32]) {
        self.banned.extend_from_slice(ids);
    }

    pub fn clear_bans(&mut self) {
        self.banned.clear();
    }

    /// Advances the random state exactly as one [`sample`](Self::sample) call does.
    /// Every call consumes one draw, greedy or not, so a sampler that takes over a
    /// sequence whose last token was sampled elsewhere (the decode side after a remote
    /// prefill) calls this once per such token and then continues bit for bit.
    pub fn replay_draw(&mut self) {
        self.rng.next_f64();
    }

    /// Chooses the next token. `logits` is used as scratch: penalties are applied in
    /// place and undone before returning, so it ends holding the raw logits again
    /// (NaN included). An empty vocabulary yields token 0.
    pub fn sample(&mut self, logits: &mut [f32], history: &TokenHistory) -> TokenOut {
        self.sample_masked(logits, history, None)
    }

    /// [`sample`](Self::sample), choosing only among the tokens `allowed` has a bit
    /// set for (bit `i % 32` of word `i / 32`; ids past its end are not allowed).
    /// When the mask leaves nothing, the raw argmax is taken.
    pub fn sample_masked(&mut self, logits: &mut [f32], history: &TokenHistory, allowed: Option<&[u32]>) -> TokenOut {
        let u = self.rng.next_f64(); // drawn even when unused: see `replay_draw`
        self.saved.clear();
        if allowed.is_some() {
            self.raw.clear();
            self.raw.extend_from_slice(logits);
        }
        self.apply_penalties(logits, history);
        self.apply_bias(logits);
        self.apply_bans(logits);
        if let Some(words) = allowed {
            apply_mask(logits, words);
        }
        let token = if self.knobs.greedy { argmax(logits) } else { self.draw(logits, u) };
        if allowed.is_some() {
            logits.copy_from_slice(&self.raw);
        } else {
            // Undo in reverse, so a token both penalized and banned gets its raw value back.
            for &(id, raw) in self.saved.iter().rev() {
                logits[id as usize] = raw;
            }
        }
        let lsm = LogSoftmax::of(logits);
        let logprob = logits.get(token).map_or(0.0, |&x| lsm.logprob(x));
        let top = self.top_logprobs(logits, &lsm);
        TokenOut { token: token as u32, logprob, top }
    }

    fn apply_penalties(&mut self, logits: &mut [f32], history: &TokenHistory) {
        let k = self.knobs;
        if k.repetition == 1.0 && k.frequency == 0.0 && k.presence == 0.0 {
            return;
        }
        for e in &history.seen {
            let Some(slot) = logits.get_mut(e.token as usize) else {
                continue;
            };
            let raw = *slot;
            let mut x = raw;
            if k.repetition != 1.0 {
                x = if x > 0.0 { x / k.repetition } else { x * k.repetition };
            }
            if e.output_count > 0 {
                x -= k.frequency * e.output_count as f32 + k.presence;
            }
            self.saved.push((e.token, raw));
            *slot = x;
        }
    }

    fn apply_bias(&mut self, logits: &mut [f32]) {
        for &(id, b) in &self.bias {
            if let Some(slot) = logits.get_mut(id as usize) {
                self.saved.push((id, *slot));
                *slot += b;
            }
        }
    }

    fn apply_bans(&mut self, logits: &mut [f32]) {
        for &id in &self.banned {
            if let Some(slot) = logits.get_mut(id as usize) {
                self.saved.push((id, *slot));
                *slot = f32::NEG_INFINITY;
            }
        }
    }

    /// Temperature, top-k, top-p, min-p, then one draw. Reads `logits` but never writes
    /// them, so the caller can restore the raw values afterwards. When nothing above
    /// `-inf` is left, falls back to the (deterministic) argmax.
    /// `u` is the step's uniform draw in `[0, 1)`.
    fn draw(&mut self, logits: &[f32], u: f64) -> usize {
        let k = self.knobs.top_k;
        let drawn = if k > 0 && k < logits.len() { self.draw_top_k(logits, k, u) } else { self.draw_full(logits, u) };
        drawn.unwrap_or_else(|| argmax(logits))
    }

    /// Top-k first, so only `k` candidates ever get weights.
    fn draw_top_k(&mut self, logits: &[f32], k: usize, u: f64) -> Option<usize> {
        self.keep_top_k(logits, k);
        let max = self.heap.iter().map(|w| w.0 .0).reduce(f32::max)?;
        self.cand.clear();
        if max == f32::INFINITY {
            // Infinite logits outweigh everything else; they share the mass equally.
            let inf = self.heap.drain().filter(|w| w.0 .0 == f32::INFINITY);
            self.cand.extend(inf.map(|w| Key::new(1.0, w.0 .1)));
        } else {
            let inv_t = 1.0 / self.knobs.temperature;
            let weigh = |w: Weakest| Key::new(exp_det((w.0 .0 - max) * inv_t), w.0 .1);
            self.cand.extend(self.heap.drain().map(weigh));
        }
        let z = self.cand.iter().map(|c| f64::from(c.weight())).sum();
        Some(self.filter_and_pick(z, false, u))
    }

    /// Leaves the `k` largest finite logits in `self.heap`. One pass with a cheap
    /// threshold test; the vocabulary is never sorted.
    fn keep_top_k(&mut self, logits: &[f32], k: usize) {
        self.heap.clear();
        let mut floor = f32::NEG_INFINITY;
        for (i, &x) in logits.iter().enumerate() {
            if x.is_nan() || x == f32::NEG_INFINITY || x < floor {
                continue;
            }
            let c = Weakest((x, i as u32));
            if self.heap.len() < k {
                self.heap.push(c);
            } else if let Some(mut weakest) = self.heap.peek_mut() {
                // Scanning ids upwards, an equal logit never displaces a lower id.
                if c < *weakest {
                    *weakest = c;
                }
            }
            if self.heap.len() == k {
                floor = self.heap.peek().map_or(floor, |w| w.0 .0);
            }
        }
    }

    /// No top-k: weigh the whole vocabulary in one vectorized pass.
    fn draw_full(&mut self, logits: &[f32], u: f64) -> Option<usize> {
        let max = max_value(logits);
        if max == f32::NEG_INFINITY {
            return None;
        }
        if max == f32::INFINITY {
            // Infinite logits outweigh everything else; they share the mass equally.
            self.cand.clear();
            let inf = logits.iter().enumerate().filter(|(_, &x)| x == f32::INFINITY);
            self.cand.extend(inf.map(|(i, _)| Key::new(1.0, i as u32)));
            let z = self.cand.len() as f64;
            return Some(self.filter_and_pick(z, true, u));
        }
        let inv_t = 1.0 / self.knobs.temperature;
        self.weights.clear();
        self.weights.extend(logits.iter().map(|&x| weight(x, max, inv_t)));
        let (min_p, top_p) = (self.knobs.min_p, self.knobs.top_p);
        if min_p <= 0.0 && top_p >= 1.0 {
            return Some(self.pick_dense(u));
        }
        let z = lane_sum(&self.weights);
        // Tokens lighter than (z - target) / n cannot reach into the nucleus: even all
        // of them together weigh less than what lies outside it. The 0.999 leaves room
        // for rounding, so the candidates hold the whole nucleus.
        let n = self.weights.len() as f64;
        let nucleus_floor = if top_p < 1.0 { (z * (1.0 - f64::from(top_p)) / n) * 0.999 } else { 0.0 };
        let floor = min_p.max(nucleus_floor as f32);
        self.cand.clear();
        let heavy = self.weights.iter().enumerate().filter(|(_, &w)| w > 0.0 && w >= floor);
        self.cand.extend(heavy.map(|(i, &w)| Key::new(w, i as u32)));
        Some(self.filter_and_pick(z, true, u))
    }

    /// min-p, then top-p, over weighted candidates whose total before filtering is `z`,
    /// then the draw `u`. `by_id` says whether `self.cand` is still in id order.
    fn filter_and_pick(&mut self, z: f64, by_id: bool, u: f64) -> usize {
        let (min_p, top_p) = (self.knobs.min_p, self.knobs.top_p);
        if min_p > 0.0 {
            // Weights are relative to the top token, so min-p is a plain threshold. It
            // keeps a prefix of the sorted order, so applying it before the nucleus
            // search (with `z` still counting what it dropped) gives the same result as
            // applying it after.
            self.cand.retain(|c| c.weight() >= min_p);
        }
        if top_p < 1.0 {
            nucleus(&mut self.cand, f64::from(top_p) * z);
        } else if !by_id {
            // A canonical order keeps a seed's tokens independent of how the heap or
            // the selection happened to arrange them.
            self.cand.sort_unstable_by_key(|c| c.id());
        }
        let total: f64 = self.cand.iter().map(|c| f64::from(c.weight())).sum();
        let mut u = u * total;
        for c in &self.cand {
            let w = f64::from(c.weight());
            if u < w {
                return c.id() as usize;
            }
            u -= w;
        }
        // Only reached through rounding at the very end of the walk.
        self.cand.last().map_or(0, |c| c.id() as usize)
    }

    /// The draw `u` over `self.weights` in id order, skipping whole blocks by their sums.
    fn pick_dense(&mut self, u: f64) -> usize {
        self.block_sums.clear();
        let sums = self.weights.chunks(DRAW_BLOCK).map(|b| lane_sum(b) as f32);
        self.block_sums.extend(sums);
        let total: f64 = self.block_sums.iter().map(|&s| f64::from(s)).sum();
        let mut u = u * total;
        let mut last_block = 0;
        for (b, &s) in self.block_sums.iter().enumerate() {
            let s = f64::from(s);
            if s > 0.0 {
                last_block = b;
            }
            if u < s {
                return pick_in_block(&self.weights, b, u);
            }
            u -= s;
        }
        // Rounding carried `u` past the end: take the last block that has any weight.
        pick_in_block(&self.weights, last_block, f64::INFINITY)
    }

    fn top_logprobs(&mut self, logits: &[f32], lsm: &LogSoftmax) -> Vec<(u32, f32)> {
        top_n(logits, lsm, self.knobs.top_logprobs, &mut self.top)
    }
}

/// Sets every logit whose bit in `allowed` is clear to `-inf`; whole words at a time,
/// since a grammar usually allows a few tokens or nearly all of them.
fn apply_mask(logits: &mut [f32], allowed: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = allowed.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, x) in chunk.iter_mut().enumerate() {
            if bits & (1 << b) == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// How likely `token` was under the raw `logits`, with the `top` most likely tokens:
/// what prompt scoring reports for each prompt position.
pub fn score(logits: &[f32], token: u32, top: usize) -> TokenOut {
    let lsm = LogSoftmax::of(logits);
    let logprob = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&x| lsm.logprob(x));
    TokenOut { token, logprob, top: top_n(logits, &lsm, top, &mut Vec::new()) }
}

/// The `n` largest logits as (id, logprob), most likely first, ties to the lower id;
/// `buf` is scratch.
fn top_n(logits: &[f32], lsm: &LogSoftmax, n: usize, buf: &mut Vec<(u32, f32)>) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    buf.clear();
    for (i, &x) in logits.iter().enumerate() {
        let x = if x.is_nan() { f32::NEG_INFINITY } else { x };
        let full = buf.len() == n;
        if full && buf.last().is_some_and(|w| x <= w.1) {
            continue;
        }
        // After every entry at least as large, so ties keep the lower id first.
        let at = buf.partition_point(|t| t.1 >= x);
        buf.insert(at, (i as u32, x));
        buf.truncate(n);
    }
    buf.iter().map(|&(id, x)| (id, lsm.logprob(x))).collect()
}

/// The token in block `b` of `weights` where the running sum passes `u`, or the
/// block's last weighted token when rounding leaves `u` beyond its sum.
fn pick_in_block(weights: &[f32], b: usize, mut u: f64) -> usize {
    let start = b * DRAW_BLOCK;
    let block = weights.get(start..).unwrap_or_default();
    let block = &block[..block.len().min(DRAW_BLOCK)];
    let mut last = 0;
    for (j, &w) in block.iter().enumerate() {
        if w > 0.0 {
            last = j;
        }
        let w = f64::from(w);
        if u < w {
            return start + j;
        }
        u -= w;
    }
    start + last
}

/// Descending weight, then ascending id: a total order, so results never depend on
/// the sort algorithm.
fn heavier_first(a: &Logit, b: &Logit) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Orders candidates so that a max-heap keeps the *weakest* on top.
#[derive(Debug, Clone, Copy)]
struct Weakest(Logit);

impl Ord for Weakest {
    fn cmp(&self, other: &Self) -> Ordering {
        heavier_first(&self.0, &other.0)
    }
}

impl PartialOrd for Weakest {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Weakest {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Weakest {}

/// Keeps the smallest most-likely prefix of `cand` whose mass reaches
/// `target`, sorted heaviest first; at least one token always stays. Sorts only as far
/// as needed: a growing head is selected from the unsorted rest, round by round.
fn nucleus(cand: &mut Vec<Key>, target: f64) {
    let len = cand.len();
    // cand[..done] holds the heaviest tokens, sorted, with mass `acc`.
    let (mut done, mut acc) = (0, 0.0);
    let mut head = NUCLEUS_FIRST_HEAD.min(len);
    while done < len {
        let rest = &mut cand[done..];
        let take = head - done;
        if take < rest.len() {
            rest.select_nth_unstable(take - 1);
        }
        rest[..take].sort_unstable();
        for (i, c) in cand[done..head].iter().enumerate() {
            acc += f64::from(c.weight());
            if acc >= target {
                cand.truncate(done + i + 1);
                return;
            }
        }
        done = head;
        head = head.saturating_mul(4).min(len);
    }
    // Rounding left the target just out of reach: everything stays.
}

#[cfg(test)]
mod tests;
