//! The leases' metrics: tokens taken into leases, given back, lost,
//! decisions admitted from a lease, tokens held.

use prometheus::{IntCounter, IntGauge};

/// Counters of [`crate::limiter::lease`].
pub(super) struct LeaseMetrics {
    pub(super) grants: IntCounter,
    pub(super) granted: IntCounter,
    pub(super) returned: IntCounter,
    pub(super) lost: IntCounter,
    pub(super) local_hits: IntCounter,
    pub(super) held: IntGauge,
}

impl LeaseMetrics {
    pub(super) fn new() -> Self {
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid metric");
        Self {
            grants: counter(
                "rls_lease_grants_total",
                "Lease calls that took tokens from a shared bucket",
            ),
            granted: counter(
                "rls_lease_tokens_granted_total",
                "Tokens taken from shared buckets into leases",
            ),
            returned: counter(
                "rls_lease_tokens_returned_total",
                "Unspent lease tokens given back to their bucket (expiry, reload, shutdown)",
            ),
            lost: counter(
                "rls_lease_tokens_lost_total",
                "Lease tokens that may have been deducted and will not be spent or returned (failed returns, lease calls without an answer)",
            ),
            local_hits: counter(
                "rls_lease_local_hits_total",
                "Decisions admitted from a lease without a store call of their own",
            ),
            held: IntGauge::new(
                "rls_lease_tokens_held",
                "Unspent lease tokens this instance holds now",
            )
            .expect("valid metric"),
        }
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.grants.clone()),
            Box::new(self.granted.clone()),
            Box::new(self.returned.clone()),
            Box::new(self.lost.clone()),
            Box::new(self.local_hits.clone()),
            Box::new(self.held.clone()),
        ]
    }
}

/// A snapshot of the lease metrics, for tests and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseCounts {
    pub grants: u64,
    pub granted: u64,
    pub returned: u64,
    pub lost: u64,
    pub local_hits: u64,
    pub held: i64,
}

/// What the leases tell the metrics.
impl super::Metrics {
    /// A lease call took `tokens` from a shared bucket.
    pub fn lease_granted(&self, tokens: u64) {
        self.lease.grants.inc();
        self.lease.granted.inc_by(tokens);
        self.lease
            .held
            .add(i64::try_from(tokens).unwrap_or(i64::MAX));
    }

    /// A decision spent `tokens` from a lease.
    pub fn lease_local_hit(&self, tokens: u64) {
        self.lease.local_hits.inc();
        self.lease
            .held
            .sub(i64::try_from(tokens).unwrap_or(i64::MAX));
    }

    /// Tokens a decision spent from a lease are back in it (its request
    /// was refused): held again.
    pub fn lease_put_back(&self, tokens: u64) {
        self.lease
            .held
            .add(i64::try_from(tokens).unwrap_or(i64::MAX));
    }

    /// Unspent tokens left a lease, to be given back.
    pub fn lease_released(&self, tokens: u64) {
        self.lease
            .held
            .sub(i64::try_from(tokens).unwrap_or(i64::MAX));
    }

    pub fn lease_returned(&self, tokens: u64) {
        self.lease.returned.inc_by(tokens);
    }

    pub fn lease_lost(&self, tokens: u64) {
        self.lease.lost.inc_by(tokens);
    }

    pub fn lease_counts(&self) -> LeaseCounts {
        LeaseCounts {
            grants: self.lease.grants.get(),
            granted: self.lease.granted.get(),
            returned: self.lease.returned.get(),
            lost: self.lease.lost.get(),
            local_hits: self.lease.local_hits.get(),
            held: self.lease.held.get(),
        }
    }
}
