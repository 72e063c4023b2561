//! Metric definitions, pinned (docs/bench.md repeats them):
//!
//! - **TTFT**: request sent → first chunk carrying generated text.
//! - **TPOT**: (last − first content chunk time) / (output tokens − 1); only for
//!   requests with at least 2 output tokens.
//! - **ITL**: every gap between consecutive content chunks, pooled over requests.
//! - **E2E**: request sent → response complete.
//! - **Duration** of a point: first send → last completion (failed requests included).
//! - **Throughput**: successful requests, their output (input, total) tokens, per
//!   second of duration.
//! - **Goodput**: successful requests with TTFT ≤ SLO and TPOT ≤ SLO (TPOT only where
//!   defined), per second of duration; **attainment** = those / all requests sent.
//! - **Percentiles**: nearest rank — the smallest sample with at least p % of the
//!   samples at or below it. Successful requests only.

use crate::record::RequestRecord;
pub use crate::record::{tpot, ttft};

/// Nearest-rank percentile of sorted samples (`p` in 0..=100).
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

/// Distribution summary of one metric, in the unit it was built with.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    pub count: usize,
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Stats {
    /// Summary of `values` multiplied by `scale` (e.g. 1000 for seconds → ms).
    pub fn of(values: impl IntoIterator<Item = f64>, scale: f64) -> Self {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).map(|x| x * scale).collect();
        v.sort_by(f64::total_cmp);
        let mean = (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        Self {
            count: v.len(),
            mean,
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            max: v.last().copied(),
        }
    }
}

/// Service-level objectives for goodput.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

impl Default for Slo {
    /// Interactive use on a small CPU server: first token within 5 s, then at least
    /// 20 tokens per second.
    fn default() -> Self {
        Self { ttft_ms: 5000.0, tpot_ms: 50.0 }
    }
}

impl Slo {
    /// Does a request count toward goodput?
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        let ttft_ok = r.ttft_s.is_some_and(|t| t * 1000.0 <= self.ttft_ms);
        let tpot_ok = r.tpot_s.is_none_or(|t| t * 1000.0 <= self.tpot_ms);
        r.ok && ttft_ok && tpot_ok
    }
}

/// Everything reported for one sweep point.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub failed: usize,
    /// Of the failed: refused by the server to shed load (429/503).
    #[serde(default)]
    pub shed: usize,
    /// Of the failed: given up by the client.
    #[serde(default)]
    pub timed_out: usize,
    pub duration_s: f64,
    pub request_throughput: f64,
    pub output_token_throughput: f64,
    pub input_token_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Stats,
    pub tpot_ms: Stats,
    pub itl_ms: Stats,
    pub e2e_ms: Stats,
    pub slo: Slo,
    pub goodput: f64,
    pub slo_attainment_pct: f64,
    /// Client work per request (see `RequestRecord::client_busy_s`), ms.
    pub client_busy_ms: Stats,
    /// Open loop: how late requests were sent relative to their schedule, ms.
    pub send_lag_ms: Stats,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    /// The point's full prompt blocks and how many the run had sent before them
    /// (a prefix cache may hold those): filled by `load::measure`.
    #[serde(default)]
    pub prompt_blocks: BlockReuse,
    /// Cached prompt tokens during the point as the server's router predicted them
    /// and as its engines reused them (pdserve's `/metrics`; absent elsewhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_hits: Option<PrefixHits>,
    /// Drafted tokens the server's workers verified and accepted during the point
    /// (pdserve's `/metrics` with `--speculative`; absent elsewhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation: Option<Speculation>,
    /// Multi-turn: replies in the prompts' histories, and how many were the
    /// server's own (`--replies generated`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replies: Option<Replies>,
}

/// Replies in a point's prompts, and how many of them the server generated (random
/// tokens stood in for the rest: still streaming when the next turn was sent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Replies {
    pub in_history: u64,
    pub generated: u64,
}

/// A server's predicted and realized prefix-cache hits, in prompt tokens, and the
/// part of the realized ones its engines copied back from their host-RAM and disk
/// tiers (the rest came straight from their pools).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PrefixHits {
    pub predicted: f64,
    pub realized: f64,
    #[serde(default)]
    pub from_host: f64,
    #[serde(default)]
    pub from_disk: f64,
    /// Of the realized, the tokens a peer sent (the KV pool across workers): what
    /// moved, not what the receiver kept of its own.
    #[serde(default)]
    pub fetched: f64,
}

