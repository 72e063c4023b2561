//! Every Prometheus metric pdserve exports, in one place: names, label keys, buckets.
//!
//! The frontend records request latencies and outcomes itself; the router and the
//! workers record phases, routes, KV transfers, block counts, prefix hits and roles
//! through the methods of a shared [`Metrics`] handle. `/metrics` serves it all in the
//! Prometheus text format 0.0.4.

use pdserve_kv::{TierCounters, TierStats};
use pdserve_kv_transfer::TransportKind;
use pdserve_protocol::WorkerStats;
use pdserve_types::{Role, SpecTotals, StageTotals};
use prometheus_client::encoding::text::encode_registry;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

// Counter names lack `_total`: the encoder appends it.
const REQUEST_TTFT: &str = "pdserve_request_ttft_seconds";
const REQUEST_TPOT: &str = "pdserve_request_tpot_seconds";
const REQUEST_ITL: &str = "pdserve_request_itl_seconds";
const REQUEST_E2E: &str = "pdserve_request_e2e_seconds";
const REQUESTS: &str = "pdserve_requests";
const PROMPT_TOKENS: &str = "pdserve_prompt_tokens";
const GENERATION_TOKENS: &str = "pdserve_generation_tokens";
const PHASE: &str = "pdserve_phase_seconds";
const PREFILL_ROUTE: &str = "pdserve_prefill_route";
const MIGRATED: &str = "pdserve_requests_migrated";
const KV_TRANSFER_BYTES: &str = "pdserve_kv_transfer_bytes";
const KV_BLOCKS: &str = "pdserve_kv_blocks";
const KV_TIER_BLOCKS: &str = "pdserve_kv_tier_blocks";
const KV_TIER_RESTORE_SECONDS: &str = "pdserve_kv_tier_restore_seconds";
const PREFIX_HIT_TOKENS: &str = "pdserve_prefix_hit_tokens";
const PREFIX_HIT_MISMATCH: &str = "pdserve_prefix_hit_mismatch";
const PREFIX_HIT_DIFFERENCE: &str = "pdserve_prefix_hit_difference_tokens";
const KV_FETCHES: &str = "pdserve_kv_fetches";
const KV_FETCHED_TOKENS: &str = "pdserve_kv_fetched_tokens";
const KV_FETCH_SECONDS: &str = "pdserve_kv_fetch_seconds";
const KV_INDEX_LAG: &str = "pdserve_kv_index_lag_seconds";
const KV_INDEX_RESYNCS: &str = "pdserve_kv_index_resyncs";
const KV_INDEX_PUSHED: &str = "pdserve_kv_index_pushed_events";
const KV_INDEX_BLOCKS: &str = "pdserve_kv_index_blocks";
const WORKER_ROLE: &str = "pdserve_worker_role";
const PLANNER_DECISIONS: &str = "pdserve_planner_decisions";
const WORKER_UP: &str = "pdserve_worker_up";
const LINK_BYTES_PER_SECOND: &str = "pdserve_link_bytes_per_second";
const LINK_ROUND_TRIP: &str = "pdserve_link_round_trip_seconds";
const PAUSED: &str = "pdserve_paused_requests";
const WORKER_REQUESTS: &str = "pdserve_worker_requests";
const WORKER_QUEUED_PROMPT_TOKENS: &str = "pdserve_worker_queued_prompt_tokens";
const CONSTRAINED: &str = "pdserve_constrained_requests";
const GRAMMAR_MASKS: &str = "pdserve_grammar_masks";
const GRAMMAR_MASK_SECONDS: &str = "pdserve_grammar_mask_seconds";
const SPEC_DRAFT_TOKENS: &str = "pdserve_spec_draft_tokens";
const SPEC_ACCEPTED_TOKENS: &str = "pdserve_spec_accepted_tokens";
const SPEC_DRAFT_PROMPT_TOKENS: &str = "pdserve_spec_draft_prompt_tokens";
const SPEC_MEAN_ACCEPTED: &str = "pdserve_spec_mean_accepted_length";
const SPEC_DRAFTING_SHARE: &str = "pdserve_spec_drafting_share";
const STAGE_STEPS: &str = "pdserve_stage_steps";
const STAGE_PIPELINED: &str = "pdserve_stage_pipelined_steps";
const STAGE_LANES: &str = "pdserve_stage_lane_steps";
const STAGE_KV_PARTS: &str = "pdserve_stage_kv_parts";
const STAGE_KV_RELAYED: &str = "pdserve_stage_kv_relayed_layers";
const STAGE_KV_DIRECT: &str = "pdserve_stage_kv_direct";
const STAGE_KV_WRITTEN: &str = "pdserve_stage_kv_written_frames";
const STAGE_ROWS: &str = "pdserve_stage_rows";
const STAGE_BYTES: &str = "pdserve_stage_activation_bytes";
const STAGE_SECONDS: &str = "pdserve_stage_seconds";
const STAGE_COMPUTE_SECONDS: &str = "pdserve_stage_compute_seconds";
const STAGE_LINK_SECONDS: &str = "pdserve_stage_link_seconds";
const STAGE_BYTES_PER_TOKEN: &str = "pdserve_stage_activation_bytes_per_token";

/// The content type `/metrics` answers with.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

