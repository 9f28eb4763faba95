//! One request, one decision: what a request answered OVER_LIMIT took on
//! its other descriptors is given back, on the memory store (the Redis
//! store's copy is in tests/give_back.rs).

use super::*;
use std::time::Instant;

const RULES: &str = r#"
domain: g
descriptors:
  - key: budget
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: op
    rate_limit: {unit: day, requests_per_unit: 2}
  - key: per_operation
    rate_limit: {unit: day, requests_per_unit: 0}
  - key: window
    algorithm: fixed_window
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: sliding
    algorithm: sliding_window
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: month
    rate_limit:
      unit: month
      requests_per_unit: 10
      calendar: {time_zone: UTC}
  - key: usage
    overdraft: true
    rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: reserving
    overdraft: true
    rate_limit: {unit: minute, requests_per_unit: 1000}
    attempts: {key: request_id, ttl: 5m, reserve: 600}
  - key: dedupe
    rate_limit: {unit: minute, requests_per_unit: 10}
    attempts: {key: request_id, ttl: 5m}
  - key: streams
    concurrency: 2
    attempts: {key: request_id, ttl: 10m}
  - key: leased
    rate_limit: {unit: minute, requests_per_unit: 100}
    lease: {size: 10, ttl: 10s}
  - key: shared
    failure_mode: local
    rate_limit: {unit: minute, requests_per_unit: 10}
"#;

fn give_back_rules() -> RuleSet {
    load_sources(
        vec![(PathBuf::from("g.yaml"), RULES.to_string())],
        LoadOptions::default(),
    )
    .expect("valid rules")
}

pub(super) type Descriptor = (Entries, Cost);

pub(super) fn own(entries: &[(&'static str, &'static str)], cost: Cost) -> Descriptor {
    (entries.to_vec(), cost)
}

async fn decide(l: &Limiter, r: &RuleSet, descriptors: &[Descriptor]) -> Vec<Decision> {
    decide_by(l, r, descriptors, None).await
}

/// Decides `descriptors` for a caller that gives up at `deadline`.
async fn decide_by(
    l: &Limiter,
    r: &RuleSet,
    descriptors: &[Descriptor],
    deadline: Option<Instant>,
) -> Vec<Decision> {
    let inputs: Vec<_> = descriptors
        .iter()
        .map(|(e, c)| DescriptorInput {
            entries: e,
            cost: *c,
            limit_override: None,
            own_hits_addend: matches!(c, Cost::Spend(n) if *n != 1),
        })
        .collect();
    l.decide_by(r, "g", &inputs, None, deadline)
        .await
        .expect("decided")
}

/// What `entries` has left, by a check (which takes nothing).
async fn left(l: &Limiter, r: &RuleSet, entries: &[(&'static str, &'static str)]) -> u64 {
    decide(l, r, &[own(entries, Cost::Check)]).await[0].remaining
}

/// Spends the day's two `op`s, so that a third refuses.
async fn exhaust_op(l: &Limiter, r: &RuleSet) {
    for _ in 0..2 {
        assert_eq!(
            decide(l, r, &[own(&[("op", "x")], Cost::Spend(1))]).await[0].verdict,
            Verdict::Ok
        );
    }
}

/// `first` beside the spent operation (see [`exhaust_op`]), which refuses
/// the request: the answer's two decisions.
async fn beside_spent_op(l: &Limiter, r: &RuleSet, first: Descriptor) -> Vec<Decision> {
    let d = decide(l, r, &[first, own(&[("op", "x")], Cost::Spend(1))]).await;
    assert_eq!(d[1].verdict, Verdict::OverLimit);
    d
}

