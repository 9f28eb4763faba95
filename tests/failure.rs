//! What happens when Redis fails, against real `redis-server` processes:
//! a hung server (SIGSTOP) is answered within the timeout until its probe
//! fails, and then at once by the open breaker; decisions return to Redis when it thaws, restarts or
//! comes back as a new cluster on the same ports; a call that timed out is
//! never sent twice.

mod common;

use std::time::{Duration, Instant};

use common::redis::{RedisCluster, RedisServer};
use common::{descriptor, request, rules_dir, sample, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use tokenbucket_rls::cli::StoreKind;
use tokenbucket_rls::rules::FailureMode;
use tokenbucket_rls::server::{self, RunningServer};
use tonic::transport::Channel;

const RULES: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requests_per_unit: 1, burst: 1000}\n";

async fn start(
    url: &str,
    dir: &tempfile::TempDir,
    timeout_ms: u64,
) -> (RunningServer, RateLimitServiceClient<Channel>) {
    let mut args = serve_args(dir.path().to_path_buf());
    args.store = StoreKind::Redis;
    args.redis_url = Some(url.to_string());
    args.redis_timeout = Duration::from_millis(timeout_ms);
    args.failure_mode = FailureMode::Open;
    let s = server::start(&args).await.expect("start");
    let c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    (s, c)
}

async fn call(c: &mut RateLimitServiceClient<Channel>, value: &str) -> RateLimitResponse {
    c.should_rate_limit(request("d", vec![descriptor(&[("k", value)])]))
        .await
        .expect("an open rule always answers")
        .into_inner()
}

/// Whether the answer came from Redis (a decision shows the limit) rather
/// than from the open failure mode (OK with no limit).
fn from_store(r: &RateLimitResponse) -> bool {
    r.statuses[0].current_limit.is_some()
}

fn metric(s: &RunningServer, name_and_labels: &str) -> f64 {
    sample(&s.metrics.render(), name_and_labels).unwrap_or(0.0)
}

