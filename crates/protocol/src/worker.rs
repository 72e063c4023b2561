//! The one surface the router drives every worker through — an engine thread in this
//! process, a worker process behind a control connection, or a simulated worker.
//!
//! A disaggregated request is three calls on two workers, whatever the transport:
//!
//! ```text
//! router                decode worker D                     prefill worker P
//!   reserve(id, n) ───► blocks held, inbox open ─► token
//!   prefill(req, D.kv_target(via) + token) ─────────────────► computes, streams frames to D
//!                       frames land in the blocks ◄── KV ───  first token ◄── once D has every frame
//!   decode(handoff) ──► waits for the last frame, decodes; events stream back
//! ```
//!
//! Results are flat (`Result<T, ServeError>`, awaited once). Stream calls
//! ([`Worker::generate`], [`Worker::decode`]) write to an [`EventSender`] whose
//! receiver's drop cancels them; dropping a [`Reply`] future cancels its call.

use crate::{EventSender, GenerateRequest, ServeError};
use pdserve_types::{
    Assignment, BlockHash, DecodeSteps, Epoch, FinishReason, HandoffToken, KvDtype, KvEvent, KvTarget, PoolStats,
    PrefillSteps, RequestId, Role, SamplingParams, SpecTotals, StageReceiver, Tier, TierCounters, TokenId, TokenOut,
    TransportKind,
};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::pin::Pin;

/// The answer to a call, awaited once; dropping it cancels the call.
pub type Reply<'a, T> = Pin<Box<dyn Future<Output = Result<T, ServeError>> + Send + 'a>>;

/// A worker as the router sees it. Local, remote and simulated workers implement it;
/// the router never asks which one it has.
///
/// These are the operations every worker has. What only some workers do is a small
/// trait of its own ([`PrefixPeer`], [`KvEventLog`], [`RoleSwitch`], [`LinkProbe`]),
/// found through the accessor of the same name here, `None` where the worker lacks
/// it; a caller that must have it answers with [`unsupported`].
pub trait Worker: Send + Sync + 'static {
    /// What the worker said about itself when it joined; fixed for its life.
    fn info(&self) -> &WorkerInfo;

    /// Requests and prefills queued or in flight here: the policies' load signal.
    fn load(&self) -> usize;

    /// False once the worker cannot be reached (its connection is lost).
    fn is_alive(&self) -> bool;

    /// Prefills and decodes `req` here; its events go to `events`. Refusals that
    /// come later (the engine's checks) arrive as [`crate::Event::Failed`].
    fn generate(&self, req: GenerateRequest, events: EventSender) -> Result<(), ServeError>;

    /// Where this worker receives KV sent over `via`, if it can.
    fn kv_target(&self, via: TransportKind) -> Option<KvTarget>;

    /// Reserves blocks for the `prompt_len` tokens of handoff `id` and starts
    /// receiving its frames. Answers with the token the sender must present, and
    /// what the draft model's K/V of the prompt would save this worker.
    /// Refused with [`ServeError::StaleEpoch`] unless the worker is at epoch `fence`.
    fn reserve(&self, id: RequestId, prompt_len: usize, fence: Option<Epoch>) -> Reply<'_, Reserved>;

    /// Prefills `req` here, sending its KV to `to` layer by layer; resolves once the
    /// receiver holds every frame. Dropping the future stops the prefill.
    fn prefill(&self, req: GenerateRequest, to: KvDestination) -> Reply<'static, Prefilled>;

    /// Decodes a transferred sequence once its last frame has arrived; tokens after
    /// the first go to `events` (a transfer that did not complete fails there).
    fn decode(&self, handoff: DecodeHandoff, events: EventSender) -> Result<(), ServeError>;

    /// Gives up the reservation of handoff `id` (the transfer failed or was
    /// cancelled). Idempotent.
    fn release(&self, id: RequestId);

    /// Block counts and queue sizes.
    fn stats(&self) -> Reply<'_, WorkerStats>;

    /// Its side of moving cached prefixes between workers, if it has one: the router
    /// fetches a prefix only where both ends answer `Some`.
    fn prefix_peer(&self) -> Option<&dyn PrefixPeer> {
        None
    }

    /// The log of its prefix-cache events, if it keeps one.
    fn kv_event_log(&self) -> Option<&dyn KvEventLog> {
        None
    }

    /// Its role switching, if it can change role while it runs.
    fn role_switch(&self) -> Option<&dyn RoleSwitch> {
        None
    }

    /// Its inboxes for the fleet's link probe, if it takes probes.
    fn link_probe(&self) -> Option<&dyn LinkProbe> {
        None
    }
}

