//! Fetching a cached prefix from a peer: the KV pool across workers.
//!
//! When the worker a request goes to lacks a prefix another worker caches (in any
//! tier), the router can have the holder send those blocks instead of the receiver
//! recomputing them:
//!
//! ```text
//! router              receiver R                        holder H
//!   reserve_after(id, k, prompt[..j]) ─► its own blocks of the first j tokens kept,
//!                     the rest held, inbox open ─► token
//!   export_prefix(prompt[..k], skip j, R + token) ────► between two layers: copies its
//!                     frames land ◄──────── KV ──────── cached blocks after j out,
//!                                                       computes nothing
//!   generate_imported(req, j + sent) ─► computes prompt[j + sent..], decodes; the
//!                                   blocks join R's prefix cache
//! ```
//!
//! Only what R lacks moves: `j` is the prefix R caches itself, as indexed (a shared
//! system prompt, an earlier turn). Where R no longer holds it when reserving, it
//! reserves for the whole prefix and H sends it all.
//!
//! The holder's queue is not joined: the export runs between two layers of its
//! running step (or between steps when it is idle, then with what its lower tiers
//! hold). The
//! choice is the KV-aware estimate's (a fetched prefix is offered as cached on the
//! receiver, its copy as the restore time), made only where it is predicted sooner
//! than recomputing. A fetch that cannot be done (no blocks on R, H lost, the link
//! broken, the deadline passed, nothing cached any more) falls back to a plain
//! generate on R, which recomputes: nothing the client sent is lost.
//!
//! A disaggregated prefill worker fetches the same way ([`into`], called by the
//! handoff before its prefill), then `prefill_imported` instead of
//! `generate_imported`: its holder is typically the decode worker that generated
//! the conversation's last answer.

use crate::workers::Entry;
use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{Capabilities, Event, EventSender, GenerateRequest, KvDestination, ServeError, Telemetry};
use pdserve_types::Epoch;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
// The runtime's clock: the twin's virtual one in a simulation.
use tokio::time::Instant;

/// Seconds per token a fetch is taken to cost until one is timed: a 2,048-token
/// prefix of the default model over loopback TCP measured about 95 ms.
const PRIOR_SECONDS_PER_TOKEN: f64 = 50e-6;
/// The fixed part of a fetch: a reservation and an export call, answered.
const FIXED_SECONDS: f64 = 0.002;
/// A fetch not done by then is given up for a recompute.
const DEADLINE: Duration = Duration::from_secs(10);
/// Fetches the pace is the median of: the latest this many, of the last minute.
const PACE_KEPT: usize = 16;
const PACE_AGE: Duration = Duration::from_secs(60);
/// Until this many are timed the prior fills in for the missing ones.
const PACE_QUORUM: usize = 3;

/// A planned fetch: `tokens` prompt tokens (whole blocks) from worker `from`, of
/// which the receiver caches the first `keep` itself.
#[derive(Clone)]
pub struct Fetch {
    pub from: Arc<Entry>,
    pub tokens: usize,
    pub keep: usize,
    /// Predicted seconds it takes.
    pub seconds: f64,
}

/// How long fetches take, learned from those done: the median seconds per token of
/// the latest fetches of the last minute, the prior standing in for missing ones
/// until [`PACE_QUORUM`] are timed. A fetch that waited long for a holder deep in a
/// long step is outvoted, and ages out: taken alone, it would price every later
/// fetch out, and no fetch would come to correct it.
#[derive(Debug, Default)]
pub struct FetchPace(Mutex<VecDeque<(Instant, f64)>>);

impl FetchPace {
    /// Seconds per token of a fetch now: the median of the latest timed, the prior
    /// standing in for missing ones. The pace learned includes the holder's wait
    /// for its current layer.
    pub(crate) fn per_token(&self) -> f64 {
        let mut timed = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        timed.retain(|&(at, _)| now.duration_since(at) < PACE_AGE);
        let mut rates: Vec<f64> = timed.iter().map(|&(_, r)| r).collect();
        rates.resize(rates.len().max(PACE_QUORUM), PRIOR_SECONDS_PER_TOKEN);
        rates.sort_by(f64::total_cmp);
        rates[rates.len() / 2]
    }

    /// A fetch of `tokens` took `seconds`, wait included.
    fn observe(&self, tokens: usize, seconds: f64) {
        if tokens == 0 {
            return;
        }
        let rate = (seconds - FIXED_SECONDS).max(0.0) / tokens as f64;
        let mut timed = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        timed.push_back((Instant::now(), rate));
        if timed.len() > PACE_KEPT {
            timed.pop_front();
        }
    }
}

/// Predicted seconds to fetch `tokens` at `per_token` ([`FetchPace::per_token`])
/// whose copy back from the holder's lower tiers takes `restore_s`.
pub(crate) fn seconds(per_token: f64, restore_s: f64, tokens: usize) -> f64 {
    restore_s + FIXED_SECONDS + tokens as f64 * per_token
}

/// What a fetch needs besides its plan.
pub(crate) struct FetchCtx {
    pub via: TransportKind,
    pub pace: Arc<FetchPace>,
    pub telemetry: Arc<dyn Telemetry>,
}

