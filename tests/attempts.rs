//! Attempts (#39): a descriptor entry a rule names (`attempts.key`, from
//! Envoy's `x-request-id`) identifies the attempt, and the phase entry
//! (`phase: done`) the call Envoy makes when the stream is done. Over real
//! gRPC, on the memory store, a real Redis and a Redis Cluster with two
//! instances: reservations that hold concurrent chats to the budget and
//! settle exactly once, repeats answered free, the stated answers for bad
//! input, and the counters.

mod common;

use std::time::Duration;

use common::redis::{RedisCluster, RedisServer};
use common::{client, descriptor, request, rules_dir, sample, serve_args, start_on_redis};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::UInt64Value;
use tokenbucket_rls::server::RunningServer;
use tonic::transport::Channel;

/// Budgets per day: the refill adds less than a token over a test.
const RULES: &str = r#"
domain: llm
descriptors:
  - key: user
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 1000, burst: 1000, name: llm-tokens}
    attempts: {key: request_id, ttl: 1m, reserve: 600}
  - key: api
    rate_limit: {unit: day, requests_per_unit: 5, name: api-calls}
    attempts: {key: request_id, ttl: 1m}
  - key: streams
    concurrency: 3
    attempts: {key: request_id, ttl: 2s}
  - key: tenant
    overdraft: true
    rate_limit:
      unit: month
      requests_per_unit: 1000
      name: month-tokens
      calendar: {time_zone: America/New_York, starts: 15}
    attempts: {key: request_id, ttl: 1m, reserve: 600}
  - key: daily_window
    algorithm: fixed_window
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 1000, name: window-tokens}
    attempts: {key: request_id, ttl: 1m, reserve: 600}
  - key: sliding_window
    algorithm: sliding_window
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 1000, name: sliding-tokens}
    attempts: {key: request_id, ttl: 1m, reserve: 600}
  - key: window_calls
    algorithm: fixed_window
    rate_limit: {unit: day, requests_per_unit: 5, name: window-calls}
    attempts: {key: request_id, ttl: 1m}
  - key: team
    overdraft: true
    max_debt: 100
    rate_limit: {unit: day, requests_per_unit: 1000, name: team-tokens}
    attempts: {key: request_id, ttl: 1m}
"#;

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

/// A call for `user` (or another key) with attempt `id`, `done` or not,
/// with its own `hits_addend` when given.
async fn call(
    c: &mut RateLimitServiceClient<Channel>,
    key: &str,
    value: &str,
    id: Option<&str>,
    done: bool,
    hits: Option<u64>,
) -> RateLimitResponse {
    let mut entries = vec![(key, value)];
    if let Some(id) = id {
        entries.push(("request_id", id));
    }
    if done {
        entries.push(("phase", "done"));
    }
    let mut d = descriptor(&entries);
    d.hits_addend = hits.map(|value| UInt64Value { value });
    c.should_rate_limit(request("llm", vec![d]))
        .await
        .expect("decided")
        .into_inner()
}

async fn start() -> (RunningServer, tempfile::TempDir) {
    let rules = rules_dir(RULES);
    let server = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("server starts");
    (server, rules)
}

/// Every scenario on one server: the memory store, or one on Redis.
async fn scenarios(server: &RunningServer) {
    twenty_chats(server, server).await;
    estimates_below_the_reserve(server).await;
    settlements(server).await;
    repeats(server).await;
    entries(server).await;
    slots(server, server).await;
    debts(server).await;
    monthly(server, server).await;
    windows(server, server).await;
    reused(server).await;
}

