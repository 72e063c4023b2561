//! Property test of the reliability contract: under any interleaving of admissions
//! (with prefix hits), growth, speculative steps (room for drafted tokens, then all but
//! the accepted ones given back), finishes, cancels and preemptions, every block is in
//! exactly one state, no block has two writers, events mirror the registry, and the
//! pool drains to zero used blocks when every sequence is gone. With host and disk
//! tiers below the pool, the same holds, events mirror every tier's registry, and
//! a model of the bytes (each block's "contents" is its hash) shows that carrying out
//! the pool's moves in order always restores the right contents.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestCaseResult, TestRunner};

use crate::{block_hashes, BlockHash, BlockId, BlockPool, BlockTable, KvEvent, Place, Tier};

// Small enough that a few sequences exhaust the pool and force evictions; a two-token
// alphabet with two-token blocks makes prefix hits common.
const BLOCKS: usize = 10;
const BLOCK_SIZE: usize = 2;
const SEQS: usize = 4;

#[derive(Clone, Debug)]
enum Op {
    /// Start the sequence (or re-admit a preempted one with its own tokens).
    Admit {
        seq: usize,
        prompt: Vec<u32>,
    },
    /// Reserve room for `new` tokens, write them, commit.
    Extend {
        seq: usize,
        new: Vec<u32>,
    },
    /// A speculative step: room for `drafts`, the first `accepted` of them kept and
    /// committed, the rest rolled back.
    Speculate {
        seq: usize,
        drafts: Vec<u32>,
        accepted: usize,
    },
    Finish {
        seq: usize,
    },
    /// Reserve `extra` tokens of room without writing them, then drop everything.
    Cancel {
        seq: usize,
        extra: usize,
    },
    /// Drop the blocks but keep the tokens, to be re-admitted later.
    Preempt {
        seq: usize,
    },
    ClearCache,
}

#[derive(Default)]
struct Seq {
    table: Option<BlockTable>,
    tokens: Vec<u32>,
}

/// How often the interesting paths ran, so the test proves it exercised them.
#[derive(Default)]
struct Coverage {
    exhausted: Cell<usize>,
    evicted: Cell<usize>,
    hit_blocks: Cell<usize>,
    restored: Cell<usize>,
    rolled_back: Cell<usize>,
}

fn pool_of(table: &BlockTable) -> &BlockPool {
    table.pool()
}

/// What each place holds, as the engine's bytes would: the hash of the block
/// whose K/V was written or copied there.
#[derive(Default)]
struct Bytes(HashMap<Place, BlockHash>);

impl Bytes {
    /// Carries out the pool's pending moves, in order.
    fn settle(&mut self, pool: &BlockPool) {
        for m in pool.take_moves() {
            let got = self.0.get(&m.from).copied();
            match got {
                Some(h) => self.0.insert(m.to, h),
                None => self.0.remove(&m.to),
            };
        }
    }

    /// Records the contents of a table's complete blocks (written by compute).
    fn write(&mut self, table: &BlockTable) {
        for (id, hash) in table.block_ids().into_iter().zip(table.full_block_hashes()) {
            self.0.insert(Place::Device(id), hash);
        }
    }
}

fn salt(seq: usize) -> u64 {
    // One sequence hashes under another salt: it must never share with the others.
    u64::from(seq == SEQS - 1)
}

fn op() -> impl Strategy<Value = Op> {
    let seq = 0..SEQS;
    let toks = |max| prop::collection::vec(0u32..2, 0..max);
    prop_oneof![
        3 => (seq.clone(), toks(9)).prop_map(|(seq, prompt)| Op::Admit { seq, prompt }),
        4 => (seq.clone(), toks(5)).prop_map(|(seq, new)| Op::Extend { seq, new }),
        3 => (seq.clone(), toks(6), 0..7usize).prop_map(|(seq, drafts, accepted)| Op::Speculate { seq, drafts, accepted }),
        1 => seq.clone().prop_map(|seq| Op::Finish { seq }),
        1 => (seq.clone(), 0..7usize).prop_map(|(seq, extra)| Op::Cancel { seq, extra }),
        1 => seq.prop_map(|seq| Op::Preempt { seq }),
        1 => Just(Op::ClearCache),
    ]
}

