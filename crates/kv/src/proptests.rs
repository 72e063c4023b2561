//! Property test of the reliability contract: under any interleaving of admissions
//! (with prefix hits), growth, finishes, cancels and preemptions, every block is in
//! exactly one state, no block has two writers, events mirror the registry, and the
//! pool drains to zero used blocks when every sequence is gone.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestCaseResult, TestRunner};

use crate::{block_hashes, BlockHash, BlockId, BlockPool, BlockTable, KvEvent};

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
        1 => seq.clone().prop_map(|seq| Op::Finish { seq }),
        1 => (seq.clone(), 0..7usize).prop_map(|(seq, extra)| Op::Cancel { seq, extra }),
        1 => seq.prop_map(|seq| Op::Preempt { seq }),
        1 => Just(Op::ClearCache),
    ]
}

fn apply(pool: &BlockPool, seqs: &mut [Seq], op: Op, cov: &Coverage) -> TestCaseResult {
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
            let hits = pool.match_prefix(&hashes);
            let hit_hashes: Vec<BlockHash> = hits.iter().map(|b| b.hash()).collect();
            prop_assert_eq!(&hit_hashes[..], &hashes[..hits.len()]);
            cov.hit_blocks.set(cov.hit_blocks.get() + hits.len());
            let table = BlockTable::with_prefix(pool, salt(seq), hits);
            grow(s, table, &[], cov)
        }
        Op::Extend { seq, new } => match seqs[seq].table.take() {
            Some(table) => grow(&mut seqs[seq], table, &new, cov),
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
            Ok(())
        }
    }
}

/// Makes room for `new` tokens and commits them; on exhaustion the sequence is
/// preempted (its table dropped, its tokens kept), as the scheduler would.
fn grow(s: &mut Seq, mut table: BlockTable, new: &[u32], cov: &Coverage) -> TestCaseResult {
    if table.ensure_capacity(s.tokens.len() + new.len()).is_err() {
        cov.exhausted.set(cov.exhausted.get() + 1);
        return Ok(());
    }
    s.tokens.extend_from_slice(new);
    table.commit(&s.tokens);
    let expected = block_hashes(&s.tokens, BLOCK_SIZE, table.salt());
    prop_assert_eq!(table.full_block_hashes(), expected);
    s.table = Some(table);
    Ok(())
}

fn check(pool: &BlockPool, seqs: &[Seq], registered: &HashSet<BlockHash>) -> TestCaseResult {
    pool.lock().audit().map_err(TestCaseError::fail)?;
    let stats = pool.stats();
    prop_assert_eq!(stats.free + stats.used + stats.cached, stats.total);
    prop_assert_eq!(&pool.lock().registered_hashes(), registered);

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
fn follow_events(
    pool: &BlockPool,
    registered: &mut HashSet<BlockHash>,
    evictions: bool,
    cov: &Coverage,
) -> TestCaseResult {
    for event in pool.take_events() {
        match event {
            KvEvent::Stored { hash, .. } => prop_assert!(registered.insert(hash)),
            KvEvent::Removed { hash } => {
                prop_assert!(registered.remove(&hash));
                if evictions {
                    cov.evicted.set(cov.evicted.get() + 1);
                }
            }
        }
    }
    Ok(())
}

fn run_case(ops: Vec<Op>, cov: &Coverage) -> TestCaseResult {
    let pool = BlockPool::new(BLOCKS, BLOCK_SIZE);
    let mut seqs: Vec<Seq> = (0..SEQS).map(|_| Seq::default()).collect();
    let mut registered = HashSet::new();
    for op in ops {
        let by_allocation = !matches!(op, Op::ClearCache);
        apply(&pool, &mut seqs, op, cov)?;
        follow_events(&pool, &mut registered, by_allocation, cov)?;
        check(&pool, &seqs, &registered)?;
    }
    drop(seqs);
    let stats = pool.stats();
    prop_assert_eq!(stats.used, 0);
    prop_assert_eq!(stats.cached, registered.len());
    for hash in &registered {
        prop_assert_eq!(pool.match_prefix(&[*hash]).len(), 1);
    }
    Ok(())
}

#[test]
fn pool_invariants_hold_under_random_interleavings() {
    let mut runner = TestRunner::new(Config { cases: 2048, failure_persistence: None, ..Config::default() });
    let cov = Coverage::default();
    let ops = prop::collection::vec(op(), 1..80);
    if let Err(e) = runner.run(&ops, |ops| run_case(ops, &cov)) {
        panic!("{e}");
    }
    // The property is only meaningful if the hard paths actually ran.
    assert!(cov.exhausted.get() > 0, "no exhaustion");
    assert!(cov.evicted.get() > 0, "no eviction");
    assert!(cov.hit_blocks.get() > 0, "no prefix hit");
}
