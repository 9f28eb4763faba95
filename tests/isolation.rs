//! Failure isolation on a real 3+3 Redis Cluster, with the service's default
//! flags: one hung primary affects only the descriptors whose slots it owns,
//! each answered by its rule's failure mode, while the other primaries keep
//! exact decisions, and so again after it is killed (until its replica
//! takes over, when every key is decided by Redis again); a load spike on a healthy cluster with
//! CPU-bound neighbours does not switch limiting off.

mod common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use common::redis::RedisCluster;
use common::{descriptor, request, rules_dir, sample, ChildGuard};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tokenbucket_rls::cli::Cli;
use tokenbucket_rls::limiter::key::{descriptor_tag, KeyOrigin};
use tokenbucket_rls::rules::BucketValue;
use tokenbucket_rls::server::{self, RunningServer};
use tokenbucket_rls::store::redis::{slot_of, tag_hash};
use tonic::transport::Channel;

const RULES: &str = r#"
domain: d
descriptors:
  - key: open_k
    failure_mode: open
    rate_limit: {unit: day, requests_per_unit: 1, burst: 4}
  - key: closed_k
    failure_mode: closed
    rate_limit: {unit: day, requests_per_unit: 1, burst: 4}
  - key: local_k
    failure_mode: local
    rate_limit: {unit: day, requests_per_unit: 1, burst: 4}
  - key: spike
    rate_limit: {unit: day, requests_per_unit: 1, burst: 200}
"#;

/// A server on `url` with the command line's defaults for everything else.
async fn start(url: &str, rules: &tempfile::TempDir) -> RunningServer {
    let config = rules.path().to_str().expect("utf-8 path");
    let cli = Cli::parse_from([
        "tokenbucket-rls",
        "--config",
        config,
        "--store",
        "redis",
        "--redis-url",
        url,
        "--grpc-addr",
        "127.0.0.1:0",
        "--admin-addr",
        "127.0.0.1:0",
    ]);
    server::start(&cli.serve).await.expect("server starts")
}

async fn client(s: &RunningServer) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect")
}

/// What one call came to: OK decided by Redis (with a limit), OK from the
/// open failure mode (no limit), OVER_LIMIT, or a failed call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Ok,
    OkWithoutLimit,
    Over,
    Failed,
}

async fn call(c: &mut RateLimitServiceClient<Channel>, key: &str, value: &str) -> Answer {
    match c
        .should_rate_limit(request("d", vec![descriptor(&[(key, value)])]))
        .await
    {
        Err(_) => Answer::Failed,
        Ok(r) => {
            let r = r.into_inner();
            match (
                r.overall_code == Code::OverLimit as i32,
                r.statuses[0].current_limit.is_some(),
            ) {
                (true, _) => Answer::Over,
                (false, true) => Answer::Ok,
                (false, false) => Answer::OkWithoutLimit,
            }
        }
    }
}

async fn calls(
    c: &mut RateLimitServiceClient<Channel>,
    key: &str,
    value: &str,
    n: usize,
) -> Vec<Answer> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(call(c, key, value).await);
    }
    out
}

/// Values of `key` whose buckets live on node `on` (or off it), `n` of them,
/// never handed out twice; by the slot owners read before any fault.
struct Values {
    next: usize,
    owners: Vec<usize>,
}

impl Values {
    fn pick(&mut self, key: &str, on: usize, want_on: bool, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        while out.len() < n {
            self.next += 1;
            let value = format!("v{}", self.next);
            let tag = descriptor_tag(
                KeyOrigin::Rule,
                "d",
                [(key, BucketValue::Value(&value))].into_iter(),
            );
            let owner = self.owners[usize::from(slot_of(tag_hash(&tag)))];
            if (owner == on) == want_on {
                out.push(value);
            }
        }
        out
    }
}

