//! RLQS and `share_threshold`: every bucket id whose value a shared
//! pattern matches spends one budget, as `ShouldRateLimit` spends one
//! bucket (audit #25, item 3).

use super::*;

const SHARED: &str = r#"
domain: edge
descriptors:
  - key: path
    value: "/api/*"
    share_threshold: true
    rate_limit: {unit: second, requests_per_unit: 10, burst: 10}
  - key: path
    value: "/web/*"
    rate_limit: {unit: second, requests_per_unit: 10, burst: 10}
"#;

const NOT_SHARED: &str = r#"
domain: edge
descriptors:
  - key: path
    value: "/api/*"
    rate_limit: {unit: second, requests_per_unit: 10, burst: 10}
"#;

/// The (stream, path value) of each assignment in `outs`, with the last
/// token bucket sent for it.
fn shares(outs: &[&Outbox]) -> BTreeMap<(StreamId, String), (u32, f64)> {
    let mut last = BTreeMap::new();
    for out in outs {
        for (stream, response) in out.iter() {
            for a in &response.bucket_action {
                let id = a.bucket_id.as_ref().expect("an id");
                let path = id.bucket.get("path").expect("a path").clone();
                if let Some(Action::QuotaAssignmentAction(q)) = &a.bucket_action {
                    let s = q
                        .rate_limit_strategy
                        .and_then(|s| s.strategy)
                        .expect("strategy");
                    // a share too small for one token is sent as DENY_ALL
                    let share = match s {
                        Strategy::BlanketRule(_) => (0, 0.0),
                        s => tokens(&s),
                    };
                    last.insert((*stream, path), share);
                }
            }
        }
    }
    last
}

fn paths(values: &[&str]) -> Vec<BucketQuotaUsage> {
    values.iter().map(|v| usage(&[("path", v)], 5, 5)).collect()
}

fn sum(shares: &BTreeMap<(StreamId, String), (u32, f64)>, prefix: &str) -> (u32, f64) {
    shares
        .iter()
        .filter(|((_, path), _)| path.starts_with(prefix))
        .fold((0, 0.0), |(b, r), (_, (sb, sr))| (b + sb, r + sr))
}

/// The audit's case: one report of four `/api/*` paths was assigned 9/s
/// each (36/s for a 10/s rule). Now they split the one budget, named by
/// the ids Envoy sent; `/web/*` (no `share_threshold`) stays one budget
/// per path.
#[test]
fn paths_a_shared_pattern_matches_split_one_budget() {
    let r = rules(SHARED);
    let mut q = Quotas::default();
    let out = q
        .report(
            1,
            "edge",
            &paths(&["/api/a", "/api/b", "/api/c", "/api/d", "/web/a", "/web/b"]),
            &r,
            SEC,
        )
        .expect("report");
    let s = shares(&[&out]);
    assert_eq!(s.len(), 6, "every id answered at once: {s:?}");
    let (burst, rate) = sum(&s, "/api/");
    assert!(burst <= 10 && rate <= 10.0 + 1e-9, "{s:?}");
    assert!(rate >= 8.0, "most of the budget: {s:?}");
    for web in ["/web/a", "/web/b"] {
        assert_eq!(s[&(1, web.to_string())].0, 9, "own budgets: {s:?}");
    }
    assert_eq!(q.buckets(), 3, "one shared bucket and two of their own");
    assert_eq!(q.pairs(), 6);
}

/// The shares in `sent` (each outbox with when it was sent) still live at
/// `now` (what Envoys may enforce), last per (stream, path).
fn live(sent: &[(u64, Outbox)], now: u64) -> BTreeMap<(StreamId, String), (u32, f64)> {
    let mut last: BTreeMap<(StreamId, String), ((u32, f64), u64)> = BTreeMap::new();
    for (at, out) in sent {
        for (stream, response) in out {
            for a in &response.bucket_action {
                let path = a.bucket_id.as_ref().expect("an id").bucket["path"].clone();
                let Some(Action::QuotaAssignmentAction(q)) = &a.bucket_action else {
                    continue;
                };
                let ttl = q.assignment_time_to_live.as_ref().expect("ttl").seconds as u64 * SEC;
                let share = shares(&[&vec![(*stream, response.clone())]])[&(*stream, path.clone())];
                last.insert((*stream, path), (share, at + ttl));
            }
        }
    }
    last.into_iter()
        .filter(|(_, (_, until))| *until > now)
        .map(|(k, (share, _))| (k, share))
        .collect()
}

