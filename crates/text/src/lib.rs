//! pdserve's text layer: what turns text into token ids and back, what renders a
//! conversation into a prompt, and what constrains sampling to a grammar. The
//! frontend uses it without compiling the engine's kernels; the engine builds its
//! tokenizer from a model file's metadata through [`meta::Metadata`].

pub mod chat;
pub mod grammar;
pub mod meta;
pub mod tokenizer;