/// The capabilities for a caller that needs one: a worker that lacks it is refused
/// with [`unsupported`], naming the worker and what it lacks. Every worker has these.
pub trait Capabilities: Worker {
    fn peering(&self) -> Result<&dyn PrefixPeer, ServeError> {
        self.prefix_peer().ok_or_else(|| unsupported(self, "fetches no prefixes from its peers"))
    }

    fn event_log(&self) -> Result<&dyn KvEventLog, ServeError> {
        self.kv_event_log().ok_or_else(|| unsupported(self, "publishes no KV events"))
    }

    fn roles(&self) -> Result<&dyn RoleSwitch, ServeError> {
        self.role_switch().ok_or_else(|| unsupported(self, "cannot change role"))
    }

    fn probes(&self) -> Result<&dyn LinkProbe, ServeError> {
        self.link_probe().ok_or_else(|| unsupported(self, "takes no link probes"))
    }
}

impl<W: Worker + ?Sized> Capabilities for W {}

/// The refusal of an optional operation by `worker`, which lacks the capability for
/// it, in the words callers have always seen: `worker {name} {lacks}` ("worker d0
/// cannot change role").
pub fn unsupported<W: Worker + ?Sized>(worker: &W, lacks: &str) -> ServeError {
    ServeError::Invalid(format!("worker {} {lacks}", worker.info().name))
}

/// Prefix peering: a worker that lacks a prefix a peer caches takes its K/V from
/// the peer instead of computing it. Apart from [`Worker`] because a worker needs
/// an engine with a prefix cache it can read and fill between steps to take part.
pub trait PrefixPeer: Send + Sync {
    /// [`Worker::reserve`] for a fetch of a prefix whose first tokens, `keep` (whole
    /// blocks), this worker caches itself: their blocks are taken from its cache, and
    /// the frames fill the blocks after them (a peer's [`PrefixPeer::export_prefix`]
    /// with `skip` = `keep.len()`). Refused with [`ServeError::Overloaded`] when some
    /// of `keep` is no longer cached here; the caller then reserves it all.
    fn reserve_after(
        &self,
        id: RequestId,
        prompt_len: usize,
        keep: Vec<TokenId>,
        fence: Option<Epoch>,
    ) -> Reply<'_, HandoffToken>;

    /// [`Worker::prefill`] of a request whose first `imported` prompt tokens' K/V
    /// came into reservation `req.id` from a peer ([`PrefixPeer::export_prefix`]):
    /// only the rest is computed, and the whole prompt's KV goes to `to`. Any
    /// failure, a dropped future too, releases the reservation.
    fn prefill_imported(&self, req: GenerateRequest, imported: usize, to: KvDestination) -> Reply<'static, Prefilled>;

    /// Sends the K/V of `tokens`' whole blocks from token `skip` on (the receiver
    /// keeps those before, [`PrefixPeer::reserve_after`]), as far as this worker
    /// caches them in a run (any tier; a chained block hash names its whole prefix),
    /// to the reservation behind `to`, between two engine steps: nothing is computed
    /// and nothing waits for this worker's queue. Resolves with the tokens sent once
    /// the receiver holds every frame (0: the block at `skip` is not cached).
    /// Dropping the future stops the transfer.
    fn export_prefix(
        &self,
        id: RequestId,
        tokens: Vec<TokenId>,
        skip: usize,
        to: KvDestination,
    ) -> Reply<'static, usize>;

