//! Decisions: from matched rules to one verdict per descriptor.
//!
//! For each request descriptor the limiter finds its rule (or the request's
//! own limit override), drops limits that another matched limit `replaces`,
//! asks the store to decide that descriptor's buckets, and turns the bucket
//! outcomes into a [`Decision`]. When the store fails, the rule's
//! [`FailureMode`] answers instead.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `service`; uses `quota` (a region's shares), `store`, `telemetry`,
//! `decision`, `rules` and leaves.

mod give_back;
mod in_turn;
mod inspect;
pub use self::inspect::parse_descriptor;
pub mod key;
pub mod lease;
mod plan;
mod request;
mod store_call;
pub mod values;
mod window_peek;

use std::collections::HashMap;
use std::sync::Arc;

use std::time::Instant;

use crate::attempt::{AttemptCall, AttemptResult, Phase};
use crate::bucket::{Algorithm, BucketOutcome, BucketParams, Cost};
use crate::clock::{Clock, MonotonicClock};
pub use crate::decision::{Decision, ShownLimit, Verdict};
use crate::instances::Instances;
use crate::labels::RuleId;
use crate::quota::region::{RegionLimit, RegionShares};
use crate::rules::{BucketValue, FailureMode, Rule, Unit};
use crate::store::memory::MemoryStore;
use crate::store::{AttemptOutcome, BucketRef, DescriptorBuckets, Store, StoreError};
use crate::telemetry::Metrics;
use give_back::{Places, Source, Spent, SpentKind};
use key::KeyOrigin;
use lease::Leases;
use plan::{CalendarNow, LimitRef, Plan};
use values::RuleValues;

/// One descriptor of a request, as the limiter needs it.
#[derive(Debug)]
pub struct DescriptorInput<'a, E> {
    pub entries: &'a [E],
    pub cost: Cost,
    /// `RateLimitDescriptor.limit`: requests per unit, sent by Envoy.
    pub limit_override: Option<(u32, Unit)>,
    /// The descriptor brought its own `hits_addend` (Envoy's
    /// `RateLimit.hits_addend`: a cost), rather than the request's.
    pub own_hits_addend: bool,
}

/// A store failure that the rule's failure mode turns into a failed call.
#[derive(Debug, thiserror::Error)]
#[error("rate limit store unavailable for a fail-closed rule: {0}")]
pub struct Unavailable(pub StoreError);

/// One descriptor decided, and what it took (to give back if the request
/// is refused).
struct Decided {
    decision: Decision,
    spent: Option<Spent>,
}

impl Decided {
    fn kept(decision: Decision) -> Self {
        Self {
            decision,
            spent: None,
        }
    }
}

/// How one request's store calls are made.
#[derive(Debug, Clone, Copy)]
struct Turn {
    /// The generation of the rules the request was planned by (a lease's).
    generation: u64,
    /// The part of the caller's deadline left to the store.
    budget: Option<std::time::Duration>,
    /// A detached decision's ([`request`]): a store call cut off at
    /// `budget` runs on, and what it took is given back when its answer
    /// arrives.
    lingering: bool,
}

impl Turn {
    fn new(generation: u64, budget: Option<std::time::Duration>) -> Self {
        Self {
            generation,
            budget,
            lingering: false,
        }
    }
}

/// Default bound on decisions that run on their own at once
/// ([`request`]); past it, a decision is made in its caller's call.
pub const MAX_DETACHED: usize = 10_000;

/// Default bound on follow-ups at once: store calls that linger past
/// their budget, and give-backs nobody waits for (apart from the
/// decisions, which cannot starve them). Past it, one is counted
/// `overloaded`, not run.
pub const MAX_FOLLOW_UPS: usize = 10_000;

/// Default bound on store calls in flight at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;

