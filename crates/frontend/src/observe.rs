//! Who else hears of each request: an [`Observer`] gets a [`RequestRecord`] when a
//! request is accepted and when it ends, with where it ran and how long each phase
//! took. The CLI's observer turns them into NimsForest lifecycle Leaves; the
//! frontend itself knows nothing of NATS.

use pdserve_protocol::{Phase, PrefillRoute, TraceData};
use serde::Serialize;
use serde_json::Value;

pub trait Observer: Send + Sync + 'static {
    /// Validated and about to run.
    fn accepted(&self, r: &RequestRecord);
    /// Answered, refused, failed or cancelled (`outcome` says which).
    fn finished(&self, r: &RequestRecord);
}

/// One request, as far as it went.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RequestRecord {
    pub request_id: String,
    /// The API path (`/v1/chat/completions`, ...).
    pub api: String,
    pub model: Option<String>,
    /// How it came: `http`, or what the `x-pdserve-ingress` header said (`river`,
    /// `wind`).
    pub ingress: String,
    /// The caller's opaque context (`x-pdserve-context`, JSON), echoed.
    pub context: Value,
    /// `ok`, `rejected`, `error` or `cancelled` once finished.
    pub outcome: Option<&'static str>,
    pub error: Option<&'static str>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// `local` (prefilled where it decoded) or `remote`.
    pub route: Option<&'static str>,
    pub prefill_node_id: Option<String>,
    pub decode_node_id: Option<String>,
    pub timings: Timings,
}

/// Milliseconds per phase, where the request went through it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Timings {
    /// Waiting for a prefill worker (the router's queue and the worker's).
    pub queue_ms: Option<f64>,
    pub prefill_ms: Option<f64>,
    pub kv_transfer_ms: Option<f64>,
    /// From the handoff to the decode worker's first token.
    pub queue_decode_ms: Option<f64>,
    pub ttft_ms: Option<f64>,
    /// From the first token to the last.
    pub decode_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
}

impl RequestRecord {
    /// Takes in what the router learned.
    pub(crate) fn add_trace(&mut self, t: TraceData) {
        self.route = t.route.map(|r| match r {
            PrefillRoute::Local => "local",
            PrefillRoute::Remote => "remote",
        });
        self.decode_node_id = t.decode;
        // A local prefill ran on the decode worker.
        self.prefill_node_id =
            t.prefill.or_else(|| self.decode_node_id.clone().filter(|_| self.route == Some("local")));
        for (phase, s) in t.phases {
            let ms = Some(s * 1e3);
            match phase {
                Phase::QueuePrefill => self.timings.queue_ms = ms,
                Phase::Prefill => self.timings.prefill_ms = ms,
                Phase::KvTransfer => self.timings.kv_transfer_ms = ms,
                Phase::QueueDecode => self.timings.queue_decode_ms = ms,
                Phase::Decode => self.timings.decode_ms = ms,
            }
        }
    }
}
