//! The router: for each request, where it prefills and where it decodes.
//!
//! Sits between the frontend (which calls [`Router::generate`] through the
//! [`Generate`] trait) and the workers, local or in other processes ([`Node`]).
//! Aggregated requests go to one worker; disaggregated ones run the handoff of
//! [`handoff`]: reserve on a decode worker, prefill on a prefill worker streaming K/V
//! into the reservation, first token to the client, decode continues — each state with
//! a deadline and a cleanup path. `auto` decides per request with [`cost`].

pub mod cost;
pub mod handoff;
mod mode;
mod node;
pub mod policies;
mod relay;

pub use handoff::{Deadlines, KvLink};
pub use mode::Mode;
pub use node::Node;
pub use policies::Policy;

use cost::{PrefillLoad, TransferCost};
use pdserve_protocol::{
    Event, Generate, GenerateRequest, NoTelemetry, PrefillRoute, ServeError, Telemetry, TokenStream,
};
use pdserve_types::Role;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Semaphore;

/// Handoffs one prefill worker runs at once: one prefilling and one reserving its
/// blocks, so the worker never idles between prompts; the rest wait in the router
/// (holding nothing on any worker) in arrival order.
pub const PREFILL_SLOTS: usize = 2;

pub struct Router {
    workers: Vec<Node>,
    /// Per worker (same index): prompt tokens queued and the measured prefill rate.
    loads: Vec<Arc<PrefillLoad>>,
    /// Per worker: handoffs it may be prefilling at once (see [`PREFILL_SLOTS`]).
    slots: Vec<Arc<Semaphore>>,
    transfer: Arc<TransferCost>,
    mode: Mode,
    policy: Policy,
    turn: AtomicUsize,
    deadlines: Deadlines,
    runtime: tokio::runtime::Handle,
    draining: AtomicBool,
    telemetry: Arc<dyn Telemetry>,
    link: Option<Arc<KvLink>>,
    /// How remote workers ship KV to each other: "tcp" or "shm".
    remote_transport: &'static str,
}

impl Router {
    /// `runtime` runs the handoff tasks.
    pub fn new(
        workers: impl IntoIterator<Item = impl Into<Node>>,
        mode: Mode,
        deadlines: Deadlines,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        let workers: Vec<Node> = workers.into_iter().map(Into::into).collect();
        Router {
            loads: workers.iter().map(|_| Arc::default()).collect(),
            slots: workers.iter().map(|_| Arc::new(Semaphore::new(PREFILL_SLOTS))).collect(),
            workers,
            transfer: Arc::default(),
            mode,
            policy: Policy::default(),
            turn: AtomicUsize::new(0),
            deadlines,
            runtime,
            draining: AtomicBool::new(false),
            telemetry: Arc::new(NoTelemetry),
            link: None,
            remote_transport: "tcp",
        }
    }

    /// Ships KV frames over `link` (TCP, shared memory) instead of handing them to
    /// the decode worker directly (workers in this process).
    pub fn with_kv_link(mut self, link: KvLink) -> Self {
        self.link = Some(Arc::new(link));
        self
    }

    /// How workers in other processes send each other KV: "tcp" or "shm".
    pub fn with_remote_transport(mut self, transport: &'static str) -> Self {
        self.remote_transport = transport;
        self
    }

    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Reports routing decisions, phase times and transfer bytes to `t`.
    pub fn with_telemetry(mut self, t: Arc<dyn Telemetry>) -> Self {
        self.telemetry = t;
        self
    }

    pub fn workers(&self) -> &[Node] {
        &self.workers
    }

    /// Refuse new requests (shutdown); requests in flight continue.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Requests in flight on all workers.
    pub fn in_flight(&self) -> usize {
        self.workers.iter().map(Node::load).sum()
    }

    /// Indices of live workers with one of `roles`, except `not`.
    fn with_role(&self, roles: &[Role], not: Option<usize>) -> Vec<usize> {
        (0..self.workers.len())
            .filter(|&i| Some(i) != not && self.workers[i].is_alive() && roles.contains(&self.workers[i].role()))
            .collect()
    }