/// Drafted tokens a server's workers verified and accepted, summed over workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Speculation {
    pub drafted: f64,
    pub accepted: f64,
}

impl Speculation {
    /// From a Prometheus text page: every worker's `pdserve_spec_draft_tokens_total`
    /// and `pdserve_spec_accepted_tokens_total`; none when no worker drafted.
    pub fn scrape(page: &str) -> Option<Self> {
        let sum = |name: &str| -> Option<f64> {
            let prefix = format!("{name}{{");
            let values =
                page.lines().filter(|l| l.starts_with(&prefix)).filter_map(|l| l.rsplit(' ').next()?.parse().ok());
            values.reduce(|a: f64, b| a + b)
        };
        let drafted = sum("pdserve_spec_draft_tokens_total")?;
        Some(Speculation { drafted, accepted: sum("pdserve_spec_accepted_tokens_total").unwrap_or(0.0) })
    }

    /// What happened between two scrapes.
    pub fn since(self, before: Option<Speculation>) -> Self {
        let b = before.unwrap_or_default();
        Speculation { drafted: self.drafted - b.drafted, accepted: self.accepted - b.accepted }
    }

    /// Accepted over drafted, in percent (none drafted: none).
    pub fn accepted_pct(&self) -> Option<f64> {
        (self.drafted > 0.0).then(|| 100.0 * self.accepted / self.drafted)
    }
}

/// Tokens in one of pdserve's KV blocks (its tier counters count blocks).
const PDSERVE_BLOCK_TOKENS: f64 = 16.0;

impl PrefixHits {
    /// Realized over predicted, in percent (none predicted: none).
    pub fn realized_pct(&self) -> Option<f64> {
        (self.predicted > 0.0).then(|| 100.0 * self.realized / self.predicted)
    }

    /// From a Prometheus text page: `pdserve_prefix_hit_tokens_total{kind=...}` and
    /// every worker's `pdserve_kv_tier_blocks_total{direction="restored"}`.
    pub fn scrape(page: &str) -> Option<Self> {
        let value = |kind: &str| {
            let key = format!("pdserve_prefix_hit_tokens_total{{kind=\"{kind}\"}} ");
            page.lines().find_map(|l| l.strip_prefix(key.as_str())?.trim().parse::<f64>().ok())
        };
        let restored = |tier: &str| {
            let label = format!("tier=\"{tier}\",direction=\"restored\"");
            let lines = page.lines().filter(|l| l.starts_with("pdserve_kv_tier_blocks_total{") && l.contains(&label));
            lines.filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum::<f64>() * PDSERVE_BLOCK_TOKENS
        };
        let fetched =
            page.lines().find_map(|l| l.strip_prefix("pdserve_kv_fetched_tokens_total ")?.trim().parse().ok());
        let (predicted, realized) = (value("predicted"), value("realized"));
        (predicted.is_some() || realized.is_some()).then(|| PrefixHits {
            predicted: predicted.unwrap_or(0.0),
            realized: realized.unwrap_or(0.0),
            from_host: restored("host"),
            from_disk: restored("disk"),
            fetched: fetched.unwrap_or(0.0),
        })
    }

    /// What happened between two scrapes.
    pub fn since(self, before: Option<PrefixHits>) -> Self {
        let b = before.unwrap_or_default();
        PrefixHits {
            predicted: self.predicted - b.predicted,
            realized: self.realized - b.realized,
            from_host: self.from_host - b.from_host,
            from_disk: self.from_disk - b.from_disk,
            fetched: self.fetched - b.fetched,
        }
    }
}

