//! A request of two or more fixed windows counted in envoyproxy/ratelimit's
//! keys, where a refused request keeps nothing of its other descriptors
//! (the default; its `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true`). A
//! window keeps every hit, so what a descriptor counted cannot be given
//! back afterwards; as there (`src/redis/fixed_cache_impl.go`), the counts
//! are read first (a check, `INCRBY key 0`), and when any descriptor would
//! go over, only those count their hits (answered over the limit, every
//! refused hit counted as there), the others answered from their counts,
//! counting nothing. When none would, all count as usual. Two round trips
//! for such a request, as there (its `GET`s, then its `INCRBY`s).

use futures::future::join_all;

use super::plan::Plan;
use super::{Decided, Limiter, Turn, Unavailable};
use crate::bucket::Cost;

/// Whether `plans` are decided by [`Limiter::decide_peeking`]: two or more
/// take something, and all of those are windows in envoyproxy/ratelimit's
/// keys spending (or checking) hits, with no attempt.
pub(super) fn peeks_first(plans: &[Plan<'_>]) -> bool {
    let mut taking = 0;
    for plan in plans {
        match plan {
            Plan::Done(_) => {}
            Plan::Buckets {
                buckets,
                cost: Cost::Spend(_) | Cost::Check,
                attempt: None,
                global: None,
                ..
            } if buckets.ratelimit_key.is_some() => taking += 1,
            _ => return false,
        }
    }
    taking >= 2
}

impl Limiter {
    /// Decides `plans` (of [`peeks_first`]) counts first: each descriptor
    /// checked, then only those that would go over spend, if any would;
    /// else all spend.
    pub(super) async fn decide_peeking(
        &self,
        plans: &[Plan<'_>],
        turn: Turn,
    ) -> Vec<Result<Decided, Unavailable>> {
        let started = std::time::Instant::now();
        let checks = join_all(plans.iter().map(|p| self.check_plan(p, turn))).await;
        let mut over = Vec::with_capacity(plans.len());
        for (plan, check) in plans.iter().zip(&checks) {
            let Ok(check) = check else {
                return checks; // the error answers the request
            };
            over.push(match plan {
                Plan::Buckets {
                    cost: Cost::Spend(n),
                    ..
                } => *n > check.decision.remaining,
                _ => false,
            });
        }
        let step = Turn {
            budget: turn.budget.map(|b| b.saturating_sub(started.elapsed())),
            ..turn
        };
        let anyone_over = over.iter().any(|o| *o);
        let spends = plans
            .iter()
            .zip(&over)
            .filter(|(_, over)| !anyone_over || **over)
            .map(|(p, _)| self.decide_plan(p, step));
        // a window's hit is never given back (its refund counts 0): none
        // to make later
        let mut spent = join_all(spends)
            .await
            .into_iter()
            .map(|d| d.map(|d| Decided { spent: None, ..d }));
        checks
            .into_iter()
            .zip(over)
            .map(|(check, over)| match !anyone_over || over {
                true => spent.next().unwrap_or(check),
                false => check,
            })
            .collect()
    }
}