/// Calls until an answer comes from Redis again, for at most `secs`.
async fn until_store_answers(
    c: &mut RateLimitServiceClient<Channel>,
    value: &str,
    secs: u64,
) -> RateLimitResponse {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let r = call(c, value).await;
        if from_store(&r) {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "decisions never returned to Redis"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_hung_redis_opens_the_breaker_and_thawing_closes_it() {
    let redis = RedisServer::standalone();
    let dir = rules_dir(RULES);
    let (s, mut c) = start(&redis.url(), &dir, 50).await;
    assert!(from_store(&call(&mut c, "a").await));

    redis.signal("-STOP");
    let mut from_redis = 0;
    for _ in 0..100 {
        if from_store(&call(&mut c, "a").await) {
            from_redis += 1;
        }
    }
    assert_eq!(from_redis, 0, "a frozen Redis decides nothing");
    let timeouts = metric(&s, "rls_store_errors_total{kind=\"timeout\"}");
    let fast = metric(&s, "rls_store_errors_total{kind=\"breaker_open\"}");
    // the first timeout starts a probe (250 ms deadline); calls wait out
    // their 50 ms timeout until it fails: about five of them
    assert_eq!(timeouts, 3.0, "a handful of calls wait out the timeout");
    assert_eq!(fast, 100.0 - timeouts, "the rest are answered at once");
    assert_eq!(metric(&s, "rls_failure_policy_total{mode=\"open\"}"), 100.0);
    let node = format!("127.0.0.1:{}", redis.port);
    // held calls return at once; the probe fails at its 250 ms deadline
    let deadline = Instant::now() + Duration::from_secs(3);
    while metric(&s, &format!("rls_store_breaker_open{{node=\"{node}\"}}")) != 1.0 {
        assert!(Instant::now() < deadline, "the breaker never opened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ready = reqwest::get(format!("http://{}/readyz", s.admin_addr))
        .await
        .expect("readyz");
    assert_eq!(
        ready.status().as_u16(),
        200,
        "a store outage is not this instance's"
    );
    let body = ready.text().await.expect("body");
    assert!(
        body.contains(&format!("{node}: circuit breaker open")),
        "{body}"
    );

    redis.signal("-CONT");
    let r = until_store_answers(&mut c, "a", 10).await;
    // 1000 − the first call − the calls that timed out (the frozen server
    // had received them and ran them when it thawed) − this call.
    assert_eq!(
        f64::from(r.statuses[0].limit_remaining),
        1000.0 - 1.0 - timeouts - 1.0,
        "the bucket kept its state"
    );
    assert_eq!(
        metric(&s, &format!("rls_store_breaker_open{{node=\"{node}\"}}")),
        0.0
    );
}

#[tokio::test]
async fn a_timed_out_call_is_not_sent_again() {
    let redis = RedisServer::standalone();
    let dir = rules_dir(RULES);
    let (_s, mut c) = start(&redis.url(), &dir, 50).await;
    let scripts = |r: &RedisServer| -> u64 {
        let info = r.cli(&["INFO", "commandstats"]);
        ["evalsha", "eval"]
            .iter()
            .map(|c| common::redis::command_calls(&info, c))
            .sum()
    };
    assert!(from_store(&call(&mut c, "once").await));
    let before = scripts(&redis);
    redis.signal("-STOP");
    let r = call(&mut c, "once").await;
    assert!(!from_store(&r), "timed out: the failure mode answered");
    redis.signal("-CONT");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The frozen server ran the command it had received once it thawed (so
    // it did spend a token), and nothing sent it a second time.
    assert_eq!(scripts(&redis) - before, 1, "the script ran exactly once");
    let r = until_store_answers(&mut c, "once", 10).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 997,
        "1 + the timed-out call + this one"
    );
}

#[tokio::test]
async fn a_restarted_redis_is_used_again_without_restarting_the_service() {
    let mut redis = RedisServer::standalone();
    let dir = rules_dir(RULES);
    let (_s, mut c) = start(&redis.url(), &dir, 100).await;
    assert!(from_store(&call(&mut c, "r").await));
    redis.kill();
    for _ in 0..10 {
        assert!(!from_store(&call(&mut c, "r").await));
    }
    redis.restart_blank();
    let r = until_store_answers(&mut c, "r", 20).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 999,
        "a blank Redis: a full bucket"
    );
}

#[tokio::test]
async fn a_new_cluster_on_the_same_ports_is_used_again() {
    let mut cluster = RedisCluster::start();
    let dir = rules_dir(RULES);
    let (_s, mut c) = start(&cluster.url(), &dir, 100).await;
    for v in ["a", "b", "c", "d"] {
        assert!(from_store(&call(&mut c, v).await));
    }
    cluster.kill_all();
    for _ in 0..10 {
        assert!(!from_store(&call(&mut c, "a").await));
    }
    cluster.recreate(); // new node ids, same addresses
    for v in ["a", "b", "c", "d"] {
        let r = until_store_answers(&mut c, v, 30).await;
        assert_eq!(
            r.statuses[0].limit_remaining, 999,
            "{v}: new cluster, full bucket"
        );
    }
}

#[tokio::test]
async fn store_calls_in_flight_are_bounded() {
    let redis = RedisServer::standalone();
    let dir = rules_dir(RULES);
    let mut args = serve_args(dir.path().to_path_buf());
    args.store = StoreKind::Redis;
    args.redis_url = Some(redis.url());
    args.redis_timeout = Duration::from_secs(2);
    args.failure_mode = FailureMode::Open;
    args.max_in_flight = 4;
    let s = server::start(&args).await.expect("start");
    let c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    redis.signal("-STOP");
    let calls: Vec<_> = (0..20)
        .map(|i| {
            let mut c = c.clone();
            tokio::spawn(async move { call(&mut c, &format!("v{i}")).await })
        })
        .collect();
    // The 16 over the bound are answered at once by the failure mode; the 4
    // in flight wait for Redis (2 s) and then fail open too.
    let started = Instant::now();
    while metric(&s, "rls_store_errors_total{kind=\"overloaded\"}") < 16.0 {
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "overloaded calls waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for call in calls {
        assert!(
            !from_store(&call.await.expect("task")),
            "no answer came from the frozen Redis"
        );
    }
    assert_eq!(
        metric(&s, "rls_store_errors_total{kind=\"overloaded\"}"),
        16.0
    );
    assert_eq!(metric(&s, "rls_store_errors_total{kind=\"timeout\"}"), 4.0);
    redis.signal("-CONT");
}

/// The caller's deadline (`grpc-timeout`, Envoy's filter timeout) caps the
/// store call: with Redis frozen and a 500 ms store timeout, a call with a
/// 100 ms deadline is answered by the rule's failure mode in time, not by
/// DEADLINE_EXCEEDED.
#[tokio::test]
async fn the_callers_deadline_caps_the_store_call() {
    let redis = RedisServer::standalone();
    let dir = rules_dir(RULES);
    let (s, mut c) = start(&redis.url(), &dir, 500).await;
    assert!(from_store(&call(&mut c, "a").await));
    redis.signal("-STOP");
    let mut req = tonic::Request::new(request("d", vec![descriptor(&[("k", "a")])]));
    req.set_timeout(Duration::from_millis(100));
    // Without the cap the call would wait the store's 500 ms and the
    // client's own 100 ms timeout would fail it.
    let r = c.should_rate_limit(req).await;
    redis.signal("-CONT");
    let r = r.expect("answered before the deadline").into_inner();
    assert!(!from_store(&r), "answered by the open failure mode");
    assert_eq!(metric(&s, "rls_failure_policy_total{mode=\"open\"}"), 1.0);
}

/// `used_memory` and `maxmemory` of a server, from `INFO memory`.
fn memory(redis: &RedisServer) -> (u64, u64) {
    let info = redis.cli(&["INFO", "memory"]);
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .expect("INFO memory field")
    };
    (field("used_memory"), field("maxmemory"))
}

async fn readyz(s: &RunningServer) -> (u16, String) {
    let r = reqwest::get(format!("http://{}/readyz", s.admin_addr))
        .await
        .expect("readyz");
    (r.status().as_u16(), r.text().await.expect("body"))
}

/// A flood of new values fills a Redis with a small `maxmemory` and
/// `noeviction`: `/readyz` warns first, then writes fail with `OOM`,
/// counted as their own kind, and the failure modes answer (open: OK, closed:
/// an error); nothing crashes or hangs, and the instance stays ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_warns_first_then_its_oom_errors_answer_by_the_failure_modes() {
    let redis = RedisServer::standalone();
    let dir = rules_dir(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requests_per_unit: 10, burst: 100}\n  - key: closed\n    failure_mode: closed\n    rate_limit: {unit: day, requests_per_unit: 10, burst: 100}\n",
    );
    let (s, c) = start(&redis.url(), &dir, 500).await;
    // room for a few thousand bucket keys above what the server uses now
    let (used, _) = memory(&redis);
    let limit = (used + 512 * 1024).to_string();
    assert!(redis
        .cli(&["CONFIG", "SET", "maxmemory", &limit])
        .contains("OK"));
    let mut warned = false;
    let mut next = 0;
    for _ in 0..400 {
        let batch: Vec<_> = (0..50)
            .map(|i| {
                let mut c = c.clone();
                let v = format!("flood-{}", next + i);
                tokio::spawn(async move { call(&mut c, &v).await })
            })
            .collect();
        next += 50;
        for b in batch {
            b.await.expect("answered");
        }
        // the warning must show before the first OOM
        let oom = metric(&s, "rls_store_errors_total{kind=\"oom\"}");
        if !warned {
            let (status, body) = readyz(&s).await;
            assert_eq!(status, 200, "{body}");
            warned = body.contains("of maxmemory");
            assert!(warned || oom == 0.0, "OOM before any warning: {body}");
        }
        // past 80 % by this test's own reading, flood slowly, so that the
        // once-a-second watch reads the node several times before it is full
        // (client buffers make used_memory move by tens of KB either way)
        let (used, max) = memory(&redis);
        if used * 100 >= max * 80 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if metric(&s, "rls_store_errors_total{kind=\"oom\"}") > 0.0 {
            break;
        }
    }
    assert!(warned, "never warned");
    let oom = metric(&s, "rls_store_errors_total{kind=\"oom\"}");
    assert!(oom > 0.0, "the flood never met OOM");
    assert_eq!(metric(&s, "rls_store_errors_total{kind=\"script\"}"), 0.0);
    let text = s.metrics.render();
    assert!(
        text.lines().any(
            |l| l.starts_with("rls_store_node_memory_bytes{kind=\"max\"")
                && l.ends_with(&format!(" {limit}"))
        ),
        "maxmemory exported per node"
    );
    // Near the limit, used_memory moves with client buffers, so a write
    // may pass now and then; well below what it holds, none does: a new
    // open key is answered by its mode, a closed one refused.
    let (used, _) = memory(&redis);
    assert!(redis
        .cli(&["CONFIG", "SET", "maxmemory", &(used / 2).to_string()])
        .contains("OK"));
    let mut c = c;
    let r = call(&mut c, "after-the-flood").await;
    assert!(!from_store(&r), "OK from the open mode");
    let closed = c
        .should_rate_limit(request("d", vec![descriptor(&[("closed", "x")])]))
        .await;
    assert!(closed.is_err(), "the closed mode refuses: {closed:?}");
    assert_eq!(
        readyz(&s).await.0,
        200,
        "a full Redis is not this instance's problem"
    );
}

