//! One budget across a swap from envoyproxy/ratelimit (#53 item 1): the
//! binary started with its environment counts a rule without `algorithm:`
//! as it does, in its keys (`CACHE_KEY_PREFIX` + `domain_key_value_…_` +
//! the window's start, `share_threshold`'s pattern in place of the value)
//! with its operations (`INCRBY` + `EXPIRE`, `EXPIRATION_JITTER_MAX_SECONDS`
//! added), per-second limits in the per-second Redis. Counts written as
//! envoyproxy/ratelimit writes them (its `fixed_cache_impl_test.go`:
//! `INCRBY key hits`, `EXPIRE key length`) are honoured, and the service's
//! counts are what it would read, on a single Redis and a Redis Cluster.

mod common;

use common::ratelimit_peer::hour_with_room;
use common::redis::{RedisCluster, RedisServer};
use common::{descriptor, request, rules_dir};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const RULES: &str = r#"
domain: edge
descriptors:
  - key: api_key
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: tenant
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 4}
  - key: burst
    rate_limit: {unit: second, requests_per_unit: 1000}
  - key: bucket
    algorithm: token_bucket
    rate_limit: {unit: hour, requests_per_unit: 10, burst: 2}
"#;

type Client = RateLimitServiceClient<tonic::transport::Channel>;

/// One call: its code and what is left of its limit.
async fn call(c: &mut Client, entries: &[(&str, &str)]) -> (i32, u32) {
    let r = c
        .should_rate_limit(request("edge", vec![descriptor(entries)]))
        .await
        .expect("decided")
        .into_inner();
    (r.overall_code, r.statuses[0].limit_remaining)
}

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

/// What both services share, asserted through `cli` (a `redis-cli`
/// against the Redis holding the keys: `-c` on a cluster).
async fn one_budget(c: &mut Client, cli: &dyn Fn(&[&str]) -> String) {
    let hour = hour_with_room().await;
    let key = format!("rl:edge_api_key_k1_{hour}");
    // envoyproxy/ratelimit counted 7 hits of k1 this hour
    assert_eq!(cli(&["INCRBY", &key, "7"]).trim(), "7");
    assert_eq!(cli(&["EXPIRE", &key, "3600"]).trim(), "1");
    // the service counts on from there: 3 more, then refused
    for left in [2, 1, 0] {
        assert_eq!(call(c, &[("api_key", "k1")]).await, (OK, left));
    }
    assert_eq!(call(c, &[("api_key", "k1")]).await, (OVER, 0));
    // and writes what envoyproxy/ratelimit reads: every hit counted, the
    // refused one too, expiring within the window's length plus the jitter
    assert_eq!(cli(&["GET", &key]).trim(), "11");
    let ttl: i64 = cli(&["TTL", &key]).trim().parse().expect("TTL");
    assert!((3500..=3600 + 300).contains(&ttl), "TTL {ttl}");

    // share_threshold: every file under files/ counts in the pattern's key
    let shared = format!("rl:edge_files_files/*_{hour}");
    assert_eq!(cli(&["INCRBY", &shared, "1"]).trim(), "1");
    assert_eq!(call(c, &[("files", "files/a")]).await, (OK, 1));
    assert_eq!(call(c, &[("files", "files/b")]).await, (OK, 0));
    assert_eq!(call(c, &[("files", "files/c")]).await, (OVER, 0));
    assert_eq!(cli(&["GET", &shared]).trim(), "4");

    // a nested descriptor: each entry's key and value, in order
    let nested = format!("rl:edge_tenant_acme_user_bob_{hour}");
    assert_eq!(cli(&["INCRBY", &nested, "4"]).trim(), "4");
    assert_eq!(
        call(c, &[("tenant", "acme"), ("user", "bob")]).await,
        (OVER, 0)
    );
    assert_eq!(
        call(c, &[("tenant", "acme"), ("user", "eve")]).await,
        (OK, 3)
    );
    assert_eq!(cli(&["GET", &nested]).trim(), "5");

    // a token bucket, one setting away, keeps keys of its own
    assert_eq!(call(c, &[("bucket", "b")]).await, (OK, 1));
    assert_eq!(
        cli(&["EXISTS", &format!("rl:edge_bucket_b_{hour}")]).trim(),
        "0"
    );
}

#[tokio::test]
async fn envoyproxy_ratelimits_counts_are_one_budget_on_one_redis() {
    let main = RedisServer::standalone();
    let per_second = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let (_child, mut c) = common::ratelimit_binary(
        rules.path(),
        &[
            ("REDIS_SOCKET_TYPE", "tcp".to_string()),
            ("REDIS_URL", format!("127.0.0.1:{}", main.port)),
            ("CACHE_KEY_PREFIX", "rl:".to_string()),
            ("EXPIRATION_JITTER_MAX_SECONDS", "300".to_string()),
            ("REDIS_PERSECOND", "true".to_string()),
            ("REDIS_PERSECOND_SOCKET_TYPE", "tcp".to_string()),
            (
                "REDIS_PERSECOND_URL",
                format!("127.0.0.1:{}", per_second.port),
            ),
        ],
    )
    .await;
    one_budget(&mut c, &|args: &[&str]| main.cli(args)).await;

    // a per-second limit counts in the per-second Redis, in its key
    assert_eq!(call(&mut c, &[("burst", "x")]).await.0, OK);
    let keys = per_second.cli(&["KEYS", "rl:edge_burst_x_*"]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(per_second.cli(&["GET", keys[0]]).trim(), "1");
    assert_eq!(main.cli(&["KEYS", "rl:edge_burst_*"]).trim(), "");
    // its operations: one INCRBY and one EXPIRE per decision of a window
    // (9 here, beside the 3 INCRBY and 1 EXPIRE written above as
    // envoyproxy/ratelimit would); the token bucket's one key is ours
    let stats = main.cli(&["INFO", "commandstats"]);
    let calls = |c: &str| common::redis::command_calls(&stats, c);
    assert_eq!((calls("incrby"), calls("expire")), (12, 10), "{stats}");
    let ours = main.cli(&["KEYS", "rl:rls:{*"]);
    assert_eq!(ours.lines().filter(|k| !k.is_empty()).count(), 1, "{ours}");
}

#[tokio::test]
async fn envoyproxy_ratelimits_counts_are_one_budget_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let (_child, mut c) = common::ratelimit_binary(
        rules.path(),
        &[
            ("REDIS_SOCKET_TYPE", "tcp".to_string()),
            ("REDIS_TYPE", "cluster".to_string()),
            ("REDIS_URL", cluster.seeds()),
            ("CACHE_KEY_PREFIX", "rl:".to_string()),
            ("EXPIRATION_JITTER_MAX_SECONDS", "300".to_string()),
        ],
    )
    .await;
    // redis-cli -c follows MOVED, as envoyproxy/ratelimit's cluster client
    one_budget(&mut c, &|args: &[&str]| cluster.cli(args)).await;
}
