//! Envoys that come and go: what departed ones leave behind (one envelope
//! per split), what a newcomer gets after them, and what a replica asks of
//! the shared ledger however many Envoys it serves.

use super::*;

const ACME: [(&str, &str); 2] = [("tenant", "acme"), ("api_key", "k1")];

fn acme() -> BucketKey {
    BucketKey::new(
        "edge",
        &BucketId {
            bucket: ACME
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        },
    )
}

/// The one strategy `out` holds for `stream`, as (burst, rate); (0, 0)
/// for DENY_ALL.
fn share_of(out: &Outbox, stream: StreamId) -> Option<(u32, f64)> {
    strategies(out, stream).first().map(|s| match s {
        Strategy::BlanketRule(_) => (0, 0.0),
        other => tokens(other),
    })
}

/// 300 streams come, report once and close 50 ms later, one every 100 ms
/// (a reconnect loop), beside an Envoy that stays (reporting every 5 s,
/// so its assignments live 15 s). The split keeps one member, the departed
/// are one envelope of at most [`allocation::ENVELOPE_SLOTS`] entries, Σ
/// stays within the budget at every step; and an Envoy joining 4 s after
/// the loop stops gets a share at once: what each short-lived stream was
/// sent lived by its own cadence (unknown: 3 s), not the stayer's 15 s.
#[test]
fn reconnect_churn_costs_one_envelope_and_starves_no_newcomer() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let mut now = SEC;
    let mut churner = 1_000;
    for tenth in 0..350u64 {
        now = SEC + tenth * SEC / 10;
        if tenth % 50 == 0 {
            q.report(1, "edge", &[usage(&ACME, 500, 5)], &r, now)
                .expect("report");
        }
        if tenth % 10 == 5 {
            q.tick(&r, now);
        }
        if (50..350).contains(&tenth) {
            churner += 1;
            q.report(churner, "edge", &[usage(&ACME, 100, 1)], &r, now)
                .expect("report");
            q.close(churner, &r, now + SEC / 20);
        }
        let reserved = reserved_in(&q, &ACME, now + SEC / 20);
        assert!(
            reserved.burst <= 200.0 + 1e-6 && reserved.rate <= 100.0 + 1e-6,
            "over the budget at {now}: {reserved:?}"
        );
    }
    let bucket = q.buckets.get(&acme()).expect("the bucket");
    assert_eq!(
        bucket.allocation.entries(),
        1,
        "the departed are not members"
    );
    let envelope = bucket.allocation.departed();
    assert!(
        !envelope.is_empty() && envelope.len() <= allocation::ENVELOPE_SLOTS,
        "{envelope:?}"
    );
    // the loop stops; 4 s later a newcomer comes and stays
    for t in 1..=4 {
        q.tick(&r, now + t * SEC);
    }
    let out = q
        .report(2, "edge", &[usage(&ACME, 100, 1)], &r, now + 4 * SEC)
        .expect("report");
    let (burst, rate) = share_of(&out, 2).expect("an assignment");
    assert!(burst >= 1 && rate > 0.0, "the newcomer got {burst} {rate}");
}

/// A bucket whose Envoys have all gone while what they were sent lives is
/// held: counted as a pair against [`MAX_SUBSCRIPTIONS`] until that
/// expires, then forgotten.
#[test]
fn a_bucket_held_only_by_departed_envoys_counts_until_they_expire() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    q.report(1, "edge", &[usage(&ACME, 10, 1)], &r, SEC)
        .expect("report");
    assert_eq!((q.pairs(), q.held()), (1, 0));
    q.close(1, &r, 2 * SEC);
    assert_eq!((q.pairs(), q.held(), q.buckets()), (0, 1, 1));
    // 3 s and its margin after it was sent at 1 s
    q.tick(&r, 4 * SEC + LIVE_MARGIN_MICROS + 1);
    assert_eq!((q.pairs(), q.held(), q.buckets()), (0, 0, 0));
}

/// With a shared ledger, a replica steps a bucket once for all the Envoys
/// it serves: 500 Envoys' first reports queue one step, its demand summing
/// 500 Envoys; the answer is split between them within the share; a tick
/// a second later queues one step again.
#[test]
fn a_shared_ledger_is_stepped_once_per_bucket_however_many_envoys() {
    let r = rules(RULES);
    let mut q = Quotas::shared();
    let mut ledgers = HashMap::new();
    for stream in 1..=500 {
        q.report(stream, "edge", &[usage(&ACME, 10, 1)], &r, SEC)
            .expect("report");
    }
    assert_eq!(q.steps.len(), 1);
    let step = q.steps.values().next().expect("a step");
    assert_eq!(step.demand.map(|d| d.pairs), Some(500));
    let out = answer_steps(&mut q, &mut ledgers, SEC);
    let shares: Vec<(u32, f64)> = (1..=500).filter_map(|s| share_of(&out, s)).collect();
    assert_eq!(shares.len(), 500);
    let burst: u32 = shares.iter().map(|s| s.0).sum();
    let rate: f64 = shares.iter().map(|s| s.1).sum();
    assert!(burst <= 200 && rate <= 100.0 + 1e-6, "{burst} {rate}");
    q.tick(&r, 2 * SEC);
    assert_eq!(q.take_steps().len(), 1);
}

/// A ledger answer that comes back late is sent with what is left of the
/// ledger's reservation, whole seconds: queued at 1 s for 3 s (and its
/// margin and a second's slack), answered at 3.5 s, it lives 1 s; one
/// answered at once lives its 3 s.
#[test]
fn a_late_ledger_answer_is_sent_with_what_is_left_of_its_life() {
    let r = rules(RULES);
    for (answered, lives) in [(SEC, 3), (3 * SEC + SEC / 2, 1)] {
        let mut q = Quotas::shared();
        let mut ledgers = HashMap::new();
        q.report(1, "edge", &[usage(&ACME, 10, 1)], &r, SEC)
            .expect("report");
        let steps = q.take_steps();
        let answers = steps
            .into_iter()
            .map(|step| {
                let args = ledger::StepArgs::new(
                    step.demand,
                    step.budget,
                    (step.ttl_micros / 1000) as i64,
                );
                let reply = ledgers
                    .entry(step.key.clone())
                    .or_insert_with(ledger::Ledger::default)
                    .step("r7", args, (SEC / 1000) as i64);
                (step, ledger::shared_from_reply(&reply).expect("reply"))
            })
            .collect();
        let out = q.granted(answers, answered);
        let ttl = out
            .iter()
            .flat_map(|(_, m)| &m.bucket_action)
            .find_map(|a| match &a.bucket_action {
                Some(Action::QuotaAssignmentAction(q)) => q.assignment_time_to_live,
                _ => None,
            })
            .expect("an assignment");
        assert_eq!(
            (ttl.seconds, ttl.nanos),
            (lives, 0),
            "answered at {answered}"
        );
    }
}
