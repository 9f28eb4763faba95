//! A request that starts an attempt, decided one descriptor at a time
//! (issue 51): the order every request takes ([`order`], pure), and the
//! turn itself ([`Limiter::decide_in_turn`]), which stops at the first
//! refusal and answers the descriptors after it by a check.

use futures::future::join_all;

use super::plan::Plan;
use std::time::Instant;

use super::{slot_decision, Decided, Limiter, Turn, Unavailable};
use crate::attempt::Phase;
use crate::bucket::Cost;
use crate::decision::{Decision, Verdict};

/// The order in which a request's descriptors are decided one at a time
/// (issue 51), or `None` where they are decided all at once.
///
/// Decided at once, two requests that each need the same two scarce
/// things can each take one and be refused by the other (a chat takes the
/// last slot and finds the minute's tokens reserved by a chat that found
/// the slots taken): both refused, both given back, none admitted where
/// one could have been. Decided one at a time in one order for every
/// request, slots first and then by descriptor key, stopping at the first
/// refusal, the first to take the first scarce thing goes on to the next
/// and the other stops there, as locks taken in one order cannot deadlock.
///
/// Only a request that starts an attempt (a reservation, a slot) among two
/// or more descriptors that take something: its request is long and dear
/// (an LLM chat), a round trip per descriptor is nothing beside it. Plain
/// requests keep one round trip for all their descriptors, each decided
/// on its own as envoyproxy/ratelimit does.
pub(super) fn order(plans: &[Plan<'_>]) -> Option<Vec<usize>> {
    let starts = plans.iter().any(|p| match p {
        Plan::Buckets { attempt, .. } | Plan::Slots { attempt, .. } => {
            attempt.as_ref().is_some_and(|a| a.phase == Phase::Start)
        }
        Plan::Done(_) => false,
    });
    let taking = plans.iter().filter(|p| !matches!(p, Plan::Done(_))).count();
    if !starts || taking < 2 || plans.iter().any(Plan::is_stream_done) {
        return None;
    }
    let turn = |p: &Plan<'_>| -> (u8, Vec<u8>) {
        match p {
            Plan::Slots { slots, .. } => (0, slots.tag.clone()),
            Plan::Buckets { buckets, .. } => (1, buckets.tag.clone()),
            Plan::Done(_) => (2, Vec::new()),
        }
    };
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by_cached_key(|&i| turn(&plans[i]));
    Some(order)
}

impl Limiter {
    /// Decides `plans` one at a time in `order` ([`order`]),
    /// stopping at the first refusal: those after it take nothing, and are
    /// answered by what a check finds (a bucket's tokens left, spending
    /// none) or, for a `concurrency` rule, as undecided (OK, 0 left). An
    /// error stops the turn too: it answers the request, and those after
    /// it are not asked. Each step has what is left of `turn`'s budget:
    /// the turn never outruns its caller.
    pub(super) async fn decide_in_turn(
        &self,
        plans: &[Plan<'_>],
        order: &[usize],
        turn: Turn,
    ) -> Vec<Result<Decided, Unavailable>> {
        let started = Instant::now();
        let left = || Turn {
            budget: turn.budget.map(|b| b.saturating_sub(started.elapsed())),
            ..turn
        };
        let mut decided: Vec<Option<Result<Decided, Unavailable>>> =
            plans.iter().map(|_| None).collect();
        for &i in order {
            let d = self.decide_plan(&plans[i], left()).await;
            let stop = d
                .as_ref()
                .map_or(true, |d| d.decision.verdict == Verdict::OverLimit);
            decided[i] = Some(d);
            if stop {
                break;
            }
        }
        let failed = decided.iter().any(|d| matches!(d, Some(Err(_))));
        let checks = match failed {
            true => Vec::new(),
            false => {
                let step = left();
                join_all(
                    plans
                        .iter()
                        .zip(&decided)
                        .filter(|(_, d)| d.is_none())
                        .map(|(p, _)| self.check_plan(p, step)),
                )
                .await
            }
        };
        let mut checks = checks.into_iter();
        decided
            .into_iter()
            .map(|d| {
                d.or_else(|| checks.next()).unwrap_or_else(|| {
                    Ok(Decided::kept(Decision::without_limit(
                        Verdict::NoRule,
                        None,
                    )))
                })
            })
            .collect()
    }

    /// What `plan` would answer, taking nothing: a check of its buckets (its
    /// attempt left out), a slot rule undecided.
    pub(super) async fn check_plan(
        &self,
        plan: &Plan<'_>,
        turn: Turn,
    ) -> Result<Decided, Unavailable> {
        match plan {
            Plan::Done(decision) => Ok(Decided::kept(decision.clone())),
            Plan::Slots { rule, max, .. } => {
                Ok(Decided::kept(slot_decision(rule, true, *max, *max)))
            }
            Plan::Buckets {
                rule,
                limits,
                buckets,
                ..
            } => {
                self.decide_buckets(*rule, limits, buckets, Cost::Check, None, turn)
                    .await
            }
        }
    }
}
