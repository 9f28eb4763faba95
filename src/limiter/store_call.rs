//! A descriptor's call to the store: traced, timed, cut off at its budget
//! (the failure mode answers instead), and followed where the store may
//! have taken something the answer does not say.
//!
//! - In a detached decision ([`super::Limiter::decide_request`]) a call cut
//!   off at its budget *lingers*: it runs on, at most
//!   [`give_back::LATE_PATIENCE`], on a task of its own, and what its
//!   answer says it took is given back when it arrives (a start that got
//!   no answer at all is withdrawn after it: a withdrawal finds its record
//!   if it ran and nothing if not).
//! - A call that failed after it may have run (a timeout, a connection
//!   lost) is, for an attempt's start or a slot, withdrawn after it.
//! - An admission whose replicas did not acknowledge it
//!   (`not_replicated`) ran: the failure mode answers instead, and what it
//!   took is given back.

use std::future::Future;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tracing::Instrument;

use super::give_back::{self, Job, Reason, LATE_PATIENCE};
use super::{within, Limiter, Turn};
use crate::attempt::{AttemptCall, Phase};
use crate::attempt::{AttemptResult, SlotOutcome};
use crate::bucket::{BucketOutcome, Cost};
use crate::labels::RuleId;
use crate::store::{AttemptOutcome, DescriptorBuckets, StoreError};
use crate::telemetry::tracing::SPAN_TARGET;