type Label1 = [(&'static str, String); 1];
type Label2 = [(&'static str, String); 2];
type Label3 = [(&'static str, String); 3];
type Histograms = Family<Label1, Histogram, fn() -> Histogram>;

/// 0.5 ms to ~65 s: token gaps through whole requests.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

/// How a request ended, for `pdserve_requests_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// The client went away before the end.
    Cancelled,
    /// Accepted, then failed.
    Error,
    /// Refused before generation: invalid input or admission.
    Rejected,
    /// Refused at the door: no API key, or a wrong one.
    Unauthorized,
}

pub use pdserve_protocol::{Phase, PrefillRoute};

/// Which prefix-cache figure, for `pdserve_prefix_hit_tokens_total{kind}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixHit {
    /// What the router's KV index predicted on the worker it chose.
    Predicted,
    /// What the worker actually found in its cache (the usage's `cached_tokens`).
    Realized,
}

/// Realized minus predicted cached tokens: ±16 up to ±8192.
fn difference_histogram() -> Histogram {
    let up: Vec<f64> = exponential_buckets(16.0, 2.0, 10).collect();
    let down = up.iter().rev().map(|b| -b);
    Histogram::new(down.chain([0.0]).chain(up.iter().copied()))
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Cancelled => "cancelled",
            Outcome::Error => "error",
            Outcome::Rejected => "rejected",
            Outcome::Unauthorized => "unauthorized",
        }
    }
}

/// The `phase` label value.
fn phase_label(phase: Phase) -> &'static str {
    match phase {
        Phase::QueuePrefill => "queue_prefill",
        Phase::Prefill => "prefill",
        Phase::KvTransfer => "kv_transfer",
        Phase::QueueDecode => "queue_decode",
        Phase::Decode => "decode",
    }
}

/// The shared metrics handle: cheap to clone, safe to record into from any thread.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    ttft: Histograms,
    tpot: Histograms,
    itl: Histograms,
    e2e: Histograms,
    requests: Family<Label1, Counter>,
    prompt_tokens: Family<Label2, Counter>,
    generation_tokens: Family<Label2, Counter>,
    phase: Histograms,
    prefill_route: Family<Label1, Counter>,
    migrated: Family<Label1, Counter>,
    kv_transfer_bytes: Family<Label1, Counter>,
    kv_blocks: Family<Label3, Gauge>,
    kv_tier_blocks: Family<Label3, Counter>,
    kv_tier_restore_seconds: Family<Label2, Counter<f64, AtomicU64>>,
    prefix_hit_tokens: Family<Label1, Counter>,
    prefix_hit_mismatch: Family<Label1, Counter>,
    prefix_hit_difference: Histogram,
    kv_fetches: Family<Label1, Counter>,
    kv_fetched_tokens: Counter,
    kv_fetch_seconds: Histogram,
    kv_index_lag: Histogram,
    kv_index_resyncs: Counter,
    kv_index_pushed: Counter,
    kv_index_blocks: Gauge,
    worker_role: Family<Label2, Gauge>,
    planner_decisions: Family<Label3, Counter>,
    worker_up: Family<Label1, Gauge>,
    link_bytes_per_second: Family<Label2, Gauge<f64, AtomicU64>>,
    link_round_trip: Family<Label2, Gauge<f64, AtomicU64>>,
    paused: Family<Label1, Gauge>,
    worker_requests: Family<Label2, Gauge>,
    worker_queued_prompt_tokens: Family<Label1, Gauge>,
    constrained: Family<Label1, Counter>,
    grammar_masks: Family<Label1, Counter>,
    grammar_mask_seconds: Family<Label1, Counter<f64, AtomicU64>>,
    spec_draft_tokens: Family<Label1, Counter>,
    spec_accepted_tokens: Family<Label1, Counter>,
    spec_draft_prompt_tokens: Family<Label1, Counter>,
    spec_mean_accepted: Family<Label1, Gauge<f64, AtomicU64>>,
    spec_drafting_share: Family<Label1, Gauge<f64, AtomicU64>>,
    stage_steps: Family<Label1, Counter>,
    stage_pipelined: Family<Label1, Counter>,
    stage_lanes: Family<Label1, Counter>,
    stage_kv_parts: Family<Label1, Counter>,
    stage_kv_relayed: Family<Label1, Counter>,
    stage_kv_direct: Family<Label1, Counter>,
    stage_kv_written: Family<Label1, Counter>,
    stage_rows: Family<Label1, Counter>,
    stage_bytes: Family<Label1, Counter>,
    stage_seconds: Family<Label1, Counter<f64, AtomicU64>>,
    stage_compute_seconds: Family<Label2, Counter<f64, AtomicU64>>,
    stage_link_seconds: Family<Label1, Counter<f64, AtomicU64>>,
    stage_bytes_per_token: Family<Label1, Gauge<f64, AtomicU64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// A fresh registry holding every pdserve metric.
    pub fn new() -> Self {
        let histograms = || Histograms::new_with_constructor(latency_histogram);
        let inner = Inner {
            registry: Registry::default(),
            ttft: histograms(),
            tpot: histograms(),
            itl: histograms(),
            e2e: histograms(),
            requests: Family::default(),
            prompt_tokens: Family::default(),
            generation_tokens: Family::default(),
            phase: histograms(),
            prefill_route: Family::default(),
            migrated: Family::default(),
            kv_transfer_bytes: Family::default(),
            kv_blocks: Family::default(),
            kv_tier_blocks: Family::default(),
            kv_tier_restore_seconds: Family::default(),
            prefix_hit_tokens: Family::default(),
            prefix_hit_mismatch: Family::default(),
            prefix_hit_difference: difference_histogram(),
            kv_fetches: Family::default(),
            kv_fetched_tokens: Counter::default(),
            kv_fetch_seconds: latency_histogram(),
            kv_index_lag: latency_histogram(),
            kv_index_resyncs: Counter::default(),
            kv_index_pushed: Counter::default(),
            kv_index_blocks: Gauge::default(),
            worker_role: Family::default(),
            planner_decisions: Family::default(),
            worker_up: Family::default(),
            link_bytes_per_second: Family::default(),
            link_round_trip: Family::default(),
            paused: Family::default(),
            worker_requests: Family::default(),
            worker_queued_prompt_tokens: Family::default(),
            constrained: Family::default(),
            grammar_masks: Family::default(),
            grammar_mask_seconds: Family::default(),
            spec_draft_tokens: Family::default(),
            spec_accepted_tokens: Family::default(),
            spec_draft_prompt_tokens: Family::default(),
            spec_mean_accepted: Family::default(),
            spec_drafting_share: Family::default(),
            stage_steps: Family::default(),
            stage_pipelined: Family::default(),
            stage_lanes: Family::default(),
            stage_kv_parts: Family::default(),
            stage_kv_relayed: Family::default(),
            stage_kv_direct: Family::default(),
            stage_kv_written: Family::default(),
            stage_rows: Family::default(),
            stage_bytes: Family::default(),
            stage_seconds: Family::default(),
            stage_compute_seconds: Family::default(),
            stage_link_seconds: Family::default(),
            stage_bytes_per_token: Family::default(),
        };
        Metrics { inner: Arc::new(inner.registered()) }
    }

    /// Time from the request's arrival to its first token.
    pub fn ttft(&self, mode: &str, seconds: f64) {
        self.inner.ttft.get_or_create(&[("mode", mode.into())]).observe(seconds);
    }

    /// Mean time per output token after the first.
    pub fn tpot(&self, mode: &str, seconds: f64) {
        self.inner.tpot.get_or_create(&[("mode", mode.into())]).observe(seconds);
    }

    /// One gap between consecutive tokens of a request.
    pub fn itl(&self, mode: &str, seconds: f64) {
        self.inner.itl.get_or_create(&[("mode", mode.into())]).observe(seconds);
    }

    /// Time from the request's arrival to its last token.
    pub fn e2e(&self, mode: &str, seconds: f64) {
        self.inner.e2e.get_or_create(&[("mode", mode.into())]).observe(seconds);
    }

    /// Counts one finished request.
    pub fn outcome(&self, outcome: Outcome) {
        self.inner.requests.get_or_create(&[("outcome", outcome.as_str().into())]).inc();
    }

    /// One request's tokens, as vLLM counts them: its prompt on the worker that
    /// prefilled it, its output on the worker that decoded it.
    pub fn tokens(&self, model: &str, prefill: (&str, usize), generation: (&str, usize)) {
        let label = |worker: &str| [("model", model.into()), ("worker", worker.into())];
        self.inner.prompt_tokens.get_or_create(&label(prefill.0)).inc_by(prefill.1 as u64);
        self.inner.generation_tokens.get_or_create(&label(generation.0)).inc_by(generation.1 as u64);
    }

    /// The KV link from worker `from` to worker `to`, as the fleet's probe last
    /// measured it.
    pub fn set_link(&self, from: &str, to: &str, bytes_per_s: f64, round_trip_s: f64) {
        let label = [("from", from.into()), ("to", to.into())];
        self.inner.link_bytes_per_second.get_or_create(&label).set(bytes_per_s);
        self.inner.link_round_trip.get_or_create(&label).set(round_trip_s);
    }

    /// Time a request spent in one phase.
    pub fn phase(&self, phase: Phase, seconds: f64) {
        self.inner.phase.get_or_create(&[("phase", phase_label(phase).into())]).observe(seconds);
    }

    /// Counts one routing decision for a prefill.
    pub fn route(&self, route: PrefillRoute) {
        let label = match route {
            PrefillRoute::Local => "local",
            PrefillRoute::Remote => "remote",
        };
        self.inner.prefill_route.get_or_create(&[("where", label.into())]).inc();
    }

    /// Counts one request moved to another worker mid-flight.
    pub fn migrated(&self, reason: &str) {
        self.inner.migrated.get_or_create(&[("reason", reason.into())]).inc();
    }

    /// Adds KV bytes moved over `transport`.
    pub fn kv_transfer_bytes(&self, transport: TransportKind, bytes: u64) {
        self.inner.kv_transfer_bytes.get_or_create(&[("transport", transport.label().into())]).inc_by(bytes);
    }

    /// A worker's block counts, its requests waiting and running, its prompt tokens
    /// not yet prefilled, and its paused requests, as it last reported them.
    pub fn set_worker_stats(&self, worker: &str, s: &WorkerStats) {
        for (state, tier, n) in block_series(s) {
            let labels = [("worker", worker.into()), ("state", state.into()), ("tier", tier.into())];
            self.inner.kv_blocks.get_or_create(&labels).set(gauge(n));
        }
        self.set_tier_counters(worker, &s.tiers);
        self.inner.paused.get_or_create(&[("worker", worker.into())]).set(gauge(s.paused));
        for (state, n) in [("waiting", s.waiting), ("running", s.running)] {
            self.inner
                .worker_requests
                .get_or_create(&[("worker", worker.into()), ("state", state.into())])
                .set(gauge(n));
        }
        let queued = self.inner.worker_queued_prompt_tokens.get_or_create(&[("worker", worker.into())]);
        queued.set(gauge(s.queued_prompt_tokens));
        // The worker reports totals since it started; the counters take the growth.
        let label = [("worker", worker.into())];
        let masks = self.inner.grammar_masks.get_or_create(&label);
        masks.inc_by(s.grammar_masks.saturating_sub(masks.get()));
        let secs = self.inner.grammar_mask_seconds.get_or_create(&label);
        secs.inc_by((s.grammar_mask_ns as f64 * 1e-9 - secs.get()).max(0.0));
        self.set_spec(&label, &s.spec);
        self.set_stages(&label, &s.stages);
    }

    /// A stage group head's totals: steps, rows and activation bytes through its
    /// later stages, and the time it waited on them.
    fn set_stages(&self, label: &Label1, t: &StageTotals) {
        if t.steps == 0 {
            return;
        }
        let i = &self.inner;
        for (family, n) in [
            (&i.stage_steps, t.steps),
            (&i.stage_pipelined, t.pipelined),
            (&i.stage_lanes, t.lanes),
            (&i.stage_kv_parts, t.kv_parts),
            (&i.stage_kv_relayed, t.kv_relayed_layers),
            (&i.stage_kv_direct, t.kv_direct),
            (&i.stage_kv_written, t.kv_written_frames),
            (&i.stage_rows, t.rows),
            (&i.stage_bytes, t.bytes),
        ] {
            let c = family.get_or_create(label);
            c.inc_by(n.saturating_sub(c.get()));
        }
        let grow = |c: &Counter<f64, AtomicU64>, total: f64| c.inc_by((total - c.get()).max(0.0));
        grow(&self.inner.stage_seconds.get_or_create(label), t.seconds);
        grow(&self.inner.stage_link_seconds.get_or_create(label), t.link);
        for c in &t.compute {
            let by = [label[0].clone(), ("layers", format!("{}..{}", c.first, c.last))];
            grow(&self.inner.stage_compute_seconds.get_or_create(&by), c.seconds);
        }
        let per_token = t.bytes as f64 / t.rows.max(1) as f64;
        self.inner.stage_bytes_per_token.get_or_create(label).set(per_token);
    }

    /// A worker's speculation totals: drafted and accepted tokens, and the tokens a
    /// verified draft kept on average.
    fn set_spec(&self, label: &Label1, t: &SpecTotals) {
        if t.draft_prompt_tokens > 0 {
            let prompt = self.inner.spec_draft_prompt_tokens.get_or_create(label);
            prompt.inc_by(t.draft_prompt_tokens.saturating_sub(prompt.get()));
        }
        if t.verified_steps == 0 {
            return;
        }
        let drafted = self.inner.spec_draft_tokens.get_or_create(label);
        drafted.inc_by(t.drafted.saturating_sub(drafted.get()));
        let accepted = self.inner.spec_accepted_tokens.get_or_create(label);
        accepted.inc_by(t.accepted.saturating_sub(accepted.get()));
        self.inner.spec_mean_accepted.get_or_create(label).set(t.accepted as f64 / t.verified_steps as f64);
        if t.decodes > 0 {
            self.inner.spec_drafting_share.get_or_create(label).set(t.verified_steps as f64 / t.decodes as f64);
        }
    }

    /// A worker's tier counters (totals since it started) into the counters.
    fn set_tier_counters(&self, worker: &str, t: &TierCounters) {
        let moved = [
            ("host", "stored", t.stored_host),
            ("disk", "stored", t.stored_disk),
            ("host", "restored", t.restored_host),
            ("disk", "restored", t.restored_disk),
            // Blocks the disk tier lost: a write that failed (a full disk), a read
            // back that failed its checksum.
            ("disk", "write_failed", t.disk_write_failures),
            ("disk", "corrupt", t.disk_corrupt),
        ];
        for (tier, direction, n) in moved.into_iter().filter(|m| m.2 > 0) {
            let labels = [("worker", worker.into()), ("tier", tier.into()), ("direction", direction.into())];
            let c = self.inner.kv_tier_blocks.get_or_create(&labels);
            c.inc_by(n.saturating_sub(c.get()));
        }
        let seconds = [("host", t.restore_seconds_host), ("disk", t.restore_seconds_disk)];
        for (tier, secs) in seconds.into_iter().filter(|s| s.1 > 0.0) {
            let c =
                self.inner.kv_tier_restore_seconds.get_or_create(&[("worker", worker.into()), ("tier", tier.into())]);
            c.inc_by((secs - c.get()).max(0.0));
        }
    }

    /// A request whose output follows a grammar was accepted; `field` is the request
    /// field that asked (`response_format`, `guided_json`, `tools`, ...).
    pub fn constrained(&self, field: &'static str) {
        self.inner.constrained.get_or_create(&[("field", field.into())]).inc();
    }

    /// 1 while `worker` answers (its connection is up and it answers pings), else 0.
    pub fn set_worker_up(&self, worker: &str, up: bool) {
        self.inner.worker_up.get_or_create(&[("worker", worker.into())]).set(i64::from(up));
    }

    /// Drops every block and role series of a worker that left, so none keeps its last
    /// value (its `pdserve_worker_up` stays, at 0).
    pub fn forget_worker(&self, worker: &str) {
        self.set_worker_up(worker, false);
        self.forget_stats(worker);
        self.forget_role(worker);
    }

    /// Drops a worker's role series.
    pub fn forget_role(&self, worker: &str) {
        for r in [Role::Prefill, Role::Decode, Role::Mixed] {
            self.inner.worker_role.remove(&[("worker", worker.into()), ("role", r.to_string())]);
        }
    }

    /// Drops a worker's reported figures (it did not answer for them: none stale).
    pub fn forget_stats(&self, worker: &str) {
        for (state, tier, _) in block_series(&WorkerStats::default()) {
            self.inner.kv_blocks.remove(&[("worker", worker.into()), ("state", state.into()), ("tier", tier.into())]);
        }
        self.inner.paused.remove(&[("worker", worker.into())]);
        for state in ["waiting", "running"] {
            self.inner.worker_requests.remove(&[("worker", worker.into()), ("state", state.into())]);
        }
        self.inner.worker_queued_prompt_tokens.remove(&[("worker", worker.into())]);
    }

    /// Adds prompt tokens found in a prefix cache.
    pub fn prefix_hit(&self, kind: PrefixHit, tokens: u64) {
        let label = match kind {
            PrefixHit::Predicted => "predicted",
            PrefixHit::Realized => "realized",
        };
        self.inner.prefix_hit_tokens.get_or_create(&[("kind", label.into())]).inc_by(tokens);
    }

    /// Marks `worker`'s current role: 1 for it, 0 for the others.
    pub fn set_role(&self, worker: &str, role: Role) {
        for r in [Role::Prefill, Role::Decode, Role::Mixed] {
            let labels = [("worker", worker.into()), ("role", r.to_string())];
            self.inner.worker_role.get_or_create(&labels).set(i64::from(r == role));
        }
    }

    /// Everything in the Prometheus text format 0.0.4.
    pub fn render(&self) -> String {
        let mut open_metrics = String::new();
        // Writing into a String cannot fail; a failure would only truncate the page.
        let _ = encode_registry(&mut open_metrics, &self.inner.registry);
        to_prometheus_text(&open_metrics)
    }
}

