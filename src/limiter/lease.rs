//! Leases: spending one hot shared bucket through local batches of tokens.
//!
//! Under a rule's `lease: {size, ttl}`, an instance takes up to `size` tokens
//! from the shared bucket in one store call (the bucket deducts them at once)
//! and admits requests from them without asking the store again. The fleet
//! therefore never admits more than the shared bucket granted: a token is
//! deducted before it is spent. The price is under-admission while tokens sit
//! unspent in some instance's lease, at most `size` per instance and key.
//!
//! One [`Lease`] per descriptor (its bucket keys) and instance. Callers share
//! it: at most one store call per lease is in flight (a *refill*); callers
//! that find too few tokens wait for it and then share its answer, so a
//! rejection reached many waiters with one call. A refill starts before the
//! tokens run out (*prefetch*, at half of `size`) so callers rarely wait.
//!
//! Unspent tokens go back to the bucket (a refund, never above B) when they
//! are older than `ttl`, when the rules are reloaded, and at shutdown. A
//! return that fails, and a refill whose answer never came (it may have
//! deducted), are counted in `rls_lease_tokens_lost_total`. A crashed
//! instance counts nothing: its lost lease is its `rls_lease_tokens_held` at
//! the last scrape.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tracing::Instrument;

use super::bucket::{BucketOutcome, Cost};
use crate::clock::Clock;
use crate::rules::LeaseConfig;
use crate::store::{DescriptorBuckets, Store, StoreError};
use crate::telemetry::tracing::SPAN_TARGET;
use crate::telemetry::Metrics;

/// Part of the lease table, by lease key.
type Shard = Mutex<HashMap<Box<[u8]>, Arc<Lease>>>;

/// The leases of one instance.
pub struct Leases<C: Clock> {
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    clock: C,
    shards: Box<[Shard]>,
    hasher: RandomState,
}

/// One descriptor's lease on this instance.
pub struct Lease {
    buckets: DescriptorBuckets,
    state: Mutex<LeaseState>,
    /// Woken when a refill lands.
    landed: Notify,
}

struct LeaseState {
    config: LeaseConfig,
    /// Generation of the rules the tokens were granted under.
    generation: u64,
    /// Unspent tokens this instance holds.
    tokens: u64,
    /// When unspent tokens go back (µs, the leases' clock).
    expires_micros: u64,
    refilling: bool,
    /// Refills that have landed so far.
    round: u64,
    /// What the last store answer that was not a grant said, for callers
    /// that waited for it: a rejection or an error.
    refused: Option<Result<Vec<BucketOutcome>, StoreError>>,
    /// Per bucket, `(remaining, full_in_secs)` at the last store answer.
    shared: Vec<(u64, u64)>,
    last_used_micros: u64,
    /// Dropped from the table: callers holding it must look it up again.
    retired: bool,
}

/// What a caller does next, decided under the lease's lock.
enum Step {
    Admitted(Vec<BucketOutcome>, Option<(u64, u64)>),
    Answer(Result<Vec<BucketOutcome>, StoreError>),
    Wait,
    Refill { needed: u64, up_to: u64, round: u64 },
}

impl LeaseState {
    /// Outcomes for a decision answered from the lease: what this instance
    /// still holds plus what the shared bucket had at the last store answer.
    fn local_outcomes(&self, taken: u64) -> Vec<BucketOutcome> {
        self.shared
            .iter()
            .map(|&(remaining, full_in_secs)| BucketOutcome {
                admitted: true,
                remaining: remaining.saturating_add(self.tokens),
                retry_after_secs: None,
                full_in_secs,
                never: None,
                taken,
            })
            .collect()
    }
}

