//! The embedded store: bucket state in process memory.
//!
//! Buckets are spread over many mutex-guarded shards by the descriptor's tag,
//! so one descriptor's buckets sit in one shard and are decided under one
//! short lock, and unrelated requests rarely meet. Time comes from a
//! monotonic [`Clock`]. A bucket that has refilled completely is the same as
//! no bucket, so a sweeper drops such entries: memory is bounded by the
//! buckets that are not full, not by every key ever seen.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

use super::{DescriptorBuckets, Store, StoreError};
use crate::bucket::{self, BucketOutcome, BucketState, Cost};
use crate::clock::Clock;

/// A bucket's state plus when it will be full again (and can be forgotten).
#[derive(Debug, Clone, Copy)]
struct Entry {
    state: BucketState,
    full_at_micros: u64,
}

type Shard = Mutex<HashMap<Box<[u8]>, Entry>>;

/// In-memory buckets for one process.
pub struct MemoryStore<C: Clock> {
    shards: Box<[Shard]>,
    /// Keyed SipHash: request values pick the shard, so the seed must be secret.
    hasher: RandomState,
    clock: C,
}

impl<C: Clock> MemoryStore<C> {
    pub fn new(clock: C) -> Self {
        let count =
            (std::thread::available_parallelism().map_or(4, |n| n.get()) * 16).next_power_of_two();
        Self {
            shards: (0..count).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            clock,
        }
    }

    fn shard(&self, tag: &[u8]) -> &Shard {
        let h = self.hasher.hash_one(tag) as usize;
        &self.shards[h & (self.shards.len() - 1)]
    }

    /// Decides synchronously; the [`Store`] impl wraps this.
    pub fn decide_now(&self, descriptor: &DescriptorBuckets, cost: Cost) -> Vec<BucketOutcome> {
        let params: Vec<_> = descriptor.buckets.iter().map(|b| b.params).collect();
        let mut shard = self.shard(&descriptor.tag).lock();
        let now = self.clock.now_micros();
        let states: Vec<Option<BucketState>> = descriptor
            .buckets
            .iter()
            .map(|b| shard.get(b.key.as_slice()).map(|e| e.state))
            .collect();
        let (new_states, outcomes) = bucket::decide(&params, &states, now, cost);
        // Only an admitted request that spends (or refunds) changes anything: a
        // rejection or a check leaves the state as it was (refill is a pure
        // function of it).
        let writes = outcomes.first().is_some_and(|o| o.admitted) && cost.deducted() != 0;
        if !writes {
            // Nothing to store, but a reload may have lowered the rate since
            // the bucket was written: it is full later now, not at the time
            // its old numbers gave (the Lua script lengthens the TTL alike).
            for (b, p) in descriptor.buckets.iter().zip(&params) {
                if let Some(e) = shard.get_mut(b.key.as_slice()) {
                    let full_at_micros = p.full_at_micros(&e.state).unwrap_or(u64::MAX);
                    e.full_at_micros = e.full_at_micros.max(full_at_micros);
                }
            }
        }
        if writes {
            for ((b, state), p) in descriptor.buckets.iter().zip(new_states).zip(&params) {
                let full_at_micros = p.full_at_micros(&state).unwrap_or(u64::MAX);
                match shard.get_mut(b.key.as_slice()) {
                    Some(e) => {
                        *e = Entry {
                            state,
                            full_at_micros,
                        }
                    }
                    None => {
                        shard.insert(
                            b.key.clone().into_boxed_slice(),
                            Entry {
                                state,
                                full_at_micros,
                            },
                        );
                    }
                }
            }
        }
        outcomes
    }

    /// Drops every bucket that is full again; returns how many were dropped.
    pub fn evict_full(&self) -> usize {
        let now = self.clock.now_micros();
        let mut dropped = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let before = shard.len();
            shard.retain(|_, e| e.full_at_micros > now);
            dropped += before - shard.len();
            if shard.capacity() > 64 && shard.capacity() > shard.len() * 4 {
                shard.shrink_to_fit();
            }
        }
        dropped
    }

    /// Buckets currently held (not full).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<C: Clock> MemoryStore<C> {
    /// Runs [`MemoryStore::evict_full`] every `every` until the store is dropped.
    pub fn spawn_sweeper(self: &Arc<Self>, every: Duration) {
        crate::periodic::spawn_every(self, every, |store| {
            store.evict_full();
        });
    }
}