    /// Prefills and decodes `req` here like [`Worker::generate`], its first
    /// `imported` prompt tokens' K/V taken from the transfer into reservation
    /// `req.id` (a peer's [`PrefixPeer::export_prefix`]) instead of computed; the
    /// blocks join this worker's prefix cache. A transfer that did not complete
    /// fails the stream (the reservation is released).
    fn generate_imported(&self, req: GenerateRequest, imported: usize, events: EventSender) -> Result<(), ServeError>;
}

/// A worker's prefix-cache events, for routers that route by what each worker
/// caches. Apart from [`Worker`] because only a worker that keeps a log of its
/// cache can tell a reader what changed since it last asked.
pub trait KvEventLog: Send + Sync {
    /// The worker's prefix-cache events after `after`; when they cannot follow it
    /// (another instance, or fallen out of the worker's log), a snapshot first.
    fn kv_events(&self, after: KvCursor) -> Reply<'_, KvEvents>;
}

/// Changing role while running, for planners that move workers between prefill and
/// decode. Apart from [`Worker`] because a worker must fence its work by epoch to
/// take part.
pub trait RoleSwitch: Send + Sync {
    /// Takes role `to.role` if `to.epoch` is newer than the worker's, and answers with
    /// the assignment it holds afterwards. Nothing is reloaded and the prefix cache
    /// stays; sequences already running finish here unless moved
    /// ([`RoleSwitch::move_decodes`]). From then on, work fenced with an
    /// older epoch is refused.
    fn set_role(&self, to: Assignment) -> Reply<'_, Assignment>;

    /// Hands back every sequence a worker that no longer decodes still runs (it
    /// switched to prefill): each stream ends with [`ServeError::Moved`] and its
    /// blocks stay in the prefix cache, so the router can prefill the rest here and
    /// ship the KV to a decoder instead of computing it again. Answers with how many
    /// moved; none while the worker's role decodes.
    fn move_decodes(&self) -> Reply<'_, usize>;
}

/// Timing the link to a worker, for the fleet's link prober. Apart from [`Worker`]
/// because only a worker with real KV receivers has a link worth timing.
pub trait LinkProbe: Send + Sync {
    /// Opens an inbox for handoff `id` whose frames are counted and thrown away, so a
    /// peer can time its link to this worker. Answers with the token the sender must
    /// present; the inbox closes after a short while.
    fn probe_inbox(&self, id: RequestId) -> Reply<'_, HandoffToken>;
}

/// Who a worker is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub name: String,
    /// The served model's name; a router refuses workers that disagree.
    pub model: String,
    /// The role it started in (the router's worker set holds the current one).
    pub role: Role,
    /// How its KV cache stores K and V: what its exports put on the wire.
    #[serde(default)]
    pub kv_dtype: KvDtype,
    /// Bytes of one token's K and V over all layers in that form (0: not known).
    #[serde(default)]
    pub kv_bytes_per_token: u64,
    /// The draft model it drafts with (`--speculative draft`), with the shape of its
    /// K/V: a prefill worker ships the draft model's K/V with the target's.
    #[serde(default)]
    pub draft: Option<String>,
}

impl WorkerInfo {
    /// A worker whose cache form is not known (f16, bytes per token 0).
    pub fn new(name: impl Into<String>, model: impl Into<String>, role: Role) -> Self {
        let (name, model) = (name.into(), model.into());
        WorkerInfo { name, model, role, kv_dtype: KvDtype::F16, kv_bytes_per_token: 0, draft: None }
    }

    /// Says which draft model it drafts with.
    pub fn with_draft(self, draft: Option<String>) -> Self {
        WorkerInfo { draft, ..self }
    }

