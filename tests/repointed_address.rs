//! A single Redis behind an address that fails over by pointing somewhere
//! else (a Kubernetes Service, a DNS name, a proxy; no Sentinel, no
//! Cluster), as envoyproxy/ratelimit #1191 reports it: the demoted primary
//! keeps the connections it had, and every write on them answers
//! `READONLY` until the process restarts. Here a TCP proxy the test
//! controls stands for the address: after the failover it sends new
//! connections to the new primary while the old ones stay on the demoted
//! server. The service must dial the address again on `READONLY` and
//! decide on the new primary, every admitted decision charged once. And an
//! address that reaches a replica from the start: tried until it is one's
//! primary.

mod common;

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::{free_redis_port, RedisServer};
use common::{client, descriptor, request, rules_dir, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tokio::net::{TcpListener, TcpStream};

const BURST: f64 = 100_000.0;

/// A TCP proxy on a loopback port: each new connection goes to the port
/// `target` holds at that moment; connections already made stay where they
/// are (as a Service's do when its endpoints change).
struct Address {
    port: u16,
    target: Arc<AtomicU16>,
}

impl Address {
    async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let target = Arc::new(AtomicU16::new(target));
        let to = target.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let port = to.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", port)).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Self { port, target }
    }

    fn point_at(&self, port: u16) {
        self.target.store(port, Ordering::SeqCst);
    }
}

fn replication_up(server: &RedisServer) -> bool {
    server
        .cli(&["INFO", "replication"])
        .contains("master_link_status:up")
}

/// The service on the Redis at `url`, one closed rule `k` of burst
/// [`BURST`] (its rules' directory kept alive beside it).
async fn serve_on(url: String) -> (tempfile::TempDir, tokenbucket_rls::server::RunningServer) {
    let rules = rules_dir(&format!(
        "domain: d\ndescriptors:\n  - key: k\n    failure_mode: closed\n    rate_limit: {{unit: day, requests_per_unit: 1, burst: {BURST}}}\n"
    ));
    let mut args = serve_args(rules.path().to_path_buf());
    args.store = tokenbucket_rls::cli::StoreKind::Redis;
    args.redis_url = Some(url);
    args.redis_timeout = Duration::from_millis(500);
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    (rules, s)
}

/// `second`, a replica of `first`, holds the bucket and all `first` wrote.
fn caught_up(first: &RedisServer, second: &RedisServer) -> bool {
    let offset = |s: &RedisServer| {
        s.cli(&["INFO", "replication"])
            .lines()
            .find(|l| l.starts_with("master_repl_offset:"))
            .map(str::to_string)
    };
    second.cli(&["DBSIZE"]).trim() == "1"
        && offset(second).is_some()
        && offset(first) == offset(second)
}

fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn a_demoted_server_behind_a_repointed_address_is_left_at_once() {
    failover_behind_an_address(&[]).await;
}

/// The same where the address does not say its role (`ROLE` refused, as a
/// proxy such as twemproxy refuses it): the address is connected to again
/// once, which reaches the new primary.
#[tokio::test]
async fn an_address_that_does_not_say_its_role_is_connected_to_again() {
    failover_behind_an_address(&["--rename-command", "ROLE", ""]).await;
}

