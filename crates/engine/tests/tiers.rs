//! The prefix cache's lower tiers on the real model: blocks the pool evicts go to
//! host RAM and then to disk, a prompt that finds them there copies them back
//! instead of recomputing them, and its tokens are the ones a cold run computes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{Engine, EngineConfig, KvFrame, StepOutput};
use pdserve_engine::loader::{self, LoadedModel};
use pdserve_engine::tiers::TierConfig;
use pdserve_kv::TierCounters;
use pdserve_types::rng::Rng;
use pdserve_types::{KvDtype, RequestId, SamplingParams};
use std::path::PathBuf;
use std::sync::OnceLock;

fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| loader::load(&pdserve_engine::models::require_default_model()).unwrap())
}

/// A pool of 24 blocks: three 120-token prompts fill it, so a fourth evicts.
fn engine(tiers: &TierConfig) -> Engine {
    engine_in(tiers, KvDtype::F16)
}

/// [`engine`] with its cache (and so its tiers) stored as `kv_dtype`.
fn engine_in(tiers: &TierConfig, kv_dtype: KvDtype) -> Engine {
    let m = model();
    let cfg = EngineConfig {
        threads: 1,
        num_blocks: 24,
        max_batch_tokens: 512,
        max_seqs: 8,
        cache_salt: 0,
        objectives: None,
        speculation: None,
        kv_dtype,
    };
    Engine::new(m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec()).with_tiers(tiers).unwrap()
}

fn prompt(seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..120).map(|_| rng.range(200, 20_000) as u32).collect()
}

/// Runs one greedy request to its end: its tokens and how many prompt tokens it
/// did not compute.
fn run(e: &mut Engine, id: u64, prompt: &[u32]) -> (Vec<u32>, usize) {
    let params = SamplingParams { max_tokens: 8, ignore_eos: true, ..Default::default() }.validate().unwrap();
    e.add(RequestId(id), prompt.to_vec(), params).unwrap();
    let mut out: Vec<StepOutput> = Vec::new();
    while e.has_work() {
        out.extend(e.step());
    }
    assert_eq!(e.stats().blocks.used, 0, "blocks left in use");
    (out.iter().map(|o| o.sampled.token).collect(), out[0].cached_tokens)
}