/// Fixed and sliding windows reserve and dedupe as a token bucket does
/// (issue 51: they refused `attempts:`): one of twenty 600-token chats in
/// flight on 1,000 a day, the refused ones taking nothing (on a fixed
/// window too, where a plain refused hit counts), settled at what it used;
/// a retried start on a window of calls counted once.
async fn windows(server: &RunningServer, other: &RunningServer) {
    let c = client(server).await;
    let d = client(other).await;
    for key in ["daily_window", "sliding_window"] {
        let admitted = chats_at_once(&c, &d, key, "acme").await;
        assert_eq!(admitted.len(), 1, "{key}: {admitted:?}");
        let mut c = d.clone();
        let r = call(&mut c, key, "acme", None, false, Some(0)).await;
        assert_eq!(remaining(&r), 400, "{key}: 600 reserved");
        let r = call(&mut c, key, "acme", Some(&admitted[0]), true, Some(250)).await;
        assert_eq!(
            (r.overall_code, remaining(&r)),
            (OK, 750),
            "{key}: settled at 250"
        );
    }
    let mut c = client(server).await;
    for _ in 0..3 {
        let r = call(&mut c, "window_calls", "acme", Some("once"), false, None).await;
        assert_eq!(r.overall_code, OK);
    }
    let r = call(&mut c, "window_calls", "acme", Some("twice"), false, None).await;
    assert_eq!(remaining(&r), 3, "the retried start counted once");
}

/// One id sent a hundred times on a dedupe rule of 5 a day (issue 51: all
/// hundred admitted, one charged): the first and three repeats (the rule's
/// `max_repeats`, a retry policy's retries) pass, the other 96 are refused
/// without a Retry-After and counted `reused`; one token is charged.
async fn reused(server: &RunningServer) {
    let mut c = client(server).await;
    let before = counted(server, "api-calls", "reused");
    let mut passed = 0;
    for _ in 0..100 {
        let r = call(&mut c, "api", "k9", Some("same"), false, None).await;
        if r.overall_code == OK {
            passed += 1;
        } else {
            assert!(
                !r.response_headers_to_add
                    .iter()
                    .any(|h| h.key.eq_ignore_ascii_case("retry-after")),
                "{r:?}"
            );
        }
    }
    assert_eq!(passed, 4);
    assert_eq!(counted(server, "api-calls", "reused") - before, 96.0);
    let r = call(&mut c, "api", "k9", None, false, Some(0)).await;
    assert_eq!(remaining(&r), 4, "one charged");
    // a concurrency limit of 3: ten starts with one id hold one slot; four
    // pass (the first and three repeats), six are refused as reuses
    let before = counted(server, "streams", "reused");
    let mut passed = 0;
    for _ in 0..10 {
        let r = call(&mut c, "streams", "reuser", Some("mine"), false, None).await;
        passed += u32::from(r.overall_code == OK);
    }
    assert_eq!(passed, 4);
    assert_eq!(counted(server, "streams", "reused") - before, 6.0);
    for id in ["other-1", "other-2"] {
        let r = call(&mut c, "streams", "reuser", Some(id), false, None).await;
        assert_eq!(r.overall_code, OK, "{id}: two slots were left");
    }
}

/// A month's budget in a tenant's time zone from its billing day reserves
/// as a token bucket does (issue 51: calendar periods refused `attempts:`,
/// so parallel chats overshot it): one of twenty 600-token chats in
/// flight, settled at what it used.
async fn monthly(server: &RunningServer, other: &RunningServer) {
    let c = client(server).await;
    let d = client(other).await;
    let admitted = chats_at_once(&c, &d, "tenant", "acme").await;
    assert_eq!(admitted.len(), 1, "{admitted:?}");
    let mut c = d.clone();
    let r = call(&mut c, "tenant", "acme", None, false, Some(0)).await;
    assert_eq!(remaining(&r), 400);
    let r = call(
        &mut c,
        "tenant",
        "acme",
        Some(&admitted[0]),
        true,
        Some(250),
    )
    .await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 750), "settled at 250");
}

#[tokio::test]
async fn memory_store() {
    let (server, _rules) = start().await;
    scenarios(&server).await;
    shows_attempts_at_config(&server).await;
    server.shutdown().await.expect("stop");
}

