//! One request, one decision: a request answered OVER_LIMIT keeps nothing
//! that its other descriptors took.
//!
//! The descriptors of a request are decided side by side, each in its own
//! atomic store call (they may live on different Redis Cluster shards).
//! When one refuses, what the others took is given back afterwards, once:
//! one compensating call per descriptor that took something, never re-sent
//! (one that fails is counted `failed` and logged, not retried: a retry
//! could give back twice).
//!
//! - tokens (token buckets, sliding windows, calendar periods; a lease's
//!   go back to the lease): refunded, never above the burst;
//! - an attempt's start (a reservation, or a dedupe rule's first call):
//!   settled as having used nothing, so that its tokens come back and its
//!   record says it ended: a retry with the same id is a new attempt, and
//!   the request's stream-done call finds nothing left to settle;
//! - a concurrency slot: released.
//!
//! What stays: a fixed window's hit (it counts every hit, refused or not,
//! as envoyproxy/ratelimit does); a charge (usage on an `overdraft` rule
//! happened whatever the answer); every call of a request that carries a
//! stream-done phase (the request ran).
//!
//! **Late answers.** A decision that completes after the caller's
//! deadline (`grpc-timeout`: Envoy has answered by its failure mode) is
//! given back the same way, but an attempt's start is *withdrawn*: what it
//! took comes back and its record goes, so that a done call that follows
//! (the failure mode may have let the request run) is charged in full. A
//! store call for an attempt's start that timed out may still run in
//! Redis: a withdrawal follows it on the same connection, which finds its
//! record if it ran (and nothing if it did not).
//!
//! **Failed requests.** A request answered with an error (a
//! `failure_mode: closed` rule whose store call failed, on any of its
//! descriptors) holds nothing either: what its other descriptors took is
//! given back as for a late answer (an attempt's start withdrawn: the
//! caller's failure mode may have let the request run). So is what the
//! store took for a call whose answer the failure mode replaced: an
//! admission that its replicas did not acknowledge (`not_replicated`), and
//! in a detached decision ([`super::Limiter::decide_request`]) a call
//! answered after its budget, given back when its answer arrives.
//!
//! The calls run on a task of their own (on the serving thread's runtime,
//! so a Redis call follows the decisions on the same connection): Envoy
//! dropping the call at its deadline cannot cut a give-back in half. A
//! refused request waits for its give-back, so that its answer says what
//! is left; a late one does not.

use std::sync::Arc;

use super::lease::Leases;
use super::plan::Plan;
use crate::attempt::{AttemptCall, AttemptMode, Phase};
use crate::bucket::{Algorithm, BucketOutcome, Cost};
use crate::clock::MonotonicClock;
use crate::labels::RuleId;
use crate::store::memory::MemoryStore;
use crate::store::{DescriptorBuckets, Store, StoreError};
use crate::telemetry::Metrics;

/// Where a descriptor's decision was made, so that its give-back goes
/// to the same place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// The store (memory or Redis).
    Store,
    /// The `local` failure mode's own buckets, at this instance's share.
    Local,
    /// A lease of `generation`'s rules, held by this instance.
    Lease { generation: u64 },
}

