//! The Redis store behind Redis Sentinel (#40), against real processes: a
//! primary, two replicas and three sentinels on loopback. Decisions go to
//! the primary the sentinels name and follow it through a failover, both
//! the commanded kind (`SENTINEL FAILOVER`) and a primary killed outright,
//! with no decision sent twice; the budget lost to asynchronous replication
//! is measured; a master no sentinel knows stops the start; sentinels that
//! do not answer leave the rules' failure modes answering.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::{bucket_key_in, stored_bucket};
use common::sentinel::SentinelSet;
use common::{client, descriptor, request, rules_dir};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use fred::prelude::*;

const RULES: &str = "domain: d\ndescriptors:\n  - key: hot\n    failure_mode: closed\n    rate_limit: {unit: day, requests_per_unit: 1, burst: 100000}\n";

const BURST: f64 = 100_000.0;

/// Tokens left in the bucket of `hot=value`, read on the server at `port`.
async fn tokens_on(port: u16, value: &str) -> f64 {
    let config = tokenbucket_rls::store::redis::url::parse(&format!("redis://127.0.0.1:{port}"))
        .expect("url");
    let raw = Builder::from_config(config).build().expect("client");
    raw.init().await.expect("raw client connects");
    let key = bucket_key_in("d", &[("hot", value)], "0");
    stored_bucket(&raw, &key)
        .await
        .expect("the bucket is there")
        .0
}

/// What the traffic saw: admitted, answered by the failure mode, and the
/// first admission after `since` was set (ms after it).
#[derive(Default)]
struct Seen {
    admitted: AtomicU64,
    unavailable: AtomicU64,
    /// Set by the test when the sentinels name the new primary (ms since
    /// the test's epoch; 0: not yet).
    announced_at: AtomicU64,
    /// The first admission at or after `announced_at` (ms since the epoch).
    first_after: AtomicU64,
    stop: AtomicBool,
}

