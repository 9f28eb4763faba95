//! One request, one decision when something fails half-way (issue 67), on
//! a real 3+3 Redis Cluster: a request whose descriptors live on
//! different shards, one of them paused (`CLIENT PAUSE`) or killed, is
//! answered by its failure mode and holds nothing afterwards: the tokens,
//! reservations and slots its other descriptors took are given back, and
//! what the paused shard decided when it woke is given back when its
//! answer arrives. Each case also runs beside four busy loops.

mod common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::redis::{bucket_key_in, RedisCluster};
use common::{client, descriptor, redis_args, request, rules_dir, sample};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tokenbucket_rls::server::RunningServer;
use tonic::transport::Channel;

/// An AI route's limits, per day so that the refill adds nothing over a
/// test; every rule fails closed (`redis_args`).
const RULES: &str = r#"
domain: ai
descriptors:
  - key: user
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 1000, name: tokens}
    attempts: {key: request_id, ttl: 1m, reserve: 100}
  - key: month
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 1000, name: month}
    attempts: {key: request_id, ttl: 1m, reserve: 100}
  - key: streams
    concurrency: 3
    attempts: {key: request_id, ttl: 1m}
  - key: requests
    rate_limit: {unit: day, requests_per_unit: 10, name: requests}
  - key: guarded
    rate_limit: {unit: day, requests_per_unit: 10, name: guarded}
  - key: bulk
    rate_limit: {unit: day, requests_per_unit: 1, burst: 100000, name: bulk}
  - key: bulk_guarded
    rate_limit: {unit: day, requests_per_unit: 1, burst: 100000, name: bulk_guarded}
"#;

/// How long a shard is paused: longer than a call's deadline.
const PAUSE_MS: u64 = 1500;
/// The caller's deadline (`grpc-timeout`).
const DEADLINE: Duration = Duration::from_secs(1);

type Client = RateLimitServiceClient<Channel>;

/// The primary holding `entries`' keys in domain `ai`.
fn shard_of(cluster: &RedisCluster, entries: &[(&str, &str)]) -> usize {
    let key = bucket_key_in("ai", entries, "x");
    let end = key.iter().position(|&b| b == b'}').expect("a hash tag");
    let tag = String::from_utf8_lossy(&key[..=end]).into_owned();
    let slot = cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", &tag]);
    cluster.owner_of_slot(slot.trim().parse().expect("a slot"))
}

/// A user named from `prefix` whose `first` and `second` descriptors live
/// on different shards.
fn user_across(cluster: &RedisCluster, prefix: &str, first: &str, second: &str) -> String {
    (0..1000)
        .map(|i| format!("{prefix}{i}"))
        .find(|u| shard_of(cluster, &[(first, u)]) != shard_of(cluster, &[(second, u)]))
        .expect("a user across two shards")
}

fn pause(cluster: &RedisCluster, shard: usize) {
    let out = cluster.nodes[shard].cli(&["CLIENT", "PAUSE", &PAUSE_MS.to_string(), "WRITE"]);
    assert!(out.contains("OK"), "CLIENT PAUSE: {out}");
}

fn start(entries: &[(&str, &str)], id: &str) -> RateLimitDescriptor {
    let mut all = entries.to_vec();
    all.push(("request_id", id));
    descriptor(&all)
}

/// The request's answer, its call cut at `deadline` by the server.
async fn call(
    c: &mut Client,
    descriptors: Vec<RateLimitDescriptor>,
    deadline: Option<Duration>,
) -> Result<Vec<i32>, tonic::Code> {
    let mut req = tonic::Request::new(request("ai", descriptors));
    if let Some(d) = deadline {
        req.set_timeout(d);
    }
    c.should_rate_limit(req)
        .await
        .map(|r| r.into_inner().statuses.iter().map(|s| s.code).collect())
        .map_err(|s| s.code())
}

/// What `entries` has left: a check (`hits_addend: 0`) takes nothing.
async fn left(c: &mut Client, entries: &[(&str, &str)]) -> u32 {
    let mut d = descriptor(entries);
    d.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
    let r = c
        .should_rate_limit(request("ai", vec![d]))
        .await
        .expect("checked")
        .into_inner();
    r.statuses[0].limit_remaining
}

/// How many of four starts on `streams=user` take a slot (of 3).
async fn free_slots(c: &mut Client, user: &str) -> usize {
    let mut taken = 0;
    for i in 0..4 {
        let r = call(
            c,
            vec![start(&[("streams", user)], &format!("probe{i}"))],
            None,
        )
        .await;
        taken += usize::from(r == Ok(vec![Code::Ok as i32]));
    }
    taken
}

