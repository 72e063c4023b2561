//! `pdserve pull [NAME]`: fetch and verify a known model (the default one unless
//! named), or list them.

use pdserve_engine::models::{self, PullError};

#[derive(clap::Args)]
pub struct Args {
    /// A known model's name (see --list) [default: the default model].
    name: Option<String>,
    /// List the models pull knows, and where each is cached.
    #[arg(long, conflicts_with = "name")]
    list: bool,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    if args.list {
        for k in models::KNOWN {
            let path = models::cached(k);
            let state = if path.exists() { "pulled" } else { "not pulled" };
            println!("{:<14} {} ({state}: {})", k.name, k.about, path.display());
        }
        return Ok(());
    }
    let name = args.name.as_deref().unwrap_or("default");
    let known = models::known(name).ok_or_else(|| PullError::Unknown(name.to_string()))?;
    let path = models::pull(known, &mut |m| tracing::info!("{m}"))?;
    println!("{}", path.display());
    Ok(())
}
