//! What placement reads: every worker as plain numbers, taken once when a request
//! arrives. The live figures ([`crate::cost`], the KV index, the worker handles)
//! change while requests flow; placement sees one consistent copy, so it is a pure
//! function with table tests ([`crate::place`]).

use crate::index::CachedPrefix;
use pdserve_types::{Role, StepFit};
use std::collections::HashMap;
use std::time::Duration;

/// Before any measurement: the default model's single-thread prefill rate here
/// (~1000 tok/s, docs/benchmarks.md) and a handoff's fixed cost.
pub(crate) const PRIOR_SECONDS_PER_TOKEN: f64 = 1e-3;
pub(crate) const PRIOR_TRANSFER_PER_TOKEN: f64 = 2e-5;
pub(crate) const HANDOFF_FIXED: f64 = 2e-3;

/// Sequences that must have ended within [`FREED_WINDOW`] for their pace to count.
pub(crate) const PACE_FROM: usize = 8;
/// How far back the pace of freed KV blocks is measured.
pub(crate) const FREED_WINDOW: Duration = Duration::from_secs(30);

/// Seconds a worker takes to copy one block back into its pool from its host-RAM
/// tier, before it measured any (a block of a small model is a few hundred KB:
/// a memory copy well under a millisecond).
pub(crate) const HOST_RESTORE_GUESS: f64 = 2e-4;
/// The same from its disk tier (page cache or an SSD read).
pub(crate) const DISK_RESTORE_GUESS: f64 = 2e-3;

/// Prefills queued on a worker: what a new one waits behind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Queue {
    pub tokens: usize,
    pub prefills: usize,
}

/// A KV link from one worker to another, as the fleet's link probe measured it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    pub bytes_per_s: f64,
    /// A one-frame handoff on the open link: sent and acknowledged.
    pub round_trip_s: f64,
}

/// The workers at one instant, as one request's placement sees them.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// In the order the workers joined; a plan names workers by index here.
    pub views: Vec<View>,
    /// The handoffs' measured extra cost.
    pub transfer: TransferView,
    /// Seconds per token of a prefix fetch between workers; `None`: fetching is off.
    pub fetch_per_token: Option<f64>,
}

/// One worker.
#[derive(Debug, Clone)]
pub struct View {
    pub name: String,
    pub role: Role,
    /// Reachable, in the set and not stopping: new work may go there.
    pub usable: bool,
    pub alive: bool,
    /// Exports and imports cached prefixes (both ends of a fetch must).
    pub peers: bool,
    /// Receives KV on the router's transport (a fetch can land there).
    pub receives: bool,
    /// Requests and prefills queued or in flight there, as it counts them.
    pub load: usize,
    /// Requests routed to it whose prefill still runs elsewhere.
    pub routed: usize,
    /// Handoffs it could start prefilling now.
    pub free_slots: usize,
    pub prefill: PrefillView,
    pub backlog: BacklogView,
    pub kv: KvView,
    /// Its decode step fit and the tokens its blocks held, as its stats last said.
    pub step: Option<(StepFit, usize)>,
    pub restore: Restore,
    /// Its probed KV links, by receiving worker's name.
    pub links: HashMap<String, Link>,
    /// The request's prompt blocks its prefix cache holds, as indexed.
    pub cached: CachedPrefix,
    /// What one token of its KV cache takes on the wire, as it announced (its
    /// cache's dtype decides it); `None` when it did not say.
    pub kv_bytes_per_token: Option<f64>,
}

impl View {
    /// Seconds of a decode step here with one more sequence of `tokens` tokens at
    /// most, if its steps were fitted.
    pub fn predict_step(&self, tokens: usize) -> Option<f64> {
        let (fit, held) = self.step?;
        Some(fit.seconds((self.load + 1) as f64, (held + tokens) as f64))
    }
}

/// A worker's prefill side: the prompts the router sent there that have not had
/// their first token, and the pace of a prefill there.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillView {
    pub queue: QueueView,
    /// Seconds per computed prompt token, if a long enough prompt was timed.
    pub per_token: Option<f64>,
    /// Seconds every prefill costs whatever its length, if a short one was timed.
    pub fixed: Option<f64>,
}

impl PrefillView {
    /// The marginal cost of one more prompt token.
    pub fn seconds_per_token(&self) -> f64 {
        self.per_token.unwrap_or(PRIOR_SECONDS_PER_TOKEN)
    }

    pub fn fixed_seconds(&self) -> f64 {
        self.fixed.unwrap_or(0.0)
    }

    fn at(&self) -> (f64, f64) {
        (self.fixed_seconds(), self.seconds_per_token())
    }

    /// The prefills a prompt admitted now would wait behind.
    pub fn ahead(&self) -> Queue {
        self.queue.left(self.at())
    }

    /// Prompt tokens queued and not computed yet.
    pub fn queued(&self) -> usize {
        self.ahead().tokens
    }

    /// Predicted seconds of one prefill computing `tokens`, once it runs.
    pub fn compute(&self, tokens: usize) -> f64 {
        self.fixed_seconds() + tokens as f64 * self.seconds_per_token()
    }

    /// Predicted seconds until the prefills queued here are done.
    pub fn queued_seconds(&self) -> f64 {
        self.queue.seconds(self.at())
    }

    /// Predicted seconds until a prompt computing `tokens` sent now has its first
    /// token.
    pub fn predict(&self, tokens: usize) -> f64 {
        self.predict_at(tokens, self.at())
    }