impl Summary {
    pub fn of(records: &[RequestRecord], slo: Slo) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok).collect();
        let duration_s = duration(records);
        let per_s = |x: f64| if duration_s > 0.0 { x / duration_s } else { 0.0 };
        let out_tokens = ok.iter().map(|r| r.output_tokens as f64).sum::<f64>();
        let in_tokens = ok.iter().map(|r| r.input_tokens as f64).sum::<f64>();
        let good = records.iter().filter(|r| slo.met_by(r)).count();
        Self {
            requests: records.len(),
            ok: ok.len(),
            failed: records.len() - ok.len(),
            shed: records.iter().filter(|r| !r.ok && r.shed.is_some()).count(),
            timed_out: records.iter().filter(|r| r.timed_out).count(),
            duration_s,
            request_throughput: per_s(ok.len() as f64),
            output_token_throughput: per_s(out_tokens),
            input_token_throughput: per_s(in_tokens),
            total_token_throughput: per_s(out_tokens + in_tokens),
            ttft_ms: Stats::of(ok.iter().filter_map(|r| r.ttft_s), 1e3),
            tpot_ms: Stats::of(ok.iter().filter_map(|r| r.tpot_s), 1e3),
            itl_ms: Stats::of(ok.iter().flat_map(|r| r.itls()), 1e3),
            e2e_ms: Stats::of(ok.iter().map(|r| r.e2e_s), 1e3),
            slo,
            goodput: per_s(good as f64),
            slo_attainment_pct: if records.is_empty() { 0.0 } else { 100.0 * good as f64 / records.len() as f64 },
            client_busy_ms: Stats::of(records.iter().map(|r| r.client_busy_s), 1e3),
            send_lag_ms: Stats::of(records.iter().filter_map(|r| Some(r.start_s - r.scheduled_s?)), 1e3),
            first_error: records.iter().find_map(|r| r.error.clone()),
            prompt_blocks: Default::default(),
            prefix_hits: None,
            speculation: None,
            replies: records.iter().any(|r| r.generated_replies > 0).then(|| Replies {
                in_history: records.iter().map(|r| u64::from(r.history_replies)).sum(),
                generated: records.iter().map(|r| u64::from(r.generated_replies)).sum(),
            }),
        }
    }
}

/// First send → last completion.
pub fn duration(records: &[RequestRecord]) -> f64 {
    let start = records.iter().map(|r| r.start_s).fold(f64::INFINITY, f64::min);
    let end = records.iter().map(RequestRecord::end_s).fold(f64::NEG_INFINITY, f64::max);
    if records.is_empty() {
        0.0
    } else {
        (end - start).max(0.0)
    }
}

/// Full blocks in one point's prompts, and how many of them the run had sent before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockReuse {
    pub blocks: usize,
    pub reused: usize,
}

impl BlockReuse {
    pub fn percent(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            100.0 * self.reused as f64 / self.blocks as f64
        }
    }
}