/// Every `pdserve_kv_blocks` series of a worker: (state, tier, blocks). The lower
/// tiers hold only reusable blocks, so their states are `cached` and `free`; `used`
/// (blocks held by sequences) exists only in the pool.
fn block_series(s: &WorkerStats) -> [(&'static str, &'static str, usize); 7] {
    let (b, free) = (s.blocks, |t: TierStats| t.capacity.saturating_sub(t.used));
    [
        ("free", "device", b.free),
        ("used", "device", b.used),
        ("cached", "device", b.cached),
        ("cached", "host", b.host.used),
        ("free", "host", free(b.host)),
        ("cached", "disk", b.disk.used),
        ("free", "disk", free(b.disk)),
    ]
}

impl Inner {
    /// The request's own metrics: latencies, outcomes, tokens.
    fn register_requests(&mut self) {
        let r = &mut self.registry;
        r.register(REQUEST_TTFT, "Time to first token", self.ttft.clone());
        r.register(REQUEST_TPOT, "Mean time per output token after the first", self.tpot.clone());
        r.register(REQUEST_ITL, "Gap between consecutive output tokens", self.itl.clone());
        r.register(REQUEST_E2E, "Request latency, arrival to last token", self.e2e.clone());
        r.register(REQUESTS, "Finished requests by outcome", self.requests.clone());
        let help = "Prompt tokens of requests, by model and the worker that prefilled them";
        r.register(PROMPT_TOKENS, help, self.prompt_tokens.clone());
        let help = "Tokens generated, by model and the worker that decoded them";
        r.register(GENERATION_TOKENS, help, self.generation_tokens.clone());
    }

