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
//! Pure bookkeeping here; the limiter makes the calls (`Limiter::give_back`).

use crate::attempt::{AttemptCall, AttemptMode, Phase};
use crate::bucket::{Algorithm, BucketOutcome, Cost};
use crate::store::DescriptorBuckets;

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

impl SpentKind {
    /// What comes back: tokens, or one slot.
    pub(super) fn units(self) -> u64 {
        match self {
            SpentKind::Tokens(n) | SpentKind::Start(n) => n,
            SpentKind::Slot => 1,
        }
    }
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
    if buckets
        .buckets
        .iter()
        .all(|b| b.params.algorithm == Algorithm::FixedWindow)
    {
        return None;
    }
    let admitted = !outcomes.is_empty() && outcomes.iter().all(|o| o.admitted);
    let taken = outcomes.iter().map(|o| o.taken).max().unwrap_or(0);
    (admitted && taken > 0).then_some(SpentKind::Tokens(taken))
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
