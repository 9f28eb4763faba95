//! A circuit breaker in front of a store, so that a dead or hung Redis costs
//! one timeout per few requests instead of one per request.
//!
//! Closed: calls go through; [`OPEN_AFTER`] consecutive timeouts or
//! connection failures open it. Open: calls fail at once with
//! [`StoreError::BreakerOpen`] (the rule's failure mode answers), while a
//! background task probes the store every [`PROBE_EVERY`] and closes the
//! breaker when it answers. One log line when it opens, one when it closes.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::{DescriptorBuckets, Store, StoreError};
use crate::limiter::bucket::{BucketOutcome, Cost};

/// Consecutive failures that open the breaker.
pub const OPEN_AFTER: u32 = 3;
/// How often an open breaker probes the store.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);

pub struct Breaker<S> {
    inner: Arc<S>,
    state: Arc<BreakerState>,
}

#[derive(Default)]
struct BreakerState {
    open: AtomicBool,
    failures: AtomicU32,
}

/// A store that can say whether it answers at all.
#[async_trait]
pub trait Probe: Send + Sync + 'static {
    /// A cheap round trip to every server the store decides on.
    async fn probe(&self) -> Result<(), StoreError>;
}

impl<S: Store + Probe> Breaker<S> {
    pub fn new(inner: Arc<S>) -> Self {
        Self {
            inner,
            state: Arc::default(),
        }
    }

    pub fn is_open(&self) -> bool {
        self.state.open.load(Ordering::Acquire)
    }

    fn on_result<T>(&self, result: &Result<T, StoreError>) {
        match result {
            Ok(_) => self.state.failures.store(0, Ordering::Relaxed),
            Err(StoreError::Timeout | StoreError::Connection(_)) => {
                let failures = self.state.failures.fetch_add(1, Ordering::AcqRel) + 1;
                if failures >= OPEN_AFTER && !self.state.open.swap(true, Ordering::AcqRel) {
                    tracing::warn!(
                        store = self.inner.name(),
                        failures,
                        "circuit breaker open: the store is failing; failure modes answer until it recovers"
                    );
                    self.spawn_probe();
                }
            }
            Err(_) => {}
        }
    }

    fn spawn_probe(&self) {
        let (inner, state) = (self.inner.clone(), self.state.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROBE_EVERY).await;
                if inner.probe().await.is_ok() {
                    state.failures.store(0, Ordering::Relaxed);
                    state.open.store(false, Ordering::Release);
                    tracing::info!(
                        store = inner.name(),
                        "circuit breaker closed: the store answers again"
                    );
                    return;
                }
            }
        });
    }
}

#[async_trait]
impl<S: Store + Probe> Store for Breaker<S> {
    async fn decide(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        if self.is_open() {
            return Err(StoreError::BreakerOpen);
        }
        let result = self.inner.decide(descriptor, cost).await;
        self.on_result(&result);
        result
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn reachable(&self) -> bool {
        !self.is_open() && self.inner.reachable()
    }

    fn warnings(&self) -> Vec<String> {
        self.inner.warnings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A store whose health the test switches, counting the calls it gets.
    #[derive(Default)]
    struct Switch {
        down: AtomicBool,
        calls: AtomicUsize,
    }

    #[async_trait]
    impl Store for Switch {
        async fn decide(
            &self,
            _: &DescriptorBuckets,
            _: Cost,
        ) -> Result<Vec<BucketOutcome>, StoreError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                Err(StoreError::Timeout)
            } else {
                Ok(Vec::new())
            }
        }
        fn name(&self) -> &'static str {
            "switch"
        }
    }

    #[async_trait]
    impl Probe for Switch {
        async fn probe(&self) -> Result<(), StoreError> {
            if self.down.load(Ordering::SeqCst) {
                Err(StoreError::Timeout)
            } else {
                Ok(())
            }
        }
    }

    fn descriptor() -> DescriptorBuckets {
        DescriptorBuckets {
            tag: Vec::new(),
            buckets: Vec::new(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_and_closes_when_probes_pass() {
        let inner = Arc::new(Switch::default());
        let breaker = Breaker::new(inner.clone());
        let d = descriptor();
        inner.down.store(true, Ordering::SeqCst);
        for _ in 0..OPEN_AFTER {
            assert!(matches!(
                breaker.decide(&d, Cost::Spend(1)).await,
                Err(StoreError::Timeout)
            ));
        }
        assert!(breaker.is_open());
        assert!(!breaker.reachable());
        for _ in 0..100 {
            assert!(matches!(
                breaker.decide(&d, Cost::Spend(1)).await,
                Err(StoreError::BreakerOpen)
            ));
        }
        assert_eq!(
            inner.calls.load(Ordering::SeqCst),
            OPEN_AFTER as usize,
            "open: no calls reach the store"
        );
        tokio::time::sleep(PROBE_EVERY * 3).await;
        assert!(breaker.is_open(), "probes fail while the store is down");
        inner.down.store(false, Ordering::SeqCst);
        tokio::time::sleep(PROBE_EVERY * 2).await;
        assert!(!breaker.is_open(), "a passing probe closes it");
        assert!(breaker.decide(&d, Cost::Spend(1)).await.is_ok());
    }

    #[tokio::test]
    async fn a_success_resets_the_count() {
        let inner = Arc::new(Switch::default());
        let breaker = Breaker::new(inner.clone());
        let d = descriptor();
        for _ in 0..5 {
            inner.down.store(true, Ordering::SeqCst);
            for _ in 0..OPEN_AFTER - 1 {
                let _ = breaker.decide(&d, Cost::Spend(1)).await;
            }
            inner.down.store(false, Ordering::SeqCst);
            assert!(breaker.decide(&d, Cost::Spend(1)).await.is_ok());
        }
        assert!(
            !breaker.is_open(),
            "failures that are not consecutive never open it"
        );
    }
}