/// `rls_given_back_total` with `reason` and `result` summed over rules.
fn given_back(server: &RunningServer, reason: &str, result: &str) -> f64 {
    ["tokens", "month", "streams", "requests", "guarded", "bulk", "bulk_guarded"]
        .iter()
        .filter_map(|rule| {
            sample(
                &server.metrics.render(),
                &format!("rls_given_back_total{{domain=\"ai\",reason=\"{reason}\",result=\"{result}\",rule=\"{rule}\"}}"),
            )
        })
        .sum()
}

/// Waits until the paused shard woke and the give-backs that follow it
/// ran: `reason`'s ok count reached `n` (bounded).
async fn settled(server: &RunningServer, reason: &str, n: f64) {
    tokio::time::sleep(Duration::from_millis(PAUSE_MS)).await;
    let until = Instant::now() + Duration::from_secs(10);
    while given_back(server, reason, "ok") < n && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        given_back(server, reason, "ok"),
        n,
        "given back for {reason}"
    );
}

/// Warms each shard's scripts (a NOSCRIPT answer from a paused node would
/// be resent only by the caller).
async fn warm(c: &mut Client, user: &str) {
    for key in ["user", "month", "requests", "guarded"] {
        left(c, &[(key, user)]).await;
    }
    let r = call(c, vec![start(&[("streams", user)], "warm")], None).await;
    assert_eq!(r, Ok(vec![Code::Ok as i32]));
    let mut done = start(&[("streams", user)], "warm");
    done.entries.push(
        envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry {
            key: "phase".into(),
            value: "done".into(),
        },
    );
    call(c, vec![done], None).await.expect("released");
}

/// Every case once, with users named from `prefix`; the give-back counts
/// `before` them.
async fn every_case(cluster: &RedisCluster, server: &RunningServer, prefix: &str) {
    let mut c = client(server).await;
    let (error0, late0) = (
        given_back(server, "error", "ok"),
        given_back(server, "late", "ok"),
    );

    // [slot, reservation] in turn, the reservation's shard paused past the
    // deadline: the slot is withdrawn at once, the reservation when it ran
    let u = user_across(cluster, &format!("{prefix}a"), "streams", "user");
    warm(&mut c, &u).await;
    pause(cluster, shard_of(cluster, &[("user", &u)]));
    let chat = vec![
        start(&[("streams", &u)], "c1"),
        start(&[("user", &u)], "c1"),
    ];
    let r = call(&mut c, chat, Some(DEADLINE)).await;
    assert_eq!(r, Err(tonic::Code::Unavailable), "{prefix}: closed");
    settled(server, "late", late0 + 1.0).await;
    assert_eq!(given_back(server, "error", "ok"), error0 + 1.0);
    assert_eq!(
        left(&mut c, &[("user", &u)]).await,
        1000,
        "{prefix}: reservation"
    );
    assert_eq!(free_slots(&mut c, &u).await, 3, "{prefix}: slots");

    // two reservations, the second's shard paused
    let u = user_across(cluster, &format!("{prefix}b"), "user", "month");
    warm(&mut c, &u).await;
    pause(cluster, shard_of(cluster, &[("month", &u)]));
    let chat = vec![start(&[("user", &u)], "c2"), start(&[("month", &u)], "c2")];
    let r = call(&mut c, chat, Some(DEADLINE)).await;
    assert_eq!(r, Err(tonic::Code::Unavailable));
    settled(server, "late", late0 + 2.0).await;
    assert_eq!(given_back(server, "error", "ok"), error0 + 2.0);
    assert_eq!(left(&mut c, &[("user", &u)]).await, 1000, "{prefix}: first");
    assert_eq!(
        left(&mut c, &[("month", &u)]).await,
        1000,
        "{prefix}: second"
    );

    // plain descriptors side by side, one shard paused
    let u = user_across(cluster, &format!("{prefix}c"), "requests", "guarded");
    warm(&mut c, &u).await;
    pause(cluster, shard_of(cluster, &[("guarded", &u)]));
    let both = vec![
        descriptor(&[("requests", &u)]),
        descriptor(&[("guarded", &u)]),
    ];
    let r = call(&mut c, both, Some(DEADLINE)).await;
    assert_eq!(r, Err(tonic::Code::Unavailable));
    settled(server, "late", late0 + 3.0).await;
    assert_eq!(given_back(server, "error", "ok"), error0 + 3.0);
    assert_eq!(left(&mut c, &[("requests", &u)]).await, 10, "{prefix}: tb");
    assert_eq!(
        left(&mut c, &[("guarded", &u)]).await,
        10,
        "{prefix}: paused"
    );

    // a caller that gives up (no deadline sent: it drops the call)
    let u = user_across(cluster, &format!("{prefix}d"), "streams", "user");
    warm(&mut c, &u).await;
    pause(cluster, shard_of(cluster, &[("user", &u)]));
    let chat = vec![
        start(&[("streams", &u)], "c4"),
        start(&[("user", &u)], "c4"),
    ];
    let dropped = tokio::time::timeout(Duration::from_millis(300), call(&mut c, chat, None)).await;
    assert!(dropped.is_err(), "the caller gave up");
    let mut c = client(server).await;
    settled(server, "late", late0 + 5.0).await;
    assert_eq!(
        left(&mut c, &[("user", &u)]).await,
        1000,
        "{prefix}: abandoned"
    );
    assert_eq!(free_slots(&mut c, &u).await, 3, "{prefix}: abandoned slots");
}

