//! The swap's last seams (#68): calls alternate between envoyproxy/ratelimit
//! (replayed as its source defines it, `common::ratelimit_peer`) and our
//! binary started with its environment, on one Redis and on a Redis
//! Cluster, the way a rolling update sends them, and the two admit one
//! budget exactly: a descriptor carrying Envoy's `limit` override counts in
//! its fixed-window key; `quota_mode` refuses once every quota-mode
//! descriptor of a request is over; with
//! `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true` a refused request counts
//! its hits only on the limits it went over (`INCRBY key 0` on the others).

mod common;

use common::ratelimit_peer::{hour_with_room, Peer, PeerAnswer, PeerDescriptor, PeerLimit};
use common::redis::{RedisCluster, RedisServer};
use common::{request, rules_dir};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const RULES: &str = r#"
domain: seams
descriptors:
  - key: route
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: regular
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: quota
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: pool
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 4}
  - key: a
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: b
    rate_limit: {unit: hour, requests_per_unit: 7}
  - key: bucket
    algorithm: token_bucket
    rate_limit: {unit: hour, requests_per_unit: 3}
"#;

const HOUR: u64 = 3600;

type Client = RateLimitServiceClient<tonic::transport::Channel>;

/// An override's unit on the wire.
const PER_SECOND: i32 = 1;
const PER_HOUR: i32 = 3;

/// A descriptor as Envoy sends it; `limit`: its override (requests, unit).
fn wire(d: &PeerDescriptor, limit: Option<(u32, i32)>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: d
            .entries
            .iter()
            .map(|(key, value)| Entry {
                key: key.clone(),
                value: value.clone(),
            })
            .collect(),
        limit: limit.map(|(requests_per_unit, unit)| RateLimitOverride {
            requests_per_unit,
            unit,
        }),
        ..Default::default()
    }
}

/// Our binary's answer, in the peer's terms.
async fn ours(
    c: &mut Client,
    descriptors: &[PeerDescriptor],
    limit: Option<(u32, i32)>,
) -> PeerAnswer {
    let r = c
        .should_rate_limit(request(
            "seams",
            descriptors.iter().map(|d| wire(d, limit)).collect(),
        ))
        .await
        .expect("decided")
        .into_inner();
    PeerAnswer {
        over: r.overall_code == Code::OverLimit as i32,
        statuses: r
            .statuses
            .iter()
            .map(|s| {
                (
                    s.code == Code::OverLimit as i32,
                    u64::from(s.limit_remaining),
                )
            })
            .collect(),
    }
}

/// `calls` calls of `descriptors`, alternating: envoyproxy/ratelimit's pod
/// first, then ours; each answer's overall code as `expected` says (true:
/// OVER_LIMIT). `limit`: the override every descriptor carries.
async fn rolling(
    c: &mut Client,
    peer: &Peer<'_>,
    descriptors: &[PeerDescriptor],
    limit: Option<(u32, i32)>,
    expected: &[bool],
) -> Vec<PeerAnswer> {
    let mut answers = Vec::new();
    for (i, over) in expected.iter().enumerate() {
        let answer = match i % 2 {
            0 => peer.call("seams", descriptors, 1),
            _ => ours(c, descriptors, limit).await,
        };
        let who = ["envoyproxy/ratelimit", "ours"][i % 2];
        assert_eq!(answer.over, *over, "call {i} ({who}): {answer:?}");
        answers.push(answer);
    }
    answers
}

fn one(entries: &[(&str, &str)], limit: PeerLimit) -> PeerDescriptor {
    PeerDescriptor::new(entries, Some(limit))
}

/// An override on a descriptor: one fixed window in its key, whichever pod
/// counts; its bytes, count and expiry as there.
async fn override_is_one_budget(c: &mut Client, peer: &Peer<'_>) {
    let hour = hour_with_room().await;
    let d = [one(&[("route", "r1")], PeerLimit::per(5, HOUR))];
    let expected: Vec<bool> = (0..12).map(|i| i >= 5).collect();
    rolling(c, peer, &d, Some((5, PER_HOUR)), &expected).await;
    let key = format!("rl:seams_route_r1_{hour}");
    assert_eq!((peer.cli)(&["GET", &key]).trim(), "12");
    let ttl: i64 = (peer.cli)(&["TTL", &key]).trim().parse().expect("TTL");
    assert!((3500..=HOUR as i64 + 300).contains(&ttl), "TTL {ttl}");
    // the same entries without the override: the rule's own (100 an hour),
    // in the same key there too
    let rule = [one(&[("route", "r2")], PeerLimit::per(100, HOUR))];
    rolling(c, peer, &rule, None, &[false; 4]).await;
    let key = format!("rl:seams_route_r2_{hour}");
    assert_eq!((peer.cli)(&["GET", &key]).trim(), "4");
}

