//! Property tests: the token bucket against the simplest model of what it
//! promises, and the store key encoding against collisions.

use std::collections::HashMap;

use proptest::prelude::*;
use tokenbucket_rls::bucket::{decide, BucketParams, BucketState, Cost};
use tokenbucket_rls::limiter::key::{bucket_key, descriptor_tag, KeyOrigin};
use tokenbucket_rls::rules::BucketValue;

const SEC: u64 = 1_000_000;

fn params() -> impl Strategy<Value = BucketParams> {
    (
        1u64..=1_000,
        0u64..=1_000,
        prop::sample::select(vec![1u64, 60, 3_600, 86_400]),
    )
        .prop_map(|(capacity, tokens_per_unit, unit_secs)| BucketParams {
            capacity,
            tokens_per_unit,
            unit_secs,
            max_debt: None,
            algorithm: Default::default(),
            period: None,
        })
}

/// A step: time moves by `dt` µs (negative: the clock went back), then a request of `cost`.
fn steps() -> impl Strategy<Value = Vec<(i64, u64)>> {
    prop::collection::vec((-5 * SEC as i64..=20 * SEC as i64, 0u64..=50), 1..200)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// Whatever the sequence of time steps and costs:
    /// - admitted tokens never exceed B + r·t (t = the clock's forward progress);
    /// - tokens stay within [0, B];
    /// - a clock going backwards never adds tokens;
    /// - a rejection changes nothing the next decision can see.
    #[test]
    fn the_bucket_never_grants_more_than_burst_plus_rate_times_time(p in params(), steps in steps()) {
        let mut now = 1_000 * SEC;
        // A bucket with no stored state is a full one at any time; it is born
        // at the first admission (the first write). t counts from then to the
        // furthest the clock has gone.
        let mut born: Option<u64> = None;
        let mut furthest = 0;
        let mut state: Option<BucketState> = None;
        let mut admitted: u64 = 0;
        for (dt, cost) in steps {
            now = (now as i64 + dt).max(0) as u64;
            let before = state.map(|s| p.refill(Some(s), now).tokens);
            let (states, outcomes) = decide(&[p], &[state], now, Cost::Spend(cost));
            let after = states[0];
            prop_assert!(after.tokens >= -1e-9 && after.tokens <= p.capacity as f64 + 1e-9, "tokens {}", after.tokens);
            if let (Some(prev), Some(b)) = (state, before) {
                if now < prev.updated_micros {
                    prop_assert!(b <= prev.tokens + 1e-9, "the clock went back and tokens grew");
                }
            }
            if outcomes[0].admitted {
                admitted += cost;
                state = Some(after);
                born.get_or_insert(now);
            } else {
                prop_assert!(outcomes[0].remaining <= p.capacity);
                // stores write nothing on a rejection; neither does the model
            }
            let Some(start) = born else { continue };
            furthest = furthest.max(now).max(start);
            let elapsed_secs = (furthest - start) as f64 / SEC as f64;
            let bound = p.capacity as f64 + p.rate_per_sec() * elapsed_secs;
            prop_assert!(admitted as f64 <= bound + 1e-6, "admitted {admitted} > B + r·t = {bound}");
        }
    }

    /// Retry-After is honest: waiting that long makes the same request pass.
    #[test]
    fn waiting_retry_after_is_enough(p in params(), spent in 0u64..=1_000, share in 0.0f64..=1.0) {
        prop_assume!(p.tokens_per_unit > 0);
        let cost = ((p.capacity as f64 * share).ceil() as u64).clamp(1, p.capacity);
        let now = 1_000 * SEC;
        let state = Some(BucketState { tokens: (p.capacity.saturating_sub(spent)) as f64, updated_micros: now });
        let (_, outcomes) = decide(&[p], &[state], now, Cost::Spend(cost));
        if let Some(wait) = outcomes[0].retry_after_secs {
            let (_, later) = decide(&[p], &[state], now + wait * SEC, Cost::Spend(cost));
            prop_assert!(later[0].admitted, "still rejected after Retry-After {wait}s");
            if wait > 1 {
                let (_, sooner) = decide(&[p], &[state], now + (wait - 1) * SEC, Cost::Spend(cost));
                prop_assert!(!sooner[0].admitted, "Retry-After {wait}s was a second too long");
            }
        }
    }

    /// A sliding window (#41), whatever the steps and costs: the current
    /// window's count never passes the limit (so no aligned window admits
    /// more), a refusal changes nothing, and its Retry-After is honest:
    /// the same hit passes after it, and not a second sooner.
    #[test]
    fn a_sliding_window_holds_its_limit_and_its_waits(
        limit in 1u64..=200,
        unit_secs in prop::sample::select(vec![1u64, 10, 60, 3_600]),
        steps in steps(),
    ) {
        use tokenbucket_rls::bucket::Algorithm;
        use tokenbucket_rls::window::sliding;
        let p = BucketParams {
            capacity: limit,
            tokens_per_unit: limit,
            unit_secs,
            max_debt: None,
            algorithm: Algorithm::SlidingWindow,
            period: None,
        };
        let mut now = 1_000 * SEC;
        let mut state: Option<BucketState> = None;
        let mut in_window: HashMap<u64, u64> = HashMap::new();
        for (dt, cost) in steps {
            now = now.saturating_add_signed(dt.max(0));
            let cost = cost.clamp(1, limit);
            let (states, outcomes) = sliding::decide(&[p], &[state], now, Cost::Spend(cost));
            let o = outcomes[0];
            if o.admitted {
                state = Some(states[0]);
                *in_window.entry(now / (unit_secs * SEC)).or_default() += cost;
                let (_, current) = states[0].window_counts();
                prop_assert!(current <= limit as f64, "current count {current} over {limit}");
            } else {
                let wait = o.retry_after_secs.expect("a wait: the cost fits the limit");
                let (_, later) = sliding::decide(&[p], &[state], now + wait * SEC, Cost::Spend(cost));
                prop_assert!(later[0].admitted, "still refused after Retry-After {wait}s");
                if wait > 1 {
                    let (_, sooner) = sliding::decide(&[p], &[state], now + (wait - 1) * SEC, Cost::Spend(cost));
                    prop_assert!(!sooner[0].admitted, "Retry-After {wait}s was a second too long");
                }
            }
        }
        for (window, n) in in_window {
            prop_assert!(n <= limit, "{n} admitted in window {window} of a limit of {limit}");
        }
    }

    /// A calendar period (#41) admits at most its limit of hits, however
    /// they come, and starts again from nothing in the next period.
    #[test]
    fn a_calendar_period_admits_at_most_its_limit(
        limit in 0u64..=100,
        costs in prop::collection::vec(0u64..=30, 1..100),
    ) {
        use tokenbucket_rls::bucket::Algorithm;
        use tokenbucket_rls::calendar::Periods;
        let p = BucketParams {
            capacity: limit,
            tokens_per_unit: limit,
            unit_secs: 86_400,
            max_debt: None,
            algorithm: Algorithm::CalendarWindow,
            period: Some(Periods { start: 1_000, end: 1_000 + 82_800, next_end: 1_000 + 82_800 + 86_400 }),
        };
        let mut state: Option<BucketState> = None;
        let mut admitted = 0;
        let first_period = 2_000 * SEC;
        for cost in &costs {
            let (states, outcomes) = tokenbucket_rls::window::decide(&[p], &[state], first_period, Cost::Spend(*cost));
            if outcomes[0].admitted {
                admitted += cost;
                state = Some(states[0]);
            }
        }
        prop_assert!(admitted <= limit, "{admitted} admitted of {limit}");
        let next_period = (1_000 + 82_800) * SEC;
        let (_, fresh) = tokenbucket_rls::window::decide(&[p], &[state], next_period, Cost::Spend(limit.max(1)));
        prop_assert_eq!(fresh[0].admitted, limit > 0, "the next period starts from nothing");
    }

    /// Distinct descriptor paths never share a store key, whatever bytes they hold.
    #[test]
    fn distinct_descriptors_never_share_a_key(
        paths in prop::collection::vec(
            (
                "[a-z_:{}#]{0,4}",
                prop::collection::vec(("[a-z_:{}#\\x00-\\x02é]{0,4}", "[a-z_:{}#*\\x00-\\x02é]{0,4}", any::<bool>()), 0..4),
                "[a-z0-9#]{0,3}",
            ),
            2..40,
        )
    ) {
        let mut seen: HashMap<Vec<u8>, String> = HashMap::new();
        for (domain, entries, id) in &paths {
            let identity = format!("{domain:?}|{entries:?}|{id:?}");
            let tag = descriptor_tag(
                KeyOrigin::Rule,
                domain,
                entries.iter().map(|(k, v, shared)| {
                    (k.as_str(), if *shared { BucketValue::Shared(v) } else { BucketValue::Value(v) })
                }),
            );
            let key = bucket_key(&tag, id);
            if let Some(other) = seen.insert(key, identity.clone()) {
                prop_assert_eq!(other, identity, "two descriptors, one key");
            }
        }
    }
}
