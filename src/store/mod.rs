//! Where bucket state lives. A [`Store`] decides one descriptor's buckets
//! atomically: it reads their state, applies the bucket math of
//! [`crate::bucket`], and writes the result, with no other decision on
//! those buckets in between.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `quota`; uses `telemetry`, `tls` and leaves; never the rules.

pub mod breaker;
pub mod key;
pub mod memory;
pub mod per_second;
pub mod redis;

use async_trait::async_trait;

use crate::attempt::{AttemptCall, AttemptResult, SlotOutcome};
use crate::bucket::{BucketOutcome, BucketParams, Cost};
use crate::labels::RuleId;
use crate::replication::Replication;

/// One bucket of a descriptor: its store key, its parameters, and the rule
/// it belongs to.
#[derive(Debug, Clone)]
pub struct BucketRef {
    pub key: Vec<u8>,
    pub params: BucketParams,
    pub rule: RuleId,
}

/// The buckets one descriptor spends from, decided together.
#[derive(Debug, Clone)]
pub struct DescriptorBuckets {
    /// Shared by every bucket of the descriptor: picks the memory shard or the
    /// Redis slot, so that they can be decided in one atomic step.
    pub tag: Vec<u8>,
    pub buckets: Vec<BucketRef>,
    /// The rule's `replication:`: an admission is answered once this many
    /// replicas hold it (the Redis store; the memory store has none).
    pub replication: Option<Replication>,
    /// envoyproxy/ratelimit's key of a fixed-window descriptor it counts
    /// as that service does (`domain_key_value_…_`, without the key
    /// prefix and the window's start, which the Redis store adds): counted
    /// there with `INCRBY` + `EXPIRE` in that key, so that both services
    /// on one Redis count one budget. `None`: the store's own layout. The
    /// memory store decides such a descriptor as any fixed window.
    pub ratelimit_key: Option<Vec<u8>>,
}

/// One call of an attempt, decided: the buckets' outcomes (a repeat is
/// answered OK from the buckets as they are), and what the call was.
#[derive(Debug, Clone)]
pub struct AttemptOutcome {
    pub outcomes: Vec<BucketOutcome>,
    pub result: AttemptResult,
    /// Reservations of the descriptor found expired unsettled by this call
    /// (kept as spent), to be counted; 0 where a sweep counts them.
    pub expired: u64,
}

/// Why a store could not decide.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store call timed out")]
    Timeout,
    #[error("store connection failed: {0}")]
    Connection(String),
    #[error("store script failed: {0}")]
    Script(String),
    /// Redis is at its `maxmemory` (with `noeviction`) and refuses writes.
    #[error("store out of memory: {0}")]
    OutOfMemory(String),
    #[error("store unavailable (circuit breaker open)")]
    BreakerOpen,
    #[error("too many store calls in flight (--max-in-flight)")]
    Overloaded,
    /// On a region: a global rule's share expired while the global tier
    /// is unreachable, and the rule fails closed.
    #[error("the global tier is unreachable and this region's share of a global rule has expired")]
    Upstream,
    /// A rule's `replication:` was not met: fewer replicas than it asks
    /// acknowledged an admission in its time (the primary answered).
    #[error("admission not replicated: {0}")]
    NotReplicated(String),
}

impl StoreError {
    /// Every value of [`StoreError::kind`] (the metric's list).
    pub const KINDS: [&'static str; 8] = crate::telemetry::metrics::STORE_ERROR_KINDS;

    /// The `kind` label of `rls_store_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout => "timeout",
            StoreError::Connection(_) => "connection",
            StoreError::Script(_) => "script",
            StoreError::OutOfMemory(_) => "oom",
            StoreError::BreakerOpen => "breaker_open",
            StoreError::Overloaded => "overloaded",
            StoreError::Upstream => "upstream",
            StoreError::NotReplicated(_) => "not_replicated",
        }
    }
}

/// What a descriptor's state holds beyond what a check answers
/// ([`Store::held`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Held {
    /// Per bucket, in order: the whole tokens it owes (a token bucket
    /// charged past empty by an `overdraft` rule), refilled to now; 0 for
    /// a bucket in credit and for windows.
    pub debts: Vec<u64>,
    /// Reservations (`attempts: {mode: reserve}`) started and neither
    /// settled nor expired.
    pub reservations: u64,
    /// A `concurrency` rule's slots held and not yet returned.
    pub slots: u64,
}

