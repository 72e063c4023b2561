//! Shared vocabulary of pdserve: newtype ids, sampling parameters, worker roles, the
//! token and KV-frame values every hop passes on, the seeded random-number generator
//! the sampler and the benchmarks share, and the checksum of KV bytes on the wire
//! and on disk.
//!
//! Sits under every other crate on the request path; it does no I/O and owns no state.

pub mod civil;
pub mod crc32c;
mod grammar;
mod ids;
mod kv;
mod lock;
mod millis;
mod prefix;
pub mod rng;
mod role;
mod sampling;
mod steps;
mod token;
mod traffic;
mod transfer;

pub use grammar::{Grammar, GrammarSpec};
pub use ids::{RequestId, TokenId};
pub use kv::{KvDtype, KvFrame};
pub use lock::lock;
pub use millis::{millis, round_ms};
pub use prefix::{BlockHash, KvEvent, PoolStats, Tier, TierCounters, TierStats};
pub use role::{Assignment, Epoch, Role};
pub use sampling::{DraftRecord, Pooling, SamplingError, SamplingParams, StopCondition, MAX_STOP_TOKEN_IDS};
pub use steps::{DecodeSteps, PrefillSteps, SpecTotals, StageCompute, StageTotals, StepFit};
pub use token::{FinishReason, TokenOut};
pub use traffic::RequestSample;
pub use transfer::{HandoffToken, InProcTarget, KvAddr, KvTarget, StageReceiver, TransportKind};