/// A per-second override counts in the per-second Redis (`REDIS_PERSECOND`),
/// in its key there too: 3 of 5 calls alternating in one second. Calls
/// that straddle a second's end are tried again on a fresh value.
async fn per_second_override_is_one_budget(c: &mut Client, per_second: &Peer<'_>) {
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
    };
    for attempt in 0..10 {
        // start just after a second begins
        let into = now().subsec_millis();
        tokio::time::sleep(std::time::Duration::from_millis(u64::from(1005 - into))).await;
        let second = now().as_secs();
        let value = format!("ps{attempt}");
        let d = [one(&[("route", &value)], PeerLimit::per(3, 1))];
        let mut admitted = 0;
        for i in 0..5 {
            let answer = match i % 2 {
                0 => per_second.call("seams", &d, 1),
                _ => ours(c, &d, Some((3, PER_SECOND))).await,
            };
            admitted += usize::from(!answer.over);
        }
        if now().as_secs() != second {
            continue; // the window ended on the way
        }
        assert_eq!(admitted, 3, "one budget");
        let key = format!("rl:seams_route_{value}_{second}");
        assert_eq!((per_second.cli)(&["GET", &key]).trim(), "5");
        return;
    }
    panic!("no try fell within one second");
}

/// `quota_mode`: a request passes while one of its quota-mode descriptors
/// has room, and is refused once all are over; a regular one as usual.
async fn quota_mode_is_one_budget(c: &mut Client, peer: &Peer<'_>) {
    let hour = hour_with_room().await;
    let quota = PeerLimit::per(3, HOUR).quota();
    let mixed = [
        one(&[("regular", "x")], PeerLimit::per(5, HOUR)),
        one(&[("quota", "x")], quota),
    ];
    // the regular limit has room; its only quota is over from the 4th call
    let answers = rolling(
        c,
        peer,
        &mixed,
        None,
        &[false, false, false, true, true, true],
    )
    .await;
    assert_eq!(answers[3].statuses, [(false, 1), (true, 0)], "as there");
    let quotas = [
        one(&[("quota", "y")], quota),
        one(&[("pool", "y")], PeerLimit::per(4, HOUR).quota()),
    ];
    // the pool has room on the 4th call: it passes; on the 5th neither
    let answers = rolling(
        c,
        peer,
        &quotas,
        None,
        &[false, false, false, false, true, true],
    )
    .await;
    assert_eq!(answers[3].statuses, [(true, 0), (false, 0)]);
    // every hit counts in its keys, the refused ones too
    for (key, count) in [("regular_x", "6"), ("quota_x", "6"), ("pool_y", "6")] {
        let key = format!("rl:seams_{key}_{hour}");
        assert_eq!((peer.cli)(&["GET", &key]).trim(), count, "{key}");
    }
}

/// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true`: a request that would go
/// over one limit counts its hits there only (`INCRBY key 0` on the
/// others), so a descriptor alone still has what the refused requests did
/// not take.
async fn stop_increment_is_one_budget(c: &mut Client, peer: &Peer<'_>) {
    let hour = hour_with_room().await;
    let both = [
        one(&[("a", "s")], PeerLimit::per(5, HOUR)),
        one(&[("b", "s")], PeerLimit::per(7, HOUR)),
    ];
    let expected: Vec<bool> = (0..10).map(|i| i >= 5).collect();
    let answers = rolling(c, peer, &both, None, &expected).await;
    assert_eq!(answers[9].statuses, [(true, 0), (false, 2)], "b untouched");
    let b = [one(&[("b", "s")], PeerLimit::per(7, HOUR))];
    rolling(c, peer, &b, None, &[false, false, true]).await;
    for (key, count) in [("a_s", "10"), ("b_s", "8")] {
        let key = format!("{}seams_{key}_{hour}", peer.prefix);
        assert_eq!((peer.cli)(&["GET", &key]).trim(), count, "{key}");
    }
    // a token bucket of ours, in keys of its own behind the same prefix
    let bucket = [one(&[("bucket", "s")], PeerLimit::per(3, HOUR))];
    for over in [false, false, false, true] {
        assert_eq!(ours(c, &bucket, None).await.over, over);
    }
    let pattern = format!("{}rls:*", peer.prefix);
    let ours = (peer.cli)(&["--scan", "--pattern", &pattern]);
    assert!(!ours.trim().is_empty(), "{ours}");
}

