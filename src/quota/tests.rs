use std::path::PathBuf;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
use envoy_types::pb::google::protobuf::Duration as PbDuration;

use super::*;
use crate::rules::{load_sources, LoadOptions};

const SEC: u64 = 1_000_000;

fn rules(yaml: &str) -> RuleSet {
    load_sources(
        vec![(PathBuf::from("rules.yaml"), yaml.to_string())],
        LoadOptions::default(),
    )
    .expect("valid rules")
    .with_generation(1)
}

const RULES: &str = r#"
domain: edge
descriptors:
  - key: tenant
    value: acme
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 100, burst: 200}
  - key: tenant
    value: free
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: tenant
    value: internal
    rate_limit: {unlimited: true}
"#;

fn usage(pairs: &[(&str, &str)], allowed: u64, secs: i64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }),
        time_elapsed: Some(PbDuration {
            seconds: secs,
            nanos: 0,
        }),
        num_requests_allowed: allowed,
        num_requests_denied: 0,
    }
}

/// The strategies in `out` for `stream`, one per bucket action.
fn strategies(out: &Outbox, stream: StreamId) -> Vec<Strategy> {
    out.iter()
        .filter(|(s, _)| *s == stream)
        .flat_map(|(_, r)| &r.bucket_action)
        .map(|a| match &a.bucket_action {
            Some(Action::QuotaAssignmentAction(q)) => q
                .rate_limit_strategy
                .and_then(|s| s.strategy)
                .expect("a strategy"),
            other => panic!("not an assignment: {other:?}"),
        })
        .collect()
}

fn tokens(s: &Strategy) -> (u32, f64) {
    match s {
        Strategy::TokenBucket(b) => {
            let fill = b.fill_interval.as_ref().expect("interval");
            let secs = fill.seconds as f64 + f64::from(fill.nanos) / 1e9;
            let per_fill = b.tokens_per_fill.as_ref().map_or(1, |v| v.value);
            (b.max_tokens, f64::from(per_fill) / secs)
        }
        other => panic!("not a token bucket: {other:?}"),
    }
}

#[test]
fn a_bucket_id_maps_to_the_rules_path_whatever_its_key_order() {
    let r = rules(RULES);
    let acme = [
        ("api_key".to_string(), "k1".to_string()),
        ("tenant".to_string(), "acme".to_string()),
    ];
    assert!(
        matches!(Policy::of(&r, "edge", &acme), Policy::Shared(b) if b.rate == 100.0 && b.burst == 200.0)
    );
    let free = [("tenant".to_string(), "free".to_string())];
    assert_eq!(Policy::of(&r, "edge", &free), Policy::DenyAll);
    let internal = [("tenant".to_string(), "internal".to_string())];
    assert_eq!(Policy::of(&r, "edge", &internal), Policy::AllowAll);
    // a key the tree does not have: no rule
    let extra = [
        ("api_key".to_string(), "k1".to_string()),
        ("region".to_string(), "eu".to_string()),
        ("tenant".to_string(), "acme".to_string()),
    ];
    assert_eq!(Policy::of(&r, "edge", &extra), Policy::AllowAll);
    assert_eq!(Policy::of(&r, "nowhere", &acme), Policy::AllowAll);
}

#[test]
fn blanket_rules_for_buckets_without_a_limit() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let out = q
        .report(
            1,
            "edge",
            &[
                usage(&[("tenant", "free")], 5, 5),
                usage(&[("tenant", "internal")], 5, 5),
            ],
            &r,
            SEC,
        )
        .expect("report");
    let mut got = strategies(&out, 1);
    got.sort_by_key(|s| format!("{s:?}"));
    assert_eq!(
        got,
        vec![
            Strategy::BlanketRule(BlanketRule::AllowAll as i32),
            Strategy::BlanketRule(BlanketRule::DenyAll as i32),
        ]
    );
}

