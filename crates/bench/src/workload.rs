//! What each request asks for: its prompt and its exact output length.
//!
//! Requests are made on demand from `(seed, point, index)`, so a workload is the same
//! for every topology (fair comparisons) but different at every sweep point (no prefix
//! cache hits carried over from an earlier point), and nothing is pre-generated.

use crate::lengths::LengthSpec;
use crate::phases::{Phases, Span};
use crate::prompt::{Prompt, TokenRange};
use crate::rng::{mix, Rng};
use crate::trace::TraceRow;
use std::str::FromStr;
use std::sync::Arc;

/// Where prompts and lengths come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// Independent random prompts.
    Random { input: LengthSpec, output: LengthSpec },
    /// `prefixes` system prompts of `prefix_len` random tokens, fixed per point; each
    /// request takes one, as `order` says, followed by its own random suffix of
    /// `input` tokens. A request drawn outside the `share` (a fraction in `(0, 1]`)
    /// takes `prefix_len` tokens of its own instead, so every prompt has the same
    /// length and only the shared ones can hit a cache.
    SharedPrefix {
        prefixes: usize,
        prefix_len: usize,
        order: PrefixOrder,
        share: f64,
        input: LengthSpec,
        output: LengthSpec,
    },
    /// `users` chat users, each holding one conversation after another, of `turns`
    /// turns each. A turn's prompt is the conversation so far (every earlier user
    /// message and reply) plus a new user message of `input` tokens; its reply is
    /// `output` tokens long, and what `replies` says stands for it in the next turn's
    /// history. Request `i` belongs to user `i % users`, so users take turns and
    /// their conversations interleave.
    MultiTurn { users: usize, turns: LengthSpec, input: LengthSpec, output: LengthSpec, replies: Replies },
    /// Rows of a trace, in order.
    Trace { rows: Arc<Vec<TraceRow>>, block_size: usize },
    /// A shifting workload: the phases' requests as rows, whose times count from the
    /// start of the run (not from the first row) so phases keep their places.
    Phased { phases: Arc<Phases>, rows: Arc<Vec<TraceRow>> },
    /// Prompts of a file, sent as text, dealt as `crate::prompts_file::pick` says
    /// (`per_point`: the requests a point sends at most).
    Texts { prompts: Arc<Vec<Arc<str>>>, per_point: usize, output: LengthSpec },
}

/// Which shared prefix a request takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefixOrder {
    /// A seeded draw per request, as users of different system prompts arrive
    /// independently of each other.
    #[default]
    Random,
    /// Request `i` takes prefix `i % prefixes`: the worst case for an LRU cache that
    /// holds fewer than all of them. Beware that a round-robin router over a number
    /// of workers that divides `prefixes` then sends every request of a prefix to
    /// the same worker, an affinity no real traffic gives it.
    Cycle,
}

impl FromStr for PrefixOrder {
    type Err = crate::error::BenchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "random" => Ok(Self::Random),
            "cycle" => Ok(Self::Cycle),
            _ => Err(crate::error::BenchError::BadFlag(format!("unknown prefix order {s:?}: random or cycle"))),
        }
    }
}

/// What stands for a reply in the next turn's history.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Replies {
    /// Random tokens of the reply's length: works with any server and prompt form.
    #[default]
    Random,
    /// The reply the server generated, as token ids (vLLM's `return_token_ids`), as
    /// a chat client sends its history back; random tokens where that reply is not
    /// in yet (still streaming, or failed).
    Generated,
}

impl FromStr for Replies {
    type Err = crate::error::BenchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "random" => Ok(Self::Random),
            "generated" => Ok(Self::Generated),
            _ => Err(crate::error::BenchError::BadFlag(format!("unknown replies {s:?}: expected random or generated"))),
        }
    }
}

/// Appends a turn's generated reply to a prompt body; false where it has none.
pub type Reply<'a> = dyn Fn(TurnKey, &mut Vec<u32>) -> bool + 'a;

/// One turn of one user's conversation: where its generated reply is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TurnKey {
    pub user: usize,
    pub conversation: usize,
    pub turn: usize,
}

