//! Workers in other processes.
//!
//! ```text
//! frontend process                      worker process (pdserve worker)
//!   Router ─► RemoteWorker ══control══► WorkerServer ─► LocalWorker (engine thread)
//!                                          prefill: KV sink ══KV link══► decode process's receiver
//! ```
//!
//! [`RemoteWorker`] and [`WorkerServer`] carry the one worker surface
//! ([`pdserve_protocol::Worker`]) over the [`control`] protocol: the client turns
//! each operation into a call, the server runs each call on the worker it serves.
//! KV goes from the prefill process straight to the decode process over TCP or shared
//! memory, never through the router.

mod asks;
mod client;
pub mod control;
mod server;
mod supervise;

pub use client::{ConnectError, RemoteWorker};
pub use control::{Handshake, PROTOCOL_VERSION};
pub use server::WorkerServer;
pub use supervise::keep_connected;