#[test]
fn two_envoys_split_the_rule_and_the_sum_never_exceeds_it() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let bucket = [("tenant", "acme"), ("api_key", "k1")];
    let out = q
        .report(1, "edge", &[usage(&bucket, 500, 5)], &r, SEC)
        .expect("report");
    let (b1, r1) = tokens(&strategies(&out, 1)[0]);
    assert_eq!(b1, 180, "all but the newcomer reserve");
    assert!((r1 - 90.0).abs() < 0.01, "{r1}");
    let out = q
        .report(2, "edge", &[usage(&bucket, 500, 5)], &r, 2 * SEC)
        .expect("report");
    // 1 shrinks to its half at once, 2 gets the reserve until 1's first
    // assignment expires
    let (b1, r1) = tokens(&strategies(&out, 1)[0]);
    let (b2, r2) = tokens(&strategies(&out, 2)[0]);
    assert_eq!((b1, b2), (90, 20));
    assert!(
        (r1 - 45.0).abs() < 0.01 && (r2 - 10.0).abs() < 0.01,
        "{r1} {r2}"
    );
    // 1's first assignment (90 %) may still be enforced, beside 2's 10 %
    let fractions = q.assigned_fractions();
    assert_eq!(fractions.len(), 1, "{fractions:?}");
    assert_eq!(fractions[0].0, "edge");
    assert!((fractions[0].2 - 1.0).abs() < 1e-9, "{fractions:?}");
    // reports every 5 s; the ttl is 15 s: by 20 s the first assignment is gone
    let mut now = 2 * SEC;
    let mut last = (0, 0.0);
    for _ in 0..5 {
        now += 5 * SEC;
        // what 2 is sent may come with 1's report
        let out = q
            .report(1, "edge", &[usage(&bucket, 500, 5)], &r, now)
            .expect("report");
        if let Some(s) = strategies(&out, 2).first() {
            last = tokens(s);
        }
        let out = q
            .report(2, "edge", &[usage(&bucket, 500, 5)], &r, now)
            .expect("report");
        if let Some(s) = strategies(&out, 2).first() {
            last = tokens(s);
        }
        let out = q.tick(&r, now + SEC / 2);
        if let Some(s) = strategies(&out, 2).first() {
            last = tokens(s);
        }
    }
    assert_eq!(last.0, 90);
    assert!((last.1 - 45.0).abs() < 0.01, "{last:?}");
}

/// The last share sent to `stream` in any of `outs`.
fn last_share(outs: &[Outbox], stream: StreamId) -> Option<(u32, f64)> {
    outs.iter()
        .flat_map(|o| strategies(o, stream))
        .last()
        .map(|s| tokens(&s))
}

#[test]
fn a_closed_stream_leaves_its_buckets_to_the_others() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let bucket = [("tenant", "acme"), ("api_key", "k1")];
    let mut outs = Vec::new();
    let mut now = SEC;
    for _ in 0..5 {
        outs.push(
            q.report(1, "edge", &[usage(&bucket, 500, 5)], &r, now)
                .expect("report"),
        );
        outs.push(
            q.report(2, "edge", &[usage(&bucket, 500, 5)], &r, now)
                .expect("report"),
        );
        outs.push(q.tick(&r, now));
        now += 5 * SEC;
    }
    assert_eq!(last_share(&outs, 1).map(|s| s.0), Some(90));
    outs.push(q.close(2, &r, now));
    assert_eq!(q.streams(), 1);
    // 2's last assignment lives 15 s (three 5 s reports); then 1 gets
    // everything assignable
    for _ in 0..4 {
        now += 5 * SEC;
        outs.push(
            q.report(1, "edge", &[usage(&bucket, 500, 5)], &r, now)
                .expect("report"),
        );
        outs.push(q.tick(&r, now));
    }
    let (b1, r1) = last_share(&outs, 1).expect("shares for 1");
    assert_eq!(b1, 180);
    assert!((r1 - 90.0).abs() < 0.01, "{r1}");
}

#[test]
fn a_stream_that_stops_reporting_is_dropped_from_its_buckets() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let bucket = [("tenant", "acme"), ("api_key", "k1")];
    let mut outs = Vec::new();
    outs.push(
        q.report(1, "edge", &[usage(&bucket, 500, 5)], &r, SEC)
            .expect("report"),
    );
    outs.push(
        q.report(2, "edge", &[usage(&bucket, 500, 5)], &r, SEC)
            .expect("report"),
    );
    // only 1 keeps reporting: 2 leaves after 15 s without a report (until
    // then it is refreshed like any member), and its assignment expires 15 s
    // after it was last sent
    let mut now = SEC;
    let mut sent_to_2_after_leaving = 0;
    for _ in 0..10 {
        now += 5 * SEC;
        let a = q
            .report(1, "edge", &[usage(&bucket, 500, 5)], &r, now)
            .expect("report");
        let b = q.tick(&r, now);
        if now > 16 * SEC {
            sent_to_2_after_leaving += strategies(&a, 2).len() + strategies(&b, 2).len();
        }
        outs.push(a);
        outs.push(b);
    }
    let (_, r1) = last_share(&outs, 1).expect("shares for 1");
    assert!((r1 - 90.0).abs() < 0.01, "{r1}");
    assert_eq!(sent_to_2_after_leaving, 0);
}