/// What an admitted descriptor took, to give back if its request is
/// refused.
#[derive(Debug)]
pub(super) struct Spent {
    pub(super) source: Source,
    pub(super) kind: SpentKind,
    /// The buckets it was taken from when they are not the plan's own: a
    /// region's share of a global rule (its parameters), the local share.
    pub(super) buckets: Option<DescriptorBuckets>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SpentKind {
    Tokens(u64),
    /// An attempt's admitted first start that took these tokens.
    Start(u64),
    /// A concurrency slot taken by a first start.
    Slot,
}

/// What a plain decision took from its buckets: `cost` (a spend) admitted
/// by `outcomes`. None for a charge, a check, a refund, a refusal, and for
/// buckets that keep every hit (fixed windows).
pub(super) fn tokens_taken(
    cost: Cost,
    buckets: &DescriptorBuckets,
    outcomes: &[BucketOutcome],
) -> Option<SpentKind> {
    if !matches!(cost, Cost::Spend(_)) {
        return None;
    }
    if !takes_tokens(buckets) {
        return None;
    }
    let admitted = !outcomes.is_empty() && outcomes.iter().all(|o| o.admitted);
    let taken = outcomes.iter().map(|o| o.taken).max().unwrap_or(0);
    (admitted && taken > 0).then_some(SpentKind::Tokens(taken))
}

/// Whether a spend from `buckets` takes tokens that can be given back:
/// not when every bucket is a fixed window (which counts every hit).
pub(super) fn takes_tokens(buckets: &DescriptorBuckets) -> bool {
    !buckets
        .buckets
        .iter()
        .all(|b| b.params.algorithm == Algorithm::FixedWindow)
}

/// The call that gives back an admitted start of `call`: a done call that
/// used nothing, settled as a reservation (its record holds what the start
/// took, for either mode).
pub(super) fn settle_unused(call: &AttemptCall) -> (AttemptCall, Cost) {
    (
        AttemptCall {
            phase: Phase::Done,
            mode: AttemptMode::Reserve,
            ..call.clone()
        },
        Cost::Charge(0),
    )
}

/// The call that releases a slot taken by `call`'s start.
pub(super) fn release(call: &AttemptCall) -> AttemptCall {
    AttemptCall {
        phase: Phase::Done,
        ..call.clone()
    }
}

/// The call that withdraws `call`'s start, answered too late.
pub(super) fn withdrawal(call: &AttemptCall) -> AttemptCall {
    AttemptCall {
        phase: Phase::Withdraw,
        ..call.clone()
    }
}

/// How long a late give-back waits for its node: it follows a call that
/// timed out, on the same connection, so it waits for that call to run.
pub(super) const LATE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// Why something is given back (`reason` of `rls_given_back_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reason {
    /// The request was answered OVER_LIMIT.
    Refused,
    /// The answer came after the caller's deadline (or the caller gave
    /// up), or the store call for an attempt's start timed out.
    Late,
    /// The request was answered with an error, or the store's answer
    /// was replaced by the failure mode's.
    Failed,
}

impl Reason {
    pub(super) fn label(self) -> &'static str {
        match self {
            Reason::Refused => "refused",
            Reason::Late => "late",
            Reason::Failed => "error",
        }
    }

    /// Whether nobody waits for the answer (the request was answered, or
    /// given up): an attempt's start is withdrawn rather than settled, and
    /// the give-back may wait for a slow node.
    fn unwatched(self) -> bool {
        !matches!(self, Reason::Refused)
    }
}

/// One descriptor's give-back, owned, so that it can outlive the call.
#[derive(Debug)]
pub(super) struct Job {
    rule: RuleId,
    source: Source,
    what: What,
}

#[derive(Debug)]
enum What {
    Tokens {
        buckets: DescriptorBuckets,
        n: u64,
    },
    Start {
        buckets: DescriptorBuckets,
        call: AttemptCall,
        taken: u64,
    },
    Slot {
        slots: DescriptorBuckets,
        max: u64,
        call: AttemptCall,
    },
}

impl What {
    /// What comes back when it is given back: its tokens, or a slot.
    fn given(&self) -> u64 {
        match self {
            What::Tokens { n, .. } => *n,
            What::Start { taken, .. } => *taken,
            What::Slot { .. } => 1,
        }
    }

    /// The same give-back without waiting for the rule's replicas
    /// (`replication:`): one lost in a failover leaves what it gives back
    /// spent, the safe side, and a give-back never holds the connection
    /// that admissions wait for their replicas on.
    fn unreplicated(mut self) -> Self {
        let buckets = match &mut self {
            What::Tokens { buckets, .. } | What::Start { buckets, .. } => buckets,
            What::Slot { slots, .. } => slots,
        };
        buckets.replication = None;
        self
    }
}

impl Job {
    /// The rule whose descriptor took what this gives back.
    pub(super) fn rule(&self) -> RuleId {
        self.rule
    }

    /// What gives back `spent`, taken by `plan`'s descriptor.
    pub(super) fn of(plan: &Plan<'_>, spent: Spent) -> Option<Job> {
        let (rule, what) = match (plan, spent.kind) {
            (
                Plan::Buckets {
                    rule,
                    buckets,
                    attempt,
                    ..
                },
                kind,
            ) => {
                let rule = rule.map(|r| r.id).unwrap_or_default();
                let buckets = spent.buckets.unwrap_or_else(|| buckets.clone());
                match (kind, attempt) {
                    (SpentKind::Tokens(n), _) => (rule, What::Tokens { buckets, n }),
                    (SpentKind::Start(taken), Some(call)) => (
                        rule,
                        What::Start {
                            buckets,
                            call: call.clone(),
                            taken,
                        },
                    ),
                    _ => return None,
                }
            }
            (
                Plan::Slots {
                    rule,
                    slots,
                    max,
                    attempt: Some(call),
                },
                SpentKind::Slot,
            ) => (
                rule.id,
                What::Slot {
                    slots: slots.clone(),
                    max: *max,
                    call: call.clone(),
                },
            ),
            _ => return None,
        };
        Some(Job {
            rule,
            source: spent.source,
            what,
        })
    }