/// A busy node is waited for while its breaker trusts it: with Redis busy
/// for 300 ms at a time (`CLIENT PAUSE 300 ALL`: it answers, late; in
/// effect once the command has answered, so no race with the call) beside four
/// busy loops, calls whose deadline is 1 s are all decided by Redis,
/// exactly, not by the failure mode after the 50 ms `--redis-timeout` (as
/// they were: the audit saw answers by the failure mode from nodes that
/// were busy, not hung). A call without a deadline keeps the short timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_node_is_waited_for_within_the_callers_deadline() {
    let redis = RedisServer::standalone();
    let dir = rules_dir(RULES);
    let (s, mut c) = start(&redis.url(), &dir, 50).await;
    let first = call(&mut c, "busy").await;
    assert!(from_store(&first));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let neighbours: Vec<_> = (0..4)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                }
                x
            })
        })
        .collect();
    let busy = || redis.cli(&["CLIENT", "PAUSE", "300", "ALL"]);
    let mut remaining = first.statuses[0].limit_remaining;
    for _ in 0..5 {
        let paused = busy();
        let mut req = tonic::Request::new(request("d", vec![descriptor(&[("k", "busy")])]));
        req.set_timeout(Duration::from_secs(1));
        let r = c
            .should_rate_limit(req)
            .await
            .expect("answered")
            .into_inner();
        assert_eq!(paused, "OK\n");
        assert!(from_store(&r), "decided by Redis, not the failure mode");
        remaining -= 1;
        assert_eq!(r.statuses[0].limit_remaining, remaining, "exact");
    }
    assert_eq!(metric(&s, "rls_failure_policy_total{mode=\"open\"}"), 0.0);
    // no deadline: the short timeout, and the open failure mode answers
    assert_eq!(busy(), "OK\n");
    let r = call(&mut c, "busy").await;
    assert!(!from_store(&r));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for n in neighbours {
        let _ = n.join();
    }
}