/// `/config` shows what each rule does with attempts.
async fn shows_attempts_at_config(server: &RunningServer) {
    let text = reqwest::get(format!("http://{}/config", server.admin_addr))
        .await
        .expect("config")
        .text()
        .await
        .expect("config text");
    let config: serde_json::Value = serde_json::from_str(&text).expect("json");
    let rule = |path: &str| {
        config["domains"][0]["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .find(|r| r["path"] == path)
            .cloned()
            .unwrap_or_else(|| panic!("rule {path}: {config}"))
    };
    let user = rule("user");
    assert_eq!(user["attempts"]["mode"], "reserve", "{user}");
    assert_eq!(user["attempts"]["reserve"], 600);
    assert_eq!(user["attempts"]["ttl"], "1m");
    assert_eq!(user["attempts"]["key"], "request_id");
    assert_eq!(user["attempts"]["phase_key"], "phase");
    assert_eq!(rule("api")["attempts"]["mode"], "dedupe");
    let streams = rule("streams");
    assert_eq!(streams["attempts"]["mode"], "slot");
    assert_eq!(streams["action"]["concurrency"]["max"], 3, "{streams}");
    assert_eq!(rule("team")["action"]["limited"][0]["max_debt"], 100);
}

#[tokio::test]
async fn redis_store() {
    let redis = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let server = start_on_redis(&redis.url(), &rules, Duration::from_secs(2)).await;
    scenarios(&server).await;
    server.shutdown().await.expect("stop");
}

/// Two instances on one Redis Cluster: the chats start on both, the
/// records and buckets are shared, and each settles once whichever
/// instance its done call reaches.
#[tokio::test]
async fn two_instances_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let a = start_on_redis(&cluster.url(), &rules, Duration::from_secs(2)).await;
    let b = start_on_redis(&cluster.url(), &rules, Duration::from_secs(2)).await;
    twenty_chats(&a, &b).await;
    settlements(&b).await;
    repeats(&a).await;
    slots(&a, &b).await;
    monthly(&a, &b).await;
    windows(&a, &b).await;
    a.shutdown().await.expect("stop");
    b.shutdown().await.expect("stop");
}

fn counted(server: &RunningServer, rule: &str, result: &str) -> f64 {
    sample(
        &server.metrics.render(),
        &format!("rls_attempts_total{{domain=\"llm\",result=\"{result}\",rule=\"{rule}\"}}"),
    )
    .unwrap_or(0.0)
}

fn remaining(r: &RateLimitResponse) -> u64 {
    u64::from(r.statuses[0].limit_remaining)
}

/// A start whose own estimate is 0 (a check) or below the rule's
/// `reserve: 600` reserves the 600 (issue 51: twenty chats with an estimate
/// of 0 started on a budget that holds one): one of twenty in flight,
/// settled after; an estimate above it reserves its own.
async fn estimates_below_the_reserve(server: &RunningServer) {
    let mut c = client(server).await;
    let mut admitted = Vec::new();
    for i in 0..20 {
        let id = format!("low-{i}");
        let estimate = [0, 10][i % 2];
        let r = call(&mut c, "user", "dora", Some(&id), false, Some(estimate)).await;
        if r.overall_code == OK {
            admitted.push(id);
        }
    }
    assert_eq!(admitted.len(), 1, "{admitted:?}");
    let r = call(&mut c, "user", "dora", None, false, Some(0)).await;
    assert_eq!(remaining(&r), 400, "600 reserved");
    let r = call(&mut c, "user", "dora", Some(&admitted[0]), true, Some(600)).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 400));
    // 700 of its own: more than the reserve, refused on the 400 left
    let r = call(&mut c, "user", "dora", Some("high"), false, Some(700)).await;
    assert_eq!(r.overall_code, OVER);
}

