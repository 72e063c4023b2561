//! Constrained decoding. A request's [`Grammar`] (JSON Schema, regular expression or
//! Lark) is compiled by llguidance, the grammar engine vLLM, SGLang and llama.cpp use,
//! into a per-sequence [`Constraint`]. Each step the constraint gives the set of
//! tokens that can continue the output; the sampler chooses only among them, and the
//! chosen token advances the constraint.
//!
//! The mask depends only on the tokens generated so far, so a constrained sequence
//! samples the same tokens alone or batched, chunked or preempted, and a worker that
//! takes a sequence over rebuilds the state by feeding it those tokens.

pub mod bounds;
mod deadline;

use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use pdserve_types::{Grammar, GrammarSpec};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    #[error("{0}")]
    Invalid(String),
    #[error("the tokens generated so far do not match the grammar: {0}")]
    Replay(String),
    #[error("the vocabulary cannot be used for constrained decoding: {0}")]
    Vocabulary(String),
    /// Too many grammars are compiling; the request may be retried.
    #[error("too many grammars are compiling; retry shortly")]
    Busy,
    /// The output stopped matching its grammar mid-generation.
    #[error("the output can no longer match its grammar: {0}")]
    Broken(String),
}

/// The model's vocabulary as llguidance sees it: each token's bytes, special tokens
/// marked with a leading 0xFF so no grammar ever matches them as text.
struct Vocab {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            // Bytes a grammar forces mid-answer: no SentencePiece space in front.
            Ok(text) => self.tokenizer.encode_continuation(text),
            // Not text: the longest-match split is valid if not canonical.
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles grammars for one model; shared by every sequence of every engine that
/// serves it, and by the validation of the requests they serve.
///
/// A grammar is compiled once, on a compile thread of its own (never an engine's,
/// whose step would stall every other sequence), and kept: a request's choices,
/// and the engines it reaches after validation, clone the compiled start state.
pub struct Grammars {
    shared: Arc<Shared>,
    jobs: SyncSender<Job>,
}

/// What the compile thread and the callers share.
struct Shared {
    factory: ParserFactory,
    compiled: Mutex<Cache>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

/// Compiles waiting for the compile thread before more are refused as busy: the
/// bound on how much grammar work the process takes on at once.
const COMPILE_QUEUE: usize = 8;
/// The compile thread's stack: [`bounds::MAX_CHAIN`] links need well under 1 MiB,
/// so a chain that slipped past the source check still cannot overflow it.
const COMPILE_STACK: usize = 64 << 20;
/// Compiled grammars kept for reuse.
const CACHE: usize = 64;
/// The longest one step of a grammar may take: computing its mask, or taking a token.
/// llguidance's own budgets keep a step to milliseconds, but not the bytes it forces
/// (see `deadline`); a step past this is cancelled: at compile time the grammar is
/// refused, mid-generation its output ends in an error.
pub const STEP_BUDGET: Duration = Duration::from_millis(500);

impl Grammars {
    /// Builds the token trie (a few hundred milliseconds for a 49k vocabulary) and
    /// starts the compile thread.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Grammars, GrammarError> {
        let n = tokenizer.vocab_size();
        let eos = tokenizer.eos_id().or_else(|| tokenizer.eog_ids().first().copied());
        let eos = eos.ok_or_else(|| GrammarError::Vocabulary("the tokenizer names no end-of-sequence token".into()))?;
        let words: Vec<Vec<u8>> = (0..n as u32).map(|id| token_word(&tokenizer, id)).collect();
        let trie = TokTrie::from(&TokRxInfo::new(n as u32, eos), &words);
        let env: TokEnv = Arc::new(Vocab { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();
        let shared = Arc::new(Shared { factory, compiled: Mutex::default() });
        let (jobs, rx) = sync_channel::<Job>(COMPILE_QUEUE);
        let on_thread = shared.clone();
        std::thread::Builder::new()
            .name("pdserve-grammar".into())
            .stack_size(COMPILE_STACK)
            .spawn(move || rx.into_iter().for_each(|job| on_thread.run(job)))
            .map_err(|e| GrammarError::Vocabulary(format!("cannot start the grammar compiler: {e}")))?;
        Ok(Grammars { shared, jobs })
    }

    /// Whether `spec` was compiled already (or refused): a constraint for it costs
    /// only a copy of its start state.
    pub fn is_compiled(&self, spec: &GrammarSpec) -> bool {
        self.shared.cache().contains(spec)
    }

    /// Queues `spec` for the compile thread, which calls `then` once the result is
    /// kept, whatever it is. [`GrammarError::Busy`] when the queue is full.
    pub fn compile_then(&self, spec: &GrammarSpec, then: Box<dyn FnOnce() + Send>) -> Result<(), GrammarError> {
        self.jobs.try_send(Job { spec: spec.clone(), then }).map_err(|_| GrammarError::Busy)
    }

    /// Compiles `spec` on the compile thread unless it is compiled already; blocks
    /// until it is, and says whether it compiled.
    pub fn prepare(&self, spec: &GrammarSpec) -> Result<(), GrammarError> {
        if !self.is_compiled(spec) {
            let (done, wait) = sync_channel(1);
            self.compile_then(
                spec,
                Box::new(move || {
                    let _ = done.send(());
                }),
            )?;
            wait.recv().map_err(|_| GrammarError::Busy)?;
        }
        self.shared.start_state(spec).map(drop)
    }

    /// A fresh constraint at the start of `g`, with its replayed tokens (the tail of
    /// `prompt`) consumed; its mask times go to `clock`. Uses the compiled grammar
    /// [`Grammars::prepare`] left; compiles on the calling thread if there is none.
    pub fn constraint(&self, g: &Grammar, prompt: &[u32], clock: Arc<MaskClock>) -> Result<Constraint, GrammarError> {
        let start = self.shared.start_state(&g.spec)?;
        let matcher = start.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let mut c = Constraint { matcher, mask: None, clock, over_budget: false };
        let replayed = prompt.len().saturating_sub(g.replayed as usize);
        c.matcher.consume_tokens(&prompt[replayed..]).map_err(|e| GrammarError::Replay(first_line(&e)))?;
        Ok(c)
    }

    /// Checks that `g` compiles, as a request is validated; the compiled grammar is
    /// kept for the engines.
    pub fn check(&self, g: &Grammar) -> Result<(), GrammarError> {
        self.prepare(&g.spec)
    }
}

impl Shared {
    /// The compiled start state of `spec`, from the cache or compiled here.
    fn start_state(&self, spec: &GrammarSpec) -> Compiled {
        if let Some(hit) = self.cache().get(spec) {
            return hit;
        }
        let compiled = compile(&self.factory, spec);
        self.cache().put(spec, compiled.clone());
        compiled
    }

