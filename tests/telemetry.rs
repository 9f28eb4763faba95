//! Telemetry: exact Prometheus counts after known traffic, bounded labels,
//! readiness and gRPC health transitions, and OTLP spans received by a test
//! collector (continuing the caller's W3C trace).

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::{descriptor, free_port, request, rules_dir, sample, serve_args, ChildGuard};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::trace::v1::Span;
use tokenbucket_rls::cli::StoreKind;
use tokenbucket_rls::rules::FailureMode;
use tokenbucket_rls::server;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const RULES: &str = r#"
domain: d
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 2, name: per-user}
  - key: path
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: free
    rate_limit: {unlimited: true}
  - key: detailed
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 100}
"#;

/// A server on RULES and a client of it.
async fn serve_rules() -> (
    tempfile::TempDir,
    server::RunningServer,
    RateLimitServiceClient<tonic::transport::Channel>,
) {
    let dir = rules_dir(RULES);
    let s = server::start(&serve_args(dir.path().to_path_buf()))
        .await
        .expect("start");
    let c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    (dir, s, c)
}

#[tokio::test]
async fn metrics_count_every_decision_exactly() {
    let (_dir, s, mut c) = serve_rules().await;
    let send = |domain: &'static str, entries: Vec<(&'static str, String)>| {
        let mut c = c.clone();
        async move {
            let e: Vec<(&str, &str)> = entries.iter().map(|(k, v)| (*k, v.as_str())).collect();
            c.should_rate_limit(request(domain, vec![descriptor(&e)]))
                .await
                .expect("answered");
        }
    };
    // per-user (2/h): 3 users × 3 requests → 6 ok, 3 over the limit
    for u in 0..3 {
        for _ in 0..3 {
            send("d", vec![("user", format!("secret-user-{u}"))]).await;
        }
    }
    // unnamed rule: 1 ok, 1 over; shadow: 1 ok, 2 shadow; unlimited: 4
    for _ in 0..2 {
        send("d", vec![("path", "/x".into())]).await;
    }
    for _ in 0..3 {
        send("d", vec![("shadow", "s".into())]).await;
    }
    for _ in 0..4 {
        send("d", vec![("free", "f".into())]).await;
    }
    // no rule, known and unknown domains; a detailed rule shows its value
    send("d", vec![("nothing", "n".into())]).await;
    send(
        "no-such-domain",
        vec![("user", "random-domain-value".into())],
    )
    .await;
    send("d", vec![("detailed", "v1".into())]).await;
    // a bad request is not a decision
    let _ = c.should_rate_limit(request("d", vec![])).await;

    let body = reqwest::get(format!("http://{}/metrics", s.admin_addr))
        .await
        .expect("scrape")
        .text()
        .await
        .expect("body");
    let d = |rule: &str, result: &str| {
        sample(
            &body,
            &format!("rls_decisions_total{{domain=\"d\",result=\"{result}\",rule=\"{rule}\"}}"),
        )
    };
    assert_eq!(d("per-user", "ok"), Some(6.0), "{body}");
    assert_eq!(d("per-user", "over_limit"), Some(3.0));
    assert_eq!(
        d("path", "ok"),
        Some(1.0),
        "unnamed rules are labelled by their path"
    );
    assert_eq!(d("path", "over_limit"), Some(1.0));
    assert_eq!(d("shadow", "ok"), Some(1.0));
    assert_eq!(d("shadow", "shadow"), Some(2.0));
    assert_eq!(d("free", "unlimited"), Some(4.0));
    assert_eq!(d("_none", "no_rule"), Some(1.0));
    // detailed_metric keeps the rule's own series (dashboards and alerts
    // on its name go on) and adds the request's values in another
    assert_eq!(d("detailed", "ok"), Some(1.0), "{body}");
    assert_eq!(
        sample(
            &body,
            "rls_decisions_detailed_total{descriptor=\"detailed_v1\",domain=\"d\",result=\"ok\",rule=\"detailed\"}"
        ),
        Some(1.0),
        "detailed_metric shows the value: {body}"
    );
    assert_eq!(
        d("detailed_v1", "ok"),
        None,
        "no series renamed by its values"
    );
    assert_eq!(
        sample(
            &body,
            "rls_decisions_total{domain=\"_unknown\",result=\"no_rule\",rule=\"_none\"}"
        ),
        Some(1.0)
    );
    assert!(
        !body.contains("secret-user"),
        "no raw request values in labels"
    );
    assert!(
        !body.contains("no-such-domain"),
        "unknown domains are not labels"
    );
    assert_eq!(
        sample(&body, "rls_decision_duration_seconds_count"),
        Some(22.0),
        "every call, bad ones too"
    );
    assert!(body.contains("rls_decision_duration_seconds_bucket{le=\"0.0005\"}"));
    assert_eq!(
        sample(&body, "rls_store_calls_total{store=\"memory\"}"),
        Some(15.0),
        "one per limited descriptor"
    );
    assert_eq!(sample(&body, "rls_config_generation"), Some(1.0));
    assert_eq!(
        sample(&body, "rls_config_reloads_total{result=\"error\"}"),
        Some(0.0)
    );
    assert_eq!(
        sample(&body, "rls_failure_policy_total{mode=\"open\"}"),
        Some(0.0)
    );
}

