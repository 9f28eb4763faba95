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
//! admitted when every one is within its limit.
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

use crate::bucket::{BucketOutcome, BucketParams, BucketState, Cost};

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
/// outcome per bucket.
pub fn decide(
    params: &[BucketParams],
    states: &[Option<BucketState>],
    now_micros: u64,
    cost: Cost,
) -> (Vec<BucketState>, Vec<BucketOutcome>) {
    // a check (`hits_addend: 0`) counts nothing, and is over when the
    // count already is: envoyproxy/ratelimit's `INCRBY key 0`
    let counted = cost.deducted().max(0) as u64;
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
        .map(|(p, (_, _, count))| count.saturating_add(counted) > p.tokens_per_unit)
        .collect();
    let admitted = !over.iter().any(|o| *o);
    let states = counts
        .iter()
        .map(|(start, _, count)| BucketState {
            tokens: count.saturating_add(counted) as f64,
            updated_micros: *start,
        })
        .collect();
    let outcomes = params
        .iter()
        .zip(&counts)
        .zip(&over)
        .map(|((p, (_, reset, count)), over)| BucketOutcome {
            admitted,
            remaining: if *over {
                0
            } else {
                p.tokens_per_unit - count.saturating_add(counted)
            },
            retry_after_secs: (!admitted && *over).then_some(*reset),
            full_in_secs: *reset,
            never: None,
            taken: if admitted { counted } else { 0 },
            forgiven: 0,
        })
        .collect();
    (states, outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::Algorithm;

    const SEC: u64 = MICROS;

    fn p(limit: u64, window_secs: u64) -> BucketParams {
        BucketParams {
            capacity: limit,
            tokens_per_unit: limit,
            unit_secs: window_secs,
            max_debt: None,
            algorithm: Algorithm::FixedWindow,
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
    fn a_limit_of_zero_refuses_until_the_window_ends_and_time_back_counts_as_another_window() {
        let mut s = None;
        let o = one(p(0, 60), &mut s, 120 * SEC + 10 * SEC, Cost::Spend(1));
        assert!(!o.admitted);
        assert_eq!(o.retry_after_secs, Some(50));
        // a clock stepped back into an earlier window: that window's count
        // is not the stored one, so it starts from nothing (as
        // envoyproxy/ratelimit, whose key names the window)
        let w = p(1, 60);
        let mut s = None;
        assert!(one(w, &mut s, 600 * SEC, Cost::Spend(1)).admitted);
        assert!(one(w, &mut s, 540 * SEC, Cost::Spend(1)).admitted);
        assert_eq!(w.full_at_micros(&s.expect("state")), Some(600 * SEC));
    }
}