/// The variables of a pod of either service on `redis_url`.
fn environment(redis: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    let mut env = vec![("REDIS_SOCKET_TYPE", "tcp".to_string())];
    if !redis.iter().any(|(k, _)| *k == "CACHE_KEY_PREFIX") {
        env.push(("CACHE_KEY_PREFIX", "rl:".to_string()));
    }
    env.extend_from_slice(redis);
    env
}

#[tokio::test]
async fn overrides_and_quota_mode_are_one_budget_on_one_redis() {
    let redis = RedisServer::standalone();
    let per_second = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let env = environment(&[
        ("REDIS_URL", format!("127.0.0.1:{}", redis.port)),
        ("REDIS_PERSECOND", "true".to_string()),
        ("REDIS_PERSECOND_SOCKET_TYPE", "tcp".to_string()),
        (
            "REDIS_PERSECOND_URL",
            format!("127.0.0.1:{}", per_second.port),
        ),
    ]);
    let (_child, mut c) = common::ratelimit_binary(rules.path(), &env).await;
    let cli = |args: &[&str]| redis.cli(args);
    let peer = Peer::on("rl:", &cli);
    override_is_one_budget(&mut c, &peer).await;
    quota_mode_is_one_budget(&mut c, &peer).await;
    let cli = |args: &[&str]| per_second.cli(args);
    let peer = Peer::on("rl:", &cli);
    per_second_override_is_one_budget(&mut c, &peer).await;
    // no bucket in keys of our own
    assert_eq!(redis.cli(&["KEYS", "rl:rls:{*"]).trim(), "");
}

#[tokio::test]
async fn overrides_and_quota_mode_are_one_budget_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let env = environment(&[
        ("REDIS_TYPE", "cluster".to_string()),
        ("REDIS_URL", cluster.seeds()),
    ]);
    let (_child, mut c) = common::ratelimit_binary(rules.path(), &env).await;
    let cli = |args: &[&str]| cluster.cli(args);
    let peer = Peer::on("rl:", &cli);
    override_is_one_budget(&mut c, &peer).await;
    quota_mode_is_one_budget(&mut c, &peer).await;
}

#[tokio::test]
async fn stop_cache_key_increment_when_overlimit_is_one_budget_on_one_redis() {
    let redis = RedisServer::standalone();
    let rules = rules_dir(RULES);
    let env = environment(&[
        ("REDIS_URL", format!("127.0.0.1:{}", redis.port)),
        (
            "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
            "true".to_string(),
        ),
    ]);
    let (_child, mut c) = common::ratelimit_binary(rules.path(), &env).await;
    let cli = |args: &[&str]| redis.cli(args);
    let peer = Peer::on("rl:", &cli).stopping();
    stop_increment_is_one_budget(&mut c, &peer).await;
}

#[tokio::test]
async fn stop_cache_key_increment_when_overlimit_is_one_budget_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let env = environment(&[
        ("REDIS_TYPE", "cluster".to_string()),
        ("REDIS_URL", cluster.seeds()),
        (
            "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
            "true".to_string(),
        ),
        // a hash tag in the prefix, as some deployments write it: every
        // key of both services in the slot of `rl`
        ("CACHE_KEY_PREFIX", "{rl}:".to_string()),
    ]);
    let (_child, mut c) = common::ratelimit_binary(rules.path(), &env).await;
    let cli = |args: &[&str]| cluster.cli(args);
    let peer = Peer::on("{rl}:", &cli).stopping();
    stop_increment_is_one_budget(&mut c, &peer).await;
}

/// Files envoyproxy/ratelimit loads start our pods under its environment
/// (a rollout does not stall on them): a domain whose `descriptors:` is
/// null, `requests_per_unit` beside `unlimited: true`, a second YAML
/// document (ignored, as there), and the first document's rules decide.
#[tokio::test]
async fn files_it_loads_start_our_pods() {
    let rules = tempfile::tempdir().expect("tempdir");
    for (name, text) in [
        ("empty.yaml", "domain: empty\ndescriptors:\n"),
        (
            "open.yaml",
            "domain: open\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n      requests_per_unit: 5\n",
        ),
        (
            "two.yaml",
            "domain: seams\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 1}\n---\ndomain: other\ndescriptors: []\n",
        ),
    ] {
        std::fs::write(rules.path().join(name), text).expect("write");
    }
    let env = [("USE_STATSD", "false".to_string())];
    let (_child, mut c) = common::ratelimit_binary(rules.path(), &env).await;
    let a = [one(&[("a", "x")], PeerLimit::per(1, HOUR))];
    assert!(!ours(&mut c, &a, None).await.over);
    assert!(ours(&mut c, &a, None).await.over);
}
