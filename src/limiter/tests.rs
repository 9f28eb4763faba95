//! Limiter cases: replaces, shadow and quota modes, overrides, several limits,
//! and the failure policy against a store that always fails.

use std::path::PathBuf;

use async_trait::async_trait;

use super::*;
use crate::clock::ManualClock;
use crate::rules::{load_sources, LoadOptions, RuleSet};

const RULES: &str = r#"
domain: d
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2, name: per-user}
  - key: vip
    rate_limit: {unit: minute, requests_per_unit: 100, replaces: [{name: per-user}]}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: quota
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: quota2
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: free
    rate_limit: {unlimited: true}
  - key: login
    limits:
      - {unit: second, requests_per_unit: 1, burst: 3, name: burst}
      - {unit: hour, requests_per_unit: 4, name: hourly}
  - key: closed
    failure_mode: closed
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: local
    failure_mode: local
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: block
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: tiny_local
    failure_mode: local
    rate_limit: {unit: minute, requests_per_unit: 60, burst: 1}
  - key: small
    rate_limit: {unit: second, requests_per_unit: 1, burst: 5}
  - key: open_door
    rate_limit: {unlimited: true, name: open-door}
  - key: closer
    rate_limit: {unit: minute, requests_per_unit: 1, replaces: [{name: open-door}]}
  - key: free_pass
    rate_limit: {unlimited: true, replaces: [{name: per-user}]}
"#;

fn rules() -> RuleSet {
    load_sources(
        vec![(PathBuf::from("r.yaml"), RULES.to_string())],
        LoadOptions::default(),
    )
    .expect("valid rules")
}

fn memory_limiter() -> Limiter {
    Limiter::new(
        Arc::new(MemoryStore::new(ManualClock::new(1_000_000))),
        FailureMode::Open,
        1,
        Arc::default(),
    )
}

type Entries = Vec<(&'static str, &'static str)>;

fn input(entries: &Entries, cost: Cost) -> DescriptorInput<'_, (&'static str, &'static str)> {
    DescriptorInput {
        entries,
        cost,
        limit_override: None,
        own_hits_addend: false,
    }
}

async fn verdicts(limiter: &Limiter, rules: &RuleSet, descriptors: &[Entries]) -> Vec<Verdict> {
    let inputs: Vec<_> = descriptors
        .iter()
        .map(|e| input(e, Cost::Spend(1)))
        .collect();
    limiter
        .decide(rules, "d", &inputs)
        .await
        .expect("decided")
        .into_iter()
        .map(|d| d.verdict)
        .collect()
}

#[tokio::test]
async fn spends_until_empty_then_over_limit() {
    let (l, r) = (memory_limiter(), rules());
    let user = vec![("user", "alice")];
    let seen: Vec<_> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.extend(verdicts(&l, &r, std::slice::from_ref(&user)).await);
        }
        v
    };
    assert_eq!(seen, [Verdict::Ok, Verdict::Ok, Verdict::OverLimit]);
    // another value of the key-only default has its own bucket
    assert_eq!(
        verdicts(&l, &r, &[vec![("user", "bob")]]).await,
        [Verdict::Ok]
    );
}

#[tokio::test]
async fn reports_limit_remaining_and_reset() {
    let (l, r) = (memory_limiter(), rules());
    let user = vec![("user", "carol")];
    let d = l
        .decide(&r, "d", &[input(&user, Cost::Spend(1))])
        .await
        .expect("ok");
    let shown = d[0].limit.clone().expect("limit");
    assert_eq!(
        (shown.name.as_str(), shown.requests_per_unit, shown.unit),
        ("per-user", 2, Unit::Minute)
    );
    assert_eq!(d[0].remaining, 1);
    assert_eq!(d[0].reset_secs, Some(30), "one token at 2/min");
    l.decide(&r, "d", &[input(&user, Cost::Spend(1))])
        .await
        .expect("ok");
    let d = l
        .decide(&r, "d", &[input(&user, Cost::Spend(1))])
        .await
        .expect("ok");
    assert_eq!(d[0].verdict, Verdict::OverLimit);
    assert_eq!(d[0].reset_secs, Some(30), "retry after one token's refill");
}

#[tokio::test]
async fn replaces_drops_the_named_limit_of_another_descriptor() {
    let (l, r) = (memory_limiter(), rules());
    let both = [vec![("user", "dave")], vec![("vip", "dave")]];
    for _ in 0..5 {
        assert_eq!(
            verdicts(&l, &r, &both).await,
            [Verdict::NoRule, Verdict::Ok]
        );
    }
    // alone, the per-user limit applies again (and was never spent)
    assert_eq!(
        verdicts(&l, &r, &[vec![("user", "dave")]]).await,
        [Verdict::Ok]
    );
}