#[test]
fn a_bucket_without_requests_for_five_minutes_is_abandoned() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let bucket = [("tenant", "acme"), ("api_key", "k1")];
    let other = [("tenant", "acme"), ("api_key", "k2")];
    let mut now = SEC;
    q.report(
        1,
        "edge",
        &[usage(&bucket, 5, 5), usage(&other, 5, 5)],
        &r,
        now,
    )
    .expect("report");
    let mut abandoned = Vec::new();
    // k1 idle from here on, k2 busy
    for _ in 0..70 {
        now += 5 * SEC;
        q.report(
            1,
            "edge",
            &[usage(&bucket, 0, 5), usage(&other, 5, 5)],
            &r,
            now,
        )
        .expect("report");
        for (stream, response) in q.tick(&r, now) {
            for a in response.bucket_action {
                if let Some(Action::AbandonAction(_)) = a.bucket_action {
                    abandoned.push((stream, now, a.bucket_id.expect("id")));
                }
            }
        }
    }
    assert_eq!(abandoned.len(), 1, "{abandoned:?}");
    let (stream, at, id) = &abandoned[0];
    assert_eq!(*stream, 1);
    assert_eq!(id.bucket.get("api_key").map(String::as_str), Some("k1"));
    // idle since its first empty report at 6 s: abandoned 300 s later
    assert_eq!(*at, 306 * SEC);
}

#[test]
fn each_of_n_instances_splits_one_nth_of_the_budget() {
    let r = rules(RULES);
    let mut q = Quotas::for_instances(2);
    let bucket = [("tenant", "acme"), ("api_key", "k1")];
    let out = q
        .report(1, "edge", &[usage(&bucket, 500, 5)], &r, SEC)
        .expect("report");
    // half of {100/s, burst 200}, less the newcomer reserve
    let (b, rate) = tokens(&strategies(&out, 1)[0]);
    assert_eq!(b, 90);
    assert!((rate - 45.0).abs() < 0.01, "{rate}");
    assert!((q.assigned_fractions()[0].2 - 0.9).abs() < 1e-9);
}

#[test]
fn the_first_report_must_name_the_domain() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let err = q
        .report(1, "", &[usage(&[("tenant", "acme")], 1, 1)], &r, SEC)
        .expect_err("no domain");
    assert!(err.contains("domain"), "{err}");
}

#[test]
fn token_buckets_never_exceed_the_share() {
    for (burst, rate) in [
        (200.0, 100.0),
        (10.5, 0.3),
        (1.0, 1e-3),
        (5.0, 7.7),
        (0.9, 5.0),
    ] {
        match token_bucket(Budget { burst, rate }) {
            Strategy::TokenBucket(tb) => {
                let fill = tb.fill_interval.expect("interval");
                assert!(
                    fill.seconds >= 1 && fill.nanos == 0,
                    "whole seconds: {fill:?}"
                );
                let s = token_bucket(Budget { burst, rate });
                let (b, r) = tokens(&s);
                assert!(
                    f64::from(b) <= burst && r <= rate + 1e-9,
                    "{burst} {rate}: {b} {r}"
                );
            }
            Strategy::BlanketRule(rule) => {
                assert_eq!(rule, BlanketRule::DenyAll as i32);
                assert!(burst < 1.0);
            }
            other => panic!("{other:?}"),
        }
    }
}

/// Answers the steps `q` queued with one in-process [`ledger::Ledger`] per
/// bucket (as the Redis ledger would, with `now` as its clock).
fn answer_steps(
    q: &mut Quotas,
    ledgers: &mut HashMap<BucketKey, ledger::Ledger>,
    now: u64,
) -> Outbox {
    let answers = q
        .take_steps()
        .into_iter()
        .map(|step| {
            let args =
                ledger::StepArgs::new(step.demand, step.budget, (step.ttl_micros / 1000) as i64);
            let field = ledger::Member { replica: 7 }.field();
            let reply = ledgers.entry(step.key.clone()).or_default().step(
                &field,
                args,
                (now / 1000) as i64,
            );
            let shared = ledger::shared_from_reply(&reply).expect("reply");
            (step, shared)
        })
        .collect();
    q.granted(answers, now)
}

