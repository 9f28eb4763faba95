use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;

use super::*;
use crate::quota::allocation::Budget;
use crate::quota::token_bucket;

const S: u64 = 1_000_000;
/// B = 90, 30 a second.
const RULE: BucketParams = BucketParams {
    capacity: 90,
    tokens_per_unit: 30,
    unit_secs: 1,
    max_debt: None,
    algorithm: crate::bucket::Algorithm::TokenBucket,
    period: None,
};

fn id(pairs: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

fn assign(pairs: &[(&str, &str)], strategy: Strategy, ttl_secs: i64) -> BucketAction {
    BucketAction {
        bucket_id: Some(id(pairs)),
        bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(
            bucket_action::QuotaAssignmentAction {
                assignment_time_to_live: Some(PbDuration {
                    seconds: ttl_secs,
                    nanos: 0,
                }),
                rate_limit_strategy: Some(envoy_types::pb::envoy::r#type::v3::RateLimitStrategy {
                    strategy: Some(strategy),
                }),
            },
        )),
    }
}

fn limit(shares: &RegionShares, mode: FailureMode, now: u64) -> RegionLimit {
    shares.limit(
        "d",
        b"tag-a",
        [("api_key", "a"), ("path", "/x")].into_iter(),
        RULE,
        mode,
        now,
    )
}

#[test]
fn the_floor_is_b_over_n_and_r_over_n() {
    let f = floor(RULE, 3);
    assert_eq!(f.capacity, 30);
    // 30 tokens every 3 s: 10 a second
    assert_eq!((f.tokens_per_unit, f.unit_secs), (30, 3));
    // never below one token
    assert_eq!(
        floor(
            BucketParams {
                capacity: 2,
                ..RULE
            },
            3
        )
        .capacity,
        1
    );
}

#[test]
fn without_a_share_a_bucket_is_decided_at_the_floor_or_by_its_failure_mode() {
    let shares = RegionShares::new(3);
    let f = RegionLimit::Floor(floor(RULE, 3));
    // reachable: the floor the global tier keeps for a region not in its split
    shares.set_reachable(true);
    for mode in [FailureMode::Local, FailureMode::Closed, FailureMode::Open] {
        assert_eq!(limit(&shares, mode, S), f);
    }
    // cut off: the rule's failure mode for the global budget
    shares.set_reachable(false);
    assert_eq!(limit(&shares, FailureMode::Local, S), f);
    assert_eq!(limit(&shares, FailureMode::Closed, S), RegionLimit::Closed);
    assert_eq!(limit(&shares, FailureMode::Open, S), RegionLimit::Open);
}

#[test]
fn an_assignment_is_kept_until_it_expires_even_when_cut_off() {
    let shares = RegionShares::new(3);
    shares.set_reachable(true);
    limit(&shares, FailureMode::Closed, S);
    let share = token_bucket(Budget {
        burst: 60.0,
        rate: 20.0,
    });
    // the id in another order than the descriptor's: the same bucket
    let taken = shares.apply(
        "d",
        &[assign(&[("path", "/x"), ("api_key", "a")], share, 3)],
        2 * S,
    );
    assert_eq!(taken, 1);
    assert_eq!(shares.since_last_assignment(3 * S), Some(S));
    let assigned = RegionLimit::Share(BucketParams {
        capacity: 60,
        tokens_per_unit: 20,
        unit_secs: 1,
        max_debt: None,
        algorithm: Default::default(),
        period: None,
    });
    // one decision settles at the floor (the share grew past it), then
    // the share
    assert_eq!(
        limit(&shares, FailureMode::Closed, 3 * S),
        RegionLimit::Share(floor(RULE, 3))
    );
    shares.record(b"tag-a", true);
    assert_eq!(limit(&shares, FailureMode::Closed, 3 * S), assigned);
    shares.set_reachable(false);
    assert_eq!(limit(&shares, FailureMode::Closed, 5 * S - 1), assigned);
    // expired while cut off: the failure mode
    assert_eq!(
        limit(&shares, FailureMode::Closed, 5 * S),
        RegionLimit::Closed
    );
    // an id this region does not hold, or another domain's, is passed over
    let share = token_bucket(Budget {
        burst: 60.0,
        rate: 20.0,
    });
    assert_eq!(
        shares.apply("d", &[assign(&[("api_key", "b")], share, 3)], 6 * S),
        0
    );
    let share = token_bucket(Budget {
        burst: 60.0,
        rate: 20.0,
    });
    assert_eq!(
        shares.apply(
            "other",
            &[assign(&[("api_key", "a"), ("path", "/x")], share, 3)],
            6 * S
        ),
        0
    );
}