    /// Refunds `n` tokens of `buckets` taken in the store by `rule`.
    pub(super) fn refund(rule: RuleId, buckets: &DescriptorBuckets, n: u64) -> Job {
        Job {
            rule,
            source: Source::Store,
            what: What::Tokens {
                buckets: buckets.clone(),
                n,
            },
        }
    }

    /// Withdraws an attempt's start whose store call timed out (it may
    /// have run): a start of `buckets`, or a slot of at most `max`.
    pub(super) fn withdraw_start(
        rule: RuleId,
        buckets: &DescriptorBuckets,
        call: &AttemptCall,
        slot_max: Option<u64>,
    ) -> Job {
        let what = match slot_max {
            Some(max) => What::Slot {
                slots: buckets.clone(),
                max,
                call: call.clone(),
            },
            None => What::Start {
                buckets: buckets.clone(),
                call: call.clone(),
                taken: 0,
            },
        };
        Job {
            rule,
            source: Source::Store,
            what,
        }
    }
}

/// Where give-backs go: the limiter's store, local buckets and leases.
#[derive(Clone)]
pub(super) struct Places {
    pub(super) store: Arc<dyn Store>,
    pub(super) local: Arc<MemoryStore<MonotonicClock>>,
    pub(super) leases: Arc<Leases<MonotonicClock>>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) instances: u32,
    /// When a give-back that failed was last logged.
    pub(super) said: Arc<OnceASecond>,
}

/// A gate that opens at most once a second (a log line's).
#[derive(Debug, Default)]
pub(super) struct OnceASecond(parking_lot::Mutex<Option<std::time::Instant>>);