/// Until when each assignment in `out` for `stream` lives.
fn lives_until(out: &Outbox, stream: StreamId, now: u64) -> Option<u64> {
    out.iter()
        .filter(|(s, _)| *s == stream)
        .flat_map(|(_, r)| &r.bucket_action)
        .filter_map(|a| match &a.bucket_action {
            Some(Action::QuotaAssignmentAction(q)) => q.assignment_time_to_live,
            _ => None,
        })
        .map(|d| now + d.seconds as u64 * SEC + d.nanos as u64 / 1000)
        .max()
}

/// An Envoy reporting every 5 s, with ticks every second: what it holds
/// never lapses, also when its first report interval is learnt and the time
/// to live grows from 3 s to 15 s (the refresh must follow the life of what
/// was sent, not of what would be sent now; it lapsed on a shared ledger,
/// whose kept share is not re-sent as moved). Both the local split and the
/// shared ledger.
#[test]
fn an_assignment_never_lapses_while_its_envoy_reports() {
    let r = rules(RULES);
    let bucket = [("tenant", "acme"), ("api_key", "k1")];
    for shared in [false, true] {
        let mut q = if shared {
            Quotas::shared()
        } else {
            Quotas::default()
        };
        let mut ledgers = HashMap::new();
        let mut live_until = 0;
        let mut sends = 0;
        for tenth in 10..400u64 {
            let now = tenth * SEC / 10;
            let mut out = Vec::new();
            if tenth % 50 == 0 {
                out.extend(
                    q.report(1, "edge", &[usage(&bucket, 500, 5)], &r, now)
                        .expect("report"),
                );
            }
            if tenth % 10 == 3 {
                out.extend(q.tick(&r, now));
            }
            out.extend(answer_steps(&mut q, &mut ledgers, now));
            if sends > 0 {
                assert!(now < live_until, "lapsed at {now} (shared: {shared})");
            }
            if let Some(until) = lives_until(&out, 1, now) {
                live_until = until;
                sends += 1;
            }
        }
        assert!(sends > 5, "{sends}");
    }
}

/// Reports Envoy should not send are passed over one by one (counted), and
/// the rest of the message is served; the stream goes on.
#[test]
fn a_report_without_a_bucket_id_is_passed_over() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let mut missing = usage(&[], 1, 1);
    missing.bucket_id = None;
    let out = q
        .report(
            1,
            "edge",
            &[
                usage(&[], 1, 1),
                missing,
                usage(&[("tenant", "free")], 1, 1),
            ],
            &r,
            SEC,
        )
        .expect("served");
    assert_eq!(q.take_dropped(), (2, 0));
    assert_eq!(
        strategies(&out, 1),
        vec![Strategy::BlanketRule(BlanketRule::DenyAll as i32)]
    );
}

/// `time_elapsed` 0 (or none, or negative) counts over the stream's usual
/// interval, else one second: 100 requests so reported are 100/s of
/// demand, not 100,000/s.
#[test]
fn a_report_without_elapsed_time_counts_over_the_usual_interval() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let bucket = [("tenant", "acme"), ("api_key", "k1")];
    let mut zero = usage(&bucket, 100, 0);
    q.report(1, "edge", &[zero.clone()], &r, SEC)
        .expect("report");
    q.report(2, "edge", &[usage(&bucket, 100, 1)], &r, SEC)
        .expect("report");
    zero.time_elapsed = None;
    q.report(1, "edge", &[zero], &r, 2 * SEC).expect("report");
    q.report(2, "edge", &[usage(&bucket, 100, 1)], &r, 2 * SEC)
        .expect("report");
    // equal demand: equal targets (45 each once the first 90 expired)
    let mut outs = Vec::new();
    for s in 3..=20 {
        outs.push(q.tick(&r, s * SEC));
    }
    assert_eq!(last_share(&outs, 1), last_share(&outs, 2));
    assert_eq!(last_share(&outs, 1).map(|s| s.0), Some(90));
}

