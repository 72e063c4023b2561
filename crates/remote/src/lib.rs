//! Workers in other processes.
//!
//! ```text
//! frontend process                      worker process (pdserve worker)
//!   Router ─► RemoteWorker ══control══► WorkerServer ─► Worker (engine thread)
//!                                          prefill: KvSink ══KV link══► decode process's Inboxes
//! ```
//!
//! The control connection ([`wire`]) carries calls and token events; KV goes from
//! the prefill process straight to the decode process over TCP or shared memory,
//! never through the router. [`linked`] holds the pieces both the in-process router
//! and the worker processes use to run the two ends of a KV link.

mod client;
pub mod linked;
mod links;
mod server;
pub mod wire;

pub use client::{CancelOnDrop, ConnectError, PrefillCall, Prefilled, RemoteWorker};
pub use server::WorkerServer;
pub use wire::{KvAddr, WorkerInfo, PROTOCOL_VERSION};