#[test]
fn deny_all_admits_nothing_and_abandon_drops_the_share() {
    let shares = RegionShares::new(2);
    shares.set_reachable(true);
    limit(&shares, FailureMode::Local, S);
    let pairs = [("api_key", "a"), ("path", "/x")];
    shares.apply(
        "d",
        &[assign(
            &pairs,
            Strategy::BlanketRule(BlanketRule::DenyAll as i32),
            10,
        )],
        S,
    );
    let RegionLimit::Share(p) = limit(&shares, FailureMode::Local, 2 * S) else {
        panic!("a share")
    };
    assert_eq!(p.capacity, 0);
    // ALLOW_ALL (no limit upstream): no share, the floor
    shares.apply(
        "d",
        &[assign(
            &pairs,
            Strategy::BlanketRule(BlanketRule::AllowAll as i32),
            10,
        )],
        2 * S,
    );
    assert_eq!(
        limit(&shares, FailureMode::Local, 2 * S),
        RegionLimit::Floor(floor(RULE, 2))
    );
    shares.apply(
        "d",
        &[assign(
            &pairs,
            token_bucket(Budget {
                burst: 5.0,
                rate: 1.0,
            }),
            10,
        )],
        3 * S,
    );
    shares.apply(
        "d",
        &[BucketAction {
            bucket_id: Some(id(&pairs)),
            bucket_action: Some(bucket_action::BucketAction::AbandonAction(
                bucket_action::AbandonAction {},
            )),
        }],
        4 * S,
    );
    assert_eq!(
        limit(&shares, FailureMode::Local, 4 * S),
        RegionLimit::Floor(floor(RULE, 2))
    );
}

#[test]
fn reports_carry_the_demand_since_the_last_and_idle_buckets_go() {
    let shares = RegionShares::new(3);
    shares.set_reachable(true);
    limit(&shares, FailureMode::Local, S);
    for admitted in [true, true, false] {
        shares.record(b"tag-a", admitted);
    }
    let reports = shares.take_reports(2 * S);
    let usage = &reports["d"][0];
    assert_eq!(
        (usage.num_requests_allowed, usage.num_requests_denied),
        (2, 1)
    );
    assert_eq!(usage.bucket_id.as_ref().map(|b| b.bucket.len()), Some(2));
    // counted afresh; active recently: reported with none
    let reports = shares.take_reports(3 * S);
    let usage = &reports["d"][0];
    assert_eq!(
        (usage.num_requests_allowed, usage.num_requests_denied),
        (0, 0)
    );
    assert_eq!(usage.time_elapsed.as_ref().map(|d| d.seconds), Some(1));
    // a live share keeps an idle bucket
    let share = token_bucket(Budget {
        burst: 30.0,
        rate: 10.0,
    });
    shares.apply(
        "d",
        &[assign(&[("api_key", "a"), ("path", "/x")], share, 60)],
        3 * S,
    );
    assert!(shares.take_reports(S + IDLE_MICROS).is_empty());
    assert_eq!(shares.len(), 1);
    // idle and no live share: forgotten, not reported
    assert!(shares.take_reports(3 * S + 60 * S).is_empty());
    assert_eq!(shares.len(), 0);
}