/// A domain without rules gets ALLOW_ALL; a stream that names another
/// domain later stays in its first one (one stream per domain).
#[test]
fn unknown_domains_allow_and_a_stream_keeps_its_first_domain() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let out = q
        .report(1, "nowhere", &[usage(&[("tenant", "free")], 1, 1)], &r, SEC)
        .expect("served");
    assert_eq!(
        strategies(&out, 1),
        vec![Strategy::BlanketRule(BlanketRule::AllowAll as i32)]
    );
    let out = q
        .report(2, "edge", &[usage(&[("tenant", "free")], 1, 1)], &r, SEC)
        .expect("served");
    assert_eq!(
        strategies(&out, 2),
        vec![Strategy::BlanketRule(BlanketRule::DenyAll as i32)]
    );
    // stream 2 names "nowhere" now: a new bucket is still edge's (a token
    // bucket of its acme rule, where "nowhere" would allow all)
    let out = q
        .report(
            2,
            "nowhere",
            &[usage(&[("tenant", "acme"), ("api_key", "k9")], 1, 1)],
            &r,
            2 * SEC,
        )
        .expect("served");
    assert_eq!(tokens(&strategies(&out, 2)[0]).0, 180);
}

/// One stream reporting more buckets than it may hold: the first
/// [`MAX_BUCKETS_PER_STREAM`] are served, the rest counted and passed over;
/// buckets it holds already are still served after.
#[test]
fn a_stream_holds_at_most_max_buckets() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let values: Vec<String> = (0..MAX_BUCKETS_PER_STREAM + 5)
        .map(|i| format!("k{i}"))
        .collect();
    let usages: Vec<BucketQuotaUsage> = values
        .iter()
        .map(|v| usage(&[("tenant", "acme"), ("api_key", v)], 1, 1))
        .collect();
    let out = q.report(1, "edge", &usages, &r, SEC).expect("served");
    assert_eq!(strategies(&out, 1).len(), MAX_BUCKETS_PER_STREAM);
    assert_eq!(q.take_dropped(), (0, 5));
    let out = q
        .report(1, "edge", &usages[..3], &r, 2 * SEC)
        .expect("served");
    assert_eq!(q.take_dropped(), (0, 0));
    let _ = out;
    assert_eq!(q.buckets(), MAX_BUCKETS_PER_STREAM);
}

/// What a report and a tick cost: a report the buckets in it and their
/// members, a tick the buckets that are due; never buckets × streams (it
/// was: every report pruned every pair, every tick planned every bucket
/// scanning every stream, under the lock the serving threads waited on).
#[test]
fn a_report_costs_its_buckets_and_a_tick_the_due_ones() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let streams = 50u64;
    let per_stream = 200;
    let shared = [("tenant", "acme"), ("api_key", "everyone")];
    for s in 1..=streams {
        let mut usages: Vec<BucketQuotaUsage> = (0..per_stream)
            .map(|i| {
                usage(
                    &[("tenant", "acme"), ("api_key", &format!("s{s}-k{i}"))],
                    5,
                    5,
                )
            })
            .collect();
        usages.push(usage(&shared, 5, 5));
        q.report(s, "edge", &usages, &r, SEC).expect("report");
    }
    assert_eq!(q.pairs(), (streams * (per_stream + 1)) as usize);
    q.take_visited();
    // nothing is due half a second later: a tick looks at nothing
    assert!(q.tick(&r, SEC + SEC / 2).is_empty());
    assert_eq!(q.take_visited(), 0);
    // one bucket of one stream: that pair (and the bucket's one member)
    q.report(
        7,
        "edge",
        &[usage(&[("tenant", "acme"), ("api_key", "s7-k3")], 5, 5)],
        &r,
        2 * SEC,
    )
    .expect("report");
    assert!(q.take_visited() <= 2);
    // the bucket every stream reports: its members, not the other buckets
    q.report(7, "edge", &[usage(&shared, 5, 5)], &r, 2 * SEC)
        .expect("report");
    assert!(q.take_visited() <= 1 + 2 * streams);
    // every stream reports that bucket within the next second: one plan
    // serves them all (each report planning it was streams² visits)
    for s in 1..=streams {
        q.report(s, "edge", &[usage(&shared, 5, 5)], &r, 3 * SEC + s)
            .expect("report");
    }
    assert!(q.take_visited() <= 3 * streams);
    // a second of ticks while every stream reports every 5 s: the refreshes
    // come due a few times per time to live, not every bucket every tick
    for t in 2..=30 {
        if t % 5 == 0 {
            for s in 1..=streams {
                let usages: Vec<BucketQuotaUsage> = (0..per_stream)
                    .map(|i| {
                        usage(
                            &[("tenant", "acme"), ("api_key", &format!("s{s}-k{i}"))],
                            5,
                            5,
                        )
                    })
                    .collect();
                q.report(s, "edge", &usages, &r, t * SEC).expect("report");
            }
        }
        q.tick(&r, t * SEC);
    }
    let pairs = q.pairs() as u64;
    let visited = q.take_visited();
    // reports, refreshes and expiries: a few visits per pair per report
    // interval (20 per pair over these 29 s), less than one per pair per
    // second; the old scan cost 29 ticks × pairs × streams (50 per pair per
    // second)
    assert!(visited < 29 * pairs, "{visited} visits for {pairs} pairs");
}