/// Two Envoys, overlapping paths, over a minute of reports and ticks (one
/// pair falls quiet half way): at every step Σ of what every (Envoy, id)
/// may enforce stays within the budget, and every reporting pair keeps a
/// share.
#[test]
fn envoys_and_ids_together_never_exceed_the_shared_budget() {
    let r = rules(SHARED);
    let mut q = Quotas::default();
    let mut sent: Vec<(u64, Outbox)> = Vec::new();
    let mut now = SEC;
    for round in 0..12 {
        let a = q
            .report(1, "edge", &paths(&["/api/a", "/api/b"]), &r, now)
            .expect("report");
        sent.push((now, a));
        let ids: &[&str] = if round < 6 {
            &["/api/a", "/api/c"]
        } else {
            &["/api/c"]
        };
        let b = q
            .report(2, "edge", &paths(ids), &r, now + SEC / 10)
            .expect("report");
        sent.push((now + SEC / 10, b));
        let t = q.tick(&r, now + SEC);
        sent.push((now + SEC, t));
        for at in [now, now + SEC / 10, now + SEC] {
            let s = live(&sent, at);
            let (burst, rate) = sum(&s, "/api/");
            assert!(burst <= 10 && rate <= 10.0 + 1e-9, "round {round}: {s:?}");
        }
        now += 5 * SEC;
    }
    let s = live(&sent, now);
    for pair in [(1, "/api/a"), (1, "/api/b"), (2, "/api/c")] {
        assert!(s[&(pair.0, pair.1.to_string())].1 > 0.0, "{pair:?}: {s:?}");
    }
    assert!(!s.contains_key(&(2, "/api/a".to_string())), "{s:?}");
}

/// A reload that adds `share_threshold` moves every id into the shared
/// bucket at its next report (and one that takes it away, back into
/// buckets of their own); nothing is left behind once the old assignments
/// expire.
#[test]
fn a_reload_moves_ids_in_and_out_of_the_shared_bucket() {
    let own = rules(NOT_SHARED);
    let shared = rules(SHARED).with_generation(2);
    let back = rules(NOT_SHARED).with_generation(3);
    let mut q = Quotas::default();
    let ids = ["/api/a", "/api/b", "/api/c"];
    let out = q
        .report(1, "edge", &paths(&ids), &own, SEC)
        .expect("report");
    assert_eq!(
        sum(&shares(&[&out]), "/api/").0,
        27,
        "own budgets of 10 (9 + reserve)"
    );
    assert_eq!(q.buckets(), 3);

    q.tick(&shared, 2 * SEC);
    assert_eq!(q.pairs(), 0, "the ids left their own buckets");
    let out = q
        .report(1, "edge", &paths(&ids), &shared, 3 * SEC)
        .expect("report");
    let s = shares(&[&out]);
    assert_eq!(s.len(), 3, "{s:?}");
    let (burst, rate) = sum(&s, "/api/");
    assert!(burst <= 10 && rate <= 10.0 + 1e-9, "{s:?}");
    assert_eq!(q.pairs(), 3);

    q.tick(&back, 4 * SEC);
    assert_eq!(q.pairs(), 0);
    let out = q
        .report(1, "edge", &paths(&ids), &back, 5 * SEC)
        .expect("report");
    assert_eq!(shares(&[&out]).len(), 3);
    // the old buckets are forgotten once what they assigned has expired
    q.tick(&back, 60 * SEC);
    q.close(1, &back, 61 * SEC);
    q.tick(&back, 120 * SEC);
    assert_eq!((q.buckets(), q.pairs(), q.key_bytes), (0, 0, 0));
}

