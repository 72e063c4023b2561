//! How pdserve reports on itself: every Prometheus metric of every process
//! ([`metrics`]), structured logs ([`logging`]) and spans exported to an
//! OpenTelemetry collector ([`otlp`]). Every request's span carries its
//! `request_id`, in every process it crosses.

pub mod logging;
pub mod metrics;
pub mod otlp;

pub use logging::{init, LogFormat};