/// A workload: a source plus how tokens are drawn.
#[derive(Clone, Debug)]
pub struct Workload {
    pub source: Source,
    pub range: TokenRange,
    pub seed: u64,
}

/// The workload flags of `bench load`, before validation.
#[derive(Clone, Debug)]
pub struct WorkloadFlags {
    pub input: LengthSpec,
    pub output: LengthSpec,
    /// Number of shared prefixes (0: none).
    pub shared_prefixes: usize,
    pub prefix_len: usize,
    pub prefix_order: PrefixOrder,
    /// The fraction of requests that take a shared prefix (1: all of them).
    pub prefix_share: f64,
    /// Chat users holding multi-turn conversations (0: single requests).
    pub conversations: usize,
    pub turns: LengthSpec,
    pub replies: Replies,
    pub trace: Option<std::path::PathBuf>,
    pub trace_block_size: usize,
    /// A shifting workload (empty: none).
    pub phases: Vec<crate::phases::Phase>,
    pub range: TokenRange,
    pub seed: u64,
}

impl WorkloadFlags {
    /// A trace wins over lengths; shared prefixes apply to random prompts.
    pub fn build(&self) -> Result<Workload, crate::error::BenchError> {
        let bad = |m: &str| Err(crate::error::BenchError::BadFlag(m.into()));
        if self.replies == Replies::Generated && self.conversations == 0 {
            return bad("--replies generated needs --conversations");
        }
        if !self.phases.is_empty() {
            if self.conversations > 0 || self.shared_prefixes > 0 || self.trace.is_some() {
                return bad("--phase mixes with none of --conversations, --shared-prefixes and --trace");
            }
            let phases = Phases::new(self.phases.clone())?;
            let rows = Arc::new(phases.rows(self.seed));
            let source = Source::Phased { phases: Arc::new(phases), rows };
            return Ok(Workload { source, range: self.range, seed: self.seed });
        }
        if self.prefix_share != 1.0 && self.shared_prefixes == 0 {
            return bad("--prefix-share needs --shared-prefixes");
        }
        let source = match &self.trace {
            _ if self.conversations > 0 && (self.shared_prefixes > 0 || self.trace.is_some()) => {
                return bad("--conversations mixes with neither --shared-prefixes nor --trace")
            }
            None if self.conversations > 0 => Source::MultiTurn {
                users: self.conversations,
                turns: self.turns,
                input: self.input,
                output: self.output,
                replies: self.replies,
            },
            Some(_) if self.shared_prefixes > 0 => return bad("--shared-prefixes and --trace do not mix"),
            Some(_) if self.trace_block_size == 0 => return bad("--trace-block-size must be at least 1"),
            Some(path) => {
                Source::Trace { rows: Arc::new(crate::trace::load(path)?), block_size: self.trace_block_size }
            }
            None if self.shared_prefixes > 0 && self.prefix_len == 0 => return bad("--prefix-len must be at least 1"),
            None if self.shared_prefixes > 0 && !(self.prefix_share > 0.0 && self.prefix_share <= 1.0) => {
                return bad("--prefix-share must be a fraction above 0 and at most 1")
            }
            None if self.shared_prefixes > 0 => Source::SharedPrefix {
                prefixes: self.shared_prefixes,
                prefix_len: self.prefix_len,
                order: self.prefix_order,
                share: self.prefix_share,
                input: self.input,
                output: self.output,
            },
            None => Source::Random { input: self.input, output: self.output },
        };
        Ok(Workload { source, range: self.range, seed: self.seed })
    }
}

/// One request to send.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestSpec {
    pub index: usize,
    pub prompt: Prompt,
    pub output_len: u32,
    /// A prompt given as text (`--prompts`), sent as it is in place of `prompt`.
    pub text: Option<Arc<str>>,
    /// The turn this request is, where its reply goes into later turns' prompts.
    pub turn: Option<TurnKey>,
    /// Earlier replies in the prompt, and how many of them the server generated.
    pub replies: u32,
    pub generated_replies: u32,
}

impl Workload {
    /// Request `index` of sweep point `point`.
    pub fn request(&self, point: u64, index: usize) -> RequestSpec {
        self.request_with(point, index, &|_, _| false)
    }

