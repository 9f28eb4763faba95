//! Leases: spending one hot shared bucket through local batches of tokens.
//!
//! Under a rule's `lease: {size, ttl}`, an instance takes up to `size` tokens
//! from the shared bucket in one store call (the bucket deducts them at once)
//! and admits requests from them without asking the store again. The price
//! is under-admission while tokens sit unspent in some instance's lease, at
//! most `size` per instance and key.
//!
//! One [`Lease`] per descriptor (its bucket keys) and instance. Callers share
//! it. Every store call of a lease is made by its *worker*, a task spawned
//! when there is work and ending when there is none: first it gives back the
//! tokens waiting to be returned, then it takes a *refill* if a caller (or a
//! *prefetch*, at half of `size`) asked for one. Callers only wait for the
//! worker's answers; they never own a store call.
//!
//! # Invariants
//! 1. Never over the bucket: a token is deducted from the shared bucket
//!    before it admits anything, and admits at most once.
//! 2. No caller can wedge a key: a cancelled caller (Envoy's filter timeout
//!    drops the gRPC call) cancels only its own wait. The worker outlives it,
//!    and every path out of the worker clears `working` under the lock, so
//!    the next caller always finds either a running worker or none.
//! 3. A lease belongs to one rules generation (its buckets' parameters and
//!    its `size`/`ttl`). A caller with newer rules moves the unspent tokens to
//!    `to_return` and takes the lease over before it decides; the worker
//!    returns them before its next refill, so a return is never overtaken by
//!    the refill after it. A caller with older rules than the lease has seen
//!    is not served from it (the store decides it directly). The sweeper
//!    moves the tokens of leases outdated by a reload to `to_return` too.
//! 4. Expired tokens (older than `ttl`) go to `to_return` likewise, ordered
//!    before the next refill.
//! 5. A refill's rejection answers only the callers it speaks for: those
//!    that needed exactly the tokens it asked for (so that its Retry-After is
//!    exact for them); the others ask again. An error answers every waiter.
//! 6. Accounting: every token granted is spent, held (`tokens` plus
//!    `to_return`), returned, or counted lost (a return that failed).
//!    A lease call without an answer may have taken up to what it asked for;
//!    that is counted lost too. `rls_lease_tokens_held` is what is held now;
//!    a crashed instance's lost lease is its last value.
//! 7. Shutdown ([`Leases::return_all`]) retires every lease, waits for the
//!    workers in flight, then returns everything still held.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tracing::Instrument;

use crate::bucket::{BucketOutcome, Cost};
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
    state: Mutex<LeaseState>,
    /// Woken whenever the worker lands an answer or stops.
    landed: Notify,
}

struct LeaseState {
    /// The buckets and lease settings of `generation`'s rules.
    buckets: DescriptorBuckets,
    config: LeaseConfig,
    generation: u64,
    /// The newest rules generation seen for this lease (by a caller or the
    /// sweeper). `tokens` are spendable only while it equals `generation`.
    newest: u64,
    /// Unspent tokens this instance holds.
    tokens: u64,
    /// When unspent tokens go back (µs, the leases' clock).
    expires_micros: u64,
    /// Tokens taken out of the lease, for the worker to give back.
    to_return: u64,
    /// A worker task owns this lease's store calls now.
    working: bool,
    /// A refill asked of the worker: the tokens the asking caller needs in
    /// the lease (0 for a prefetch, which fills up to `size`).
    wanted: Option<u64>,
    /// Refills that have landed so far.
    round: u64,
    /// The last refill's answer when it granted nothing.
    refused: Option<Refusal>,
    /// Per bucket, `(remaining, full_in_secs)` at the last store answer.
    shared: Vec<(u64, u64)>,
    last_used_micros: u64,
    /// Dropped from the table: callers holding it must look it up again,
    /// and its worker starts no new store call.
    retired: bool,
}

/// A refill that granted nothing, and whom its answer speaks for.
#[derive(Clone)]
struct Refusal {
    /// The round it landed as.
    round: u64,
    /// Tokens it needed: a rejection speaks for callers that needed as many.
    needed: u64,
    answer: Result<Vec<BucketOutcome>, StoreError>,
}

/// What a caller does next, decided under the lease's lock.
enum Step {
    Admitted(Vec<BucketOutcome>),
    Answer(Result<Vec<BucketOutcome>, StoreError>),
    Wait,
}

/// The worker's next store call.
enum Job {
    Return {
        buckets: DescriptorBuckets,
        tokens: u64,
    },
    Refill {
        buckets: DescriptorBuckets,
        generation: u64,
        ttl: Duration,
        needed: u64,
        up_to: u64,
    },
}

