use super::*;
use crate::hash::block_hashes;
use crate::pool::PoolStats;

fn tokens(n: u32) -> Vec<u32> {
    (100..100 + n).collect()
}

#[test]
fn ensure_capacity_allocates_missing_blocks_only() {
    let pool = BlockPool::new(4, 4);
    let mut t = BlockTable::new(&pool, 0);
    t.ensure_capacity(5).unwrap();
    assert_eq!((t.num_blocks(), t.capacity_tokens()), (2, 8));
    t.ensure_capacity(8).unwrap();
    assert_eq!(t.num_blocks(), 2);
    let err = t.ensure_capacity(17).unwrap_err();
    assert_eq!(err, PoolExhausted { requested: 3, available: 2 });
    assert_eq!(t.num_blocks(), 2);
    assert_eq!(t.block_ids(), [BlockId(0), BlockId(1)]);
    assert_eq!((t.id_at(1), t.id_at(2)), (Some(BlockId(1)), None));
    drop(t);
    assert_eq!(pool.stats().free, 4);
}

#[test]
fn commit_seals_full_blocks_with_chained_hashes() {
    let pool = BlockPool::new(4, 4);
    let mut t = BlockTable::new(&pool, 7);
    let toks = tokens(10);
    t.ensure_capacity(toks.len()).unwrap();
    t.commit(&toks[..3]);
    assert!(t.full_block_hashes().is_empty());
    t.commit(&toks);
    let hashes = t.full_block_hashes();
    assert_eq!(hashes, block_hashes(&toks, 4, 7));
    assert_eq!(hashes[1], hash_block(Some(hashes[0]), &toks[4..8], 7));
    assert_eq!((t.num_full_blocks(), t.num_blocks()), (2, 3));
    // Committing again is a no-op.
    t.commit(&toks);
    assert_eq!(t.full_block_hashes(), hashes);
}

#[test]
fn salt_separates_hash_spaces() {
    let pool = BlockPool::new(4, 4);
    let toks = tokens(8);
    let hashes_with = |salt| {
        let mut t = BlockTable::new(&pool, salt);
        t.ensure_capacity(toks.len()).unwrap();
        t.commit(&toks);
        t.full_block_hashes()
    };
    let (a, b) = (hashes_with(1), hashes_with(2));
    assert_ne!(a[0], b[0]);
    assert_ne!(a[1], b[1]);
    assert!(pool.match_prefix(&a).len() == 2 && pool.match_prefix(&b).len() == 2);
}

#[test]
fn adopted_prefix_is_shared_and_extended() {
    let pool = BlockPool::new(6, 4);
    let prompt = tokens(9);
    let mut first = BlockTable::new(&pool, 0);
    first.ensure_capacity(prompt.len()).unwrap();
    first.commit(&prompt);

    let hits = pool.match_prefix(&block_hashes(&prompt, 4, 0));
    let mut second = BlockTable::with_prefix(&pool, 0, hits);
    assert_eq!(second.cached_prefix_tokens(), 8);
    assert_eq!(second.block_ids()[..2], first.block_ids()[..2]);

    let mut longer = prompt[..8].to_vec();
    longer.extend([1, 2, 3, 4]);
    second.ensure_capacity(longer.len()).unwrap();
    second.commit(&longer);
    assert_eq!(second.full_block_hashes(), block_hashes(&longer, 4, 0));
    assert_eq!(pool.stats(), PoolStats { total: 6, free: 2, used: 4, cached: 0, ..PoolStats::default() });
    // The first table's partial block is freed; the three complete blocks are cached.
    drop((first, second));
    assert_eq!(pool.stats(), PoolStats { total: 6, free: 3, used: 0, cached: 3, ..PoolStats::default() });
}

#[test]
fn dropped_table_frees_mutable_and_caches_full_tail_first() {
    let pool = BlockPool::new(4, 2);
    let mut t = BlockTable::new(&pool, 0);
    let toks = tokens(5);
    t.ensure_capacity(toks.len()).unwrap();
    t.commit(&toks);
    let ids = t.block_ids();
    drop(t);
    assert_eq!(pool.stats(), PoolStats { total: 4, free: 2, used: 0, cached: 2, ..PoolStats::default() });
    // The tail was released first, so it is the oldest and evicted first.
    assert_eq!(pool.lock().lru_order(), [ids[1], ids[0]]);
}

#[test]
fn adopt_into_empty_table() {
    let pool = BlockPool::new(2, 2);
    let block = pool.allocate().unwrap().complete(BlockHash(1), None);
    let mut t = BlockTable::new(&pool, 0);
    t.adopt_prefix(vec![block]);
    assert_eq!((t.num_blocks(), t.num_full_blocks(), t.cached_prefix_tokens()), (1, 1, 2));
}
