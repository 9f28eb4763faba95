//! The memory store's cap holds in bytes: with 1,000-byte descriptor values
//! (a bucket then costs about 1,200 bytes, not the 168 of a short one), a
//! store of `--max-buckets 100000` stays near 100,000 × 168 bytes however
//! many such buckets arrive. Its own test binary, so that the resident-set
//! reading sees only this test's allocations.

mod common;

use common::footprint::{api_key, rss};
use tokenbucket_rls::bucket::{BucketParams, Cost};
use tokenbucket_rls::clock::ManualClock;
use tokenbucket_rls::store::memory::MemoryStore;

#[test]
fn buckets_of_long_values_stay_within_the_caps_bytes() {
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::with_cap(clock.clone(), 100_000, None);
    let params = BucketParams {
        capacity: 60,
        tokens_per_unit: 60,
        unit_secs: 60,
        max_debt: None,
        algorithm: Default::default(),
        period: None,
    };
    let pad = "v".repeat(1_000 - 9);
    let descriptor = |i: usize| api_key(&format!("{pad}{i:09}"), params, Default::default());
    let before = rss();
    for i in 0..400_000 {
        assert!(store.decide_now(&descriptor(i), Cost::Spend(1))[0].admitted);
    }
    let grown = rss().saturating_sub(before);
    let cap = store.max_bytes() as u64;
    eprintln!(
        "memory store, 1,000-byte values: {} buckets held, counted {} MiB, resident +{} MiB, cap {} MiB",
        store.len(),
        store.bytes() >> 20,
        grown >> 20,
        cap >> 20
    );
    assert!(store.bytes() as u64 <= cap);
    // what the count says is what the process holds, within allocator slack
    assert!(
        grown <= cap * 3 / 2,
        "resident grew {grown} against a cap of {cap}"
    );
}