    /// Why requests cannot be handed between `self` and `other`, if they cannot:
    /// they serve different models, or draft with different draft models (one's
    /// prefill would ship draft K/V the other cannot use, or none where it needs it;
    /// and roles switch, so every pair may hand off either way). Caches of other
    /// dtypes can: frames are converted on receipt.
    pub fn mismatch(&self, other: &WorkerInfo) -> Option<String> {
        let none = || "no draft model".to_string();
        if self.model != other.model {
            Some(format!("{} serves {}, {} serves {}", self.name, self.model, other.name, other.model))
        } else if self.draft != other.draft {
            let (a, b) = (self.draft.clone().unwrap_or_else(none), other.draft.clone().unwrap_or_else(none));
            Some(format!("{} drafts with {a}, {} with {b}", self.name, other.name))
        } else {
            None
        }
    }

    /// Says how its cache stores K and V, and what a token of it takes.
    pub fn with_kv(self, kv_dtype: KvDtype, kv_bytes_per_token: u64) -> Self {
        WorkerInfo { kv_dtype, kv_bytes_per_token, ..self }
    }
}

/// Where a prefill sends its KV: the decode worker's target, the token its
/// reservation issued, and what the draft model's K/V of the prompt is worth there.
#[derive(Debug, Clone)]
pub struct KvDestination {
    pub target: KvTarget,
    pub token: HandoffToken,
    /// [`Reserved::draft_worth`]: a prefill worker with a draft model computes the
    /// prompt in it and ships its K/V only where that beats its own cost.
    pub draft_worth: Option<f64>,
    /// [`Reserved::stages`]: the layers that go straight to a decode group's later
    /// stages, not to `target`.
    pub stages: Vec<StageReceiver>,
}

impl KvDestination {
    /// A destination that takes no draft model's K/V (a prefix's, a probe's).
    pub fn plain(target: KvTarget, token: HandoffToken) -> KvDestination {
        KvDestination { target, token, draft_worth: Some(0.0), stages: Vec::new() }
    }

    /// The destination of a peer's cached prefix into reservation `r` at `target`:
    /// no draft model's K/V, each layer to the stage that holds it.
    pub fn prefix(target: KvTarget, r: Reserved) -> KvDestination {
        KvDestination { stages: r.stages, ..KvDestination::plain(target, r.token) }
    }

    /// The destination of a prefill into reservation `r` at `target`.
    pub fn reserved(target: KvTarget, r: Reserved) -> KvDestination {
        KvDestination { target, token: r.token, draft_worth: r.draft_worth, stages: r.stages }
    }
}

/// A decode worker's reservation of a handoff's blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reserved {
    /// What the sender must present.
    pub token: HandoffToken,
    /// Seconds the draft model's K/V of the prompt would save the reserving
    /// worker's decodes (they draft by lookup without it): 0 where it drafts with
    /// no draft model or has no room for the K/V; `None` while it has not measured
    /// the saving (the K/V is then wanted whatever it costs).
    pub draft_worth: Option<f64>,
    /// A decode group's later stages that take their own layers of the handoff
    /// straight from the sender (each issued a token of its own); empty for a whole
    /// worker, whose `target` takes every layer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageReceiver>,
}

impl Reserved {
    /// A reservation whose every layer goes to the worker that made it.
    pub fn whole(token: HandoffToken, draft_worth: Option<f64>) -> Reserved {
        Reserved { token, draft_worth, stages: Vec::new() }
    }
}

