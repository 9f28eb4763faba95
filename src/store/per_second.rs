//! Two stores, as envoyproxy/ratelimit's `REDIS_PERSECOND` lays them out: a
//! descriptor whose every bucket refills per second is decided in the
//! per-second store, every other one in the main store.
//!
//! Each store keeps its own connections, breakers and failure handling: a
//! per-second Redis that is down leaves per-second rules answering by
//! their failure mode while the rest decide as usual, and the other way
//! round. A descriptor's buckets are decided together in one store, so a
//! rule whose `limits` mix a per-second bucket with another unit stays
//! whole in the main store (all or nothing, as everywhere).
//!
//! **Layer:** store; wraps two [`Store`]s.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::{AttemptOutcome, DescriptorBuckets, Store, StoreError};
use crate::attempt::{AttemptCall, SlotOutcome};
use crate::bucket::{BucketOutcome, Cost};
use crate::labels::RuleId;

/// A main store and a per-second one.
pub struct PerSecondSplit {
    main: Arc<dyn Store>,
    per_second: Arc<dyn Store>,
}

impl PerSecondSplit {
    pub fn new(main: Arc<dyn Store>, per_second: Arc<dyn Store>) -> Self {
        Self { main, per_second }
    }

    /// Where `descriptor` is decided.
    fn of(&self, descriptor: &DescriptorBuckets) -> &dyn Store {
        if is_per_second(descriptor) {
            self.per_second.as_ref()
        } else {
            self.main.as_ref()
        }
    }
}

/// Every bucket of `descriptor` refills per second (a descriptor with no
/// bucket, a concurrency rule's, is not).
pub fn is_per_second(descriptor: &DescriptorBuckets) -> bool {
    !descriptor.buckets.is_empty() && descriptor.buckets.iter().all(|b| b.params.unit_secs == 1)
}

#[async_trait]
impl Store for PerSecondSplit {
    fn answers_at_once(&self) -> bool {
        self.main.answers_at_once() && self.per_second.answers_at_once()
    }

    async fn decide(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        self.of(descriptor).decide(descriptor, cost).await
    }

    async fn decide_patiently(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        patience: Option<Duration>,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        self.of(descriptor)
            .decide_patiently(descriptor, cost, patience)
            .await
    }

    async fn decide_attempt(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        call: &AttemptCall,
        patience: Option<Duration>,
    ) -> Result<AttemptOutcome, StoreError> {
        self.of(descriptor)
            .decide_attempt(descriptor, cost, call, patience)
            .await
    }

    async fn decide_slot(
        &self,
        descriptor: &DescriptorBuckets,
        max: u64,
        call: &AttemptCall,
        rule: RuleId,
        patience: Option<Duration>,
    ) -> Result<SlotOutcome, StoreError> {
        self.of(descriptor)
            .decide_slot(descriptor, max, call, rule, patience)
            .await
    }

    async fn forget(&self, descriptor: &DescriptorBuckets) -> Result<u64, StoreError> {
        self.of(descriptor).forget(descriptor).await
    }

    async fn held(&self, descriptor: &DescriptorBuckets) -> Result<super::Held, StoreError> {
        self.of(descriptor).held(descriptor).await
    }

    fn key_names(&self, descriptor: &DescriptorBuckets) -> Vec<String> {
        self.of(descriptor).key_names(descriptor)
    }

    fn name(&self) -> &'static str {
        self.main.name()
    }

    fn reachable(&self) -> bool {
        self.main.reachable() && self.per_second.reachable()
    }

    fn warnings(&self) -> Vec<String> {
        let mut warnings = self.main.warnings();
        warnings.extend(
            self.per_second
                .warnings()
                .into_iter()
                .map(|w| format!("per-second store: {w}")),
        );
        warnings
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::BucketParams;
    use crate::store::memory::MemoryStore;
    use crate::store::BucketRef;

    fn descriptor(units: &[u64]) -> DescriptorBuckets {
        DescriptorBuckets {
            tag: format!("{units:?}").into_bytes(),
            buckets: units
                .iter()
                .enumerate()
                .map(|(i, unit)| BucketRef {
                    // a bucket's key names its descriptor, as every real
                    // key does (two tags may share a memory shard)
                    key: format!("{units:?}b{i}").into_bytes(),
                    params: BucketParams {
                        capacity: 1,
                        tokens_per_unit: 1,
                        unit_secs: *unit,
                        max_debt: None,
                        algorithm: Default::default(),
                        period: None,
                    },
                    rule: RuleId::default(),
                })
                .collect(),
            replication: None,
            ratelimit_key: None,
        }
    }

    #[test]
    fn only_descriptors_wholly_per_second_go_there() {
        assert!(is_per_second(&descriptor(&[1])));
        assert!(is_per_second(&descriptor(&[1, 1])));
        assert!(!is_per_second(&descriptor(&[60])));
        assert!(!is_per_second(&descriptor(&[1, 60])));
        assert!(!is_per_second(&descriptor(&[])));
    }

    #[tokio::test]
    async fn each_store_decides_its_own() {
        let main = Arc::new(MemoryStore::new(crate::clock::ManualClock::new(0)));
        let per_second = Arc::new(MemoryStore::new(crate::clock::ManualClock::new(0)));
        let split = PerSecondSplit::new(main.clone(), per_second.clone());
        // a burst of one each: the second call of a descriptor is refused
        // only in the store that holds it
        for units in [[1u64], [60]] {
            let d = descriptor(&units);
            assert!(split.decide(&d, Cost::Spend(1)).await.expect("decided")[0].admitted);
            assert!(!split.decide(&d, Cost::Spend(1)).await.expect("decided")[0].admitted);
        }
        let second = descriptor(&[1]);
        assert!(
            !per_second
                .decide(&second, Cost::Spend(1))
                .await
                .expect("decided")[0]
                .admitted
        );
        assert!(main.decide(&second, Cost::Spend(1)).await.expect("decided")[0].admitted);
    }
}