/// Turns requests into decisions against a store.
pub struct Limiter {
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    /// Bounds store calls in flight: past it, calls fail at once (`overloaded`)
    /// and the failure mode answers, instead of memory growing without limit.
    in_flight: tokio::sync::Semaphore,
    default_failure_mode: FailureMode,
    /// Decides for `local` rules while the store is failing: B/N and r/N.
    local: Arc<MemoryStore<MonotonicClock>>,
    /// The instances sharing the store: given, or counted in it.
    instances: Instances,
    /// Local batches of tokens for rules with `lease:`.
    leases: Arc<Leases<MonotonicClock>>,
    /// The descriptors of each `max_values` rule that have buckets of their own.
    values: parking_lot::Mutex<HashMap<RuleId, RuleValues>>,
    clock: MonotonicClock,
    /// On a region (`--quota-upstream`): its shares of the global rules'
    /// budgets. `None`: global rules are ordinary rules here.
    regions: Option<Arc<RegionShares>>,
    /// How far ahead of `clock` calendar periods are found
    /// (`--calendar-clock-offset`; 0 but to rehearse a period's end).
    calendar_offset_secs: i64,
    /// A request answered OVER_LIMIT gives back what its other
    /// descriptors took ([`give_back`]); false: each descriptor spends on
    /// its own (`--per-descriptor-spending`).
    give_back: bool,
    /// `--quota-mode`: every descriptor in quota mode
    /// ([`crate::decision::settle_quotas`]).
    all_quota: bool,
    /// The rules whose reused attempt ids were logged (once each).
    reused_said: parking_lot::Mutex<std::collections::HashSet<RuleId>>,
    /// Detached decisions running now, at most [`MAX_DETACHED`].
    detached: Arc<tokio::sync::Semaphore>,
    /// Follow-ups running now, at most [`MAX_FOLLOW_UPS`].
    follow_ups: Arc<tokio::sync::Semaphore>,
    /// When a give-back that failed was last logged.
    give_back_said: Arc<give_back::OnceASecond>,
}

impl Limiter {
    pub fn new(
        store: Arc<dyn Store>,
        default_failure_mode: FailureMode,
        instances: impl Into<Instances>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self::with_max_in_flight(
            store,
            default_failure_mode,
            instances,
            metrics,
            DEFAULT_MAX_IN_FLIGHT,
        )
    }

    pub fn with_max_in_flight(
        store: Arc<dyn Store>,
        default_failure_mode: FailureMode,
        instances: impl Into<Instances>,
        metrics: Arc<Metrics>,
        max_in_flight: usize,
    ) -> Self {
        // Bounded too, in buckets and bytes: a flood of new values while
        // the store fails would otherwise grow it faster than the sweeper
        // (`spawn_local_sweeper`) drops the full ones.
        let local = Arc::new(
            MemoryStore::with_cap(
                MonotonicClock::new(),
                crate::store::memory::DEFAULT_MAX_BUCKETS,
                Some(metrics.eviction_sink()),
            )
            .with_attempts(
                crate::store::memory::DEFAULT_MAX_ATTEMPTS,
                Some(metrics.expiry_sink()),
            ),
        );
        Self {
            leases: Arc::new(Leases::new(
                store.clone(),
                metrics.clone(),
                MonotonicClock::new(),
            )),
            store,
            metrics,
            in_flight: tokio::sync::Semaphore::new(max_in_flight.max(1)),
            default_failure_mode,
            local,
            instances: instances.into(),
            values: parking_lot::Mutex::default(),
            clock: MonotonicClock::new(),
            regions: None,
            calendar_offset_secs: 0,
            give_back: true,
            all_quota: false,
            reused_said: parking_lot::Mutex::default(),
            detached: Arc::new(tokio::sync::Semaphore::new(MAX_DETACHED)),
            follow_ups: Arc::new(tokio::sync::Semaphore::new(MAX_FOLLOW_UPS)),
            give_back_said: Arc::default(),
        }
    }

    /// Each descriptor spends on its own: a refused request keeps what
    /// its other descriptors took (`--per-descriptor-spending`, and what
    /// `--shadow-mode` and `--quota-mode` need: nothing is refused there).
    pub fn with_per_descriptor_spending(mut self, on: bool) -> Self {
        self.give_back = !on;
        self
    }

    /// Every descriptor in quota mode (`--quota-mode`, envoyproxy/ratelimit's
    /// `QUOTA_MODE`): a request is refused once all of them are over.
    pub fn with_quota_mode(mut self, on: bool) -> Self {
        self.all_quota = on;
        self
    }

    /// Calendar periods end as if the clock read `secs` later
    /// (`--calendar-clock-offset`).
    pub fn with_calendar_offset(mut self, secs: i64) -> Self {
        self.calendar_offset_secs = secs;
        self
    }

