//! Worker selection policies, one per file, behind one trait over plain records:
//! a policy sees the request's shape and a [`Candidate`] per eligible worker, never
//! a worker handle, so each is unit-tested without a model or a worker.

pub(crate) mod kv_aware;
mod least_loaded;
mod round_robin;

pub use kv_aware::{predicted_ttft, KvAware};
pub use least_loaded::LeastLoaded;
pub use round_robin::RoundRobin;

use pdserve_kv::BlockHash;
use pdserve_types::Role;
use std::str::FromStr;

/// What a policy may know about the request being routed.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub prompt_len: usize,
    /// The prompt's full blocks, chained as every engine hashes them.
    pub block_hashes: &'a [BlockHash],
}

/// One worker the request may go to.
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    pub name: &'a str,
    pub role: Role,
    /// Requests and prefills queued or in flight there.
    pub load: usize,
    /// Predicted seconds of the prefills the router has sent it that are not done
    /// yet.
    pub queued_seconds: f64,
    /// Prompt tokens its prefix cache holds in any tier, as the router's KV index
    /// predicts.
    pub cached_tokens: usize,
    /// Seconds to copy the part of those held in host RAM or on disk back into its
    /// pool.
    pub restore_seconds: f64,
    /// Its measured prefill pace: seconds per computed prompt token, and seconds
    /// each prefill costs whatever its length.
    pub seconds_per_token: f64,
    pub fixed_seconds: f64,
}

/// Picks one of `candidates` (never empty when called) by index. A policy owns its
/// state (a turn counter, an index) and must be safe to call from many requests at
/// once.
pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    fn pick(&self, ask: &Ask<'_>, candidates: &[Candidate<'_>]) -> Option<usize>;
}

/// The policies `--policy` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PolicyKind {
    #[default]
    KvAware,
    LeastLoaded,
    RoundRobin,
}

impl PolicyKind {
    pub fn build(self) -> Box<dyn Policy> {
        match self {
            PolicyKind::KvAware => Box::new(KvAware),
            PolicyKind::LeastLoaded => Box::new(LeastLoaded),
            PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        }
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "kv-aware" => Ok(PolicyKind::KvAware),
            "least-loaded" => Ok(PolicyKind::LeastLoaded),
            "round-robin" => Ok(PolicyKind::RoundRobin),
            other => Err(format!("unknown policy `{other}` (expected kv-aware, least-loaded or round-robin)")),
        }
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    pub fn ask() -> Ask<'static> {
        Ask { prompt_len: 100, block_hashes: &[] }
    }

    pub fn cand(name: &'static str, load: usize) -> Candidate<'static> {
        Candidate {
            name,
            role: Role::Mixed,
            load,
            queued_seconds: 0.0,
            cached_tokens: 0,
            restore_seconds: 0.0,
            seconds_per_token: 1e-3,
            fixed_seconds: 0.0,
        }
    }
}
