//! The memory store's cap holds in bytes: with 1,000-byte descriptor values
//! (a bucket then costs about 1,200 bytes, not the 168 of a short one), a
//! store of `--max-buckets 100000` stays near 100,000 × 168 bytes however
//! many such buckets arrive. Its own test binary, so that the resident-set
//! reading sees only this test's allocations.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::footprint::{api_key, rss};
use tokenbucket_rls::bucket::{BucketParams, Cost};
use tokenbucket_rls::clock::ManualClock;
use tokenbucket_rls::store::memory::MemoryStore;

/// The bytes allocated and not yet freed, as the process asked for them:
/// what the store's count stands for, whatever the allocator keeps of
/// freed memory (which the resident set includes, and which varied from
/// 15 to 24 MiB for the same work between runs: glibc's malloc, whose
/// freed chunks of evicted keys a busy machine's run did not give back).
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is the system allocator's, with the caller's layout;
// the counter only adds and takes the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, new_size) };
        if !q.is_null() {
            LIVE.fetch_add(new_size, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

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
    let (before, resident_before) = (LIVE.load(Ordering::Relaxed), rss());
    for i in 0..400_000 {
        assert!(store.decide_now(&descriptor(i), Cost::Spend(1))[0].admitted);
    }
    let grown = LIVE.load(Ordering::Relaxed).saturating_sub(before) as u64;
    let resident = rss().saturating_sub(resident_before);
    let cap = store.max_bytes() as u64;
    eprintln!(
        "memory store, 1,000-byte values: {} buckets held, counted {} MiB, allocated +{} MiB (resident +{} MiB), cap {} MiB",
        store.len(),
        store.bytes() >> 20,
        grown >> 20,
        resident >> 20,
        cap >> 20
    );
    assert!(store.bytes() as u64 <= cap);
    // what the count says is what the process holds (allocated; the
    // resident set adds what the allocator keeps of freed memory)
    assert!(
        grown <= cap * 11 / 10,
        "allocated {grown} bytes against a cap of {cap}"
    );
}