    /// What workers total since they started: speculation and stage groups.
    fn register_engine_totals(&mut self) {
        let r = &mut self.registry;
        r.register(SPEC_DRAFT_TOKENS, "Drafted tokens each worker verified", self.spec_draft_tokens.clone());
        r.register(SPEC_ACCEPTED_TOKENS, "Drafted tokens each worker accepted", self.spec_accepted_tokens.clone());
        let help = "Prompt tokens each worker's draft model computed (none where the draft K/V came with the target's)";
        r.register(SPEC_DRAFT_PROMPT_TOKENS, help, self.spec_draft_prompt_tokens.clone());
        let help = "Drafted tokens a verified draft kept, on average, per worker";
        r.register(SPEC_MEAN_ACCEPTED, help, self.spec_mean_accepted.clone());
        let help = "Share of each worker's decode steps (per request) that verified a draft";
        r.register(SPEC_DRAFTING_SHARE, help, self.spec_drafting_share.clone());
        let help = "Steps a stage group's head sent through its later stages";
        r.register(STAGE_STEPS, help, self.stage_steps.clone());
        let help = "Steps of a stage group's head that went through its stages in micro-batches, one behind another";
        r.register(STAGE_PIPELINED, help, self.stage_pipelined.clone());
        let help = "Steps of a stage group's head that were one lane of its decodes, sent on while another lane was in its later stages";
        r.register(STAGE_LANES, help, self.stage_lanes.clone());
        let help =
            "Parts of K/V handoffs a stage group's later stage sent to the receiver itself (its own layers, one link)";
        r.register(STAGE_KV_PARTS, help, self.stage_kv_parts.clone());
        let help = "Layers of K/V a stage group's head read from a later stage and sent on itself (a part that could not reach its receiver)";
        r.register(STAGE_KV_RELAYED, help, self.stage_kv_relayed.clone());
        let help = "Handoffs into a stage group whose later stages each took their own layers straight from the sender";
        r.register(STAGE_KV_DIRECT, help, self.stage_kv_direct.clone());
        let help = "Frames of K/V a stage group's head received for its later stages' layers and wrote on to them";
        r.register(STAGE_KV_WRITTEN, help, self.stage_kv_written.clone());
        let help = "Rows (tokens computed) of those steps: activation bytes over rows is the bytes per token";
        r.register(STAGE_ROWS, help, self.stage_rows.clone());
        let help = "Bytes of residual stream and logits between a stage group's head and its later stages";
        r.register(STAGE_BYTES, help, self.stage_bytes.clone());
        let help = "Time a stage group's head waited on its later stages (their compute and the links)";
        r.register(STAGE_SECONDS, help, self.stage_seconds.clone());
        let help = "Time each stage of a group computed its layers on the head's steps (over steps: its step time)";
        r.register(STAGE_COMPUTE_SECONDS, help, self.stage_compute_seconds.clone());
        let help = "On steps sent whole, the time a stage group's head waited beyond its later stages' compute: the hops both ways";
        r.register(STAGE_LINK_SECONDS, help, self.stage_link_seconds.clone());
        let help = "Activation bytes per token computed, both ways over every hop of a stage group";
        r.register(STAGE_BYTES_PER_TOKEN, help, self.stage_bytes_per_token.clone());
    }