/// Runs prompt 0, then enough other prompts to push its blocks out of the pool,
/// then prompt 0 again: (cold tokens, warm tokens, warm cached tokens).
fn evict_and_return(e: &mut Engine) -> (Vec<u32>, Vec<u32>, usize) {
    let (cold, cached) = run(e, 0, &prompt(0));
    assert_eq!(cached, 0);
    for i in 1..=4 {
        run(e, i, &prompt(i));
    }
    let (warm, cached) = run(e, 9, &prompt(0));
    (cold, warm, cached)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdserve-tiers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn without_tiers_an_evicted_prompt_is_computed_again() {
    let (cold, warm, cached) = evict_and_return(&mut engine(&TierConfig::default()));
    assert_eq!(cached, 0, "the prompt should have left the pool");
    assert_eq!(cold, warm);
}

#[test]
fn blocks_evicted_to_host_ram_come_back_with_the_same_tokens() {
    for dtype in KvDtype::ALL {
        host_round_trip(dtype);
    }
}

fn host_round_trip(dtype: KvDtype) {
    let mut e = engine_in(&TierConfig { host_blocks: 64, ..TierConfig::default() }, dtype);
    let (cold, warm, cached) = evict_and_return(&mut e);
    // Every full block but the last (one token is always computed).
    assert_eq!(cached, 112);
    assert_eq!(cold, warm, "restored K/V gave other tokens");
    let s = e.stats();
    assert_eq!(s.tiers.restored_host, 7);
    assert_eq!(s.tiers.restored_disk, 0);
    assert!(s.tiers.stored_host >= 7);
    assert!(s.blocks.host.used > 0 && s.blocks.host.used <= 64);
}

#[test]
fn blocks_pushed_on_to_disk_come_back_with_the_same_tokens() {
    for dtype in KvDtype::ALL {
        disk_round_trip(dtype);
    }
}

fn disk_round_trip(dtype: KvDtype) {
    let dir = scratch(&format!("disk-{dtype}"));
    let tiers = TierConfig { host_blocks: 4, disk_blocks: 64, disk_dir: Some(dir.clone()) };
    let mut e = engine_in(&tiers, dtype);
    let (cold, warm, cached) = evict_and_return(&mut e);
    assert_eq!(cached, 112);
    assert_eq!(cold, warm, "K/V read back from disk gave other tokens");
    let s = e.stats();
    assert!(s.tiers.restored_disk > 0, "{:?}", s.tiers);
    assert!(s.tiers.stored_disk > 0);
    assert_eq!((s.tiers.disk_write_failures, s.tiers.disk_corrupt), (0, 0));
    // The tier file is unlinked once open: nothing is left even if the process is killed.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "a tier file in the directory");
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_disk_tier_that_cannot_be_created_is_a_clear_error() {
    let file = scratch("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let m = model();
    let tiers = TierConfig { host_blocks: 0, disk_blocks: 8, disk_dir: Some(file.join("sub")) };
    let e = Engine::new(m.model.clone(), EngineConfig::default(), vec![]).with_tiers(&tiers);
    let err = e.err().expect("a disk tier under a file").to_string();
    assert!(err.contains("KV disk tier in"), "{err}");
    let _ = std::fs::remove_file(&file);
}

/// One export of a prompt the pool evicted, less its first `skip` tokens.
struct Exported {
    sent: usize,
    frames: Vec<KvFrame>,
    /// The engine's tier counters right after it.
    tiers: TierCounters,
}

/// Pushes prompt 0 out of the pool (with prompts 1–4), then exports it, less its
/// first `skip` tokens, between two layers of another prompt's step, and again
/// between steps once that prompt is done. The frames must be the same.
fn exported_mid_step_then_idle(e: &mut Engine, skip: usize) -> [Exported; 2] {
    let history = prompt(0);
    run(e, 0, &history);
    for i in 1..=4 {
        run(e, i, &prompt(i));
    }
    let params = SamplingParams { max_tokens: 2, ignore_eos: true, ..Default::default() }.validate().unwrap();
    e.add(RequestId(7), prompt(7), params).unwrap();
    let (mut frames, mut served) = (Vec::new(), None);
    e.step_serving(&mut |pool| {
        if served.is_none() {
            served = Some(pool.export(&history, skip, &mut |f| {
                frames.push(f);
                true
            }));
        }
    });
    let mid = Exported { sent: served.unwrap().unwrap(), frames, tiers: e.stats().tiers };
    let dtype = e.config().kv_dtype;
    assert!(mid.frames.iter().all(|f| f.dtype == dtype), "frames carry the cache's form");
    while e.has_work() {
        e.step();
    }
    let mut frames = Vec::new();
    let sent = e
        .export_cached(&history, skip, &mut |f| {
            frames.push(f);
            true
        })
        .unwrap();
    let idle = Exported { sent, frames, tiers: e.stats().tiers };
    assert_eq!(mid.frames.len(), idle.frames.len());
    let same = |a: &KvFrame, b: &KvFrame| (a.layer, a.index, &a.k, &a.v) == (b.layer, b.index, &b.k, &b.v);
    assert!(mid.frames.iter().zip(&idle.frames).all(|(a, b)| same(a, b)), "other bytes mid-step");
    assert_eq!(e.stats().blocks.used, 0);
    [mid, idle]
}

#[test]
fn a_fetch_served_mid_step_reads_host_tier_blocks_in_place() {
    // The history's 7 whole blocks are in host RAM, none in the pool: mid-step
    // they are sent as they lie; between steps they are copied back first.
    let mut e = engine(&TierConfig { host_blocks: 64, ..TierConfig::default() });
    let [mid, idle] = exported_mid_step_then_idle(&mut e, 0);
    assert_eq!((mid.sent, idle.sent), (112, 112));
    assert_eq!((mid.tiers.restored_host, idle.tiers.restored_host), (0, 7));
}

#[test]
fn a_fetch_served_mid_step_reads_disk_tier_blocks_too() {
    for dtype in KvDtype::ALL {
        mid_step_disk(dtype);
    }
}

fn mid_step_disk(dtype: KvDtype) {
    // The history's 7 whole blocks went on through host RAM to disk: mid-step they
    // are read for the export without waiting for the step's end, and none is
    // copied back into the pool.
    let dir = scratch(&format!("midstep-{dtype}"));
    let tiers = TierConfig { host_blocks: 4, disk_blocks: 64, disk_dir: Some(dir.clone()) };
    let mut e = engine_in(&tiers, dtype);
    let [mid, idle] = exported_mid_step_then_idle(&mut e, 16);
    assert_eq!((mid.sent, idle.sent), (96, 96), "the 6 blocks after the one skipped");
    assert_eq!((mid.tiers.restored_host, mid.tiers.restored_disk), (0, 0), "{:?}", mid.tiers);
    assert!(idle.tiers.restored_disk > 0);
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_fetch_that_skips_the_receivers_blocks_copies_back_only_the_rest() {
    let mut e = engine(&TierConfig { host_blocks: 64, ..TierConfig::default() });
    let history = prompt(0);
    run(&mut e, 0, &history);
    for i in 1..=4 {
        run(&mut e, i, &prompt(i));
    }
    // The history's 7 whole blocks are in host RAM; the receiver keeps the first 3.
    let mut frames = Vec::new();
    let sent = e
        .export_cached(&history, 48, &mut |f| {
            frames.push(f);
            true
        })
        .unwrap();
    assert_eq!(sent, 64);
    assert_eq!(e.stats().tiers.restored_host, 4, "the skipped blocks stay where they are");
    assert_eq!(frames.len(), 4 * model().model.cfg.n_layers);
    assert!(frames.iter().all(|f| f.index < 4), "numbered from the first block sent");
    assert_eq!(e.stats().blocks.used, 0);
}
