//! What pdserve's tests share, so no test suite writes its own:
//!
//! - [`fake`]: a model-free worker behind the real worker surface, with real KV
//!   transfer and switchable faults (router, handoff and control-protocol tests);
//! - [`http`]: a raw HTTP/1.1 + SSE test client;
//! - [`bodies`]: random request bodies for the API, and the check of their answers;
//! - [`rng`]: the project's seeded generator, for random workloads in tests.
//!
//! Test-only code: the lints that deny `unwrap` elsewhere are relaxed here, since a
//! failed test step should panic with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod bodies;
pub mod fake;
pub mod http;

pub use fake::FakeWorker;
pub use pdserve_types::rng;
