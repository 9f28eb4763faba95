//! A shared ledger that cannot answer (issue 56): the Envoys are never left
//! without an assignment, and what a replica assigns then stays within
//! what the ledger and the other replicas can account for.

use super::*;

const ACME: [(&str, &str); 2] = [("tenant", "acme"), ("api_key", "k1")];
const BUDGET: Budget = Budget {
    burst: 200.0,
    rate: 100.0,
};

/// This replica's member and another replica's, stepping the same bucket.
const ME: &str = "r7";
const OTHER: &str = "r9";

/// Answers the steps `q` queued from `ledgers` at `now` (as replica
/// [`ME`], telling what it held), or refuses them all when `down`.
fn step_or_refuse(
    q: &mut Quotas,
    ledgers: &mut HashMap<BucketKey, ledger::Ledger>,
    now: u64,
    down: bool,
) -> Outbox {
    let steps = q.take_steps();
    if down {
        return q.refused(steps, now);
    }
    let answers = steps
        .into_iter()
        .map(|step| {
            let args =
                ledger::StepArgs::new(step.demand, step.budget, (step.ttl_micros / 1000) as i64)
                    .holding(step.held_at(now));
            let reply =
                ledgers
                    .entry(step.key.clone())
                    .or_default()
                    .step(ME, args, (now / 1000) as i64);
            (step, ledger::shared_from_reply(&reply).expect("reply"))
        })
        .collect();
    q.granted(answers, now)
}

/// The other replica steps every bucket of `ledgers` with `demand`.
fn other_steps(ledgers: &mut HashMap<BucketKey, ledger::Ledger>, demand: f64, now: u64) -> Shared {
    let args = ledger::StepArgs::new(
        Some(ledger::Demand {
            per_sec: demand,
            pairs: 1,
        }),
        BUDGET,
        4_500,
    );
    let mut last = None;
    for l in ledgers.values_mut() {
        let reply = l.step(OTHER, args, (now / 1000) as i64);
        last = Some(ledger::shared_from_reply(&reply).expect("reply"));
    }
    last.expect("a bucket")
}

/// The token buckets in `out` for `stream`, with their times to live.
fn sent(out: &Outbox, stream: StreamId) -> Vec<((u32, f64), u64)> {
    out.iter()
        .filter(|(s, _)| *s == stream)
        .flat_map(|(_, r)| &r.bucket_action)
        .filter_map(|a| match &a.bucket_action {
            Some(Action::QuotaAssignmentAction(q)) => Some((
                tokens(
                    &q.rate_limit_strategy
                        .and_then(|s| s.strategy)
                        .expect("strategy"),
                ),
                q.assignment_time_to_live.map_or(0, |d| d.seconds as u64),
            )),
            _ => None,
        })
        .collect()
}

/// An Envoy reporting every second while the ledger stops answering for
/// 20 s, with another replica active beside (three times its demand): its
/// assignment never lapses; while the last confirmed share (27/s) is
/// reserved in the ledger it is sent with what is left of that, then the
/// safe share (half the budget less the newcomer reserve: two replicas at
/// the last answer) with the Envoy's own time to live; the bucket is
/// counted; the first answer after takes over, and the ledger keeps what
/// the safe share left live reserved for this replica, so the other
/// replica is not given it.
#[test]
fn envoys_keep_a_safe_assignment_while_the_ledger_is_down() {
    let r = rules(RULES);
    let mut q = Quotas::shared();
    let mut ledgers = HashMap::new();
    let mut live_until = 0;
    let mut safe_seen = 0;
    let mut confirmed_while_down = 0;
    for tenth in 10..600u64 {
        let now = tenth * SEC / 10;
        let down = (100..300).contains(&tenth);
        let mut out = Vec::new();
        if tenth % 10 == 0 {
            out.extend(
                q.report(1, "edge", &[usage(&ACME, 500, 1)], &r, now)
                    .expect("report"),
            );
        }
        if tenth % 10 == 3 {
            out.extend(q.tick(&r, now));
        }
        if !down && tenth % 10 == 5 && !ledgers.is_empty() {
            other_steps(&mut ledgers, 1_500.0, now);
        }
        out.extend(step_or_refuse(&mut q, &mut ledgers, now, down));
        if tenth > 15 {
            assert!(now < live_until, "lapsed at {now} (ledger down: {down})");
        }
        for ((burst, rate), ttl) in sent(&out, 1) {
            live_until = live_until.max(now + ttl * SEC);
            if down && (burst, rate) == (90, 45.0) {
                safe_seen += 1;
                assert!(ttl >= 3, "the safe share outlasts a missed step: {ttl} s");
            } else if down {
                confirmed_while_down += 1;
                assert!(rate < 45.0 && burst < 90, "{burst} {rate}");
            }
        }
        if (150..300).contains(&tenth) {
            assert_eq!(q.without_ledger(), 1, "at {tenth}");
        }
        if tenth == 320 {
            assert_eq!(q.without_ledger(), 0);
            // the safe share's assignments still live: the ledger holds
            // them for this replica, so the other is not given them
            let other = other_steps(&mut ledgers, 1_500.0, now);
            assert!(
                other.share.rate <= BUDGET.rate - 45.0 + 1e-6,
                "the other replica got {:?} beside 45/s still enforced here",
                other.share
            );
        }
    }
    assert!(safe_seen >= 5, "the safe share was sent {safe_seen} times");
    assert!(confirmed_while_down >= 1);
}

/// A replica whose very first step fails has no answer to count the
/// replicas by: it assigns the budget divided by `--instances`.
#[test]
fn a_replica_that_never_reached_the_ledger_assigns_its_part_of_the_budget() {
    let r = rules(RULES);
    // whole tokens a second, as Envoy takes them
    for (instances, rate) in [(0, 90.0), (1, 90.0), (4, 22.0)] {
        let mut q = Quotas::shared().with_instances(instances);
        let mut ledgers = HashMap::new();
        q.report(1, "edge", &[usage(&ACME, 500, 1)], &r, SEC)
            .expect("report");
        let out = step_or_refuse(&mut q, &mut ledgers, SEC, true);
        let sent = sent(&out, 1);
        assert_eq!(sent.len(), 1, "{out:?}");
        assert_eq!(sent[0].0 .1, rate, "--instances {instances}");
        assert_eq!(q.without_ledger(), 1);
    }
}

/// The safe share never counts when the ledger's own answer is live, and a
/// bucket that is forgotten stops counting in [`Quotas::without_ledger`].
#[test]
fn a_forgotten_bucket_is_no_longer_without_the_ledger() {
    let r = rules(RULES);
    let mut q = Quotas::shared();
    let mut ledgers = HashMap::new();
    q.report(1, "edge", &[usage(&ACME, 500, 1)], &r, SEC)
        .expect("report");
    step_or_refuse(&mut q, &mut ledgers, SEC, true);
    assert_eq!(q.without_ledger(), 1);
    q.close(1, &r, 2 * SEC);
    for s in 2..120 {
        q.tick(&r, s * SEC);
        step_or_refuse(&mut q, &mut ledgers, s * SEC, true);
    }
    assert_eq!((q.buckets(), q.without_ledger()), (0, 0));
}
