//! The router as the planner's [`Fleet`]: its usable workers as plain records, their
//! stats, the traffic its front records, and role switches over each worker's own
//! connection.

use crate::workers::{Entry, PREFILL_SLOTS};
use crate::{Router, BLOCK_SIZE};
use pdserve_planner::model::Slo;
use pdserve_planner::signals::Traffic;
use pdserve_planner::{Boxed, Fleet, Measures, Member};
use pdserve_protocol::{Capabilities, ServeError};
use pdserve_types::Assignment;
use std::sync::Arc;
use std::time::Duration;

impl Router {
    /// The worker named `name`, if it is in the set.
    fn named(&self, name: &str) -> Result<Arc<Entry>, ServeError> {
        let found = self.workers().snapshot().into_iter().find(|e| e.name() == name);
        found.ok_or_else(|| ServeError::NoWorker(format!("{name} left the worker set")))
    }

    /// Gives worker `e` assignment `a`; answers with what it holds afterwards. The
    /// router routes by the new role from the moment it is known.
    pub(crate) async fn assign(&self, e: &Entry, a: Assignment) -> Result<Assignment, ServeError> {
        let now = e.worker.roles()?.set_role(a).await?;
        e.learn(now);
        self.note_role(e, now.role);
        Ok(now)
    }
}

fn member(e: &Entry) -> Member {
    Member {
        name: e.name().to_string(),
        assignment: e.assignment(),
        load: e.worker.load(),
        timed_prefill: e.prefill.measured(),
    }
}

impl Fleet for Router {
    fn members(&self) -> Vec<Member> {
        self.workers().snapshot().iter().filter(|e| e.usable()).map(|e| member(e)).collect()
    }

    fn measures<'a>(&'a self, worker: &'a str) -> Boxed<'a, Result<Measures, ServeError>> {
        Box::pin(async move {
            let s = self.named(worker)?.read_stats().await?;
            Ok(Measures {
                decode_steps: s.decode_steps,
                prefill_steps: s.prefill_steps,
                kv_tokens: (s.blocks.free + s.blocks.used + s.blocks.cached) * BLOCK_SIZE,
                busy: s.running + s.waiting,
            })
        })
    }

    fn prefill_backlog(&self, pace: (f64, f64)) -> f64 {
        self.workers().snapshot().iter().filter(|e| e.usable()).map(|e| e.prefill.queued_seconds_at(pace)).sum()
    }

    fn prefill_slots(&self) -> usize {
        PREFILL_SLOTS
    }

    fn traffic(&self, within: Option<Duration>, slo: &Slo) -> Traffic {
        match within {
            Some(w) => self.signals.traffic_within(w, slo.ttft_s, slo.tpot_s),
            None => self.signals.traffic(slo.ttft_s, slo.tpot_s),
        }
    }

    fn assign<'a>(&'a self, worker: &'a str, a: Assignment) -> Boxed<'a, Result<Assignment, ServeError>> {
        Box::pin(async move { Router::assign(self, &*self.named(worker)?, a).await })
    }

    fn move_decodes<'a>(&'a self, worker: &'a str) -> Boxed<'a, Result<usize, ServeError>> {
        Box::pin(async move { self.named(worker)?.worker.roles()?.move_decodes().await })
    }

    fn decided(&self, from: &str, to: &str, reason: &'static str) {
        self.telemetry.planned(from, to, reason);
    }

    fn runtime(&self) -> tokio::runtime::Handle {
        self.runtime.clone()
    }
}