/// Bucket ids are bounded like descriptors (entries, key and value
/// length), counted `invalid` when over; and however many buckets one
/// response carries, each message stays under the size every gRPC client
/// takes by default (one stream of 1 MB values grew the service by 1 GB).
#[test]
fn bucket_ids_are_bounded_and_responses_split_below_the_message_limit() {
    let r = rules(RULES);
    let mut q = Quotas::default();
    let long = "x".repeat(MAX_ID_KEY_OR_VALUE_BYTES + 1);
    let many: Vec<(String, String)> = (0..=MAX_ID_ENTRIES)
        .map(|i| (format!("k{i}"), "v".to_string()))
        .collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let out = q
        .report(
            1,
            "edge",
            &[
                usage(&[("tenant", "acme"), ("api_key", &long)], 1, 5),
                usage(&[(&long, "acme")], 1, 5),
                usage(&many, 1, 5),
            ],
            &r,
            SEC,
        )
        .expect("served");
    assert!(out.is_empty());
    assert_eq!(q.take_dropped(), (3, 0));
    assert_eq!(q.pairs(), 0);
    // 10,000 buckets of 1,000-byte values: all assigned, in messages of at
    // most MAX_MESSAGE_BYTES
    let value = |i: usize| format!("{i:01000}");
    let values: Vec<String> = (0..10_000).map(value).collect();
    let usages: Vec<BucketQuotaUsage> = values
        .iter()
        .map(|v| usage(&[("tenant", "acme"), ("api_key", v)], 1, 5))
        .collect();
    let out = q.report(2, "edge", &usages, &r, SEC).expect("served");
    assert!(
        out.len() > 1,
        "one message of {} actions",
        out[0].1.bucket_action.len()
    );
    for (_, m) in &out {
        assert!(prost::Message::encoded_len(m) <= assignment::MAX_MESSAGE_BYTES);
    }
    assert_eq!(strategies(&out, 2).len(), 10_000);
}

mod churn;
mod share_threshold;
mod without_ledger;

/// Σ reserved in one bucket (what its members may enforce now).
fn reserved_in(q: &Quotas, pairs: &[(&str, &str)], now: u64) -> Budget {
    let key = BucketKey::new(
        "edge",
        &BucketId {
            bucket: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        },
    );
    q.buckets
        .get(&key)
        .map_or(Budget::ZERO, |b| b.allocation.reserved(now))
}

#[test]
fn regions_split_their_part_and_b_over_n_stays_for_each_region_not_reporting() {
    let rules = rules(RULES);
    let id = [("tenant", "acme"), ("api_key", "k")];
    let mut q = Quotas::for_instances(1);
    // three regions; budget B = 200, r = 100
    let (a, b) = (1, 2);
    q.add_region_stream(a, 3);
    q.add_region_stream(b, 3);
    let mut now = SEC;
    let out = q
        .report(a, "edge", &[usage(&id, 1000, 1)], &rules, now)
        .expect("report");
    // alone, region a gets at most a third: the others keep their floors
    let (burst, rate) = tokens(&strategies(&out, a)[0]);
    assert!(burst <= 66 && rate <= 33.4, "{burst} {rate}");
    assert!(
        burst >= 50,
        "a loud region alone gets most of its third: {burst}"
    );
    for _ in 0..10 {
        now += SEC;
        q.report(a, "edge", &[usage(&id, 1000, 1)], &rules, now)
            .expect("report");
        q.report(b, "edge", &[usage(&id, 10, 1)], &rules, now)
            .expect("report");
        q.tick(&rules, now);
        // with the third region's floor (B/3, r/3) kept out: ≤ 2/3 of the budget
        let r = reserved_in(&q, &id, now);
        assert!(r.burst <= 200.0 * 2.0 / 3.0 + 1e-6, "{r:?}");
        assert!(r.rate <= 100.0 * 2.0 / 3.0 + 1e-6, "{r:?}");
    }
    // region b joined with its floor counted as live at once
    let seeded = q
        .buckets
        .values()
        .next()
        .and_then(|bk| bk.allocation.current(&(b, 0)))
        .expect("b has a share");
    assert!(seeded.burst > 0.0);
    // a loud region gets most of the two regions' part
    let key = q.buckets.keys().next().expect("bucket").clone();
    let bucket = &q.buckets[&key];
    let (sa, sb) = (
        bucket.allocation.current(&(a, 0)).expect("a"),
        bucket.allocation.current(&(b, 0)).expect("b"),
    );
    assert!(sa.rate > 3.0 * sb.rate, "{sa:?} {sb:?}");
}