    /// [`Workload::request`], with a multi-turn history's replies taken from
    /// `reply` where it has them (generated replies): `reply(turn, body)` appends
    /// that turn's reply to `body` and says whether it had one.
    pub fn request_with(&self, point: u64, index: usize, reply: &Reply<'_>) -> RequestSpec {
        let mut rng = Rng::new(mix(&[self.seed, point, index as u64]));
        let (prompt, output_len) = match &self.source {
            Source::Random { input, output } => {
                let n = input.sample(&mut rng) as usize;
                (Prompt { prefix: Vec::new(), body: self.range.random_ids(&mut rng, n) }, output.sample(&mut rng))
            }
            Source::SharedPrefix { prefixes, prefix_len, order, share, input, output } => {
                let prefix = match self.shares_a_prefix(point, index, *share) {
                    true => self.prefix(point, self.prefix_of(point, index, *prefixes, *order), *prefix_len),
                    false => self.own_prefix(point, index, *prefix_len),
                };
                let n = input.sample(&mut rng) as usize;
                (Prompt { prefix, body: self.range.random_ids(&mut rng, n) }, output.sample(&mut rng))
            }
            Source::MultiTurn { users, turns, input, output, replies } => {
                let at = (index % (*users).max(1), index / (*users).max(1));
                let reply = (*replies == Replies::Generated).then_some(reply);
                return RequestSpec { index, ..self.turn(point, at, *turns, (*input, *output), reply) };
            }
            Source::Trace { rows, block_size } => match rows.get(index % rows.len().max(1)) {
                Some(row) => (row.prompt(*block_size, self.range, self.seed, rng.next_u64()), row.output_length),
                None => (Prompt::default(), 1),
            },
            Source::Phased { rows, .. } => match rows.get(index) {
                Some(row) => (row.prompt(16, self.range, self.seed, rng.next_u64()), row.output_length),
                None => (Prompt::default(), 1),
            },
            Source::Texts { prompts, per_point, output } => {
                let text = prompts.get(crate::prompts_file::pick(prompts.len(), *per_point, point, index)).cloned();
                return RequestSpec { index, text, output_len: output.sample(&mut rng), ..RequestSpec::default() };
            }
        };
        RequestSpec { index, prompt, output_len, ..RequestSpec::default() }
    }

    /// `user`'s `step`-th request: which conversation and turn that is, then the
    /// conversation up to it, each earlier reply as `reply` has it or else random
    /// tokens of its length. The turn is keyed only where replies are generated.
    fn turn(
        &self,
        point: u64,
        (user, mut step): (usize, usize),
        turns: LengthSpec,
        (input, output): (LengthSpec, LengthSpec),
        reply: Option<&Reply<'_>>,
    ) -> RequestSpec {
        let rng = |conv: usize, turn: usize, what: u64| {
            Rng::new(mix(&[self.seed, point, 0x7c3a_11d5, user as u64, conv as u64, turn as u64, what]))
        };
        let mut conv = 0;
        loop {
            let n = (turns.sample(&mut rng(conv, 0, 0)) as usize).max(1);
            if step < n {
                break;
            }
            step -= n;
            conv += 1;
        }
        let key = |turn| TurnKey { user, conversation: conv, turn };
        let (mut body, mut replies, mut generated_replies) = (Vec::new(), 0, 0);
        for t in 0..=step {
            let mut r = rng(conv, t, 1);
            let asked = input.sample(&mut r) as usize;
            body.extend(self.range.random_ids(&mut r, asked));
            let output_len = output.sample(&mut r);
            if t == step {
                let (prompt, turn) = (Prompt { prefix: Vec::new(), body }, reply.map(|_| key(t)));
                return RequestSpec { index: 0, prompt, output_len, turn, replies, generated_replies, text: None };
            }
            replies += 1;
            if reply.is_some_and(|f| f(key(t), &mut body)) {
                generated_replies += 1;
            } else {
                body.extend(self.range.random_ids(&mut r, output_len as usize));
            }
        }
        unreachable!("the loop returns at its last turn")
    }

