//! The memory store's footprint: one million idle buckets (a million API keys
//! that each made one request) must cost at most 200 bytes each, and every
//! one of them is dropped once it has refilled. Its own test binary, so that
//! the resident-set reading sees only this test's allocations.

mod common;

use common::footprint::{api_key, rss};
use tokenbucket_rls::bucket::{BucketParams, Cost};
use tokenbucket_rls::clock::ManualClock;
use tokenbucket_rls::store::memory::MemoryStore;

const BUCKETS: usize = 1_000_000;

#[test]
fn a_million_idle_buckets_fit_in_200_bytes_each_and_are_evicted() {
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::new(clock.clone());
    // A per-minute API-key rule: 60 per minute, burst 60.
    let params = BucketParams {
        capacity: 60,
        tokens_per_unit: 60,
        unit_secs: 60,
        max_debt: None,
        algorithm: Default::default(),
        period: None,
    };
    let descriptor = |i: usize| api_key(&format!("key-{i:08}"), params, Default::default());
    // Warm the allocator and the shards' first growth before measuring.
    for i in 0..1_000 {
        store.decide_now(&descriptor(BUCKETS + i), Cost::Spend(1));
    }
    let before = rss();
    for i in 0..BUCKETS {
        assert!(store.decide_now(&descriptor(i), Cost::Spend(1))[0].admitted);
    }
    let after = rss();
    assert_eq!(store.len(), BUCKETS + 1_000);
    let per_bucket = (after.saturating_sub(before)) as f64 / BUCKETS as f64;
    eprintln!(
        "memory store: {per_bucket:.0} bytes per idle bucket ({} MiB for {BUCKETS})",
        (after - before) >> 20
    );
    assert!(per_bucket <= 200.0, "{per_bucket:.0} bytes per bucket");

    // One token at 60/min is back after a second: every bucket is full again.
    clock.advance_secs_f64(1.5);
    assert_eq!(store.evict_full(), BUCKETS + 1_000);
    assert!(store.is_empty());
}
