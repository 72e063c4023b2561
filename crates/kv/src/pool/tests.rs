use super::*;
use crate::hash::{hash_block, BlockId};
use crate::KvEvent;

fn h(n: u64) -> BlockHash {
    BlockHash(n)
}

fn check(pool: &BlockPool) -> PoolStats {
    pool.lock().audit().unwrap();
    let s = pool.stats();
    assert_eq!(s.free + s.used + s.cached, s.total);
    s
}

/// Completes a fresh block under `hash` and drops it, leaving it cached.
fn cache_one(pool: &BlockPool, hash: BlockHash) -> BlockId {
    let block = pool.allocate().unwrap().complete(hash, None);
    block.id()
}

#[test]
fn handles_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<BlockPool>();
    assert_send_sync::<MutableBlock>();
    assert_send_sync::<ImmutableBlock>();
    assert_send_sync::<crate::BlockTable>();
}

#[test]
fn allocate_and_drop_return_blocks() {
    let pool = BlockPool::new(4, 16);
    assert_eq!((pool.num_blocks(), pool.block_size()), (4, 16));
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    assert_ne!(a.id(), b.id());
    assert_eq!(check(&pool), PoolStats { total: 4, free: 2, used: 2, cached: 0, ..PoolStats::default() });
    drop(a);
    drop(b);
    assert_eq!(check(&pool), PoolStats { total: 4, free: 4, used: 0, cached: 0, ..PoolStats::default() });
}

#[test]
fn exhaustion_is_all_or_nothing() {
    let pool = BlockPool::new(3, 4);
    let held = pool.allocate_many(2).unwrap();
    let err = pool.allocate_many(2).unwrap_err();
    assert_eq!(err, PoolExhausted { requested: 2, available: 1 });
    assert_eq!(pool.available(), 1);
    let last = pool.allocate().unwrap();
    assert_eq!(pool.allocate().unwrap_err().available, 0);
    drop((held, last));
    assert_eq!(check(&pool).free, 3);
    assert!(pool.allocate_many(0).unwrap().is_empty());
}

#[test]
fn last_reference_caches_registered_block() {
    let pool = BlockPool::new(2, 4);
    let a = pool.allocate().unwrap().complete(h(1), None);
    let a2 = a.clone();
    assert_eq!(pool.lock().refs(a.id()), 2);
    drop(a);
    assert_eq!(check(&pool).used, 1);
    drop(a2);
    assert_eq!(check(&pool), PoolStats { total: 2, free: 1, used: 0, cached: 1, ..PoolStats::default() });
    assert_eq!(pool.available(), 2);
}

#[test]
fn eviction_takes_least_recently_used_first() {
    let pool = BlockPool::new(3, 4);
    let ids: Vec<BlockId> = (1..=3).map(|n| cache_one(&pool, h(n))).collect();
    pool.take_events();
    // Reviving block 1 and releasing it again makes it the most recently used.
    drop(pool.match_prefix(&[h(1)]));
    assert_eq!(pool.lock().lru_order(), [ids[1], ids[2], ids[0]]);

    let first = pool.allocate().unwrap();
    assert_eq!(first.id(), ids[1]);
    let second = pool.allocate().unwrap();
    assert_eq!(second.id(), ids[2]);
    let removed =
        [KvEvent::Removed { hash: h(2), tier: Tier::Device }, KvEvent::Removed { hash: h(3), tier: Tier::Device }];
    assert_eq!(pool.take_events(), removed);
    assert!(pool.match_prefix(&[h(2)]).is_empty());
    assert_eq!(pool.match_prefix(&[h(1)])[0].id(), ids[0]);
    check(&pool);
}

#[test]
fn free_blocks_are_used_before_evicting() {
    let pool = BlockPool::new(2, 4);
    let cached = cache_one(&pool, h(7));
    let fresh = pool.allocate().unwrap();
    assert_ne!(fresh.id(), cached);
    assert_eq!(pool.match_prefix(&[h(7)]).len(), 1);
}

#[test]
fn equal_hashes_dedupe_to_the_first_block() {
    let pool = BlockPool::new(4, 4);
    let first = pool.allocate().unwrap().complete(h(5), None);
    let dup = pool.allocate().unwrap().complete(h(5), None);
    assert_eq!(pool.take_events(), [KvEvent::Stored { hash: h(5), parent: None, tier: Tier::Device }]);
    assert_eq!(dup.hash(), h(5));
    let hits = pool.match_prefix(&[h(5)]);
    assert_eq!(hits[0].id(), first.id());
    // The duplicate goes back to free, the original to the cache.
    drop(dup);
    assert_eq!(check(&pool), PoolStats { total: 4, free: 3, used: 1, cached: 0, ..PoolStats::default() });
    drop((first, hits));
    assert_eq!(check(&pool), PoolStats { total: 4, free: 3, used: 0, cached: 1, ..PoolStats::default() });
    assert!(pool.take_events().is_empty());
}