#[test]
fn state_is_bounded_and_past_the_bound_requests_get_the_floor_unreported() {
    let shares = RegionShares::new(4);
    shares.set_reachable(true);
    for i in 0..MAX_BUCKETS {
        let tag = format!("t{i}");
        let v = i.to_string();
        shares.limit(
            "d",
            tag.as_bytes(),
            [("k", v.as_str())].into_iter(),
            RULE,
            FailureMode::Closed,
            S,
        );
    }
    shares.set_reachable(false);
    let over = shares.limit(
        "d",
        b"new",
        [("k", "new")].into_iter(),
        RULE,
        FailureMode::Closed,
        S,
    );
    assert_eq!(over, RegionLimit::Floor(floor(RULE, 4)));
    assert_eq!(shares.len(), MAX_BUCKETS);
    assert_eq!(shares.take_over_bound(), 1);
}

/// A global tier (or anything answering as one) that grants a million a
/// second for ten years: the share is cut to the rule's B and r, and held
/// no longer than the longest time to live a global tier sends; each cut
/// counted. Before, the region took it as it came: 300 of 300 admitted,
/// and a `closed` rule admitted everything long after the tier vanished.
#[test]
fn an_assignment_beyond_the_rule_or_the_longest_ttl_is_cut() {
    let shares = RegionShares::new(2);
    let now = 1_000 * S;
    limit(&shares, FailureMode::Closed, now);
    let huge = token_bucket(Budget {
        burst: 1_000_000.0,
        rate: 1_000_000.0,
    });
    let ten_years = 10 * 365 * 24 * 3600;
    let taken = shares.apply(
        "d",
        &[assign(&[("api_key", "a"), ("path", "/x")], huge, ten_years)],
        now,
    );
    assert_eq!(taken, 1);
    // (decisions settle at the floor until one is admitted)
    limit(&shares, FailureMode::Closed, now + S);
    shares.record(b"tag-a", true);
    assert_eq!(
        limit(&shares, FailureMode::Closed, now + S),
        RegionLimit::Share(RULE),
        "the rule's own B and r at most"
    );
    assert_eq!(
        shares.take_clamped(),
        Clamped {
            burst: 1,
            rate: 1,
            ttl: 1
        }
    );
    assert_eq!(shares.take_clamped(), Clamped::default(), "taken once");
    // the global tier vanished: the share lapses after the longest TTL
    shares.set_reachable(false);
    assert_eq!(
        limit(&shares, FailureMode::Closed, now + MAX_SHARE_TTL_MICROS - 1),
        RegionLimit::Share(RULE)
    );
    assert_eq!(
        limit(&shares, FailureMode::Closed, now + MAX_SHARE_TTL_MICROS + 1),
        RegionLimit::Closed
    );
    // a share within the rule is taken as it is, slower rates included
    let within = BucketParams {
        capacity: 20,
        tokens_per_unit: 100,
        unit_secs: 10,
        max_debt: None,
        algorithm: Default::default(),
        period: None,
    };
    let strategy = Strategy::TokenBucket(envoy_types::pb::envoy::r#type::v3::TokenBucket {
        max_tokens: 20,
        tokens_per_fill: Some(envoy_types::pb::google::protobuf::UInt32Value { value: 100 }),
        fill_interval: Some(PbDuration {
            seconds: 10,
            nanos: 0,
        }),
    });
    let later = now + 2 * MAX_SHARE_TTL_MICROS;
    shares.apply(
        "d",
        &[assign(&[("api_key", "a"), ("path", "/x")], strategy, 5)],
        later,
    );
    assert_eq!(
        limit(&shares, FailureMode::Closed, later + S),
        RegionLimit::Share(within)
    );
    assert_eq!(shares.take_clamped(), Clamped::default());
}

/// An answer from the global tier means it took this region's stream:
/// reachable again, even after a refusal left it unreachable.
#[test]
fn an_assignment_makes_the_global_tier_reachable() {
    let shares = RegionShares::new(2);
    shares.set_reachable(false);
    shares.apply("d", &[], 5 * S);
    assert!(shares.reachable());
}

