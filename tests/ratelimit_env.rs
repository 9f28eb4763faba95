//! The binary started as envoyproxy/ratelimit is deployed today (#27):
//! Istio's sample environment, read from `examples/istio/ratelimit-sample.yaml`
//! (rules from a ConfigMap under RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config,
//! Redis over TCP, statsd off), ports and paths moved, no flags; statsd on, as
//! its default is. What it cannot honour yet stops the start with
//! the variable named.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::{descriptor, free_port, request, ChildGuard};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

/// A Kubernetes ConfigMap volume: `file` links to `..data/file`, and
/// `..data` to a timestamped directory that a swap replaces at once.
fn configmap(dir: &Path, version: &str, text: &str) {
    let data = dir.join(format!("..{version}"));
    std::fs::create_dir_all(&data).expect("mkdir");
    std::fs::write(data.join("config.yaml"), text).expect("write");
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(format!("..{version}"), &tmp).expect("symlink");
    std::fs::rename(&tmp, dir.join("..data")).expect("swap ..data");
    let link = dir.join("config.yaml");
    if std::fs::symlink_metadata(&link).is_err() {
        std::os::unix::fs::symlink("..data/config.yaml", &link).expect("symlink");
    }
}

/// `examples/istio/ratelimit-sample.yaml`: Istio's sample with our image.
/// Its rules (the ConfigMap) and the ratelimit container's environment.
fn istio_sample() -> (String, Vec<(String, String)>) {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/istio/ratelimit-sample.yaml"
    ))
    .expect("sample");
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("a YAML document"))
        .collect();
    let rules = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("ConfigMap"))
        .and_then(|d| d["data"]["config.yaml"].as_str())
        .expect("the rules")
        .to_string();
    let deployment = docs
        .iter()
        .find(|d| {
            d["kind"].as_str() == Some("Deployment")
                && d["metadata"]["name"].as_str() == Some("ratelimit")
        })
        .expect("the ratelimit Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["command"][0].as_str(), Some("/bin/ratelimit"));
    assert!(container["image"]
        .as_str()
        .is_some_and(|i| i.starts_with("tokenbucket-rls")));
    let env = container["env"]
        .as_sequence()
        .expect("env")
        .iter()
        .map(|e| {
            let name = e["name"].as_str().expect("name").to_string();
            let value = e["value"].as_str().expect("value").to_string();
            (name, value)
        })
        .collect();
    (rules, env)
}

#[tokio::test]
async fn started_with_istios_sample_environment() {
    let redis = RedisServer::standalone();
    let root = tempfile::tempdir().expect("tempdir");
    let config = root.path().join("ratelimit").join("config");
    std::fs::create_dir_all(&config).expect("mkdir");
    let (rules, sample_env) = istio_sample();
    configmap(&config, "2026_12_04_a", &rules);
    let (grpc, admin) = (free_port(), free_port());
    let mut command = common::binary_without_rls_env();
    // the sample's environment, as it is, then where this machine differs:
    // the root of the ConfigMap, Redis's address, ports off 8080/8081 on
    // loopback
    command.env_remove("RUST_LOG").envs(sample_env);
    let child = command
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port))
        .env("RUNTIME_ROOT", root.path())
        .env("HOST", "127.0.0.1")
        .env("PORT", admin.to_string())
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        // ours wins over theirs
        .env("LOG_FORMAT", "text")
        .env("RLS_LOG_FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start");
    let child = ChildGuard(child);

    // envoyproxy/ratelimit's probe path answers once the rules are loaded
    common::until_ok(
        &format!("http://127.0.0.1:{admin}/healthcheck"),
        "never healthy",
    )
    .await;

    let c = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .expect("connect");
    let call = |path: &'static str| {
        let mut c = c.clone();
        async move {
            c.should_rate_limit(request("ratelimit", vec![descriptor(&[("PATH", path)])]))
                .await
                .expect("decided")
                .into_inner()
        }
    };
    assert_eq!(call("/productpage").await.overall_code, Code::Ok as i32);
    assert_eq!(
        call("/productpage").await.overall_code,
        Code::OverLimit as i32
    );
    // in Redis, not in memory
    let keys: u64 = redis.cli(&["DBSIZE"]).trim().parse().expect("DBSIZE");
    assert!(keys >= 1, "{keys} keys");

    // the ConfigMap changes: ..data swapped, the new rules apply
    configmap(
        &config,
        "2026_12_04_b",
        &rules.replace("requests_per_unit: 100", "requests_per_unit: 7"),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = call("/reviews").await;
        let limit = r.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit);
        if limit == Some(7) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the swap was not applied: {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // off this runtime's thread: the client answers the server's GOAWAY
    let out = tokio::task::spawn_blocking(move || child.terminate())
        .await
        .expect("joined");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let first = stderr.lines().next().unwrap_or_default();
    assert!(first.starts_with('{'), "RLS_LOG_FORMAT=json won: {first}");
    assert!(
        stderr.contains("RUNTIME_WATCH_ROOT: the rules directory is watched"),
        "the settings that change nothing are named: {stderr}"
    );
    assert!(
        stderr.contains("\"level\":\"DEBUG\""),
        "LOG_LEVEL=debug: {stderr}"
    );
}