async fn failover_keeps_the_budget(kill: bool) {
    let mut set = SentinelSet::start();
    let rules = rules_dir(RULES);
    let s = common::start_on_redis(&set.url(), &rules, Duration::from_millis(500)).await;
    let value = if kill { "killed" } else { "commanded" };
    let epoch = Instant::now();
    let seen = Arc::new(Seen::default());
    let traffic = {
        let mut c = client(&s).await;
        let seen = seen.clone();
        tokio::spawn(async move {
            let mut calls = 0;
            while !seen.stop.load(Ordering::SeqCst) && calls < 60_000 {
                calls += 1;
                match c
                    .should_rate_limit(request("d", vec![descriptor(&[("hot", value)])]))
                    .await
                {
                    Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => {
                        seen.admitted.fetch_add(1, Ordering::SeqCst);
                        let announced = seen.announced_at.load(Ordering::SeqCst);
                        let now = epoch.elapsed().as_millis() as u64;
                        if announced > 0 && now >= announced {
                            let _ = seen.first_after.compare_exchange(
                                0,
                                now,
                                Ordering::SeqCst,
                                Ordering::SeqCst,
                            );
                        }
                    }
                    Ok(r) => panic!("refused with {} tokens of burst left: {r:?}", BURST),
                    Err(e) => {
                        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                        seen.unavailable.fetch_add(1, Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        seen.admitted.load(Ordering::SeqCst) > 0,
        "traffic flowed before the failover"
    );
    let old = set.primary();
    let old_port = set.servers[old].port;
    // This blocks the test's runtime (traffic and service included): no
    // write comes between the replicas having everything and the failover.
    set.replicas_caught_up(old);
    let started = Instant::now();
    let admitted_before = seen.admitted.load(Ordering::SeqCst);
    if kill {
        set.servers[old].kill();
    } else {
        let out = set.sentinels[0].cli(&["SENTINEL", "FAILOVER", common::sentinel::MASTER]);
        assert_eq!(out.trim(), "OK", "SENTINEL FAILOVER: {out}");
    }
    // wait, off the runtime, until every sentinel names another primary
    let ports: Vec<u16> = set.sentinels.iter().map(|s| s.port).collect();
    let new_port = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let named: Vec<Option<u16>> = ports
                .iter()
                .map(|p| {
                    common::redis::redis_cli(
                        *p,
                        &[
                            "SENTINEL",
                            "GET-MASTER-ADDR-BY-NAME",
                            common::sentinel::MASTER,
                        ],
                    )
                    .lines()
                    .nth(1)
                    .and_then(|p| p.trim().parse().ok())
                })
                .collect();
            if let Some(Some(port)) = named.first() {
                if *port != old_port && named.iter().all(|n| *n == Some(*port)) {
                    return *port;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the sentinels never named a new primary: {named:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    })
    .await
    .expect("poll");
    let announced = epoch.elapsed().as_millis().max(1) as u64;
    seen.announced_at.store(announced, Ordering::SeqCst);
    let failover_took = started.elapsed();
    // decisions reach the new primary (its first script call), and are
    // admitted again
    let switched = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let stats = common::redis::redis_cli(new_port, &["INFO", "commandstats"]);
            if common::redis::command_calls(&stats, "evalsha")
                + common::redis::command_calls(&stats, "eval")
                > 0
            {
                return Instant::now();
            }
            assert!(
                Instant::now() < deadline,
                "decisions never reached the new primary"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    })
    .await
    .expect("poll");
    let switched_ms = (switched - epoch).as_millis() as i64 - announced as i64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.first_after.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < deadline,
            "decisions never resumed after the failover"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // what was admitted from the failover's start until the service had
    // surely switched (an ask of the sentinels and a connect after the
    // announcement): the most writes the old primary can have taken unseen
    tokio::time::sleep(Duration::from_millis(300)).await;
    let in_window = (seen.admitted.load(Ordering::SeqCst) - admitted_before) as f64;
    seen.stop.store(true, Ordering::SeqCst);
    traffic.await.expect("traffic task");
    let resumed_ms = seen.first_after.load(Ordering::SeqCst) - announced;

    let admitted = seen.admitted.load(Ordering::SeqCst) as f64;
    let unavailable = seen.unavailable.load(Ordering::SeqCst);
    let tokens = tokens_on(new_port, value).await;
    // Without failures, tokens = burst − admitted (the refill is 1/day).
    // Writes the old primary acknowledged and never replicated are lost,
    // and their tokens spent again (positive); a call answered by the
    // failure mode that ran anyway spent a token nobody used (negative, one
    // per such call at most). A decision sent twice would spend one more
    // than both allow.
    let drift = (tokens - (BURST - admitted)).round();
    eprintln!(
        "sentinel {}: new primary announced {failover_took:?} after the {}; the new primary's first decision {switched_ms} ms after the announcement, an admission {resumed_ms} ms after it; \
         {admitted} admitted ({in_window} from the start of the failover to 300 ms after the announcement), {unavailable} answered by the failure mode (closed); tokens left minus expected: {drift} (lost writes minus calls that ran unanswered)",
        if kill { "kill" } else { "FAILOVER" },
        if kill { "kill" } else { "command" },
    );
    assert!(
        drift >= -(unavailable as f64),
        "no more tokens gone than admitted requests plus unanswered calls: {tokens} left after {admitted} admitted"
    );
    assert!(
        drift <= in_window,
        "at most the writes between the failover's start and the switch are lost: {drift} of {in_window}"
    );

    // exact again: ten calls, ten tokens
    let mut c = client(&s).await;
    let before = tokens_on(new_port, value).await;
    for _ in 0..10 {
        let r = c
            .should_rate_limit(request("d", vec![descriptor(&[("hot", value)])]))
            .await
            .expect("answered");
        assert_eq!(r.get_ref().overall_code, Code::Ok as i32);
    }
    assert_eq!(
        tokens_on(new_port, value).await.round(),
        (before - 10.0).round()
    );
    s.shutdown().await.expect("stop");
}

#[tokio::test]
async fn decisions_follow_a_commanded_failover() {
    failover_keeps_the_budget(false).await;
}

#[tokio::test]
async fn decisions_follow_a_killed_primary_replaced() {
    failover_keeps_the_budget(true).await;
}

#[tokio::test]
async fn a_master_no_sentinel_knows_stops_the_start() {
    let set = SentinelSet::start();
    let rules = rules_dir(RULES);
    let args = common::redis_args(&set.url_for("nosuch"), &rules, Duration::from_millis(500));
    let e = match tokenbucket_rls::server::start(&args).await {
        Ok(_) => panic!("a master no sentinel knows must stop the start"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("know no master named 'nosuch'"), "{e}");
}

#[tokio::test]
async fn sentinels_that_do_not_answer_leave_the_failure_mode_answering() {
    let rules = rules_dir(RULES);
    let closed: Vec<String> = (0..2)
        .map(|_| format!("127.0.0.1:{}", common::redis::free_redis_port()))
        .collect();
    let url = format!("redis-sentinel://{}/mymaster", closed.join(","));
    let s = common::start_on_redis(&url, &rules, Duration::from_millis(500)).await;
    let mut c = client(&s).await;
    let e = c
        .should_rate_limit(request("d", vec![descriptor(&[("hot", "x")])]))
        .await
        .expect_err("a closed rule with no primary");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    s.shutdown().await.expect("stop");
}

/// The binary started with envoyproxy/ratelimit's environment for
/// Sentinel (`REDIS_TYPE=sentinel`, `REDIS_URL=master,sentinel,…`), the
/// sentinels asking for a password of their own (`REDIS_SENTINEL_AUTH`):
/// decisions land on the primary.
#[tokio::test]
async fn envoyproxy_ratelimits_sentinel_settings_reach_the_primary() {
    let set = SentinelSet::start();
    let primary = set.servers[set.primary()].port;
    for s in &set.sentinels {
        assert_eq!(
            s.cli(&["ACL", "SETUSER", "default", "on", ">watch"]).trim(),
            "OK"
        );
    }
    let rules = rules_dir(RULES);
    let (grpc, admin) = (common::free_port(), common::free_port());
    let sentinels: Vec<String> = set
        .sentinels
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port))
        .collect();
    let _child = common::ChildGuard(
        common::binary_without_rls_env()
            .env("RUNTIME_ROOT", rules.path())
            .env("RUNTIME_SUBDIRECTORY", ".")
            .env("RUNTIME_APPDIRECTORY", ".")
            .env("GRPC_HOST", "127.0.0.1")
            .env("GRPC_PORT", grpc.to_string())
            .env("HOST", "127.0.0.1")
            .env("PORT", admin.to_string())
            .env("REDIS_TYPE", "sentinel")
            .env(
                "REDIS_URL",
                format!("{},{}", common::sentinel::MASTER, sentinels.join(",")),
            )
            .env("REDIS_SENTINEL_AUTH", "watch")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start the binary"),
    );
    common::until_ok(&format!("http://127.0.0.1:{admin}/readyz"), "ready").await;
    let mut c = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .expect("connect");
    for _ in 0..3 {
        let r = c
            .should_rate_limit(request("d", vec![descriptor(&[("hot", "env")])]))
            .await
            .expect("decided on the primary")
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
    }
    assert_eq!(tokens_on(primary, "env").await.round(), BURST - 3.0);
}