impl LeaseState {
    fn new(buckets: &DescriptorBuckets, config: LeaseConfig, generation: u64, now: u64) -> Self {
        Self {
            shared: vec![(0, 0); buckets.buckets.len()],
            buckets: buckets.clone(),
            config,
            generation,
            newest: generation,
            tokens: 0,
            expires_micros: now,
            to_return: 0,
            working: false,
            wanted: None,
            round: 0,
            refused: None,
            last_used_micros: now,
            retired: false,
        }
    }

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
                forgiven: 0,
                window_count: None,
            })
            .collect()
    }

    /// Moves every unspent token to `to_return` (expired, or outdated).
    fn release(&mut self) {
        self.to_return = self
            .to_return
            .saturating_add(std::mem::take(&mut self.tokens));
    }

    /// Gives up tokens that expired or that older rules granted; takes the
    /// lease over for `current` (a caller's newer rules), when given.
    fn renew(&mut self, now: u64, current: Option<(&DescriptorBuckets, LeaseConfig, u64)>) {
        if let Some((buckets, config, generation)) = current {
            if generation > self.generation {
                self.release();
                self.buckets = buckets.clone();
                self.config = config;
                self.generation = generation;
                self.newest = self.newest.max(generation);
                self.refused = None;
                self.shared = vec![(0, 0); buckets.buckets.len()];
            }
        }
        if self.newest > self.generation || now >= self.expires_micros {
            self.release();
        }
    }

    /// The worker's next job, taken out of the state; None: nothing to do.
    fn next_job(&mut self) -> Option<Job> {
        if self.retired {
            // shutdown: return_all gives back what is left
            self.wanted = None;
            return None;
        }
        if self.to_return > 0 {
            return Some(Job::Return {
                buckets: self.buckets.clone(),
                tokens: std::mem::take(&mut self.to_return),
            });
        }
        if self.newest > self.generation {
            self.wanted = None;
            return None;
        }
        let wanted = self.wanted.take()?;
        let size = self.config.size;
        let up_to = size.max(wanted).saturating_sub(self.tokens);
        if up_to == 0 {
            return None; // the lease is full already
        }
        Some(Job::Refill {
            buckets: self.buckets.clone(),
            generation: self.generation,
            ttl: self.config.ttl,
            needed: wanted.saturating_sub(self.tokens).max(1),
            up_to,
        })
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

/// Clears `working` and wakes the waiters however the worker ends, a panic
/// in the store included: a lease must never stay marked as being worked on.
struct WorkerGuard<'a>(&'a Lease);

