//! Instances on one Redis count themselves (#53 item 2): without
//! `--instances`, each announces itself in the store every 2 s and counts
//! the announcements not yet lapsed; the count gives a `local` rule its
//! share while Redis is away (the last count kept), and an instance that
//! stops withdraws its announcement. `--instances` overrides it.

mod common;

use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::{client, descriptor, request, rules_dir};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tokenbucket_rls::server::RunningServer;

/// A `local` rule of 10 an hour: while Redis is away each of N instances
/// admits 10/N.
const RULES: &str = "domain: d\ndescriptors:\n  - key: k\n    failure_mode: local\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";

async fn start(url: &str, rules: &tempfile::TempDir, instances: Option<u32>) -> RunningServer {
    let mut args = common::redis_args(url, rules, Duration::from_millis(200));
    args.instances = instances;
    tokenbucket_rls::server::start(&args)
        .await
        .expect("server starts")
}

fn counted(s: &RunningServer) -> f64 {
    s.metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix("rls_instances "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits until `s` counts `n` instances (an announcement every 2 s).
async fn until_counted(s: &RunningServer, n: f64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while counted(s) != n {
        assert!(
            Instant::now() < deadline,
            "{what}: counted {} instances, not {n}",
            counted(s)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn instances_count_themselves_and_a_local_rule_takes_its_share_by_the_count() {
    let mut redis = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let a = start(&redis.url(), &rules, None).await;
    assert_eq!(counted(&a), 1.0, "alone at its start");
    let b = start(&redis.url(), &rules, None).await;
    assert_eq!(counted(&b), 2.0, "the second counts both at its start");
    until_counted(&a, 2.0, "the first, at its next announcement").await;

    // one stops: it withdraws, and the other counts one again
    b.shutdown().await.expect("stop");
    until_counted(&a, 1.0, "after the second stopped").await;

    // an override counts nothing and announces nothing
    let c = start(&redis.url(), &rules, Some(3)).await;
    assert_eq!(counted(&c), 3.0);
    let b = start(&redis.url(), &rules, None).await;
    until_counted(&a, 2.0, "with the second back (the third not counted)").await;
    assert_eq!(counted(&b), 2.0);
    c.shutdown().await.expect("stop");

    // Redis goes: the last count stands, and the local rule's share is half
    redis.kill();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(counted(&a), 2.0, "the last count kept while Redis is away");
    let mut c = client(&a).await;
    let mut admitted = 0;
    for _ in 0..10 {
        let r = c
            .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
            .await
            .expect("answered by the local failure mode")
            .into_inner();
        if r.overall_code == Code::Ok as i32 {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 5, "10 an hour over the 2 instances counted");
    a.shutdown().await.expect("stop");
    b.shutdown().await.expect("stop");
}

/// #65: the instances' set is untrusted. Members written to lapse far
/// beyond any announcement's time to live are dropped at the next count;
/// a count past any fleet (`MAX_COUNTED_INSTANCES`) is refused, counted,
/// and the last count stands: nobody with write access to the Redis cuts
/// every `local` share to nothing.
#[tokio::test]
async fn forged_instances_in_redis_do_not_cut_the_shares() {
    let redis = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let s = start(&redis.url(), &rules, None).await;
    until_counted(&s, 1.0, "this instance alone").await;
    // far in the future: no instance announces that far ahead
    let mut far = vec!["ZADD".to_string(), "rls:instances".to_string()];
    for i in 0..2000 {
        far.push("99999999999999".into());
        far.push(format!("forged-{i}"));
    }
    let far: Vec<&str> = far.iter().map(String::as_str).collect();
    redis.cli(&far);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(counted(&s), 1.0, "forged far-future members dropped");
    assert_eq!(
        redis.cli(&["ZCARD", "rls:instances"]).trim(),
        "1",
        "only this instance's announcement is left"
    );
    // within the time to live but past any fleet: refused, the count stands
    let now_ms: u64 = {
        let t = redis.cli(&["TIME"]);
        let mut parts = t.split_whitespace();
        let secs: u64 = parts.next().and_then(|v| v.parse().ok()).expect("seconds");
        secs * 1000
    };
    let soon = (now_ms + 9_000).to_string();
    let mut near = vec!["ZADD".to_string(), "rls:instances".to_string()];
    for i in 0..2000 {
        near.push(soon.clone());
        near.push(format!("near-{i}"));
    }
    let near: Vec<&str> = near.iter().map(String::as_str).collect();
    redis.cli(&near);
    let deadline = Instant::now() + Duration::from_secs(10);
    let refused = |s: &RunningServer| {
        common::sample(
            &s.metrics.render(),
            "rls_untrusted_input_refused_total{reason=\"too_many\",source=\"instances\"}",
        )
        .unwrap_or(0.0)
    };
    while refused(&s) < 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        refused(&s) >= 1.0,
        "the count past any fleet is counted as refused"
    );
    assert_eq!(counted(&s), 1.0, "the last count stands");
    s.shutdown().await.expect("stop");
}