#[tokio::test]
async fn shadow_answers_ok_when_over_and_a_lone_quota_refuses() {
    let (l, r) = (memory_limiter(), rules());
    let s = vec![("shadow", "x")];
    let q = vec![("quota", "x")];
    assert_eq!(
        verdicts(&l, &r, &[s.clone(), q.clone()]).await,
        [Verdict::Ok, Verdict::Ok]
    );
    // the request's only quota-mode descriptor is over: none has room
    assert_eq!(
        verdicts(&l, &r, &[s, q]).await,
        [Verdict::Shadow, Verdict::OverLimit]
    );
}

/// envoyproxy/ratelimit's quota mode (`TestServiceMixedPerDescriptorModes`,
/// `TestServiceQuotaModeOnlySomeOverTheLimit`): a request is refused once
/// every quota-mode descriptor in it is over; a regular limit as usual.
#[tokio::test]
async fn a_request_is_refused_once_every_quota_is_over() {
    let (l, r) = (memory_limiter(), rules());
    let (q1, q2) = (vec![("quota", "a")], vec![("quota2", "a")]);
    let both = [q1.clone(), q2.clone()];
    assert_eq!(verdicts(&l, &r, &both).await, [Verdict::Ok, Verdict::Ok]);
    // one over, the other with room: passes, and says which is over
    assert_eq!(
        verdicts(&l, &r, &both).await,
        [Verdict::QuotaExceeded, Verdict::Ok]
    );
    // both over: refused
    assert_eq!(
        verdicts(&l, &r, &both).await,
        [Verdict::OverLimit, Verdict::OverLimit]
    );
    // a regular limit with room beside an exhausted quota: refused
    let user = vec![("user", "quota-fan")];
    assert_eq!(
        verdicts(&l, &r, &[user.clone(), q1.clone()]).await,
        [Verdict::Ok, Verdict::OverLimit]
    );
    // (that refused request took nothing: the user has both tokens)
    for _ in 0..2 {
        assert_eq!(
            verdicts(&l, &r, std::slice::from_ref(&user)).await,
            [Verdict::Ok]
        );
    }
    // a regular limit over refuses whatever the quotas say
    let fresh = vec![("quota2", "fresh")];
    assert_eq!(
        verdicts(&l, &r, &[user.clone(), fresh.clone()]).await,
        [Verdict::OverLimit, Verdict::Ok]
    );
}

#[tokio::test]
async fn unlimited_unknown_and_blocked() {
    let (l, r) = (memory_limiter(), rules());
    assert_eq!(
        verdicts(
            &l,
            &r,
            &[
                vec![("free", "x")],
                vec![("nope", "x")],
                vec![("block", "x")]
            ]
        )
        .await,
        [Verdict::Unlimited, Verdict::NoRule, Verdict::OverLimit]
    );
    let blocked = vec![("block", "x")];
    let d = l
        .decide(&r, "d", &[input(&blocked, Cost::Spend(1))])
        .await
        .expect("ok");
    assert_eq!(d[0].reset_secs, None, "r = 0 has no retry time");
    let unknown_domain = vec![("user", "x")];
    let d = l
        .decide(&r, "elsewhere", &[input(&unknown_domain, Cost::Spend(1))])
        .await
        .expect("ok");
    assert_eq!(d[0].verdict, Verdict::NoRule);
}

#[tokio::test]
async fn several_limits_decide_together_and_the_tightest_speaks() {
    let (l, r) = (memory_limiter(), rules());
    let login = vec![("login", "/")];
    let d = l
        .decide(&r, "d", &[input(&login, Cost::Spend(1))])
        .await
        .expect("ok");
    // burst has 2 left, hourly 3: the fewest tokens speak
    assert_eq!(d[0].limit.as_ref().map(|l| l.name.as_str()), Some("burst"));
    assert_eq!(d[0].remaining, 2);
    let d = l
        .decide(&r, "d", &[input(&login, Cost::Spend(3))])
        .await
        .expect("ok");
    assert_eq!(d[0].verdict, Verdict::OverLimit, "burst has only 2");
    assert_eq!(d[0].limit.as_ref().map(|l| l.name.as_str()), Some("burst"));
    let d = l
        .decide(&r, "d", &[input(&login, Cost::Spend(2))])
        .await
        .expect("ok");
    assert_eq!(
        d[0].verdict,
        Verdict::Ok,
        "the rejected request charged nothing"
    );
    assert_eq!(d[0].remaining, 0);
    let d = l
        .decide(&r, "d", &[input(&login, Cost::Spend(1))])
        .await
        .expect("ok");
    assert_eq!(d[0].verdict, Verdict::OverLimit);
}

