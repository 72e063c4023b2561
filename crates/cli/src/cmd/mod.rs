pub mod bench;
pub mod frontend;
pub mod generate;
mod http;
pub mod pull;
pub mod serve;
pub mod worker;

use anyhow::Context;
use pdserve_engine::loader::{self, LoadedModel, ModelMeta};
use std::path::PathBuf;

/// Resolves `default` or a path, fetching the default model on first use.
fn model_path(spec: &str) -> anyhow::Result<PathBuf> {
    Ok(if spec == "default" {
        pdserve_engine::models::pull_default(&mut |m| eprintln!("{m}"))?
    } else {
        pdserve_engine::models::resolve(spec)?
    })
}

/// Loads a model (weights included) from `default` or a path.
pub fn load_model(spec: &str) -> anyhow::Result<LoadedModel> {
    let path = model_path(spec)?;
    loader::load(&path).with_context(|| format!("cannot load model {}", path.display()))
}

/// Loads only what a frontend needs of a model.
pub fn load_meta(spec: &str) -> anyhow::Result<ModelMeta> {
    let path = model_path(spec)?;
    loader::load_meta(&path).with_context(|| format!("cannot load model {}", path.display()))
}
