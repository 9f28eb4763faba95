//! A rule's `replication:` (#52 item 1) against real processes: a primary,
//! two replicas and three sentinels on loopback. An admission of such a
//! rule is answered only once both replicas hold it (`WAIT 2` after the
//! decision, on a connection of its own), so a promotion, commanded or
//! after the primary was killed, loses none of them; without the replicas
//! the rule answers by its failure mode, and the rules beside it do not
//! notice.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::sentinel::{Seen, SentinelSet};
use common::{client, descriptor, request, rules_dir};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

/// `hot` asks both replicas, waiting up to the longest timeout a rule may
/// give (beside CPU-bound loops, replicas took over 100 ms to acknowledge);
/// `plain` (the same budget) asks none.
const RULES: &str = "domain: d
descriptors:
  - key: hot
    failure_mode: closed
    replication: {replicas: 2, timeout: 1s}
    rate_limit: {unit: day, requests_per_unit: 1, burst: 100000}
  - key: plain
    failure_mode: closed
    rate_limit: {unit: day, requests_per_unit: 1, burst: 100000}
  - key: reserved
    failure_mode: closed
    replication: {replicas: 2, timeout: 1s}
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 1000}
    attempts: {key: request_id, ttl: 1m, reserve: 100}
";

const BURST: f64 = 100_000.0;

/// The calls a second the failover runs are sent at (the rate at which a
/// rule without `replication:` lost 1,352–1,865 tokens, docs/redis.md).
const RATE: u64 = 1_500;

async fn tokens_on(port: u16, key: &str, value: &str) -> f64 {
    common::redis::tokens_on(port, "d", &[(key, value)], "0").await
}

fn store_errors(s: &tokenbucket_rls::server::RunningServer, kind: &str) -> f64 {
    let prefix = format!("rls_store_errors_total{{kind=\"{kind}\"}} ");
    s.metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// One decision of `key=value`: its overall code, or the gRPC error's.
async fn decide(
    c: &mut RateLimitServiceClient<tonic::transport::Channel>,
    key: &str,
    value: &str,
) -> Result<i32, tonic::Code> {
    c.should_rate_limit(request("d", vec![descriptor(&[(key, value)])]))
        .await
        .map(|r| r.get_ref().overall_code)
        .map_err(|e| e.code())
}

/// Both replicas answering, each admission is held by both when it is
/// answered. One replica frozen: the rule fails closed (`UNAVAILABLE`),
/// counted as `not_replicated`, while `plain` beside it on the same primary
/// is admitted; thawed, admissions resume.
#[tokio::test]
async fn an_admission_waits_for_both_replicas_and_fails_closed_without_one() {
    let set = SentinelSet::start();
    set.replicas_caught_up(set.primary());
    let rules = rules_dir(RULES);
    let s = common::start_on_redis(&set.url(), &rules, Duration::from_millis(500)).await;
    let mut c = client(&s).await;
    let primary = set.primary();
    for _ in 0..20 {
        assert_eq!(decide(&mut c, "hot", "a").await, Ok(Code::Ok as i32));
    }
    // held by each replica as it was answered
    for (i, server) in set.servers.iter().enumerate() {
        if i != primary {
            assert_eq!(
                tokens_on(server.port, "hot", "a").await.round(),
                BURST - 20.0
            );
        }
    }
    let waits =
        common::redis::command_calls(&set.servers[primary].cli(&["INFO", "commandstats"]), "wait");
    assert!(waits >= 20, "a WAIT after each admission: {waits}");
    assert_eq!(store_errors(&s, "not_replicated"), 0.0);

    for key in ["plain", "hot"] {
        let started = Instant::now();
        for _ in 0..200 {
            assert_eq!(decide(&mut c, key, "t").await, Ok(Code::Ok as i32));
        }
        eprintln!(
            "200 calls of {key} one after another: {:?}",
            started.elapsed()
        );
    }

    let frozen = (0..3).find(|i| *i != primary).expect("a replica");
    set.servers[frozen].signal("-STOP");
    for _ in 0..5 {
        assert_eq!(
            decide(&mut c, "hot", "a").await,
            Err(tonic::Code::Unavailable),
            "one replica of two holds it: the rule's failure mode (closed)"
        );
        assert_eq!(decide(&mut c, "plain", "a").await, Ok(Code::Ok as i32));
    }
    assert_eq!(store_errors(&s, "not_replicated"), 5.0);
    // issue 67: the failure mode's answer replaced each admission, so
    // what it took on the primary is given back, and what `plain` took
    // beside it in one request; a reservation's start is withdrawn
    for _ in 0..3 {
        let both = vec![descriptor(&[("plain", "b")]), descriptor(&[("hot", "b")])];
        let r = c.should_rate_limit(request("d", both)).await;
        assert_eq!(
            r.map_err(|e| e.code()).err(),
            Some(tonic::Code::Unavailable)
        );
    }
    let start = descriptor(&[("reserved", "r"), ("request_id", "r1")]);
    let r = c.should_rate_limit(request("d", vec![start])).await;
    assert_eq!(
        r.map_err(|e| e.code()).err(),
        Some(tonic::Code::Unavailable)
    );
    let port = set.servers[primary].port;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        // a bucket given back to full may be dropped: full
        let full = |t: Option<f64>| t.unwrap_or(BURST).round();
        let on = common::redis::stored_tokens_on;
        let held = (
            full(on(port, "d", &[("hot", "a")], "0").await),
            full(on(port, "d", &[("hot", "b")], "0").await),
            full(on(port, "d", &[("plain", "b")], "0").await),
        );
        if held == (BURST - 20.0, BURST, BURST) || Instant::now() > deadline {
            assert_eq!(
                held,
                (BURST - 20.0, BURST, BURST),
                "(hot a, hot b, plain b)"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    set.servers[frozen].signal("-CONT");
    let deadline = Instant::now() + Duration::from_secs(10);
    while decide(&mut c, "hot", "a").await != Ok(Code::Ok as i32) {
        assert!(Instant::now() < deadline, "admissions never resumed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut check = descriptor(&[("reserved", "r")]);
    check.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
    let r = c
        .should_rate_limit(request("d", vec![check]))
        .await
        .expect("checked");
    assert_eq!(
        r.into_inner().statuses[0].limit_remaining,
        1000,
        "withdrawn"
    );
    // withdrawn, not settled: its done call is charged in full
    let mut done = descriptor(&[("reserved", "r"), ("request_id", "r1"), ("phase", "done")]);
    done.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 100 });
    let r = c
        .should_rate_limit(request("d", vec![done]))
        .await
        .expect("charged");
    assert_eq!(r.into_inner().statuses[0].limit_remaining, 900);
    s.shutdown().await.expect("stop");
}

/// Calls of `hot=value` at [`RATE`] a second from 8 clients, counted in
/// `seen`, until it stops.
async fn traffic(
    s: &tokenbucket_rls::server::RunningServer,
    value: &'static str,
    seen: &Arc<Seen>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let clients = 8u64;
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let mut c = client(s).await;
        let seen = seen.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 * clients / RATE));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !seen.stopped() {
                tick.tick().await;
                match decide(&mut c, "hot", value).await {
                    Ok(code) if code == Code::Ok as i32 => seen.admitted(),
                    Ok(code) => panic!("refused ({code}) with {BURST} tokens of burst"),
                    Err(code) => {
                        assert_eq!(code, tonic::Code::Unavailable);
                        seen.failed();
                    }
                }
            }
        }));
    }
    tasks
}

