//! Fixed windows, as envoyproxy/ratelimit counts: pure functions of
//! (parameters, state, now, cost), beside the token bucket's
//! ([`crate::bucket`]).
//!
//! A rule with `algorithm: fixed_window` allows `requests_per_unit` hits
//! in each window of `unit × unit_multiplier` seconds, windows aligned to
//! the Unix epoch (a minute's window starts at :00). Every hit counts, the
//! refused ones too: a hit is added to the window's count, and the call is
//! OVER_LIMIT when the count after it is above the limit. What is left is
//! the limit minus that count (0 when over; a check, `hits_addend: 0`,
//! counts nothing and is over when the count already is, as its `INCRBY 0`
//! is), and the wait, for a refusal
//! and for `duration_until_reset` alike, is the time until the window
//! ends. A descriptor's buckets (`limits`) each count the hit; the call is
//! admitted when every one is within its limit. A charge (`overdraft`)
//! counts as a hit does; a plain refund counts nothing and, as an
//! attempt's repeat, is answered OK; an attempt's give-back
//! ([`Cost::GiveBack`]) takes off the count of the window that counted it
//! (in a later window, nothing). A reservation refused takes nothing: the
//! store does not keep its count.
//!
//! A bucket's state is (the count, the window's start in µs) in
//! [`BucketState`]'s two fields; a count of another window is a count of
//! none. `store/redis/bucket.lua` has the Lua copy (flag 8), checked row by
//! row against this one by `tests/bucket_cases.rs`.
//!
//! Sliding windows, which weigh the window before too, are [`sliding`].
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses only the bucket's types.

use crate::bucket::{Algorithm, BucketOutcome, BucketParams, BucketState, Cost, NeverReason};

pub mod sliding;

const MICROS: u64 = 1_000_000;

/// The window holding `now_micros`: its start (µs) and the whole seconds
/// until it ends (at least 1).
pub fn window_of(params: &BucketParams, now_micros: u64) -> (u64, u64) {
    let length = params.unit_secs.max(1);
    let now_secs = now_micros / MICROS;
    let into = now_secs % length;
    ((now_secs - into) * MICROS, length - into)
}

/// Decides `cost` against fixed-window buckets; returns the states to
/// store (every bucket's count after the hit, refused or not) and one
/// outcome per bucket. Calendar periods count their own way
/// ([`decide_calendar`]).
pub fn decide(
    params: &[BucketParams],
    states: &[Option<BucketState>],
    now_micros: u64,
    cost: Cost,
) -> (Vec<BucketState>, Vec<BucketOutcome>) {
    if params
        .first()
        .is_some_and(|p| p.algorithm == Algorithm::CalendarWindow)
    {
        return decide_calendar(params, states, now_micros, cost);
    }
    // a check (`hits_addend: 0`) counts nothing, and is over when the
    // count already is: envoyproxy/ratelimit's `INCRBY key 0`; a charge
    // (`overdraft`) counts as every hit does, refused or not
    let counted = cost.deducted().max(0) as u64;
    // a refund, a repeat and a settlement that moves nothing need nothing:
    // answered OK
    let needed = cost.needed();
    // an attempt's give-back takes off the count of the window that
    // counted it, and is always answered OK (a plain refund counts
    // nothing here: a window keeps every hit)
    let give_back = match cost {
        Cost::GiveBack { tokens, .. } => Some(tokens.min(crate::bucket::MAX_COST)),
        _ => None,
    };
    let counts: Vec<(u64, u64, u64)> = params
        .iter()
        .zip(states)
        .map(|(p, s)| {
            let (start, reset) = window_of(p, now_micros);
            let count = s
                .filter(|s| s.updated_micros == start)
                .map_or(0, |s| s.tokens.max(0.0) as u64);
            (start, reset, count)
        })
        .collect();
    let over: Vec<bool> = params
        .iter()
        .zip(&counts)
        .map(|(p, (_, _, count))| needed > 0 && count.saturating_add(counted) > p.tokens_per_unit)
        .collect();
    let admitted = !over.iter().any(|o| *o);
    let after: Vec<u64> = params
        .iter()
        .zip(&counts)
        .map(|(p, (start, _, count))| match give_back {
            Some(n) if cost.gives_back_to(*start, start + p.unit_secs.max(1) * MICROS) => {
                count.saturating_sub(n)
            }
            Some(_) => *count,
            None => count.saturating_add(counted),
        })
        .collect();
    let states = counts
        .iter()
        .zip(&after)
        .map(|((start, _, _), after)| BucketState {
            tokens: *after as f64,
            updated_micros: *start,
        })
        .collect();
    let charge = matches!(cost, Cost::Charge(_));
    let outcomes = params
        .iter()
        .zip(&counts)
        .zip(&over)
        .zip(&after)
        .map(|(((p, (_, reset, _)), over), after)| {
            // a refusal that waiting cannot cure (a limit of 0, a cost
            // above the limit) gets no wait, as every refusal that can
            // never pass
            let never = match *over {
                true if p.tokens_per_unit == 0 => Some(NeverReason::ZeroRate),
                true if counted > p.tokens_per_unit => Some(NeverReason::CostAboveCapacity),
                _ => None,
            };
            BucketOutcome {
                admitted,
                remaining: if *over {
                    0
                } else {
                    p.tokens_per_unit.saturating_sub(*after)
                },
                retry_after_secs: (!admitted && *over && never.is_none()).then_some(*reset),
                full_in_secs: *reset,
                never,
                taken: if admitted || charge { counted } else { 0 },
                forgiven: 0,
                window_count: Some(*after),
            }
        })
        .collect();
    (states, outcomes)
}

