//! `hf:ORG/REPO[:QUANT]`: a GGUF from the Hugging Face Hub, as `llama-server -hf`
//! fetches one.
//!
//! The repository's file list (`/api/models/ORG/REPO/tree/main?recursive=true`) names
//! each file with its size and, for large (LFS) files, its sha256. [`choose`] picks the
//! GGUF of the quant asked for (Q4_K_M when none is), every part of a split one;
//! each is fetched from `/ORG/REPO/resolve/main/PATH` into `FILE.part`, resumed with
//! a `Range` request when a `.part` is already there, and checked against the hub's
//! sha256 before it takes its name. `HF_ENDPOINT` replaces `https://huggingface.co`
//! (a mirror, or a test's server); `HF_TOKEN` is sent as a bearer token (gated and
//! private repositories). Files land in `CACHE/models/hf/ORG/REPO/`, where `--model
//! hf:...` finds them again without the network.

use pdserve_engine::models::cache_dir;
use serde::Deserialize;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The quant picked when a reference names none (llama-server's default too).
const DEFAULT_QUANT: &str = "Q4_K_M";

/// A parsed `hf:ORG/REPO[:QUANT]`.
#[derive(Debug, Clone, PartialEq)]
pub struct HubRef {
    pub repo: String,
    pub quant: Option<String>,
}

impl HubRef {
    /// `None` when `spec` is not a hub reference; an error when it is one, malformed.
    pub fn parse(spec: &str) -> Option<anyhow::Result<HubRef>> {
        let rest = spec.strip_prefix("hf:")?;
        let (repo, quant) = match rest.split_once(':') {
            Some((r, q)) => (r, Some(q.to_string())),
            None => (rest, None),
        };
        let parts: Vec<&str> = repo.split('/').collect();
        let valid = |p: &&str| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if parts.len() != 2 || !parts.iter().all(valid) || parts.contains(&"..") || quant.as_deref() == Some("") {
            return Some(Err(anyhow::anyhow!(
                "`{spec}` is not a hub reference: write hf:ORG/REPO or hf:ORG/REPO:QUANT"
            )));
        }
        Some(Ok(HubRef { repo: repo.to_string(), quant }))
    }

    /// Where its files are kept.
    pub fn dir(&self) -> PathBuf {
        cache_dir().join("models").join("hf").join(&self.repo)
    }
}

/// One file of a repository, as the hub lists it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct HubFile {
    pub path: String,
    #[serde(default)]
    pub size: u64,
    /// Large files are stored in LFS, whose `oid` is the content's sha256.
    pub lfs: Option<Lfs>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Lfs {
    pub oid: String,
}

/// The GGUF file(s) of `quant` (default [`DEFAULT_QUANT`]) among `paths`: one file, or
/// every part of a split one in order. Projector files (`mmproj`) are never picked.
pub fn choose<'a>(paths: &[&'a str], quant: Option<&str>) -> Result<Vec<&'a str>, String> {
    let ggufs: Vec<&str> =
        paths.iter().copied().filter(|p| p.ends_with(".gguf") && !p.to_lowercase().contains("mmproj")).collect();
    if ggufs.is_empty() {
        return Err("the repository has no GGUF file".into());
    }
    let want = quant.unwrap_or(DEFAULT_QUANT);
    let mut hits: Vec<&str> = ggufs.iter().copied().filter(|p| names_quant(p, want)).collect();
    if hits.is_empty() && quant.is_none() && ggufs.len() == 1 {
        hits = ggufs.clone();
    }
    hits.sort_unstable();
    let first_parts: Vec<&str> = hits.iter().copied().filter(|p| split_part(p).is_none_or(|(no, _)| no == 1)).collect();
    match first_parts.as_slice() {
        [one] => Ok(match split_part(one) {
            Some((_, count)) => hits.into_iter().filter(|p| same_split(p, one)).take(count).collect(),
            None => vec![*one],
        }),
        [] => Err(format!("no GGUF of quant {want}; the repository has: {}", ggufs.join(", "))),
        many => Err(format!("several GGUF files are quant {want}: {}; name one more exactly", many.join(", "))),
    }
}

/// Whether `path`'s file name names `quant` as a whole word (`Q4_K` is not `Q4_K_M`).
fn names_quant(path: &str, quant: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path).to_lowercase();
    let quant = quant.to_lowercase();
    let word = |c: Option<char>| c.is_none_or(|c| !c.is_ascii_alphanumeric() && c != '_');
    name.match_indices(&quant)
        .any(|(i, _)| word(name[..i].chars().last()) && word(name[i + quant.len()..].chars().next()))
}

/// `NAME-00002-of-00003.gguf` → (2, 3).
fn split_part(path: &str) -> Option<(usize, usize)> {
    let stem = path.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (_, no) = rest.rsplit_once('-')?;
    Some((no.parse().ok()?, count.parse().ok()?))
}

