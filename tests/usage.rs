//! Usage-based limits (#26): a rule with `overdraft: true` is checked when a
//! request arrives (a descriptor `hits_addend` of 0) and charged what the
//! request really used once it is done (Envoy's `apply_on_stream_done`).
//! A charge is never refused: the bucket goes into debt, down to minus its
//! burst, and checks are OVER_LIMIT until the refill has repaid it. Over
//! real gRPC, on the memory store and on a real Redis.

mod common;

use std::time::Duration;

use common::redis::RedisServer;
use common::{client, descriptor, request, rules_dir, serve_args, start_on_redis};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::UInt64Value;
use tokenbucket_rls::server::RunningServer;
use tonic::transport::Channel;

const RULES: &str = r#"
domain: llm
descriptors:
  - key: user
    overdraft: true
    rate_limit: {unit: hour, requests_per_unit: 1000, burst: 1000, name: llm-tokens}
  - key: team
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 1000, burst: 1000}
  - key: fast
    overdraft: true
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100}
"#;

/// `hits_addend` on the descriptor: 0 checks, more charges.
async fn call(
    c: &mut RateLimitServiceClient<Channel>,
    key: &str,
    value: &str,
    hits: u64,
) -> RateLimitResponse {
    let mut d = descriptor(&[(key, value)]);
    d.hits_addend = Some(UInt64Value { value: hits });
    c.should_rate_limit(request("llm", vec![d]))
        .await
        .expect("decided")
        .into_inner()
}

fn retry_after(r: &RateLimitResponse) -> Option<&str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case("retry-after"))
        .map(|h| h.value.as_str())
}

async fn scenario(server: &RunningServer) {
    let mut c = client(server).await;
    let ok = Code::Ok as i32;
    let over = Code::OverLimit as i32;
    // alice's first chat: checked, then charged its 600
    assert_eq!(call(&mut c, "user", "alice", 0).await.overall_code, ok);
    let r = call(&mut c, "user", "alice", 600).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (ok, 400));
    // the second starts with 400 left and uses 600: charged all the same
    assert_eq!(call(&mut c, "user", "alice", 0).await.overall_code, ok);
    let r = call(&mut c, "user", "alice", 600).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (over, 0));
    // the third waits until the debt of 200 is repaid and a token is back:
    // 201 tokens at 1000 an hour
    let r = call(&mut c, "user", "alice", 0).await;
    assert_eq!(r.overall_code, over);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    assert_eq!(retry_after(&r), Some("724"), "{r:?}");
    assert_eq!(
        r.statuses[0]
            .duration_until_reset
            .as_ref()
            .map(|d| d.seconds),
        Some(724)
    );
    // another user is untouched
    let r = call(&mut c, "user", "bob", 0).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (ok, 1000));

    // many streams of one team charged at once: exactly the sum is spent
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let mut c = c.clone();
            tokio::spawn(async move { call(&mut c, "team", "t1", 37).await })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    let r = call(&mut c, "team", "t1", 0).await;
    assert_eq!(r.statuses[0].limit_remaining, 1000 - 20 * 37);
    // and past the balance: 13 more charges of 37 take it to -221
    for _ in 0..13 {
        call(&mut c, "team", "t1", 37).await;
    }
    let r = call(&mut c, "team", "t1", 0).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (over, 0));
    // the debt stops at minus the burst: a huge charge costs at most 1000
    // more, so the wait is at most 2 bursts' worth (2 days and a token)
    call(&mut c, "team", "t1", 1_000_000).await;
    let r = call(&mut c, "team", "t1", 0).await;
    let wait: u64 = retry_after(&r).expect("retry-after").parse().expect("secs");
    assert_eq!(wait, (1001.0_f64 / (1000.0 / 86_400.0)).ceil() as u64);

    // once repaid it passes again: 150 charged on 100 a second leaves a
    // debt of 50; after the Retry-After it says, a check passes
    call(&mut c, "fast", "f1", 150).await;
    let r = call(&mut c, "fast", "f1", 0).await;
    assert_eq!(r.overall_code, over);
    let wait: u64 = retry_after(&r).expect("retry-after").parse().expect("secs");
    assert_eq!(wait, 1, "51 tokens at 100 a second, rounded up");
    tokio::time::sleep(Duration::from_millis(wait * 1000 + 20)).await;
    let r = call(&mut c, "fast", "f1", 0).await;
    assert_eq!(r.overall_code, ok, "repaid: {r:?}");
}

#[tokio::test]
async fn memory_store_charges_into_debt_and_checks_wait_for_it() {
    let rules = rules_dir(RULES);
    let server = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("server starts");
    scenario(&server).await;
    server.shutdown().await.expect("stop");
}

#[tokio::test]
async fn redis_store_charges_into_debt_and_checks_wait_for_it() {
    let redis = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let server = start_on_redis(&redis.url(), &rules, Duration::from_secs(2)).await;
    scenario(&server).await;
    server.shutdown().await.expect("stop");
}

/// A reload that takes `overdraft` away keeps the debt (the bucket is the
/// same): checks still wait for it, and a spend is refused and charges
/// nothing; one that gives it back charges again.
#[tokio::test]
async fn a_reload_keeps_the_debt_and_decides_by_the_new_rule() {
    let rules = rules_dir(RULES);
    let server = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("server starts");
    let mut c = client(&server).await;
    let over = Code::OverLimit as i32;
    call(&mut c, "team", "t9", 1200).await;
    let reload = |text: String, generation: u64| {
        let path = rules.path().join("rules.yaml");
        let server = &server;
        async move {
            std::fs::write(&path, text).expect("write rules");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while server.rules.load().generation() < generation {
                assert!(tokio::time::Instant::now() < deadline, "reloaded");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    reload(RULES.replace("    overdraft: true\n", ""), 2).await;
    let r = call(&mut c, "team", "t9", 0).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (over, 0));
    let r = call(&mut c, "team", "t9", 1).await;
    assert_eq!(r.overall_code, over, "a spend, no longer a charge: refused");
    // still 200 in debt: one token back in 201 × 86.4 s
    let wait: u64 = retry_after(&r).expect("retry-after").parse().expect("secs");
    assert!((17_366..=17_367).contains(&wait), "{wait}");
    reload(RULES.to_string(), 3).await;
    call(&mut c, "team", "t9", 100).await;
    let r = call(&mut c, "team", "t9", 0).await;
    let wait: u64 = retry_after(&r).expect("retry-after").parse().expect("secs");
    assert!((26_006..=26_007).contains(&wait), "301 owed: {wait}");
    server.shutdown().await.expect("stop");
}