    /// Now by the calendar's clock (Unix seconds), and its offset.
    fn calendar_now(&self) -> CalendarNow {
        let secs = i64::try_from(self.clock.now_micros() / 1_000_000).unwrap_or(i64::MAX);
        CalendarNow {
            unix_secs: secs.saturating_add(self.calendar_offset_secs),
            offset_secs: self.calendar_offset_secs,
        }
    }

    /// On a region: `scope: global` rules spend this region's shares.
    pub fn with_regions(mut self, shares: Arc<RegionShares>) -> Self {
        self.regions = Some(shares);
        self
    }

    pub fn store_name(&self) -> &'static str {
        self.store.name()
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// On a region (`--quota-upstream`): its shares of the global rules.
    pub fn region_shares(&self) -> Option<&Arc<RegionShares>> {
        self.regions.as_ref()
    }

    pub fn default_failure_mode(&self) -> FailureMode {
        self.default_failure_mode
    }

    pub fn leases(&self) -> &Arc<Leases<MonotonicClock>> {
        &self.leases
    }

    /// Drops the `local` failure mode's buckets that are full again, every
    /// `every`, as the memory store's sweeper does for its own: what a
    /// store outage left there does not wait for eviction to go.
    pub fn spawn_local_sweeper(self: &Arc<Self>, every: std::time::Duration) {
        crate::periodic::spawn_every(self, every, |limiter| {
            limiter.local.evict_full();
        });
    }

    /// Buckets the `local` failure mode holds now.
    pub fn local_buckets(&self) -> usize {
        self.local.len()
    }

    fn places(&self) -> Places {
        Places {
            store: self.store.clone(),
            local: self.local.clone(),
            leases: self.leases.clone(),
            metrics: self.metrics.clone(),
            instances: self.instances.get(),
            said: self.give_back_said.clone(),
        }
    }

