//! `max_values`: after N distinct values of a rule, new values share the
//! rule's one overflow bucket (exact counts), the first N keep their own,
//! also across a reload; with the memory store and with a real Redis.

mod common;

use std::time::Duration;

use common::redis::RedisServer;
use common::{client, descriptor, request, rules_dir, sample, serve_args, start_on_redis};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tokenbucket_rls::server::{self, RunningServer};
use tokenbucket_rls::sources::reload::ReloadOutcome;
use tonic::transport::Channel;

/// Three API keys get buckets of their own (burst 2 a day); the rest share one.
const RULES: &str = r#"
domain: d
descriptors:
  - key: api_key
    max_values: 3
    rate_limit: {unit: day, requests_per_unit: 1, burst: 2, name: per_key}
"#;

/// What `n` calls for `value` came to: 'o' admitted, 'x' over the limit.
async fn calls(c: &mut RateLimitServiceClient<Channel>, value: &str, n: usize) -> String {
    let mut out = String::new();
    for _ in 0..n {
        let r = c
            .should_rate_limit(request("d", vec![descriptor(&[("api_key", value)])]))
            .await
            .expect("answered")
            .into_inner();
        out.push(if r.overall_code == Code::OverLimit as i32 {
            'x'
        } else {
            'o'
        });
    }
    out
}

async fn overflow_bounds_new_values(s: &RunningServer, rules: &tempfile::TempDir) {
    let mut c = client(s).await;
    // the first three values: their own burst of 2 each
    for v in ["a", "b", "c"] {
        assert_eq!(calls(&mut c, v, 3).await, "oox", "{v}: its own bucket");
    }
    // every further value: one shared bucket of 2, whoever spends it
    assert_eq!(calls(&mut c, "d", 1).await, "o");
    assert_eq!(calls(&mut c, "e", 1).await, "o");
    assert_eq!(calls(&mut c, "f", 2).await, "xx", "the overflow is spent");
    assert_eq!(calls(&mut c, "d", 1).await, "x");
    let overflowed = sample(
        &s.metrics.render(),
        "rls_values_overflowed_total{domain=\"d\",rule=\"per_key\"}",
    );
    assert_eq!(overflowed, Some(5.0));

    // A reload (the limit grows to 4 values): the three keep their own
    // (spent) buckets, and the fourth value to come gets one; the others
    // still share the overflow.
    std::fs::write(
        rules.path().join("rules.yaml"),
        RULES.replace("max_values: 3", "max_values: 4"),
    )
    .expect("write");
    assert!(matches!(
        s.reloader.reload(true),
        ReloadOutcome::Applied { .. }
    ));
    assert_eq!(calls(&mut c, "a", 1).await, "x", "a keeps its spent bucket");
    assert_eq!(calls(&mut c, "g", 3).await, "oox", "the fourth value's own");
    assert_eq!(calls(&mut c, "h", 1).await, "x", "back to the overflow");
    // /config shows it
    let config = reqwest::get(format!("http://{}/config", s.admin_addr))
        .await
        .expect("config")
        .text()
        .await
        .expect("body");
    assert!(config.contains("\"max_values\":4"), "{config}");
}

#[tokio::test]
async fn memory_store_new_values_past_the_maximum_share_one_bucket() {
    let rules = rules_dir(RULES);
    let s = server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("start");
    overflow_bounds_new_values(&s, &rules).await;
}

#[tokio::test]
async fn redis_store_new_values_past_the_maximum_share_one_bucket() {
    let redis = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let s = start_on_redis(&redis.url(), &rules, Duration::from_millis(500)).await;
    overflow_bounds_new_values(&s, &rules).await;
    // the overflow bucket is one key in Redis, beside the four values' own
    let keys = redis.cli(&["--raw", "KEYS", "rls:*"]);
    assert_eq!(keys.lines().count(), 5, "{keys}");
}
