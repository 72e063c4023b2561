//! Runs one sweep point against one client and returns its records, sorted by index.
//!
//! Everything runs in the calling task (joined futures, no spawning), so it works on
//! a single-threaded runtime and the client stays off the server's cores as much as a
//! client can.

use crate::point::{Issue, PointPlan};
use crate::progress::{self, Counters};
use crate::record::RequestRecord;
use crate::rng::{mix, Rng};
use crate::workload::{RequestSpec, TurnKey, Workload};
use futures_util::stream::{FuturesUnordered, StreamExt};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;

/// Where a point's requests go: an OpenAI server over HTTP ([`crate::client::Client`]),
/// or the twin's simulated fleet on a virtual clock. Times are the runtime's clock.
pub trait Server {
    /// Sends one request; `origin` is the start of the sweep point.
    fn send(
        &self,
        spec: &RequestSpec,
        origin: Instant,
        scheduled_s: Option<f64>,
    ) -> impl Future<Output = RequestRecord>;
}

/// Runs a point, showing progress on stderr in `style` (none when `None`).
pub async fn run_point(
    client: &impl Server,
    workload: &Workload,
    plan: &PointPlan,
    style: Option<progress::Style>,
) -> Vec<RequestRecord> {
    let counters = Counters::default();
    let turns = Turns { workload, plan, replies: RefCell::default() };
    let work = async {
        match &plan.issue {
            Issue::Closed { concurrency } => closed(client, &turns, *concurrency, &counters).await,
            Issue::Open { arrivals } => {
                let mut rng = Rng::new(mix(&[workload.seed, plan.seed, 0xa771_7a15]));
                let mut t = 0.0;
                let times = std::iter::from_fn(move || {
                    let now = t;
                    t += arrivals.next_gap(&mut rng);
                    Some(now)
                });
                open(client, &turns, times, &counters).await
            }
            Issue::Trace { speedup } => {
                let times = workload.trace_offsets(*speedup).unwrap_or_default();
                open(client, &turns, times.into_iter(), &counters).await
            }
        }
    };
    let mut records = match style {
        Some(style) => {
            let label = plan.label.as_str();
            let r = tokio::select! {
                r = work => r,
                _ = progress::draw_forever(label, plan.bounds, &counters, style) => Vec::new(),
            };
            progress::clear(style);
            r
        }
        None => work.await,
    };
    records.sort_by_key(|r| r.index);
    records
}

/// A point's requests as they are made and answered: a multi-turn workload with
/// generated replies puts each reply into its conversation's later turns.
struct Turns<'a> {
    workload: &'a Workload,
    plan: &'a PointPlan,
    replies: RefCell<HashMap<TurnKey, Vec<u32>>>,
}

impl Turns<'_> {
    fn request(&self, i: usize) -> RequestSpec {
        let reply = |k, body: &mut Vec<u32>| self.replies.borrow().get(&k).map(|ids| body.extend(ids)).is_some();
        self.workload.request_with(self.plan.seed, i, &reply)
    }

    /// Sends `spec` and keeps its reply where a later turn will want it.
    async fn send(&self, client: &impl Server, spec: &RequestSpec, origin: Instant, at: Option<f64>) -> RequestRecord {
        let mut rec = client.send(spec, origin, at).await;
        (rec.history_replies, rec.generated_replies) = (spec.replies, spec.generated_replies);
        if let Some(key) = spec.turn {
            rec.prompt_ids = spec.prompt.ids();
            if rec.ok && !rec.reply_ids.is_empty() {
                self.replies.borrow_mut().insert(key, std::mem::take(&mut rec.reply_ids));
            }
        }
        rec
    }
}

/// `c` clients, each sending back to back, sharing one request counter. A client the
/// server sheds waits its `Retry-After` before its next request, as the OpenAI SDKs
/// do, instead of hammering it.
async fn closed(client: &impl Server, turns: &Turns<'_>, c: usize, n: &Counters) -> Vec<RequestRecord> {
    let plan = turns.plan;
    let origin = Instant::now();
    let next = Cell::new(0usize);
    let one_client = || async {
        let mut out = Vec::new();
        loop {
            let i = next.get();
            if !plan.bounds.may_issue(i, origin.elapsed().as_secs_f64()) {
                return out;
            }
            next.set(i + 1);
            let spec = turns.request(i);
            n.on_sent();
            let rec = turns.send(client, &spec, origin, None).await;
            n.on_done(rec.ok);
            let back_off = rec.shed.filter(|_| !rec.ok);
            out.push(rec);
            if let Some(after) = back_off {
                tokio::time::sleep(Duration::from_secs_f64(after.clamp(0.0, 600.0))).await;
            }
        }
    };
    futures_util::future::join_all((0..c.max(1)).map(|_| one_client())).await.into_iter().flatten().collect()
}

/// Sends request `i` at `times[i]` seconds after the start, whatever is in flight.
async fn open(
    client: &impl Server,
    turns: &Turns<'_>,
    times: impl Iterator<Item = f64>,
    n: &Counters,
) -> Vec<RequestRecord> {
    let plan = turns.plan;
    let origin = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    let mut out = Vec::new();
    for (i, at) in times.enumerate() {
        if !plan.bounds.may_issue(i, at) {
            break;
        }
        let due = origin + Duration::from_secs_f64(at);
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(due) => break,
                Some(rec) = in_flight.next(), if !in_flight.is_empty() => out.push(rec),
            }
        }
        let spec = turns.request(i);
        n.on_sent();
        in_flight.push(async move {
            let rec = turns.send(client, &spec, origin, Some(at)).await;
            n.on_done(rec.ok);
            rec
        });
    }
    while let Some(rec) = in_flight.next().await {
        out.push(rec);
    }
    out
}