#[test]
fn match_prefix_stops_at_first_miss_and_shares_live_blocks() {
    let pool = BlockPool::new(6, 4);
    let a = pool.allocate().unwrap().complete(h(1), None);
    let b = pool.allocate().unwrap().complete(h(2), Some(h(1)));
    let c_id = cache_one(&pool, h(3));
    let hits = pool.match_prefix(&[h(1), h(2), h(3), h(9), h(4)]);
    let ids: Vec<BlockId> = hits.iter().map(ImmutableBlock::id).collect();
    assert_eq!(ids, [a.id(), b.id(), c_id]);
    assert_eq!(pool.lock().refs(a.id()), 2);
    assert_eq!(pool.lock().refs(c_id), 1);
    assert_eq!(check(&pool), PoolStats { total: 6, free: 3, used: 3, cached: 0, ..PoolStats::default() });
    assert!(pool.match_prefix(&[h(9), h(1)]).is_empty());
    drop((a, b, hits));
    assert_eq!(check(&pool).cached, 3);
}

#[test]
fn events_report_stores_and_removals() {
    let pool = BlockPool::new(2, 2);
    let p = hash_block(None, &[1, 2], 0);
    let c = hash_block(Some(p), &[3, 4], 0);
    let a = pool.allocate().unwrap().complete(p, None);
    let b = pool.allocate().unwrap().complete(c, Some(p));
    let stored = [
        KvEvent::Stored { hash: p, parent: None, tier: Tier::Device },
        KvEvent::Stored { hash: c, parent: Some(p), tier: Tier::Device },
    ];
    assert_eq!(pool.take_events(), stored);
    drop((b, a));
    pool.clear_cache();
    let removed = [KvEvent::Removed { hash: c, tier: Tier::Device }, KvEvent::Removed { hash: p, tier: Tier::Device }];
    assert_eq!(pool.take_events(), removed);
    assert_eq!(check(&pool).free, 2);
    assert!(pool.take_events().is_empty());
}

#[test]
fn clear_cache_keeps_blocks_in_use() {
    let pool = BlockPool::new(3, 4);
    let live = pool.allocate().unwrap().complete(h(1), None);
    cache_one(&pool, h(2));
    pool.clear_cache();
    assert_eq!(check(&pool), PoolStats { total: 3, free: 2, used: 1, cached: 0, ..PoolStats::default() });
    assert_eq!(pool.match_prefix(&[h(1)]).len(), 1);
    drop(live);
}

#[test]
fn exhausted_error_reads_well() {
    let err = PoolExhausted { requested: 3, available: 1 };
    assert_eq!(err.to_string(), "KV block pool exhausted: requested 3 blocks, 1 available");
}

#[test]
fn a_lost_disk_block_is_forgotten_and_its_removal_logged() {
    let pool = BlockPool::with_tiers(1, 16, 0, 4);
    cache_one(&pool, h(1));
    pool.clear_cache();
    pool.take_moves();
    pool.take_events();
    assert_eq!(pool.locate_lower(h(1)), Some((Tier::Disk, Place::Disk(0))));
    pool.forget_lower(Place::Disk(0));
    assert_eq!(pool.locate_lower(h(1)), None);
    assert_eq!(check(&pool).disk.used, 0);
    assert_eq!(pool.take_events(), [KvEvent::Removed { hash: h(1), tier: Tier::Disk }]);
    // Forgetting an empty slot changes nothing.
    pool.forget_lower(Place::Disk(0));
    assert!(pool.take_events().is_empty());
}

#[test]
fn forgetting_the_lower_tiers_drops_every_block_and_every_copy_owed() {
    let pool = BlockPool::with_tiers(3, 16, 1, 4);
    for i in 1..=3 {
        cache_one(&pool, h(i));
    }
    pool.clear_cache();
    pool.take_events();
    assert!(!pool.take_moves().is_empty());
    // Evicted again, with copies still owed: those go too.
    cache_one(&pool, h(4));
    pool.clear_cache();
    pool.forget_lower_all();
    assert!(pool.take_moves().is_empty());
    assert!((1..=4).all(|i| pool.locate_lower(h(i)).is_none()));
    let s = check(&pool);
    assert_eq!((s.host.used, s.disk.used), (0, 0));
    let removed = pool.take_events().into_iter().filter(|e| matches!(e, KvEvent::Removed { .. })).count();
    // h(4) was stored and removed, the other three removed once each.
    assert!(removed >= 4, "{removed} removals logged");
}
