//! Fetching a cached prefix from a peer: the KV pool across workers.
//!
//! When the worker a request goes to lacks a prefix another worker caches (in any
//! tier), the router can have the holder send those blocks instead of the receiver
//! recomputing them:
//!
//! ```text
//! router              receiver R                        holder H
//!   reserve(id, k) ─► blocks held, inbox open ─► token
//!   export_prefix(prompt[..k], R + token) ────────────► between two layers: copies its
//!                     frames land ◄──────── KV ──────── cached blocks out, computes nothing
//!   generate_imported(req, sent) ─► computes prompt[sent..], decodes; the blocks
//!                                   join R's prefix cache
//! ```
//!
//! The holder's queue is not joined: the export runs between two layers of its
//! running step (or between steps when it is idle, then with what its lower tiers
//! hold). The
//! choice is the KV-aware estimate's (a fetched prefix is offered as cached on the
//! receiver, its copy as the restore time), made only where it is predicted sooner
//! than recomputing. A fetch that cannot be done (no blocks on R, H lost, the link
//! broken, the deadline passed, nothing cached any more) falls back to a plain
//! generate on R, which recomputes: nothing the client sent is lost.

use crate::workers::Entry;
use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::{Event, EventSender, GenerateRequest, KvDestination, ServeError, Telemetry};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Seconds per token a fetch is taken to cost until one is timed: a 2,048-token
/// prefix of the default model over loopback TCP measured about 95 ms.
const PRIOR_SECONDS_PER_TOKEN: f64 = 50e-6;
/// The fixed part of a fetch: a reservation and an export call, answered.
const FIXED_SECONDS: f64 = 0.002;
/// A fetch not done by then is given up for a recompute.
const DEADLINE: Duration = Duration::from_secs(10);

/// A planned fetch: `tokens` prompt tokens (whole blocks) from worker `from`.
#[derive(Clone)]
pub struct Fetch {
    pub from: Arc<Entry>,
    pub tokens: usize,
}

/// How long fetches take, learned from those done.
#[derive(Debug, Default)]
pub struct FetchPace(Mutex<Option<f64>>);

impl FetchPace {
    /// Predicted seconds to fetch `tokens` whose copy back from the holder's lower
    /// tiers takes `restore_s`. The pace learned includes the holder's wait for
    /// its current layer.
    pub(crate) fn predict(&self, restore_s: f64, tokens: usize) -> f64 {
        let pace = self.0.lock().unwrap_or_else(PoisonError::into_inner).unwrap_or(PRIOR_SECONDS_PER_TOKEN);
        restore_s + FIXED_SECONDS + tokens as f64 * pace
    }

    /// A fetch of `tokens` took `seconds`, wait included.
    fn observe(&self, tokens: usize, seconds: f64) {
        if tokens == 0 {
            return;
        }
        let rate = (seconds - FIXED_SECONDS).max(0.0) / tokens as f64;
        let mut pace = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        *pace = Some(pace.map_or(rate, |p| 0.8 * p + 0.2 * rate));
    }
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
    let started = Instant::now();
    let fetched = tokio::select! {
        done = tokio::time::timeout(DEADLINE, fetch(&f, &r, &req, ctx.via)) => {
            done.unwrap_or_else(|_| Err(ServeError::Timeout("fetching a cached prefix".into())))
        }
        () = events.closed() => {
            r.worker.release(req.id);
            return;
        }
    };
    let (seconds, id) = (started.elapsed().as_secs_f64(), req.id);
    let started = match fetched {
        Ok(sent) if sent > 0 => {
            ctx.pace.observe(sent, seconds);
            ctx.telemetry.prefix_fetched(sent, seconds, None);
            tracing::debug!(from = f.from.name(), to = r.name(), tokens = sent, ms = seconds * 1e3, "fetched a prefix");
            // Refused, the reservation is given back (release is idempotent).
            r.worker.generate_imported(req, sent, events.clone()).inspect_err(|_| r.worker.release(id))
        }
        other => {
            let why = match &other {
                Ok(_) => "evicted",
                Err(e) => e.kind(),
            };
            ctx.telemetry.prefix_fetched(0, seconds, Some(why));
            tracing::debug!(from = f.from.name(), to = r.name(), why, "a prefix fetch fell back to recomputing");
            r.worker.release(req.id);
            r.worker.generate(req, events.clone())
        }
    };
    if let Err(e) = started {
        let _ = events.send(Event::Failed(r.noted(e)));
    }
}

/// Reserves on `r` and has the holder send the prefix; the tokens sent.
async fn fetch(f: &Fetch, r: &Entry, req: &GenerateRequest, via: TransportKind) -> Result<usize, ServeError> {
    let target = r.worker.kv_target(via).ok_or_else(|| ServeError::Invalid(format!("no {via} receiver")))?;
    let token = r.worker.reserve(req.id, f.tokens, Some(r.epoch())).await?;
    let to = KvDestination { target, token };
    f.from.worker.export_prefix(req.id, req.prompt[..f.tokens].to_vec(), to).await
}