    fn pick(&self, candidates: &[usize]) -> Option<usize> {
        let nodes: Vec<&Node> = candidates.iter().map(|&i| &self.workers[i]).collect();
        let chosen = match self.policy {
            Policy::LeastLoaded => policies::least_loaded(&nodes),
            Policy::RoundRobin => policies::round_robin(&nodes, &self.turn),
        }?;
        candidates.iter().copied().find(|&i| std::ptr::eq(&self.workers[i], chosen))
    }

    /// The prefill worker for a request decoding on `d`, or `None` to prefill there.
    fn remote_prefill(&self, d: usize, prompt_len: usize) -> Option<usize> {
        match self.mode {
            Mode::Aggregated => None,
            Mode::Disaggregated => self.pick(&self.with_role(&[Role::Prefill], None)),
            Mode::Auto => {
                let cost = |w: usize| self.loads[w].predict(prompt_len) + self.interference(w, prompt_len);
                let local = cost(d);
                let candidates = self.with_role(&[Role::Prefill, Role::Mixed], Some(d));
                let remote = |p: &usize| cost(*p) + self.transfer.predict(prompt_len);
                let best = candidates.iter().copied().min_by(|a, b| remote(a).total_cmp(&remote(b)))?;
                cost::prefer_remote(local, remote(&best)).then_some(best)
            }
        }
    }

    /// What prefilling `tokens` on worker `w` costs the sequences decoding there: each
    /// waits out the prefill's compute (chunked prefill shares their steps).
    fn interference(&self, w: usize, tokens: usize) -> f64 {
        let node = &self.workers[w];
        if node.role() == Role::Prefill || node.load() == 0 {
            return 0.0;
        }
        tokens as f64 * self.loads[w].seconds_per_token()
    }

    /// Prefill and decode on worker `d`. In `auto`, the first token is watched so
    /// `d`'s queue and rate stay measured.
    fn local(&self, d: usize, req: GenerateRequest) -> Result<TokenStream, ServeError> {
        let node = &self.workers[d];
        let (client, stream) = TokenStream::channel(req.params.max_tokens as usize + 4);
        if self.mode != Mode::Auto {
            node.generate_into(req, client)?;
            return Ok(stream);
        }
        let (inner_tx, inner) = TokenStream::channel(req.params.max_tokens as usize + 4);
        let (load, n) = (self.loads[d].clone(), req.prompt.len());
        let ahead = load.queued();
        let ticket = load.admit(n);
        node.generate_into(req, inner_tx)?;
        let started = Instant::now();
        relay::relay(&self.runtime, inner, client, move |first| {
            if matches!(first, Event::Token(_)) {
                load.observe(ahead, n, started.elapsed());
            }
            drop(ticket);
        });
        Ok(stream)
    }
}

impl Generate for Router {
    fn generate(&self, req: GenerateRequest) -> Result<TokenStream, ServeError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ServeError::ShuttingDown);
        }
        let decoders = self.with_role(&[Role::Decode, Role::Mixed], None);
        let d = self.pick(&decoders).ok_or_else(|| ServeError::NoWorker("no live decode or mixed worker".into()))?;
        match self.remote_prefill(d, req.prompt.len()) {
            None => {
                self.telemetry.route(PrefillRoute::Local);
                self.local(d, req)
            }
            Some(p) => {
                self.telemetry.route(PrefillRoute::Remote);
                // In disaggregated mode a second prefill worker stands by; in auto the
                // decode worker itself is the fallback.
                let spare = match self.mode {
                    Mode::Disaggregated => self.pick(&self.with_role(&[Role::Prefill], Some(p))),
                    _ => None,
                };
                let spare = spare.map(|s| handoff::Prefiller {
                    node: self.workers[s].clone(),
                    load: self.loads[s].clone(),
                    slots: self.slots[s].clone(),
                });
                let hop = handoff::Hop {
                    spare,
                    p: self.workers[p].clone(),
                    d: self.workers[d].clone(),
                    p_load: self.loads[p].clone(),
                    p_slots: self.slots[p].clone(),
                    transfer: self.transfer.clone(),
                    deadlines: self.deadlines,
                    telemetry: self.telemetry.clone(),
                    link: self.link.clone(),
                    remote_transport: self.remote_transport,
                };
                Ok(handoff::start(&self.runtime, hop, req))
            }
        }
    }

    fn ready(&self) -> bool {
        !self.draining.load(Ordering::SeqCst) && !self.with_role(&[Role::Decode, Role::Mixed], None).is_empty()
    }
}