/// Every admission is on the new primary: the tokens left there are at
/// most the burst less those admitted (less again by calls that ran and
/// were answered by the failure mode: replicated too late).
fn check_nothing_lost(label: &str, seen: &Seen, tokens: f64, started: Instant) {
    let admitted = seen.admitted.load(Ordering::SeqCst) as f64;
    let unavailable = seen.unavailable.load(Ordering::SeqCst);
    let lost = (tokens - (BURST - admitted)).round();
    eprintln!(
        "{label}: {admitted} admitted ({:.0}/s), {unavailable} answered by the failure mode; \
         tokens left minus expected: {lost}",
        admitted / started.elapsed().as_secs_f64()
    );
    assert!(
        lost <= 0.0,
        "{label}: {lost} admissions lost in the failover"
    );
    assert!(
        lost >= -(unavailable as f64),
        "{label}: more tokens gone ({}) than admitted and unanswered calls",
        -lost
    );
}

/// A sentinel set with both replicas online (a replica's first sync waits
/// a few seconds), the service on it, and a second of [`traffic`] on
/// `hot=value` (its rate printed).
struct Running {
    set: SentinelSet,
    _rules: tempfile::TempDir,
    service: tokenbucket_rls::server::RunningServer,
    seen: Arc<Seen>,
    started: Instant,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

async fn start_traffic(value: &'static str) -> Running {
    let set = SentinelSet::start();
    set.replicas_caught_up(set.primary());
    let rules = rules_dir(RULES);
    let service = common::start_on_redis(&set.url(), &rules, Duration::from_millis(500)).await;
    let seen = Arc::new(Seen::new());
    let started = Instant::now();
    let tasks = traffic(&service, value, &seen).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    eprintln!(
        "{value}: {}/s before the failover",
        seen.admitted.load(Ordering::SeqCst)
    );
    Running {
        set,
        _rules: rules,
        service,
        seen,
        started,
        tasks,
    }
}

impl Running {
    /// Stops the traffic and checks, on the primary at `port`, that no
    /// admission was lost ([`check_nothing_lost`]).
    async fn stop_and_check(self, label: &str, value: &str, port: u16) {
        self.seen.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            t.await.expect("traffic task");
        }
        let tokens = tokens_on(port, "hot", value).await;
        check_nothing_lost(label, &self.seen, tokens, self.started);
        self.service.shutdown().await.expect("stop");
    }
}

#[tokio::test]
async fn a_commanded_failover_loses_no_admission_of_a_replicated_rule() {
    let mut run = start_traffic("commanded").await;
    let failover = run.set.fail_over(false, &run.seen).await;
    run.stop_and_check("SENTINEL FAILOVER", "commanded", failover.new_port)
        .await;
}

/// The primary killed: once the sentinels named another, it is started
/// again (and made a replica by them), as an orchestrator would; until
/// then the new primary has one replica, and the rule fails closed.
#[tokio::test]
async fn a_killed_primary_loses_no_admission_of_a_replicated_rule() {
    let mut run = start_traffic("killed").await;
    let old = run.set.primary();
    let old_port = run.set.servers[old].port;
    run.set.servers[old].kill();
    let new_port = run.set.named_other_than(old_port).await;
    run.set.servers[old].restart();
    // admissions resume once the new primary has two replicas again
    let before = run.seen.admitted.load(Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(60);
    while run.seen.admitted.load(Ordering::SeqCst) < before + 100 {
        assert!(
            Instant::now() < deadline,
            "admissions never resumed on the new primary"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    run.stop_and_check("primary killed", "killed", new_port)
        .await;
}