/// A setting whose meaning this service lacks stops the start, named.
#[test]
fn a_setting_it_cannot_honour_stops_the_start() {
    for (name, value) in [
        ("CONFIG_TYPE", "REST"),
        ("REDIS_TYPE", "sentinel"),
        ("USE_DOG_STATSD", "true"),
        // an empty hash tag would scatter one descriptor's keys over slots
        ("CACHE_KEY_PREFIX", "{}"),
    ] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"));
        if name == "REDIS_TYPE" || name == "CACHE_KEY_PREFIX" {
            command.env("REDIS_URL", "127.0.0.1:1");
        }
        let out = command
            .env(name, value)
            .env("RLS_CONFIG", concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
            .output()
            .expect("run");
        assert!(!out.status.success(), "{name}={value} started");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(&format!("{name}={value}")), "{stderr}");
    }
}

/// `USE_STATSD=true`: the per-rule stats reach a statsd server (a UDP
/// socket here) under envoyproxy/ratelimit's names, summed exactly.
#[tokio::test]
async fn statsd_gets_the_stats_under_envoyproxy_ratelimits_names() {
    let root = tempfile::tempdir().expect("tempdir");
    let config = root.path().join("ratelimit").join("config");
    std::fs::create_dir_all(&config).expect("mkdir");
    std::fs::write(
        config.join("config.yaml"),
        "domain: edge\ndescriptors:\n  - key: path\n    value: /login\n    rate_limit: {unit: minute, requests_per_unit: 3}\n  - key: free\n    rate_limit: {unlimited: true}\n",
    )
    .expect("rules");
    let statsd = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("udp");
    let statsd_port = statsd.local_addr().expect("addr").port();
    let (grpc, admin) = (free_port(), free_port());
    let mut command = common::binary_without_rls_env();
    let child = command
        .env("RUNTIME_ROOT", root.path())
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("HOST", "127.0.0.1")
        .env("PORT", admin.to_string())
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        .env("USE_STATSD", "true")
        .env("STATSD_HOST", "127.0.0.1")
        .env("STATSD_PORT", statsd_port.to_string())
        .env("STATS_FLUSH_INTERVAL", "100ms")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start");
    let child = ChildGuard(child);
    let mut c = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}")).await {
                Ok(c) => break c,
                Err(e) => assert!(Instant::now() < deadline, "never served: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // 5 calls of /login (3 a minute): 3 within (the third near the
    // limit), 2 over; an unlimited rule counts in none
    let mut codes = Vec::new();
    for _ in 0..5 {
        let r = c
            .should_rate_limit(request("edge", vec![descriptor(&[("path", "/login")])]))
            .await
            .expect("decided")
            .into_inner();
        codes.push(r.overall_code);
    }
    let ok = Code::Ok as i32;
    let over = Code::OverLimit as i32;
    assert_eq!(codes, [ok, ok, ok, over, over]);
    c.should_rate_limit(request("edge", vec![descriptor(&[("free", "x")])]))
        .await
        .expect("decided");

    let want = [
        (
            "ratelimit.service.rate_limit.edge.path_/login.total_hits",
            5,
        ),
        (
            "ratelimit.service.rate_limit.edge.path_/login.within_limit",
            3,
        ),
        (
            "ratelimit.service.rate_limit.edge.path_/login.near_limit",
            1,
        ),
        (
            "ratelimit.service.rate_limit.edge.path_/login.over_limit",
            2,
        ),
    ];
    let mut got = std::collections::BTreeMap::<String, u64>::new();
    let mut buf = vec![0u8; 2048];
    let deadline = Instant::now() + Duration::from_secs(20);
    // until every expected count is in, then one more flush for strays
    let mut settled_at = None;
    while Instant::now() < deadline {
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(100), statsd.recv(&mut buf)).await
        {
            for line in String::from_utf8_lossy(&buf[..n]).lines() {
                let (name, rest) = line.split_once(':').expect("name:value|c");
                let value = rest.strip_suffix("|c").expect("a counter");
                *got.entry(name.to_string()).or_default() += value.parse::<u64>().expect("n");
            }
        }
        let complete = want.iter().all(|(n, v)| got.get(*n) >= Some(v));
        match settled_at {
            None if complete => settled_at = Some(Instant::now()),
            Some(t) if t.elapsed() > Duration::from_millis(500) => break,
            _ => {}
        }
    }
    let expected: std::collections::BTreeMap<String, u64> =
        want.iter().map(|(n, v)| (n.to_string(), *v)).collect();
    assert_eq!(
        got, expected,
        "exactly these, nothing for the unlimited rule"
    );
    drop(child);
}