/// Whether `path` is a part of the same split file as `first`.
fn same_split(path: &str, first: &str) -> bool {
    let prefix =
        |p: &str| p.rsplit_once("-of-").and_then(|(rest, _)| rest.rsplit_once('-')).map(|(head, _)| head.to_string());
    prefix(path) == prefix(first) && split_part(path).is_some()
}

/// The first (or only) file of `r`'s quant in the cache, if it was pulled.
pub fn cached(r: &HubRef) -> Option<PathBuf> {
    let dir = r.dir();
    let names: Vec<String> =
        walk(&dir).iter().filter_map(|p| Some(p.strip_prefix(&dir).ok()?.to_str()?.to_string())).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let chosen = choose(&refs, r.quant.as_deref()).ok()?;
    chosen.iter().all(|p| dir.join(p).exists()).then(|| dir.join(chosen[0]))
}

/// Every file under `dir`, recursively; `.part` files are not finished ones.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else if p.extension().is_some_and(|x| x == "gguf") {
            out.push(p);
        }
    }
    out
}

/// The hub's address: `$HF_ENDPOINT`, else huggingface.co.
fn endpoint() -> String {
    std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into()).trim_end_matches('/').to_string()
}

struct Hub {
    agent: ureq::Agent,
    endpoint: String,
    token: Option<String>,
}

impl Hub {
    fn new() -> Hub {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(20)))
            .user_agent(concat!("pdserve/", env!("CARGO_PKG_VERSION")))
            .build();
        let token = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty());
        Hub { agent: config.into(), endpoint: endpoint(), token }
    }

    fn get(&self, url: &str, range_from: u64) -> anyhow::Result<ureq::http::Response<ureq::Body>> {
        let mut req = self.agent.get(url);
        if let Some(t) = &self.token {
            req = req.header("Authorization", &format!("Bearer {t}"));
        }
        if range_from > 0 {
            req = req.header("Range", &format!("bytes={range_from}-"));
        }
        req.call().map_err(|e| anyhow::anyhow!("cannot reach {url}: {e}"))
    }

    /// The repository's files.
    fn files(&self, repo: &str) -> anyhow::Result<Vec<HubFile>> {
        let url = format!("{}/api/models/{repo}/tree/main?recursive=true", self.endpoint);
        let mut resp = self.get(&url, 0)?;
        let status = resp.status().as_u16();
        let body = resp.body_mut().read_to_string().unwrap_or_default();
        match status {
            200 => serde_json::from_str(&body)
                .map_err(|e| anyhow::anyhow!("the hub's file list of {repo} is not JSON: {e}")),
            401 | 403 => anyhow::bail!("{repo}: access denied ({status}); set HF_TOKEN to a token that may read it"),
            404 => anyhow::bail!("{repo}: no such repository on {}", self.endpoint),
            _ => anyhow::bail!("{repo}: the hub answered {status}: {}", body.chars().take(200).collect::<String>()),
        }
    }

    /// Fetches `f` into `dest`, resuming a `.part` left by an earlier try, and checks
    /// its sha256 when the hub gives one.
    fn fetch(&self, repo: &str, f: &HubFile, dest: &Path, log: &mut dyn FnMut(&str)) -> anyhow::Result<()> {
        let part = dest.with_extension("gguf.part");
        let have = std::fs::metadata(&part).map_or(0, |m| m.len());
        let url = format!("{}/{repo}/resolve/main/{}", self.endpoint, f.path);
        let mut resp = self.get(&url, have)?;
        let status = resp.status().as_u16();
        let append = match status {
            206 => true,
            200 => false,
            416 if have == f.size => true,
            401 | 403 => anyhow::bail!("{}: access denied ({status}); set HF_TOKEN", f.path),
            _ => anyhow::bail!("{}: the hub answered {status}", f.path),
        };
        if append && have > 0 {
            log(&format!("resuming {} at {:.1} MB", f.path, have as f64 / 1e6));
        }
        let mut out =
            std::fs::OpenOptions::new().create(true).write(true).append(append).truncate(!append).open(&part)?;
        if status != 416 {
            let start = if append { have } else { 0 };
            copy_with_progress(&mut resp.body_mut().as_reader(), &mut out, start, f.size, &f.path)?;
        }
        drop(out);
        if let Some(want) = f.lfs.as_ref().map(|l| l.oid.as_str()) {
            let got = sha256_of(&part)?;
            if got != want {
                std::fs::remove_file(&part)?;
                anyhow::bail!(
                    "{}: sha256 {got} is not the hub's {want}; the partial file was removed, pull again",
                    f.path
                );
            }
        }
        std::fs::rename(&part, dest)?;
        Ok(())
    }
}

