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

pub use handoff::Deadlines;
pub use mode::Mode;

use pdserve_protocol::{Generate, GenerateRequest, ServeError, TokenStream};
use pdserve_types::Role;
use pdserve_worker::Worker;
use std::sync::atomic::{AtomicBool, Ordering};

pub struct Router {
    workers: Vec<Worker>,
    mode: Mode,
    deadlines: Deadlines,
    runtime: tokio::runtime::Handle,
    draining: AtomicBool,
}

impl Router {
    /// `runtime` runs the handoff tasks.
    pub fn new(workers: Vec<Worker>, mode: Mode, deadlines: Deadlines, runtime: tokio::runtime::Handle) -> Self {
        Router { workers, mode, deadlines, runtime, draining: AtomicBool::new(false) }
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
            None => d.generate(req),
            Some(p) => Ok(handoff::start(&self.runtime, p.clone(), d.clone(), req, self.deadlines)),
        }
    }

    fn ready(&self) -> bool {
        !self.draining.load(Ordering::SeqCst) && !self.with_role(&[Role::Decode, Role::Mixed]).is_empty()
    }
}
