//! The router: for each request, where it prefills and where it decodes.
//!
//! Sits between the frontend (which calls [`Router::generate`] through the
//! [`Generate`] trait) and the workers. Aggregated requests go to one worker;
//! disaggregated ones run the handoff of [`handoff`]: reserve on a decode worker,
//! prefill on a prefill worker streaming K/V into the reservation, first token to the
//! client, decode continues — each state with a deadline and a cleanup path.

pub mod handoff;
mod mode;
pub mod policies;

pub use handoff::{Deadlines, KvLink};
pub use mode::Mode;

use pdserve_protocol::{Generate, GenerateRequest, NoTelemetry, PrefillRoute, ServeError, Telemetry, TokenStream};
use pdserve_types::Role;
use pdserve_worker::Worker;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub struct Router {
    workers: Vec<Worker>,
    mode: Mode,
    deadlines: Deadlines,
    runtime: tokio::runtime::Handle,
    draining: AtomicBool,
    telemetry: Arc<dyn Telemetry>,
    link: Option<Arc<KvLink>>,
}

impl Router {
    /// `runtime` runs the handoff tasks.
    pub fn new(workers: Vec<Worker>, mode: Mode, deadlines: Deadlines, runtime: tokio::runtime::Handle) -> Self {
        Router {
            workers,
            mode,
            deadlines,
            runtime,
            draining: AtomicBool::new(false),
            telemetry: Arc::new(NoTelemetry),
            link: None,
        }
    }

    /// Ships KV frames over `link` (TCP, shared memory) instead of handing them to
    /// the decode worker directly.
    pub fn with_kv_link(mut self, link: KvLink) -> Self {
        self.link = Some(Arc::new(link));
        self
    }

    /// Reports routing decisions, phase times and transfer bytes to `t`.
    pub fn with_telemetry(mut self, t: Arc<dyn Telemetry>) -> Self {
        self.telemetry = t;
        self
    }

    pub fn workers(&self) -> &[Worker] {
        &self.workers
    }

    /// Refuse new requests (shutdown); requests in flight continue.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Requests in flight on all workers.
    pub fn in_flight(&self) -> usize {
        self.workers.iter().map(Worker::load).sum()
    }

    fn with_role(&self, roles: &[Role]) -> Vec<&Worker> {
        self.workers.iter().filter(|w| roles.contains(&w.role())).collect()
    }
}

impl Generate for Router {
    fn generate(&self, req: GenerateRequest) -> Result<TokenStream, ServeError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ServeError::ShuttingDown);
        }
        let decoders = self.with_role(&[Role::Decode, Role::Mixed]);
        let d = policies::least_loaded(&decoders)
            .ok_or_else(|| ServeError::NoWorker("no decode or mixed worker".into()))?;
        let prefillers = self.with_role(&[Role::Prefill]);
        let remote = match self.mode {
            Mode::Aggregated => None,
            Mode::Disaggregated => policies::least_loaded(&prefillers),
            Mode::Auto => {
                policies::least_loaded(&prefillers).filter(|_| mode::prefer_remote(req.prompt.len(), d.load()))
            }
        };
        match remote {
            None => {
                self.telemetry.route(PrefillRoute::Local);
                d.generate(req)
            }
            Some(p) => {
                self.telemetry.route(PrefillRoute::Remote);
                let hop = handoff::Hop {
                    p: p.clone(),
                    d: d.clone(),
                    deadlines: self.deadlines,
                    telemetry: self.telemetry.clone(),
                    link: self.link.clone(),
                };
                Ok(handoff::start(&self.runtime, hop, req))
            }
        }
    }

    fn ready(&self) -> bool {
        !self.draining.load(Ordering::SeqCst) && !self.with_role(&[Role::Decode, Role::Mixed]).is_empty()
    }
}
