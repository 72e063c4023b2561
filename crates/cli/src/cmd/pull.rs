//! `pdserve pull`: fetch and verify the default model.

pub fn run() -> anyhow::Result<()> {
    let path = pdserve_engine::models::pull_default(&mut |m| eprintln!("{m}"))?;
    println!("{}", path.display());
    Ok(())
}
