//! One request as the planner sees it: what it asked for when it came, and how it
//! went when it ended. A router records these; a fleet's frontends publish them for
//! a planner in another process.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RequestSample {
    Arrived {
        prompt: usize,
        max_tokens: usize,
    },
    /// `ttft` and `tpot` in seconds, when it had a first (and a second) token.
    Ended {
        out: usize,
        max_tokens: usize,
        ttft: Option<f64>,
        tpot: Option<f64>,
        failed: bool,
    },
}
