//! Leases against the memory store with a hand-moved clock: exact admission
//! totals, store calls per token, returns on expiry, reload and shutdown.

use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;

use super::*;
use crate::bucket::BucketParams;
use crate::clock::ManualClock;
use crate::store::memory::MemoryStore;
use crate::store::BucketRef;

/// The memory store behind a yield (so that concurrent callers interleave as
/// with a network store), counting calls; `fail` makes every call time out.
struct Shared {
    inner: MemoryStore<ManualClock>,
    calls: AtomicU64,
    fail: std::sync::atomic::AtomicBool,
    /// Calls wait for a permit here (a paused Redis); plenty by default.
    gate: tokio::sync::Semaphore,
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
        self.gate.acquire().await.expect("gate open").forget();
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
/// Permits of an open gate.
const OPEN: usize = 1 << 30;

fn setup() -> (ManualClock, Arc<Shared>) {
    let clock = ManualClock::new(SEC);
    let store = Arc::new(Shared {
        inner: MemoryStore::new(clock.clone()),
        calls: AtomicU64::new(0),
        fail: false.into(),
        gate: tokio::sync::Semaphore::new(OPEN),
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
    bucket(capacity, 1, 86_400)
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
                        .expect("served by the lease")
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
        .expect("served by the lease")
        .expect("store works");
    assert!(!o[0].admitted);
    assert_eq!(o[0].retry_after_secs, Some(86_400), "one token a day");
}

#[tokio::test]
async fn unspent_tokens_go_back_on_expiry_and_on_reload() {
    let (clock, store) = setup();
    let leases = instance(&clock, &store);
    let metrics = leases.metrics.clone();
    let o = leases
        .spend(&hot(100), config(10), 1, 1)
        .await
        .expect("served")
        .expect("ok");
    assert!(o[0].admitted);
    assert_eq!(o[0].remaining, 99, "9 in the lease + 90 in the bucket");
    settle().await;
    assert_eq!(leases.held(), 9);
    assert_eq!(metrics.lease_counts().held, 9);

    leases.sweep(1);
    settle().await;
    assert_eq!(leases.held(), 9, "not expired yet");
    clock.advance_micros(SEC);
    assert_eq!(leases.sweep(1), 1, "expired: returned by its worker");
    settle().await;
    assert_eq!(
        leases.sweep(1),
        0,
        "then forgotten, idle for a second with nothing held"
    );
    assert_eq!(leases.held(), 0);
    let counts = metrics.lease_counts();
    assert_eq!((counts.returned, counts.held), (9, 0));
    let peek = store.inner.decide_now(&hot(100), Cost::Check);
    assert_eq!(peek[0].remaining, 99, "the bucket has them back");

    // a reload (a new generation) returns what was leased under the old rules
    leases
        .spend(&hot(100), config(10), 1, 1)
        .await
        .expect("served")
        .expect("ok");
    settle().await;
    assert_eq!(leases.held(), 9);
    leases
        .spend(&hot(100), config(10), 2, 1)
        .await
        .expect("served")
        .expect("ok");
    settle().await;
    assert_eq!(metrics.lease_counts().returned, 18);
    // a call still holding the older rules is not served by the newer
    // lease (the store decides it) and gives nothing back
    assert!(leases.spend(&hot(100), config(10), 1, 1).await.is_none());
    settle().await;
    assert_eq!(metrics.lease_counts().returned, 18);
    assert_eq!(leases.held(), 9);
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
    leases
        .spend(&hot(100), config(10), 1, 3)
        .await
        .expect("served")
        .expect("ok");
    settle().await;
    assert_eq!(leases.return_all().await, 7);
    assert_eq!(leases.held(), 0);
    assert_eq!(
        store.inner.decide_now(&hot(100), Cost::Check)[0].remaining,
        97
    );

    store.fail.store(true, Ordering::SeqCst);
    let e = leases.spend(&hot(100), config(10), 1, 1).await;
    assert!(matches!(e, Some(Err(StoreError::Timeout))), "{e:?}");
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
    assert!(leases.peek(&hot(100), 1).is_none(), "no lease yet");
    leases
        .spend(&hot(100), config(10), 1, 1)
        .await
        .expect("served")
        .expect("ok");
    let o = leases.peek(&hot(100), 1).expect("lease holds tokens");
    assert!(o[0].admitted);
    assert_eq!((o[0].remaining, o[0].taken), (99, 0));
    assert_eq!(leases.held(), 9, "a check spends nothing");
    assert!(
        leases.peek(&hot(100), 2).is_none(),
        "not for a caller with newer rules"
    );
}

/// A bucket with its own parameters (one key, so every rules generation of
/// it shares the lease).
fn bucket(capacity: u64, tokens_per_unit: u64, unit_secs: u64) -> DescriptorBuckets {
    DescriptorBuckets {
        tag: b"hot".to_vec(),
        buckets: vec![BucketRef {
            key: b"hot#0".to_vec(),
            rule: Default::default(),
            params: BucketParams {
                capacity,
                tokens_per_unit,
                unit_secs,
                max_debt: None,
                algorithm: Default::default(),
                period: None,
            },
        }],
        replication: None,
        ratelimit_key: None,
    }
}

/// Audit 1: a caller dropped while waiting for a refill (Envoy's deadline)
/// must not wedge the key.
#[tokio::test]
async fn a_cancelled_caller_does_not_wedge_its_key() {
    let (clock, store) = setup();
    let leases = instance(&clock, &store);
    let metrics = leases.metrics.clone();
    store.gate.forget_permits(OPEN); // Redis paused
    let cancelled = tokio::time::timeout(
        Duration::from_millis(5),
        leases.spend(&hot(100), config(10), 1, 1),
    )
    .await;
    assert!(cancelled.is_err(), "the caller waited and was dropped");
    store.gate.add_permits(OPEN); // Redis back
    let o = tokio::time::timeout(
        Duration::from_secs(2),
        leases.spend(&hot(100), config(10), 1, 1),
    )
    .await
    .expect("the key answers again")
    .expect("served")
    .expect("ok");
    assert!(o[0].admitted);
    settle().await;
    assert_eq!(leases.working(), 0, "no worker left running");
    // the refill the cancelled caller asked for landed in the lease
    let c = metrics.lease_counts();
    assert_eq!(c.granted, 10, "one refill");
    assert_eq!((leases.held(), c.held), (9, 9));
    assert_eq!(
        store.inner.decide_now(&hot(100), Cost::Check)[0].remaining,
        90
    );
}

/// Audit 2: a reload changes what a leased key allows at its next decision.
#[tokio::test]
async fn a_reload_retires_the_lease_before_the_next_decision() {
    let (clock, store) = setup();
    let leases = instance(&clock, &store);
    let old = bucket(100, 100, 1);
    let o = leases
        .spend(&old, config(10), 1, 1)
        .await
        .expect("served")
        .expect("ok");
    assert_eq!(o[0].remaining, 99);
    // new rules: {hour, 1, burst 10}, lease size 2
    let new = bucket(10, 1, 3600);
    let mut admitted = 0;
    for _ in 0..20 {
        let o = leases
            .spend(&new, config(2), 2, 1)
            .await
            .expect("served")
            .expect("ok");
        assert!(o[0].remaining <= 10, "above the new burst: {o:?}");
        admitted += u64::from(o[0].admitted);
    }
    assert_eq!(admitted, 10, "the new burst, not the old lease");
    settle().await;
    assert_eq!(
        leases.metrics.lease_counts().returned,
        9,
        "the old lease went back"
    );
}

/// Audit 4: an expired lease's return reaches the bucket before the refill
/// that follows it.
#[tokio::test]
async fn an_expired_lease_is_returned_before_the_next_refill() {
    let (clock, store) = setup();
    let leases = instance(&clock, &store);
    let b = bucket(10, 1, 3600);
    for _ in 0..40 {
        let o = leases
            .spend(&b, config(10), 1, 1)
            .await
            .expect("served")
            .expect("ok");
        assert!(o[0].admitted);
        clock.advance_micros(SEC + 1_000);
        let o = leases
            .spend(&b, config(10), 1, 1)
            .await
            .expect("served")
            .expect("ok");
        assert!(o[0].admitted, "expired tokens raced the refill: {o:?}");
        assert_eq!(o[0].remaining, 8);
        settle().await;
        assert_eq!(leases.return_all().await, 8);
        store.inner.decide_now(&b, Cost::Refund(2));
    }
}

/// Audit 5: a refill rejected for a larger cost does not answer a waiter
/// that needs fewer tokens.
#[tokio::test]
async fn a_rejection_answers_only_the_callers_it_speaks_for() {
    let (clock, store) = setup();
    let leases = instance(&clock, &store);
    let b = bucket(10, 1, 3600);
    store.inner.decide_now(&b, Cost::Spend(7)); // 3 left
    store.gate.forget_permits(OPEN);
    let (big, small) = (leases.clone(), leases.clone());
    let (b1, b2) = (b.clone(), b.clone());
    let big = tokio::spawn(async move { big.spend(&b1, config(10), 1, 5).await });
    settle().await;
    let small = tokio::spawn(async move { small.spend(&b2, config(10), 1, 1).await });
    settle().await;
    store.gate.add_permits(OPEN);
    let big = big.await.expect("task").expect("served").expect("ok");
    let small = small.await.expect("task").expect("served").expect("ok");
    assert!(!big[0].admitted);
    assert_eq!(big[0].retry_after_secs, Some(7200), "2 tokens at 1/hour");
    assert!(
        small[0].admitted,
        "the small caller was answered with the big one's rejection"
    );
}

mod interleavings {
    use futures::FutureExt;
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Spend(u64),
        /// Polled once, then dropped: a caller cancelled mid-wait.
        Cancelled(u64),
        /// New rules: another lease size and ttl.
        Reload(u64, u64),
        Advance(u64),
        Sweep,
        /// Lets spawned workers run.
        Settle,
        /// The store stops answering for a while (calls wait).
        Pause,
        Resume,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u64..=3).prop_map(Op::Spend),
            2 => (1u64..=3).prop_map(Op::Cancelled),
            1 => (3u64..=10, 100u64..=2000).prop_map(|(s, t)| Op::Reload(s, t)),
            2 => (0u64..=1500).prop_map(Op::Advance),
            1 => Just(Op::Sweep),
            2 => Just(Op::Settle),
            1 => Just(Op::Pause),
            1 => Just(Op::Resume),
        ]
    }