/// Copies `from` to `to`, drawing a progress line on stderr when it is a terminal.
fn copy_with_progress(
    from: &mut dyn Read,
    to: &mut dyn Write,
    start: u64,
    total: u64,
    name: &str,
) -> anyhow::Result<()> {
    let terminal = std::io::stderr().is_terminal();
    let (mut done, mut buf, mut drawn) = (start, vec![0u8; 1 << 20], Instant::now());
    let stopped = |done: u64, why: &dyn std::fmt::Display| {
        anyhow::anyhow!("{name}: the download stopped at {done} of {total} bytes ({why}); pull again to resume")
    };
    loop {
        let n = from.read(&mut buf).map_err(|e| stopped(done, &e))?;
        if n == 0 {
            break;
        }
        to.write_all(&buf[..n])?;
        done += n as u64;
        if terminal && (drawn.elapsed() > Duration::from_millis(200) || done == total) {
            let pct = if total > 0 { done as f64 * 100.0 / total as f64 } else { 0.0 };
            eprint!("\r{name}: {:.1} / {:.1} MB ({pct:.0}%)", done as f64 / 1e6, total as f64 / 1e6);
            drawn = Instant::now();
        }
    }
    if terminal {
        eprintln!();
    }
    if total > 0 && done != total {
        return Err(stopped(done, &"the connection closed"));
    }
    Ok(())
}

fn sha256_of(path: &Path) -> anyhow::Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Fetches `r`'s GGUF (every part of a split one) unless it is cached; returns the
/// first file's path.
pub fn pull(r: &HubRef, log: &mut dyn FnMut(&str)) -> anyhow::Result<PathBuf> {
    let hub = Hub::new();
    let files = hub.files(&r.repo)?;
    let paths: Vec<&str> = files.iter().map(|f| f.path.as_str()).collect();
    let chosen = choose(&paths, r.quant.as_deref()).map_err(|e| anyhow::anyhow!("{}: {e}", r.repo))?;
    let dir = r.dir();
    for path in &chosen {
        let f = files.iter().find(|f| f.path == *path).ok_or_else(|| anyhow::anyhow!("{path} vanished"))?;
        let dest = dir.join(path);
        if dest.exists() && f.lfs.as_ref().is_none_or(|l| sha256_of(&dest).is_ok_and(|s| s == l.oid)) {
            log(&format!("already present: {}", dest.display()));
            continue;
        }
        std::fs::create_dir_all(dest.parent().unwrap_or(&dir))?;
        log(&format!("fetching {}/{path} ({:.1} MB)", r.repo, f.size as f64 / 1e6));
        hub.fetch(&r.repo, f, &dest, log)?;
    }
    let first = dir.join(chosen[0]);
    log(&format!("model ready: {}", first.display()));
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_or_say_how_to_write_them() {
        let ok = |s: &str| HubRef::parse(s).unwrap().unwrap();
        assert_eq!(ok("hf:org/repo"), HubRef { repo: "org/repo".into(), quant: None });
        assert_eq!(ok("hf:unsloth/Qwen3-8B-GGUF:Q8_0").quant.as_deref(), Some("Q8_0"));
        assert!(HubRef::parse("default").is_none() && HubRef::parse("/models/x.gguf").is_none());
        for bad in ["hf:", "hf:repo", "hf:a/b/c", "hf:a/..", "hf:org/repo:", "hf:o rg/repo"] {
            assert!(HubRef::parse(bad).unwrap().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_quant_asked_for_is_picked_with_every_split_part() {
        let repo = [
            "README.md",
            "model-Q4_K.gguf",
            "model-Q4_K_M.gguf",
            "model-q8_0.gguf",
            "mmproj-model-f16.gguf",
            "BF16/model-BF16-00002-of-00002.gguf",
            "BF16/model-BF16-00001-of-00002.gguf",
            "Q6_K/a-Q6_K.gguf",
            "Q6_K/b-Q6_K.gguf",
        ];
        type Case<'a> = (Option<&'a str>, Result<Vec<&'a str>, &'a str>);
        let table: [Case; 7] = [
            (None, Ok(vec!["model-Q4_K_M.gguf"])),
            (Some("Q4_K"), Ok(vec!["model-Q4_K.gguf"])),
            (Some("Q8_0"), Ok(vec!["model-q8_0.gguf"])),
            (Some("bf16"), Ok(vec!["BF16/model-BF16-00001-of-00002.gguf", "BF16/model-BF16-00002-of-00002.gguf"])),
            (Some("Q6_K"), Err("several")),
            (Some("Q2_K"), Err("no GGUF of quant Q2_K")),
            (Some("f16"), Err("no GGUF of quant f16")),
        ];
        for (quant, want) in table {
            match (choose(&repo, quant), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{quant:?}"),
                (Err(e), Err(says)) => assert!(e.contains(says), "{quant:?}: {e}"),
                (got, want) => panic!("{quant:?}: {got:?}, wanted {want:?}"),
            }
        }
        assert_eq!(choose(&["only.gguf"], None).unwrap(), ["only.gguf"], "a lone GGUF is the default");
        assert!(choose(&["README.md"], None).unwrap_err().contains("no GGUF"));
    }
}