/// `rls_given_back_total` summed over every series whose labels hold each
/// of `labels` (`result="ok"`, …).
pub(super) fn counted(l: &Limiter, labels: &[&str]) -> u64 {
    l.metrics
        .render()
        .lines()
        .filter(|line| {
            line.starts_with("rls_given_back_total{") && labels.iter().all(|w| line.contains(w))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

fn given_back(l: &Limiter, result: &str) -> u64 {
    counted(l, &[&format!("result=\"{result}\"")])
}

#[tokio::test]
async fn a_refused_request_keeps_no_tokens_of_its_other_descriptors() {
    let (l, r) = (memory_limiter(), give_back_rules());
    exhaust_op(&l, &r).await;
    for entries in [[("budget", "a")], [("sliding", "a")], [("month", "a")]] {
        let before = left(&l, &r, &entries).await;
        for _ in 0..5 {
            let d = beside_spent_op(&l, &r, own(&entries, Cost::Spend(3))).await;
            assert_eq!(d[0].verdict, Verdict::Ok, "{entries:?} admitted on its own");
        }
        assert_eq!(
            left(&l, &r, &entries).await,
            before,
            "{entries:?}: nothing kept"
        );
    }
    assert_eq!(given_back(&l, "ok"), 15);
    assert_eq!(given_back(&l, "failed"), 0);
    // admitted requests keep what they took
    let d = decide(
        &l,
        &r,
        &[
            own(&[("budget", "a")], Cost::Spend(3)),
            own(&[("op", "y")], Cost::Spend(1)),
        ],
    )
    .await;
    assert!(d.iter().all(|d| d.verdict == Verdict::Ok));
    assert_eq!(left(&l, &r, &[("budget", "a")]).await, 7);
}

#[tokio::test]
async fn per_descriptor_spending_keeps_what_each_took() {
    let l = memory_limiter().with_per_descriptor_spending(true);
    let r = give_back_rules();
    exhaust_op(&l, &r).await;
    for _ in 0..2 {
        beside_spent_op(&l, &r, own(&[("budget", "a")], Cost::Spend(3))).await;
    }
    assert_eq!(left(&l, &r, &[("budget", "a")]).await, 4);
    assert_eq!(given_back(&l, "ok"), 0);
}

#[tokio::test]
async fn fixed_windows_count_every_hit_and_charges_stay() {
    let (l, r) = (memory_limiter(), give_back_rules());
    exhaust_op(&l, &r).await;
    beside_spent_op(&l, &r, own(&[("window", "a")], Cost::Spend(1))).await;
    assert_eq!(
        left(&l, &r, &[("window", "a")]).await,
        9,
        "a fixed window counts every hit, as envoyproxy/ratelimit"
    );
    beside_spent_op(&l, &r, own(&[("usage", "a")], Cost::Spend(100))).await;
    assert_eq!(left(&l, &r, &[("usage", "a")]).await, 900, "usage happened");
    assert_eq!(given_back(&l, "ok"), 0);
}

#[tokio::test]
async fn a_refused_requests_reservation_and_slot_come_back_and_its_id_is_no_free_pass() {
    let (l, r) = (memory_limiter(), give_back_rules());
    for i in 0..5 {
        // (the refusing limit is decided last: its key is the longest)
        let d = decide(
            &l,
            &r,
            &[
                own(&[("streams", "u"), ("request_id", "r1")], Cost::Spend(1)),
                own(&[("reserving", "u"), ("request_id", "r1")], Cost::Check),
                own(&[("dedupe", "u"), ("request_id", "r1")], Cost::Spend(1)),
                own(&[("per_operation", "x")], Cost::Spend(1)),
            ],
        )
        .await;
        let verdicts: Vec<_> = d.iter().map(|d| d.verdict).collect();
        assert_eq!(
            verdicts,
            [Verdict::Ok, Verdict::Ok, Verdict::Ok, Verdict::OverLimit],
            "call {i}: each first again, as nothing was kept"
        );
    }
    assert_eq!(given_back(&l, "ok"), 15);
    assert_eq!(left(&l, &r, &[("reserving", "u")]).await, 1000);
    assert_eq!(left(&l, &r, &[("dedupe", "u")]).await, 10);
    // both slots free: two other requests hold them, a third is refused
    for (id, verdict) in [
        ("a", Verdict::Ok),
        ("b", Verdict::Ok),
        ("c", Verdict::OverLimit),
    ] {
        let d = decide(
            &l,
            &r,
            &[own(&[("streams", "u"), ("request_id", id)], Cost::Spend(1))],
        )
        .await;
        assert_eq!(d[0].verdict, verdict, "{id}");
    }
    // the request's stream-done call finds nothing to settle or release,
    // and gives nothing back (its request ran, as far as Envoy knows)
    let d = decide(
        &l,
        &r,
        &[
            own(
                &[("reserving", "u"), ("request_id", "r1"), ("phase", "done")],
                Cost::Spend(0),
            ),
            own(
                &[("streams", "u"), ("request_id", "r1"), ("phase", "done")],
                Cost::Spend(1),
            ),
        ],
    )
    .await;
    assert!(d.iter().all(|d| d.verdict == Verdict::Ok));
    assert_eq!(left(&l, &r, &[("reserving", "u")]).await, 1000);
}

#[tokio::test]
async fn a_leases_tokens_go_back_to_the_lease() {
    let (l, r) = (memory_limiter(), give_back_rules());
    exhaust_op(&l, &r).await;
    for _ in 0..30 {
        beside_spent_op(&l, &r, own(&[("leased", "a")], Cost::Spend(1))).await;
    }
    // one lease of 10 taken, every token of it back in the lease
    assert_eq!(l.leases().held(), 10);
    assert_eq!(given_back(&l, "ok"), 30);
}

#[tokio::test]
async fn the_local_failure_modes_share_is_given_back_locally() {
    // a dead store: `shared` decides on this instance's share, 10/2 = 5
    let l = Limiter::new(Arc::new(DeadStore), FailureMode::Open, 2, Arc::default());
    let r = give_back_rules();
    let (a, b) = ([("shared", "a")], [("shared", "b")]);
    for _ in 0..5 {
        assert_eq!(
            decide(&l, &r, &[own(&b, Cost::Spend(1))]).await[0].verdict,
            Verdict::Ok
        );
    }
    for _ in 0..4 {
        let d = decide(&l, &r, &[own(&a, Cost::Spend(1)), own(&b, Cost::Spend(1))]).await;
        assert_eq!(
            (d[0].verdict, d[1].verdict),
            (Verdict::Ok, Verdict::OverLimit)
        );
    }
    assert_eq!(left(&l, &r, &a).await, 5, "the local share got it back");
    assert_eq!(given_back(&l, "ok"), 4);
}

/// Decides `descriptors` for a caller whose deadline already passed.
async fn decide_late(l: &Limiter, r: &RuleSet, descriptors: &[Descriptor]) -> Vec<Decision> {
    let past = Instant::now()
        .checked_sub(std::time::Duration::from_millis(1))
        .expect("a moment ago");
    decide_by(l, r, descriptors, Some(past)).await
}

/// Waits (bounded) until the give-back task counted `n` for `reason`.
async fn given_back_for(l: &Limiter, reason: &str, n: u64) {
    let reason = format!("reason=\"{reason}\"");
    for _ in 0..200 {
        let counted = counted(l, &[&reason, "result=\"ok\""]);
        if counted >= n {
            assert_eq!(counted, n);
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("never given back {n} for {reason}");
}

/// An answer that came after the caller's deadline (Envoy answered by its
/// failure mode): every descriptor is given back what it took, and an
/// attempt's start is withdrawn, so that a done call after it (the request
/// may have run) is charged in full.
#[tokio::test]
async fn an_answer_after_the_deadline_keeps_nothing_and_withdraws_the_start() {
    let (l, r) = (memory_limiter(), give_back_rules());
    let d = decide_late(
        &l,
        &r,
        &[
            own(&[("reserving", "u"), ("request_id", "late")], Cost::Check),
            own(&[("streams", "u"), ("request_id", "late")], Cost::Spend(1)),
            own(&[("budget", "late")], Cost::Spend(2)),
        ],
    )
    .await;
    assert!(d.iter().all(|d| d.verdict == Verdict::Ok), "{d:?}");
    given_back_for(&l, "late", 3).await;
    assert_eq!(left(&l, &r, &[("reserving", "u")]).await, 1000);
    assert_eq!(left(&l, &r, &[("budget", "late")]).await, 10);
    // withdrawn, not settled: the done call charges what was used, in full
    let done = decide(
        &l,
        &r,
        &[own(
            &[
                ("reserving", "u"),
                ("request_id", "late"),
                ("phase", "done"),
            ],
            Cost::Spend(250),
        )],
    )
    .await;
    assert_eq!(done[0].remaining, 750);
    // both slots free again
    for id in ["x", "y"] {
        let d = decide(
            &l,
            &r,
            &[own(&[("streams", "u"), ("request_id", id)], Cost::Spend(1))],
        )
        .await;
        assert_eq!(d[0].verdict, Verdict::Ok, "{id}");
    }
    // one descriptor alone is given back too
    decide_late(&l, &r, &[own(&[("budget", "alone")], Cost::Spend(4))]).await;
    given_back_for(&l, "late", 4).await;
    assert_eq!(left(&l, &r, &[("budget", "alone")]).await, 10);
}

/// A request that starts an attempt is decided one descriptor at a time,
/// slots first, stopping at the first refusal: what comes after it takes
/// nothing (so that two such requests cannot each hold what refuses the
/// other), and is answered by a check.
#[tokio::test]
async fn a_refusal_early_in_the_turn_leaves_the_rest_untaken() {
    let (l, r) = (memory_limiter(), give_back_rules());
    exhaust_op(&l, &r).await;
    let d = decide(
        &l,
        &r,
        &[
            own(&[("reserving", "u"), ("request_id", "r1")], Cost::Check),
            own(&[("op", "x")], Cost::Spend(1)),
            own(&[("dedupe", "u"), ("request_id", "r1")], Cost::Spend(1)),
            own(&[("streams", "u"), ("request_id", "r1")], Cost::Spend(1)),
        ],
    )
    .await;
    let verdicts: Vec<_> = d.iter().map(|d| d.verdict).collect();
    assert_eq!(
        verdicts,
        [Verdict::Ok, Verdict::OverLimit, Verdict::Ok, Verdict::Ok]
    );
    // the slot (first in the turn) was taken and given back; the
    // reservation and the dedupe call came after the refusal: checked
    assert_eq!(given_back(&l, "ok"), 1);
    assert_eq!((d[0].remaining, d[2].remaining), (1000, 10));
    assert_eq!(left(&l, &r, &[("reserving", "u")]).await, 1000);
    assert_eq!(left(&l, &r, &[("dedupe", "u")]).await, 10);
    // a plain request (no attempt) is decided all at once: each took, and
    // gave back
    let d = decide(
        &l,
        &r,
        &[
            own(&[("budget", "b")], Cost::Spend(1)),
            own(&[("op", "x")], Cost::Spend(1)),
        ],
    )
    .await;
    assert_eq!(d[1].verdict, Verdict::OverLimit);
    assert_eq!(given_back(&l, "ok"), 2);
}