    /// [`PrefillView::predict`] at a pace given as `(fixed, per token)` (a worker not timed yet is
    /// taken to be as fast as its peers).
    pub fn predict_at(&self, tokens: usize, (fixed, per_token): (f64, f64)) -> f64 {
        self.queue.seconds((fixed, per_token)) + fixed + tokens as f64 * per_token
    }
}

/// Work queued on a worker and served in order: what a new arrival finds is what
/// was queued less what the worker has done since it started on it, and at least
/// what the worker's own last count leaves.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QueueView {
    pub queue: Queue,
    /// Seconds the worker has spent on the queue as it is.
    pub served_s: f64,
    /// The worker's own count of prompt tokens not computed yet, and its age in
    /// seconds.
    pub reported: Option<(f64, usize)>,
}

impl QueueView {
    /// Tokens of the worker's last count not computed yet at `per_token`.
    fn reported_left(&self, per_token: f64) -> usize {
        let Some((age_s, tokens)) = self.reported else { return 0 };
        let done = age_s / per_token.max(1e-12);
        (tokens as f64 - done).max(0.0) as usize
    }

    /// The queue less the tokens the time served computed at `(fixed, per token)`,
    /// the first entry's fixed cost paid first; at least what the worker's count
    /// leaves.
    pub fn left(&self, (fixed, per_token): (f64, f64)) -> Queue {
        let computing = (self.served_s - fixed).max(0.0);
        let done = (computing / per_token.max(1e-12)).min(self.queue.tokens as f64) as usize;
        let tokens = (self.queue.tokens - done).max(self.reported_left(per_token));
        Queue { tokens, ..self.queue }
    }

    /// Predicted seconds until what is queued is done, at `(fixed, per token)`.
    pub fn seconds(&self, (fixed, per_token): (f64, f64)) -> f64 {
        let q = self.queue;
        let by_time = q.prefills as f64 * fixed + q.tokens as f64 * per_token - self.served_s;
        by_time.max(self.reported_left(per_token) as f64 * per_token).max(0.0)
    }
}

/// A decode worker's requests still waiting for their first token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BacklogView {
    /// Seconds a request arriving now waits for those ahead of it to start.
    pub wait_s: f64,
    /// KV blocks the waiting requests still need, and those taken that the
    /// worker's last free count does not show.
    pub pending_blocks: usize,
    /// What admission's raw prediction is multiplied by (measured over predicted).
    pub correction: f64,
}

impl Default for BacklogView {
    fn default() -> Self {
        BacklogView { wait_s: 0.0, pending_blocks: 0, correction: 1.0 }
    }
}

/// A worker's KV memory as admission knows it: the blocks it could give a new
/// sequence, and the blocks its sequences gave back lately.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvView {
    /// Free (or only cached) blocks as last reported; `None` before any report.
    pub free: Option<usize>,
    /// Blocks freed by sequences that ended within the window, and how many ended.
    pub freed_blocks: usize,
    pub ended: usize,
    /// Seconds since the router started counting (the window is shorter before).
    pub counting_s: f64,
}

impl KvView {
    /// Seconds until `need` blocks are free (`KvMemory::wait_for` in `cost`).
    pub fn wait_for(&self, need: usize) -> f64 {
        let Some(free) = self.free else { return 0.0 };
        let missing = need.saturating_sub(free);
        if missing == 0 {
            return 0.0;
        }
        if self.freed_blocks == 0 {
            return 2.0 * FREED_WINDOW.as_secs_f64();
        }
        let window = match self.ended {
            n if n < PACE_FROM => FREED_WINDOW.as_secs_f64(),
            _ => self.counting_s.min(FREED_WINDOW.as_secs_f64()).max(1.0),
        };
        missing as f64 * window / self.freed_blocks as f64
    }
}

/// Seconds per block to copy a cached block back into a worker's pool from its host
/// RAM and from its disk tier.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Restore {
    pub host: f64,
    pub disk: f64,
}

impl Default for Restore {
    fn default() -> Self {
        Restore { host: HOST_RESTORE_GUESS, disk: DISK_RESTORE_GUESS }
    }
}

impl Restore {
    /// Seconds to bring `p`'s host and disk blocks back into the pool.
    pub fn seconds(&self, p: &CachedPrefix) -> f64 {
        p.host as f64 * self.host + p.disk as f64 * self.disk
    }
}

/// The extra cost of a handoff, measured on those made.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TransferView {
    pub seconds_per_token: Option<f64>,
    /// KV payload per prompt token.
    pub bytes_per_token: Option<f64>,
}

impl TransferView {
    /// The extra cost of handing off `tokens` prompt tokens whose prefill computes
    /// for `compute_s`, over `link` if it was probed, from a sender whose cache
    /// takes `sender_bpt` bytes per token (else the bytes the handoffs so far moved).
    pub fn predict(&self, tokens: usize, link: Option<Link>, compute_s: f64, sender_bpt: Option<f64>) -> f64 {
        let per_token = self.seconds_per_token.unwrap_or(PRIOR_TRANSFER_PER_TOKEN);
        let learned = HANDOFF_FIXED + tokens as f64 * per_token;
        let (Some(link), Some(bpt)) = (link, sender_bpt.or(self.bytes_per_token)) else { return learned };
        // Frames leave layer by layer while the prefill computes: only the wire time
        // beyond the compute delays the first token.
        let wire = tokens as f64 * bpt / link.bytes_per_s.max(1.0);
        learned.max(HANDOFF_FIXED + link.round_trip_s + (wire - compute_s).max(0.0))
    }
}