    fn registered(mut self) -> Self {
        self.register_requests();
        let r = &mut self.registry;
        r.register(PHASE, "Time spent per request phase", self.phase.clone());
        r.register(PREFILL_ROUTE, "Prefills by where they ran", self.prefill_route.clone());
        r.register(MIGRATED, "Requests moved to another worker mid-flight, by reason", self.migrated.clone());
        r.register(KV_TRANSFER_BYTES, "KV cache bytes moved between workers", self.kv_transfer_bytes.clone());
        r.register(KV_BLOCKS, "KV cache blocks per worker, state and tier", self.kv_blocks.clone());
        let help = "KV blocks copied down into a lower tier (stored) or back into the pool (restored), or lost by the disk tier (write_failed, corrupt)";
        r.register(KV_TIER_BLOCKS, help, self.kv_tier_blocks.clone());
        let help = "Seconds spent copying KV blocks back into the pool from a lower tier";
        r.register(KV_TIER_RESTORE_SECONDS, help, self.kv_tier_restore_seconds.clone());
        r.register(PREFIX_HIT_TOKENS, "Prompt tokens found in a prefix cache", self.prefix_hit_tokens.clone());
        let help = "Requests whose realized prefix-cache hit differed from the router's prediction, by cause";
        r.register(PREFIX_HIT_MISMATCH, help, self.prefix_hit_mismatch.clone());
        let help = "Realized minus predicted cached prompt tokens per request";
        r.register(PREFIX_HIT_DIFFERENCE, help, self.prefix_hit_difference.clone());
        let help = "Prefix fetches from a peer's cache, by outcome (fetched, or why it fell back to recomputing)";
        r.register(KV_FETCHES, help, self.kv_fetches.clone());
        let help = "Prompt tokens whose KV was fetched from a peer's cache instead of computed";
        r.register(KV_FETCHED_TOKENS, help, self.kv_fetched_tokens.clone());
        let help = "Time to fetch a prefix from a peer, reservation to last frame";
        r.register(KV_FETCH_SECONDS, help, self.kv_fetch_seconds.clone());
        let help = "Age of a worker's KV event when the router's index applied it";
        r.register(KV_INDEX_LAG, help, self.kv_index_lag.clone());
        let help = "Times the router's KV index rebuilt a worker from a snapshot";
        r.register(KV_INDEX_RESYNCS, help, self.kv_index_resyncs.clone());
        let help = "KV events the router's index took as their workers pushed them (over NATS), not polled";
        r.register(KV_INDEX_PUSHED, help, self.kv_index_pushed.clone());
        r.register(KV_INDEX_BLOCKS, "Distinct KV blocks in the router's index", self.kv_index_blocks.clone());
        r.register(WORKER_ROLE, "1 for each worker's current role", self.worker_role.clone());
        let decisions = "Role switches the planner made, by the role vector before and after and why";
        r.register(PLANNER_DECISIONS, decisions, self.planner_decisions.clone());
        r.register(WORKER_UP, "1 while the worker answers, 0 once it is lost", self.worker_up.clone());
        let help = "Payload rate of the KV link between two workers, as the fleet's probe last measured it";
        r.register(LINK_BYTES_PER_SECOND, help, self.link_bytes_per_second.clone());
        let help = "A one-frame handoff's round trip on the KV link between two workers, as last probed";
        r.register(LINK_ROUND_TRIP, help, self.link_round_trip.clone());
        r.register(PAUSED, "Requests paused because their clients stopped reading", self.paused.clone());
        let help = "Requests on each worker's engine, waiting to start and running, as it last reported";
        r.register(WORKER_REQUESTS, help, self.worker_requests.clone());
        let help = "Prompt tokens each worker has been sent and not yet prefilled, as it last reported";
        r.register(WORKER_QUEUED_PROMPT_TOKENS, help, self.worker_queued_prompt_tokens.clone());
        r.register(
            CONSTRAINED,
            "Requests whose output follows a grammar, by the field that asked",
            self.constrained.clone(),
        );
        r.register(GRAMMAR_MASKS, "Token masks computed for constrained requests", self.grammar_masks.clone());
        let mask_seconds = self.grammar_mask_seconds.clone();
        r.register(GRAMMAR_MASK_SECONDS, "Time spent computing token masks", mask_seconds);
        self.register_engine_totals();
        self
    }
}