/// What a prefill worker hands the decode worker: the first token it sampled and
/// the figures of the prefill.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prefilled {
    pub token: TokenOut,
    /// The first token already ends the request (EOS, stop id or max_tokens 1).
    pub finished: Option<FinishReason>,
    pub prompt_tokens: usize,
    /// Prompt tokens the prefill worker found in its prefix cache.
    pub cached_tokens: usize,
    /// Seconds the prefill waited in the worker's queue, then computed.
    pub queued_seconds: f64,
    pub prefill_seconds: f64,
    /// Seconds from the first token until the decode worker held every frame: the
    /// part of the transfer the prefill did not hide.
    pub transfer_seconds: f64,
    /// Payload bytes sent to the decode worker.
    pub kv_bytes: u64,
    /// Prompt tokens of the draft model's K/V sent beside the target's, after them (0
    /// without a draft model, or where the draft's K/V was not worth computing).
    #[serde(default)]
    pub draft_kv_tokens: usize,
    /// The prompt's scores, when the request asked for them.
    #[serde(default)]
    pub prompt_logprobs: Option<Vec<TokenOut>>,
    /// The prompt's embedding, when the request asked for it.
    #[serde(default)]
    pub embedding: Option<Vec<f32>>,
}

/// A transferred sequence, ready to decode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeHandoff {
    pub id: RequestId,
    /// The request's public id, for the decode worker's logs.
    pub tag: crate::RequestTag,
    pub prompt: Vec<TokenId>,
    /// The token the prefill worker sampled (already sent to the client).
    pub first: TokenId,
    pub params: SamplingParams,
    /// The prefill side's cache hit, reported in the request's usage.
    pub cached_tokens: usize,
}

/// Where a reader of a worker's KV events stands: the worker's event log and the
/// number of the last event applied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCursor {
    pub instance: u64,
    pub seq: u64,
}

/// A worker's KV events after a cursor.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvEvents {
    /// Present when the cursor could not be followed: what the worker holds now, in
    /// each tier, to replace everything known of it before `events` apply.
    pub snapshot: Option<Vec<(BlockHash, Tier)>>,
    /// Oldest first, each with its age in seconds on the worker's clock when sent.
    pub events: Vec<(KvEvent, f32)>,
    /// The cursor after applying all of this.
    pub cursor: KvCursor,
}

/// A snapshot of a worker's engine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerStats {
    pub waiting: usize,
    pub running: usize,
    /// Reservations waiting for (or receiving) a transfer.
    pub importing: usize,
    /// Running sequences paused because their clients fell behind.
    pub paused: usize,
    /// Prompt tokens queued or being prefilled, not computed yet.
    #[serde(default)]
    pub queued_prompt_tokens: usize,
    pub blocks: PoolStats,
    /// Token masks computed for constrained requests since the worker started, and
    /// their total time in nanoseconds.
    #[serde(default)]
    pub grammar_masks: u64,
    #[serde(default)]
    pub grammar_mask_ns: u64,
    /// The worker's role and epoch now (absent from workers that predate switching).
    #[serde(default)]
    pub assignment: Option<Assignment>,
    /// Running sums over its decode-only steps since it started.
    #[serde(default)]
    pub decode_steps: DecodeSteps,
    /// Running sums over its prefill-only steps since it started.
    #[serde(default)]
    pub prefill_steps: PrefillSteps,
    /// Blocks its lower tiers stored and restored since it started.
    #[serde(default)]
    pub tiers: TierCounters,
    /// It is stopping (SIGTERM): it finishes what it has and should get nothing new.
    #[serde(default)]
    pub stopping: bool,
    /// It heads a stage group whose later stages are not all reachable: it holds no
    /// request and should get none until they are.
    #[serde(default)]
    pub incomplete: bool,
    /// Drafted tokens it verified and accepted since it started.
    #[serde(default)]
    pub spec: SpecTotals,
    /// Its draft model's block pool, when it drafts with one.
    #[serde(default)]
    pub draft_blocks: Option<PoolStats>,
    /// Its steps through the later stages of its group, when it heads one.
    #[serde(default)]
    pub stages: pdserve_types::StageTotals,
}

/// The furthest a role switch may move a worker's epoch. Planners move it one at a
/// time; a far jump (to the last epoch, say) would leave no newer one to undo it.
pub const MAX_EPOCH_JUMP: u64 = 1024;

