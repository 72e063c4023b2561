//! Shared vocabulary of pdserve: newtype ids, sampling parameters and worker roles.
//!
//! Sits under every other crate on the request path; it does no I/O and owns no state.

mod ids;
mod role;
mod sampling;

pub use ids::{RequestId, TokenId};
pub use role::Role;
pub use sampling::{SamplingError, SamplingParams, StopCondition};
