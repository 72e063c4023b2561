//! Routing modes.

use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every request prefills and decodes on one worker.
    Aggregated,
    /// Every request prefills on a prefill worker and decodes elsewhere.
    Disaggregated,
    /// Per request: prefill on the decode worker itself or on another worker,
    /// whichever the live cost model predicts gives the first token sooner.
    Auto,
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "aggregated" => Ok(Mode::Aggregated),
            "disaggregated" => Ok(Mode::Disaggregated),
            "auto" => Ok(Mode::Auto),
            other => Err(format!("unknown mode `{other}` (expected aggregated, disaggregated or auto)")),
        }
    }
}
