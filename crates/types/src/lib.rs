//! Shared vocabulary of pdserve: newtype ids, sampling parameters, worker roles, and
//! the seeded random-number generator the sampler and the benchmarks share.
//!
//! Sits under every other crate on the request path; it does no I/O and owns no state.

mod ids;
pub mod rng;
mod role;
mod sampling;

pub use ids::{RequestId, TokenId};
pub use role::Role;
pub use sampling::{SamplingError, SamplingParams, StopCondition};