impl Drop for WorkerGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.0.state.lock();
        if st.working {
            st.working = false;
        }
        drop(st);
        self.0.landed.notify_waiters();
    }
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
            state: Mutex::new(LeaseState::new(buckets, config, generation, now)),
            landed: Notify::new(),
        });
        shard.insert(key, lease.clone());
        lease
    }

    /// Spends `cost` tokens under `config` for a request seen with rules of
    /// `generation`: from the lease when it holds enough, else after the
    /// worker's refill. The outcomes read like a store's. None: the lease
    /// has seen newer rules than the caller's; decide it at the store.
    pub async fn spend(
        self: &Arc<Self>,
        buckets: &DescriptorBuckets,
        config: LeaseConfig,
        generation: u64,
        cost: u64,
    ) -> Option<Result<Vec<BucketOutcome>, StoreError>> {
        let mut lease = self.lease(buckets, config, generation);
        let mut waited: Option<u64> = None;
        loop {
            // Registered before the state is read: an answer that lands
            // after the read wakes it (notify_waiters), one before is seen.
            let current = lease.clone();
            let landed = current.landed.notified();
            let (step, start_worker) = {
                let mut st = current.state.lock();
                if st.retired {
                    drop(st);
                    lease = self.lease(buckets, config, generation);
                    continue;
                }
                if generation < st.newest {
                    return None; // Step::Bypass: older rules than the lease's
                }
                let now = self.clock.now_micros();
                st.renew(now, Some((buckets, config, generation)));
                st.last_used_micros = now;
                let step = if st.tokens >= cost {
                    st.tokens -= cost;
                    let outcomes = st.local_outcomes(cost);
                    if st.tokens <= st.config.size / 2 && st.wanted.is_none() && !st.working {
                        st.wanted = Some(0); // prefetch
                    }
                    Step::Admitted(outcomes)
                } else if let Some(refusal) = waited
                    .and_then(|w| st.refused.as_ref().filter(|r| r.round > w))
                    .filter(|r| r.answer.is_err() || r.needed == cost - st.tokens)
                {
                    Step::Answer(refusal.answer.clone())
                } else {
                    waited = Some(st.round);
                    st.wanted = Some(st.wanted.unwrap_or(0).max(cost));
                    Step::Wait
                };
                let start = (st.to_return > 0 || st.wanted.is_some()) && !st.working;
                if start {
                    st.working = true;
                }
                (step, start)
            };
            if start_worker {
                self.start_worker(lease.clone());
            }
            match step {
                Step::Admitted(outcomes) => {
                    self.metrics.lease_local_hit(cost);
                    return Some(Ok(outcomes));
                }
                Step::Answer(answer) => return Some(answer),
                Step::Wait => landed.await,
            }
        }
    }

    /// A check (`hits_addend: 0`) answered from the lease, if it holds a
    /// token granted under rules no older than the caller's.
    pub fn peek(&self, buckets: &DescriptorBuckets, generation: u64) -> Option<Vec<BucketOutcome>> {
        let key = lease_key(buckets);
        let lease = self.shard(&key).lock().get(&key).cloned()?;
        let st = lease.state.lock();
        let current = st.generation >= generation && st.newest == st.generation;
        (current && st.tokens >= 1 && self.clock.now_micros() < st.expires_micros)
            .then(|| st.local_outcomes(0))
    }

    /// Spawns the worker of a lease whose `working` the caller just set.
    fn start_worker(self: &Arc<Self>, lease: Arc<Lease>) {
        let leases = self.clone();
        crate::background::spawn(async move { leases.work(&lease).await });
    }

    /// The worker: store calls one after another until nothing is asked.
    async fn work(&self, lease: &Lease) {
        let _guard = WorkerGuard(lease);
        loop {
            let job = {
                let mut st = lease.state.lock();
                match st.next_job() {
                    Some(job) => job,
                    None => {
                        st.working = false;
                        return; // the guard wakes the waiters
                    }
                }
            };
            match job {
                Job::Return { buckets, tokens } => {
                    self.give_back(&buckets, tokens).await;
                }
                Job::Refill {
                    buckets,
                    generation,
                    ttl,
                    needed,
                    up_to,
                } => {
                    self.refill(lease, &buckets, generation, ttl, needed, up_to)
                        .await;
                }
            }
            lease.landed.notify_waiters();
        }
    }

    /// One store call for up to `up_to` tokens (at least `needed`), landed
    /// in the lease.
    async fn refill(
        &self,
        lease: &Lease,
        buckets: &DescriptorBuckets,
        generation: u64,
        ttl: Duration,
        needed: u64,
        up_to: u64,
    ) {
        let sent = self.clock.now_micros();
        let started = Instant::now();
        let result = self
            .store
            .decide(buckets, Cost::Lease { needed, up_to })
            .instrument(
                tracing::info_span!(target: SPAN_TARGET, "store.lease", store = self.store.name()),
            )
            .await;
        self.metrics
            .observe_store_call(self.store.name(), started.elapsed().as_secs_f64());
        let mut st = lease.state.lock();
        st.round += 1;
        let round = st.round;
        match result {
            Ok(outcomes) => {
                let granted = outcomes.first().filter(|o| o.admitted).map(|o| o.taken);
                let current = st.generation == generation && st.newest == generation;
                if current {
                    st.shared = outcomes
                        .iter()
                        .map(|o| (o.remaining, o.full_in_secs))
                        .collect();
                }
                match granted {
                    Some(granted) => {
                        self.metrics.lease_granted(granted);
                        if current && !st.retired {
                            st.tokens += granted;
                            st.expires_micros = sent.saturating_add(micros(ttl));
                            st.refused = None;
                        } else {
                            // the rules changed, or shutdown, meanwhile
                            st.to_return = st.to_return.saturating_add(granted);
                        }
                    }
                    None => {
                        st.refused = Some(Refusal {
                            round,
                            needed,
                            answer: Ok(outcomes),
                        });
                    }
                }
            }
            Err(e) => {
                self.metrics.store_error(e.kind());
                if matches!(e, StoreError::Timeout | StoreError::Connection(_)) {
                    // it may have run and deducted: those tokens are gone
                    self.metrics.lease_lost(up_to);
                }
                st.refused = Some(Refusal {
                    round,
                    needed,
                    answer: Err(e),
                });
            }
        }
    }

    /// Puts back `tokens` a decision spent from the lease of `buckets`
    /// under `generation`'s rules (another descriptor refused its request):
    /// held again by the lease, or, when the lease has moved on to other
    /// rules or is gone, returned to the shared bucket.
    pub async fn put_back(
        self: &Arc<Self>,
        buckets: &DescriptorBuckets,
        generation: u64,
        tokens: u64,
    ) {
        let key = lease_key(buckets);
        let lease = self.shard(&key).lock().get(&key).cloned();
        // held again until spent or returned
        self.metrics.lease_put_back(tokens);
        if let Some(lease) = lease {
            let start = {
                let mut st = lease.state.lock();
                if !st.retired {
                    if st.generation == generation && st.newest == generation {
                        st.tokens = st.tokens.saturating_add(tokens);
                    } else {
                        st.to_return = st.to_return.saturating_add(tokens);
                    }
                    let start = st.to_return > 0 && !st.working;
                    if start {
                        st.working = true;
                    }
                    Some(start)
                } else {
                    None
                }
            };
            match start {
                Some(true) => return self.start_worker(lease),
                Some(false) => return,
                None => {}
            }
        }
        self.give_back(buckets, tokens).await;
    }

    /// Returns `tokens` to the shared bucket; counted returned or lost.
    async fn give_back(&self, buckets: &DescriptorBuckets, tokens: u64) -> bool {
        let started = Instant::now();
        let result = self.store.decide(buckets, Cost::Refund(tokens)).await;
        self.metrics
            .observe_store_call(self.store.name(), started.elapsed().as_secs_f64());
        self.metrics.lease_released(tokens);
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

    /// Gives back expired tokens and tokens of rules older than
    /// `generation`, and forgets leases idle for longer than their ttl (and
    /// at least a second). Returns the leases kept.
    pub fn sweep(self: &Arc<Self>, generation: u64) -> usize {
        let now = self.clock.now_micros();
        let mut kept = 0;
        let mut start = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            shard.retain(|_, lease| {
                let mut st = lease.state.lock();
                st.newest = st.newest.max(generation);
                st.renew(now, None);
                if st.to_return > 0 && !st.working {
                    st.working = true;
                    start.push(lease.clone());
                }
                let idle_for = micros(st.config.ttl.max(Duration::from_secs(1)));
                let idle = st.tokens == 0
                    && st.to_return == 0
                    && !st.working
                    && now.saturating_sub(st.last_used_micros) >= idle_for;
                if idle {
                    st.retired = true;
                }
                !idle
            });
            kept += shard.len();
        }
        for lease in start {
            self.start_worker(lease);
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

    /// Retires every lease, waits for the workers in flight (their grants
    /// land as tokens to return), then gives every unspent token back.
    /// Returns the tokens given back.
    pub async fn return_all(&self) -> u64 {
        let leases: Vec<Arc<Lease>> = self
            .shards
            .iter()
            .flat_map(|s| s.lock().drain().map(|(_, l)| l).collect::<Vec<_>>())
            .collect();
        for lease in &leases {
            lease.state.lock().retired = true;
        }
        let mut returns = Vec::new();
        for lease in &leases {
            loop {
                let landed = lease.landed.notified();
                let left = {
                    let mut st = lease.state.lock();
                    (!st.working).then(|| {
                        st.release();
                        (st.buckets.clone(), std::mem::take(&mut st.to_return))
                    })
                };
                match left {
                    Some((buckets, tokens)) => {
                        if tokens > 0 {
                            returns.push((buckets, tokens));
                        }
                        break;
                    }
                    None => landed.await,
                }
            }
        }
        let results =
            futures::future::join_all(returns.iter().map(|(b, tokens)| self.give_back(b, *tokens)))
                .await;
        returns
            .iter()
            .zip(results)
            .filter(|(_, ok)| *ok)
            .map(|((_, tokens), _)| tokens)
            .sum()
    }

    /// Unspent tokens held by this instance now (in leases and waiting to
    /// be returned).
    pub fn held(&self) -> u64 {
        self.shards
            .iter()
            .flat_map(|s| s.lock().values().cloned().collect::<Vec<_>>())
            .map(|l| {
                let st = l.state.lock();
                st.tokens + st.to_return
            })
            .sum()
    }

    /// Leases whose worker is running now (tests: none may stay so).
    pub fn working(&self) -> usize {
        self.shards
            .iter()
            .flat_map(|s| s.lock().values().cloned().collect::<Vec<_>>())
            .filter(|l| l.state.lock().working)
            .count()
    }
}

#[cfg(test)]
mod tests;
