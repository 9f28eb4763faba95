//! One request, top to bottom: its descriptors planned, decided (side by
//! side, or in turn: [`in_turn`]) and settled: what a request that holds
//! nothing took (refused, answered with an error, or given up by its
//! caller) given back ([`give_back`]).
//!
//! **Detached decisions.** A caller that gives up (Envoy at its deadline,
//! a client's cancellation, a dropped connection) drops its call: a
//! decision cut there would keep what its first descriptors took and leave
//! a store call that already went out to run unseen. Where that can happen
//! (a store that waits, Redis, and a request with two or more descriptors
//! that take something, or an attempt's start) the decision runs on a task
//! of its own ([`Limiter::decide_request`]): it completes whether or not
//! anybody waits, gives back everything when nobody does, and its store
//! calls cut off at their budget linger ([`super::store_call`]). At most
//! [`super::MAX_DETACHED`] such decisions at once: past it a decision is
//! made in its caller's call, as on the memory store (whose calls never
//! wait: nothing can cut them in half).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use tokio::sync::OwnedSemaphorePermit;

use super::give_back::{Job, Reason};
use super::plan::{plan, Plan};
use super::{in_turn, window_peek, Decided, DescriptorInput, Limiter, Turn, Unavailable};
use crate::attempt::Phase;
use crate::bucket::Cost;
use crate::decision::{Decision, Verdict};
use crate::rules::{DescriptorEntry, RuleSet, Unit};
use crate::store::StoreError;

/// A descriptor of a request, owned: what a detached decision takes along.
struct OwnedInput<E> {
    entries: Vec<E>,
    cost: Cost,
    limit_override: Option<(u32, Unit)>,
    own_hits_addend: bool,
}

impl<E: Clone> OwnedInput<E> {
    fn of(input: &DescriptorInput<'_, E>) -> Self {
        Self {
            entries: input.entries.to_vec(),
            cost: input.cost,
            limit_override: input.limit_override,
            own_hits_addend: input.own_hits_addend,
        }
    }

    fn input(&self) -> DescriptorInput<'_, E> {
        DescriptorInput {
            entries: &self.entries,
            cost: self.cost,
            limit_override: self.limit_override,
            own_hits_addend: self.own_hits_addend,
        }
    }
}

/// A give-back's task: what came back for each descriptor, by its index.
type GivenBack = tokio::task::JoinHandle<Vec<(usize, Option<u64>)>>;

/// Whether the caller of a decision has given up on it.
type Gone<'a> = &'a (dyn Fn() -> bool + Sync);