fn apply(pool: &BlockPool, seqs: &mut [Seq], op: Op, bytes: &mut Bytes, cov: &Coverage) -> TestCaseResult {
    match op {
        Op::Admit { seq, prompt } => {
            let s = &mut seqs[seq];
            if s.table.is_some() {
                return Ok(());
            }
            if s.tokens.is_empty() {
                s.tokens = prompt;
            }
            let hashes = block_hashes(&s.tokens, BLOCK_SIZE, salt(seq));
            let mut hits = pool.match_prefix(&hashes);
            let hit_hashes: Vec<BlockHash> = hits.iter().map(|b| b.hash()).collect();
            prop_assert_eq!(&hit_hashes[..], &hashes[..hits.len()]);
            cov.hit_blocks.set(cov.hit_blocks.get() + hits.len());
            restore(pool, &hashes, &mut hits, bytes, cov)?;
            let table = BlockTable::with_prefix(pool, salt(seq), hits);
            grow(s, table, &[], bytes, cov)
        }
        Op::Extend { seq, new } => match seqs[seq].table.take() {
            Some(table) => grow(&mut seqs[seq], table, &new, bytes, cov),
            None => Ok(()),
        },
        Op::Speculate { seq, drafts, accepted } => match seqs[seq].table.take() {
            Some(table) => speculate(&mut seqs[seq], table, &drafts, accepted, bytes, cov),
            None => Ok(()),
        },
        Op::Finish { seq } => {
            seqs[seq] = Seq::default();
            Ok(())
        }
        Op::Cancel { seq, extra } => {
            let s = &mut seqs[seq];
            if let Some(table) = &mut s.table {
                let _ = table.ensure_capacity(s.tokens.len() + extra);
                bytes.settle(pool);
            }
            seqs[seq] = Seq::default();
            Ok(())
        }
        Op::Preempt { seq } => {
            seqs[seq].table = None;
            Ok(())
        }
        Op::ClearCache => {
            pool.clear_cache();
            bytes.settle(pool);
            Ok(())
        }
    }
}

/// Copies the blocks after a pool hit back from the lower tiers, as the engine does:
/// allocate, carry out the moves that allocation caused, then find each block again
/// (the moves may have sent it further down) and check its bytes are its own.
fn restore(
    pool: &BlockPool,
    hashes: &[BlockHash],
    hits: &mut Vec<crate::ImmutableBlock>,
    bytes: &mut Bytes,
    cov: &Coverage,
) -> TestCaseResult {
    let from = hits.len();
    let found = pool.lower_prefix(&hashes[from..]).len().min(pool.available());
    let Ok(blocks) = pool.allocate_many(found) else { return Ok(()) };
    bytes.settle(pool);
    for (i, block) in blocks.into_iter().enumerate() {
        let (at, hash) = (from + i, hashes[from + i]);
        let Some((_, place)) = pool.locate_lower(hash) else { break };
        prop_assert_eq!(bytes.0.get(&place), Some(&hash), "{:?} holds another block", place);
        bytes.0.insert(Place::Device(block.id()), hash);
        let parent = at.checked_sub(1).map(|p| hashes[p]);
        hits.push(block.complete(hash, parent));
        cov.restored.set(cov.restored.get() + 1);
    }
    Ok(())
}

/// Makes room for `new` tokens and commits them; on exhaustion the sequence is
/// preempted (its table dropped, its tokens kept), as the scheduler would.
fn grow(s: &mut Seq, mut table: BlockTable, new: &[u32], bytes: &mut Bytes, cov: &Coverage) -> TestCaseResult {
    let room = table.ensure_capacity(s.tokens.len() + new.len());
    bytes.settle(pool_of(&table));
    if room.is_err() {
        cov.exhausted.set(cov.exhausted.get() + 1);
        return Ok(());
    }
    s.tokens.extend_from_slice(new);
    table.commit(&s.tokens);
    bytes.write(&table);
    let expected = block_hashes(&s.tokens, BLOCK_SIZE, table.salt());
    prop_assert_eq!(table.full_block_hashes(), expected);
    s.table = Some(table);
    Ok(())
}

/// Makes room for every drafted token (all or nothing, as a step does), keeps the
/// first `accepted`, commits them and gives back the blocks only rejected ones used.
fn speculate(
    s: &mut Seq,
    mut table: BlockTable,
    drafts: &[u32],
    accepted: usize,
    bytes: &mut Bytes,
    cov: &Coverage,
) -> TestCaseResult {
    let room = table.ensure_capacity(s.tokens.len() + drafts.len());
    bytes.settle(pool_of(&table));
    if room.is_err() {
        cov.exhausted.set(cov.exhausted.get() + 1);
        return Ok(());
    }
    let kept = accepted.min(drafts.len());
    s.tokens.extend_from_slice(&drafts[..kept]);
    table.commit(&s.tokens);
    bytes.write(&table);
    table.truncate(s.tokens.len());
    let needed = s.tokens.len().div_ceil(BLOCK_SIZE).max(table.num_full_blocks());
    prop_assert_eq!(table.num_blocks(), needed, "rolled back to the accepted tokens");
    prop_assert_eq!(table.full_block_hashes(), block_hashes(&s.tokens, BLOCK_SIZE, table.salt()));
    if kept < drafts.len() {
        cov.rolled_back.set(cov.rolled_back.get() + 1);
    }
    s.table = Some(table);
    Ok(())
}

