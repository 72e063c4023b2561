pub mod bench;
mod bench_migrate;
mod bench_switch;
mod bench_tiers;
pub mod fleet;
pub mod frontend;
pub mod generate;
mod http;
pub mod perplexity;
pub mod planner;
pub use http::Stopped;
pub mod pull;
pub mod serve;
pub mod stage;
pub mod twin;
pub mod worker;
mod workload;

use anyhow::Context;
use pdserve_engine::batch::{DraftModel, SpecConfig};
use pdserve_engine::grammar::Grammars;
use pdserve_engine::loader::{self, LoadedModel, ModelMeta};
use pdserve_engine::tokenizer::Tokenizer;
use pdserve_types::KvDtype;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Resolves `default`, a known model's name, `hf:ORG/REPO[:QUANT]` or a path,
/// fetching a known or hub model on first use.
fn model_path(spec: &str) -> anyhow::Result<PathBuf> {
    use pdserve_engine::models;
    let log = &mut |m: &str| tracing::info!("{m}");
    if let Some(hub) = crate::hub::HubRef::parse(spec) {
        let hub = hub?;
        return match crate::hub::cached(&hub) {
            Some(path) => Ok(path),
            None => crate::hub::pull(&hub, log),
        };
    }
    Ok(match models::known(spec) {
        Some(k) => models::pull(k, log)?,
        None => models::resolve(spec)?,
    })
}

/// Loads a model (weights included) from `default`, a known name or a path.
pub fn load_model(spec: &str) -> anyhow::Result<LoadedModel> {
    load_model_layers(spec, None)
}

/// [`load_model`], only `layers` of it when given (a pipeline stage).
pub fn load_model_layers(spec: &str, layers: Option<pdserve_engine::model::LayerRange>) -> anyhow::Result<LoadedModel> {
    let path = model_path(spec)?;
    loader::load_layers(&path, layers).with_context(|| format!("cannot load model {}", path.display()))
}

/// The grammar compiler of a model's vocabulary, for constrained outputs; without
/// one (a vocabulary llguidance cannot use) such requests are refused with a 400.
pub fn grammars(tokenizer: &Arc<Tokenizer>) -> Option<Arc<Grammars>> {
    match Grammars::new(tokenizer.clone()) {
        Ok(g) => Some(Arc::new(g)),
        Err(e) => {
            tracing::warn!(error = %e, "constrained outputs are off");
            None
        }
    }
}

/// Loads only what a frontend needs of a model.
pub fn load_meta(spec: &str) -> anyhow::Result<ModelMeta> {
    let path = model_path(spec)?;
    loader::load_meta(&path).with_context(|| format!("cannot load model {}", path.display()))
}

/// The path of a Unix socket named `name` in this process's runtime directory.
fn socket_path(name: &str) -> anyhow::Result<PathBuf> {
    Ok(runtime_dir::get()?.join(format!("{name}.sock")))
}

/// A directory per process for its sockets, `$TMPDIR/pdserve-<pid>`: created on first
/// use (after removing those left by processes that no longer run) and removed at
/// exit, so a killed worker leaves nothing behind for long.
pub mod runtime_dir {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    static DIR: OnceLock<PathBuf> = OnceLock::new();