/// A share that grows is given to one decision at the numbers before it:
/// that decision refills the time since the last one at the old rate, so
/// the time before the growth is never credited at the new rate (before:
/// a bucket idle for a while refilled at the new rate from its last
/// decision, up to the new burst). Then the new numbers.
#[test]
fn a_share_that_grows_settles_once_at_the_numbers_before_it() {
    let shares = RegionShares::new(2);
    shares.set_reachable(true);
    let pairs = [("api_key", "a"), ("path", "/x")];
    let small = BucketParams {
        capacity: 10,
        tokens_per_unit: 5,
        unit_secs: 1,
        max_debt: None,
        algorithm: Default::default(),
        period: None,
    };
    let big = BucketParams {
        capacity: 40,
        tokens_per_unit: 20,
        unit_secs: 1,
        max_debt: None,
        algorithm: Default::default(),
        period: None,
    };
    let strategy = |p: BucketParams| {
        token_bucket(Budget {
            burst: p.capacity as f64,
            rate: p.tokens_per_unit as f64,
        })
    };
    let floor_of = floor(RULE, 2);
    assert_eq!(
        limit(&shares, FailureMode::Local, S),
        RegionLimit::Floor(floor_of)
    );
    // the first share, below the floor the bucket was decided with: at once
    shares.apply("d", &[assign(&pairs, strategy(small), 10)], 2 * S);
    assert_eq!(
        limit(&shares, FailureMode::Local, 3 * S),
        RegionLimit::Share(small)
    );
    // it grows: decisions at the small numbers until one is admitted (its
    // spend writes the refill at those numbers), then the big ones
    shares.apply("d", &[assign(&pairs, strategy(big), 10)], 4 * S);
    assert_eq!(
        limit(&shares, FailureMode::Local, 5 * S),
        RegionLimit::Share(small)
    );
    shares.record(b"tag-a", false);
    assert_eq!(
        limit(&shares, FailureMode::Local, 5 * S),
        RegionLimit::Share(small)
    );
    shares.record(b"tag-a", true);
    assert_eq!(
        limit(&shares, FailureMode::Local, 5 * S),
        RegionLimit::Share(big)
    );
    // it shrinks: at once
    shares.apply("d", &[assign(&pairs, strategy(small), 10)], 7 * S);
    assert_eq!(
        limit(&shares, FailureMode::Local, 7 * S),
        RegionLimit::Share(small)
    );
}

/// Settling ends after [`SETTLE_MICROS`] even when nothing was admitted, and
/// never starts from numbers that cannot admit (a DENY_ALL share: settling
/// at it would refuse every request for good).
#[test]
fn settling_is_bounded_and_never_at_numbers_that_cannot_admit() {
    let shares = RegionShares::new(2);
    shares.set_reachable(true);
    let pairs = [("api_key", "a"), ("path", "/x")];
    let share = |burst: f64, rate: f64| token_bucket(Budget { burst, rate });
    let floor_of = floor(RULE, 2);
    assert_eq!(
        limit(&shares, FailureMode::Local, S),
        RegionLimit::Floor(floor_of)
    );
    let big = BucketParams {
        capacity: 80,
        tokens_per_unit: 25,
        unit_secs: 1,
        max_debt: None,
        algorithm: Default::default(),
        period: None,
    };
    shares.apply("d", &[assign(&pairs, share(80.0, 25.0), 10)], 2 * S);
    assert_eq!(
        limit(&shares, FailureMode::Local, 2 * S),
        RegionLimit::Share(floor_of),
        "settling"
    );
    shares.record(b"tag-a", false);
    assert_eq!(
        limit(&shares, FailureMode::Local, 2 * S + SETTLE_MICROS),
        RegionLimit::Share(big),
        "settled by time"
    );
    // DENY_ALL, then a share: no settling at DENY_ALL's numbers
    shares.apply("d", &[assign(&pairs, share(0.0, 0.0), 10)], 5 * S);
    limit(&shares, FailureMode::Local, 5 * S);
    shares.apply("d", &[assign(&pairs, share(80.0, 25.0), 10)], 6 * S);
    assert_eq!(
        limit(&shares, FailureMode::Local, 6 * S),
        RegionLimit::Share(big)
    );
}