/// The issue's case: 20 chats of 600 start at once on 1,000. Without
/// attempts all 20 checks pass; with reservations exactly one is in
/// flight, and the rest are refused with nothing taken.
/// Twenty chats of 600 for `key: value` at once, half on each server:
/// the ids admitted; each refusal checked to carry a Retry-After.
async fn chats_at_once(
    c: &RateLimitServiceClient<Channel>,
    d: &RateLimitServiceClient<Channel>,
    key: &'static str,
    value: &'static str,
) -> Vec<String> {
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let mut c = if i % 2 == 0 { c.clone() } else { d.clone() };
            tokio::spawn(async move {
                let id = format!("{key}-chat-{i}");
                let r = call(&mut c, key, value, Some(&id), false, Some(600)).await;
                (id, r)
            })
        })
        .collect();
    let mut admitted = Vec::new();
    for t in tasks {
        let (id, r) = t.await.expect("task");
        if r.overall_code == OK {
            admitted.push(id);
        } else {
            assert_eq!(r.overall_code, OVER);
            assert!(
                r.response_headers_to_add
                    .iter()
                    .any(|h| h.key.eq_ignore_ascii_case("retry-after")),
                "{r:?}"
            );
        }
    }
    admitted
}

async fn twenty_chats(server: &RunningServer, other: &RunningServer) {
    let c = client(server).await;
    let d = client(other).await;
    let admitted = chats_at_once(&c, &d, "user", "alice").await;
    assert_eq!(admitted.len(), 1, "{admitted:?}");
    let mut c = d.clone();
    // nothing was taken by the refused ones: 400 left
    let r = call(&mut c, "user", "alice", None, false, Some(0)).await;
    assert_eq!(remaining(&r), 400);
    // the chat used 100 of its 600: 500 back at once, and then 900 left
    let r = call(&mut c, "user", "alice", Some(&admitted[0]), true, Some(100)).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(remaining(&r), 900);
    // Envoy sends the done call again (a retry): nothing moves
    let r = call(&mut c, "user", "alice", Some(&admitted[0]), true, Some(100)).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 900));
    // and the start again, after its attempt ended: a new attempt that
    // reserves again (issue 51: an ended attempt's id is no free pass)
    let r = call(
        &mut c,
        "user",
        "alice",
        Some(&admitted[0]),
        false,
        Some(600),
    )
    .await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 300));
    let r = call(&mut c, "user", "alice", Some(&admitted[0]), true, Some(0)).await;
    assert_eq!(
        (r.overall_code, remaining(&r)),
        (OK, 900),
        "it used nothing"
    );
    let both = |result: &str| {
        counted(server, "llm-tokens", result)
            + if std::ptr::eq(server, other) {
                0.0
            } else {
                counted(other, "llm-tokens", result)
            }
    };
    assert_eq!(both("first"), 21.0);
    assert_eq!(both("settled"), 2.0);
    assert_eq!(both("repeat"), 1.0);
}

async fn settlements(server: &RunningServer) {
    let mut c = client(server).await;
    // no hits_addend of its own: the rule's reserve (600)
    let r = call(&mut c, "user", "bob", Some("b1"), false, None).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 400));
    // used 900: 300 more charged, into nothing left
    let r = call(&mut c, "user", "bob", Some("b1"), true, Some(900)).await;
    assert_eq!(remaining(&r), 100);
    // a chat that used nothing (Envoy's format gave 0) gets it all back
    let r = call(&mut c, "user", "carol", Some("c1"), false, Some(600)).await;
    assert_eq!(remaining(&r), 400);
    let r = call(&mut c, "user", "carol", Some("c1"), true, Some(0)).await;
    assert_eq!(remaining(&r), 1000);
    // a done call for an attempt never seen is charged in full, once
    let r = call(&mut c, "user", "dave", Some("ghost"), true, Some(1200)).await;
    assert_eq!(r.overall_code, OVER, "1,200 charged: 200 in debt");
    let r = call(&mut c, "user", "dave", Some("ghost"), true, Some(1200)).await;
    assert_eq!(r.overall_code, OK, "a repeat: answered, nothing charged");
    let r = call(&mut c, "user", "dave", None, false, Some(0)).await;
    assert_eq!((r.overall_code, remaining(&r)), (OVER, 0));
    // a start above what the bucket holds: refused, nothing taken
    let r = call(&mut c, "user", "erin", Some("e1"), false, Some(1001)).await;
    assert_eq!(r.overall_code, OVER);
    let r = call(&mut c, "user", "erin", None, false, Some(0)).await;
    assert_eq!(remaining(&r), 1000);
    assert_eq!(counted(server, "llm-tokens", "unknown"), 1.0);
}

