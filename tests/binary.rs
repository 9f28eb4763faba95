//! The `tokenbucket-rls` binary as an operator runs it: flags from the
//! environment, readiness, and a clean exit on SIGTERM and SIGINT.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, ChildGuard};

fn start() -> (ChildGuard, u16) {
    let admin = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .env("RLS_CONFIG", concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
        .env("RLS_GRPC_ADDR", format!("127.0.0.1:{}", free_port()))
        .env("RLS_ADMIN_ADDR", format!("127.0.0.1:{admin}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start tokenbucket-rls");
    (ChildGuard(child), admin)
}

/// Starts the server on `config/` with `args` (RUST_LOG unset), waits until
/// it serves, stops it with SIGTERM (no shutdown delay), and returns what
/// it wrote to stderr.
fn stderr_of_a_run(args: &[&str]) -> String {
    let args: Vec<&str> = args
        .iter()
        .copied()
        .chain(["--shutdown-delay", "0s"])
        .collect();
    let (child, _, _) = serving_config_on(&args);
    let out = child.terminate();
    String::from_utf8_lossy(&out.stderr).to_string()
}

fn wait_ready(admin: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", admin)).is_err() {
        assert!(Instant::now() < deadline, "admin port never opened");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The binary on `config/` (no RLS_* from the environment, RUST_LOG unset)
/// on free loopback ports with `args`, its stderr piped, once its admin
/// port answers: the child, its gRPC port.
fn serving_config_with(args: &[&str]) -> (ChildGuard, u16) {
    let (child, grpc, _) = serving_config_on(args);
    (child, grpc)
}

/// As [`serving_config_with`], with the admin port too.
fn serving_config_on(args: &[&str]) -> (ChildGuard, u16, u16) {
    let (grpc, admin) = (free_port(), free_port());
    let child = ChildGuard(
        common::binary_without_rls_env()
            .env("RLS_CONFIG", concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
            .env_remove("RUST_LOG")
            .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
            .args(["--admin-addr", &format!("127.0.0.1:{admin}")])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start"),
    );
    wait_ready(admin);
    (child, grpc, admin)
}

fn exits_cleanly_on(signal: &str) {
    let (mut child, admin) = start();
    wait_ready(admin);
    let sent = Command::new("kill")
        .args([signal, &child.0.id().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success());
    // the default --shutdown-delay (5 s) first, then the drain
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.0.try_wait().expect("wait") {
            assert!(status.success(), "{signal}: exit status {status}");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{signal}: still running after 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_stops_the_server_cleanly() {
    exits_cleanly_on("-TERM");
}

#[test]
fn sigint_stops_the_server_cleanly() {
    exits_cleanly_on("-INT");
}

#[test]
fn invalid_rules_stop_the_start_with_the_errors() {
    let dir = common::rules_dir("domain: d\ndescriptors:\n  - key: k\n    ratelimit: {}\n");
    let out = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .args(["--config"])
        .arg(dir.path())
        .args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rules.yaml") && stderr.contains("unknown field `ratelimit`"),
        "{stderr}"
    );
}

#[test]
fn json_logs_start_with_version_store_and_generation() {
    let stderr = stderr_of_a_run(&["--log-format", "json"]);
    let first: serde_json::Value =
        serde_json::from_str(stderr.lines().next().expect("a log line")).expect("JSON log line");
    let fields = &first["fields"];
    assert_eq!(fields["message"], "tokenbucket-rls serving", "{stderr}");
    assert_eq!(fields["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(fields["store"], "memory");
    assert_eq!(fields["generation"], 1);
    assert!(
        stderr
            .lines()
            .all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()),
        "{stderr}"
    );
}

#[test]
fn an_empty_rules_file_is_rejected_alike_by_check_config_and_start() {
    // The reload's side is in tests/reload.rs (half-written and emptied files).
    let dir = common::rules_dir("# emptied\n");
    let message = "the file holds no rules (it is empty, or only comments)";
    let check = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .arg("check-config")
        .arg(dir.path())
        .output()
        .expect("run check-config");
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(!check.status.success(), "check-config passes it: {stdout}");
    assert!(
        stdout.contains("rules.yaml") && stdout.contains(message),
        "{stdout}"
    );
    let start = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .args(["--config"])
        .arg(dir.path())
        .args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&start.stderr);
    assert!(!start.status.success(), "the server starts on it: {stderr}");
    assert!(
        stderr.contains("rules.yaml") && stderr.contains(message),
        "{stderr}"
    );
}

#[test]
fn text_logs_written_to_a_pipe_carry_no_colour_codes() {
    let stderr = stderr_of_a_run(&[]);
    assert!(stderr.contains("tokenbucket-rls serving"), "{stderr}");
    assert!(
        !stderr.contains('\x1b'),
        "ANSI escapes in a pipe: {stderr:?}"
    );
}

/// Redis unreachable at start: the log says why in words (the name does
/// not resolve, or the port refused), not a failed `CONFIG` command, and
/// the service serves at once on its failure policies instead of waiting
/// seconds for a connection that cannot come.
#[test]
fn redis_unreachable_at_start_is_named_and_does_not_hold_the_start() {
    let refused_port = free_port().to_string();
    for (url, said) in [
        (
            format!("redis://127.0.0.1:{refused_port}"),
            "refused the connection",
        ),
        (
            "redis://no-such-host.invalid:6379".to_string(),
            "the name does not resolve",
        ),
    ] {
        let stderr = stderr_of_a_run(&["--store", "redis", "--redis-url", &url]);
        assert!(stderr.contains(said), "{url}: {stderr}");
        assert!(!stderr.contains("CONFIG"), "{url}: {stderr}");
        assert!(!stderr.contains("maxmemory-policy"), "{url}: {stderr}");
    }
}

/// Rules with `attempts:` on the memory store with `--instances` above 1
/// (each instance remembers only its own attempts: a release reaching
/// another finds nothing) are named in a warning at start (issue 51); one
/// instance, or no such rule, says nothing of it.
#[test]
fn attempts_on_the_memory_store_with_several_instances_are_warned_of() {
    let concurrency = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/concurrency");
    let said = "rules with attempts on the memory store with several instances";
    let stderr = stderr_of_a_run(&["--config", concurrency, "--instances", "2"]);
    assert!(
        stderr.contains(said) && stderr.contains("streams: user"),
        "{stderr}"
    );
    let stderr = stderr_of_a_run(&["--config", concurrency]);
    assert!(!stderr.contains(said), "{stderr}");
    let stderr = stderr_of_a_run(&["--instances", "2"]);
    assert!(!stderr.contains(said), "no attempts in config/: {stderr}");
}

/// The refusal log (#54 item 4): a line per refused request, at most
/// `--refusal-log-rate` a second, naming the limit that refused and the
/// descriptor, the values of `--refusal-log-hash-keys` hashed (never
/// written as they came).
#[tokio::test]
async fn refusals_are_logged_at_most_the_rate_with_the_asked_values_hashed() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("pseudonym-key");
    std::fs::write(&secret, "a secret of this deployment").expect("write");
    let secret = secret.to_str().expect("utf-8 path");
    let (child, grpc) = serving_config_with(&[
        "--refusal-log-rate",
        "2",
        "--refusal-log-hash-keys",
        "api_key",
        "--pseudonym-key-file",
        secret,
    ]);
    let mut c = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .expect("connect");
    let started = Instant::now();
    let mut refused = 0;
    for _ in 0..40 {
        let r = c
            .should_rate_limit(common::request(
                "edge",
                vec![common::descriptor(&[
                    ("plan", "free"),
                    ("api_key", "secret-key"),
                ])],
            ))
            .await
            .expect("answered")
            .into_inner();
        refused += u32::from(r.overall_code == 2);
    }
    // the clock seconds the calls touched: a run of 0.1 s may straddle two
    let secs = started.elapsed().as_secs() + 2;
    // off this runtime's thread: the client answers the server's GOAWAY
    let out = tokio::task::spawn_blocking(move || child.terminate())
        .await
        .expect("joined");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(refused, 37, "a burst of 3 a minute");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("tokenbucket_rls::service") && l.contains("refused"))
        .collect();
    assert!(
        !lines.is_empty() && lines.len() as u64 <= 2 * secs,
        "at most 2 lines a second over {secs} s: {lines:?}"
    );
    assert!(
        lines[0].contains("free-keys")
            && lines[0].contains("plan=free")
            && lines[0].contains("api_key=hmac:"),
        "{}",
        lines[0]
    );
    assert!(!stderr.contains("secret-key"), "{stderr}");
}

/// #65 item 5: a descriptor value cannot forge a log line. A newline, ESC,
/// NUL and BEL in a refused request's value are written escaped in the
/// default text log; no line the client wrote stands on its own.
#[tokio::test]
async fn a_value_cannot_forge_a_log_line() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let (child, grpc) = serving_config_with(&["--refusal-log-rate", "100"]);
    let mut c = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .expect("connect");
    let forged =
        "evil\n2026-12-07T00:00:00Z  INFO tokenbucket_rls::service: forged\u{1b}[31m\u{0}\u{7}";
    let mut refused = 0;
    for _ in 0..4 {
        let r = c
            .should_rate_limit(common::request(
                "edge",
                vec![common::descriptor(&[("tenant", forged), ("user", "u")])],
            ))
            .await
            .expect("answered")
            .into_inner();
        refused += u32::from(r.overall_code == 2);
    }
    // off this runtime's thread: the client answers the server's GOAWAY
    let out = tokio::task::spawn_blocking(move || child.terminate())
        .await
        .expect("joined");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(refused, 2, "a non-acme tenant's user: burst 2");
    assert!(
        !stderr
            .lines()
            .any(|l| l.contains("INFO tokenbucket_rls::service: forged") && !l.contains("refused")),
        "a forged line: {stderr}"
    );
    assert!(stderr.contains("evil\\u{a}2026"), "{stderr}");
    assert!(!stderr.contains('\u{1b}') && !stderr.contains('\u{0}') && !stderr.contains('\u{7}'));
}

/// #66 (part): SIGTERM with calls in flight answers every one of them
/// before the process exits. Redis is paused (CLIENT PAUSE) so that 40
/// calls wait in the service when the signal comes; they are answered
/// when Redis answers again, then the process exits 0. (The server's
/// tasks were once dropped with the wait the signal ended: the process
/// exited at once and every call was cut.)
#[tokio::test]
async fn sigterm_answers_the_calls_in_flight() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let redis = common::redis::RedisServer::standalone();
    let url = redis.url();
    // no delay: the drain itself meets the calls in flight
    let (child, grpc) = serving_config_with(&[
        "--store",
        "redis",
        "--redis-url",
        &url,
        "--redis-timeout",
        "5s",
        "--instances",
        "1",
        "--shutdown-delay",
        "0s",
    ]);
    let c = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .expect("connect");
    // one call first: the store's connections are up
    let _ = c
        .clone()
        .should_rate_limit(common::request(
            "edge",
            vec![common::descriptor(&[("plan", "free"), ("api_key", "warm")])],
        ))
        .await
        .expect("answered");
    redis.cli(&["CLIENT", "PAUSE", "1500"]);
    let calls: Vec<_> = (0..40)
        .map(|i| {
            let mut c = c.clone();
            tokio::spawn(async move {
                c.should_rate_limit(common::request(
                    "edge",
                    vec![common::descriptor(&[
                        ("plan", "free"),
                        ("api_key", &format!("k{i}")),
                    ])],
                ))
                .await
                .map(|r| r.into_inner().overall_code)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = tokio::task::spawn_blocking(move || child.terminate())
        .await
        .expect("joined");
    let mut answered = 0;
    for call in calls {
        match call.await.expect("joined") {
            Ok(code) => {
                assert_eq!(code, 1, "admitted: a fresh key each");
                answered += 1;
            }
            Err(status) => panic!("a call in flight was cut: {status}"),
        }
    }
    assert_eq!(answered, 40);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A peer that opened an HTTP/2 connection and then never answers (hung,
/// or cut off) does not hold a shutdown for ever: the process exits once
/// `--shutdown-grace` has passed, 0.
#[tokio::test]
async fn a_silent_peer_does_not_hold_the_shutdown() {
    use std::io::Write;
    let (child, grpc) = serving_config_with(&["--shutdown-delay", "0s", "--shutdown-grace", "2s"]);
    let mut silent = std::net::TcpStream::connect(("127.0.0.1", grpc)).expect("connect");
    // the client preface and an empty SETTINGS frame, then nothing: not
    // even the SETTINGS ack nor the GOAWAY's ping
    silent
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .expect("preface");
    std::thread::sleep(Duration::from_millis(200));
    let out = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let out = child.terminate();
        (out, started.elapsed())
    })
    .await
    .expect("joined");
    let (out, took) = out;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("exited {took:?} after SIGTERM with a silent peer");
    drop(silent);
}

/// SIGTERM: `/readyz` and the gRPC health service say not ready at once
/// (before the next second's sync), calls are answered all through
/// `--shutdown-delay`, then the process exits 0.
#[tokio::test]
async fn sigterm_turns_not_ready_at_once_and_answers_through_the_delay() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let (mut child, grpc, admin) = serving_config_on(&["--shutdown-delay", "3s"]);
    common::until_ok(&format!("http://127.0.0.1:{admin}/readyz"), "ready").await;
    let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{grpc}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut health = HealthClient::new(channel.clone());
    let mut rls = RateLimitServiceClient::new(channel);
    let status = |h: tonic_health::pb::HealthCheckResponse| h.status;
    let check = HealthCheckRequest {
        service: "ratelimit".into(),
    };
    let serving = health
        .check(check.clone())
        .await
        .expect("check")
        .into_inner();
    assert_eq!(status(serving), 1, "SERVING before the signal");
    let sent = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
    // told at once: polled from the signal on, well inside a second
    let mut not_serving = false;
    for _ in 0..20 {
        let now = health
            .check(check.clone())
            .await
            .expect("check")
            .into_inner();
        if status(now) == 2 {
            not_serving = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(not_serving, "NOT_SERVING within 0.5 s of SIGTERM");
    let readyz = reqwest::get(format!("http://127.0.0.1:{admin}/readyz"))
        .await
        .expect("readyz");
    assert_eq!(readyz.status().as_u16(), 503);
    // still answered through the delay
    for i in 0..10 {
        let answer = rls
            .should_rate_limit(common::request(
                "edge",
                vec![common::descriptor(&[
                    ("plan", "free"),
                    ("api_key", &format!("d{i}")),
                ])],
            ))
            .await
            .expect("answered while draining");
        assert_eq!(answer.into_inner().overall_code, 1);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let exited = tokio::task::spawn_blocking(move || child.0.wait())
        .await
        .expect("joined")
        .expect("wait");
    assert!(exited.success(), "{exited}");
}

/// A second signal during the delay ends the process at once, exit 1.
#[test]
fn a_second_signal_exits_at_once() {
    let (mut child, _) = serving_config_with(&["--shutdown-delay", "10m"]);
    let pid = child.0.id().to_string();
    let kill = |signal: &str| {
        let sent = Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("kill");
        assert!(sent.success());
    };
    kill("-TERM");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.0.try_wait().expect("wait").is_none(),
        "still answering in the delay"
    );
    kill("-INT");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "a second signal did not end it");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(1), "{status}");
}