    /// Shared prefix `j` of a point: the same tokens for every request that uses it.
    pub fn prefix(&self, point: u64, j: usize, len: usize) -> Vec<u32> {
        self.range.random_ids(&mut Rng::new(mix(&[self.seed, point, 0x9f1e_f1c5, j as u64])), len)
    }

    /// Whether request `index` is among the `share` that take a shared prefix; its
    /// own stream, so the share leaves the suffixes and the prefix order as they are.
    fn shares_a_prefix(&self, point: u64, index: usize, share: f64) -> bool {
        share >= 1.0 || Rng::new(mix(&[self.seed, point, 0x2b7e_1516, index as u64])).next_f64() < share
    }

    /// The `len` tokens standing in for a shared prefix in a request outside the share.
    fn own_prefix(&self, point: u64, index: usize, len: usize) -> Vec<u32> {
        self.range.random_ids(&mut Rng::new(mix(&[self.seed, point, 0x28ae_d2a6, index as u64])), len)
    }

    /// Which of `n` shared prefixes request `index` takes; its own stream, so the
    /// order leaves the suffixes as they are.
    fn prefix_of(&self, point: u64, index: usize, n: usize, order: PrefixOrder) -> usize {
        let n = n.max(1);
        match order {
            PrefixOrder::Cycle => index % n,
            PrefixOrder::Random => {
                Rng::new(mix(&[self.seed, point, 0x51ed_0bde, index as u64])).range(0, n as u64) as usize
            }
        }
    }

    /// Whether later turns take the replies the server generated.
    pub fn generates_replies(&self) -> bool {
        matches!(self.source, Source::MultiTurn { replies: Replies::Generated, .. })
    }

    /// The number of rows when the workload is a trace (its natural request bound).
    pub fn trace_len(&self) -> Option<usize> {
        match &self.source {
            Source::Trace { rows, .. } | Source::Phased { rows, .. } => Some(rows.len()),
            _ => None,
        }
    }

    /// The phases of a shifting workload (empty otherwise).
    pub fn spans(&self) -> Vec<Span> {
        match &self.source {
            Source::Phased { phases, .. } => phases.spans(),
            _ => Vec::new(),
        }
    }

    /// Trace arrival offsets in seconds from the first row, divided by `speedup`
    /// (phases: from the start of the run).
    pub fn trace_offsets(&self, speedup: f64) -> Option<Vec<f64>> {
        let (rows, t0) = match &self.source {
            Source::Trace { rows, .. } => (rows, rows.first().map_or(0.0, |r| r.timestamp)),
            Source::Phased { rows, .. } => (rows, 0.0),
            _ => return None,
        };
        Some(rows.iter().map(|r| (r.timestamp - t0) / 1000.0 / speedup).collect())
    }

