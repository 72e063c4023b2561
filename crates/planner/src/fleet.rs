//! What the planner reads of the workers and asks of them: one small trait, so the
//! controller needs no router. The router implements it over its worker set (in
//! `serve --planner`, in `pdserve planner` and in the twin alike).

use crate::model::Slo;
use crate::signals::Traffic;
use pdserve_protocol::ServeError;
use pdserve_types::{Assignment, DecodeSteps, PrefillSteps};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// A future a [`Fleet`] or an [`crate::Actuator`] answers with.
pub type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A usable worker as the planner weighs it on a tick, copied once.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    pub name: String,
    /// Its role, and the epoch it holds it at.
    pub assignment: Assignment,
    /// Requests it runs now: the least loaded are moved first.
    pub load: usize,
    /// Seconds per prompt token the router timed against its prefill queue, if any.
    pub timed_prefill: Option<f64>,
}

/// What a worker measured of itself, as its stats said.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measures {
    pub decode_steps: DecodeSteps,
    pub prefill_steps: PrefillSteps,
    /// Its KV pool, in tokens.
    pub kv_tokens: usize,
    /// Sequences it runs or holds waiting.
    pub busy: usize,
}

/// The workers the planner gives roles to.
pub trait Fleet: Send + Sync + 'static {
    /// The usable workers now.
    fn members(&self) -> Vec<Member>;

    /// What `worker` says of itself, asked with a deadline (a
    /// [`ServeError::Timeout`] past it).
    fn measures<'a>(&'a self, worker: &'a str) -> Boxed<'a, Result<Measures, ServeError>>;

    /// Seconds of prefill queued on the usable workers at `pace` (fixed seconds a
    /// prompt, seconds a token).
    fn prefill_backlog(&self, pace: (f64, f64)) -> f64;

    /// Prompts one prefill step carries at once: they share its fixed cost.
    fn prefill_slots(&self) -> usize;

    /// The traffic of the window, or of its newest `within`, judged by `slo`.
    fn traffic(&self, within: Option<Duration>, slo: &Slo) -> Traffic;

    /// Gives `worker` assignment `a`; answers what it holds now.
    fn assign<'a>(&'a self, worker: &'a str, a: Assignment) -> Boxed<'a, Result<Assignment, ServeError>>;

    /// Asks `worker`, which left decode, to hand its sequences to the decoders;
    /// answers how many it moved.
    fn move_decodes<'a>(&'a self, worker: &'a str) -> Boxed<'a, Result<usize, ServeError>>;

    /// Counts a decision (the metrics).
    fn decided(&self, from: &str, to: &str, reason: &'static str);

    /// Where the planner's tasks run.
    fn runtime(&self) -> tokio::runtime::Handle;
}