/// Fetches `f` into `r` for `req`, then generates there; on any failure, a plain
/// generate on `r` instead. A client that leaves meanwhile stops the fetch and
/// releases the reservation.
pub(crate) async fn run(f: Fetch, r: Arc<Entry>, req: GenerateRequest, events: EventSender, ctx: FetchCtx) {
    let imported = tokio::select! {
        n = into(&f, &r, &req, Some(r.epoch()), &ctx) => n,
        () = events.closed() => {
            r.worker.release(req.id);
            return;
        }
    };
    let id = req.id;
    let started = match imported {
        // Refused, the reservation is given back (release is idempotent).
        Some(n) => r
            .worker
            .peering()
            .and_then(|peer| peer.generate_imported(req, n, events.clone()))
            .inspect_err(|_| r.worker.release(id)),
        None => r.worker.generate(req, events.clone()),
    };
    if let Err(e) = started {
        let _ = events.send(Event::Failed(r.noted(e)));
    }
}

/// Fetches `f` into a reservation for `req` on `r` (fenced for `fence`), timed
/// into the pace and reported: the prompt tokens `r` then holds of it, its own
/// kept and those sent, or `None` when nothing was fetched (its reservation
/// released). Dropped, it leaves the reservation for the caller to release.
pub(crate) async fn into(
    f: &Fetch,
    r: &Entry,
    req: &GenerateRequest,
    fence: Option<Epoch>,
    ctx: &FetchCtx,
) -> Option<usize> {
    let started = Instant::now();
    let fetched = tokio::time::timeout(DEADLINE, fetch(f, r, req, ctx.via, fence))
        .await
        .unwrap_or_else(|_| Err(ServeError::Timeout("fetching a cached prefix".into())));
    let seconds = started.elapsed().as_secs_f64();
    match fetched {
        Ok(Fetched { kept, sent }) if sent > 0 => {
            ctx.pace.observe(sent, seconds);
            ctx.telemetry.prefix_fetched(sent, seconds, None);
            let (from, to, ms) = (f.from.name(), r.name(), pdserve_types::round_ms(seconds));
            tracing::debug!(from, to, tokens = sent, kept, ms, "fetched a prefix");
            Some(kept + sent)
        }
        other => {
            let why = match &other {
                Ok(_) => "evicted",
                Err(e) => e.kind(),
            };
            ctx.telemetry.prefix_fetched(0, seconds, Some(why));
            tracing::debug!(from = f.from.name(), to = r.name(), why, "a prefix fetch fell back to recomputing");
            r.worker.release(req.id);
            None
        }
    }
}

/// What a fetch left on the receiver: `kept` prompt tokens of its own, then `sent`.
struct Fetched {
    kept: usize,
    sent: usize,
}

/// Reserves on `r`, keeping the blocks of the prefix it caches itself where it
/// still does, and has the holder send the rest.
async fn fetch(
    f: &Fetch,
    r: &Entry,
    req: &GenerateRequest,
    via: TransportKind,
    fence: Option<Epoch>,
) -> Result<Fetched, ServeError> {
    let target = r.worker.kv_target(via).ok_or_else(|| ServeError::Invalid(format!("no {via} receiver")))?;
    let prefix = &req.prompt[..f.tokens];
    let kept = match f.keep {
        0 => None,
        // Without a prefix of its own to keep, the receiver reserves it all.
        k => match r.worker.prefix_peer() {
            Some(peer) => peer.reserve_after(req.id, f.tokens, prefix[..k].to_vec(), fence).await.ok().map(|t| (t, k)),
            None => None,
        },
    };
    let (to, kept) = match kept {
        Some((token, k)) => (KvDestination::plain(target, token), k),
        None => (KvDestination::prefix(target, r.worker.reserve(req.id, f.tokens, fence).await?), 0),
    };
    let sent = f.from.worker.peering()?.export_prefix(req.id, prefix.to_vec(), kept, to).await?;
    Ok(Fetched { kept, sent })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKENS: usize = 100;

    fn per_token(p: &FetchPace) -> f64 {
        (seconds(p.per_token(), 0.0, TOKENS) - FIXED_SECONDS) / TOKENS as f64
    }

    #[tokio::test(start_paused = true)]
    async fn one_slow_fetch_is_outvoted_and_does_not_price_fetching_out_for_good() {
        let p = FetchPace::default();
        assert!((per_token(&p) - PRIOR_SECONDS_PER_TOKEN).abs() < 1e-12);
        // The first fetch waited a second for a busy holder.
        p.observe(TOKENS, FIXED_SECONDS + 1.0);
        assert!((per_token(&p) - PRIOR_SECONDS_PER_TOKEN).abs() < 1e-12, "the prior outvotes it");
        for _ in 0..3 {
            p.observe(TOKENS, FIXED_SECONDS + TOKENS as f64 * 20e-6);
        }
        assert!((per_token(&p) - 20e-6).abs() < 1e-12, "the usual fetches set the pace");
        // Slow fetches that are the norm now are learned, and age out in a minute.
        for _ in 0..8 {
            p.observe(TOKENS, FIXED_SECONDS + TOKENS as f64 * 1e-3);
        }
        assert!((per_token(&p) - 1e-3).abs() < 1e-12);
        tokio::time::advance(PACE_AGE).await;
        assert!((per_token(&p) - PRIOR_SECONDS_PER_TOKEN).abs() < 1e-12, "back to the prior");
    }
}
