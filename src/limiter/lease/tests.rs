//! Leases against the memory store with a hand-moved clock: exact admission
//! totals, store calls per token, returns on expiry, reload and shutdown.

use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;

use super::*;
use crate::clock::ManualClock;
use crate::limiter::bucket::BucketParams;
use crate::store::memory::MemoryStore;
use crate::store::BucketRef;

/// The memory store behind a yield (so that concurrent callers interleave as
/// with a network store), counting calls; `fail` makes every call time out.
struct Shared {
    inner: MemoryStore<ManualClock>,
    calls: AtomicU64,
    fail: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl Store for Shared {
    async fn decide(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        tokio::task::yield_now().await;
        if self.fail.load(Ordering::SeqCst) {
            return Err(StoreError::Timeout);
        }
        self.inner.decide(descriptor, cost).await
    }

    fn name(&self) -> &'static str {
        "test"
    }
}

const SEC: u64 = 1_000_000;

fn setup() -> (ManualClock, Arc<Shared>) {
    let clock = ManualClock::new(SEC);
    let store = Arc::new(Shared {
        inner: MemoryStore::new(clock.clone()),
        calls: AtomicU64::new(0),
        fail: false.into(),
    });
    (clock, store)
}

fn instance(clock: &ManualClock, store: &Arc<Shared>) -> Arc<Leases<ManualClock>> {
    Arc::new(Leases::new(
        store.clone(),
        Arc::new(Metrics::new()),
        clock.clone(),
    ))
}

/// A bucket of `capacity` that refills one token a day.
fn hot(capacity: u64) -> DescriptorBuckets {
    DescriptorBuckets {
        tag: b"hot".to_vec(),
        buckets: vec![BucketRef {
            key: b"hot#0".to_vec(),
            params: BucketParams {
                capacity,
                tokens_per_unit: 1,
                unit_secs: 86_400,
            },
        }],
    }
}

fn config(size: u64) -> LeaseConfig {
    LeaseConfig {
        size,
        ttl: Duration::from_secs(1),
    }
}

/// Spends one token per call from `tasks` tasks × `each` calls; returns admitted.
async fn hammer(leases: &Arc<Leases<ManualClock>>, size: u64, tasks: usize, each: usize) -> u64 {
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let leases = leases.clone();
            tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..each {
                    let o = leases
                        .spend(&hot(100), config(size), 1, 1)
                        .await
                        .expect("store works");
                    admitted += u64::from(o[0].admitted);
                }
                admitted
            })
        })
        .collect();
    let mut total = 0;
    for h in handles {
        total += h.await.expect("task");
    }
    total
}

/// Lets spawned returns and prefetches run.
async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_never_admit_more_than_the_bucket() {
    let (clock, store) = setup();
    let (a, b) = (instance(&clock, &store), instance(&clock, &store));
    let (x, y) = tokio::join!(hammer(&a, 10, 20, 25), hammer(&b, 10, 20, 25));
    settle().await;
    let held = a.held() + b.held();
    assert!(x + y <= 100, "admitted {x} + {y}");
    assert_eq!(x + y + held, 100, "every token admitted or still held");
    assert!(held <= 20, "at most a lease per instance unspent: {held}");
}

#[tokio::test]
async fn one_store_call_serves_a_lease_worth_of_decisions() {
    let (clock, store) = setup();
    let leases = instance(&clock, &store);
    let admitted = hammer(&leases, 10, 8, 10).await;
    assert_eq!(admitted, 80);
    let calls = store.calls.load(Ordering::SeqCst);
    // each refill takes at least half a lease (prefetch at half)
    assert!(calls <= 80 / 5 + 1, "{calls} store calls for 80 tokens");
    assert!(calls >= 8, "{calls}");
}

#[tokio::test]
async fn an_empty_bucket_rejects_with_its_retry_after() {
    let (clock, store) = setup();
    let leases = instance(&clock, &store);
    assert_eq!(hammer(&leases, 10, 4, 50).await, 100);
    let o = leases
        .spend(&hot(100), config(10), 1, 1)
        .await
        .expect("store works");
    assert!(!o[0].admitted);
    assert_eq!(o[0].retry_after_secs, Some(86_400), "one token a day");
}

#[tokio::test]
async fn unspent_tokens_go_back_on_expiry_and_on_reload() {
    let (clock, store) = setup();
    let leases = instance(&clock, &store);
    let metrics = leases.metrics.clone();
    let o = leases.spend(&hot(100), config(10), 1, 1).await.expect("ok");
    assert!(o[0].admitted);
    assert_eq!(o[0].remaining, 99, "9 in the lease + 90 in the bucket");
    settle().await;
    assert_eq!(leases.held(), 9);
    assert_eq!(metrics.lease_counts().held, 9);

    leases.sweep(1);
    settle().await;
    assert_eq!(leases.held(), 9, "not expired yet");
    clock.advance_micros(SEC);
    assert_eq!(
        leases.sweep(1),
        0,
        "returned, and forgotten after a second idle"
    );
    settle().await;
    assert_eq!(leases.held(), 0);
    let counts = metrics.lease_counts();
    assert_eq!((counts.returned, counts.held), (9, 0));
    let peek = store.inner.decide_now(&hot(100), Cost::Check);
    assert_eq!(peek[0].remaining, 99, "the bucket has them back");

    // a reload (a new generation) returns what was leased under the old rules
    leases.spend(&hot(100), config(10), 1, 1).await.expect("ok");
    settle().await;
    assert_eq!(leases.held(), 9);
    leases.spend(&hot(100), config(10), 2, 1).await.expect("ok");
    settle().await;
    assert_eq!(metrics.lease_counts().returned, 18);
    // a call still holding the older rules spends from the newer lease
    leases.spend(&hot(100), config(10), 1, 1).await.expect("ok");
    settle().await;
    assert_eq!(metrics.lease_counts().returned, 18);
    assert_eq!(leases.held(), 8);
    // 100 - 3 admitted - 9 held
    assert_eq!(
        store.inner.decide_now(&hot(100), Cost::Check)[0].remaining,
        88
    );
}

#[tokio::test]
async fn shutdown_returns_everything_and_failures_are_counted_lost() {
    let (clock, store) = setup();
    let leases = instance(&clock, &store);
    let metrics = leases.metrics.clone();
    leases.spend(&hot(100), config(10), 1, 3).await.expect("ok");
    settle().await;
    assert_eq!(leases.return_all().await, 7);
    assert_eq!(leases.held(), 0);
    assert_eq!(
        store.inner.decide_now(&hot(100), Cost::Check)[0].remaining,
        97
    );

    store.fail.store(true, Ordering::SeqCst);
    let e = leases.spend(&hot(100), config(10), 1, 1).await;
    assert!(matches!(e, Err(StoreError::Timeout)), "{e:?}");
    let counts = metrics.lease_counts();
    assert_eq!(
        counts.lost, 10,
        "a lease call without an answer may have taken 10"
    );
    assert_eq!((counts.returned, counts.held), (7, 0));
}

#[tokio::test]
async fn checks_are_answered_from_the_lease() {
    let (clock, store) = setup();
    let leases = instance(&clock, &store);
    assert!(leases.peek(&hot(100)).is_none(), "no lease yet");
    leases.spend(&hot(100), config(10), 1, 1).await.expect("ok");
    let o = leases.peek(&hot(100)).expect("lease holds tokens");
    assert!(o[0].admitted);
    assert_eq!((o[0].remaining, o[0].taken), (99, 0));
    assert_eq!(leases.held(), 9, "a check spends nothing");
}
