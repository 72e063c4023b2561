//! The router's KV index at scale: 1M indexed blocks spread over 16 workers (each
//! block held by one or two of them in their pools, and every eighth chain also in a
//! third worker's host-RAM tier), then the cached prefix of 2,048-token prompts
//! (128 block hashes) on all 16 candidates, as routing asks for it. Prints the index's
//! memory (resident set growth) and the per-request lookup time percentiles.
//!
//! cargo run --release -p pdserve-router --example kv_index_scale

use pdserve_kv::{BlockHash, Tier};
use pdserve_protocol::{KvCursor, KvEvents};
use pdserve_router::index::KvIndex;
use std::time::{Duration, Instant};

const BLOCKS: u64 = 1_000_000;
const WORKERS: u64 = 16;
const PROMPT_BLOCKS: u64 = 128;
const LOOKUPS: usize = 100_000;

fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix(" kB")?.trim().parse().ok()).unwrap_or(0)
}

fn main() {
    let names: Vec<String> = (0..WORKERS).map(|w| format!("worker-{w}")).collect();
    let before = rss_kb();
    let index = KvIndex::default();
    // Chains of 128 blocks (one prompt each), every chain on one worker and every
    // fourth also on the next, every eighth in the host tier of the one after: 1M
    // distinct hashes in all.
    for (w, name) in names.iter().enumerate() {
        let w = w as u64;
        let held = |chain: u64| chain % WORKERS == w || (chain.is_multiple_of(4) && (chain + 1) % WORKERS == w);
        let host = |chain: u64| chain.is_multiple_of(8) && (chain + 2) % WORKERS == w;
        let device = (0..BLOCKS).filter(|b| held(b / PROMPT_BLOCKS)).map(|b| (BlockHash(b), Tier::Device));
        let lower = (0..BLOCKS).filter(|b| host(b / PROMPT_BLOCKS)).map(|b| (BlockHash(b), Tier::Host));
        let hashes: Vec<(BlockHash, Tier)> = device.chain(lower).collect();
        let got = KvEvents { snapshot: Some(hashes), events: Vec::new(), cursor: KvCursor { instance: 1, seq: 1 } };
        index.apply(name, got, Duration::ZERO);
    }
    let grown = rss_kb().saturating_sub(before);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let chains = BLOCKS / PROMPT_BLOCKS;
    let mut times = Vec::with_capacity(LOOKUPS);
    let mut found = 0;
    for i in 0..LOOKUPS as u64 {
        // Half the prompts are cached chains, half miss after a random cached prefix.
        let chain = (i * 7919) % chains;
        let keep = if i.is_multiple_of(2) { PROMPT_BLOCKS } else { i % PROMPT_BLOCKS };
        let prompt: Vec<BlockHash> = (0..PROMPT_BLOCKS)
            .map(|b| if b < keep { BlockHash(chain * PROMPT_BLOCKS + b) } else { BlockHash(u64::MAX - b) })
            .collect();
        let t = Instant::now();
        let prefix = index.prefix_blocks(&prompt, &refs);
        times.push(t.elapsed());
        found += prefix.iter().sum::<usize>();
    }
    times.sort();
    let pct = |p: usize| times[(times.len() * p / 100).min(times.len() - 1)];
    println!("indexed blocks: {} over {WORKERS} workers", index.len());
    println!("index memory (RSS growth): {:.1} MiB", grown as f64 / 1024.0);
    println!(
        "prefix lookup of a {}-block prompt on {WORKERS} candidates, {LOOKUPS} lookups: p50 {:?}, p99 {:?}, max {:?} (blocks found: {found})",
        PROMPT_BLOCKS,
        pct(50),
        pct(99),
        times[times.len() - 1]
    );
}
