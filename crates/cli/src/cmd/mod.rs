pub mod bench;
pub mod generate;
pub mod pull;
pub mod serve;

use anyhow::Context;
use pdserve_engine::loader::{self, LoadedModel};

/// Resolves `default` or a path, fetching the default model on first use.
pub fn load_model(spec: &str) -> anyhow::Result<LoadedModel> {
    let path = if spec == "default" {
        pdserve_engine::models::pull_default(&mut |m| eprintln!("{m}"))?
    } else {
        pdserve_engine::models::resolve(spec)?
    };
    loader::load(&path).with_context(|| format!("cannot load model {}", path.display()))
}