impl Limiter {
    /// Decides every descriptor of one request. Each descriptor is decided
    /// in its own store call (the buckets of one descriptor together), side
    /// by side, or one at a time for a request that starts an attempt
    /// (`in_turn`); when one refuses, what the others took is given
    /// back ([`give_back`]), unless each spends on its own
    /// (`--per-descriptor-spending`).
    pub async fn decide<E: DescriptorEntry>(
        &self,
        rules: &RuleSet,
        domain: &str,
        descriptors: &[DescriptorInput<'_, E>],
    ) -> Result<Vec<Decision>, Unavailable> {
        self.decide_within(rules, domain, descriptors, None).await
    }

    /// [`Limiter::decide`], with store calls cut off after `budget` (the
    /// part of the caller's deadline left to the store): the rule's failure
    /// mode answers a call that would take longer, before the caller gives up.
    pub async fn decide_within<E: DescriptorEntry>(
        &self,
        rules: &RuleSet,
        domain: &str,
        descriptors: &[DescriptorInput<'_, E>],
        budget: Option<Duration>,
    ) -> Result<Vec<Decision>, Unavailable> {
        self.decide_by(rules, domain, descriptors, budget, None)
            .await
    }

    /// [`Limiter::decide_within`] for a caller that gives up at `deadline`
    /// (Envoy answers by its failure mode then): what a decision that
    /// completes after it took is given back ([`give_back`], "Late
    /// answers"). Decided in the caller's call: see
    /// [`Limiter::decide_request`] for a caller that may drop it.
    pub async fn decide_by<E: DescriptorEntry>(
        &self,
        rules: &RuleSet,
        domain: &str,
        descriptors: &[DescriptorInput<'_, E>],
        budget: Option<Duration>,
        deadline: Option<Instant>,
    ) -> Result<Vec<Decision>, Unavailable> {
        let mut plans = plan(rules, domain, descriptors, self.calendar_now());
        self.bound_values(domain, &mut plans);
        let turn = Turn::new(rules.generation(), budget);
        self.decide_planned(&plans, turn, deadline, &|| false).await
    }

    /// [`Limiter::decide_by`] for a caller that may drop the call (the
    /// service: Envoy resets a call at its deadline): detached where a
    /// dropped call could be cut in half (see the module's text).
    pub async fn decide_request<E>(
        self: &Arc<Self>,
        rules: &Arc<RuleSet>,
        domain: &str,
        descriptors: &[DescriptorInput<'_, E>],
        budget: Option<Duration>,
        deadline: Option<Instant>,
    ) -> Result<Vec<Decision>, Unavailable>
    where
        E: DescriptorEntry + Clone + Send + Sync + 'static,
    {
        let mut plans = plan(rules, domain, descriptors, self.calendar_now());
        let turn = Turn::new(rules.generation(), budget);
        if self.may_be_cut(&plans) {
            if let Ok(permit) = self.detached.clone().try_acquire_owned() {
                drop(plans);
                // boxed: the plain path's future stays as small as it was
                let detached =
                    self.decide_detached(permit, rules, domain, descriptors, turn, deadline);
                return Box::pin(detached).await;
            }
        }
        self.bound_values(domain, &mut plans);
        self.decide_planned(&plans, turn, deadline, &|| false).await
    }

    /// Whether a caller that drops its call could cut `plans`' decision in
    /// half: its store waits, and it takes from two or more places or
    /// starts an attempt (a request that reports a stream's end keeps
    /// everything anyway).
    fn may_be_cut(&self, plans: &[Plan<'_>]) -> bool {
        if !self.give_back || self.store.answers_at_once() || plans.iter().any(Plan::is_stream_done)
        {
            return false;
        }
        let taking = plans.iter().filter(|p| !matches!(p, Plan::Done(_))).count();
        taking >= 2 || plans.iter().any(starts)
    }

    /// Decides on a task of its own, which answers through a channel and
    /// settles as late when nobody listens any more.
    async fn decide_detached<E>(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
        rules: &Arc<RuleSet>,
        domain: &str,
        descriptors: &[DescriptorInput<'_, E>],
        turn: Turn,
        deadline: Option<Instant>,
    ) -> Result<Vec<Decision>, Unavailable>
    where
        E: DescriptorEntry + Clone + Send + Sync + 'static,
    {
        let owned: Vec<OwnedInput<E>> = descriptors.iter().map(OwnedInput::of).collect();
        let (this, rules, domain) = (self.clone(), rules.clone(), domain.to_owned());
        let (answer, answered) = tokio::sync::oneshot::channel();
        let span = tracing::Span::current();
        let decision = async move {
            let _permit = permit;
            let inputs: Vec<_> = owned.iter().map(OwnedInput::input).collect();
            let mut plans = plan(&rules, &domain, &inputs, this.calendar_now());
            this.bound_values(&domain, &mut plans);
            let turn = Turn {
                lingering: true,
                ..turn
            };
            let decided = this
                .decide_planned(&plans, turn, deadline, &|| answer.is_closed())
                .await;
            let _ = answer.send(decided);
        };
        // its store calls' spans stay the request's
        tokio::spawn(tracing::Instrument::instrument(decision, span));
        answered.await.unwrap_or_else(|_| {
            Err(Unavailable(StoreError::Connection(
                "the request's decision ended without an answer".into(),
            )))
        })
    }

    /// Decides `plans` and settles the request: its answer, and what is
    /// given back.
    async fn decide_planned(
        &self,
        plans: &[Plan<'_>],
        turn: Turn,
        deadline: Option<Instant>,
        gone: Gone<'_>,
    ) -> Result<Vec<Decision>, Unavailable> {
        let decided = self.decide_plans(plans, turn).await;
        let late = gone() || deadline.is_some_and(|d| Instant::now() >= d);
        self.settle(plans, decided, late, turn.budget).await
    }

    /// Each plan's decision: alone, in turn, or side by side.
    async fn decide_plans(
        &self,
        plans: &[Plan<'_>],
        turn: Turn,
    ) -> Vec<Result<Decided, Unavailable>> {
        if let [only] = plans {
            return vec![self.decide_plan(only, turn).await];
        }
        let order = match self.give_back {
            true => in_turn::order(plans),
            false => None,
        };
        match order {
            Some(order) => self.decide_in_turn(plans, &order, turn).await,
            None if self.give_back && window_peek::peeks_first(plans) => {
                self.decide_peeking(plans, turn).await
            }
            None => join_all(plans.iter().map(|p| self.decide_plan(p, turn))).await,
        }
    }

    /// The request's answer from its descriptors' decisions (the first
    /// error, if any), once what they took is given back where the request
    /// holds nothing: refused, failed (an error answers it) or late (its
    /// caller gave up or had given up).
    async fn settle(
        &self,
        plans: &[Plan<'_>],
        mut decided: Vec<Result<Decided, Unavailable>>,
        late: bool,
        budget: Option<Duration>,
    ) -> Result<Vec<Decision>, Unavailable> {
        // (only a request over a quota has one to settle: nothing else
        // allocates here)
        let over_a_quota = || {
            decided
                .iter()
                .flatten()
                .any(|d| d.decision.verdict == Verdict::QuotaExceeded)
        };
        if self.all_quota || over_a_quota() {
            let mut answers: Vec<&mut Decision> = decided
                .iter_mut()
                .flatten()
                .map(|d| &mut d.decision)
                .collect();
            crate::decision::settle_quotas(&mut answers, self.all_quota);
        }
        let keeps = !self.give_back
            || plans.iter().any(Plan::is_stream_done)
            || decided
                .iter()
                .all(|d| d.as_ref().map_or(true, |d| d.spent.is_none()));
        let reason = if keeps {
            None
        } else if decided.iter().any(Result::is_err) {
            Some(Reason::Failed)
        } else if late {
            Some(Reason::Late)
        } else if decided
            .iter()
            .flatten()
            .any(|d| d.decision.verdict == Verdict::OverLimit)
        {
            Some(Reason::Refused)
        } else {
            None
        };
        let Some(reason) = reason else {
            return decided.into_iter().map(|d| d.map(|d| d.decision)).collect();
        };
        let mut decisions = Vec::with_capacity(decided.len());
        let mut jobs = Vec::new();
        let mut error = None;
        for (i, (plan, d)) in plans.iter().zip(decided).enumerate() {
            match d {
                Ok(d) => {
                    jobs.extend(d.spent.and_then(|s| Job::of(plan, s)).map(|j| (i, j)));
                    decisions.push(d.decision);
                }
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        let given = self.give_back(jobs, reason, budget);
        if let Some(error) = error {
            return Err(error);
        }
        if reason != Reason::Refused {
            return Ok(decisions); // nobody reads what is left
        }
        // the answer says what is left once given back
        let given = match given {
            Some(given) => given.await.unwrap_or_default(),
            None => Vec::new(),
        };
        for (i, back) in given {
            if let (Some(n), Some(d)) = (back, decisions.get_mut(i)) {
                d.remaining = d.remaining.saturating_add(n);
            }
        }
        Ok(decisions)
    }

    /// Runs `jobs` for `reason` on a task of their own ([`give_back`]): a
    /// caller that gives up cannot cut them in half. Each answer with its
    /// descriptor's index. One that nobody waits for needs room among the
    /// follow-ups ([`super::MAX_FOLLOW_UPS`]), or is counted `overloaded`
    /// and not run.
    pub(super) fn give_back(
        &self,
        jobs: Vec<(usize, Job)>,
        reason: Reason,
        budget: Option<Duration>,
    ) -> Option<GivenBack> {
        if jobs.is_empty() {
            return None;
        }
        let permit = match self.follow_ups.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            // its caller waits for it: bounded by the calls in flight
            Err(_) if reason == Reason::Refused => None,
            Err(_) => {
                for (_, job) in &jobs {
                    self.metrics
                        .given_back(job.rule(), reason.label(), "overloaded");
                }
                return None;
            }
        };
        let places = self.places();
        // on this thread's runtime: a Redis call follows the decisions on
        // their connection
        Some(tokio::spawn(async move {
            let _permit = permit;
            join_all(jobs.into_iter().map(|(i, job)| {
                let places = &places;
                async move { (i, places.run(job, reason, budget).await) }
            }))
            .await
        }))
    }
}

/// Whether `plan` starts an attempt (a reservation, a dedupe rule's first
/// call, a slot).
fn starts(plan: &Plan<'_>) -> bool {
    match plan {
        Plan::Buckets { attempt, .. } | Plan::Slots { attempt, .. } => {
            attempt.as_ref().is_some_and(|a| a.phase == Phase::Start)
        }
        Plan::Done(_) => false,
    }
}