/// On a rule without `overdraft`, attempts dedupe: a call repeated (a
/// gRPC retry after a timeout, Envoy sending it again) is answered as the
/// first was and charges nothing; a refused one is decided afresh.
async fn repeats(server: &RunningServer) {
    let mut c = client(server).await;
    for _ in 0..3 {
        let r = call(&mut c, "api", "k1", Some("r1"), false, None).await;
        assert_eq!((r.overall_code, remaining(&r)), (OK, 4));
    }
    for i in 2..=5 {
        let r = call(&mut c, "api", "k1", Some(&format!("r{i}")), false, None).await;
        assert_eq!(r.overall_code, OK);
    }
    let r = call(&mut c, "api", "k1", Some("r6"), false, None).await;
    assert_eq!(r.overall_code, OVER);
    let r = call(&mut c, "api", "k1", Some("r6"), false, None).await;
    assert_eq!(r.overall_code, OVER, "decided afresh: still nothing left");
    assert_eq!(counted(server, "api-calls", "repeat"), 2.0);
    assert_eq!(counted(server, "api-calls", "first"), 7.0);
}

/// The attempt and phase entries take no part in matching or in the
/// bucket's key: calls with different ids spend one bucket, and a call
/// without an id is decided as without attempts (counted `no_id`).
async fn entries(server: &RunningServer) {
    let mut c = client(server).await;
    call(&mut c, "api", "k2", Some("x1"), false, None).await;
    call(&mut c, "api", "k2", Some("x2"), true, None).await;
    let r = call(&mut c, "api", "k2", None, false, None).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 2));
    let r = call(&mut c, "api", "k2", Some(""), false, None).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 1));
    assert_eq!(counted(server, "api-calls", "no_id"), 2.0);
}

/// `concurrency: 3`: ten streams start at once (half on each server when
/// there are two), three hold slots, the rest are refused with a
/// Retry-After; a release lets the next in, a repeated start takes no
/// second slot, and slots never released come back after the ttl.
async fn slots(server: &RunningServer, other: &RunningServer) {
    let c = client(server).await;
    let d = client(other).await;
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let mut c = if i % 2 == 0 { c.clone() } else { d.clone() };
            tokio::spawn(async move {
                let id = format!("s{i}");
                let r = call(&mut c, "streams", "u1", Some(&id), false, None).await;
                (id, r)
            })
        })
        .collect();
    let mut holding = Vec::new();
    for t in tasks {
        let (id, r) = t.await.expect("task");
        if r.overall_code == OK {
            holding.push(id);
        } else {
            assert_eq!(r.overall_code, OVER);
            let retry = r
                .response_headers_to_add
                .iter()
                .find(|h| h.key.eq_ignore_ascii_case("retry-after"))
                .map(|h| h.value.clone());
            assert_eq!(retry.as_deref(), Some("1"), "{r:?}");
            assert_eq!(remaining(&r), 0);
        }
    }
    assert_eq!(holding.len(), 3, "{holding:?}");
    let mut c = c.clone();
    // a repeated start of a stream in flight: OK, no second slot
    let r = call(&mut c, "streams", "u1", Some(&holding[0]), false, None).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 0));
    let r = call(&mut c, "streams", "u1", Some("late"), false, None).await;
    assert_eq!(r.overall_code, OVER);
    // one finishes: its slot is back, once
    let r = call(&mut c, "streams", "u1", Some(&holding[0]), true, None).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 1));
    let r = call(&mut c, "streams", "u1", Some(&holding[0]), true, None).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 1), "released once");
    let r = call(&mut c, "streams", "u1", Some("late"), false, None).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 0));
    // another value has slots of its own
    let r = call(&mut c, "streams", "u2", Some("x"), false, None).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 2));
    // none of u1's three is released: after the ttl (2 s) they are back
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let r = call(&mut c, "streams", "u1", Some("after"), false, None).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 2), "{r:?}");
    // a start without an attempt id can hold no slot: refused, counted
    let r = call(&mut c, "streams", "u1", None, false, None).await;
    assert_eq!(r.overall_code, OVER);
    let both = |result: &str| {
        counted(server, "streams", result)
            + if std::ptr::eq(server, other) {
                0.0
            } else {
                counted(other, "streams", result)
            }
    };
    assert_eq!(both("released"), 1.0);
    assert_eq!(both("not_held"), 1.0);
    assert_eq!(both("unknown"), 0.0);
    assert_eq!(both("repeat"), 1.0);
    assert_eq!(both("expired"), 3.0);
    assert_eq!(both("no_id"), 1.0);
}