async fn readyz(addr: SocketAddr) -> (u16, String) {
    let r = reqwest::get(format!("http://{addr}/readyz"))
        .await
        .expect("readyz");
    (r.status().as_u16(), r.text().await.expect("body"))
}

async fn grpc_health(addr: SocketAddr, service: &str) -> i32 {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut h = HealthClient::new(channel);
    h.check(HealthCheckRequest {
        service: service.to_string(),
    })
    .await
    .expect("health answers")
    .into_inner()
    .status
}

/// Waits up to 5 s for the gRPC health status of `service` to become `want`.
async fn wait_health(addr: SocketAddr, service: &str, want: i32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while grpc_health(addr, service).await != want {
        assert!(
            Instant::now() < deadline,
            "health of '{service}' never became {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

const SERVING: i32 = 1;
const NOT_SERVING: i32 = 2;

#[tokio::test]
async fn readiness_follows_rules_and_store() {
    // No rules yet: alive, not ready.
    let dir = tempfile::tempdir().expect("tempdir");
    let s = server::start(&serve_args(dir.path().to_path_buf()))
        .await
        .expect("start");
    let h = reqwest::get(format!("http://{}/healthz", s.admin_addr))
        .await
        .expect("healthz");
    assert_eq!(h.status().as_u16(), 200);
    let (code, body) = readyz(s.admin_addr).await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("no rules loaded"));
    wait_health(s.grpc_addr, "ratelimit", NOT_SERVING).await;
    // Rules arrive: ready.
    std::fs::write(dir.path().join("r.yaml"), RULES).expect("write");
    s.reloader.reload(false);
    assert_eq!(readyz(s.admin_addr).await.0, 200);
    wait_health(s.grpc_addr, "ratelimit", SERVING).await;
    wait_health(s.grpc_addr, "", SERVING).await;
}

/// A shared-store outage is not a reason for an instance to leave the
/// Service (every instance would, and the failure modes could no longer
/// answer): readiness stays 200, with the store's state in the body.
#[tokio::test]
async fn readiness_does_not_follow_the_shared_store() {
    let mut redis = RedisServer::standalone();
    let dir = rules_dir(RULES);
    let mut args = serve_args(dir.path().to_path_buf());
    args.store = StoreKind::Redis;
    args.redis_url = Some(redis.url());
    args.failure_mode = FailureMode::Closed;
    let closed = server::start(&args).await.expect("start");
    let (code, body) = readyz(closed.admin_addr).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("store redis"));
    redis.kill();
    // calls notice it (the breaker opens after three refused connections)
    let mut c = RateLimitServiceClient::connect(format!("http://{}", closed.grpc_addr))
        .await
        .expect("connect");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let call = c
            .should_rate_limit(request("d", vec![descriptor(&[("user", "v")])]))
            .await;
        assert!(
            call.is_err(),
            "a fail-closed rule without Redis fails the call"
        );
        let (code, body) = readyz(closed.admin_addr).await;
        assert_eq!(code, 200, "{body}");
        if body.contains("circuit breaker open") {
            assert!(body.contains("failure modes answer"), "{body}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never noticed Redis was down: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_health(closed.grpc_addr, "ratelimit", SERVING).await;
    // Redis back: the breaker closes, readiness never moved.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    while readyz(closed.admin_addr)
        .await
        .1
        .contains("circuit breaker open")
    {
        assert!(Instant::now() < deadline, "never noticed Redis was back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(readyz(closed.admin_addr).await.0, 200);
}

/// An OTLP trace collector that keeps every span it receives.
#[derive(Default, Clone)]
struct Collector {
    spans: Arc<parking_lot::Mutex<Vec<Span>>>,
}

impl Collector {
    /// A collector serving on a loopback port: it, and its address.
    async fn start() -> (Self, SocketAddr) {
        let collector = Collector::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let svc = TraceServiceServer::new(collector.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await;
        });
        (collector, addr)
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock();
        for rs in request.into_inner().resource_spans {
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tokio::test]
async fn spans_reach_an_otlp_collector_and_continue_the_callers_trace() {
    let (collector, otlp) = Collector::start().await;

    let dir = rules_dir(RULES);
    let (grpc, admin) = (free_port(), free_port());
    let _rls = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
            .arg("--config")
            .arg(dir.path())
            .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
            .args(["--admin-addr", &format!("127.0.0.1:{admin}")])
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{otlp}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start"),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut client = loop {
        if let Ok(c) = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}")).await {
            break c;
        }
        assert!(Instant::now() < deadline, "service never started");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // Envoy's side of the trace.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let envoy_span = "00f067aa0ba902b7";
    let mut req = tonic::Request::new(request("d", vec![descriptor(&[("user", "traced")])]));
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-{envoy_span}-01")
            .parse()
            .expect("ascii"),
    );
    client.should_rate_limit(req).await.expect("answered");

    let deadline = Instant::now() + Duration::from_secs(15);
    let (call, store) = loop {
        {
            let spans = collector.spans.lock();
            let call = spans.iter().find(|s| s.name == "ShouldRateLimit").cloned();
            let store = spans.iter().find(|s| s.name == "store.decide").cloned();
            if let (Some(call), Some(store)) = (call, store) {
                break (call, store);
            }
        }
        assert!(Instant::now() < deadline, "spans never arrived");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    assert_eq!(hex(&call.trace_id), trace_id, "continues Envoy's trace");
    assert_eq!(
        hex(&call.parent_span_id),
        envoy_span,
        "child of Envoy's span"
    );
    assert_eq!(store.trace_id, call.trace_id);
    assert_eq!(
        store.parent_span_id, call.span_id,
        "the store call is a child of the request"
    );
    let attr = |s: &Span, k: &str| {
        s.attributes
            .iter()
            .find(|a| a.key == k)
            .and_then(|a| a.value.as_ref())
            .map(|v| format!("{:?}", v.value))
    };
    assert!(
        attr(&call, "domain").is_some_and(|v| v.contains("\"d\"")),
        "{:?}",
        call.attributes
    );
    assert!(
        attr(&call, "overall_code").is_some_and(|v| v.contains("OK")),
        "{:?}",
        call.attributes
    );

    // RLQS: a span per report message
    let (_keep_open, _assignments) =
        common::rlqs::report(&format!("http://127.0.0.1:{grpc}"), "traced", 3).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let report = loop {
        if let Some(s) = collector
            .spans
            .lock()
            .iter()
            .find(|s| s.name == "RLQS report")
            .cloned()
        {
            break s;
        }
        assert!(Instant::now() < deadline, "no RLQS report span");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        attr(&report, "domain").is_some_and(|v| v.contains("\"d\"")),
        "{:?}",
        report.attributes
    );
    assert!(
        attr(&report, "buckets").is_some_and(|v| v.contains('1')),
        "{:?}",
        report.attributes
    );
}

/// A server on RULES holding at most `max_buckets` buckets.
async fn serve_capped(
    max_buckets: usize,
) -> (
    tempfile::TempDir,
    server::RunningServer,
    RateLimitServiceClient<tonic::transport::Channel>,
) {
    let dir = rules_dir(RULES);
    let mut args = serve_args(dir.path().to_path_buf());
    args.max_buckets = max_buckets;
    let s = server::start(&args).await.expect("start");
    let c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    (dir, s, c)
}

/// `n` decisions for users `u0`, `u1`, …: `n` new buckets of `per-user`.
async fn new_users(c: &mut RateLimitServiceClient<tonic::transport::Channel>, n: usize) {
    for i in 0..n {
        c.should_rate_limit(request(
            "d",
            vec![descriptor(&[("user", &format!("u{i}"))])],
        ))
        .await
        .expect("answered");
    }
}

#[tokio::test]
async fn the_bucket_cap_holds_and_every_eviction_is_counted() {
    let (_dir, s, mut c) = serve_capped(64).await;
    new_users(&mut c, 500).await;
    // the gauge is set by the once-a-second sweep; `per-user` refills one
    // token in 30 min, so no bucket is dropped for being full: each of the
    // 500 is held or was evicted
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = s.metrics.render();
        let held = sample(&text, "rls_buckets{store=\"memory\"}").unwrap_or(-1.0);
        let evicted = sample(
            &text,
            "rls_buckets_evicted_total{domain=\"d\",rule=\"per-user\"}",
        )
        .unwrap_or(0.0);
        if held >= 0.0 && held + evicted == 500.0 {
            assert!(held <= 64.0, "{held} held");
            assert!(evicted >= 436.0, "{evicted} evicted");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "held {held} + evicted {evicted} never made 500"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_grafana_dashboard_queries_only_exported_metrics() {
    // a cap small enough that evictions have series
    let (_dir, s, mut c) = serve_capped(4).await;
    new_users(&mut c, 20).await;
    // an RLQS stream, for the quota series: one report, its assignment,
    // then the next re-plan (every second) sets the share gauge
    let (_keep_open, mut assignments) =
        common::rlqs::report(&format!("http://{}", s.grpc_addr), "rlqs", 5).await;
    tokio::time::timeout(Duration::from_secs(5), assignments.message())
        .await
        .expect("an assignment")
        .expect("ok")
        .expect("open");
    // the share gauge is set by the next re-plan (every second)
    for _ in 0..100 {
        if s.metrics.render().contains("rls_quota_share{") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let exported = reqwest::get(format!("http://{}/metrics", s.admin_addr))
        .await
        .expect("scrape")
        .text()
        .await
        .expect("body");
    // and a Redis-backed one, for the per-node series
    let redis = RedisServer::standalone();
    let mut args = serve_args(_dir.path().to_path_buf());
    args.store = StoreKind::Redis;
    args.redis_url = Some(redis.url());
    let on_redis = server::start(&args).await.expect("start");
    let mut rc = RateLimitServiceClient::connect(format!("http://{}", on_redis.grpc_addr))
        .await
        .expect("connect");
    rc.should_rate_limit(request("d", vec![descriptor(&[("user", "u")])]))
        .await
        .expect("answered");
    let exported = exported + &on_redis.metrics.render();
    let names: std::collections::HashSet<&str> = exported
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/grafana/tokenbucket-rls.json"
    ))
    .expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let mut checked = 0;
    for panel in dash["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            let used: Vec<&str> = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("rls_"))
                .collect();
            assert!(!used.is_empty(), "{expr}");
            for metric in used {
                let base = ["_bucket", "_count", "_sum"]
                    .iter()
                    .find_map(|s| metric.strip_suffix(s))
                    .unwrap_or(metric);
                assert!(names.contains(base), "{metric} in '{expr}' is not exported");
                checked += 1;
            }
        }
    }
    assert!(checked >= 8);
}

/// `--ratelimit-metrics` with `--prometheus-addr` (envoyproxy/ratelimit's
/// USE_PROMETHEUS): its statistics under its names, by the first two
/// elements of the rule's path, counting hits, on its own address too.
#[tokio::test]
async fn envoyproxy_ratelimit_statistics_under_its_names() {
    let rules = rules_dir(
        r#"
domain: eg
descriptors:
  - key: PATH
    value: "/productpage"
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: tenant
    value: acme
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 10}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
"#,
    );
    let scrape_port = free_port();
    let mut args = serve_args(rules.path().to_path_buf());
    args.ratelimit_metrics = true;
    args.prometheus_addr = Some(SocketAddr::from(([127, 0, 0, 1], scrape_port)));
    args.prometheus_path = "/stats".into();
    let s = server::start(&args).await.expect("server starts");
    let c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    let call = |entries: &'static [(&'static str, &'static str)], hits: u32| {
        let mut c = c.clone();
        async move {
            let mut r = request("eg", vec![descriptor(entries)]);
            r.hits_addend = hits;
            c.should_rate_limit(r).await.expect("decided").into_inner()
        }
    };
    call(&[("PATH", "/productpage")], 1).await;
    call(&[("PATH", "/productpage")], 1).await;
    call(&[("tenant", "acme"), ("user", "u1")], 3).await;
    call(&[("tenant", "acme"), ("user", "u1")], 6).await;
    call(&[("shadow", "x")], 1).await;
    call(&[("shadow", "x")], 1).await;
    let text = reqwest::get(format!("http://127.0.0.1:{scrape_port}/stats"))
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    let n = |name: &str, key1: &str, key2: &str| {
        sample(
            &text,
            &format!("ratelimit_service_rate_limit_{name}{{domain=\"eg\",key1=\"{key1}\",key2=\"{key2}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(n("total_hits", "PATH_/productpage", ""), 2.0, "{text}");
    assert_eq!(n("within_limit", "PATH_/productpage", ""), 1.0);
    assert_eq!(
        n("near_limit", "PATH_/productpage", ""),
        1.0,
        "the whole burst spent"
    );
    assert_eq!(n("over_limit", "PATH_/productpage", ""), 1.0);
    // hits, not calls: 3 then 6 of a burst of 10 (9 spent: past 80 %)
    assert_eq!(n("total_hits", "tenant_acme", "user"), 9.0);
    assert_eq!(n("within_limit", "tenant_acme", "user"), 9.0);
    assert_eq!(n("near_limit", "tenant_acme", "user"), 6.0);
    assert_eq!(n("over_limit", "shadow", ""), 1.0);
    assert_eq!(n("shadow_mode", "shadow", ""), 1.0);
    // the service-wide ones of its mapping (Envoy Gateway's dashboard)
    let exact = |name: &str| sample(&text, name).unwrap_or(-1.0);
    assert_eq!(
        exact("ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"}"),
        6.0,
        "{text}"
    );
    assert_eq!(
        exact("ratelimit_service_response_time_seconds_count{grpc_method=\"ShouldRateLimit\"}"),
        6.0
    );
    assert_eq!(exact("ratelimit_service_config_load_success"), 1.0);
    assert_eq!(exact("ratelimit_service_config_load_error"), 0.0);
    let mut invalid = c.clone();
    invalid
        .should_rate_limit(request("eg", vec![]))
        .await
        .expect_err("no descriptors");
    // a hits_addend near 2^64 saturates the counters instead of wrapping
    // (2 + 2^64 - 2 wrapped to 0)
    let mut huge = descriptor(&[("PATH", "/productpage")]);
    huge.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value {
        value: u64::MAX - 1,
    });
    c.clone()
        .should_rate_limit(request("eg", vec![huge]))
        .await
        .expect("decided");
    let text = s.metrics.render();
    assert_eq!(
        sample(
            &text,
            "ratelimit_service_should_rate_limit_error{err_type=\"service_error\"}"
        ),
        Some(1.0),
        "{text}"
    );
    let total = sample(
        &text,
        "ratelimit_service_rate_limit_total_hits{domain=\"eg\",key1=\"PATH_/productpage\",key2=\"\"}",
    )
    .unwrap_or(0.0);
    assert!(total >= 1.8e19, "saturated, not wrapped: {total}");
    // ours are there too, on both addresses
    assert!(text.contains("rls_decisions_total"));
    assert!(s
        .metrics
        .render()
        .contains("ratelimit_service_rate_limit_total_hits"));
    s.shutdown().await.expect("stop");
}

/// envoyproxy/ratelimit's tracing switches, in the binary: with
/// TRACING_ENABLED=false no span is sent whatever
/// OTEL_EXPORTER_OTLP_ENDPOINT says (before, they were); with true,
/// TRACING_EXPORTER_PROTOCOL=grpc and a bare host:port, they arrive
/// (before, none did).
#[tokio::test]
async fn tracing_enabled_decides_whether_spans_are_sent() {
    let (collector, otlp) = Collector::start().await;
    let dir = rules_dir(RULES);
    let run = |tracing: &[(&str, String)]| {
        let (grpc, admin) = (free_port(), free_port());
        let child = ChildGuard(
            common::binary_without_rls_env()
                .arg("--config")
                .arg(dir.path())
                .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
                .args(["--admin-addr", &format!("127.0.0.1:{admin}")])
                .envs(tracing.iter().map(|(k, v)| (k.to_string(), v.clone())))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start"),
        );
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut client = loop {
                if let Ok(c) =
                    RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}")).await
                {
                    break c;
                }
                assert!(Instant::now() < deadline, "service never started");
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            for _ in 0..3 {
                client
                    .should_rate_limit(request("d", vec![descriptor(&[("user", "t")])]))
                    .await
                    .expect("answered");
            }
            child
        }
    };
    let off = run(&[
        ("TRACING_ENABLED", "false".into()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{otlp}")),
    ])
    .await;
    // a batch goes out within a second; and at exit, flushed
    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(off.terminate());
    assert_eq!(collector.spans.lock().len(), 0, "TRACING_ENABLED=false");

    let on = run(&[
        ("TRACING_ENABLED", "true".into()),
        ("TRACING_EXPORTER_PROTOCOL", "grpc".into()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.to_string()),
    ])
    .await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while !collector
        .spans
        .lock()
        .iter()
        .any(|s| s.name == "ShouldRateLimit")
    {
        assert!(Instant::now() < deadline, "spans never arrived");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(on);
}

/// A statsd host that does not resolve (yet) does not stop the start, as
/// envoyproxy/ratelimit's UDP sink does not: the service serves, and each
/// flush's packets are dropped and counted until it resolves.
#[tokio::test]
async fn a_statsd_host_that_does_not_resolve_does_not_stop_the_start() {
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.statsd_addr = Some("statsd.does-not-exist.invalid:8125".into());
    args.statsd_flush_interval = Duration::from_millis(50);
    let s = server::start(&args).await.expect("starts all the same");
    let mut c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    let r = c
        .should_rate_limit(request("d", vec![descriptor(&[("user", "a")])]))
        .await
        .expect("decided")
        .into_inner();
    assert_eq!(r.overall_code, 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let dropped = sample(&s.metrics.render(), "rls_statsd_send_errors_total").unwrap_or(0.0);
        if dropped >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dropped packet was never counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.shutdown().await.expect("stop");
    args.statsd_addr = Some("no-port".into());
    let e = server::start(&args).await.err().expect("refused");
    assert!(format!("{e:#}").contains("HOST:PORT"), "{e:#}");
}

/// envoyproxy/ratelimit's own near-limit scenarios
/// (`test/redis/fixed_cache_impl_test.go`, TestNearLimit and its
/// hits_addend cases) replayed over gRPC on `algorithm: fixed_window`
/// rules (#41): each window is first brought to the count its mock
/// returned before the call (a hit of that size), then the call: the same
/// code, `limit_remaining` and `duration_until_reset` as there, and the
/// same split of a weighted hit between within_limit, near_limit and
/// over_limit (counted as the difference the call made).
#[tokio::test]
async fn a_fixed_window_replays_envoyproxy_ratelimits_near_limit_scenarios_over_grpc() {
    let secs_to_hour = || {
        3600 - std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs()
            % 3600
    };
    if secs_to_hour() < 15 {
        tokio::time::sleep(std::time::Duration::from_secs(secs_to_hour() + 1)).await;
    }
    // (key, limit an hour, count before the call, the call's hits, over,
    // remaining, within, near, over hits)
    type Scenario = (&'static str, u32, u32, u32, bool, u32, f64, f64, f64);
    let scenarios: [Scenario; 9] = [
        ("key4a", 15, 10, 1, false, 4, 1.0, 0.0, 0.0),
        ("key4b", 15, 12, 1, false, 2, 1.0, 1.0, 0.0),
        ("key4c", 15, 15, 1, true, 0, 0.0, 0.0, 1.0),
        ("key5", 20, 2, 3, false, 15, 3.0, 0.0, 0.0),
        ("key6", 8, 5, 2, false, 1, 2.0, 1.0, 0.0),
        ("key7", 20, 16, 3, false, 1, 3.0, 3.0, 0.0),
        ("key8", 20, 19, 3, true, 0, 0.0, 1.0, 2.0),
        ("key9", 20, 15, 7, true, 0, 0.0, 4.0, 2.0),
        ("key10", 10, 27, 3, true, 0, 0.0, 0.0, 3.0),
    ];
    let mut yaml = String::from("domain: eg\ndescriptors:\n");
    for (key, limit, ..) in scenarios {
        yaml.push_str(&format!(
            "  - key: {key}\n    algorithm: fixed_window\n    rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
        ));
    }
    let rules = rules_dir(&yaml);
    let mut args = serve_args(rules.path().to_path_buf());
    args.ratelimit_metrics = true;
    let s = server::start(&args).await.expect("server starts");
    let c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    let n = |text: &str, name: &str, key: &str| {
        sample(
            text,
            &format!(
                "ratelimit_service_rate_limit_{name}{{domain=\"eg\",key1=\"{key}\",key2=\"\"}}"
            ),
        )
        .unwrap_or(0.0)
    };
    for (key, _, before, hits, over, remaining, within, near, over_hits) in scenarios {
        let call = |hits: u32| {
            let mut c = c.clone();
            let mut r = request("eg", vec![descriptor(&[(key, "v")])]);
            r.hits_addend = hits;
            async move { c.should_rate_limit(r).await.expect("decided").into_inner() }
        };
        call(before).await;
        let then = s.metrics.render();
        let answer = call(hits).await;
        let now = s.metrics.render();
        let status = &answer.statuses[0];
        let case = (key, before, hits);
        assert_eq!(status.code == Code::OverLimit as i32, over, "{case:?}");
        assert_eq!(status.limit_remaining, remaining, "{case:?}");
        let reset = status
            .duration_until_reset
            .as_ref()
            .map_or(0, |d| d.seconds as u64);
        assert!(
            reset.abs_diff(secs_to_hour()) <= 2,
            "{case:?}: duration_until_reset {reset} s, the hour ends in {} s",
            secs_to_hour()
        );
        let delta = |name: &str| n(&now, name, key) - n(&then, name, key);
        assert_eq!(delta("total_hits"), f64::from(hits), "{case:?}");
        assert_eq!(
            (
                delta("within_limit"),
                delta("near_limit"),
                delta("over_limit")
            ),
            (within, near, over_hits),
            "{case:?}: within, near, over"
        );
    }
}