/// prometheus-client writes OpenMetrics, whose counter families are named without
/// `_total` and which ends with `# EOF`. The 0.0.4 format names the family like its
/// samples, so the HELP and TYPE lines of counters get the suffix back.
fn to_prometheus_text(open_metrics: &str) -> String {
    let counters: Vec<&str> =
        open_metrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(open_metrics.len() + 64);
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        out.push_str(&rename_counter(line, &counters).unwrap_or_else(|| line.to_string()));
        out.push('\n');
    }
    out
}

/// `# HELP name ...` / `# TYPE name counter` of a counter, with `name_total`.
fn rename_counter(line: &str, counters: &[&str]) -> Option<String> {
    let (tag, rest) =
        line.strip_prefix("# HELP ").map(|r| ("HELP", r)).or(line.strip_prefix("# TYPE ").map(|r| ("TYPE", r)))?;
    let (name, tail) = rest.split_once(' ')?;
    counters.contains(&name).then(|| format!("# {tag} {name}_total {tail}"))
}

impl pdserve_protocol::Telemetry for Metrics {
    fn phase(&self, phase: Phase, seconds: f64) {
        Metrics::phase(self, phase, seconds)
    }

    fn route(&self, route: PrefillRoute) {
        Metrics::route(self, route)
    }

    fn kv_transfer_bytes(&self, transport: TransportKind, bytes: u64) {
        Metrics::kv_transfer_bytes(self, transport, bytes)
    }