    /// Sends each descriptor of a `max_values` rule that has no buckets of
    /// its own, while the rule holds its maximum, to the rule's overflow
    /// bucket. Each of `--instances` instances holds its share of the
    /// maximum (see `values`).
    fn bound_values(&self, domain: &str, plans: &mut [Plan<'_>]) {
        for p in plans.iter_mut() {
            let Plan::Buckets {
                rule: Some(rule),
                limits,
                buckets,
                ..
            } = p
            else {
                continue;
            };
            let Some(max) = rule.max_values else {
                continue;
            };
            let share = usize::try_from(max.div_ceil(u64::from(self.instances.get())))
                .unwrap_or(usize::MAX);
            let idle_micros = buckets
                .buckets
                .iter()
                .map(|b| b.params.micros_from_empty_to_full())
                .max()
                .unwrap_or(0);
            let now = self.clock.now_micros();
            let own = self.values.lock().entry(rule.id).or_default().admit(
                &buckets.tag,
                share,
                idle_micros,
                now,
            );
            if own {
                continue;
            }
            self.metrics.value_overflowed(rule.id);
            let tag = key::descriptor_tag(
                KeyOrigin::Overflow,
                domain,
                [(rule.path.as_str(), BucketValue::Shared(""))].into_iter(),
            );
            for (b, l) in buckets.buckets.iter_mut().zip(limits.iter()) {
                if let LimitRef::Rule(l) = l {
                    b.key = key::bucket_key(&tag, &l.bucket_id);
                }
            }
            buckets.tag = tag;
        }
    }

    async fn decide_plan(&self, plan: &Plan<'_>, turn: Turn) -> Result<Decided, Unavailable> {
        match plan {
            Plan::Done(decision) => Ok(Decided::kept(decision.clone())),
            Plan::Slots {
                rule,
                slots,
                max,
                attempt,
            } => {
                self.decide_slot(rule, slots, *max, attempt.as_ref(), turn)
                    .await
            }
            Plan::Buckets {
                rule: Some(rule),
                limits,
                buckets,
                cost,
                global: Some(id),
                ..
            } if self.regions.is_some() => {
                self.decide_global(rule, limits, buckets, *cost, id, turn)
                    .await
            }
            Plan::Buckets {
                rule,
                limits,
                buckets,
                cost,
                attempt,
                no_id,
                ..
            } => {
                if let (true, Some(rule)) = (*no_id, rule) {
                    self.metrics
                        .attempts(rule.id, AttemptResult::NoId.label(), 1);
                }
                self.decide_buckets(*rule, limits, buckets, *cost, attempt.as_ref(), turn)
                    .await
            }
        }
    }

    /// A `scope: global` rule on a region: its bucket holds this region's
    /// share of the global budget (or what stands in for it, see
    /// [`crate::quota::region`]), and the outcome is counted as demand.
    #[allow(clippy::too_many_arguments)]
    async fn decide_global(
        &self,
        rule: &Arc<Rule>,
        limits: &[LimitRef<'_>],
        buckets: &DescriptorBuckets,
        cost: Cost,
        id: &[(&str, std::borrow::Cow<'_, str>)],
        turn: Turn,
    ) -> Result<Decided, Unavailable> {
        let Some(shares) = &self.regions else {
            return self
                .decide_buckets(Some(rule), limits, buckets, cost, None, turn)
                .await;
        };
        let Some(own) = buckets.buckets.first() else {
            return Ok(Decided::kept(Decision::without_limit(
                Verdict::NoRule,
                Some(rule.clone()),
            )));
        };
        let mode = rule.failure_mode.unwrap_or(self.default_failure_mode);
        let limit = shares.limit(
            &rule.domain,
            &buckets.tag,
            id.iter().map(|(k, v)| (*k, v.as_ref())),
            own.params,
            mode,
            shares.now_micros(),
        );
        let params = match limit {
            RegionLimit::Share(p) => p,
            RegionLimit::Floor(p) => {
                self.metrics.region_fallback("floor", 1);
                p
            }
            RegionLimit::Closed => {
                self.metrics.region_fallback("closed", 1);
                return Err(Unavailable(StoreError::Upstream));
            }
            RegionLimit::Open => {
                self.metrics.region_fallback("open", 1);
                return Ok(Decided::kept(Decision::without_limit(
                    Verdict::FailedOpen,
                    Some(rule.clone()),
                )));
            }
        };
        let share = DescriptorBuckets {
            tag: buckets.tag.clone(),
            buckets: vec![BucketRef {
                key: own.key.clone(),
                params,
                rule: own.rule,
            }],
            replication: None,
            ratelimit_key: None,
        };
        let mut decided = self
            .decide_buckets(Some(rule), limits, &share, cost, None, turn)
            .await?;
        let admitted = matches!(decided.decision.verdict, Verdict::Ok | Verdict::FailedOpen);
        shares.record(&buckets.tag, admitted);
        if let Some(spent) = decided.spent.as_mut().filter(|s| s.buckets.is_none()) {
            // given back to the share it was taken from
            spent.buckets = Some(share);
        }
        Ok(decided)
    }

    async fn decide_buckets(
        &self,
        rule: Option<&Arc<Rule>>,
        limits: &[LimitRef<'_>],
        buckets: &DescriptorBuckets,
        cost: Cost,
        attempt: Option<&AttemptCall>,
        turn: Turn,
    ) -> Result<Decided, Unavailable> {
        if let Some(leased) = self.decide_leased(rule, limits, buckets, cost, turn).await {
            return leased;
        }
        let started = Instant::now();
        let Ok(_permit) = self.in_flight.try_acquire() else {
            self.metrics.store_error(StoreError::Overloaded.kind());
            return self.on_store_error(
                rule,
                limits,
                buckets,
                cost,
                attempt,
                StoreError::Overloaded,
            );
        };
        if let Some(call) = attempt {
            return self
                .decide_attempt(rule, limits, buckets, cost, call, turn, started)
                .await;
        }
        let rule_id = rule.map(|r| r.id).unwrap_or_default();
        match self
            .spend_in_store(rule_id, buckets, cost, turn, started)
            .await
        {
            Ok(outcomes) => {
                self.count_forgiven(rule, &outcomes);
                Ok(Decided {
                    decision: decision_from(rule, limits, &outcomes),
                    spent: spent(
                        Source::Store,
                        give_back::tokens_taken(cost, buckets, &outcomes),
                    ),
                })
            }
            Err(e) => {
                self.metrics.store_error(e.kind());
                let taking = store_call::Taking::Tokens(cost);
                self.follow_failed_call(rule_id, buckets, taking, &e, turn);
                self.on_store_error(rule, limits, buckets, cost, None, e)
            }
        }
    }

    /// A rule with `lease:` spends from this instance's lease (`None`:
    /// not leased, or a cost over the lease's size: the store decides).
    async fn decide_leased(
        &self,
        rule: Option<&Arc<Rule>>,
        limits: &[LimitRef<'_>],
        buckets: &DescriptorBuckets,
        cost: Cost,
        turn: Turn,
    ) -> Option<Result<Decided, Unavailable>> {
        let generation = turn.generation;
        let leased = match (rule.and_then(|r| r.lease), cost) {
            (Some(lease), Cost::Spend(n)) if n <= lease.size => {
                self.leases.spend(buckets, lease, generation, n).await
            }
            (Some(_), Cost::Check) => self.leases.peek(buckets, generation).map(Ok),
            _ => None,
        }?;
        Some(match leased {
            Ok(outcomes) => Ok(Decided {
                decision: decision_from(rule, limits, &outcomes),
                spent: spent(
                    Source::Lease { generation },
                    give_back::tokens_taken(cost, buckets, &outcomes),
                ),
            }),
            Err(e) => self.on_store_error(rule, limits, buckets, cost, None, e),
        })
    }

    /// One call of an attempt, through the store's attempt records (see
    /// [`crate::attempt`]); counted by what it was.
    #[allow(clippy::too_many_arguments)]
    async fn decide_attempt(
        &self,
        rule: Option<&Arc<Rule>>,
        limits: &[LimitRef<'_>],
        buckets: &DescriptorBuckets,
        cost: Cost,
        call: &AttemptCall,
        turn: Turn,
        started: Instant,
    ) -> Result<Decided, Unavailable> {
        let rule_id = rule.map(|r| r.id).unwrap_or_default();
        let result = self
            .attempt_in_store(rule_id, buckets, cost, call, turn, started)
            .await;
        match result {
            Ok(outcome) => {
                if let Some(rule) = rule {
                    self.count_attempt(rule, outcome.result, outcome.expired);
                }
                self.count_forgiven(rule, &outcome.outcomes);
                let mut decision = decision_from(rule, limits, &outcome.outcomes);
                if outcome.result == AttemptResult::Reused {
                    self.refuse_reused(rule, &mut decision);
                }
                Ok(Decided {
                    decision,
                    spent: spent(Source::Store, start_taken(call, &outcome)),
                })
            }
            Err(e) => {
                self.metrics.store_error(e.kind());
                let taking = store_call::Taking::Start(call);
                self.follow_failed_call(rule_id, buckets, taking, &e, turn);
                self.on_store_error(rule, limits, buckets, cost, Some(call), e)
            }
        }
    }

    /// A `concurrency` rule's call: a start takes a slot (refused while all
    /// are held), a done call releases it. A call that names no attempt
    /// can hold no slot: refused, counted `no_id`.
    async fn decide_slot(
        &self,
        rule: &Arc<Rule>,
        slots: &DescriptorBuckets,
        max: u64,
        attempt: Option<&AttemptCall>,
        turn: Turn,
    ) -> Result<Decided, Unavailable> {
        let Some(call) = attempt else {
            self.metrics
                .attempts(rule.id, AttemptResult::NoId.label(), 1);
            return Ok(Decided::kept(slot_decision(rule, false, max, max)));
        };
        let started = Instant::now();
        let result = match self.in_flight.try_acquire() {
            Ok(_permit) => {
                self.slot_in_store(rule.id, slots, max, call, turn, started)
                    .await
            }
            Err(_) => Err(StoreError::Overloaded),
        };
        let (outcome, source) = match result {
            Ok(outcome) => (outcome, Source::Store),
            Err(e) => {
                self.metrics.store_error(e.kind());
                let taking = store_call::Taking::Slot(call, max);
                self.follow_failed_call(rule.id, slots, taking, &e, turn);
                let mode = rule.failure_mode.unwrap_or(self.default_failure_mode);
                self.metrics.failure_policy(mode);
                match mode {
                    FailureMode::Open => {
                        return Ok(Decided::kept(Decision::without_limit(
                            Verdict::FailedOpen,
                            Some(rule.clone()),
                        )))
                    }
                    FailureMode::Closed => return Err(Unavailable(e)),
                    // this instance's share of the slots, at least one
                    FailureMode::Local => (
                        self.local.decide_slot_now(
                            slots,
                            (max / u64::from(self.instances.get())).max(1),
                            call,
                            rule.id,
                        ),
                        Source::Local,
                    ),
                }
            }
        };
        self.count_attempt(rule, outcome.result, outcome.expired);
        let took = call.phase == Phase::Start
            && outcome.admitted
            && outcome.result == AttemptResult::First;
        let mut decision = slot_decision(rule, outcome.admitted, outcome.in_flight, max);
        if outcome.result == AttemptResult::Reused {
            self.refuse_reused(Some(rule), &mut decision);
        }
        Ok(Decided {
            decision,
            spent: spent(source, took.then_some(SpentKind::Slot)),
        })
    }

    /// Counts one call of `rule`'s attempts as `result`, and the attempts
    /// the store found expired on the way.
    fn count_attempt(&self, rule: &Rule, result: AttemptResult, expired: u64) {
        self.metrics.attempts(rule.id, result.label(), 1);
        if expired > 0 {
            self.metrics
                .attempts(rule.id, AttemptResult::Expired.label(), expired);
        }
    }

    /// A start of a live attempt repeated past the rule's `max_repeats`:
    /// refused, with no time to retry (the same id never passes again
    /// while its attempt lives), and said once per rule in the log.
    fn refuse_reused(&self, rule: Option<&Arc<Rule>>, decision: &mut Decision) {
        decision.verdict = match rule {
            Some(r) if r.shadow_mode => Verdict::Shadow,
            Some(r) if r.quota_mode => Verdict::QuotaExceeded,
            _ => Verdict::OverLimit,
        };
        decision.remaining = 0;
        decision.reset_secs = None;
        if let Some(rule) = rule {
            if self.reused_said.lock().insert(rule.id) {
                tracing::warn!(
                    domain = %rule.domain,
                    rule = %rule.path,
                    max_repeats = rule.attempts.as_ref().map_or(0, |a| a.max_repeats),
                    "an attempt id is reused: a start of a live attempt came more often than a retry policy sends it, and is refused (counted in rls_attempts_total{{result=\"reused\"}}; said once per rule). Take the attempt id from something a client cannot set (docs/usage.md, Attempts)"
                );
            }
        }
    }

    /// Counts what the debt bound cut off a charge (summed over the rule's
    /// limits): nothing is forgiven silently.
    fn count_forgiven(&self, rule: Option<&Arc<Rule>>, outcomes: &[BucketOutcome]) {
        let forgiven: u64 = outcomes.iter().map(|o| o.forgiven).sum();
        if let (true, Some(rule)) = (forgiven > 0, rule) {
            self.metrics.debt_forgiven(rule.id, forgiven);
        }
    }

    fn on_store_error(
        &self,
        rule: Option<&Arc<Rule>>,
        limits: &[LimitRef<'_>],
        buckets: &DescriptorBuckets,
        cost: Cost,
        attempt: Option<&AttemptCall>,
        error: StoreError,
    ) -> Result<Decided, Unavailable> {
        let mode = rule
            .and_then(|r| r.failure_mode)
            .unwrap_or(self.default_failure_mode);
        self.metrics.failure_policy(mode);
        match mode {
            FailureMode::Open => Ok(Decided::kept(Decision::without_limit(
                Verdict::FailedOpen,
                rule.cloned(),
            ))),
            FailureMode::Closed => Err(Unavailable(error)),
            FailureMode::Local => {
                let n = u64::from(self.instances.get());
                let share = DescriptorBuckets {
                    tag: buckets.tag.clone(),
                    buckets: buckets
                        .buckets
                        .iter()
                        .map(|b| BucketRef {
                            key: b.key.clone(),
                            // At least one token each, so that a burst
                            // below N does not block everything: the fleet's
                            // local burst is then at most max(B, N).
                            rule: b.rule,
                            params: BucketParams {
                                capacity: (b.params.capacity / n).max(1),
                                tokens_per_unit: b.params.tokens_per_unit,
                                unit_secs: b.params.unit_secs * n,
                                max_debt: b.params.max_debt.map(|d| d / n),
                                // a fixed window's share too: B/N refilling
                                // at r/N, continuously
                                algorithm: Algorithm::TokenBucket,
                                period: None,
                            },
                        })
                        .collect(),
                    replication: None,
                    ratelimit_key: None,
                };
                // an attempt is remembered here while the store fails
                let (outcomes, took, reused) = match attempt {
                    Some(call) => {
                        let outcome = self.local.decide_attempt_now(&share, cost, call);
                        if let Some(rule) = rule {
                            self.count_attempt(rule, outcome.result, outcome.expired);
                        }
                        let took = start_taken(call, &outcome);
                        let reused = outcome.result == AttemptResult::Reused;
                        (outcome.outcomes, took, reused)
                    }
                    None => {
                        let outcomes = self.local.decide_now(&share, cost);
                        let took = give_back::tokens_taken(cost, &share, &outcomes);
                        (outcomes, took, false)
                    }
                };
                self.count_forgiven(rule, &outcomes);
                let mut decision = decision_from(rule, limits, &outcomes);
                if reused {
                    self.refuse_reused(rule, &mut decision);
                }
                Ok(Decided {
                    decision,
                    spent: took.map(|kind| Spent {
                        source: Source::Local,
                        kind,
                        buckets: Some(share),
                    }),
                })
            }
        }
    }
}

/// What a decision took, at `source`, from the plan's own buckets.
fn spent(source: Source, kind: Option<SpentKind>) -> Option<Spent> {
    kind.map(|kind| Spent {
        source,
        kind,
        buckets: None,
    })
}

/// Whether an attempt's call took something a refusal must give back: an
/// admitted first start that took tokens.
fn start_taken(call: &AttemptCall, outcome: &AttemptOutcome) -> Option<SpentKind> {
    let admitted = !outcome.outcomes.is_empty() && outcome.outcomes.iter().all(|o| o.admitted);
    let taken = outcome.outcomes.iter().map(|o| o.taken).max().unwrap_or(0);
    (call.phase == Phase::Start && outcome.result == AttemptResult::First && admitted && taken > 0)
        .then_some(SpentKind::Start(taken))
}

/// `call`, cut off after `budget` (a timeout) when there is one.
async fn within<T>(
    budget: Option<std::time::Duration>,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match budget {
        Some(budget) => tokio::time::timeout(budget, call)
            .await
            .unwrap_or(Err(StoreError::Timeout)),
        None => call.await,
    }
}

/// A slot call's answer: OK while it holds (or released) a slot, else over
/// the limit with a retry in a second (a slot frees when a request in
/// flight finishes, which nobody can foresee); the slots left free as
/// `limit_remaining`, none when refused (a start the memory store had no
/// room to remember was refused with three of three "left").
fn slot_decision(rule: &Arc<Rule>, admitted: bool, in_flight: u64, max: u64) -> Decision {
    let verdict = match admitted {
        true => Verdict::Ok,
        false if rule.shadow_mode => Verdict::Shadow,
        false if rule.quota_mode => Verdict::QuotaExceeded,
        false => Verdict::OverLimit,
    };
    Decision {
        verdict,
        limit: None,
        remaining: if admitted {
            max.saturating_sub(in_flight)
        } else {
            0
        },
        reset_secs: Some(u64::from(!admitted)),
        rule: Some(rule.clone()),
        window_count: None,
    }
}

/// Picks the bucket that speaks for the descriptor: the one that rejected
/// (the longest wait first), else the one with the fewest tokens left.
fn decision_from(
    rule: Option<&Arc<Rule>>,
    limits: &[LimitRef<'_>],
    outcomes: &[BucketOutcome],
) -> Decision {
    let admitted = outcomes.iter().all(|o| o.admitted);
    let speaker = if admitted {
        outcomes.iter().enumerate().min_by_key(|(_, o)| o.remaining)
    } else {
        outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| o.retry_after_secs.is_some() || o.never.is_some())
            .max_by_key(|(_, o)| (o.never.is_some(), o.retry_after_secs))
    };
    let Some((i, outcome)) = speaker else {
        return Decision::without_limit(Verdict::NoRule, rule.cloned());
    };
    let verdict = match (admitted, rule) {
        (true, _) => Verdict::Ok,
        (false, Some(r)) if r.shadow_mode => Verdict::Shadow,
        (false, Some(r)) if r.quota_mode => Verdict::QuotaExceeded,
        (false, _) => Verdict::OverLimit,
    };
    Decision {
        verdict,
        limit: limits.get(i).map(LimitRef::shown),
        remaining: outcome.remaining,
        reset_secs: if admitted {
            Some(outcome.full_in_secs)
        } else {
            outcome.retry_after_secs
        },
        rule: rule.cloned(),
        window_count: outcome.window_count,
    }
}

#[cfg(test)]
mod tests;