    fn run(&self, job: Job) {
        self.start_state(&job.spec).ok();
        (job.then)();
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.compiled.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A grammar's start state, or why it has none.
type Compiled = Result<Arc<Mutex<Matcher>>, GrammarError>;

/// One compile for the compile thread, and what to do once it is kept.
struct Job {
    spec: GrammarSpec,
    then: Box<dyn FnOnce() + Send>,
}

/// Bounds-checks and compiles `spec`, and computes its first mask: a grammar that
/// cannot give one is refused now rather than failing its first step.
fn compile(factory: &ParserFactory, spec: &GrammarSpec) -> Compiled {
    bounds::check(spec)?;
    let top = match spec {
        GrammarSpec::JsonSchema(text) => {
            let mut schema = serde_json::from_str(text).map_err(|e| GrammarError::Invalid(format!("schema: {e}")))?;
            compact_json(&mut schema);
            TopLevelGrammar::from_json_schema(schema)
        }
        GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        GrammarSpec::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
    };
    let parser = factory.create_parser(top).map_err(|e| GrammarError::Invalid(first_line(&e)))?;
    // Cancellable, so each step can be held to its budget; the first step is taken
    // here, and what it forced is kept for every copy of the start state.
    let mut start = Matcher::new(Ok(parser)).into_cancellable();
    let armed = start.cancellation_handle().map(|h| deadline::arm(h, STEP_BUDGET));
    let first = start.compute_mask();
    drop(armed);
    if start.is_cancelled() {
        return Err(GrammarError::Invalid(format!(
            "the grammar is too complex: its first step took over {} ms",
            STEP_BUDGET.as_millis()
        )));
    }
    first.map_err(|e| GrammarError::Invalid(format!("the grammar allows no output: {}", first_line(&e))))?;
    Ok(Arc::new(Mutex::new(start)))
}

/// The most recently used compiled grammars, oldest first.
#[derive(Default)]
struct Cache(Vec<(GrammarSpec, Compiled)>);

impl Cache {
    fn contains(&self, spec: &GrammarSpec) -> bool {
        self.0.iter().any(|(s, _)| s == spec)
    }

    fn get(&mut self, spec: &GrammarSpec) -> Option<Compiled> {
        let i = self.0.iter().position(|(s, _)| s == spec)?;
        let hit = self.0.remove(i);
        let compiled = hit.1.clone();
        self.0.push(hit);
        Some(compiled)
    }

    fn put(&mut self, spec: &GrammarSpec, compiled: Compiled) {
        if self.0.len() >= CACHE {
            drop(self.0.remove(0));
        }
        self.0.push((spec.clone(), compiled));
    }
}

/// Makes a JSON schema's output one line with `", "` and `": "` between items, unless
/// the schema sets its own layout (llguidance's `x-guidance` options). Free
/// whitespace lets a model pad its output with newlines until `max_tokens` (the known
/// failure of JSON modes with small models); one fixed layout also makes outputs
/// comparable.
pub fn compact_json(schema: &mut serde_json::Value) {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
}

fn token_word(t: &Tokenizer, id: u32) -> Vec<u8> {
    if t.is_special(id) {
        let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        w.extend_from_slice(t.token_text(id).unwrap_or_default().as_bytes());
        return w;
    }
    t.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default()
}

/// llguidance's errors can be long (a whole schema path); the first line says what.
/// A panic llguidance caught inside itself says nothing a client can act on.
fn first_line(e: &anyhow::Error) -> String {
    let line = e.to_string().lines().next().unwrap_or("grammar error").to_string();
    match line.starts_with("panic") {
        true => "the grammar is too large or complex to compile".into(),
        false => line,
    }
}

/// One sequence's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
    mask: Option<SimpleVob>,
    clock: Arc<MaskClock>,
    /// A step ran past [`STEP_BUDGET`] and was cancelled.
    over_budget: bool,
}

impl Constraint {
    /// The tokens that may come next, one bit each (bit `i % 32` of word `i / 32`):
    /// only the end-of-sequence token once the grammar is complete; `None` once the
    /// constraint failed (the sequence should stop), a step past [`STEP_BUDGET`] too.
    pub fn allowed(&mut self) -> Option<&[u32]> {
        let t0 = Instant::now();
        let armed = self.arm();
        let mask = self.matcher.compute_mask_or_eos().ok();
        drop(armed);
        self.over_budget |= self.matcher.is_cancelled();
        self.clock.record(t0.elapsed().as_nanos() as u64);
        self.mask = mask;
        self.mask.as_ref().map(SimpleVob::as_slice)
    }