/// What a router following the events believes each tier holds.
type Registered = HashMap<Tier, HashSet<BlockHash>>;

fn check(pool: &BlockPool, seqs: &[Seq], registered: &Registered) -> TestCaseResult {
    pool.lock().audit().map_err(TestCaseError::fail)?;
    let stats = pool.stats();
    prop_assert_eq!(stats.free + stats.used + stats.cached, stats.total);
    let mut held = Registered::new();
    for (hash, tier) in pool.snapshot().hashes {
        prop_assert!(held.entry(tier).or_default().insert(hash));
    }
    held.entry(Tier::Device).or_default().extend(pool.lock().registered_hashes());
    for tier in Tier::ALL {
        prop_assert_eq!(
            held.get(&tier).cloned().unwrap_or_default(),
            registered.get(&tier).cloned().unwrap_or_default()
        );
    }
    prop_assert_eq!(stats.host.used, held.get(&Tier::Host).map_or(0, HashSet::len));
    prop_assert_eq!(stats.disk.used, held.get(&Tier::Disk).map_or(0, HashSet::len));

    let mut writers = HashSet::new();
    let mut readers: HashMap<BlockId, u32> = HashMap::new();
    for table in seqs.iter().filter_map(|s| s.table.as_ref()) {
        let ids = table.block_ids();
        let (full, mutable) = ids.split_at(table.num_full_blocks());
        for id in full {
            *readers.entry(*id).or_default() += 1;
        }
        for id in mutable {
            prop_assert!(writers.insert(*id), "two mutable handles on {:?}", id);
        }
    }
    prop_assert!(writers.iter().all(|id| !readers.contains_key(id)));
    for (id, n) in &readers {
        prop_assert_eq!(pool.lock().refs(*id), *n);
    }
    prop_assert_eq!(stats.used, writers.len() + readers.len());
    Ok(())
}

/// Applies the drained events to the router-side model of the registry.
fn follow_events(pool: &BlockPool, registered: &mut Registered, evictions: bool, cov: &Coverage) -> TestCaseResult {
    for event in pool.take_events() {
        match event {
            KvEvent::Stored { hash, tier, .. } => prop_assert!(registered.entry(tier).or_default().insert(hash)),
            KvEvent::Removed { hash, tier } => {
                prop_assert!(registered.entry(tier).or_default().remove(&hash));
                if evictions && tier == Tier::Device {
                    cov.evicted.set(cov.evicted.get() + 1);
                }
            }
        }
    }
    Ok(())
}

fn run_case(pool: BlockPool, ops: Vec<Op>, cov: &Coverage) -> TestCaseResult {
    let mut seqs: Vec<Seq> = (0..SEQS).map(|_| Seq::default()).collect();
    let mut registered = Registered::new();
    let mut bytes = Bytes::default();
    for op in ops {
        let by_allocation = !matches!(op, Op::ClearCache);
        apply(&pool, &mut seqs, op, &mut bytes, cov)?;
        follow_events(&pool, &mut registered, by_allocation, cov)?;
        check(&pool, &seqs, &registered)?;
    }
    drop(seqs);
    let stats = pool.stats();
    prop_assert_eq!(stats.used, 0);
    let device = registered.remove(&Tier::Device).unwrap_or_default();
    prop_assert_eq!(stats.cached, device.len());
    for hash in &device {
        prop_assert_eq!(pool.match_prefix(&[*hash]).len(), 1);
    }
    Ok(())
}

fn run(tiers: (usize, usize)) -> Coverage {
    let mut runner = TestRunner::new(Config { cases: 2048, failure_persistence: None, ..Config::default() });
    let cov = Coverage::default();
    let ops = prop::collection::vec(op(), 1..80);
    let pool = || BlockPool::with_tiers(BLOCKS, BLOCK_SIZE, tiers.0, tiers.1);
    if let Err(e) = runner.run(&ops, |ops| run_case(pool(), ops, &cov)) {
        panic!("{e}");
    }
    // The property is only meaningful if the hard paths actually ran.
    assert!(cov.exhausted.get() > 0, "no exhaustion");
    assert!(cov.evicted.get() > 0, "no eviction");
    assert!(cov.hit_blocks.get() > 0, "no prefix hit");
    assert!(cov.rolled_back.get() > 0, "no draft rolled back");
    cov
}

#[test]
fn pool_invariants_hold_under_random_interleavings() {
    let cov = run((0, 0));
    assert_eq!(cov.restored.get(), 0);
}

#[test]
fn tiers_keep_their_invariants_and_restore_the_right_bytes() {
    // Tiers smaller than the pool, so blocks go all the way down and out.
    let cov = run((3, 4));
    assert!(cov.restored.get() > 0, "nothing came back from a lower tier");
}
