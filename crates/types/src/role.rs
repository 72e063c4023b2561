use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// What a worker does with requests: only prompts, only generation, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    Mixed,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Mixed => "mixed",
        })
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "mixed" => Ok(Role::Mixed),
            other => Err(format!("unknown role `{other}` (expected prefill, decode or mixed)")),
        }
    }
}

/// Counts a worker's role changes. Work is dispatched for the `(role, epoch)` the
/// router saw; a worker refuses work for an older epoch (fencing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Epoch(pub u64);

impl Epoch {
    /// The epoch after this one; the last stays last (a wrap to 0 would make
    /// every later assignment look older).
    pub fn next(self) -> Epoch {
        Epoch(self.0.saturating_add(1))
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Role {
    /// Whether the role takes decodes (and so receives KV).
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Mixed)
    }

    /// Whether the role takes remote prefills for other workers.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Mixed)
    }
}

/// A worker's role and the epoch it took it at: what a router routes by, and what
/// a worker checks each new piece of work against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Assignment {
    pub role: Role,
    pub epoch: Epoch,
}

impl Assignment {
    pub fn new(role: Role, epoch: Epoch) -> Self {
        Assignment { role, epoch }
    }

    /// The next assignment, to `role`.
    pub fn switch(self, role: Role) -> Self {
        Assignment { role, epoch: self.epoch.next() }
    }
}

impl fmt::Display for Assignment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.role, self.epoch)
    }
}
