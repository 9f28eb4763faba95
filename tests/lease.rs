//! Leasing against a real 3+3 Redis Cluster: two service instances hammering
//! one leased key never admit more than the shared bucket, lose no more than
//! their unspent leases (which go back at shutdown and on reload), and the
//! fleet receives the bucket's refill rate.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::RedisCluster;
use common::{client, descriptor, request, rules_dir};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use tokenbucket_rls::server::RunningServer;
use tonic::transport::Channel;

const RULES: &str = r#"
domain: d
descriptors:
  - key: hot
    lease: {size: 50, ttl: 30s}
    rate_limit: {unit: day, requests_per_unit: 1, burst: 500}
  - key: flowing
    lease: {size: 50, ttl: 30s}
    rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
"#;

async fn start(url: &str, rules: &tempfile::TempDir) -> RunningServer {
    common::start_on_redis(url, rules, Duration::from_secs(1)).await
}

async fn call(c: &mut RateLimitServiceClient<Channel>, key: &str) -> RateLimitResponse {
    c.should_rate_limit(request("d", vec![descriptor(&[(key, "k")])]))
        .await
        .expect("decided")
        .into_inner()
}

/// What one instance's clients saw.
#[derive(Default)]
struct Seen {
    admitted: AtomicUsize,
    rejected_with_retry: AtomicUsize,
}

