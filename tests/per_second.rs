//! A second Redis for per-second limits (#40, envoyproxy/ratelimit's
//! `REDIS_PERSECOND` layout), against two real redis-server processes:
//! descriptors whose every bucket refills per second are decided in the
//! per-second Redis, the rest (a rule mixing units included) in the main
//! one; each fails on its own (one down, the other's rules still decide);
//! the binary started with envoyproxy/ratelimit's environment.

mod common;

use std::time::Duration;

use common::redis::RedisServer;
use common::{client, descriptor, request, rules_dir};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;

const RULES: &str = r#"
domain: d
descriptors:
  - key: per_sec
    failure_mode: closed
    rate_limit: {unit: second, requests_per_unit: 1, burst: 5}
  - key: per_min
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 1, burst: 5}
  - key: mixed
    failure_mode: closed
    limits:
      - {unit: second, requests_per_unit: 1, burst: 5, name: short}
      - {unit: minute, requests_per_unit: 1, burst: 5, name: long}
"#;

/// The buckets' keys on `server` (not the instances' count, which the
/// main Redis holds when the binary counts its instances: docs/run.md).
fn keys(server: &RedisServer) -> usize {
    server
        .cli(&["KEYS", "*"])
        .lines()
        .filter(|k| !k.is_empty() && !k.ends_with("rls:instances"))
        .count()
}

async fn decide(
    c: &mut envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<tonic::transport::Channel>,
    key: &str,
) -> Result<u32, tonic::Code> {
    c.should_rate_limit(request("d", vec![descriptor(&[(key, "v")])]))
        .await
        .map(|r| {
            let r = r.into_inner();
            assert_eq!(r.overall_code, Code::Ok as i32);
            r.statuses[0].limit_remaining
        })
        .map_err(|e| e.code())
}

#[tokio::test]
async fn per_second_rules_live_in_their_own_redis_and_fail_on_their_own() {
    let main = RedisServer::standalone();
    let mut per_second = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let mut args = common::redis_args(&main.url(), &rules, Duration::from_millis(300));
    args.redis_persecond_url = Some(per_second.url());
    let s = tokenbucket_rls::server::start(&args)
        .await
        .expect("server starts");
    let mut c = client(&s).await;

    assert_eq!(decide(&mut c, "per_sec").await, Ok(4));
    assert_eq!(
        (keys(&main), keys(&per_second)),
        (0, 1),
        "a per-second rule"
    );
    assert_eq!(decide(&mut c, "per_min").await, Ok(4));
    assert_eq!(decide(&mut c, "mixed").await, Ok(4));
    assert_eq!(
        (keys(&main), keys(&per_second)),
        (3, 1),
        "a minute rule, and both buckets of a rule that mixes units, in the main Redis"
    );

    // the per-second Redis goes: its rules answer by their failure mode,
    // the others still decide
    per_second.kill();
    assert_eq!(
        decide(&mut c, "per_sec").await,
        Err(tonic::Code::Unavailable)
    );
    assert_eq!(decide(&mut c, "per_min").await, Ok(3));
    assert_eq!(decide(&mut c, "mixed").await, Ok(3));
    // and comes back (blank): per-second rules decide again
    per_second.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while decide(&mut c, "per_sec").await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the per-second Redis never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // the main one goes: the per-second rules are untouched
    drop(main);
    assert!(decide(&mut c, "per_sec").await.is_ok());
    assert_eq!(
        decide(&mut c, "per_min").await,
        Err(tonic::Code::Unavailable)
    );
    s.shutdown().await.expect("stop");
}

#[tokio::test]
async fn a_per_second_url_without_the_redis_store_stops_the_start() {
    let rules = rules_dir(RULES);
    let mut args = common::serve_args(rules.path().to_path_buf());
    args.redis_persecond_url = Some("redis://127.0.0.1:1".into());
    let e = match tokenbucket_rls::server::start(&args).await {
        Ok(_) => panic!("a per-second Redis beside the memory store"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("--redis-persecond-url needs --store redis"),
        "{e}"
    );
}

/// The binary with envoyproxy/ratelimit's environment for a per-second
/// Redis: `REDIS_PERSECOND=true` and its `REDIS_PERSECOND_*`.
#[tokio::test]
async fn envoyproxy_ratelimits_per_second_settings_split_the_rules() {
    let main = RedisServer::standalone();
    let per_second = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let (_child, mut c) = common::ratelimit_binary(
        rules.path(),
        &[
            ("REDIS_SOCKET_TYPE", "tcp".to_string()),
            ("REDIS_URL", format!("127.0.0.1:{}", main.port)),
            ("REDIS_PERSECOND", "true".to_string()),
            ("REDIS_PERSECOND_SOCKET_TYPE", "tcp".to_string()),
            (
                "REDIS_PERSECOND_URL",
                format!("127.0.0.1:{}", per_second.port),
            ),
            ("REDIS_PERSECOND_POOL_SIZE", "2".to_string()),
            // these rules have bursts: token buckets, one setting away
            // from its fixed windows
            ("RLS_ALGORITHM", "token_bucket".to_string()),
        ],
    )
    .await;
    assert_eq!(decide(&mut c, "per_sec").await, Ok(4));
    assert_eq!(decide(&mut c, "per_min").await, Ok(4));
    assert_eq!((keys(&main), keys(&per_second)), (1, 1));
}