/// What a failed call would have taken, to follow it with its give-back.
#[derive(Debug, Clone, Copy)]
pub(super) enum Taking<'a> {
    Tokens(Cost),
    Start(&'a AttemptCall),
    /// A slot of at most the given number.
    Slot(&'a AttemptCall, u64),
}

/// What gives back a lingering call's take, from its answer (`None`: no
/// answer, though it may have run).
type Late<T> = Box<dyn FnOnce(Option<&T>) -> Option<Job> + Send>;

/// Whether a call that failed with `error` may still have run in the store.
fn may_have_run(error: &StoreError) -> bool {
    matches!(error, StoreError::Timeout | StoreError::Connection(_))
}

impl Limiter {
    /// Spends `cost` from `buckets` in the store.
    pub(super) async fn spend_in_store(
        &self,
        rule: RuleId,
        buckets: &DescriptorBuckets,
        cost: Cost,
        turn: Turn,
        started: Instant,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        if !turn.lingering {
            let call = self.store.decide_patiently(buckets, cost, turn.budget);
            return self.store_call(started, turn.budget, call).await;
        }
        let (store, owned) = (self.store.clone(), buckets.clone());
        let patience = lingering_patience(turn.budget);
        let call = Box::pin(async move { store.decide_patiently(&owned, cost, patience).await });
        let owned = buckets.clone();
        let late: Late<Vec<BucketOutcome>> = Box::new(move |answer| {
            let outcomes = answer?;
            match give_back::tokens_taken(cost, &owned, outcomes)? {
                give_back::SpentKind::Tokens(n) => Some(Job::refund(rule, &owned, n)),
                _ => None,
            }
        });
        // boxed: a decision that does not linger keeps its future small
        Box::pin(self.lingering_call(started, turn.budget, rule, call, late)).await
    }

    /// One call of an attempt in the store's attempt records.
    pub(super) async fn attempt_in_store(
        &self,
        rule: RuleId,
        buckets: &DescriptorBuckets,
        cost: Cost,
        call: &AttemptCall,
        turn: Turn,
        started: Instant,
    ) -> Result<AttemptOutcome, StoreError> {
        if !turn.lingering {
            let store_call = self.store.decide_attempt(buckets, cost, call, turn.budget);
            return self.store_call(started, turn.budget, store_call).await;
        }
        let (store, owned, owned_call) = (self.store.clone(), buckets.clone(), call.clone());
        let patience = lingering_patience(turn.budget);
        let store_call = Box::pin(async move {
            store
                .decide_attempt(&owned, cost, &owned_call, patience)
                .await
        });
        let (owned, call) = (buckets.clone(), call.clone());
        let late: Late<AttemptOutcome> = Box::new(move |answer| {
            let took = match answer {
                Some(outcome) => super::start_taken(&call, outcome).is_some(),
                None => call.phase == Phase::Start,
            };
            took.then(|| Job::withdraw_start(rule, &owned, &call, None))
        });
        Box::pin(self.lingering_call(started, turn.budget, rule, store_call, late)).await
    }

    /// One call of a `concurrency` rule's attempt in the store.
    pub(super) async fn slot_in_store(
        &self,
        rule: RuleId,
        slots: &DescriptorBuckets,
        max: u64,
        call: &AttemptCall,
        turn: Turn,
        started: Instant,
    ) -> Result<SlotOutcome, StoreError> {
        if !turn.lingering {
            let store_call = self.store.decide_slot(slots, max, call, rule, turn.budget);
            return self.store_call(started, turn.budget, store_call).await;
        }
        let (store, owned, owned_call) = (self.store.clone(), slots.clone(), call.clone());
        let patience = lingering_patience(turn.budget);
        let store_call = Box::pin(async move {
            store
                .decide_slot(&owned, max, &owned_call, rule, patience)
                .await
        });
        let (owned, call) = (slots.clone(), call.clone());
        let late: Late<SlotOutcome> = Box::new(move |answer| {
            let took = call.phase == Phase::Start
                && answer.is_none_or(|o| o.admitted && o.result == AttemptResult::First);
            took.then(|| Job::withdraw_start(rule, &owned, &call, Some(max)))
        });
        Box::pin(self.lingering_call(started, turn.budget, rule, store_call, late)).await
    }

    /// `call` to the store, traced, cut off after `budget`, its time
    /// observed from `started`. A budget already spent sends nothing to a
    /// store that waits.
    pub(super) async fn store_call<T>(
        &self,
        started: Instant,
        budget: Option<Duration>,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        if self.spent_budget(budget) {
            return Err(StoreError::Timeout);
        }
        let call = call.instrument(
            tracing::info_span!(target: SPAN_TARGET, "store.decide", store = self.store.name()),
        );
        let result = within(budget, call).await;
        self.metrics
            .observe_store_call(self.store.name(), started.elapsed().as_secs_f64());
        result
    }

    /// Whether `budget` leaves a store that waits no time at all (an
    /// in-turn request's last descriptors, its deadline spent).
    fn spent_budget(&self, budget: Option<Duration>) -> bool {
        budget == Some(Duration::ZERO) && !self.store.answers_at_once()
    }

    /// [`Limiter::store_call`] for a detached decision: a call cut off at
    /// `budget` lingers ([`Limiter::follow_late`]).
    async fn lingering_call<T: Send + 'static>(
        &self,
        started: Instant,
        budget: Option<Duration>,
        rule: RuleId,
        mut call: BoxFuture<'static, Result<T, StoreError>>,
        late: Late<T>,
    ) -> Result<T, StoreError> {
        let Some(limit) = budget else {
            return self.store_call(started, None, call).await;
        };
        if self.spent_budget(budget) {
            return Err(StoreError::Timeout);
        }
        let span =
            tracing::info_span!(target: SPAN_TARGET, "store.decide", store = self.store.name());
        let cut = tokio::time::timeout(limit, &mut call)
            .instrument(span)
            .await;
        self.metrics
            .observe_store_call(self.store.name(), started.elapsed().as_secs_f64());
        match cut {
            Ok(result) => result,
            Err(_) => {
                self.follow_late(rule, call, late);
                Err(StoreError::Timeout)
            }
        }
    }

    /// Lets `call`, cut off at its budget, run on (at most
    /// [`LATE_PATIENCE`]) and gives back what its answer says it took;
    /// a call that never answers is counted `unanswered` unless `late`
    /// withdraws it anyway.
    fn follow_late<T: Send + 'static>(
        &self,
        rule: RuleId,
        call: BoxFuture<'static, Result<T, StoreError>>,
        late: Late<T>,
    ) {
        let Ok(permit) = self.follow_ups.clone().try_acquire_owned() else {
            self.metrics
                .given_back(rule, Reason::Late.label(), "overloaded");
            return;
        };
        let places = self.places();
        tokio::spawn(async move {
            let _permit = permit;
            let answer = tokio::time::timeout(LATE_PATIENCE, call).await;
            let job = match &answer {
                Ok(Ok(t)) => late(Some(t)),
                Ok(Err(e)) if !may_have_run(e) => None,
                _ => match late(None) {
                    Some(job) => Some(job),
                    None => {
                        places
                            .metrics
                            .given_back(rule, Reason::Late.label(), "unanswered");
                        None
                    }
                },
            };
            if let Some(job) = job {
                places.run(job, Reason::Late, None).await;
            }
        });
    }

    /// Follows a store call that failed with `error` by what gives back
    /// what it may have taken (see the module's text); not waited for.
    pub(super) fn follow_failed_call(
        &self,
        rule: RuleId,
        buckets: &DescriptorBuckets,
        taking: Taking<'_>,
        error: &StoreError,
        turn: Turn,
    ) {
        if !self.give_back {
            return;
        }
        // a detached call cut off at its budget lingers instead
        let cut_off = turn.lingering && turn.budget.is_some();
        let (job, reason) = match (error, taking) {
            (StoreError::NotReplicated(_), Taking::Tokens(cost)) => {
                let Cost::Spend(n) = cost else { return };
                if !give_back::takes_tokens(buckets) {
                    return;
                }
                (Job::refund(rule, buckets, n), Reason::Failed)
            }
            (StoreError::NotReplicated(_), Taking::Start(call)) if call.phase == Phase::Start => (
                Job::withdraw_start(rule, buckets, call, None),
                Reason::Failed,
            ),
            (StoreError::NotReplicated(_), Taking::Slot(call, max))
                if call.phase == Phase::Start =>
            {
                (
                    Job::withdraw_start(rule, buckets, call, Some(max)),
                    Reason::Failed,
                )
            }
            (StoreError::Timeout, _) if cut_off => return,
            (e, Taking::Start(call)) if may_have_run(e) && call.phase == Phase::Start => {
                (Job::withdraw_start(rule, buckets, call, None), Reason::Late)
            }
            (e, Taking::Slot(call, max)) if may_have_run(e) && call.phase == Phase::Start => (
                Job::withdraw_start(rule, buckets, call, Some(max)),
                Reason::Late,
            ),
            _ => return,
        };
        drop(self.give_back(vec![(0, job)], reason, turn.budget));
    }
}

/// How long a lingering call's store may wait: past its budget (where the
/// failure mode answers) by [`LATE_PATIENCE`], so that the cut is always
/// the limiter's and the answer can still arrive.
fn lingering_patience(budget: Option<Duration>) -> Option<Duration> {
    budget.map(|b| b.saturating_add(LATE_PATIENCE))
}