/// `clients` clients per instance call `key` until `stop` says so; returns
/// what each instance admitted.
async fn hammer(
    servers: &[&RunningServer],
    clients: usize,
    key: &'static str,
    stop: impl Fn(usize) -> bool + Send + Sync + 'static,
) -> Vec<Arc<Seen>> {
    let stop = Arc::new(stop);
    let sent = Arc::new(AtomicUsize::new(0));
    let seen: Vec<Arc<Seen>> = servers.iter().map(|_| Arc::default()).collect();
    let mut tasks = Vec::new();
    for (server, seen) in servers.iter().zip(&seen) {
        for _ in 0..clients {
            let mut c = client(server).await;
            let (seen, sent, stop) = (seen.clone(), sent.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                while !stop(sent.fetch_add(1, Ordering::SeqCst)) {
                    let r = call(&mut c, key).await;
                    if r.overall_code == Code::Ok as i32 {
                        seen.admitted.fetch_add(1, Ordering::SeqCst);
                    } else if r.statuses[0]
                        .duration_until_reset
                        .as_ref()
                        .is_some_and(|d| d.seconds > 0)
                    {
                        seen.rejected_with_retry.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("client task");
    }
    seen
}

fn admitted(seen: &[Arc<Seen>]) -> usize {
    seen.iter().map(|s| s.admitted.load(Ordering::SeqCst)).sum()
}

#[tokio::test]
async fn two_leasing_instances_admit_at_most_the_bucket_and_lose_only_unspent_leases() {
    let cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let a = start(&cluster.url(), &rules).await;
    let b = start(&cluster.url(), &rules).await;

    let seen = hammer(&[&a, &b], 22, "hot", |sent| sent >= 5000).await;
    let total = admitted(&seen);
    let (la, lb) = (a.metrics.lease_counts(), b.metrics.lease_counts());
    let held = usize::try_from(la.held + lb.held).expect("held is never negative");
    println!(
        "admitted {total} (a {}, b {}), unspent leases {held}, grants {} + {}",
        seen[0].admitted.load(Ordering::SeqCst),
        seen[1].admitted.load(Ordering::SeqCst),
        la.grants,
        lb.grants
    );
    assert!(total <= 500, "admitted {total} > B = 500");
    assert!(
        total + held >= 500,
        "admitted {total} + unspent {held} < 500"
    );
    assert!(
        held <= 2 * 50,
        "at most one lease per instance unspent: {held}"
    );
    let rejected: usize = seen
        .iter()
        .map(|s| s.rejected_with_retry.load(Ordering::SeqCst))
        .sum();
    assert_eq!(
        total + rejected,
        5000,
        "every rejection says when to retry (a token a day: 86400 s)"
    );
    // a grant takes at least half a lease until the bucket runs dry
    assert!(
        la.grants + lb.grants <= 500 / 25 + 4,
        "lease grants {} + {}",
        la.grants,
        lb.grants
    );
    assert_eq!(la.local_hits + lb.local_hits, total as u64);

    // shutdown gives the unspent tokens back: a fresh instance can spend
    // exactly those
    let (ma, mb) = (a.metrics.clone(), b.metrics.clone());
    a.shutdown().await.expect("a stops");
    b.shutdown().await.expect("b stops");
    let returned = ma.lease_counts().returned + mb.lease_counts().returned;
    assert_eq!(returned, held as u64);
    assert_eq!(ma.lease_counts().held + mb.lease_counts().held, 0);
    let c = start(&cluster.url(), &rules).await;
    let again = hammer(&[&c], 4, "hot", |sent| sent >= 400).await;
    assert_eq!(
        total + admitted(&again),
        500,
        "the {held} unspent tokens came back at shutdown"
    );
}

#[tokio::test]
async fn the_fleet_receives_the_refill_rate_within_the_lease_bound() {
    let cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let a = start(&cluster.url(), &rules).await;
    let b = start(&cluster.url(), &rules).await;
    const RUN: Duration = Duration::from_secs(5);

    let started = Instant::now();
    let seen = hammer(&[&a, &b], 20, "flowing", move |_| started.elapsed() >= RUN).await;
    let elapsed = started.elapsed().as_secs_f64();
    let total = admitted(&seen) as f64;
    let rejected: usize = seen
        .iter()
        .map(|s| s.rejected_with_retry.load(Ordering::SeqCst))
        .sum();
    assert!(
        rejected > 0,
        "the clients never outpaced the refill, so this measured nothing"
    );
    let held = (a.metrics.lease_counts().held + b.metrics.lease_counts().held) as f64;
    let (b_cap, rate) = (1000.0, 1000.0);
    println!(
        "admitted {total}, rejected {rejected} in {elapsed:.2} s (a {}, b {}), unspent {held}; B + r·t = {}",
        seen[0].admitted.load(Ordering::SeqCst),
        seen[1].admitted.load(Ordering::SeqCst),
        b_cap + rate * elapsed
    );
    assert!(
        total <= b_cap + rate * elapsed,
        "admitted {total} > B + r·t = {}",
        b_cap + rate * elapsed
    );
    // tokens refilled while no client was asking yet (start-up) or after the
    // last one stopped are not lost but unspent: allow a quarter second
    let floor = b_cap + rate * RUN.as_secs_f64() - held - rate * 0.25;
    assert!(total >= floor, "admitted {total} < {floor}");
    for (name, s) in ["a", "b"].iter().zip(&seen) {
        let share = s.admitted.load(Ordering::SeqCst) as f64 / total;
        assert!(share >= 0.1, "instance {name} got {share:.2} of the tokens");
    }
}

#[tokio::test]
async fn a_reload_and_a_shutdown_give_unspent_tokens_back() {
    let cluster = RedisCluster::start();
    let rules = rules_dir(RULES);
    let s = start(&cluster.url(), &rules).await;
    let mut c = client(&s).await;

    let r = call(&mut c, "hot").await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 499, "49 leased + 450 shared");
    assert_eq!(s.metrics.lease_counts().held, 49);

    std::fs::write(
        rules.path().join("rules.yaml"),
        format!("{RULES}  - key: other\n    rate_limit: {{unit: day, requests_per_unit: 5}}\n"),
    )
    .expect("rewrite rules");
    s.reloader.reload(true);
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.metrics.lease_counts().returned < 49 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let counts = s.metrics.lease_counts();
    assert_eq!((counts.returned, counts.held), (49, 0));

    // the next lease starts from a bucket that has them back
    let r = call(&mut c, "hot").await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 498);
    assert_eq!(s.metrics.lease_counts().held, 49);

    // and so does a shutdown: a new instance's first lease sees 500 - 3
    let metrics = s.metrics.clone();
    s.shutdown().await.expect("stops");
    assert_eq!(metrics.lease_counts().returned, 98);
    let t = start(&cluster.url(), &rules).await;
    let mut c = client(&t).await;
    let r = call(&mut c, "hot").await;
    assert_eq!(r.statuses[0].limit_remaining, 497);
}

/// Audit 1, through a real gRPC deadline: while Redis is paused, callers
/// cancelled by their 5 ms deadline (Envoy's filter timeout does this) leave
/// the leased key answering again once Redis is back, with every token
/// accounted for.
#[tokio::test]
async fn callers_cancelled_by_their_deadline_do_not_wedge_a_leased_key() {
    let redis = common::redis::RedisServer::standalone();
    let rules = rules_dir(
        "domain: d\ndescriptors:\n  - key: leased\n    lease: {size: 10, ttl: 30s}\n    rate_limit: {unit: hour, requests_per_unit: 100, burst: 100}\n",
    );
    let s = common::start_on_redis(&redis.url(), &rules, Duration::from_secs(2)).await;
    let mut c = client(&s).await;
    let with_deadline = |ms: u64| {
        let mut r = tonic::Request::new(request("d", vec![descriptor(&[("leased", "k")])]));
        r.set_timeout(Duration::from_millis(ms));
        r
    };
    let mut admitted = 0;
    // Redis paused for a second before the key's first call: that caller's
    // refill, and the callers waiting on it, are cancelled by 5 ms deadlines.
    redis.cli(&["CLIENT", "PAUSE", "1000", "ALL"]);
    let paused_at = Instant::now();
    let mut cancelled = 0;
    for _ in 0..40 {
        match c.should_rate_limit(with_deadline(5)).await {
            Ok(r) => admitted += usize::from(r.into_inner().overall_code == Code::Ok as i32),
            Err(status) => {
                // the server's deadline or the client's own timeout, first
                assert!(
                    matches!(
                        status.code(),
                        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
                    ),
                    "{status}"
                );
                cancelled += 1;
            }
        }
    }
    assert_eq!(cancelled, 40, "every caller waited on the paused refill");
    assert!(
        paused_at.elapsed() < Duration::from_millis(900),
        "the drain outlasted the pause; the test proves nothing"
    );

    // Redis is back: the key answers, from Redis or the lease.
    tokio::time::sleep(Duration::from_millis(1200).saturating_sub(paused_at.elapsed())).await;
    for i in 0..20 {
        let r = c
            .should_rate_limit(with_deadline(2000))
            .await
            .unwrap_or_else(|e| panic!("call {i} after the pause: {e}"))
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32, "call {i} after the pause");
        admitted += 1;
    }

    // Every token is accounted for: what was admitted, plus what the
    // instance gives back at shutdown, is what the bucket lost.
    let metrics = s.metrics.clone();
    s.shutdown().await.expect("stops");
    let counts = metrics.lease_counts();
    assert_eq!((counts.held, counts.lost), (0, 0), "{counts:?}");
    let t = common::start_on_redis(&redis.url(), &rules, Duration::from_secs(2)).await;
    let mut c = client(&t).await;
    let mut check = request("d", vec![descriptor(&[("leased", "k")])]);
    check.descriptors[0].hits_addend =
        Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
    let r = c
        .should_rate_limit(check)
        .await
        .expect("decided")
        .into_inner();
    let remaining = r.statuses[0].limit_remaining as usize;
    // at 100 per hour, at most one token refilled during the test
    assert!(
        (100 - admitted..=100 - admitted + 1).contains(&remaining),
        "remaining {remaining}, admitted {admitted}, {counts:?}"
    );
}
