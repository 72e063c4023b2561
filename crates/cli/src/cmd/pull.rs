//! `pdserve pull [NAME]`: fetch and verify a known model (the default one unless
//! named) or a GGUF from the Hugging Face Hub (`hf:ORG/REPO[:QUANT]`), or list the
//! known ones; `pdserve models`: what the cache holds.

use crate::hub::{self, HubRef};
use pdserve_engine::models::{self, PullError};
use std::path::Path;

#[derive(clap::Args)]
pub struct Args {
    /// A known model's name (see --list) or hf:ORG/REPO[:QUANT] (a GGUF from the
    /// Hugging Face Hub; $HF_ENDPOINT and $HF_TOKEN are honoured) [default: the
    /// default model].
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
    let log = &mut |m: &str| tracing::info!("{m}");
    let path = match HubRef::parse(name) {
        Some(r) => hub::pull(&r?, log)?,
        None => {
            let known = models::known(name).ok_or_else(|| PullError::Unknown(name.to_string()))?;
            models::pull(known, log)?
        }
    };
    println!("{}", path.display());
    Ok(())
}

/// `pdserve models`: each cached model's name (as `--model` takes it), size and path.
pub fn list_cached() -> anyhow::Result<()> {
    let mut rows: Vec<(String, u64, String)> = Vec::new();
    for k in models::KNOWN {
        let path = models::cached(k);
        if let Ok(m) = std::fs::metadata(&path) {
            rows.push((k.name.to_string(), m.len(), path.display().to_string()));
        }
    }
    let hub_dir = models::cache_dir().join("models").join("hf");
    for (repo, file, size) in hub_files(&hub_dir) {
        let quant = quant_of(&file).map(|q| format!(":{q}")).unwrap_or_default();
        rows.push((format!("hf:{repo}{quant}"), size, hub_dir.join(&repo).join(&file).display().to_string()));
    }
    if rows.is_empty() {
        println!("no models cached in {}; `pdserve pull` fetches the default one", models::cache_dir().display());
    }
    for (name, size, path) in rows {
        println!("{name:<40} {:>9.1} MB  {path}", size as f64 / 1e6);
    }
    Ok(())
}

/// (ORG/REPO, file under it, size) of every finished GGUF pulled from the hub; of a
/// split file, its first part with the size of all its parts.
fn hub_files(dir: &Path) -> Vec<(String, String, u64)> {
    let mut out = Vec::new();
    for org in read_dirs(dir) {
        for repo in read_dirs(&org) {
            let name = format!("{}/{}", file_name(&org), file_name(&repo));
            let files = gguf_files(&repo, &repo);
            for (file, _) in files.iter().filter(|(f, _)| !f.contains("-of-") || f.contains("-00001-of-")) {
                let stem = file.split("-00001-of-").next().unwrap_or(file);
                let size = files.iter().filter(|(f, _)| f.starts_with(stem)).map(|(_, s)| s).sum();
                out.push((name.clone(), file.clone(), size));
            }
        }
    }
    out
}

fn read_dirs(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<_> =
        std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    dirs
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// GGUF files under `dir`, as paths relative to `root`, with their sizes.
fn gguf_files(dir: &Path, root: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(gguf_files(&p, root));
        } else if p.extension().is_some_and(|x| x == "gguf") {
            let rel = p.strip_prefix(root).map(|r| r.display().to_string()).unwrap_or_default();
            out.push((rel, e.metadata().map_or(0, |m| m.len())));
        }
    }
    out.sort();
    out
}

/// The quant a GGUF's name ends with (`model-Q4_K_M.gguf` → `Q4_K_M`), as `hf:` names
/// it; `None` when the name carries none.
fn quant_of(file: &str) -> Option<String> {
    let name = file.rsplit('/').next()?.strip_suffix(".gguf")?;
    let name = name.split("-00001-of-").next()?;
    let last = name.rsplit(['-', '.']).next()?;
    let quant = last.starts_with(['Q', 'q', 'F', 'f', 'B', 'b', 'I', 'i']) && last.chars().any(|c| c.is_ascii_digit());
    quant.then(|| last.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_files_quant_is_its_last_word() {
        for (file, quant) in [
            ("model-Q4_K_M.gguf", Some("Q4_K_M")),
            ("Qwen3-8B.q8_0.gguf", Some("q8_0")),
            ("BF16/model-BF16-00001-of-00002.gguf", Some("BF16")),
            ("model.gguf", None),
            ("gemma-3-270m-it.gguf", None),
        ] {
            assert_eq!(quant_of(file).as_deref(), quant, "{file}");
        }
    }
}