    fn migrated(&self, reason: &'static str) {
        Metrics::migrated(self, reason)
    }

    fn role(&self, worker: &str, role: pdserve_types::Role) {
        self.set_role(worker, role)
    }

    fn role_gone(&self, worker: &str) {
        self.forget_role(worker)
    }

    fn planned(&self, from: &str, to: &str, reason: &'static str) {
        let labels = [("from", from.into()), ("to", to.into()), ("reason", reason.into())];
        self.inner.planner_decisions.get_or_create(&labels).inc();
    }

    fn kv_index(&self, lags: &[f64], resyncs: usize, blocks: usize) {
        for &lag in lags {
            self.inner.kv_index_lag.observe(lag);
        }
        self.inner.kv_index_resyncs.inc_by(resyncs as u64);
        self.inner.kv_index_blocks.set(gauge(blocks));
    }

    fn kv_events_pushed(&self, events: usize) {
        self.inner.kv_index_pushed.inc_by(events as u64);
    }

    fn prefix_hit(&self, predicted: usize, realized: usize, cause: Option<&'static str>) {
        Metrics::prefix_hit(self, PrefixHit::Predicted, predicted as u64);
        self.inner.prefix_hit_difference.observe(realized as f64 - predicted as f64);
        if let Some(cause) = cause {
            self.inner.prefix_hit_mismatch.get_or_create(&[("cause", cause.into())]).inc();
        }
    }

    fn prefix_fetched(&self, tokens: usize, seconds: f64, fell_back: Option<&'static str>) {
        let outcome = fell_back.unwrap_or("fetched");
        self.inner.kv_fetches.get_or_create(&[("outcome", outcome.into())]).inc();
        if fell_back.is_none() {
            self.inner.kv_fetched_tokens.inc_by(tokens as u64);
            self.inner.kv_fetch_seconds.observe(seconds);
        }
    }
}