/// Bucket keys written one after another with their lengths: one lease per
/// set of buckets (a descriptor whose limits were partly replaced is another).
fn lease_key(buckets: &DescriptorBuckets) -> Box<[u8]> {
    let mut key = Vec::with_capacity(buckets.buckets.iter().map(|b| b.key.len() + 4).sum());
    for b in &buckets.buckets {
        key.extend_from_slice(&(b.key.len() as u32).to_le_bytes());
        key.extend_from_slice(&b.key);
    }
    key.into_boxed_slice()
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl<C: Clock> Leases<C> {
    pub fn new(store: Arc<dyn Store>, metrics: Arc<Metrics>, clock: C) -> Self {
        Self {
            store,
            metrics,
            clock,
            shards: (0..64).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
        }
    }

    fn shard(&self, key: &[u8]) -> &Shard {
        let h = self.hasher.hash_one(key) as usize;
        &self.shards[h % self.shards.len()]
    }

    fn lease(
        &self,
        buckets: &DescriptorBuckets,
        config: LeaseConfig,
        generation: u64,
    ) -> Arc<Lease> {
        let key = lease_key(buckets);
        let mut shard = self.shard(&key).lock();
        if let Some(lease) = shard.get(&key) {
            return lease.clone();
        }
        let now = self.clock.now_micros();
        let lease = Arc::new(Lease {
            buckets: buckets.clone(),
            state: Mutex::new(LeaseState {
                config,
                generation,
                tokens: 0,
                expires_micros: now,
                refilling: false,
                round: 0,
                refused: None,
                shared: vec![(0, 0); buckets.buckets.len()],
                last_used_micros: now,
                retired: false,
            }),
            landed: Notify::new(),
        });
        shard.insert(key, lease.clone());
        lease
    }

    /// Spends `cost` tokens (at most the lease's size) under `config` for a
    /// request seen with rules of `generation`: from the lease when it holds
    /// enough, else after a refill. The outcomes read like a store's.
    pub async fn spend(
        self: &Arc<Self>,
        buckets: &DescriptorBuckets,
        config: LeaseConfig,
        generation: u64,
        cost: u64,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        let mut lease = self.lease(buckets, config, generation);
        let mut waited: Option<u64> = None;
        loop {
            // Registered before the state is read: a refill that lands after
            // the read wakes it (notify_waiters), one that landed before is seen.
            let current = lease.clone();
            let landed = current.landed.notified();
            let step = {
                let mut st = current.state.lock();
                if st.retired {
                    drop(st);
                    lease = self.lease(buckets, config, generation);
                    continue;
                }
                let now = self.clock.now_micros();
                self.renew(&lease, &mut st, now, Some((generation, config)));
                st.last_used_micros = now;
                if st.tokens >= cost {
                    st.tokens -= cost;
                    let outcomes = st.local_outcomes(cost);
                    let prefetch = st.tokens <= st.config.size / 2 && !st.refilling;
                    let prefetch = prefetch.then(|| {
                        st.refilling = true;
                        (1, st.config.size - st.tokens)
                    });
                    Step::Admitted(outcomes, prefetch)
                } else if let Some(answer) = waited
                    .filter(|w| st.round > *w)
                    .and_then(|_| st.refused.clone())
                {
                    Step::Answer(answer)
                } else if st.refilling {
                    waited = Some(st.round);
                    Step::Wait
                } else {
                    st.refilling = true;
                    Step::Refill {
                        needed: cost - st.tokens,
                        up_to: st.config.size.max(cost) - st.tokens,
                        round: st.round,
                    }
                }
            };
            match step {
                Step::Admitted(outcomes, prefetch) => {
                    self.metrics.lease_local_hit(cost);
                    if let Some((needed, up_to)) = prefetch {
                        let (leases, lease) = (self.clone(), lease.clone());
                        tokio::spawn(async move {
                            leases.refill(&lease, needed, up_to, generation).await
                        });
                    }
                    return Ok(outcomes);
                }
                Step::Answer(answer) => return answer,
                Step::Wait => landed.await,
                Step::Refill {
                    needed,
                    up_to,
                    round,
                } => {
                    self.refill(&lease, needed, up_to, generation).await;
                    waited = Some(round);
                }
            }
        }
    }

    /// A check (`hits_addend: 0`) answered from the lease, if it holds a token.
    pub fn peek(&self, buckets: &DescriptorBuckets) -> Option<Vec<BucketOutcome>> {
        let key = lease_key(buckets);
        let lease = self.shard(&key).lock().get(&key).cloned()?;
        let st = lease.state.lock();
        (st.tokens >= 1 && self.clock.now_micros() < st.expires_micros)
            .then(|| st.local_outcomes(0))
    }

    /// Gives back tokens that expired or were granted under older rules
    /// (`current`: the generation and config in force, when known).
    fn renew(
        self: &Arc<Self>,
        lease: &Arc<Lease>,
        st: &mut LeaseState,
        now: u64,
        current: Option<(u64, LeaseConfig)>,
    ) {
        // Only newer rules outdate a lease: a call that read the rules just
        // before a reload keeps using what the newer ones were granted.
        let stale = current.is_some_and(|(g, _)| g > st.generation);
        if st.tokens > 0 && (stale || now >= st.expires_micros) {
            let tokens = std::mem::take(&mut st.tokens);
            self.metrics.lease_released(tokens);
            self.give_back(lease.clone(), tokens);
        }
        if let (true, Some((generation, config))) = (stale, current) {
            st.generation = generation;
            st.config = config;
            st.refused = None;
        }
    }

    /// One store call for up to `up_to` tokens (at least `needed`); lands
    /// its answer in the lease and wakes the callers waiting for it.
    async fn refill(
        self: &Arc<Self>,
        lease: &Arc<Lease>,
        needed: u64,
        up_to: u64,
        generation: u64,
    ) {
        let sent = self.clock.now_micros();
        let started = Instant::now();
        let result = self
            .store
            .decide(&lease.buckets, Cost::Lease { needed, up_to })
            .instrument(
                tracing::info_span!(target: SPAN_TARGET, "store.lease", store = self.store.name()),
            )
            .await;
        self.metrics
            .observe_store_call(self.store.name(), started.elapsed().as_secs_f64());
        let surplus = {
            let mut st = lease.state.lock();
            st.refilling = false;
            st.round += 1;
            match result {
                Ok(outcomes) => {
                    st.shared = outcomes
                        .iter()
                        .map(|o| (o.remaining, o.full_in_secs))
                        .collect();
                    let granted = outcomes.first().filter(|o| o.admitted).map(|o| o.taken);
                    match granted {
                        Some(granted) => {
                            self.metrics.lease_granted(granted);
                            if st.retired || st.generation != generation {
                                Some(granted) // the rules changed meanwhile
                            } else {
                                st.tokens += granted;
                                st.expires_micros = sent.saturating_add(micros(st.config.ttl));
                                st.refused = None;
                                None
                            }
                        }
                        None => {
                            st.refused = Some(Ok(outcomes));
                            None
                        }
                    }
                }
                Err(e) => {
                    self.metrics.store_error(e.kind());
                    if matches!(e, StoreError::Timeout | StoreError::Connection(_)) {
                        // it may have run and deducted: those tokens are gone
                        self.metrics.lease_lost(up_to);
                    }
                    st.refused = Some(Err(e));
                    None
                }
            }
        };
        if let Some(tokens) = surplus {
            self.give_back(lease.clone(), tokens);
        }
        lease.landed.notify_waiters();
    }

    /// Returns `tokens` to the shared bucket in the background.
    fn give_back(self: &Arc<Self>, lease: Arc<Lease>, tokens: u64) {
        let leases = self.clone();
        tokio::spawn(async move { leases.give_back_now(&lease.buckets, tokens).await });
    }

    async fn give_back_now(&self, buckets: &DescriptorBuckets, tokens: u64) -> bool {
        let started = Instant::now();
        let result = self.store.decide(buckets, Cost::Refund(tokens)).await;
        self.metrics
            .observe_store_call(self.store.name(), started.elapsed().as_secs_f64());
        match result {
            Ok(_) => {
                self.metrics.lease_returned(tokens);
                true
            }
            Err(e) => {
                self.metrics.store_error(e.kind());
                self.metrics.lease_lost(tokens);
                tracing::debug!(error = %e, tokens, "could not return unspent lease tokens");
                false
            }
        }
    }

    /// Gives back expired and outdated tokens, and forgets leases idle for
    /// longer than their ttl (and at least a second). Returns the leases kept.
    pub fn sweep(self: &Arc<Self>, generation: u64) -> usize {
        let now = self.clock.now_micros();
        let mut kept = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            shard.retain(|_, lease| {
                let mut st = lease.state.lock();
                let config = st.config;
                self.renew(lease, &mut st, now, Some((generation, config)));
                let idle_for = micros(config.ttl.max(Duration::from_secs(1)));
                let idle = st.tokens == 0
                    && !st.refilling
                    && now.saturating_sub(st.last_used_micros) >= idle_for;
                if idle {
                    st.retired = true;
                }
                !idle
            });
            kept += shard.len();
        }
        kept
    }

    /// Runs [`Leases::sweep`] every `every` with the generation `generation`
    /// reports, until the leases are dropped.
    pub fn spawn_sweeper(
        self: &Arc<Self>,
        every: Duration,
        generation: impl Fn() -> u64 + Send + 'static,
    ) {
        crate::periodic::spawn_every(self, every, move |leases| {
            leases.sweep(generation());
        });
    }

    /// Gives every unspent token back and forgets every lease (shutdown).
    /// Returns the tokens given back.
    pub async fn return_all(&self) -> u64 {
        let mut returns = Vec::new();
        for shard in self.shards.iter() {
            for (_, lease) in shard.lock().drain() {
                let mut st = lease.state.lock();
                st.retired = true;
                let tokens = std::mem::take(&mut st.tokens);
                drop(st);
                self.metrics.lease_released(tokens);
                if tokens > 0 {
                    returns.push((lease, tokens));
                }
            }
        }
        let results = futures::future::join_all(
            returns
                .iter()
                .map(|(lease, tokens)| self.give_back_now(&lease.buckets, *tokens)),
        )
        .await;
        returns
            .iter()
            .zip(results)
            .filter(|(_, ok)| *ok)
            .map(|((_, tokens), _)| tokens)
            .sum()
    }

    /// Unspent tokens held by this instance now.
    pub fn held(&self) -> u64 {
        self.shards
            .iter()
            .flat_map(|s| s.lock().values().cloned().collect::<Vec<_>>())
            .map(|l| l.state.lock().tokens)
            .sum()
    }
}

#[cfg(test)]
mod tests;