/// A worker's own side of role switching: the assignment it holds, switched only
/// forward in epochs, and the fence each new piece of work passes.
#[derive(Debug)]
pub struct RoleState(std::sync::Mutex<Assignment>);

impl RoleState {
    pub fn new(role: Role) -> Self {
        RoleState(std::sync::Mutex::new(Assignment::new(role, Epoch::default())))
    }

    pub fn get(&self) -> Assignment {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes `to` if it is newer, by at most [`MAX_EPOCH_JUMP`]; answers with what
    /// was held before and after.
    pub fn switch(&self, to: Assignment) -> (Assignment, Assignment) {
        let mut held = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = *held;
        if to.epoch > held.epoch && to.epoch.0 - held.epoch.0 <= MAX_EPOCH_JUMP {
            *held = to;
        }
        (before, *held)
    }

    /// Refuses work fenced for another epoch than the worker's, or (defensively)
    /// work its role does not `take`. Unfenced work passes.
    pub fn fence(&self, worker: &str, fence: Option<Epoch>, take: fn(Role) -> bool) -> Result<(), ServeError> {
        let now = self.get();
        match fence {
            Some(e) if e != now.epoch || !take(now.role) => {
                Err(ServeError::StaleEpoch { worker: worker.to_string(), now })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_switch_forward_only_and_fence_older_epochs() {
        let s = RoleState::new(Role::Decode);
        assert!(s.fence("w", Some(Epoch(0)), Role::decodes).is_ok());
        assert!(s.fence("w", None, Role::prefills).is_ok(), "unfenced work is not checked");
        let to = Assignment::new(Role::Prefill, Epoch(1));
        assert_eq!(s.switch(to).1, to);
        // An older or equal epoch changes nothing.
        assert_eq!(s.switch(Assignment::new(Role::Decode, Epoch(1))), (to, to));
        let e = s.fence("w", Some(Epoch(0)), Role::prefills).unwrap_err();
        assert!(matches!(e, ServeError::StaleEpoch { now, .. } if now == to));
        assert!(e.is_retryable());
        assert!(s.fence("w", Some(Epoch(1)), Role::prefills).is_ok());
        assert!(s.fence("w", Some(Epoch(1)), Role::decodes).is_err(), "a prefill worker takes no decode");
    }

    #[test]
    fn workers_hand_off_only_with_the_same_model_and_draft_model() {
        let w = |name: &str, model: &str, draft: Option<&str>| {
            WorkerInfo::new(name, model, Role::Decode).with_draft(draft.map(str::to_string))
        };
        let q8 = w("b", "m", None).with_kv(KvDtype::Q8_0, 10);
        let cases = [
            (w("a", "m", None), w("b", "m", None), None),
            (w("a", "m", Some("d")), w("b", "m", Some("d")), None),
            (w("a", "m", None), q8, None),
            (w("a", "m", None), w("b", "n", None), Some("a serves m, b serves n")),
            (w("a", "m", Some("d")), w("b", "m", None), Some("a drafts with d, b with no draft model")),
            (w("a", "m", Some("d")), w("b", "m", Some("e")), Some("a drafts with d, b with e")),
        ];
        for (a, b, want) in cases {
            assert_eq!(a.mismatch(&b).as_deref(), want, "{a:?} {b:?}");
            assert_eq!(b.mismatch(&a).is_some(), want.is_some(), "either way");
        }
    }

    #[test]
    fn a_far_epoch_jump_is_refused_and_the_last_epoch_does_not_wrap() {
        let s = RoleState::new(Role::Decode);
        let far = Assignment::new(Role::Prefill, Epoch(u64::MAX));
        assert_eq!(s.switch(far).1, Assignment::new(Role::Decode, Epoch(0)));
        let next = Assignment::new(Role::Prefill, Epoch(MAX_EPOCH_JUMP));
        assert_eq!(s.switch(next).1, next);
        assert_eq!(Epoch(u64::MAX).next(), Epoch(u64::MAX));
    }
}
