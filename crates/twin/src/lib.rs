//! pdserve's twin: the same router, planner and worker loop driven by a virtual clock
//! and by per-phase costs calibrated on a real machine.
//!
//! - [`profile`]: what a worker shape costs (`pdserve profile` writes it; [`measure`]
//!   times it on this machine).
//! - [`sim`]: a topology under a `bench load` workload on a virtual clock
//!   (`pdserve sim`), with `bench load`'s records and summaries as output.
//! - [`group`]: a worker split by layers across nodes (a stage group): its step
//!   cost over the links and its cache.
//! - [`plan`]: every topology of N nodes simulated over a concurrency sweep, ranked
//!   by goodput, with the crossover and the advice (`pdserve plan`).

pub mod group;
pub mod measure;
pub mod plan;
pub mod profile;
pub mod sim;
pub mod versus;

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TwinError {
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

impl TwinError {
    pub fn io(path: &Path, source: std::io::Error) -> TwinError {
        TwinError::Io { path: path.to_path_buf(), source }
    }
}