    /// B = 20, r = 10/s.
    fn params() -> DescriptorBuckets {
        bucket(20, 10, 1)
    }

    async fn run(ops: Vec<Op>) {
        let (clock, store) = setup();
        let leases = instance(&clock, &store);
        let metrics = leases.metrics.clone();
        let (mut generation, mut lease) = (1u64, config(5));
        let (mut admitted, mut elapsed_ms, mut paused) = (0u64, 0u64, false);
        let mut spends = Vec::new();
        for op in ops {
            match op {
                Op::Spend(cost) => {
                    let (l, g) = (leases.clone(), generation);
                    spends.push(tokio::spawn(async move {
                        l.spend(&params(), lease, g, cost).await.map(|r| (r, cost))
                    }));
                }
                Op::Cancelled(cost) => {
                    if let Some(Some(Ok(o))) = leases
                        .spend(&params(), lease, generation, cost)
                        .now_or_never()
                    {
                        admitted += if o[0].admitted { cost } else { 0 };
                    }
                }
                Op::Reload(size, ttl) => {
                    generation += 1;
                    lease = LeaseConfig {
                        size,
                        ttl: Duration::from_millis(ttl),
                    };
                }
                Op::Advance(ms) => {
                    clock.advance_micros(ms * 1000);
                    elapsed_ms += ms;
                }
                Op::Sweep => {
                    leases.sweep(generation);
                }
                Op::Settle => settle().await,
                Op::Pause if !paused => {
                    store.gate.forget_permits(OPEN);
                    paused = true;
                }
                Op::Resume if paused => {
                    store.gate.add_permits(OPEN);
                    paused = false;
                }
                Op::Pause | Op::Resume => {}
            }
        }
        if paused {
            store.gate.add_permits(OPEN);
        }
        for s in spends {
            let result = tokio::time::timeout(Duration::from_secs(5), s)
                .await
                .expect("no caller wedged")
                .expect("task");
            if let Some((Ok(o), cost)) = result {
                admitted += if o[0].admitted { cost } else { 0 };
            }
        }
        // No key wedged: a fresh caller is answered.
        let last = tokio::time::timeout(
            Duration::from_secs(5),
            leases.spend(&params(), lease, generation, 1),
        )
        .await
        .expect("the key answers");
        if let Some(Ok(o)) = last {
            admitted += u64::from(o[0].admitted);
        }
        settle().await;
        assert_eq!(leases.working(), 0, "a worker stayed running");

        // Never over the bucket: admitted <= B + r·t.
        let bound = 20 + 10 * elapsed_ms / 1000;
        assert!(admitted <= bound, "admitted {admitted} > B + r·t = {bound}");

        // Every token granted is spent, held, returned or lost.
        leases.return_all().await;
        let c = metrics.lease_counts();
        assert_eq!(c.held, 0, "{c:?}");
        assert_eq!(c.lost, 0, "the store never failed: {c:?}");
        assert_eq!(
            c.granted,
            admitted + c.returned,
            "granted = spent + returned: {c:?}, admitted {admitted}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn any_interleaving_keeps_the_invariants(ops in proptest::collection::vec(op(), 1..60)) {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("runtime")
                .block_on(run(ops));
        }
    }
}
