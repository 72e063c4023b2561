//! pdserve's inference engine: everything below the worker on the request path.
//!
//! A worker hands the engine validated requests; the engine tokenizes nothing itself
//! (the tokenizer, chat templates and grammars live in `pdserve-text`, re-exported
//! here), schedules sequences with
//! continuous batching over a paged KV cache, runs the model on our own SIMD kernels,
//! samples, and returns tokens. It can also export a sequence's KV layer by layer and
//! import it on another engine, which is what disaggregated serving is built on.

pub mod batch;
pub mod bench;
pub mod config;
pub mod format;
pub mod kernels;
pub mod kvcache;
pub mod loader;
pub mod model;
pub mod models;
pub mod perplexity;
pub mod pipeline;
pub mod sampler;
pub mod testing;
pub mod threadpool;
pub mod tiers;
pub mod timed;

pub use pdserve_text::{chat, grammar, tokenizer};

pub use batch::{Engine, EngineConfig, EngineError};
