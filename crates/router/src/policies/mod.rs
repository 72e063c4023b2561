//! Worker selection policies, one per file.

mod least_loaded;
mod round_robin;

pub use least_loaded::least_loaded;
pub use round_robin::round_robin;

use std::str::FromStr;

/// How the router picks among workers of the same role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    #[default]
    LeastLoaded,
    RoundRobin,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "least-loaded" => Ok(Policy::LeastLoaded),
            "round-robin" => Ok(Policy::RoundRobin),
            other => Err(format!("unknown policy `{other}` (expected least-loaded or round-robin)")),
        }
    }
}