/// The second audit's case (#43 item 5): two Envoys split the shared
/// bucket of `/api/*` for the same id; a reload takes `share_threshold`
/// away, so the id spends a bucket of its own. The first Envoy to report
/// there must not take what the other still enforces from the shared
/// bucket's assignment (before: 9 of 10, beside the other's 4, for 4 s).
#[test]
fn a_moving_pairs_live_grant_is_carried_into_its_new_bucket() {
    let shared = rules(SHARED);
    let own = rules(NOT_SHARED).with_generation(2);
    let mut q = Quotas::default();
    let mut sent: Vec<(u64, Outbox)> = Vec::new();
    let mut now = SEC;
    // a minute of reports every 5 s: the two converge on halves
    for _ in 0..12 {
        for stream in [1, 2] {
            let out = q
                .report(stream, "edge", &paths(&["/api/a"]), &shared, now)
                .expect("report");
            sent.push((now, out));
        }
        sent.push((now + SEC, q.tick(&shared, now + SEC)));
        now += 5 * SEC;
    }
    let before = live(&sent, now);
    assert!(before[&(2, "/api/a".to_string())].0 >= 3, "{before:?}");
    // the reload, then envoy 1 reports first in the id's own bucket
    sent.push((now, q.tick(&own, now)));
    let out = q
        .report(1, "edge", &paths(&["/api/a"]), &own, now + SEC / 10)
        .expect("report");
    sent.push((now + SEC / 10, out));
    for at in [now + SEC / 10, now + SEC, now + 3 * SEC] {
        let s = live(&sent, at);
        let (burst, rate) = sum(&s, "/api/a");
        assert!(burst <= 10 && rate <= 10.0 + 1e-9, "at {at}: {s:?}");
    }
    // once the carried grant has expired, envoy 1 may have most of it
    for t in 1..=20 {
        let at = now + t * SEC;
        let out = q
            .report(1, "edge", &paths(&["/api/a"]), &own, at)
            .expect("report");
        sent.push((at, out));
        sent.push((at, q.tick(&own, at)));
    }
    let s = live(&sent, now + 20 * SEC);
    assert!(s[&(1, "/api/a".to_string())].0 >= 8, "{s:?}");
}

/// With a shared ledger, the shared bucket is one record, stepped once for
/// this replica's three (stream, id) pairs: the ledger gives the replica
/// its share, which it splits between them.
#[test]
fn a_shared_ledger_splits_the_shared_bucket_between_pairs() {
    let r = rules(SHARED);
    let mut q = Quotas::shared();
    let mut ledgers = HashMap::new();
    q.report(1, "edge", &paths(&["/api/a", "/api/b"]), &r, SEC)
        .expect("report");
    q.report(2, "edge", &paths(&["/api/a"]), &r, SEC)
        .expect("report");
    let steps = q.take_steps();
    let keys: HashSet<&BucketKey> = steps.iter().map(|s| &s.key).collect();
    assert_eq!(keys.len(), 1, "one record: {steps:?}");
    assert_eq!(steps.len(), 1, "one step: {steps:?}");
    assert_eq!(steps[0].demand.map(|d| d.pairs), Some(3), "{steps:?}");
    // queue them again and answer them
    q.tick(&r, 2 * SEC);
    let mut outs = Vec::new();
    for step in 0..5 {
        let now = (3 + 5 * step) * SEC;
        q.report(1, "edge", &paths(&["/api/a", "/api/b"]), &r, now)
            .expect("report");
        q.report(2, "edge", &paths(&["/api/a"]), &r, now)
            .expect("report");
        outs.push(answer_steps(&mut q, &mut ledgers, now));
        let s = shares(&outs.iter().collect::<Vec<_>>());
        let (burst, rate) = sum(&s, "/api/");
        assert!(burst <= 10 && rate <= 10.0 + 1e-9, "{s:?}");
    }
    let s = shares(&outs.iter().collect::<Vec<_>>());
    assert_eq!(s.len(), 3, "{s:?}");
}

/// One shared bucket is split between at most
/// [`MAX_PAIRS_PER_SHARED_BUCKET`] pairs; the rest are counted and passed
/// over (a report costs what it holds, not what the bucket holds).
#[test]
fn a_shared_bucket_holds_at_most_its_pairs() {
    let r = rules(SHARED);
    let mut q = Quotas::default();
    let values: Vec<String> = (0..MAX_PAIRS_PER_SHARED_BUCKET + 3)
        .map(|i| format!("/api/{i}"))
        .collect();
    let refs: Vec<&str> = values.iter().map(String::as_str).collect();
    q.report(1, "edge", &paths(&refs), &r, SEC).expect("report");
    assert_eq!(q.pairs(), MAX_PAIRS_PER_SHARED_BUCKET);
    assert_eq!(q.take_dropped(), (0, 3));
}

/// `check-config --rlqs` and `/config` say which values share a budget.
#[test]
fn the_rule_notes_name_the_shared_pattern() {
    let r = rules(SHARED);
    let described = describe_domain(&r, "edge").to_string();
    assert!(
        described.contains(
            "share_threshold: every bucket id whose 'path' matches '/api/*' spends one budget"
        ),
        "{described}"
    );
    assert_eq!(
        described.matches("share_threshold").count(),
        1,
        "{described}"
    );
}
