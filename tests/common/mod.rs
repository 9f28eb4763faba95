//! Helpers shared by the integration tests: servers on free loopback ports,
//! child processes that are killed when the test ends, and request builders.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::Child;

pub mod ads;
pub mod footprint;
pub mod ratelimit_peer;
pub mod redis;
pub mod rlqs;
pub mod sentinel;
pub mod tls;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tokenbucket_rls::cli::{ServeArgs, StoreKind};
use tokenbucket_rls::rules::FailureMode;

/// A loopback port nobody listens on right now, for a process the test
/// starts a moment later (Envoy, the service's binary). Below the kernel's
/// ephemeral range (32768 and up) and the Redis servers' ports (10000 and
/// up): a port in that range can meanwhile become an outgoing connection's
/// local port (ci15: the demo's second instance could not bind its admin
/// port), and a port the OS hands out for `:0` is in it.
pub fn free_port() -> u16 {
    redis::free_port_below_ephemeral(2_000, 10_000, |p| {
        TcpListener::bind(("127.0.0.1", p)).is_ok()
    })
}

/// Server arguments for a test: loopback, OS-chosen ports, the given rules.
pub fn serve_args(config: PathBuf) -> ServeArgs {
    let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    ServeArgs {
        config,
        grpc_addr: any,
        grpc_uds: None,
        grpc_uds_mode: 0o660,
        algorithm: tokenbucket_rls::bucket::Algorithm::TokenBucket,
        calendar_clock_offset: 0,
        admin_addr: any,
        store: StoreKind::Memory,
        redis_url: None,
        redis_timeout: std::time::Duration::from_millis(500),
        redis_pool_size: 4,
        redis_persecond_url: None,
        redis_persecond_pool_size: None,
        redis_persecond_timeout: None,
        redis_persecond_password_file: None,
        redis_batch: None,
        redis_ca_file: None,
        redis_password_file: None,
        redis_client_cert: None,
        redis_client_key: None,
        redis_tls_skip_hostname_verification: false,
        max_buckets: tokenbucket_rls::store::memory::DEFAULT_MAX_BUCKETS,
        max_attempts: tokenbucket_rls::store::memory::DEFAULT_MAX_ATTEMPTS,
        max_in_flight: 10_000,
        serving_threads: None,
        shutdown_delay: std::time::Duration::ZERO,
        shutdown_grace: std::time::Duration::from_secs(20),
        max_connections: 10_000,
        idle_timeout: std::time::Duration::from_secs(600),
        http2_keepalive_interval: std::time::Duration::from_secs(30),
        http2_keepalive_timeout: std::time::Duration::from_secs(20),
        redis_bucket_layout: Default::default(),
        redis_key_prefix: String::new(),
        redis_expiration_jitter_max_seconds: 0,
        failure_mode: FailureMode::Open,
        instances: Some(1),
        response_headers: false,
        response_headers_format: Default::default(),
        retry_after: true,
        ratelimit_rules: false,
        ratelimit_metrics: false,
        quota_upstream: None,
        region: None,
        regions: None,
        quota_upstream_ca_file: None,
        quota_upstream_client_cert: None,
        quota_upstream_client_key: None,
        quota_upstream_server_name: None,
        xds_server: None,
        xds_node_id: "default".into(),
        xds_node_metadata: Default::default(),
        xds_headers: Default::default(),
        xds_server_name: None,
        xds_ca_file: None,
        xds_client_cert: None,
        xds_client_key: None,
        xds_ready_without_rules: false,
        xds_backoff: std::time::Duration::from_millis(200),
        xds_max_backoff: std::time::Duration::from_secs(2),
        xds_max_message_size: tokenbucket_rls::sources::xds::DEFAULT_MAX_MESSAGE_SIZE,
        near_limit_ratio: 0.8,
        prometheus_addr: None,
        prometheus_path: "/metrics".into(),
        merge_domains: false,
        usage_domains: Vec::new(),
        shadow_mode: false,
        legacy_header_names: ["RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"]
            .map(String::from)
            .to_vec(),
        quota_mode: false,
        per_descriptor_spending: false,
        response_dynamic_metadata: false,
        refused_by_header: None,
        refusal_log_rate: 5,
        heavy_hitters: tokenbucket_rls::hitters::DEFAULT_COUNTERS,
        admin_token_file: None,
        admin_allowed_hosts: Vec::new(),
        admin_tls_cert: None,
        admin_tls_key: None,
        admin_tls_client_ca: None,
        refusal_log_hash_keys: Vec::new(),
        pseudonym_key_file: None,
        statsd_addr: None,
        statsd_flush_interval: std::time::Duration::from_secs(10),
        otlp_endpoint: None,
        tls_cert: None,
        tls_key: None,
        tls_client_ca: None,
        tls_client_san: None,
        log_format: tokenbucket_rls::telemetry::tracing::LogFormat::Text,
    }
}