impl std::ops::AddAssign for BlockReuse {
    fn add_assign(&mut self, o: BlockReuse) {
        self.blocks += o.blocks;
        self.reused += o.reused;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speculation_is_summed_over_workers_and_taken_as_a_difference() {
        let page = |d0: u32, a0: u32, d1: u32, a1: u32| {
            format!(
                "# TYPE pdserve_spec_draft_tokens_total counter\n\
                 pdserve_spec_draft_tokens_total{{worker=\"a\"}} {d0}\n\
                 pdserve_spec_draft_tokens_total{{worker=\"b\"}} {d1}\n\
                 pdserve_spec_accepted_tokens_total{{worker=\"a\"}} {a0}\n\
                 pdserve_spec_accepted_tokens_total{{worker=\"b\"}} {a1}\n"
            )
        };
        assert_eq!(Speculation::scrape("# TYPE pdserve_spec_draft_tokens_total counter\n"), None);
        let before = Speculation::scrape(&page(10, 4, 0, 0));
        let after = Speculation::scrape(&page(30, 12, 20, 8)).unwrap().since(before);
        assert_eq!(after, Speculation { drafted: 40.0, accepted: 16.0 });
        assert_eq!(after.accepted_pct(), Some(40.0));
    }

    #[test]
    fn prefix_hits_are_read_from_a_metrics_page() {
        let page = "# TYPE pdserve_prefix_hit_tokens_total counter\n\
                    pdserve_prefix_hit_tokens_total{kind=\"predicted\"} 4000\n\
                    pdserve_prefix_hit_tokens_total{kind=\"realized\"} 3900\n\
                    pdserve_kv_tier_blocks_total{worker=\"a\",tier=\"host\",direction=\"restored\"} 10\n\
                    pdserve_kv_tier_blocks_total{worker=\"b\",tier=\"host\",direction=\"restored\"} 5\n\
                    pdserve_kv_tier_blocks_total{worker=\"b\",tier=\"disk\",direction=\"stored\"} 7\n\
                    pdserve_kv_fetched_tokens_total 640\n";
        let before =
            PrefixHits { predicted: 1000.0, realized: 1000.0, from_host: 80.0, from_disk: 0.0, fetched: 160.0 };
        let h = PrefixHits::scrape(page).unwrap().since(Some(before));
        let want = PrefixHits { predicted: 3000.0, realized: 2900.0, from_host: 160.0, from_disk: 0.0, fetched: 480.0 };
        assert_eq!(h, want);
        assert!((h.realized_pct().unwrap() - 96.666).abs() < 0.01);
        assert_eq!(PrefixHits::scrape("other_metric 1\n"), None);
    }

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-9)
    }

    #[test]
    fn ttft_tpot_and_itl_follow_their_definitions() {
        // Sent at 0; chunks at 0.5, 0.6, 0.8, 1.1; 4 tokens.
        let r = RequestRecord::succeeded(0, 0.0, vec![0.5, 0.6, 0.8, 1.1], 4, 1.2);
        assert!(close(r.ttft_s, 0.5));
        assert!(close(r.tpot_s, 0.2)); // (1.1 - 0.5) / 3
        let itl: Vec<f64> = r.itls().collect();
        assert_eq!(itl.len(), 3);
        assert!(itl.iter().zip([0.1, 0.2, 0.3]).all(|(a, b)| (a - b).abs() < 1e-9));
        // Usage may report more tokens than chunks (several tokens per chunk): TPOT
        // divides by tokens, ITL stays per chunk.
        let r = RequestRecord::succeeded(0, 0.0, vec![0.5, 1.1], 4, 1.2);
        assert!(close(r.tpot_s, 0.2));
        assert_eq!(r.itls().count(), 1);
        assert_eq!(tpot(&[0.5], 1), None);
        assert_eq!(tpot(&[], 5), None);
        assert_eq!(ttft(&[]), None);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 90.0), Some(90.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[], 50.0), None);
        let s = Stats::of([3.0, 1.0, 2.0, f64::NAN], 1000.0);
        assert_eq!((s.count, s.mean, s.p50, s.max), (3, Some(2000.0), Some(2000.0), Some(3000.0)));
        assert_eq!(Stats::of([], 1.0), Stats::default());
    }

    #[test]
    fn summary_throughput_and_goodput() {
        let slo = Slo { ttft_ms: 600.0, tpot_ms: 150.0 };
        let mut records = vec![
            // meets both SLOs: ttft 0.5, tpot 0.1
            RequestRecord::succeeded(0, 0.0, vec![0.5, 0.6, 0.7], 3, 0.8),
            // misses TTFT
            RequestRecord::succeeded(1, 0.5, vec![0.7, 0.8], 2, 1.0),
            // misses TPOT: (1.0 - 0.1) / 3 = 0.3
            RequestRecord::succeeded(2, 1.0, vec![0.1, 1.0], 4, 1.0),
            // one token: TPOT undefined, only TTFT counts
            RequestRecord::succeeded(3, 1.0, vec![0.2], 1, 0.3),
            RequestRecord::failed(4, 1.5, 0.5, "HTTP 500".into()),
        ];
        for r in &mut records {
            r.input_tokens = 10;
        }
        let s = Summary::of(&records, slo);
        assert_eq!((s.requests, s.ok, s.failed), (5, 4, 1));
        assert!((s.duration_s - 2.0).abs() < 1e-9);
        assert!((s.request_throughput - 2.0).abs() < 1e-9);
        assert!((s.output_token_throughput - 5.0).abs() < 1e-9);
        assert!((s.input_token_throughput - 20.0).abs() < 1e-9);
        assert!((s.goodput - 1.0).abs() < 1e-9);
        assert!((s.slo_attainment_pct - 40.0).abs() < 1e-9);
        assert_eq!(s.itl_ms.count, 4);
        assert_eq!(s.tpot_ms.count, 3);
        assert_eq!(s.first_error.as_deref(), Some("HTTP 500"));
        assert_eq!(Summary::of(&[], slo).duration_s, 0.0);
    }

    #[test]
    fn failed_requests_never_meet_the_slo() {
        let mut r = RequestRecord::succeeded(0, 0.0, vec![0.01], 1, 0.02);
        assert!(Slo::default().met_by(&r));
        r.ok = false;
        assert!(!Slo::default().met_by(&r));
    }
}