fn breaker_open(s: &RunningServer, port: u16) -> f64 {
    sample(
        &s.metrics.render(),
        &format!("rls_store_breaker_open{{node=\"127.0.0.1:{port}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Waits (3 s at most) until the breaker of the node on `port` is open.
async fn until_breaker_opens(s: &RunningServer, port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while breaker_open(s, port) != 1.0 {
        assert!(
            Instant::now() < deadline,
            "the {what} node's breaker never opened"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const EXACT: [Answer; 6] = [
    Answer::Ok,
    Answer::Ok,
    Answer::Ok,
    Answer::Ok,
    Answer::Over,
    Answer::Over,
];

/// Keys on the healthy primaries decide exactly.
async fn healthy_keys_are_exact(
    c: &mut RateLimitServiceClient<Channel>,
    values: &mut Values,
    sick: usize,
    when: &str,
) {
    for key in ["open_k", "closed_k", "local_k"] {
        for v in values.pick(key, sick, false, 2) {
            assert_eq!(
                calls(c, key, &v, 6).await,
                EXACT,
                "{when}: {key}={v} on a healthy primary"
            );
        }
    }
}

/// Keys on the sick primary answer by their failure mode.
async fn sick_keys_answer_by_their_mode(
    c: &mut RateLimitServiceClient<Channel>,
    values: &mut Values,
    sick: usize,
    when: &str,
) {
    for v in values.pick("open_k", sick, true, 2) {
        assert_eq!(
            calls(c, "open_k", &v, 6).await,
            [Answer::OkWithoutLimit; 6],
            "{when}: open"
        );
    }
    for v in values.pick("closed_k", sick, true, 2) {
        assert_eq!(
            calls(c, "closed_k", &v, 3).await,
            [Answer::Failed; 3],
            "{when}: closed"
        );
    }
    for v in values.pick("local_k", sick, true, 2) {
        // a fresh local bucket of B/N = 4 (one instance)
        assert_eq!(calls(c, "local_k", &v, 6).await, EXACT, "{when}: local");
    }
}

/// Waits (`secs` at most) until a fresh key on node `sick` is decided by
/// Redis again.
async fn until_redis_decides(
    c: &mut RateLimitServiceClient<Channel>,
    values: &mut Values,
    sick: usize,
    secs: u64,
    what: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let v = values.pick("open_k", sick, true, 1).remove(0);
    while call(c, "open_k", &v).await != Answer::Ok {
        assert!(Instant::now() < deadline, "{what} never decided again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sick_primary_affects_only_its_own_keys() {
    let mut cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let s = start(&cluster.url(), &rules).await;
    let mut c = client(&s).await;
    let mut values = Values {
        next: 0,
        owners: cluster.slot_owners(),
    };
    let primaries = cluster.primaries();
    let sick = primaries[0];
    let sick_port = cluster.nodes[sick].port;
    healthy_keys_are_exact(&mut c, &mut values, sick, "all healthy").await;

    // Hung: the node's breaker opens, its keys answer by their mode.
    cluster.nodes[sick].signal("-STOP");
    sick_keys_answer_by_their_mode(&mut c, &mut values, sick, "hung").await;
    // held calls return at once; the probe fails at its 250 ms deadline
    until_breaker_opens(&s, sick_port, "hung").await;
    healthy_keys_are_exact(&mut c, &mut values, sick, "one primary hung").await;
    for &other in primaries.iter().filter(|&&p| p != sick) {
        assert_eq!(breaker_open(&s, cluster.nodes[other].port), 0.0);
    }
    let answered_at_once = sample(
        &s.metrics.render(),
        "rls_store_errors_total{kind=\"breaker_open\"}",
    )
    .unwrap_or(0.0);
    assert!(
        answered_at_once > 0.0,
        "an open breaker answers without waiting"
    );

    // Thawed: decided by Redis again, without a restart.
    cluster.nodes[sick].signal("-CONT");
    until_redis_decides(&mut c, &mut values, sick, 10, "the thawed node").await;
    assert_eq!(breaker_open(&s, sick_port), 0.0);

    // Killed, and no failover yet (its replica is told to wait; the other
    // primaries keep serving their slots): its keys answer by their mode,
    // the other primaries' keys stay exact.
    cluster.config_set_all("cluster-require-full-coverage", "no");
    let replica = cluster.replica_of(sick);
    let out = cluster.nodes[replica].cli(&["CONFIG", "SET", "cluster-replica-no-failover", "yes"]);
    assert!(out.contains("OK"), "{out}");
    cluster.nodes[sick].kill();
    sick_keys_answer_by_their_mode(&mut c, &mut values, sick, "killed").await;
    until_breaker_opens(&s, sick_port, "killed").await;
    healthy_keys_are_exact(&mut c, &mut values, sick, "one primary killed").await;
    sick_keys_answer_by_their_mode(&mut c, &mut values, sick, "still killed").await;
    healthy_keys_are_exact(&mut c, &mut values, sick, "one primary still killed").await;

    // Its replica takes over: Redis decides those keys again, and the others.
    let out = cluster.nodes[replica].cli(&["CLUSTER", "FAILOVER", "TAKEOVER"]);
    assert!(out.contains("OK"), "{out}");
    until_redis_decides(&mut c, &mut values, sick, 30, "the failed-over slots").await;
    // every connection of the client back (the readiness body says so)
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let body = reqwest::get(format!("http://{}/readyz", s.admin_addr))
            .await
            .expect("readyz")
            .text()
            .await
            .expect("body");
        if !body.contains("not fully reachable") && !body.contains("breaker open") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the store never came back whole: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    healthy_keys_are_exact(&mut c, &mut values, sick, "after the failover").await;
}

/// CPU-bound processes beside the test, killed when dropped.
struct Neighbours(#[allow(dead_code)] Vec<ChildGuard>);

impl Neighbours {
    fn spin(n: usize) -> Self {
        Self(
            (0..n)
                .map(|_| {
                    ChildGuard(
                        Command::new("sh")
                            .args(["-c", "while :; do :; done"])
                            .stdout(Stdio::null())
                            .spawn()
                            .expect("spin"),
                    )
                })
                .collect(),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_spike_on_a_healthy_cluster_keeps_limiting() {
    let cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let s = start(&cluster.url(), &rules).await;
    let channels: Vec<_> = {
        let mut v = Vec::new();
        for _ in 0..8 {
            v.push(client(&s).await);
        }
        v
    };
    let _busy = Neighbours::spin(2);
    const ROUNDS: usize = 5;
    const BURST: usize = 200;
    const REQUESTS: usize = 2000;
    const CALLERS: usize = 40;
    for round in 0..ROUNDS {
        let before = s.metrics.render();
        let count = |text: &str, kind: &str| {
            sample(text, &format!("rls_store_errors_total{{kind=\"{kind}\"}}")).unwrap_or(0.0)
        };
        let value = format!("round-{round}");
        let (sent, admitted) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let tasks: Vec<_> = (0..CALLERS)
            .map(|i| {
                let mut c = channels[i % channels.len()].clone();
                let (sent, admitted, value) = (sent.clone(), admitted.clone(), value.clone());
                tokio::spawn(async move {
                    while sent.fetch_add(1, Ordering::SeqCst) < REQUESTS {
                        let a = call(&mut c, "spike", &value).await;
                        assert_ne!(a, Answer::Failed);
                        if matches!(a, Answer::Ok | Answer::OkWithoutLimit) {
                            admitted.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("caller");
        }
        let text = s.metrics.render();
        let timeouts = count(&text, "timeout") - count(&before, "timeout");
        // calls held while a suspect node's probe was out
        let held = count(&text, "breaker_open") - count(&before, "breaker_open");
        let admitted = admitted.load(Ordering::SeqCst) as f64;
        // A call past its timeout, or held, is answered by the (open)
        // failure mode: it may admit one request over the burst; nothing
        // else may. A timed-out call may also have spent a token.
        let by_mode = timeouts + held;
        assert!(
            admitted <= BURST as f64 + by_mode,
            "round {round}: admitted {admitted} > burst {BURST} + {timeouts} timed out + {held} held"
        );
        assert!(
            admitted >= BURST as f64 - timeouts,
            "round {round}: admitted {admitted} < burst {BURST} - {timeouts} timed-out calls"
        );
        assert!(
            by_mode <= 100.0,
            "round {round}: {timeouts} timed out and {held} held of {REQUESTS} calls (the bound is 5 %)"
        );
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("rls_store_breaker_open{") && l.ends_with(" 1")),
            "round {round}: a breaker opened under load:\n{text}"
        );
    }
}