/// The share `member` holds in the only bucket.
fn current(q: &Quotas, member: StreamId) -> Budget {
    let bucket = q.buckets.values().next().expect("bucket");
    bucket.allocation.current(&(member, 0)).expect("a share")
}

#[test]
fn a_regions_demand_is_the_sum_of_its_instances() {
    let rules = rules(RULES);
    let id = [("tenant", "acme"), ("api_key", "k")];
    let mut q = Quotas::for_instances(1);
    // region a: two instances (streams 11, 12) at 50/s each; region b: one
    // instance (stream 21) at 100/s. Members 1 and 2.
    q.add_region_stream(1, 2);
    q.add_region_stream(2, 2);
    let mut now = SEC;
    for _ in 0..12 {
        q.report_part(1, 11, "edge", &[usage(&id, 50, 1)], &rules, now)
            .expect("report");
        q.report_part(1, 12, "edge", &[usage(&id, 50, 1)], &rules, now + SEC / 2)
            .expect("report");
        q.report_part(2, 21, "edge", &[usage(&id, 100, 1)], &rules, now)
            .expect("report");
        now += SEC;
        q.tick(&rules, now);
    }
    let (a, b) = (current(&q, 1), current(&q, 2));
    assert!(
        (a.rate - b.rate).abs() <= 0.05 * b.rate,
        "equal demand, equal shares: {a:?} {b:?}"
    );
    // an instance that stops reporting leaves the sum: a's demand halves
    for _ in 0..10 {
        q.report_part(1, 11, "edge", &[usage(&id, 50, 1)], &rules, now)
            .expect("report");
        q.report_part(2, 21, "edge", &[usage(&id, 100, 1)], &rules, now)
            .expect("report");
        now += SEC;
        q.tick(&rules, now);
    }
    let (a, b) = (current(&q, 1), current(&q, 2));
    assert!(a.rate < 0.75 * b.rate, "{a:?} {b:?}");
}

/// #66: a replica leaving says farewell: an Envoy that came seconds ago
/// (its cadence not known, its assignments living 3 s) is sent what it
/// holds again at once, living 15 s (three of Envoy's 5 s reports: it
/// reconnects elsewhere on the next), reserved that long in the shared
/// ledger first; an Envoy already on 15 s keeps what it has. Both the
/// local split and the shared ledger.
#[test]
fn a_leaving_replica_makes_what_each_envoy_holds_outlive_its_reconnection() {
    let r = rules(RULES);
    let bucket = [("tenant", "acme"), ("api_key", "k1")];
    for shared in [false, true] {
        let mut q = if shared {
            Quotas::shared()
        } else {
            Quotas::default()
        };
        let mut ledgers = HashMap::new();
        let now = SEC;
        let mut first = q
            .report(1, "edge", &[usage(&bucket, 500, 5)], &r, now)
            .expect("report");
        first.extend(answer_steps(&mut q, &mut ledgers, now));
        assert_eq!(
            lives_until(&first, 1, now),
            Some(now + 3 * SEC),
            "a newcomer's assignment lives 3 s (shared: {shared})"
        );
        let later = now + SEC / 2;
        let mut farewell = q.farewell(&r, later);
        farewell.extend(answer_steps(&mut q, &mut ledgers, later));
        assert_eq!(
            lives_until(&farewell, 1, later),
            Some(later + 15 * SEC),
            "sent again, living 15 s (shared: {shared})"
        );
        assert_eq!(
            last_share(&[first], 1),
            last_share(&[farewell], 1),
            "the same share (shared: {shared})"
        );
    }
}