    /// A short description for reports.
    pub fn describe(&self) -> String {
        match &self.source {
            Source::Random { input, output } => format!("random ISL {input} / OSL {output}"),
            Source::SharedPrefix { prefixes, prefix_len, order, share, input, output } => {
                let order = match order {
                    PrefixOrder::Random => "drawn at random",
                    PrefixOrder::Cycle => "in turn",
                };
                let share = match *share < 1.0 {
                    true => format!(" for {:.0} % of requests", share * 100.0),
                    false => String::new(),
                };
                format!("shared prefix: {prefixes} × {prefix_len} tokens ({order}){share} + ISL {input} / OSL {output}")
            }
            Source::MultiTurn { users, turns, input, output, replies } => {
                let replies = match replies {
                    Replies::Random => "",
                    Replies::Generated => ", the replies generated",
                };
                format!("multi-turn: {users} users, {turns} turns of ISL {input} / OSL {output}{replies}")
            }
            Source::Trace { rows, block_size } => format!("trace of {} rows (block {block_size})", rows.len()),
            Source::Phased { phases, rows } => format!("{} ({} requests)", phases.describe(), rows.len()),
            Source::Texts { prompts, output, .. } => format!("{} prompts of a file / OSL {output}", prompts.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompts_file_is_dealt_point_by_point() {
        let prompts: Vec<Arc<str>> = (0..10).map(|i| Arc::from(format!("p{i}"))).collect();
        let source = Source::Texts { prompts: Arc::new(prompts), per_point: 4, output: LengthSpec::Fixed(7) };
        let w = Workload { source, range: TokenRange::default(), seed: 1 };
        let text = |point, i| w.request(point, i).text.map(|t| t.to_string());
        assert_eq!((text(0, 0), text(0, 3), text(1, 0), text(2, 1)), (p(0), p(3), p(4), p(9)));
        assert_eq!(text(u64::MAX, 0), p(9), "the warm-up starts from the end");
        let r = w.request(1, 2);
        assert_eq!((r.index, r.output_len, r.prompt.is_empty()), (2, 7, true));
        assert_eq!(w.describe(), "10 prompts of a file / OSL 7");
    }

    fn p(i: usize) -> Option<String> {
        Some(format!("p{i}"))
    }

    fn shared(prefixes: usize, order: PrefixOrder) -> Workload {
        shared_by(prefixes, order, 1.0)
    }

    fn shared_by(prefixes: usize, order: PrefixOrder, share: f64) -> Workload {
        Workload {
            source: Source::SharedPrefix {
                prefixes,
                prefix_len: 64,
                order,
                share,
                input: LengthSpec::Fixed(16),
                output: LengthSpec::Fixed(8),
            },
            range: TokenRange::default(),
            seed: 3,
        }
    }

    #[test]
    fn shared_prefixes_are_really_shared_and_suffixes_are_not() {
        let w = shared(2, PrefixOrder::Cycle);
        let reqs: Vec<RequestSpec> = (0..6).map(|i| w.request(0, i)).collect();
        assert_eq!(reqs[0].prompt.prefix, reqs[2].prompt.prefix);
        assert_eq!(reqs[0].prompt.prefix, reqs[4].prompt.prefix);
        assert_eq!(reqs[1].prompt.prefix, reqs[3].prompt.prefix);
        assert_ne!(reqs[0].prompt.prefix, reqs[1].prompt.prefix);
        assert_ne!(reqs[0].prompt.body, reqs[2].prompt.body);
        assert!(reqs.iter().all(|r| r.prompt.len() == 80 && r.output_len == 8));
        assert_eq!(reqs[0].prompt.ids()[..64], reqs[2].prompt.ids()[..64]);
    }

    #[test]
    fn random_prefixes_are_reproducible_all_used_and_not_in_turn() {
        let w = shared(8, PrefixOrder::Random);
        let picks = |w: &Workload| -> Vec<Vec<u32>> { (0..256).map(|i| w.request(0, i).prompt.prefix).collect() };
        let (a, cycle) = (picks(&w), picks(&shared(8, PrefixOrder::Cycle)));
        assert_eq!(a, picks(&w), "seeded");
        assert!(cycle.iter().all(|p| a.contains(p)) && a.iter().all(|p| cycle.contains(p)), "the same 8 prefixes");
        // In turn, the even requests share 4 prefixes (what a round-robin router over
        // two workers aligns with); drawn, they use all 8.
        let on_even = |v: &[Vec<u32>]| v.iter().step_by(2).collect::<std::collections::HashSet<_>>().len();
        assert_eq!((on_even(&cycle), on_even(&a)), (4, 8));
        // The order leaves the suffixes as they are.
        assert_eq!(w.request(0, 9).prompt.body, shared(8, PrefixOrder::Cycle).request(0, 9).prompt.body);
    }

    #[test]
    fn a_prefix_share_leaves_the_rest_a_prefix_of_their_own_of_the_same_length() {
        let (hot, w) = (shared(1, PrefixOrder::Random), shared_by(1, PrefixOrder::Random, 0.9));
        let the_hot = hot.request(0, 0).prompt.prefix;
        let reqs: Vec<RequestSpec> = (0..1000).map(|i| w.request(0, i)).collect();
        let sharing = reqs.iter().filter(|r| r.prompt.prefix == the_hot).count();
        assert!((860..=940).contains(&sharing), "{sharing} of 1000 share it");
        let own: std::collections::HashSet<_> =
            reqs.iter().filter(|r| r.prompt.prefix != the_hot).map(|r| r.prompt.prefix.clone()).collect();
        assert_eq!(own.len(), 1000 - sharing, "each of the rest has its own");
        assert!(reqs.iter().all(|r| r.prompt.len() == 80));
        // The share leaves the suffixes as they are.
        assert!((0..50).all(|i| w.request(0, i).prompt.body == hot.request(0, i).prompt.body));
    }

    #[test]
    fn a_prefix_share_out_of_range_or_without_prefixes_is_refused() {
        let flags = WorkloadFlags {
            input: LengthSpec::Fixed(8),
            output: LengthSpec::Fixed(4),
            shared_prefixes: 1,
            prefix_len: 16,
            prefix_order: PrefixOrder::Random,
            prefix_share: 0.0,
            conversations: 0,
            turns: LengthSpec::Fixed(1),
            replies: Replies::Random,
            trace: None,
            trace_block_size: 16,
            phases: Vec::new(),
            range: TokenRange::default(),
            seed: 1,
        };
        for share in [0.0, 1.5, f64::NAN] {
            let err = WorkloadFlags { prefix_share: share, ..flags.clone() }.build().unwrap_err().to_string();
            assert!(err.contains("--prefix-share must be a fraction"), "{err}");
        }
        let err = WorkloadFlags { shared_prefixes: 0, prefix_share: 0.9, ..flags.clone() }.build().unwrap_err();
        assert!(err.to_string().contains("--prefix-share needs --shared-prefixes"), "{err}");
        assert!(WorkloadFlags { prefix_share: 0.9, ..flags }.build().is_ok());
    }

    #[test]
    fn requests_are_reproducible_and_differ_between_points() {
        let w = Workload {
            source: Source::Random { input: LengthSpec::Fixed(32), output: LengthSpec::Uniform { min: 1, max: 9 } },
            range: TokenRange::default(),
            seed: 1,
        };
        assert_eq!(w.request(0, 5), w.request(0, 5));
        assert_ne!(w.request(0, 5).prompt, w.request(1, 5).prompt);
        assert_ne!(w.request(0, 5).prompt, w.request(0, 6).prompt);
        let one = shared(1, PrefixOrder::Random);
        assert_ne!(one.request(0, 0).prompt.prefix, one.request(1, 0).prompt.prefix);
    }

    #[test]
    fn ten_thousand_points_requests_and_prefixes_give_ten_thousand_prompts() {
        let w = shared(10, PrefixOrder::Random);
        let mut seen = std::collections::HashSet::new();
        let mut prefixes = std::collections::HashSet::new();
        for point in 0..10 {
            for index in 0..1000 {
                let r = w.request(point, index);
                prefixes.insert(r.prompt.prefix.clone());
                assert!(seen.insert(r.prompt.ids()), "point {point} request {index} repeats an earlier prompt");
            }
        }
        // Ten prefixes per point, none shared between points.
        assert_eq!((seen.len(), prefixes.len()), (10_000, 100));
    }

    #[test]
    fn a_sweep_sends_no_prompt_block_twice() {
        let w = Workload {
            source: Source::Random { input: LengthSpec::Fixed(512), output: LengthSpec::Fixed(8) },
            range: TokenRange::default(),
            seed: 0,
        };
        let mut sent = crate::reuse::SentBlocks::default();
        for point in [u64::MAX, 0, 1, 2] {
            for index in 0..100 {
                assert_eq!(sent.record(&w.request(point, index).prompt.ids()).reused, 0);
            }
        }
    }

    #[test]
    fn a_conversation_grows_turn_by_turn_and_users_interleave() {
        let w = Workload {
            source: Source::MultiTurn {
                users: 3,
                turns: LengthSpec::Fixed(2),
                input: LengthSpec::Fixed(10),
                output: LengthSpec::Fixed(4),
                replies: Replies::Random,
            },
            range: TokenRange::default(),
            seed: 5,
        };
        // User 1: turn 0 is request 1, turn 1 is request 4, then a new conversation.
        let (t0, t1, next) = (w.request(0, 1), w.request(0, 4), w.request(0, 7));
        assert_eq!((t0.prompt.len(), t1.prompt.len(), next.prompt.len()), (10, 24, 10));
        let (a, b) = (t0.prompt.ids(), t1.prompt.ids());
        assert_eq!(b[..10], a[..], "the history starts with the first message");
        assert_eq!(t0.output_len, 4);
        assert_ne!(next.prompt.ids(), a, "a new conversation");
        assert_ne!(w.request(0, 0).prompt.ids(), a, "another user");
        // Random replies: nothing to keep, whatever a server generated.
        let given = w.request_with(0, 4, &|_, body| {
            body.extend([7; 4]);
            true
        });
        assert_eq!((given.turn, given.prompt, given.generated_replies), (None, t1.prompt, 0));
    }

    #[test]
    fn generated_replies_go_into_the_next_turns_history() {
        let w = Workload {
            source: Source::MultiTurn {
                users: 3,
                turns: LengthSpec::Fixed(3),
                input: LengthSpec::Fixed(10),
                output: LengthSpec::Fixed(4),
                replies: Replies::Generated,
            },
            range: TokenRange::default(),
            seed: 5,
        };
        let key = |turn| TurnKey { user: 1, conversation: 0, turn };
        let t0 = w.request(0, 1);
        assert_eq!((t0.turn, t0.replies, t0.generated_replies), (Some(key(0)), 0, 0));
        // Turn 2 with turn 0's reply in (6 ids: a reply need not be the asked
        // length) and turn 1's not yet: random tokens stand in for it.
        let reply = |k: TurnKey, body: &mut Vec<u32>| (k == key(0)).then(|| body.extend([7; 6])).is_some();
        let t2 = w.request_with(0, 7, &reply);
        assert_eq!((t2.turn, t2.replies, t2.generated_replies), (Some(key(2)), 2, 1));
        let ids = t2.prompt.ids();
        assert_eq!(ids.len(), 10 + 6 + 10 + 4 + 10);
        assert_eq!((&ids[..10], &ids[10..16]), (&t0.prompt.ids()[..], &[7; 6][..]));
        let without = w.request(0, 7).prompt.ids();
        assert_eq!(ids[16..26], without[14..24], "the second message is the same");
        assert_eq!(ids[26..30], without[24..28], "the stand-in for the missing reply too");
    }

    #[test]
    fn generated_replies_without_conversations_are_refused_phases_included() {
        let flags = WorkloadFlags {
            input: LengthSpec::Fixed(8),
            output: LengthSpec::Fixed(4),
            shared_prefixes: 0,
            prefix_len: 0,
            prefix_order: PrefixOrder::Random,
            prefix_share: 1.0,
            conversations: 0,
            turns: LengthSpec::Fixed(1),
            replies: Replies::Generated,
            trace: None,
            trace_block_size: 16,
            phases: Vec::new(),
            range: TokenRange::default(),
            seed: 1,
        };
        let phased = WorkloadFlags { phases: vec!["a:10:1:8/4".parse().unwrap()], ..flags.clone() };
        for f in [flags.clone(), phased.clone()] {
            let err = f.build().unwrap_err().to_string();
            assert!(err.contains("--replies generated needs --conversations"), "{err}");
        }
        assert!(WorkloadFlags { replies: Replies::Random, ..phased }.build().is_ok());
        assert!(WorkloadFlags { conversations: 2, ..flags }.build().is_ok());
    }

    #[test]
    fn trace_workload_follows_rows_and_offsets() {
        let rows = crate::trace::parse(
            "{\"timestamp\": 1000, \"input_length\": 8, \"output_length\": 3}\n\
             {\"timestamp\": 1500, \"input_length\": 4, \"output_length\": 2}\n",
            "t",
        )
        .unwrap();
        let w = Workload {
            source: Source::Trace { rows: Arc::new(rows), block_size: 16 },
            range: TokenRange::default(),
            seed: 1,
        };
        assert_eq!(w.trace_len(), Some(2));
        assert_eq!(w.trace_offsets(2.0), Some(vec![0.0, 0.25]));
        let r = w.request(0, 1);
        assert_eq!((r.prompt.len(), r.output_len), (4, 2));
    }
}