    pub fn get() -> std::io::Result<PathBuf> {
        if let Some(d) = DIR.get() {
            return Ok(d.clone());
        }
        sweep();
        let dir = std::env::temp_dir().join(format!("pdserve-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(DIR.get_or_init(|| dir).clone())
    }

    /// Removes this process's directory (called on the way out).
    pub fn remove() {
        if let Some(d) = DIR.get() {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    /// Removes the directories of pdserve processes that are gone.
    fn sweep() {
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("pdserve-")).and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// The prefix cache's lower tiers, per worker (off by default).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct KvTierArgs {
    /// Host RAM per worker, in GB, for KV blocks evicted from the pool (tier 2): a
    /// prompt that finds its prefix there copies it back instead of recomputing it.
    #[arg(long, default_value_t = 0.0)]
    pub kv_host_gb: f64,
    /// Directory for a disk tier (tier 3) below the host tier: blocks evicted from
    /// host RAM are written there in the background, one file per worker, removed
    /// when it stops.
    #[arg(long, requires = "kv_disk_gb")]
    pub kv_disk_dir: Option<PathBuf>,
    /// Disk per worker for that tier, in GB.
    #[arg(long, default_value_t = 0.0, requires = "kv_disk_dir")]
    pub kv_disk_gb: f64,
}

impl KvTierArgs {
    /// The tiers' sizes in blocks of `block_bytes` (one block of every layer).
    pub fn config(&self, block_bytes: usize) -> anyhow::Result<pdserve_engine::tiers::TierConfig> {
        for (flag, gb) in [("--kv-host-gb", self.kv_host_gb), ("--kv-disk-gb", self.kv_disk_gb)] {
            if !gb.is_finite() || gb < 0.0 {
                anyhow::bail!("{flag} must be a number of gigabytes, 0 or more (got {gb})");
            }
        }
        let blocks = |gb| pdserve_engine::tiers::TierConfig::blocks_in(gb, block_bytes);
        Ok(pdserve_engine::tiers::TierConfig {
            host_blocks: blocks(self.kv_host_gb),
            disk_blocks: blocks(self.kv_disk_gb),
            disk_dir: self.kv_disk_dir.clone(),
        })
    }
}

/// Speculative decoding on the workers that decode.
#[derive(clap::Args, Clone)]
pub struct SpecArgs {
    /// Draft tokens and verify them in one step: `ngram` drafts what followed the
    /// latest earlier occurrence of a request's last tokens in its prompt or output
    /// (prompt lookup); `draft` drafts with --draft-model; `none` decodes one token a
    /// step. Output is the same either way; how much a step verifies follows each
    /// request's acceptance and the worker's measured step costs
    /// (docs/speculative.md).
    #[arg(long, default_value = "none")]
    pub speculative: SpecMode,
    /// The most tokens drafted for one request in one step (vLLM's
    /// --num-speculative-tokens, llama.cpp's --draft-max).
    #[arg(long, default_value_t = 8, alias = "num-speculative-tokens", alias = "draft-max")]
    pub spec_tokens: usize,
    /// How much of each draft a step verifies: `measured` (what each request's
    /// acceptance and the worker's step costs say pays) or `all` (every draft whole,
    /// as vLLM and llama.cpp do).
    #[arg(long, default_value = "measured")]
    pub spec_verify: SpecVerify,
    /// The draft model of `--speculative draft`: a GGUF file (or a name `pdserve
    /// pull` knows) whose vocabulary is the target's, token for token (llama.cpp's
    /// --model-draft).
    #[arg(long, alias = "model-draft")]
    pub draft_model: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecVerify {
    Measured,
    All,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecMode {
    None,
    Ngram,
    Draft,
}

/// The most `--spec-tokens` takes: each drafted row costs a row of logits.
const MAX_SPEC_TOKENS: usize = 32;

impl SpecArgs {
    /// Checks the flags, before any model loads.
    pub fn check(&self) -> anyhow::Result<()> {
        if !(1..=MAX_SPEC_TOKENS).contains(&self.spec_tokens) {
            anyhow::bail!("--spec-tokens must be 1 to {MAX_SPEC_TOKENS} (got {})", self.spec_tokens);
        }
        match (self.speculative, &self.draft_model) {
            (SpecMode::Draft, None) => anyhow::bail!("--speculative draft needs --draft-model"),
            (SpecMode::None | SpecMode::Ngram, Some(_)) => {
                anyhow::bail!("--draft-model is used only with --speculative draft")
            }
            _ => Ok(()),
        }
    }

    /// The engine's speculation settings for `target` (`None`: a simulated worker),
    /// the draft model loaded and its vocabulary checked against the target's.
    pub fn config(&self, target: Option<&LoadedModel>) -> anyhow::Result<Option<SpecConfig>> {
        self.check()?;
        let draft = match (&self.draft_model, target) {
            (None, _) => None,
            (Some(_), None) => anyhow::bail!("--speculative draft needs a real model, not a simulated one"),
            (Some(path), Some(target)) => Some(load_draft(path, target)?),
        };
        let verify_all = self.spec_verify == SpecVerify::All;
        Ok((self.speculative != SpecMode::None).then_some(SpecConfig {
            max_draft: self.spec_tokens,
            verify_all,
            draft,
        }))
    }
}

/// Loads the draft model at `spec` and checks it reads `target`'s token ids.
fn load_draft(spec: &str, target: &LoadedModel) -> anyhow::Result<DraftModel> {
    let draft = load_model(spec).context("--draft-model")?;
    if let Some(diff) = target.tokenizer.vocab_difference(&draft.tokenizer) {
        anyhow::bail!("the draft model's vocabulary is not the target's: {diff}");
    }
    DraftModel::new(draft.model, draft.name, &target.model).map_err(|e| anyhow::anyhow!("--draft-model: {e}"))
}

/// How a worker's KV cache stores K and V, and how much memory its pool takes.
#[derive(clap::Args, Clone, Copy)]
pub struct KvCacheArgs {
    /// How the KV cache stores K and V: f16 | q8_0 | q4_0 (GGUF's blocks of 32
    /// values with one f16 scale, as llama.cpp's --cache-type-k/-v name them). A
    /// quantized cache holds more tokens in the same memory and moves fewer bytes to
    /// decode workers and tiers; its quality is in docs/models.md.
    #[arg(long, default_value = "f16")]
    pub kv_cache_dtype: KvDtype,
    /// Memory of each worker's KV pool, in GB: the blocks it holds follow from the
    /// dtype [default: what 1024 blocks of f16 take; --kv-blocks sets a count instead].
    #[arg(long, conflicts_with = "kv_blocks")]
    pub kv_cache_gb: Option<f64>,
}

impl KvCacheArgs {
    /// Blocks of the pool: `kv_blocks` if given, else the byte budget (--kv-cache-gb,
    /// or what `default_blocks` of f16 take) over a block of this dtype. The block
    /// sizes are of one block of every layer, in f16 and in the chosen dtype.
    pub fn blocks(
        &self,
        kv_blocks: Option<usize>,
        default_blocks: usize,
        f16_block: f64,
        block: f64,
    ) -> anyhow::Result<usize> {
        if let Some(n) = kv_blocks {
            return Ok(n);
        }
        let budget = match self.kv_cache_gb {
            Some(gb) if !(gb.is_finite() && gb > 0.0) => {
                anyhow::bail!("--kv-cache-gb must be a positive number of gigabytes (got {gb})")
            }
            Some(gb) => gb * 1e9,
            None => default_blocks as f64 * f16_block,
        };
        match (budget / block.max(1.0)) as usize {
            0 => anyhow::bail!("--kv-cache-gb {} holds no block of {block} bytes", budget / 1e9),
            n => Ok(n),
        }
    }

    /// The dtype, checked against the model's heads.
    pub fn dtype_for(&self, cfg: &pdserve_engine::config::ModelConfig) -> anyhow::Result<KvDtype> {
        pdserve_engine::kvcache::check_dtype(cfg, self.kv_cache_dtype).map_err(anyhow::Error::msg)?;
        Ok(self.kv_cache_dtype)
    }

    /// Blocks of the pool for a real model.
    pub fn model_blocks(
        &self,
        cfg: &pdserve_engine::config::ModelConfig,
        kv_blocks: Option<usize>,
        default_blocks: usize,
    ) -> anyhow::Result<usize> {
        let block = |d| pdserve_engine::kvcache::block_bytes(cfg, pdserve_engine::batch::BLOCK_SIZE, d) as f64;
        self.blocks(kv_blocks, default_blocks, block(KvDtype::F16), block(self.dtype_for(cfg)?))
    }
}

/// Who may use a worker's ports: the cluster's shared secret.
#[derive(clap::Args)]
pub struct Security {
    /// File holding the cluster's shared secret (at least 16 bytes; make one with
    /// `head -c 32 /dev/urandom | base64 > FILE && chmod 600 FILE`). Workers and
    /// frontends prove it to each other on every control and KV connection.
    #[arg(long, conflicts_with = "insecure")]
    cluster_token_file: Option<PathBuf>,
    /// Run without a cluster token: anyone who can reach the ports may use them.
    #[arg(long)]
    insecure: bool,
}

impl Security {
    fn key(&self) -> anyhow::Result<pdserve_kv_transfer::ClusterKey> {
        match (&self.cluster_token_file, self.insecure) {
            (Some(path), _) => {
                warn_if_exposed(path);
                pdserve_kv_transfer::ClusterKey::from_file(path).map_err(anyhow::Error::msg)
            }
            (None, true) => Ok(pdserve_kv_transfer::ClusterKey::insecure()),
            (None, false) => anyhow::bail!(
                "no cluster token: give --cluster-token-file FILE (make one with `head -c 32 /dev/urandom | base64 > FILE && chmod 600 FILE`), or --insecure to let anyone who reaches the ports in"
            ),
        }
    }
}

/// Warns, once, when more than the owner may read the cluster token (as ssh does for
/// a private key): whoever reads it may use every port of the cluster.
fn warn_if_exposed(path: &Path) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if let Some(mode) = exposed_mode(path) {
        ONCE.call_once(|| {
            tracing::warn!(
                "the cluster token {} has mode {mode:03o}: group or others can read it; run `chmod 600` on it",
                path.display()
            );
        });
    }
}

/// The token file's permission bits, when group or others may read it.
fn exposed_mode(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o044 != 0).then_some(mode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_token_file_others_can_read_is_flagged() {
        let path = std::env::temp_dir().join(format!("pdserve-token-mode-{}", std::process::id()));
        std::fs::write(&path, "0123456789abcdef").unwrap();
        let chmod = |mode| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        chmod(0o644);
        assert_eq!(exposed_mode(&path), Some(0o644));
        chmod(0o640);
        assert_eq!(exposed_mode(&path), Some(0o640));
        chmod(0o600);
        assert_eq!(exposed_mode(&path), None);
        std::fs::remove_file(&path).unwrap();
    }
}
