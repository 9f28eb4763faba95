//! A database number in a Redis URL (`redis://host:port/3`,
//! `unix:///path?db=3`, `redis-sentinel://…/master?db=3`, as redis-py,
//! redis-rs and Limitador's users write them): every decision and every
//! key lands in that database, not in database 0, against a real
//! redis-server. A Redis Cluster has only database 0, so any other number
//! in a cluster URL stops the start naming it.

mod common;

use std::time::Duration;

use common::redis::{free_redis_port, three_decisions_on, RedisServer, FIVE_A_DAY};
use common::{client, descriptor, request, rules_dir, serve_args};

const RULES: &str = FIVE_A_DAY;

/// Keys in database `db` of `redis`.
fn keys_in(redis: &RedisServer, db: u8) -> String {
    redis
        .cli(&["-n", &db.to_string(), "DBSIZE"])
        .trim()
        .to_string()
}

#[tokio::test]
async fn a_database_in_a_tcp_url_holds_the_buckets() {
    let redis = RedisServer::standalone();
    three_decisions_on(format!("{}/3", redis.url())).await;
    assert_eq!(
        (keys_in(&redis, 3).as_str(), keys_in(&redis, 0).as_str()),
        ("1", "0")
    );
    // a second service on the same database finds the bucket spent
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.store = tokenbucket_rls::cli::StoreKind::Redis;
    args.redis_url = Some(format!("{}/3", redis.url()));
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let r = client(&s)
        .await
        .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
        .await
        .expect("decided")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 1);
    s.shutdown().await.expect("stop");
}

#[tokio::test]
async fn a_database_in_a_unix_socket_url_holds_the_buckets() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("redis.sock");
    let redis = RedisServer::start(
        free_redis_port(),
        &["--unixsocket", socket.to_str().expect("utf-8")],
    );
    three_decisions_on(format!("unix://{}?db=2", socket.display())).await;
    assert_eq!(
        (keys_in(&redis, 2).as_str(), keys_in(&redis, 0).as_str()),
        ("1", "0")
    );
}

#[tokio::test]
async fn a_database_in_a_sentinel_url_holds_the_buckets_on_the_primary() {
    let set = common::sentinel::SentinelSet::start();
    three_decisions_on(format!("{}?db=4", set.url())).await;
    let primary = &set.servers[set.primary()];
    assert_eq!(
        (keys_in(primary, 4).as_str(), keys_in(primary, 0).as_str()),
        ("1", "0")
    );
}

#[tokio::test]
async fn a_database_past_the_servers_count_is_answered_by_the_failure_mode() {
    // redis-server has 16 databases unless told otherwise: SELECT 20 fails,
    // the connection is not used, and a closed rule answers UNAVAILABLE
    let redis = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.store = tokenbucket_rls::cli::StoreKind::Redis;
    args.redis_url = Some(format!("{}/20", redis.url()));
    args.redis_timeout = Duration::from_millis(300);
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let e = client(&s)
        .await
        .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
        .await
        .expect_err("no database 20");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert_eq!(keys_in(&redis, 0), "0");
    s.shutdown().await.expect("stop");
}

#[tokio::test]
async fn a_cluster_url_naming_another_database_stops_the_start() {
    let rules = rules_dir(RULES);
    for (url, named) in [
        ("redis-cluster://127.0.0.1:7000/3", "database 3"),
        (
            "redis-cluster://127.0.0.1:7000,127.0.0.1:7001/1",
            "database 1",
        ),
        ("redis-cluster://127.0.0.1:7000/x", "'x'"),
    ] {
        let mut args = serve_args(rules.path().to_path_buf());
        args.store = tokenbucket_rls::cli::StoreKind::Redis;
        args.redis_url = Some(url.to_string());
        let e = tokenbucket_rls::server::start(&args)
            .await
            .err()
            .unwrap_or_else(|| panic!("{url} started"));
        let e = format!("{e:#}");
        assert!(e.contains(named) && e.contains("database"), "{url}: {e}");
    }
}

/// An IPv6 literal in a Redis URL (issue 52: `redis://[::1]:6391/2`
/// started, warned "the name does not resolve", and answered by the
/// failure mode for good): the decisions reach the server on `::1`, in the
/// database the URL names.
#[tokio::test]
async fn an_ipv6_literal_address_holds_the_buckets() {
    let port = free_redis_port();
    let redis = RedisServer::start(port, &["--bind", "127.0.0.1", "::1"]);
    three_decisions_on(format!("redis://[::1]:{port}/2")).await;
    assert_eq!(
        (keys_in(&redis, 2).as_str(), keys_in(&redis, 0).as_str()),
        ("1", "0")
    );
}