#[tokio::test]
async fn request_overrides_replace_the_rule() {
    let (l, r) = (memory_limiter(), rules());
    let user = vec![("user", "erin")];
    let with = DescriptorInput {
        entries: &user,
        cost: Cost::Spend(1),
        limit_override: Some((5, Unit::Second)),
        own_hits_addend: false,
    };
    for _ in 0..5 {
        let d = l
            .decide(&r, "d", std::slice::from_ref(&with))
            .await
            .expect("ok");
        assert_eq!(d[0].verdict, Verdict::Ok);
        assert_eq!(d[0].limit.as_ref().map(|l| l.requests_per_unit), Some(5));
    }
    let d = l
        .decide(&r, "d", std::slice::from_ref(&with))
        .await
        .expect("ok");
    assert_eq!(d[0].verdict, Verdict::OverLimit);
    // the rule's own bucket was untouched
    assert_eq!(
        verdicts(&l, &r, std::slice::from_ref(&user)).await,
        [Verdict::Ok]
    );
}

/// A store that always fails, as a dead Redis would.
struct DeadStore;

#[async_trait]
impl Store for DeadStore {
    async fn decide(
        &self,
        _: &DescriptorBuckets,
        _: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        Err(StoreError::Connection("refused".into()))
    }
    fn name(&self) -> &'static str {
        "dead"
    }
}