/// Two servers started with `extra`, the second a replica of the first,
/// behind one address; the failover between two calls, then sixteen
/// callers at once until each is decided again.
async fn failover_behind_an_address(extra: &[&str]) {
    let first = RedisServer::start(free_redis_port(), extra);
    let first_port = first.port.to_string();
    let mut replica_args = vec!["--replicaof", "127.0.0.1", &first_port];
    replica_args.extend_from_slice(extra);
    let second = RedisServer::start(free_redis_port(), &replica_args);
    if !extra.is_empty() {
        let role = second.cli(&["ROLE"]);
        assert!(role.contains("unknown command"), "ROLE refused: {role}");
    }
    wait_for("the replica in sync", || replication_up(&second));
    let address = Address::start(first.port).await;
    let (_rules, s) = serve_on(format!("redis://127.0.0.1:{}", address.port)).await;
    let mut c = client(&s).await;
    let mut admitted = 0u64;
    for _ in 0..100 {
        let r = c
            .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
            .await
            .expect("decided on the first primary")
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        admitted += 1;
    }
    wait_for("the replica caught up", || caught_up(&first, &second));
    // the failover, between two calls: the replica promoted, the address
    // pointed at it, the old primary demoted with its connections kept
    assert_eq!(second.cli(&["REPLICAOF", "NO", "ONE"]).trim(), "OK");
    address.point_at(second.port);
    assert_eq!(
        first
            .cli(&["REPLICAOF", "127.0.0.1", &second.port.to_string()])
            .trim(),
        "OK"
    );
    // sixteen callers at once, each calling until one of its calls is
    // decided again (a refused one is answered by the closed rule): many
    // READONLY answers together, one redial
    let started = Instant::now();
    let callers: Vec<_> = (0..16)
        .map(|_| {
            let mut c = c.clone();
            tokio::spawn(async move {
                let mut refused = 0u64;
                loop {
                    assert!(
                        started.elapsed() < Duration::from_secs(20),
                        "still answered by the failure mode after {refused} calls: the demoted server was never left"
                    );
                    match c
                        .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
                        .await
                    {
                        Ok(r) => {
                            assert_eq!(r.into_inner().overall_code, Code::Ok as i32);
                            return refused;
                        }
                        Err(e) => {
                            assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                            refused += 1;
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    }
                }
            })
        })
        .collect();
    let mut refused = 0u64;
    for caller in callers {
        refused += caller.await.expect("caller");
        admitted += 1;
    }
    let healed = started.elapsed();
    for _ in 0..200 {
        let r = c
            .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
            .await
            .expect("decided on the new primary")
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        admitted += 1;
    }
    eprintln!(
        "repointed address: decided again {healed:?} after the failover, {refused} calls answered by the failure mode in between"
    );
    // every admitted decision charged once, on the new primary (a call
    // answered READONLY ran nothing)
    let left = common::redis::tokens_on(second.port, "d", &[("k", "v")], "0").await;
    assert_eq!(
        left.round(),
        BURST - admitted as f64,
        "tokens left on the new primary"
    );
    s.shutdown().await.expect("stop");
}

/// An address that reaches a replica from the start (a mistake, or a
/// failover not finished): every decision is answered by the failure mode
/// (the replica answers READONLY, nothing is written there), the address
/// is tried again while it stays a replica, and once that server is
/// promoted, decisions go to it without a restart.
#[tokio::test]
async fn an_address_that_reaches_a_replica_is_tried_until_it_is_a_primary() {
    let first = RedisServer::standalone();
    let second = RedisServer::start(
        free_redis_port(),
        &["--replicaof", "127.0.0.1", &first.port.to_string()],
    );
    wait_for("the replica in sync", || replication_up(&second));
    let (_rules, s) = serve_on(second.url()).await;
    let mut c = client(&s).await;
    // a second of calls on the replica: all by the failure mode
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(1) {
        let e = c
            .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
            .await
            .expect_err("a replica decides nothing");
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(second.cli(&["DBSIZE"]).trim(), "0", "nothing written");
    assert_eq!(second.cli(&["REPLICAOF", "NO", "ONE"]).trim(), "OK");
    let promoted = Instant::now();
    let mut admitted = 0u64;
    while admitted < 100 {
        assert!(
            promoted.elapsed() < Duration::from_secs(20),
            "never decided on the promoted server"
        );
        match c
            .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
            .await
        {
            Ok(r) => {
                assert_eq!(r.into_inner().overall_code, Code::Ok as i32);
                admitted += 1;
            }
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                assert_eq!(admitted, 0, "once decided, every call is");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    let left = common::redis::tokens_on(second.port, "d", &[("k", "v")], "0").await;
    assert_eq!(left.round(), BURST - admitted as f64);
    s.shutdown().await.expect("stop");
}

/// The value of `rls_store_primary_events_total{event}` on `s`.
fn primary_events(s: &tokenbucket_rls::server::RunningServer, event: &str) -> f64 {
    let prefix = format!("rls_store_primary_events_total{{event=\"{event}\"}} ");
    s.metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()).map(str::to_string))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Issue 52: a demoted primary configured `replica-read-only no` takes the
/// writes of the connections it kept, answering no `READONLY` that would
/// tell: every decision admitted there and lost, nothing said. The service
/// asks the server its connections are on `ROLE` every half second, and
/// leaves one that says it is a replica: decisions go to the new primary
/// again, the demotion and the move counted.
#[tokio::test]
async fn a_demoted_server_that_still_takes_writes_is_left() {
    let first = RedisServer::start(free_redis_port(), &["--replica-read-only", "no"]);
    let second = RedisServer::start(
        free_redis_port(),
        &["--replicaof", "127.0.0.1", &first.port.to_string()],
    );
    wait_for("the replica in sync", || replication_up(&second));
    let address = Address::start(first.port).await;
    let (_rules, s) = serve_on(format!("redis://127.0.0.1:{}", address.port)).await;
    assert_eq!(
        primary_events(&s, "demoted"),
        0.0,
        "the series from the start"
    );
    let mut c = client(&s).await;
    for _ in 0..10 {
        decide(&mut c).await;
    }
    wait_for("the replica caught up", || caught_up(&first, &second));
    // the failover: the replica promoted, the address pointed at it, the
    // old primary demoted, still taking the writes of its connections
    assert_eq!(second.cli(&["REPLICAOF", "NO", "ONE"]).trim(), "OK");
    address.point_at(second.port);
    assert_eq!(
        first
            .cli(&["REPLICAOF", "127.0.0.1", &second.port.to_string()])
            .trim(),
        "OK"
    );
    let demoted = Instant::now();
    while primary_events(&s, "moved") < 1.0 {
        assert!(
            demoted.elapsed() < Duration::from_secs(20),
            "decisions still go to the demoted server"
        );
        decide(&mut c).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(primary_events(&s, "demoted") >= 1.0);
    let before = common::redis::tokens_on(second.port, "d", &[("k", "v")], "0").await;
    for _ in 0..100 {
        decide(&mut c).await;
    }
    let after = common::redis::tokens_on(second.port, "d", &[("k", "v")], "0").await;
    assert_eq!(
        (before - after).round(),
        100.0,
        "every decision after the move counted on the new primary"
    );
    eprintln!(
        "left the demoted server {:?} after the failover",
        demoted.elapsed()
    );
    s.shutdown().await.expect("stop");
}

/// One call of `k=v`, admitted (both servers take writes).
async fn decide(
    c: &mut envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<
        tonic::transport::Channel,
    >,
) {
    let r = c
        .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
        .await
        .expect("decided: both servers take writes")
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
}
