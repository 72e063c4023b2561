//! What the client saw of one request. Records are the raw data: every summary,
//! table and plot is computed from them, and all of them go into the JSON output.

/// One request, as measured by the client. Times are seconds.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RequestRecord {
    pub index: usize,
    /// When the request was sent, from the start of its sweep point.
    pub start_s: f64,
    /// When an open-loop schedule wanted it sent (lag = `start_s - scheduled_s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_s: Option<f64>,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The server shed the request (HTTP 429 or 503) and asked to come back after
    /// this many seconds (0 when it did not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shed: Option<f64>,
    /// The client gave up waiting (`--timeout-seconds`).
    #[serde(default)]
    pub timed_out: bool,
    /// Prompt tokens: the server's usage when reported, else what was sent.
    pub input_tokens: u64,
    /// Generated tokens: the server's usage when reported, else content chunks.
    pub output_tokens: u64,
    /// What was asked for (`max_tokens = min_tokens`).
    pub requested_output_tokens: u32,
    /// Arrival of each chunk carrying generated text, from when the request was sent.
    pub chunk_times_s: Vec<f64>,
    /// Derived: request sent → first content chunk.
    pub ttft_s: Option<f64>,
    /// Derived: (last − first content chunk) / (output tokens − 1).
    pub tpot_s: Option<f64>,
    /// Request sent → `[DONE]` (or the end of the body, or the failure).
    pub e2e_s: f64,
    /// Time the client spent working on this request rather than waiting for the
    /// socket: building the body, parsing SSE and JSON, bookkeeping.
    pub client_busy_s: f64,
    /// Multi-turn: earlier replies in the prompt, and how many of them were the
    /// server's own (`--replies generated`; random tokens stood in for the rest).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub history_replies: u32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generated_replies: u32,
    /// The ids generated, where the server returned them (kept for later turns,
    /// not written out).
    #[serde(skip)]
    pub reply_ids: Vec<u32>,
    /// The prompt sent, where it was made of generated replies (so it cannot be made
    /// again from the workload); not written out.
    #[serde(skip)]
    pub prompt_ids: Vec<u32>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl RequestRecord {
    /// Fills the derived fields from the raw ones.
    pub fn derive(mut self) -> Self {
        self.ttft_s = ttft(&self.chunk_times_s);
        self.tpot_s = tpot(&self.chunk_times_s, self.output_tokens);
        self
    }

    /// A successful record from its raw parts (hand-made records in tests).
    pub fn succeeded(index: usize, start_s: f64, chunk_times_s: Vec<f64>, output_tokens: u64, e2e_s: f64) -> Self {
        Self { index, start_s, ok: true, chunk_times_s, output_tokens, e2e_s, ..Self::default() }.derive()
    }

    /// A failed record.
    pub fn failed(index: usize, start_s: f64, e2e_s: f64, error: String) -> Self {
        Self { index, start_s, e2e_s, error: Some(error), ..Self::default() }
    }

    /// Inter-token latencies: every gap between consecutive content chunks.
    pub fn itls(&self) -> impl Iterator<Item = f64> + '_ {
        self.chunk_times_s.windows(2).map(|w| w[1] - w[0])
    }

    /// When the request finished, from the start of its point.
    pub fn end_s(&self) -> f64 {
        self.start_s + self.e2e_s
    }
}

/// Request sent → first content chunk.
pub fn ttft(chunk_times_s: &[f64]) -> Option<f64> {
    chunk_times_s.first().copied()
}

/// (last − first content chunk) / (output tokens − 1).
pub fn tpot(chunk_times_s: &[f64], output_tokens: u64) -> Option<f64> {
    let (first, last) = (chunk_times_s.first()?, chunk_times_s.last()?);
    (output_tokens >= 2).then(|| (last - first) / (output_tokens - 1) as f64)
}