/// A count as a gauge's value.
fn gauge(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_types::{PoolStats, StageCompute};

    #[test]
    fn counters_keep_their_total_suffix() {
        let m = Metrics::new();
        m.outcome(Outcome::Ok);
        m.kv_transfer_bytes(TransportKind::Tcp, 42);
        let text = m.render();
        assert!(text.contains("# TYPE pdserve_requests_total counter\n"), "{text}");
        assert!(text.contains("pdserve_requests_total{outcome=\"ok\"} 1\n"), "{text}");
        assert!(text.contains("pdserve_kv_transfer_bytes_total{transport=\"tcp\"} 42\n"), "{text}");
        assert!(!text.contains("# EOF"));
    }

    #[test]
    fn tokens_count_by_model_and_the_worker_that_ran_each_phase() {
        let m = Metrics::new();
        m.tokens("smol", ("p0", 100), ("d1", 7));
        m.tokens("smol", ("d1", 20), ("d1", 3));
        let text = m.render();
        for line in [
            "pdserve_prompt_tokens_total{model=\"smol\",worker=\"p0\"} 100\n",
            "pdserve_prompt_tokens_total{model=\"smol\",worker=\"d1\"} 20\n",
            "pdserve_generation_tokens_total{model=\"smol\",worker=\"d1\"} 10\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
    }

    #[test]
    fn speculation_totals_become_counters_and_a_mean() {
        let m = Metrics::new();
        m.set_worker_stats("w0", &WorkerStats::default());
        assert!(!m.render().contains("pdserve_spec_draft_tokens_total{"), "no series before a draft is verified");
        for (drafted, accepted, verified_steps) in [(10, 4, 5), (30, 18, 12)] {
            let spec = SpecTotals { drafted, accepted, verified_steps, decodes: 48, draft_prompt_tokens: 7 };
            m.set_worker_stats("w0", &WorkerStats { spec, ..Default::default() });
        }
        let text = m.render();
        assert!(text.contains("pdserve_spec_draft_tokens_total{worker=\"w0\"} 30\n"), "{text}");
        assert!(text.contains("pdserve_spec_accepted_tokens_total{worker=\"w0\"} 18\n"), "{text}");
        assert!(text.contains("pdserve_spec_mean_accepted_length{worker=\"w0\"} 1.5\n"), "{text}");
        assert!(text.contains("pdserve_spec_drafting_share{worker=\"w0\"} 0.25\n"), "{text}");
        assert!(text.contains("pdserve_spec_draft_prompt_tokens_total{worker=\"w0\"} 7\n"), "{text}");
    }

    #[test]
    fn a_stage_heads_totals_become_counters() {
        let m = Metrics::new();
        m.set_worker_stats("h", &WorkerStats::default());
        assert!(!m.render().contains("pdserve_stage_steps_total{"), "no series for a worker that heads no group");
        for (steps, rows, bytes, seconds) in [(4, 10, 1000, 0.5), (9, 20, 3000, 1.25)] {
            let compute = vec![
                StageCompute { first: 0, last: 9, seconds: seconds / 4.0 },
                StageCompute { first: 10, last: 29, seconds: seconds / 2.0 },
            ];
            let link = seconds / 2.0;
            let (pipelined, lanes, kv_parts, kv_relayed_layers) = (steps / 2, steps / 3, steps * 2, steps + 1);
            let (kv_direct, kv_written_frames) = (steps * 3, steps + 2);
            let stages = StageTotals {
                steps,
                rows,
                bytes,
                seconds,
                compute,
                link,
                pipelined,
                lanes,
                kv_parts,
                kv_relayed_layers,
                kv_direct,
                kv_written_frames,
            };
            m.set_worker_stats("h", &WorkerStats { stages, ..Default::default() });
        }
        let text = m.render();
        for line in [
            "pdserve_stage_steps_total{worker=\"h\"} 9\n",
            "pdserve_stage_pipelined_steps_total{worker=\"h\"} 4\n",
            "pdserve_stage_lane_steps_total{worker=\"h\"} 3\n",
            "pdserve_stage_kv_parts_total{worker=\"h\"} 18\n",
            "pdserve_stage_kv_relayed_layers_total{worker=\"h\"} 10\n",
            "pdserve_stage_kv_direct_total{worker=\"h\"} 27\n",
            "pdserve_stage_kv_written_frames_total{worker=\"h\"} 11\n",
            "pdserve_stage_rows_total{worker=\"h\"} 20\n",
            "pdserve_stage_activation_bytes_total{worker=\"h\"} 3000\n",
            "pdserve_stage_seconds_total{worker=\"h\"} 1.25\n",
            "pdserve_stage_compute_seconds_total{worker=\"h\",layers=\"0..9\"} 0.3125\n",
            "pdserve_stage_compute_seconds_total{worker=\"h\",layers=\"10..29\"} 0.625\n",
            "pdserve_stage_link_seconds_total{worker=\"h\"} 0.625\n",
            "pdserve_stage_activation_bytes_per_token{worker=\"h\"} 150.0\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
    }

    #[test]
    fn roles_and_blocks_are_gauges() {
        let m = Metrics::new();
        m.set_role("w0", Role::Decode);
        let blocks = PoolStats { free: 10, used: 2, cached: 3, ..Default::default() };
        let stats =
            WorkerStats { paused: 1, waiting: 2, running: 5, queued_prompt_tokens: 300, blocks, ..Default::default() };
        m.set_worker_stats("w0", &stats);
        let text = m.render();
        assert!(text.contains("pdserve_worker_role{worker=\"w0\",role=\"decode\"} 1\n"), "{text}");
        assert!(text.contains("pdserve_worker_role{worker=\"w0\",role=\"prefill\"} 0\n"), "{text}");
        assert!(text.contains("pdserve_kv_blocks{worker=\"w0\",state=\"cached\",tier=\"device\"} 3\n"), "{text}");
        assert!(text.contains("pdserve_paused_requests{worker=\"w0\"} 1\n"), "{text}");
        assert!(text.contains("pdserve_worker_requests{worker=\"w0\",state=\"waiting\"} 2\n"), "{text}");
        assert!(text.contains("pdserve_worker_requests{worker=\"w0\",state=\"running\"} 5\n"), "{text}");
        assert!(text.contains("pdserve_worker_queued_prompt_tokens{worker=\"w0\"} 300\n"), "{text}");
        m.forget_stats("w0");
        assert!(!m.render().contains("pdserve_worker_requests{"), "a worker's series go with it");
    }

    #[test]
    fn the_disk_tiers_losses_are_counted_beside_its_moves() {
        let m = Metrics::new();
        let tiers = TierCounters { stored_disk: 9, disk_write_failures: 2, disk_corrupt: 1, ..Default::default() };
        m.set_worker_stats("w0", &WorkerStats { tiers, ..Default::default() });
        let text = m.render();
        for (direction, n) in [("stored", 9), ("write_failed", 2), ("corrupt", 1)] {
            let line =
                format!("pdserve_kv_tier_blocks_total{{worker=\"w0\",tier=\"disk\",direction=\"{direction}\"}} {n}\n");
            assert!(text.contains(&line), "{line}{text}");
        }
    }

    #[test]
    fn histograms_have_buckets() {
        let m = Metrics::new();
        m.ttft("auto", 0.01);
        m.phase(Phase::KvTransfer, 0.002);
        let text = m.render();
        assert!(text.contains("pdserve_request_ttft_seconds_count{mode=\"auto\"} 1\n"), "{text}");
        assert!(text.contains("pdserve_phase_seconds_bucket{le=\"+Inf\",phase=\"kv_transfer\"} 1\n"), "{text}");
    }
}