#[async_trait]
impl<C: Clock> Store for MemoryStore<C> {
    async fn decide(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        Ok(self.decide_now(descriptor, cost))
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::BucketParams;
    use crate::clock::ManualClock;
    use crate::store::BucketRef;

    fn descriptor(key: &str, capacity: u64, rate: u64) -> DescriptorBuckets {
        DescriptorBuckets {
            tag: key.as_bytes().to_vec(),
            buckets: vec![BucketRef {
                key: key.as_bytes().to_vec(),
                params: BucketParams {
                    capacity,
                    tokens_per_unit: rate,
                    unit_secs: 1,
                },
            }],
        }
    }

    #[test]
    fn admits_exactly_the_burst_then_refills() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::new(clock.clone());
        let d = descriptor("a", 3, 1);
        let admitted = (0..10)
            .filter(|_| store.decide_now(&d, Cost::Spend(1))[0].admitted)
            .count();
        assert_eq!(admitted, 3);
        clock.advance_secs_f64(1.0);
        assert!(store.decide_now(&d, Cost::Spend(1))[0].admitted);
        assert!(!store.decide_now(&d, Cost::Spend(1))[0].admitted);
    }

    #[test]
    fn rejections_and_checks_store_nothing() {
        let store = MemoryStore::new(ManualClock::new(1));
        store.decide_now(&descriptor("big", 2, 1), Cost::Spend(5));
        store.decide_now(&descriptor("check", 2, 1), Cost::Check);
        store.decide_now(&descriptor("zero", 0, 0), Cost::Spend(1));
        assert!(store.is_empty());
    }

    /// Audit 6: a reload lowers the rate of a drained bucket; a decision
    /// after it moves the time the bucket is forgotten to the new numbers.
    #[test]
    fn a_lowered_rate_keeps_the_bucket_until_the_new_full_time() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::new(clock.clone());
        let fast = descriptor("k", 5, 1); // {second, 1, burst 5}
        for _ in 0..5 {
            assert!(store.decide_now(&fast, Cost::Spend(1))[0].admitted);
        }
        let mut slow = fast.clone(); // reloaded: {hour, 1, burst 5}
        slow.buckets[0].params.unit_secs = 3600;
        clock.advance_secs_f64(1.5);
        let o = store.decide_now(&slow, Cost::Check)[0];
        assert_eq!(o.retry_after_secs, Some(3599), "1.5 s of the new rate");
        clock.advance_secs_f64(5.0);
        assert_eq!(store.evict_full(), 0, "not full under the new rate");
        let admitted = (0..6)
            .filter(|_| store.decide_now(&slow, Cost::Spend(1))[0].admitted)
            .count();
        assert_eq!(admitted, 0, "6.5 s at one per hour refill no token");
    }

    #[test]
    fn full_buckets_are_evicted_and_others_kept() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::new(clock.clone());
        for i in 0..100 {
            store.decide_now(&descriptor(&format!("fast{i}"), 10, 10), Cost::Spend(1));
        }
        store.decide_now(&descriptor("slow", 10, 1), Cost::Spend(5));
        assert_eq!(store.len(), 101);
        assert_eq!(store.evict_full(), 0, "nothing full yet");
        clock.advance_secs_f64(0.2); // fast buckets needed 0.1 s
        assert_eq!(store.evict_full(), 100);
        assert_eq!(store.len(), 1);
        clock.advance_secs_f64(5.0);
        assert_eq!(store.evict_full(), 1);
        // a forgotten bucket behaves as a full one
        let d = descriptor("slow", 10, 1);
        assert_eq!(store.decide_now(&d, Cost::Spend(1))[0].remaining, 9);
    }

    #[test]
    fn concurrent_spending_admits_exactly_the_capacity() {
        let store = Arc::new(MemoryStore::new(ManualClock::new(1)));
        let d = descriptor("hot", 200, 0);
        let d = DescriptorBuckets {
            buckets: vec![BucketRef {
                params: BucketParams {
                    tokens_per_unit: 1,
                    unit_secs: 86_400,
                    ..d.buckets[0].params
                },
                ..d.buckets[0].clone()
            }],
            ..d
        };
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (store, d) = (store.clone(), d.clone());
                std::thread::spawn(move || {
                    (0..250)
                        .filter(|_| store.decide_now(&d, Cost::Spend(1))[0].admitted)
                        .count()
                })
            })
            .collect();
        let total: usize = handles.into_iter().map(|h| h.join().expect("thread")).sum();
        assert_eq!(total, 200);
    }
}