/// A server on the Redis (or Redis Cluster) at `url` with the rules in
/// `rules`, failing closed, so that every answer comes from Redis.
pub async fn start_on_redis(
    url: &str,
    rules: &tempfile::TempDir,
    timeout: std::time::Duration,
) -> tokenbucket_rls::server::RunningServer {
    tokenbucket_rls::server::start(&redis_args(url, rules, timeout))
        .await
        .expect("server starts")
}

/// What [`start_on_redis`] starts with, to change before starting.
pub fn redis_args(url: &str, rules: &tempfile::TempDir, timeout: std::time::Duration) -> ServeArgs {
    let mut args = serve_args(rules.path().to_path_buf());
    args.store = StoreKind::Redis;
    args.redis_url = Some(url.to_string());
    args.redis_timeout = timeout;
    args.failure_mode = FailureMode::Closed;
    args
}

/// A gRPC client of `server`.
pub async fn client(
    server: &tokenbucket_rls::server::RunningServer,
) -> envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<
    tonic::transport::Channel,
>{
    envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(
        format!("http://{}", server.grpc_addr),
    )
    .await
    .expect("connect")
}

/// Writes `yaml` as the only rules file of a fresh directory.
pub fn rules_dir(yaml: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("rules.yaml"), yaml).expect("write rules");
    dir
}

/// A child process killed (and reaped) when dropped, also on panic.
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Stops it with SIGTERM, as an orchestrator does, and returns what it
    /// wrote (to the pipes it was given).
    pub fn terminate(mut self) -> std::process::Output {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let placeholder = std::process::Command::new("true").spawn().expect("true");
        std::mem::replace(&mut self.0, placeholder)
            .wait_with_output()
            .expect("output")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_string(),
        descriptors,
        hits_addend: 0,
    }
}

/// The value of the sample line `name{labels}` in Prometheus text, if present.
pub fn sample(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name_and_labels) && l[name_and_labels.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The service binary with none of this shell's `RLS_*` variables, for
/// tests that configure it only as envoyproxy/ratelimit's deployments do.
pub fn binary_without_rls_env() -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("RLS_")) {
        command.env_remove(k);
    }
    command
}

/// The binary as a Deployment written for envoyproxy/ratelimit starts it:
/// rules under `RUNTIME_ROOT` (`rules` itself), gRPC on
/// `GRPC_HOST:GRPC_PORT`, the admin port on `HOST:PORT`, its output
/// dropped; the caller adds the variables under test. With its gRPC client
/// once it is ready.
pub async fn ratelimit_binary(
    rules: &std::path::Path,
    env: &[(&str, String)],
) -> (
    ChildGuard,
    envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<
        tonic::transport::Channel,
    >,
){
    let (grpc, admin) = (free_port(), free_port());
    let child = ChildGuard(
        binary_without_rls_env()
            .env("RUNTIME_ROOT", rules)
            .env("RUNTIME_SUBDIRECTORY", ".")
            .env("RUNTIME_APPDIRECTORY", ".")
            .env("GRPC_HOST", "127.0.0.1")
            .env("GRPC_PORT", grpc.to_string())
            .env("HOST", "127.0.0.1")
            .env("PORT", admin.to_string())
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start the binary"),
    );
    until_ok(&format!("http://127.0.0.1:{admin}/readyz"), "ready").await;
    let client = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .expect("connect");
    (child, client)
}

/// Waits until `url` answers a 2xx (a process's probe path), for at most
/// 30 s; `what` says what never happened.
pub async fn until_ok(url: &str, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let probe = reqwest::get(url).await;
        if probe.is_ok_and(|r| r.status().is_success()) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Waits until something listens on `port` on loopback (a process just
/// started), for at most 20 s.
pub async fn listening(port: u16) {
    for _ in 0..400 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("nothing listens on {port}");
}
