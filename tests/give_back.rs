//! One request, one decision (issue 51): a request answered OVER_LIMIT
//! keeps nothing its other descriptors took (tokens, a reservation, a
//! concurrency slot), over real gRPC on the memory store, a real Redis and
//! a Redis Cluster with two instances (the descriptors' keys on different
//! shards, given back there); `--per-descriptor-spending` keeps what each
//! took, as envoyproxy/ratelimit does by default.

mod common;

use std::time::Duration;

use common::redis::{RedisCluster, RedisServer};
use common::{client, descriptor, redis_args, request, rules_dir, sample, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use tokenbucket_rls::cli::ServeArgs;
use tokenbucket_rls::server::RunningServer;
use tonic::transport::Channel;

/// An AI route's limits, per day so that the refill adds nothing over a
/// test: a per-operation request limit, a reserved token budget, a
/// concurrency limit and a plain request budget.
const RULES: &str = r#"
domain: ai
descriptors:
  - key: operation
    rate_limit: {unit: day, requests_per_unit: 2, name: per-operation}
  - key: user
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 1000, name: tokens}
    attempts: {key: request_id, ttl: 1m, reserve: 100}
  - key: streams
    concurrency: 3
    attempts: {key: request_id, ttl: 1m}
  - key: requests
    rate_limit: {unit: day, requests_per_unit: 10, name: requests}
"#;

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

/// One chat of `user` with attempt `id` on operation `op`.
async fn chat(
    c: &mut RateLimitServiceClient<Channel>,
    user: &str,
    op: &str,
    id: &str,
) -> RateLimitResponse {
    let descriptors = vec![
        descriptor(&[("streams", user), ("request_id", id)]),
        descriptor(&[("user", user), ("request_id", id)]),
        descriptor(&[("requests", user)]),
        descriptor(&[("operation", op)]),
    ];
    c.should_rate_limit(request("ai", descriptors))
        .await
        .expect("decided")
        .into_inner()
}

/// What `entries` has left: a check (`hits_addend: 0`) takes nothing.
async fn left(c: &mut RateLimitServiceClient<Channel>, entries: &[(&str, &str)]) -> u32 {
    let mut d = descriptor(entries);
    d.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
    let r = c
        .should_rate_limit(request("ai", vec![d]))
        .await
        .expect("decided")
        .into_inner();
    r.statuses[0].limit_remaining
}

fn given_back(servers: &[&RunningServer], result: &str) -> f64 {
    let rule = |rule: &str| {
        servers
            .iter()
            .map(|s| {
                sample(
                    &s.metrics.render(),
                    &format!(
                        "rls_given_back_total{{domain=\"ai\",reason=\"refused\",result=\"{result}\",rule=\"{rule}\"}}"
                    ),
                )
                .unwrap_or(0.0)
            })
            .sum::<f64>()
    };
    rule("tokens") + rule("requests") + rule("streams")
}

/// Two chats pass the per-operation limit of 2; 20 more, refused by it,
/// half on each server, leave every budget and slot as the two left them.
async fn refused_chats_hold_nothing(a: &RunningServer, b: &RunningServer, user: &str) {
    let mut c = client(a).await;
    let mut d = client(b).await;
    let servers: &[&RunningServer] = if std::ptr::eq(a, b) { &[a] } else { &[a, b] };
    let before = given_back(servers, "ok");
    for i in 0..2 {
        let r = chat(
            &mut c,
            user,
            &format!("{user}-op"),
            &format!("{user}-ok{i}"),
        )
        .await;
        assert_eq!(r.overall_code, OK, "chat {i}");
    }
    for i in 0..20 {
        let c = if i % 2 == 0 { &mut c } else { &mut d };
        let r = chat(c, user, &format!("{user}-op"), &format!("{user}-no{i}")).await;
        assert_eq!(r.overall_code, OVER, "refused chat {i}");
        let codes: Vec<i32> = r.statuses.iter().map(|s| s.code).collect();
        assert_eq!(codes, [OK, OK, OK, OVER], "each limit but one admitted it");
    }
    assert_eq!(
        left(&mut c, &[("user", user)]).await,
        800,
        "two reservations of 100"
    );
    assert_eq!(left(&mut c, &[("requests", user)]).await, 8);
    // two slots held by the chats that passed: one more is free
    for (id, code) in [("s1", OK), ("s2", OVER)] {
        let slot = descriptor(&[("streams", user), ("request_id", id)]);
        let r = c
            .should_rate_limit(request("ai", vec![slot]))
            .await
            .expect("decided")
            .into_inner();
        assert_eq!(r.overall_code, code, "slot {id}");
    }
    assert_eq!(
        given_back(servers, "ok") - before,
        60.0,
        "3 descriptors of 20"
    );
    assert_eq!(given_back(servers, "failed"), 0.0);
}

