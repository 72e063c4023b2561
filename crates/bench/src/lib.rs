//! pdserve's serving benchmarks.
//!
//! - `bench load` ([`load`]): an OpenAI-compatible load generator that works against
//!   any such server (pdserve, llama-server, vLLM): completions or chat, streamed;
//!   closed loop at given concurrencies or open loop at given rates (Poisson or gamma
//!   arrivals); fixed or distributed lengths; random-token or text prompts, or prompts of a file;
//!   shared prefixes; Mooncake-format trace replay.
//! - `bench compare` ([`compare`]): starts each serving topology of a compute budget
//!   in turn, sweeps workloads × concurrencies against it, and reports tables, plots
//!   and where disaggregation overtakes replication.
//!
//! Metric definitions are pinned in [`metrics`] and in docs/bench.md. A server that
//! misbehaves never makes this crate fail: a bad response is a failed request record.

pub mod analysis;
pub mod arrivals;
pub mod calibrate;
pub mod client;
pub mod compare;
pub mod error;
pub mod fake_server;
pub mod jsonl;
pub mod lengths;
pub mod load;
pub mod metrics;
pub mod openai;
pub mod phases;
pub mod point;
pub mod process;
pub mod progress;
pub mod prompt;
pub mod prompts_file;
pub mod record;
pub mod report;
pub mod reuse;
pub mod rng;
pub mod runner;
pub mod sse;
pub mod target;
pub mod topology;
pub mod trace;
pub mod workload;

pub use error::{BenchError, Result};