impl Held {
    /// Nothing held by `descriptor`.
    pub fn none(descriptor: &DescriptorBuckets) -> Self {
        Self {
            debts: vec![0; descriptor.buckets.len()],
            ..Self::default()
        }
    }
}

/// The whole tokens a token bucket holding `tokens` owes (0 when none).
pub fn debt_of(tokens: f64) -> u64 {
    if tokens < 0.0 {
        (-tokens).ceil() as u64
    } else {
        0
    }
}

/// A place that decides buckets.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Decides `cost` against every bucket of `descriptor`: admitted only if
    /// all admit, and then all pay. Returns one outcome per bucket, in order.
    async fn decide(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError>;

    /// [`Store::decide`] for a caller that can wait up to `patience` (its
    /// share of the caller's deadline): a store whose node is known to be
    /// alive may wait that long for a busy node instead of its own short
    /// timeout. By default the same as `decide`.
    async fn decide_patiently(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        patience: Option<std::time::Duration>,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        let _ = patience;
        self.decide(descriptor, cost).await
    }

    /// Decides one call of an attempt ([`crate::attempt`]): its record
    /// read and written atomically with `descriptor`'s buckets, `cost`
    /// taken as the record says. A store that keeps no attempt records
    /// answers a script error (the server refuses rules with `attempts:`
    /// at load for it).
    async fn decide_attempt(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        call: &AttemptCall,
        patience: Option<std::time::Duration>,
    ) -> Result<AttemptOutcome, StoreError> {
        let _ = (descriptor, cost, call, patience);
        Err(StoreError::Script(format!(
            "the {} store keeps no attempt records",
            self.name()
        )))
    }

    /// One call of a `concurrency` rule's attempt: a start takes one of
    /// `descriptor`'s slots (its tag names them; it has no buckets), at
    /// most `max` held, a done call releases it
    /// ([`crate::attempt::take_slot`]), atomically across instances; the
    /// slots that returned by themselves are `rule`'s.
    async fn decide_slot(
        &self,
        descriptor: &DescriptorBuckets,
        max: u64,
        call: &AttemptCall,
        rule: RuleId,
        patience: Option<std::time::Duration>,
    ) -> Result<SlotOutcome, StoreError> {
        let _ = (descriptor, max, call, rule, patience);
        Err(StoreError::Script(format!(
            "the {} store keeps no slots",
            self.name()
        )))
    }

    /// Forgets `descriptor`'s buckets (an operator's reset: the next
    /// decision finds them full, a window's count at 0); the keys removed.
    /// A store that cannot answers an error.
    async fn forget(&self, descriptor: &DescriptorBuckets) -> Result<u64, StoreError> {
        let _ = descriptor;
        Err(StoreError::Script(format!(
            "the {} store cannot forget buckets",
            self.name()
        )))
    }

    /// What `descriptor`'s state holds beyond what a check answers, for
    /// the bucket inspector: each token bucket's debt, the reservations
    /// and slots it holds. Reads only. A store that keeps none of these
    /// answers none.
    async fn held(&self, descriptor: &DescriptorBuckets) -> Result<Held, StoreError> {
        Ok(Held::none(descriptor))
    }

    /// Where `descriptor`'s buckets are kept, as an operator would look
    /// for them (a Redis key, binary bytes escaped).
    fn key_names(&self, descriptor: &DescriptorBuckets) -> Vec<String> {
        descriptor
            .buckets
            .iter()
            .map(|b| key::escaped(&b.key))
            .collect()
    }

    /// A short name for logs (`memory`, `redis`).
    fn name(&self) -> &'static str;

    /// Whether the store is connected right now (for readiness).
    fn reachable(&self) -> bool {
        true
    }

    /// Whether every call is answered without waiting (the memory store):
    /// a caller that gives up cannot cut such a call, or a request's
    /// calls, in half.
    fn answers_at_once(&self) -> bool {
        false
    }

    /// Problems an operator should fix, shown at `/readyz`.
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }
}