/// A refused chat's retry with its id is a new attempt: it reserves again
/// (refused again by `user`'s spent operation, so given back again), never
/// answered as a repeat of a reservation that was given back.
async fn a_retry_is_decided_afresh(server: &RunningServer, spent_op_of: &str) {
    let mut c = client(server).await;
    let attempts = |result: &str| {
        sample(
            &server.metrics.render(),
            &format!("rls_attempts_total{{domain=\"ai\",result=\"{result}\",rule=\"tokens\"}}"),
        )
        .unwrap_or(0.0)
    };
    let (first, repeat) = (attempts("first"), attempts("repeat"));
    for _ in 0..3 {
        let r = chat(&mut c, "erin", &format!("{spent_op_of}-op"), "retried").await;
        let codes: Vec<i32> = r.statuses.iter().map(|s| s.code).collect();
        assert_eq!(codes, [OK, OK, OK, OVER]);
    }
    assert_eq!(attempts("first") - first, 3.0, "reserved afresh each time");
    assert_eq!(attempts("repeat") - repeat, 0.0);
    assert_eq!(left(&mut c, &[("user", "erin")]).await, 1000);
}

async fn start(args: ServeArgs) -> RunningServer {
    tokenbucket_rls::server::start(&args)
        .await
        .expect("server starts")
}

#[tokio::test]
async fn memory_store() {
    let rules = rules_dir(RULES);
    let server = start(serve_args(rules.path().to_path_buf())).await;
    refused_chats_hold_nothing(&server, &server, "alice").await;
    a_retry_is_decided_afresh(&server, "alice").await;
    server.shutdown().await.expect("stop");
}

#[tokio::test]
async fn redis_store() {
    let redis = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let server = start(redis_args(&redis.url(), &rules, Duration::from_secs(2))).await;
    refused_chats_hold_nothing(&server, &server, "alice").await;
    a_retry_is_decided_afresh(&server, "alice").await;
    server.shutdown().await.expect("stop");
}

/// The four descriptors' keys hash to different slots, so to different
/// primaries of the cluster: each is given back on its own shard.
#[tokio::test]
async fn two_instances_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let args = redis_args(&cluster.url(), &rules, Duration::from_secs(2));
    let a = start(args.clone()).await;
    let b = start(args).await;
    for user in ["alice", "bob", "carol"] {
        refused_chats_hold_nothing(&a, &b, user).await;
    }
    a_retry_is_decided_afresh(&b, "alice").await;
    let holding = cluster
        .primaries()
        .into_iter()
        .filter(|&p| cluster.nodes[p].cli(&["DBSIZE"]).trim() != "0")
        .count();
    assert!(holding >= 2, "the request's keys span {holding} shard(s)");
    a.shutdown().await.expect("stop");
    b.shutdown().await.expect("stop");
}

/// `--per-descriptor-spending` (envoyproxy/ratelimit's default): each
/// descriptor keeps what it took, refused request or not.
#[tokio::test]
async fn per_descriptor_spending_keeps_what_each_took() {
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.per_descriptor_spending = true;
    let server = start(args).await;
    let mut c = client(&server).await;
    for i in 0..5 {
        chat(&mut c, "dave", "op", &format!("d{i}")).await;
    }
    assert_eq!(left(&mut c, &[("requests", "dave")]).await, 5);
    assert_eq!(given_back(&[&server], "ok"), 0.0);
    server.shutdown().await.expect("stop");
}

/// A reservation's start whose Redis call timed out (Redis paused) is
/// answered by the failure mode; Redis runs the script when it wakes, and
/// the withdrawal sent after it on the same connection gives the
/// reservation back and drops its record: the request's done call (the
/// failure mode may have let it run) is charged in full.
#[tokio::test]
async fn a_start_that_timed_out_in_redis_is_withdrawn_once_it_ran() {
    let redis = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let server = start(redis_args(&redis.url(), &rules, Duration::from_millis(100))).await;
    let mut c = client(&server).await;
    // the script loaded before Redis pauses (a NOSCRIPT answer would be
    // sent again as EVAL only by the caller that gave up)
    assert_eq!(left(&mut c, &[("user", "frank")]).await, 1000);
    redis.cli(&["CLIENT", "PAUSE", "800", "WRITE"]);
    let start = descriptor(&[("user", "frank"), ("request_id", "slow")]);
    let r = c.should_rate_limit(request("ai", vec![start])).await;
    assert_eq!(
        r.expect_err("the rule fails closed").code(),
        tonic::Code::Unavailable
    );
    // Redis wakes, runs the start, then the withdrawal queued after it
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(left(&mut c, &[("user", "frank")]).await, 1000);
    let late: f64 = ["ok", "unanswered"]
        .iter()
        .map(|result| {
            sample(
                &server.metrics.render(),
                &format!(
                    "rls_given_back_total{{domain=\"ai\",reason=\"late\",result=\"{result}\",rule=\"tokens\"}}"
                ),
            )
            .unwrap_or(0.0)
        })
        .sum();
    assert_eq!(late, 1.0, "one withdrawal sent");
    let mut done = descriptor(&[("user", "frank"), ("request_id", "slow"), ("phase", "done")]);
    done.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 100 });
    let r = c
        .should_rate_limit(request("ai", vec![done]))
        .await
        .expect("decided")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 900, "charged in full");
    server.shutdown().await.expect("stop");
}