    /// The tokens the grammar forces from here (its canonical tokenization of the
    /// bytes no other output could have), without advancing: free drafts for
    /// speculative decoding. Empty when nothing is forced or the step fails.
    pub fn forced(&mut self) -> Vec<u32> {
        let armed = self.arm();
        let tokens = self.matcher.compute_ff_tokens();
        drop(armed);
        self.over_budget |= self.matcher.is_cancelled();
        tokens
    }

    /// Advances past the chosen token; false if the grammar cannot take it.
    pub fn accept(&mut self, token: u32) -> bool {
        if self.matcher.is_stopped() {
            return true;
        }
        let armed = self.arm();
        let taken = self.matcher.consume_token(token).is_ok();
        drop(armed);
        self.over_budget |= self.matcher.is_cancelled();
        taken
    }

    /// This step, cancelled should it run past [`STEP_BUDGET`].
    fn arm(&self) -> Option<deadline::Armed> {
        self.matcher.cancellation_handle().map(|h| deadline::arm(h, STEP_BUDGET))
    }

    /// The grammar hit an error (an unexpected token): the output cannot continue.
    pub fn failed(&self) -> bool {
        self.matcher.is_error()
    }

    /// Advances past the chosen token; why the output cannot continue if it cannot
    /// (the token does not fit, or no mask could be computed for this step).
    pub fn broken(&mut self, token: u32) -> Option<String> {
        if self.accept(token) && !self.failed() {
            return None;
        }
        if self.over_budget {
            return Some(format!("a step of the grammar took over {} ms; it is too complex", STEP_BUDGET.as_millis()));
        }
        let why = self.matcher.get_error().unwrap_or_else(|| format!("token {token} does not fit"));
        Some(why.lines().next().unwrap_or_default().to_string())
    }
}

/// Buckets per doubling of [`MaskClock`]: quantiles at most 25 % high.
const SUB_BUCKETS: usize = 4;
/// Up to 2^32 ns (4 s) per mask.
const BUCKETS: usize = 32 * SUB_BUCKETS;

/// How long mask computations take: a count, a sum and log-scale buckets of
/// nanoseconds, lock-free, for the metrics and the benchmark.
pub struct MaskClock {
    count: AtomicU64,
    total_ns: AtomicU64,
    buckets: Vec<AtomicU64>,
}

impl Default for MaskClock {
    fn default() -> Self {
        MaskClock {
            count: AtomicU64::new(0),
            total_ns: AtomicU64::new(0),
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl MaskClock {
    fn record(&self, ns: u64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.total_ns.fetch_add(ns, Ordering::Relaxed);
        self.buckets[bucket(ns)].fetch_add(1, Ordering::Relaxed);
    }

    /// Masks computed, and their total time in seconds.
    pub fn totals(&self) -> (u64, f64) {
        (self.count.load(Ordering::Relaxed), self.total_ns.load(Ordering::Relaxed) as f64 * 1e-9)
    }

    /// The quantile `q` of the times, in seconds, as its bucket's upper bound (so at
    /// most 25 % high); 0 with no samples.
    pub fn quantile(&self, q: f64) -> f64 {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        let rank = (q.clamp(0.0, 1.0) * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (b, c) in counts.iter().enumerate() {
            seen += c;
            if total > 0 && seen >= rank {
                return upper_bound(b) * 1e-9;
            }
        }
        0.0
    }
}

/// The bucket of `ns`: its doubling, then which quarter of it.
fn bucket(ns: u64) -> usize {
    let ns = ns.max(1);
    let octave = 63 - ns.leading_zeros() as usize;
    let quarter = if octave >= 2 { (ns >> (octave - 2)) as usize & 3 } else { 0 };
    (octave * SUB_BUCKETS + quarter).min(BUCKETS - 1)
}

/// The largest time of bucket `b`, in ns.
fn upper_bound(b: usize) -> f64 {
    let (octave, quarter) = (b / SUB_BUCKETS, b % SUB_BUCKETS);
    (1u64 << octave) as f64 * (1.0 + (quarter + 1) as f64 / SUB_BUCKETS as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_close_upper_bounds() {
        let c = MaskClock::default();
        for ns in 1..=1000u64 {
            c.record(ns * 1000);
        }
        for q in [0.5, 0.9, 0.99] {
            let exact = q * 1000.0 * 1000.0 * 1e-9;
            let got = c.quantile(q);
            assert!(got >= exact && got <= exact * 1.26, "q{q}: {got} vs {exact}");
        }
        assert_eq!(c.totals().0, 1000);
        assert_eq!(MaskClock::default().quantile(0.5), 0.0);
    }
}