/// The calendar period holding `now_micros`: its start and end (µs), from
/// the periods the limiter found (the second once the first has ended); a
/// bucket without them counts in epoch-aligned windows of its unit.
pub fn period_of(params: &BucketParams, now_micros: u64) -> (u64, u64) {
    match params.period {
        Some(p) => p.window_at(now_micros),
        None => {
            let (start, _) = window_of(params, now_micros);
            (start, start + params.unit_secs.max(1) * MICROS)
        }
    }
}

/// Decides `cost` against calendar-period buckets (a budget per period):
/// a hit is admitted when every period's count has room for it, and only
/// an admitted hit counts; a charge (`overdraft`, a usage domain) counts
/// whatever the verdict, past the limit too, and is answered OVER_LIMIT
/// when the count had no room; a refund takes off the count, never below
/// 0 (an attempt's give-back only in the period that counted it); a check counts nothing and answers as a hit of one. A refusal waits,
/// and `duration_until_reset` is, the time until the period ends; a cost
/// above the limit, or a limit of 0, is never admitted (no wait).
pub fn decide_calendar(
    params: &[BucketParams],
    states: &[Option<BucketState>],
    now_micros: u64,
    cost: Cost,
) -> (Vec<BucketState>, Vec<BucketOutcome>) {
    let needed = cost.needed();
    let deducted = cost.deducted();
    let periods: Vec<(u64, u64, u64)> = params
        .iter()
        .zip(states)
        .map(|(p, s)| {
            let (start, end) = period_of(p, now_micros);
            let count = s
                .filter(|s| s.updated_micros == start)
                .map_or(0, |s| s.tokens.max(0.0) as u64);
            (start, end, count)
        })
        .collect();
    let verdicts: Vec<Result<(), Option<NeverReason>>> = params
        .iter()
        .zip(&periods)
        .map(|(p, (_, _, count))| {
            if needed == 0 {
                Ok(())
            } else if p.tokens_per_unit == 0 {
                Err(Some(NeverReason::ZeroRate))
            } else if needed > p.tokens_per_unit {
                Err(Some(NeverReason::CostAboveCapacity))
            } else if count.saturating_add(needed) <= p.tokens_per_unit {
                Ok(())
            } else {
                Err(None)
            }
        })
        .collect();
    let admitted = verdicts.iter().all(Result::is_ok);
    let applies = admitted
        || (matches!(cost, Cost::Charge(_))
            && !verdicts.contains(&Err(Some(NeverReason::ZeroRate))));
    // (an attempt's give-back goes only to the period that counted it)
    let after: Vec<u64> = periods
        .iter()
        .map(|(start, end, count)| match (applies, deducted) {
            (true, d) if d >= 0 => count.saturating_add(d as u64),
            (true, d) if cost.gives_back_to(*start, *end) => count.saturating_sub(d.unsigned_abs()),
            (_, _) => *count,
        })
        .collect();
    let states = periods
        .iter()
        .zip(&after)
        .map(|((start, _, _), count)| BucketState {
            tokens: *count as f64,
            updated_micros: *start,
        })
        .collect();
    let outcomes = params
        .iter()
        .zip(&periods)
        .zip(&after)
        .zip(verdicts)
        .map(|(((p, (_, end, _)), count), verdict)| {
            let left = end.saturating_sub(now_micros).div_ceil(MICROS);
            let (retry_after_secs, never) = match verdict {
                Ok(()) => (None, None),
                Err(Some(reason)) => (None, Some(reason)),
                Err(None) => (Some(left.max(1)), None),
            };
            BucketOutcome {
                admitted,
                remaining: p.tokens_per_unit.saturating_sub(*count),
                retry_after_secs,
                full_in_secs: left,
                never,
                taken: if applies { deducted.max(0) as u64 } else { 0 },
                forgiven: 0,
                window_count: None,
            }
        })
        .collect();
    (states, outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = MICROS;

    fn p(limit: u64, window_secs: u64) -> BucketParams {
        BucketParams {
            capacity: limit,
            tokens_per_unit: limit,
            unit_secs: window_secs,
            max_debt: None,
            algorithm: Algorithm::FixedWindow,
            period: None,
        }
    }

    /// Decides `cost` on one bucket at `now`, carrying the state along.
    fn one(
        params: BucketParams,
        state: &mut Option<BucketState>,
        now: u64,
        cost: Cost,
    ) -> BucketOutcome {
        let (states, outcomes) = decide(&[params], &[*state], now, cost);
        *state = Some(states[0]);
        outcomes[0]
    }

    #[test]
    fn a_give_back_goes_to_the_window_that_counted_it_and_a_charge_counts_past_the_limit() {
        let q = p(10, 60);
        let t = 1_000_000_020 * SEC;
        let mut s = None;
        one(q, &mut s, t, Cost::Spend(6));
        let back = |at: u64| Cost::GiveBack {
            tokens: 5,
            taken_micros: at,
        };
        let o = one(q, &mut s, t + 30 * SEC, back(t));
        assert_eq!((o.admitted, o.remaining), (true, 9), "its own window");
        // a charge (`overdraft`) counts past the limit, answered over
        let o = one(q, &mut s, t + 31 * SEC, Cost::Charge(12));
        assert_eq!((o.admitted, o.remaining, o.taken), (false, 0, 12));
        // a give-back is answered OK even over the limit
        assert!(one(q, &mut s, t + 32 * SEC, back(t)).admitted);
        assert_eq!(s.map(|s| s.tokens), Some(8.0));
        // in the window after, what the one before counted is not given
        let next = t + 60 * SEC;
        one(q, &mut s, next, Cost::Spend(4));
        let o = one(q, &mut s, next + SEC, back(t + 59 * SEC));
        assert_eq!((o.admitted, o.remaining), (true, 6));
        // a plain refund gives nothing to a window (every hit counts),
        // and is answered OK
        one(q, &mut s, next + SEC, Cost::Spend(7));
        let o = one(q, &mut s, next + 2 * SEC, Cost::Refund(3));
        assert_eq!((o.admitted, o.remaining), (true, 0));
    }

    #[test]
    fn a_calendar_give_back_goes_only_to_the_period_that_counted_it() {
        let mut q = p(100, 60);
        q.algorithm = Algorithm::CalendarWindow;
        let t = 1_000_000_020 * SEC;
        let mut s = None;
        let (states, _) = decide(&[q], &[s], t, Cost::Spend(60));
        s = Some(states[0]);
        let back = Cost::GiveBack {
            tokens: 50,
            taken_micros: t,
        };
        let (states, o) = decide(&[q], &[s], t + SEC, back);
        assert_eq!(o[0].remaining, 90);
        s = Some(states[0]);
        let next = t + 60 * SEC;
        let (states, _) = decide(&[q], &[s], next, Cost::Spend(30));
        let (_, o) = decide(&[q], &[Some(states[0])], next + SEC, back);
        assert_eq!(o[0].remaining, 70, "not given to the period after");
    }

    #[test]
    fn windows_are_aligned_to_the_epoch() {
        // 1,000,000,037 s: 17 s into its minute (which began at ...020)
        let now = 1_000_000_037 * SEC + 500_000;
        assert_eq!(window_of(&p(3, 60), now), (1_000_000_020 * SEC, 43));
        assert_eq!(window_of(&p(3, 1), now), (1_000_000_037 * SEC, 1));
        // the last microsecond of a window still belongs to it
        assert_eq!(window_of(&p(3, 60), 1_000_000_079 * SEC + 999_999).1, 1);
        assert_eq!(window_of(&p(3, 60), 1_000_000_080 * SEC).1, 60);
    }

    #[test]
    fn every_hit_counts_and_the_wait_is_the_window_end() {
        let w = p(3, 60);
        let t = 6_000 * SEC + 15 * SEC;
        let mut s = None;
        let remaining: Vec<u64> = (0..3)
            .map(|_| one(w, &mut s, t, Cost::Spend(1)).remaining)
            .collect();
        assert_eq!(remaining, [2, 1, 0]);
        let over = one(w, &mut s, t, Cost::Spend(1));
        assert!(!over.admitted);
        assert_eq!(
            (over.remaining, over.retry_after_secs, over.full_in_secs),
            (0, Some(45), 45)
        );
        // the refused hit counted too
        assert_eq!(s.map(|s| s.tokens), Some(4.0));
        // the next window starts from nothing
        let next = one(w, &mut s, t + 45 * SEC, Cost::Spend(1));
        assert!(next.admitted);
        assert_eq!((next.remaining, next.full_in_secs), (2, 60));
    }

    #[test]
    fn a_weighted_hit_is_over_when_the_count_after_it_is() {
        let w = p(10, 60);
        let mut s = None;
        assert!(one(w, &mut s, 60 * SEC, Cost::Spend(7)).admitted);
        let over = one(w, &mut s, 60 * SEC, Cost::Spend(4));
        assert!(!over.admitted);
        assert_eq!(over.remaining, 0);
        assert_eq!(s.map(|s| s.tokens), Some(11.0));
        // a check counts nothing, and is over only when the count is
        let mut fresh = None;
        let check = one(w, &mut fresh, 60 * SEC, Cost::Check);
        assert!(check.admitted);
        assert_eq!((check.remaining, fresh.map(|s| s.tokens)), (10, Some(0.0)));
        let mut full = Some(BucketState {
            tokens: 10.0,
            updated_micros: 60 * SEC,
        });
        assert!(
            one(w, &mut full, 60 * SEC, Cost::Check).admitted,
            "at the limit"
        );
        assert!(!one(w, &mut s, 60 * SEC, Cost::Check).admitted, "past it");
    }

    /// The scenarios of envoyproxy/ratelimit's own fixed-window tests
    /// (`test/redis/fixed_cache_impl_test.go`: TestRedis, TestNearLimit and
    /// its hits_addend cases): at its mocked Unix time, a limit per unit,
    /// the hits, and the count its `INCRBY` returned; the same code,
    /// `limit_remaining` and `duration_until_reset` here.
    #[test]
    fn answers_as_envoyproxy_ratelimits_own_tests() {
        // (now s, limit, unit s, hits, count after, over, remaining, reset s)
        type Scenario = (u64, u64, u64, u64, u64, bool, u64, u64);
        let scenarios: [Scenario; 15] = [
            (1234, 10, 1, 1, 5, false, 5, 1),
            (1234, 10, 60, 1, 11, true, 0, 26),
            (1_000_000, 10, 3600, 0, 11, true, 0, 800),
            (1_000_000, 10, 86_400, 1, 13, true, 0, 36_800),
            (1_000_000, 15, 3600, 1, 11, false, 4, 800),
            (1_000_000, 15, 3600, 1, 13, false, 2, 800),
            (1_000_000, 15, 3600, 1, 16, true, 0, 800),
            (1234, 20, 1, 3, 5, false, 15, 1),
            (1234, 8, 1, 2, 7, false, 1, 1),
            (1234, 20, 1, 3, 19, false, 1, 1),
            (1234, 20, 1, 3, 22, true, 0, 1),
            (1234, 20, 1, 7, 22, true, 0, 1),
            (1234, 10, 1, 3, 30, true, 0, 1),
            (1_000_000, 15, 3600, 2, 13, false, 2, 800),
            (1_000_000, 14, 3600, 2, 15, true, 0, 800),
        ];
        for (now, limit, unit, hits, after, over, remaining, reset) in scenarios {
            let w = p(limit, unit);
            let (start, _) = window_of(&w, now * SEC);
            let mut state = Some(BucketState {
                tokens: (after - hits) as f64,
                updated_micros: start,
            });
            let cost = if hits == 0 {
                Cost::Check
            } else {
                Cost::Spend(hits)
            };
            let o = one(w, &mut state, now * SEC, cost);
            let case = (now, limit, unit, hits, after);
            assert_eq!(o.admitted, !over, "{case:?}");
            assert_eq!(o.remaining, remaining, "{case:?}");
            assert_eq!(o.full_in_secs, reset, "{case:?}: duration_until_reset");
            assert_eq!(
                state.map(|s| s.tokens),
                Some(after as f64),
                "{case:?}: the count"
            );
        }
    }

    #[test]
    fn several_limits_each_count_the_hit() {
        let (short, long) = (p(1, 60), p(5, 3600));
        let mut states = vec![None, None];
        let mut decide_both = |now| {
            let (next, outcomes) = decide(&[short, long], &states, now, Cost::Spend(1));
            states = next.into_iter().map(Some).collect();
            outcomes
        };
        assert!(decide_both(3600 * SEC)[0].admitted);
        let refused = decide_both(3600 * SEC + SEC);
        assert!(!refused[0].admitted);
        assert_eq!(refused[0].retry_after_secs, Some(59));
        assert_eq!(refused[1].retry_after_secs, None, "the long one is within");
        // refused by the short one, counted by the long one all the same
        assert_eq!(refused[1].remaining, 3);
    }

    #[test]
    fn a_limit_of_zero_never_admits_and_time_back_counts_as_another_window() {
        let mut s = None;
        let o = one(p(0, 60), &mut s, 120 * SEC + 10 * SEC, Cost::Spend(1));
        assert!(!o.admitted);
        // waiting cannot cure it: no wait (issue 52), as every refusal
        // that can never pass; the window still resets in 50 s
        assert_eq!(o.retry_after_secs, None);
        assert_eq!(o.never, Some(NeverReason::ZeroRate));
        assert_eq!(o.full_in_secs, 50);
        // a cost above the limit, likewise
        let o = one(p(3, 60), &mut None, 130 * SEC, Cost::Spend(4));
        assert_eq!(
            (o.retry_after_secs, o.never),
            (None, Some(NeverReason::CostAboveCapacity))
        );
        // a clock stepped back into an earlier window: that window's count
        // is not the stored one, so it starts from nothing (as
        // envoyproxy/ratelimit, whose key names the window)
        let w = p(1, 60);
        let mut s = None;
        assert!(one(w, &mut s, 600 * SEC, Cost::Spend(1)).admitted);
        assert!(one(w, &mut s, 540 * SEC, Cost::Spend(1)).admitted);
        assert_eq!(w.full_at_micros(&s.expect("state")), Some(600 * SEC));
    }

    /// A calendar period's bucket: `limit` a period, the periods given.
    fn cal(limit: u64, start: i64, end: i64, next_end: i64) -> BucketParams {
        BucketParams {
            algorithm: Algorithm::CalendarWindow,
            period: Some(crate::calendar::Periods {
                start,
                end,
                next_end,
            }),
            ..p(limit, 30 * 86_400)
        }
    }

    #[test]
    fn a_calendar_period_counts_admitted_hits_until_it_ends() {
        // a period of 23 hours (a daylight-saving day), then one of 24
        let (start, end, next) = (86_400, 86_400 + 23 * 3600, 86_400 + 47 * 3600);
        let c = cal(3, start, end, next);
        let mut s = None;
        let t = (start as u64 + 3600) * SEC;
        let remaining: Vec<u64> = (0..3)
            .map(|_| one(c, &mut s, t, Cost::Spend(1)).remaining)
            .collect();
        assert_eq!(remaining, [2, 1, 0]);
        let over = one(c, &mut s, t, Cost::Spend(1));
        assert!(!over.admitted);
        assert_eq!(over.retry_after_secs, Some(22 * 3600));
        assert_eq!(over.full_in_secs, 22 * 3600);
        // a refused hit counts nothing (a budget), a weighted one that does
        // not fit neither
        assert_eq!(s.map(|s| s.tokens), Some(3.0));
        // the last microsecond of the period is in it
        let last = end as u64 * SEC - 1;
        let at_last = one(c, &mut s, last, Cost::Spend(1));
        assert!(!at_last.admitted);
        assert_eq!(at_last.retry_after_secs, Some(1));
        // and at its end the next period starts from nothing
        let next_period = one(c, &mut s, end as u64 * SEC, Cost::Spend(1));
        assert!(next_period.admitted);
        assert_eq!(
            (next_period.remaining, next_period.full_in_secs),
            (2, 24 * 3600)
        );
        assert_eq!(s.map(|s| s.updated_micros), Some(end as u64 * SEC));
        assert_eq!(
            c.full_at_micros(&s.expect("state")),
            Some(next as u64 * SEC)
        );
    }

    #[test]
    fn a_calendar_period_counts_charges_past_its_limit_and_takes_refunds_off() {
        let c = cal(1_000, 0, 1_000, 2_000);
        let mut s = None;
        let t = 10 * SEC;
        // a charge (usage) counts whatever the verdict
        assert!(one(c, &mut s, t, Cost::Charge(900)).admitted);
        let over = one(c, &mut s, t, Cost::Charge(300));
        assert!(!over.admitted);
        assert_eq!((over.taken, over.remaining), (300, 0));
        assert_eq!(s.map(|s| s.tokens), Some(1_200.0));
        // checks are refused until the period ends
        let check = one(c, &mut s, t, Cost::Check);
        assert_eq!((check.admitted, check.retry_after_secs), (false, Some(990)));
        // a refund takes off the count
        let refund = one(c, &mut s, t, Cost::Refund(500));
        assert!(refund.admitted);
        assert_eq!(refund.remaining, 300);
        one(c, &mut s, t, Cost::Refund(5_000));
        assert_eq!(s.map(|s| s.tokens), Some(0.0), "never below nothing");
    }

    #[test]
    fn a_calendar_period_says_what_it_can_never_admit() {
        let mut s = None;
        let above = one(cal(10, 0, 1_000, 2_000), &mut s, SEC, Cost::Spend(11));
        assert_eq!(
            (above.admitted, above.never, above.retry_after_secs),
            (
                false,
                Some(crate::bucket::NeverReason::CostAboveCapacity),
                None
            )
        );
        let zero = one(cal(0, 0, 1_000, 2_000), &mut s, SEC, Cost::Charge(1));
        assert_eq!(zero.never, Some(crate::bucket::NeverReason::ZeroRate));
        assert_eq!(zero.taken, 0, "no charge on a limit of 0");
    }

    #[test]
    fn a_store_clock_behind_or_ahead_of_the_periods_counts_in_the_right_one() {
        let c = cal(2, 100, 200, 300);
        // behind (before the first period started): counted in the first
        let mut s = None;
        one(c, &mut s, 90 * SEC, Cost::Spend(1));
        assert_eq!(s.map(|s| s.updated_micros), Some(100 * SEC));
        // ahead (past the first's end): in the second
        let mut s = None;
        let o = one(c, &mut s, 250 * SEC, Cost::Spend(1));
        assert_eq!(s.map(|s| s.updated_micros), Some(200 * SEC));
        assert_eq!(o.full_in_secs, 50);
    }
}