/// `max_debt: 100` on a burst of 1,000: a settlement far above the
/// reservation leaves 100 of debt, and what it cut off is counted.
async fn debts(server: &RunningServer) {
    let mut c = client(server).await;
    let r = call(&mut c, "team", "t1", Some("big"), false, Some(1000)).await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 0));
    let r = call(&mut c, "team", "t1", Some("big"), true, Some(1500)).await;
    assert_eq!(r.overall_code, OVER);
    let forgiven = sample(
        &server.metrics.render(),
        "rls_debt_forgiven_tokens_total{domain=\"llm\",rule=\"team-tokens\"}",
    );
    assert_eq!(
        forgiven,
        Some(400.0),
        "1,500 used: 100 of debt kept, 400 cut"
    );
    // the debt is 100: 101 tokens at 1,000 a day
    let r = call(&mut c, "team", "t1", None, false, Some(0)).await;
    let retry: u64 = r
        .response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case("retry-after"))
        .and_then(|h| h.value.parse().ok())
        .expect("retry-after");
    assert!((8_726..=8_727).contains(&retry), "{retry}");
}

/// A reload that takes `attempts:` off a rule while a reservation is in
/// flight (issue 51: the 600 it reserved never came back): the done call
/// that follows still settles from the record, at what the chat used.
async fn a_reload_removing_attempts_settles_what_was_reserved(redis: Option<&RedisServer>) {
    const WITH: &str = "domain: llm\ndescriptors:\n  - key: user\n    overdraft: true\n    rate_limit: {unit: day, requests_per_unit: 1000, burst: 1000, name: llm-tokens}\n    attempts: {key: request_id, ttl: 1m, reserve: 600}\n";
    let rules = rules_dir(WITH);
    let server = match redis {
        Some(redis) => start_on_redis(&redis.url(), &rules, Duration::from_secs(2)).await,
        None => tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
            .await
            .expect("server starts"),
    };
    let mut c = client(&server).await;
    let r = call(
        &mut c,
        "user",
        "reloaded",
        Some("in-flight"),
        false,
        Some(600),
    )
    .await;
    assert_eq!((r.overall_code, remaining(&r)), (OK, 400));
    let file = std::fs::read_dir(rules.path())
        .expect("rules dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "yaml"))
        .expect("a rules file");
    std::fs::write(
        &file,
        WITH.replace(
            "    attempts: {key: request_id, ttl: 1m, reserve: 600}\n",
            "",
        ),
    )
    .expect("rules written");
    server.reloader.reload(true);
    assert!(
        server.rules.load().attempt_rules().is_empty(),
        "no rule has attempts now"
    );
    let r = call(
        &mut c,
        "user",
        "reloaded",
        Some("in-flight"),
        true,
        Some(100),
    )
    .await;
    assert_eq!(
        (r.overall_code, remaining(&r)),
        (OK, 900),
        "the 600 back, the 100 used charged"
    );
    server.shutdown().await.expect("stop");
}

#[tokio::test]
async fn a_reload_removing_attempts_on_the_memory_store() {
    a_reload_removing_attempts_settles_what_was_reserved(None).await;
}

#[tokio::test]
async fn a_reload_removing_attempts_on_redis() {
    let redis = RedisServer::standalone();
    a_reload_removing_attempts_settles_what_was_reserved(Some(&redis)).await;
}