impl OnceASecond {
    /// Whether a line may be written at `now`: none in the last second.
    pub(super) fn admit(&self, now: std::time::Instant) -> bool {
        let mut last = self.0.lock();
        match *last {
            Some(t) if now.duration_since(t) < std::time::Duration::from_secs(1) => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

impl Places {
    /// Runs `job` once for `reason`, its store call cut off after
    /// `budget`; counted by result. What came back (tokens, or a slot),
    /// when it did.
    pub(super) async fn run(
        &self,
        job: Job,
        reason: Reason,
        budget: Option<std::time::Duration>,
    ) -> Option<u64> {
        // nobody waits for a late one: it may wait for a slow node
        let budget = match reason.unwatched() {
            false => budget,
            true => Some(LATE_PATIENCE),
        };
        let given = job.what.given();
        let result = self
            .give(job.rule, job.what, job.source, reason, budget)
            .await;
        // applied on the primary, as what it gives back was taken there
        let result = match result {
            Err(StoreError::NotReplicated(_)) => Ok(given),
            other => other,
        };
        self.count(job.rule, reason, result)
    }

    /// Gives `what` back to `source`: what came back (tokens, or a slot).
    async fn give(
        &self,
        rule: RuleId,
        what: What,
        source: Source,
        reason: Reason,
        budget: Option<std::time::Duration>,
    ) -> Result<u64, StoreError> {
        match (what.unreplicated(), source) {
            (What::Tokens { buckets, n }, Source::Store) => super::within(
                budget,
                self.store
                    .decide_patiently(&buckets, Cost::Refund(n), budget),
            )
            .await
            .map(|_| n),
            (What::Tokens { buckets, n }, Source::Local) => {
                self.local.decide_now(&buckets, Cost::Refund(n));
                Ok(n)
            }
            (What::Tokens { buckets, n }, Source::Lease { generation }) => {
                self.leases.put_back(&buckets, generation, n).await;
                Ok(n)
            }
            (
                What::Start {
                    buckets,
                    call,
                    taken,
                },
                source,
            ) => {
                let (call, cost) = match reason.unwatched() {
                    false => settle_unused(&call),
                    true => (withdrawal(&call), Cost::Check),
                };
                if source == Source::Local {
                    self.local.decide_attempt_now(&buckets, cost, &call);
                    return Ok(taken);
                }
                let call = self.store.decide_attempt(&buckets, cost, &call, budget);
                super::within(budget, call).await.map(|_| taken)
            }
            (What::Slot { slots, max, call }, source) => {
                // a late one is a withdrawal: released all the same, and
                // sent after the start whatever the node's breaker says
                let release = match reason.unwatched() {
                    false => release(&call),
                    true => withdrawal(&call),
                };
                if source == Source::Local {
                    let share = (max / u64::from(self.instances.max(1))).max(1);
                    self.local.decide_slot_now(&slots, share, &release, rule);
                    return Ok(1);
                }
                let call = self.store.decide_slot(&slots, max, &release, rule, budget);
                super::within(budget, call).await.map(|_| 1)
            }
        }
    }

    /// Counts a give-back of `rule` by its `result` (a failed one also
    /// logged, at most once a second): what came back, if it did.
    fn count(&self, rule: RuleId, reason: Reason, result: Result<u64, StoreError>) -> Option<u64> {
        let e = match result {
            Ok(n) => {
                self.metrics.given_back(rule, reason.label(), "ok");
                return Some(n);
            }
            Err(e) => e,
        };
        // sent, and no answer in time: it may still run (after the call it
        // follows, on the same connection)
        let sent = matches!(e, StoreError::Timeout | StoreError::Connection(_));
        let result = if sent { "unanswered" } else { "failed" };
        self.metrics.given_back(rule, reason.label(), result);
        if self.said.admit(std::time::Instant::now()) {
            let (domain, rule) = rule.labels();
            tracing::warn!(
                %domain,
                %rule,
                reason = reason.label(),
                result,
                error = %e,
                "could not give back what a descriptor took; it stays spent (rls_given_back_total; logged at most once a second)"
            );
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::BucketParams;
    use crate::labels::RuleId;
    use crate::store::BucketRef;

    fn buckets(algorithm: Algorithm) -> DescriptorBuckets {
        DescriptorBuckets {
            tag: b"t".to_vec(),
            buckets: vec![BucketRef {
                key: b"k".to_vec(),
                params: BucketParams {
                    capacity: 10,
                    tokens_per_unit: 10,
                    unit_secs: 60,
                    max_debt: None,
                    algorithm,
                    period: None,
                },
                rule: RuleId::default(),
            }],
            replication: None,
            ratelimit_key: None,
        }
    }

    fn outcome(admitted: bool, taken: u64) -> BucketOutcome {
        BucketOutcome {
            admitted,
            remaining: 0,
            retry_after_secs: None,
            full_in_secs: 0,
            never: None,
            taken,
            forgiven: 0,
            window_count: None,
        }
    }

    #[test]
    fn only_an_admitted_spend_that_took_tokens_is_given_back() {
        let tb = buckets(Algorithm::TokenBucket);
        let took = [outcome(true, 3)];
        assert_eq!(
            tokens_taken(Cost::Spend(3), &tb, &took),
            Some(SpentKind::Tokens(3))
        );
        assert_eq!(
            tokens_taken(Cost::Spend(3), &tb, &[outcome(false, 0)]),
            None
        );
        assert_eq!(tokens_taken(Cost::Check, &tb, &[outcome(true, 0)]), None);
        assert_eq!(
            tokens_taken(Cost::Charge(3), &tb, &took),
            None,
            "usage stays"
        );
        assert_eq!(tokens_taken(Cost::Refund(3), &tb, &took), None);
        assert_eq!(tokens_taken(Cost::Spend(3), &tb, &[]), None);
        let window = buckets(Algorithm::FixedWindow);
        assert_eq!(tokens_taken(Cost::Spend(3), &window, &took), None);
        for given in [Algorithm::SlidingWindow, Algorithm::CalendarWindow] {
            assert_eq!(
                tokens_taken(Cost::Spend(3), &buckets(given), &took),
                Some(SpentKind::Tokens(3))
            );
        }
    }

    #[test]
    fn a_start_is_given_back_as_a_settlement_of_nothing_and_a_slot_as_a_release() {
        let start = AttemptCall {
            id: b"a".to_vec(),
            phase: Phase::Start,
            mode: AttemptMode::Dedupe,
            ttl_micros: 5,
            max_repeats: 3,
        };
        let (call, cost) = settle_unused(&start);
        assert_eq!(
            (call.phase, call.mode, cost),
            (Phase::Done, AttemptMode::Reserve, Cost::Charge(0))
        );
        assert_eq!((call.id, call.ttl_micros), (start.id.clone(), 5));
        let slot = AttemptCall {
            mode: AttemptMode::Slot,
            ..start
        };
        assert_eq!(release(&slot).phase, Phase::Done);
        assert_eq!(release(&slot).mode, AttemptMode::Slot);
    }
}