/// `REDIS_URL` with a scheme and `REDIS_AUTH` (before, the password was
/// dropped: NOAUTH on every call, answered OK, silently); and a Redis
/// outage answered as envoyproxy/ratelimit answers it: an error, for
/// Envoy's `failure_mode_deny` to decide (before, OK: every request
/// admitted whatever Envoy was told to do).
#[tokio::test]
async fn redis_url_with_a_scheme_takes_redis_auth_and_an_outage_is_an_error() {
    let mut redis = RedisServer::standalone();
    assert!(redis
        .cli(&["CONFIG", "SET", "requirepass", "s3cret"])
        .contains("OK"));
    let rules = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        rules.path().join("config.yaml"),
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requests_per_unit: 2}\n",
    )
    .expect("write");
    let (grpc, admin, prom) = (free_port(), free_port(), free_port());
    let child = common::binary_without_rls_env()
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("redis://127.0.0.1:{}", redis.port))
        .env("REDIS_AUTH", "s3cret")
        .env("RUNTIME_ROOT", rules.path())
        .env("RUNTIME_SUBDIRECTORY", ".")
        .env("RUNTIME_APPDIRECTORY", ".")
        .env("HOST", "127.0.0.1")
        .env("PORT", admin.to_string())
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        .env("USE_PROMETHEUS", "true")
        .env("PROMETHEUS_ADDR", format!("127.0.0.1:{prom}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start");
    let _child = ChildGuard(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut c = loop {
        if let Ok(c) = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}")).await {
            break c;
        }
        assert!(Instant::now() < deadline, "never served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut codes = Vec::new();
    for _ in 0..3 {
        let r = c
            .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
            .await
            .expect("decided")
            .into_inner();
        codes.push(r.overall_code);
    }
    assert_eq!(
        codes,
        [Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32],
        "decided in Redis, authenticated"
    );
    redis.kill();
    let e = c
        .should_rate_limit(request("d", vec![descriptor(&[("k", "w")])]))
        .await
        .expect_err("Redis is down: an error, for Envoy to decide");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    let text = reqwest::get(format!("http://127.0.0.1:{prom}/metrics"))
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    assert_eq!(
        common::sample(
            &text,
            "ratelimit_service_should_rate_limit_error{err_type=\"redis_error\"}"
        ),
        Some(1.0),
        "{text}"
    );
}

/// A value of one of its variables that our flag cannot read is reported
/// under the variable the user set (before: under our flag's name only),
/// and `--help` says that its environment is read.
#[test]
fn a_bad_value_names_the_variable_the_user_set() {
    let out = common::binary_without_rls_env()
        .env("REDIS_URL", "127.0.0.1:1")
        .env("REDIS_TIMEOUT", "10")
        .env("RLS_CONFIG", concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("REDIS_TIMEOUT=10"), "{stderr}");
    assert!(stderr.contains("--redis-timeout"), "{stderr}");
    let help = common::binary_without_rls_env()
        .arg("--help")
        .output()
        .expect("run");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("envoyproxy/ratelimit's environment"),
        "{help}"
    );
}
