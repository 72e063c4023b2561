use serde::{Deserialize, Serialize};
use std::fmt;

/// A vocabulary index.
pub type TokenId = u32;

/// Identifies one user request across every hop (frontend, router, workers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{:x}", self.0)
    }
}