/// A commanded failover of one shard under a stream of two-descriptor
/// requests: whatever each got (admitted, or an error while the shard
/// moved), both budgets have lost exactly one token per admitted request.
async fn failing_over(cluster: &RedisCluster, server: &RunningServer) {
    let mut c = client(server).await;
    let u = user_across(cluster, "failover", "bulk", "bulk_guarded");
    for key in ["bulk", "bulk_guarded"] {
        left(&mut c, &[(key, &u)]).await;
    }
    let shard = shard_of(cluster, &[("bulk_guarded", &u)]);
    let replica = cluster.replica_of(shard);
    let out = cluster.nodes[replica].cli(&["CLUSTER", "FAILOVER"]);
    assert!(out.contains("OK"), "CLUSTER FAILOVER: {out}");
    let (mut admitted, mut failed) = (0u32, 0u32);
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let both = vec![
            descriptor(&[("bulk", &u)]),
            descriptor(&[("bulk_guarded", &u)]),
        ];
        match call(&mut c, both, Some(DEADLINE)).await {
            Ok(codes) => {
                assert_eq!(codes, [Code::Ok as i32; 2]);
                admitted += 1;
            }
            Err(_) => failed += 1,
        }
    }
    let until = Instant::now() + Duration::from_secs(10);
    while !cluster.nodes[replica].cli(&["ROLE"]).starts_with("master") {
        assert!(Instant::now() < until, "the replica never took over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // the give-backs of the failed ones, and any call followed past its budget
    tokio::time::sleep(Duration::from_millis(2500)).await;
    eprintln!("through the failover: {admitted} admitted, {failed} failed");
    for key in ["bulk", "bulk_guarded"] {
        assert_eq!(
            left(&mut c, &[(key, &u)]).await,
            100_000 - admitted,
            "{key}: {admitted} admitted, {failed} failed"
        );
    }
}

/// `n` processes that spin a core each until dropped.
struct BusyLoops(Vec<Child>);

impl BusyLoops {
    fn start(n: usize) -> Self {
        let spin = |_| {
            Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .spawn()
                .expect("sh spins")
        };
        Self((0..n).map(spin).collect())
    }
}

impl Drop for BusyLoops {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[tokio::test]
async fn a_request_that_fails_half_way_on_a_redis_cluster_holds_nothing() {
    let mut cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let server =
        tokenbucket_rls::server::start(&redis_args(&cluster.url(), &rules, Duration::from_secs(2)))
            .await
            .expect("server starts");
    every_case(&cluster, &server, "quiet").await;
    {
        let _busy = BusyLoops::start(4);
        every_case(&cluster, &server, "busy").await;
    }

    failing_over(&cluster, &server).await;

    // a killed shard: what the other descriptor took is given back, and
    // the killed one's call (which may have run) is counted, not guessed
    let mut c = client(&server).await;
    let u = user_across(&cluster, "killed", "requests", "guarded");
    warm(&mut c, &u).await;
    let error0 = given_back(&server, "error", "ok");
    let shard = shard_of(&cluster, &[("guarded", &u)]);
    cluster.nodes[shard].kill();
    let both = vec![
        descriptor(&[("requests", &u)]),
        descriptor(&[("guarded", &u)]),
    ];
    let r = call(&mut c, both, Some(DEADLINE)).await;
    assert_eq!(r, Err(tonic::Code::Unavailable));
    let until = Instant::now() + Duration::from_secs(10);
    while given_back(&server, "error", "ok") < error0 + 1.0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(given_back(&server, "error", "ok"), error0 + 1.0);
    assert_eq!(left(&mut c, &[("requests", &u)]).await, 10, "killed: tb");
    server.shutdown().await.expect("stop");
}
