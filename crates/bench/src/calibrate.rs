//! Client overhead, measured two ways (docs/bench.md, "Client overhead"):
//!
//! 1. **Busy time** (every run, every request): the time the client spends working on
//!    a request — serializing the body, parsing SSE and JSON, bookkeeping — summed
//!    between awaits. A lower bound: time waiting for the runtime to poll is not in it.
//! 2. **Floor** (`--calibrate`, and once in `bench compare`): the same point run
//!    against an in-process server that answers instantly. Its TTFT and ITL are what
//!    the client and loopback add by themselves; an upper bound, since the instant
//!    server shares the machine with the client.

use crate::client::Client;
use crate::error::BenchError;
use crate::fake_server::FakeServer;
use crate::metrics::{Slo, Summary};
use crate::openai::BodyOptions;
use crate::point::PointPlan;
use crate::runner::run_point;
use crate::target::Target;
use crate::workload::Workload;
use std::time::Duration;

/// The floor of one point.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Calibration {
    pub label: String,
    pub summary: Summary,
}

/// Runs `plan` against a fresh instant server.
pub async fn floor(body: &BodyOptions, workload: &Workload, plan: &PointPlan) -> Result<Calibration, BenchError> {
    let server = FakeServer::start()?;
    let target = Target::parse(&server.url(), false)?;
    let client = Client { target, body: BodyOptions { model: None, ..body.clone() }, timeout: Duration::from_secs(60) };
    let records = run_point(&client, workload, plan, None).await;
    drop(server);
    Ok(Calibration { label: plan.label.clone(), summary: Summary::of(&records, Slo::default()) })
}