#[tokio::test]
async fn failure_modes_when_the_store_is_down() {
    let r = rules();
    let open = Limiter::new(Arc::new(DeadStore), FailureMode::Open, 2, Arc::default());
    assert_eq!(
        verdicts(&open, &r, &[vec![("user", "x")]]).await,
        [Verdict::FailedOpen]
    );
    let closed = open
        .decide(&r, "d", &[input(&vec![("closed", "x")], Cost::Spend(1))])
        .await;
    assert!(closed.is_err(), "a closed rule fails the call");
    // local: B/N = 10/2 = 5 admitted by this instance, then over the limit
    let local = vec![("local", "x")];
    let mut admitted = 0;
    for _ in 0..8 {
        if verdicts(&open, &r, std::slice::from_ref(&local)).await == [Verdict::Ok] {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 5);
    // the server default applies to rules without their own mode
    let default_closed = Limiter::new(Arc::new(DeadStore), FailureMode::Closed, 1, Arc::default());
    assert!(default_closed
        .decide(&r, "d", &[input(&vec![("user", "x")], Cost::Spend(1))])
        .await
        .is_err());
}

/// Audit 9: with `local`, a burst below --instances still admits a token per
/// instance (B/N would round to 0 and block everything).
#[tokio::test]
async fn local_mode_keeps_at_least_one_token_per_instance() {
    let r = rules();
    let l = Limiter::new(Arc::new(DeadStore), FailureMode::Open, 2, Arc::default());
    let tiny = vec![("tiny_local", "x")];
    let v: Vec<Verdict> = {
        let mut out = Vec::new();
        for _ in 0..3 {
            out.extend(verdicts(&l, &r, std::slice::from_ref(&tiny)).await);
        }
        out
    };
    assert_eq!(v, [Verdict::Ok, Verdict::OverLimit, Verdict::OverLimit]);
}

/// Audit 3: a cost that does not fit 63 bits is rejected as above capacity,
/// never wrapped (the Redis side is in tests/bucket_cases.rs).
#[tokio::test]
async fn a_huge_cost_is_over_capacity_not_wrapped() {
    let (l, r) = (memory_limiter(), rules());
    let small = vec![("small", "x")];
    for hits in [1u64 << 63, u64::MAX, (1 << 53) + 1] {
        let d = l
            .decide(&r, "d", &[input(&small, Cost::Spend(hits))])
            .await
            .expect("decided");
        assert_eq!(d[0].verdict, Verdict::OverLimit, "{hits}");
        assert_eq!((d[0].remaining, d[0].reset_secs), (5, None), "{hits}");
    }
    assert_eq!(Cost::Spend(u64::MAX).needed(), crate::bucket::MAX_COST);
    assert_eq!(
        Cost::Refund(u64::MAX).deducted(),
        -(crate::bucket::MAX_COST as i64)
    );
}

/// Two different overrides on the same entries are two buckets.
#[tokio::test]
async fn different_overrides_do_not_share_a_bucket() {
    let (l, r) = (memory_limiter(), rules());
    let user = vec![("user", "olga")];
    let with = |rpu| DescriptorInput {
        entries: &user,
        cost: Cost::Spend(1),
        limit_override: Some((rpu, Unit::Hour)),
        own_hits_addend: false,
    };
    for _ in 0..3 {
        l.decide(&r, "d", &[with(3)]).await.expect("ok");
    }
    let d = l.decide(&r, "d", &[with(3)]).await.expect("ok");
    assert_eq!(d[0].verdict, Verdict::OverLimit, "3 per hour spent");
    let d = l.decide(&r, "d", &[with(100)]).await.expect("ok");
    assert_eq!(
        (d[0].verdict, d[0].remaining),
        (Verdict::Ok, 99),
        "another override has its own bucket"
    );
}

/// `replaces` and unlimited rules, as envoyproxy/ratelimit has them: an
/// unlimited rule's `replaces` drops other limits, and a replaced unlimited
/// rule leaves its descriptor without a rule.
#[tokio::test]
async fn replaces_works_with_unlimited_rules_both_ways() {
    let (l, r) = (memory_limiter(), rules());
    assert_eq!(
        verdicts(&l, &r, &[vec![("open_door", "x")], vec![("closer", "x")]]).await,
        [Verdict::NoRule, Verdict::Ok]
    );
    assert_eq!(
        verdicts(&l, &r, &[vec![("user", "x")], vec![("free_pass", "x")]]).await,
        [Verdict::NoRule, Verdict::Unlimited]
    );
}

/// The `local` failure mode's buckets are swept once full again, as the
/// memory store's are (they stayed until evicted).
#[tokio::test]
async fn the_local_failure_modes_buckets_are_swept_once_full() {
    let r = rules();
    let limiter = Arc::new(Limiter::new(
        Arc::new(DeadStore),
        FailureMode::Open,
        1,
        Arc::default(),
    ));
    assert_eq!(
        verdicts(&limiter, &r, &[vec![("tiny_local", "x")]]).await,
        [Verdict::Ok]
    );
    assert_eq!(limiter.local_buckets(), 1);
    limiter.spawn_local_sweeper(std::time::Duration::from_millis(50));
    // 60 a minute, burst 1: full again after a second
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while limiter.local_buckets() > 0 {
        assert!(std::time::Instant::now() < deadline, "never swept");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// `--usage-domains`: a descriptor's own cost is charged into debt on a
/// rule that does not say `overdraft`; a cost that is the request's is not;
/// a rule that cannot hold a debt (a rate of 0) spends as usual.
#[tokio::test]
async fn usage_domains_charge_own_costs() {
    let rules = load_sources(
        vec![(PathBuf::from("r.yaml"), RULES.to_string())],
        LoadOptions {
            usage_domains: crate::rules::DomainPatterns::new(&["x", "*d"]),
            ..LoadOptions::default()
        },
    )
    .expect("valid rules");
    assert!(rules.is_usage_domain("d"));
    let l = memory_limiter();
    let decide = |entries: &'static [(&'static str, &'static str)], cost, own| {
        let (l, rules) = (&l, &rules);
        async move {
            let input = DescriptorInput {
                entries,
                cost,
                limit_override: None,
                own_hits_addend: own,
            };
            l.decide(rules, "d", std::slice::from_ref(&input))
                .await
                .expect("decided")
                .remove(0)
        }
    };
    const SMALL: &[(&str, &str)] = &[("small", "a")];
    // burst 5 at 1/s: a charge of 4, then one of 4 more goes into debt (-3)
    assert_eq!(
        decide(SMALL, Cost::Spend(4), true).await.verdict,
        Verdict::Ok
    );
    let debt = decide(SMALL, Cost::Spend(4), true).await;
    assert_eq!(debt.verdict, Verdict::OverLimit, "answered as in debt");
    assert_eq!(debt.remaining, 0);
    let check = decide(SMALL, Cost::Check, true).await;
    assert_eq!(check.verdict, Verdict::OverLimit);
    assert_eq!(check.reset_secs, Some(4), "(1 - -3) / 1 per second");
    // the debt is real: nothing is back until it is repaid
    assert_eq!(decide(SMALL, Cost::Check, true).await.reset_secs, Some(4));

    // the same cost without its own hits_addend is a plain spend: refused,
    // nothing taken
    const OTHER: &[(&str, &str)] = &[("small", "b")];
    assert_eq!(
        decide(OTHER, Cost::Spend(4), false).await.verdict,
        Verdict::Ok
    );
    let refused = decide(OTHER, Cost::Spend(4), false).await;
    assert_eq!(refused.verdict, Verdict::OverLimit);
    assert_eq!(
        decide(OTHER, Cost::Spend(1), false).await.verdict,
        Verdict::Ok,
        "1 was left"
    );

    // a rate of 0 cannot repay a debt: spends as usual, refused
    const BLOCK: &[(&str, &str)] = &[("block", "x")];
    assert_eq!(
        decide(BLOCK, Cost::Spend(1), true).await.verdict,
        Verdict::OverLimit
    );

    // a request override in a usage domain is charged too
    let user: Entries = vec![("user", "pat")];
    let with = DescriptorInput {
        entries: &user,
        cost: Cost::Spend(3),
        limit_override: Some((2, Unit::Hour)),
        own_hits_addend: true,
    };
    let d = l
        .decide(&rules, "d", std::slice::from_ref(&with))
        .await
        .expect("ok");
    assert_eq!(
        d[0].verdict,
        Verdict::OverLimit,
        "3 charged into a burst of 2"
    );
    let check = DescriptorInput {
        cost: Cost::Check,
        ..with
    };
    let d = l
        .decide(&rules, "d", std::slice::from_ref(&check))
        .await
        .expect("ok");
    assert_eq!(
        d[0].reset_secs,
        Some(3600),
        "a debt of 1 and one token at 2 an hour"
    );
}

/// Without `--usage-domains` (or outside them) an own cost is a spend:
/// refused when the bucket does not hold it, nothing taken.
#[tokio::test]
async fn own_costs_outside_usage_domains_are_spends() {
    let (l, r) = (memory_limiter(), rules());
    let small = vec![("small", "a")];
    let input = |cost| DescriptorInput {
        entries: &small,
        cost,
        limit_override: None,
        own_hits_addend: true,
    };
    let d = l
        .decide(&r, "d", &[input(Cost::Spend(4))])
        .await
        .expect("ok");
    assert_eq!(d[0].verdict, Verdict::Ok);
    let d = l
        .decide(&r, "d", &[input(Cost::Spend(4))])
        .await
        .expect("ok");
    assert_eq!(d[0].verdict, Verdict::OverLimit);
    let d = l
        .decide(&r, "d", &[input(Cost::Spend(1))])
        .await
        .expect("ok");
    assert_eq!(d[0].verdict, Verdict::Ok, "the refused 4 took nothing");
}

/// A refused slot start leaves no slot to the caller, whatever the store
/// counted in flight (a start refused for a full attempt table said three
/// of three were left).
#[test]
fn a_refused_slot_start_reports_no_slot_left() {
    let r = rules();
    let rule = r
        .rules("d")
        .into_iter()
        .find(|rule| rule.label() == "per-user")
        .expect("the per-user rule")
        .clone();
    let admitted = slot_decision(&rule, true, 1, 3);
    assert_eq!((admitted.verdict, admitted.remaining), (Verdict::Ok, 2));
    let refused = slot_decision(&rule, false, 0, 3);
    assert_eq!(
        (refused.verdict, refused.remaining, refused.reset_secs),
        (Verdict::OverLimit, 0, Some(1))
    );
}

mod give_back;
mod half_way;

/// Fixed windows in envoyproxy/ratelimit's keys, where a refused request
/// keeps nothing of the others (its `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`):
/// a request over one window counts its hit there only, never on the
/// others, which a window could not give back.
#[tokio::test]
async fn a_request_over_one_window_counts_nothing_on_the_others() {
    let rules = load_sources(
        vec![(
            PathBuf::from("w.yaml"),
            r#"
domain: d
descriptors:
  - key: a
    algorithm: fixed_window
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: b
    algorithm: fixed_window
    rate_limit: {unit: hour, requests_per_unit: 7}
"#
            .to_string(),
        )],
        LoadOptions::default(),
    )
    .expect("valid rules");
    let l = memory_limiter();
    let both = [vec![("a", "x")], vec![("b", "x")]];
    for _ in 0..5 {
        assert_eq!(
            verdicts(&l, &rules, &both).await,
            [Verdict::Ok, Verdict::Ok]
        );
    }
    for _ in 0..3 {
        assert_eq!(
            verdicts(&l, &rules, &both).await,
            [Verdict::OverLimit, Verdict::Ok]
        );
    }
    // b counted 5: two more alone, as there
    let b = [vec![("b", "x")]];
    for verdict in [Verdict::Ok, Verdict::Ok, Verdict::OverLimit] {
        assert_eq!(verdicts(&l, &rules, &b).await, [verdict]);
    }
}
