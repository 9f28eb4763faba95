//! Rules over xDS (#27): a test ADS server with mTLS (tonic, certificates
//! made by the test) serving `RateLimitConfig` snapshots shaped like Envoy
//! Gateway's translator output. ACK with the version, a NACK with the
//! errors while the last good rules keep serving, an update, and a
//! reconnect after the xDS server restarts.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::ads::{eg_config, AdsServer};
use common::{descriptor, request, rules_dir, sample, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitUnit;
use tokenbucket_rls::sources::xds::{RESOURCE_TYPE_URL, TYPE_URL};
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

#[tokio::test]
async fn rules_over_xds_with_mtls_ack_nack_update_and_reconnect() {
    let m = mtls_ads().await;
    let (mut args, _unused) = xds_args(&m);
    let MtlsAds {
        mut ads, port, tls, ..
    } = m;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    // by address, the certificate checked for the name it carries
    args.xds_server = Some(format!("https://127.0.0.1:{port}"));
    args.xds_server_name = Some("localhost".into());
    args.xds_node_id = "envoy-ratelimit".into();
    args.xds_node_metadata = tokenbucket_rls::cli::Pairs(vec![("cluster".into(), "eg".into())]);
    args.xds_headers = tokenbucket_rls::cli::Pairs(vec![("x-tenant".into(), "eg".into())]);
    let s = tokenbucket_rls::server::start(&args)
        .await
        .expect("server starts");

    // the first request: no version yet, our node id
    let first = ads.next_request().await;
    assert_eq!(first.type_url, TYPE_URL);
    assert_eq!(first.version_info, "");
    assert_eq!(
        first.node.as_ref().map(|n| n.id.as_str()),
        Some("envoy-ratelimit")
    );
    let metadata = first
        .node
        .as_ref()
        .and_then(|n| n.metadata.clone())
        .expect("node metadata");
    assert_eq!(
        metadata.fields.get("cluster").and_then(|v| v.kind.clone()),
        Some(envoy_types::pb::google::protobuf::value::Kind::StringValue(
            "eg".into()
        ))
    );
    let headers = ads.headers.lock().clone().expect("the stream's metadata");
    assert_eq!(
        headers.get("x-tenant").and_then(|v| v.to_str().ok()),
        Some("eg")
    );
    let ready = |s: &tokenbucket_rls::server::RunningServer| {
        let url = format!("http://{}/readyz", s.admin_addr);
        async move { reqwest::get(url).await.expect("readyz").status().as_u16() }
    };
    assert_eq!(ready(&s).await, 503, "not ready before the first snapshot");

    // v1: ACKed, and it limits
    let ack = ads
        .snapshot(
            "v1",
            "n1",
            &[eg_config(&[("rule-0-match-0", 3)], RateLimitUnit::Minute)],
        )
        .await;
    assert_eq!(
        (ack.version_info.as_str(), ack.error_detail.is_none()),
        ("v1", true)
    );
    assert_eq!(ready(&s).await, 200);
    let c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    let call = |rule: &'static str| {
        let mut c = c.clone();
        async move {
            c.should_rate_limit(request(
                "default/eg/http",
                vec![descriptor(&[("first-route", "first-route"), (rule, rule)])],
            ))
            .await
            .expect("decided")
            .into_inner()
        }
    };
    let mut codes = Vec::new();
    for _ in 0..4 {
        codes.push(call("rule-0-match-0").await.overall_code);
    }
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    assert_eq!(codes, [ok, ok, ok, over]);

    // v2 invalid: NACKed with the errors, v1 keeps serving
    let nack = ads
        .snapshot(
            "v2",
            "n2",
            &[eg_config(&[("rule-0-match-0", 3)], RateLimitUnit::Unknown)],
        )
        .await;
    assert_eq!(nack.version_info, "v1", "the version in force");
    let detail = nack.error_detail.expect("a NACK");
    assert!(
        detail.message.contains("xds:default/eg/http"),
        "{}",
        detail.message
    );
    assert_eq!(
        call("rule-0-match-0").await.overall_code,
        over,
        "v1 still limits"
    );

    // v3: an update, applied
    let ack = ads
        .snapshot(
            "v3",
            "n3",
            &[eg_config(
                &[("rule-0-match-0", 3), ("rule-1-match-0", 100)],
                RateLimitUnit::Minute,
            )],
        )
        .await;
    assert_eq!(
        (ack.version_info.as_str(), ack.error_detail.is_none()),
        ("v3", true)
    );
    let r = call("rule-1-match-0").await;
    assert_eq!(
        r.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit),
        Some(100)
    );
    let text = s.metrics.render();
    assert_eq!(
        sample(&text, "rls_config_reloads_total{result=\"ok\"}"),
        Some(2.0)
    );
    assert_eq!(
        sample(&text, "rls_config_reloads_total{result=\"error\"}"),
        Some(1.0)
    );

    // the xDS server restarts: the client comes back with the version in
    // force, and the rules keep serving meanwhile
    ads.stop().await;
    assert_eq!(call("rule-0-match-0").await.overall_code, over);
    let mut ads = AdsServer::start(addr, tls).await;
    let again = ads.next_request().await;
    assert_eq!(
        again.version_info, "v3",
        "resumed with the version in force"
    );
    let ack = ads
        .snapshot(
            "v4",
            "n4",
            &[eg_config(
                &[("rule-0-match-0", 3), ("rule-1-match-0", 100)],
                RateLimitUnit::Minute,
            )],
        )
        .await;
    assert_eq!(ack.version_info, "v4");
    ads.stop().await;
    s.shutdown().await.expect("stop");
}

/// Without the client certificate the xDS server requires, no rules ever
/// come: the service stays not ready and says why in its log.
#[tokio::test]
async fn an_xds_server_that_refuses_the_client_leaves_it_not_ready() {
    let m = mtls_ads().await;
    let (mut args, _unused) = xds_args(&m);
    // no client certificate
    args.xds_client_cert = None;
    args.xds_client_key = None;
    let ads = m.ads;
    let s = tokenbucket_rls::server::start(&args)
        .await
        .expect("server starts");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let status = reqwest::get(format!("http://{}/readyz", s.admin_addr))
        .await
        .expect("readyz")
        .status()
        .as_u16();
    assert_eq!(status, 503);
    ads.stop().await;
    s.shutdown().await.expect("stop");
}

/// The binary started with Envoy Gateway's ratelimit environment exactly
/// (`internal/infrastructure/kubernetes/ratelimit/resource.go` in
/// envoyproxy/gateway), only the addresses and paths moved to the test's:
/// ready before any rules (forced start), rules over xDS with mTLS, gRPC
/// over mTLS, Redis, metrics under envoyproxy/ratelimit's names on
/// PROMETHEUS_ADDR.
#[tokio::test]
async fn the_binary_with_envoy_gateways_environment() {
    use tonic::transport::{ClientTlsConfig, Endpoint};
    let redis = common::redis::RedisServer::standalone();
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = common::tls::Ca::new(dir.path(), "eg");
    let (server_pem, server_key) = ca.issue("envoy-gateway", true);
    let (rl_pem, rl_key) = ca.issue("ratelimit", true);
    // (Envoy Gateway's one certificate serves both ends; the test CA issues
    // one per use)
    let (rl_client_pem, rl_client_key) = ca.issue("ratelimit-client", false);
    let (envoy_pem, envoy_key) = ca.issue("envoy", false);
    let read = |p: &std::path::Path| std::fs::read(p).expect("read");
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(read(&server_pem), read(&server_key)))
        .client_ca_root(Certificate::from_pem(read(&ca.pem())));
    let xds_port = common::free_port();
    let mut ads = AdsServer::start(SocketAddr::from(([127, 0, 0, 1], xds_port)), tls).await;
    let (http, grpc, prom) = (
        common::free_port(),
        common::free_port(),
        common::free_port(),
    );
    let p = |path: &std::path::Path| path.display().to_string();
    let env = [
        ("RUNTIME_ROOT", "/data".to_string()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".into()),
        ("RUNTIME_IGNOREDOTFILES", "true".into()),
        ("RUNTIME_WATCH_ROOT", "false".into()),
        ("LOG_LEVEL", "info".into()),
        ("USE_STATSD", "false".into()),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".into()),
        (
            "CONFIG_GRPC_XDS_SERVER_URL",
            format!("localhost:{xds_port}"),
        ),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit".into()),
        ("GRPC_SERVER_USE_TLS", "true".into()),
        ("GRPC_SERVER_TLS_CERT", p(&rl_pem)),
        ("GRPC_SERVER_TLS_KEY", p(&rl_key)),
        ("GRPC_SERVER_TLS_CA_CERT", p(&ca.pem())),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".into()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", p(&rl_client_pem)),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", p(&rl_client_key)),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", p(&ca.pem())),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".into()),
        ("REDIS_SOCKET_TYPE", "tcp".into()),
        ("REDIS_URL", format!("127.0.0.1:{}", redis.port)),
        ("USE_PROMETHEUS", "true".into()),
        ("PROMETHEUS_ADDR", format!("127.0.0.1:{prom}")),
        // moved: Envoy Gateway's pod listens on 8080 and 8081
        ("HOST", "127.0.0.1".into()),
        ("PORT", http.to_string()),
        ("GRPC_HOST", "127.0.0.1".into()),
        ("GRPC_PORT", grpc.to_string()),
    ];
    // what examples/envoy-gateway adds in rateLimitDeployment.container.env
    let added = envoy_gateway_example_env();
    assert!(
        added
            .iter()
            .any(|(k, v)| k == "CACHE_KEY_PREFIX" && v == "eg:rl:"),
        "{added:?}"
    );
    let mut command = common::binary_without_rls_env();
    let child = command
        .env_remove("RUST_LOG")
        .envs(env)
        .envs(added)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start");
    let _child = common::ChildGuard(child);

    // ready before any rules (Envoy Gateway starts it before any policy)
    common::until_ok(
        &format!("http://127.0.0.1:{http}/healthcheck"),
        "never healthy",
    )
    .await;
    let first = ads.next_request().await;
    assert_eq!(first.node.map(|n| n.id), Some("envoy-ratelimit".into()));
    let ack = ads
        .snapshot(
            "1",
            "a",
            &[eg_config(&[("rule-0-match-0", 2)], RateLimitUnit::Minute)],
        )
        .await;
    assert_eq!(
        (ack.version_info.as_str(), ack.error_detail.is_none()),
        ("1", true)
    );

    // Envoy's side: gRPC over mTLS
    let channel = Endpoint::from_shared(format!("https://localhost:{grpc}"))
        .expect("endpoint")
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(read(&ca.pem())))
                .identity(Identity::from_pem(read(&envoy_pem), read(&envoy_key))),
        )
        .expect("tls")
        .connect()
        .await
        .expect("connects over mTLS");
    let mut c = RateLimitServiceClient::new(channel);
    let mut codes = Vec::new();
    for _ in 0..3 {
        let r = c
            .should_rate_limit(request(
                "default/eg/http",
                vec![descriptor(&[
                    ("first-route", "first-route"),
                    ("rule-0-match-0", "rule-0-match-0"),
                ])],
            ))
            .await
            .expect("decided")
            .into_inner();
        codes.push(r.overall_code);
    }
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    assert_eq!(codes, [ok, ok, over]);
    let keys = redis.cli(&["KEYS", "*"]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert!(!keys.is_empty(), "decided in Redis");
    // buckets, and the instances counting themselves (docs/run.md)
    assert!(
        keys.iter()
            .all(|k| k.starts_with("eg:rl:rls:{") || *k == "eg:rl:rls:instances"),
        "every key behind CACHE_KEY_PREFIX: {keys:?}"
    );
    let text = reqwest::get(format!("http://127.0.0.1:{prom}/metrics"))
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    assert_eq!(
        sample(
            &text,
            "ratelimit_service_rate_limit_over_limit{domain=\"default/eg/http\",key1=\"first-route_first-route\",key2=\"rule-0-match-0_rule-0-match-0\"}"
        ),
        Some(1.0),
        "{text}"
    );
    ads.stop().await;
}

/// `examples/envoy-gateway/envoy-gateway-config.yaml`: the ratelimit
/// container's image (ours) and the environment it adds.
fn envoy_gateway_example_env() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/envoy-gateway/envoy-gateway-config.yaml"
    ))
    .expect("example");
    let configmap: serde_yaml::Value = serde_yaml::from_str(&text).expect("YAML");
    let inner = configmap["data"]["envoy-gateway.yaml"]
        .as_str()
        .expect("the EnvoyGateway configuration");
    let eg: serde_yaml::Value = serde_yaml::from_str(inner).expect("YAML");
    assert_eq!(eg["kind"].as_str(), Some("EnvoyGateway"));
    let container = &eg["provider"]["kubernetes"]["rateLimitDeployment"]["container"];
    assert!(container["image"]
        .as_str()
        .is_some_and(|i| i.starts_with("tokenbucket-rls")));
    container["env"]
        .as_sequence()
        .expect("env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().expect("name").to_string(),
                e["value"].as_str().expect("value").to_string(),
            )
        })
        .collect()
}

/// An mTLS ADS server on a free port, with what a client needs to reach it.
struct MtlsAds {
    ads: AdsServer,
    port: u16,
    ca: common::tls::Ca,
    client_pem: std::path::PathBuf,
    client_key: std::path::PathBuf,
    tls: ServerTlsConfig,
    _dir: tempfile::TempDir,
}

async fn mtls_ads() -> MtlsAds {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = common::tls::Ca::new(dir.path(), "xds");
    let (server_pem, server_key) = ca.issue("xds-server", true);
    let (client_pem, client_key) = ca.issue("rls-client", false);
    let read = |p: &std::path::Path| std::fs::read(p).expect("read");
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(read(&server_pem), read(&server_key)))
        .client_ca_root(Certificate::from_pem(read(&ca.pem())));
    let port = common::free_port();
    let ads = AdsServer::start(SocketAddr::from(([127, 0, 0, 1], port)), tls.clone()).await;
    MtlsAds {
        ads,
        port,
        ca,
        client_pem,
        client_key,
        tls,
        _dir: dir,
    }
}

/// Server arguments taking the rules from `m` with its client
/// certificate (the rules directory holds none that matter).
fn xds_args(m: &MtlsAds) -> (tokenbucket_rls::cli::ServeArgs, tempfile::TempDir) {
    let unused = rules_dir("domain: unused\ndescriptors: []\n");
    let mut args = serve_args(unused.path().to_path_buf());
    args.xds_server = Some(format!("https://localhost:{}", m.port));
    args.xds_ca_file = Some(m.ca.pem());
    args.xds_client_cert = Some(m.client_pem.clone());
    args.xds_client_key = Some(m.client_key.clone());
    (args, unused)
}

fn any_of(type_url: &str, value: Vec<u8>) -> envoy_types::pb::google::protobuf::Any {
    envoy_types::pb::google::protobuf::Any {
        type_url: type_url.into(),
        value,
    }
}

/// A resource wrapped in `envoy.service.discovery.v3.Resource`, as
/// go-control-plane sends one with a TTL; `None`: a heartbeat.
fn wrapped(
    name: &str,
    config: Option<&envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitConfig>,
) -> envoy_types::pb::google::protobuf::Any {
    use prost::Message;
    let resource = envoy_types::pb::envoy::service::discovery::v3::Resource {
        name: name.into(),
        version: "1".into(),
        resource: config.map(|c| any_of(TYPE_URL, c.encode_to_vec())),
        ttl: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 30,
            nanos: 0,
        }),
        ..Default::default()
    };
    any_of(RESOURCE_TYPE_URL, resource.encode_to_vec())
}

fn response(
    version: &str,
    nonce: &str,
    type_url: &str,
    resources: Vec<envoy_types::pb::google::protobuf::Any>,
) -> envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse {
    envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse {
        version_info: version.into(),
        resources,
        type_url: type_url.into(),
        nonce: nonce.into(),
        ..Default::default()
    }
}

/// Resources wrapped in `Resource` are unwrapped (before, they were
/// dropped and the empty rest ACKed: every limit vanished); a TTL
/// heartbeat keeps its config; a resource of another type, or a response
/// of another type, is NACKed and the rules in force keep limiting.
#[tokio::test]
async fn wrapped_resources_are_taken_and_foreign_ones_nacked() {
    let m = mtls_ads().await;
    let (args, _unused) = xds_args(&m);
    let mut ads = m.ads;
    let s = tokenbucket_rls::server::start(&args)
        .await
        .expect("server starts");
    ads.next_request().await;
    let config = eg_config(&[("rule-0-match-0", 2)], RateLimitUnit::Minute);
    let ack = ads
        .push(response(
            "v1",
            "n1",
            TYPE_URL,
            vec![wrapped(&config.name, Some(&config))],
        ))
        .await;
    assert_eq!(
        (ack.version_info.as_str(), ack.error_detail),
        ("v1", None),
        "a wrapped config is taken"
    );
    let c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    let call = |value: &'static str| {
        let mut c = c.clone();
        async move {
            c.should_rate_limit(request(
                "default/eg/http",
                vec![descriptor(&[
                    ("first-route", "first-route"),
                    ("rule-0-match-0", value),
                ])],
            ))
            .await
            .expect("decided")
            .into_inner()
            .overall_code
        }
    };
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(call("rule-0-match-0").await);
    }
    assert_eq!(codes, [ok, ok, over], "the wrapped rule limits");

    // a heartbeat: the config keeps its body
    let ack = ads
        .push(response(
            "v2",
            "n2",
            TYPE_URL,
            vec![wrapped(&config.name, None)],
        ))
        .await;
    assert_eq!((ack.version_info.as_str(), ack.error_detail), ("v2", None));
    assert_eq!(call("rule-0-match-0").await, over, "still limits");

    // a resource of another type beside ours: NACKed, v2 keeps serving
    use prost::Message;
    let nack = ads
        .push(response(
            "v3",
            "n3",
            TYPE_URL,
            vec![
                any_of(TYPE_URL, config.encode_to_vec()),
                any_of(
                    "type.googleapis.com/envoy.config.cluster.v3.Cluster",
                    vec![10, 3, b'a', b'b', b'c'],
                ),
            ],
        ))
        .await;
    assert_eq!(nack.version_info, "v2");
    let detail = nack.error_detail.expect("a NACK").message;
    assert!(
        detail.contains("envoy.config.cluster.v3.Cluster"),
        "{detail}"
    );
    assert_eq!(call("rule-0-match-0").await, over, "v2 still limits");

    // a response of another type: NACKed
    let nack = ads
        .push(response(
            "v4",
            "n4",
            "type.googleapis.com/envoy.config.listener.v3.Listener",
            vec![],
        ))
        .await;
    assert_eq!(nack.version_info, "v2");
    let detail = nack.error_detail.expect("a NACK").message;
    assert!(detail.contains("Listener"), "{detail}");
    assert_eq!(call("rule-0-match-0").await, over, "v2 still limits");
    let text = s.metrics.render();
    assert_eq!(
        sample(&text, "rls_config_reloads_total{result=\"error\"}"),
        Some(2.0)
    );
    ads.stop().await;
    s.shutdown().await.expect("stop");
}

/// A config of about `bytes` bytes: descriptors with long values.
fn config_of_size(
    bytes: usize,
) -> envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitConfig {
    let mut config = eg_config(&[("rule-0-match-0", 2)], RateLimitUnit::Minute);
    let template = config.descriptors[0].descriptors[0].clone();
    let pad = "x".repeat(1000);
    for i in 0..bytes / 1020 {
        let mut d = template.clone();
        d.value = format!("{i}-{pad}");
        config.descriptors[0].descriptors.push(d);
    }
    config
}

/// `--xds-max-message-size` is honoured: a 5 MiB snapshot (over gRPC's
/// default 4 MiB, which was the only size taken) is ACKed under a limit
/// of 6 MiB; a 7 MiB one is not taken: the stream fails and is opened
/// again with the version in force.
#[tokio::test]
async fn snapshots_up_to_the_configured_size_are_taken() {
    let m = mtls_ads().await;
    let (mut args, _unused) = xds_args(&m);
    let mut ads = m.ads;
    args.xds_max_message_size = 6 * 1024 * 1024;
    let s = tokenbucket_rls::server::start(&args)
        .await
        .expect("server starts");
    ads.next_request().await;
    let ack = ads
        .snapshot("big", "n1", &[config_of_size(5 * 1024 * 1024)])
        .await;
    assert_eq!(
        (ack.version_info.as_str(), ack.error_detail),
        ("big", None),
        "5 MiB under a limit of 6 MiB"
    );
    use prost::Message;
    let huge = config_of_size(7 * 1024 * 1024);
    let next = ads
        .push_then_next(response(
            "huge",
            "n2",
            TYPE_URL,
            vec![any_of(TYPE_URL, huge.encode_to_vec())],
        ))
        .await;
    assert_eq!(
        (next.version_info.as_str(), next.response_nonce.as_str()),
        ("big", ""),
        "not taken: a new stream, with the version in force"
    );
    ads.stop().await;
    s.shutdown().await.expect("stop");
}

/// TLS files with a plaintext `--xds-server` would be ignored (rules over
/// plaintext): refused at start, naming them.
#[tokio::test]
async fn tls_files_with_a_plaintext_xds_url_are_refused() {
    let unused = rules_dir("domain: unused\ndescriptors: []\n");
    let mut args = serve_args(unused.path().to_path_buf());
    args.xds_server = Some("http://127.0.0.1:18000".into());
    args.xds_ca_file = Some("/tmp/ca.pem".into());
    let e = tokenbucket_rls::server::start(&args)
        .await
        .err()
        .expect("refused");
    let text = format!("{e:#}");
    assert!(
        text.contains("--xds-ca-file") && text.contains("http://"),
        "{text}"
    );
    args.xds_ca_file = None;
    args.xds_server = Some("grpc://127.0.0.1:18000".into());
    let e = tokenbucket_rls::server::start(&args)
        .await
        .err()
        .expect("refused");
    assert!(format!("{e:#}").contains("https://"), "{e:#}");
}

/// envoyproxy/ratelimit's `CONFIG_GRPC_XDS_SERVER_USE_TLS=true` with an
/// `http://` server URL: TLS all the same (before, the rules came over
/// plaintext and nothing was logged; against this mTLS server, never).
/// And an explicit `--config` wins over `CONFIG_TYPE=GRPC_XDS_SOTW` in
/// the environment: flags win.
#[tokio::test]
async fn the_binary_honours_use_tls_and_a_config_flag() {
    let MtlsAds {
        mut ads,
        port,
        ca,
        client_pem,
        client_key,
        _dir,
        ..
    } = mtls_ads().await;
    let p = |path: &std::path::Path| path.display().to_string();
    let http = common::free_port();
    let grpc = common::free_port();
    let env = [
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".to_string()),
        (
            "CONFIG_GRPC_XDS_SERVER_URL",
            format!("http://localhost:{port}"),
        ),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".into()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", p(&client_pem)),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", p(&client_key)),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", p(&ca.pem())),
        ("HOST", "127.0.0.1".into()),
        ("PORT", http.to_string()),
        ("GRPC_HOST", "127.0.0.1".into()),
        ("GRPC_PORT", grpc.to_string()),
    ];
    let child = common::binary_without_rls_env()
        .envs(env.clone())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start");
    let _child = common::ChildGuard(child);
    let first = ads.next_request().await;
    assert_eq!(first.type_url, TYPE_URL, "reached over TLS");
    let ack = ads
        .snapshot(
            "1",
            "a",
            &[eg_config(&[("rule-0-match-0", 2)], RateLimitUnit::Minute)],
        )
        .await;
    assert_eq!((ack.version_info.as_str(), ack.error_detail), ("1", None));
    drop(_child);
    ads.stop().await;

    // the same environment and --config: rules from the flag's directory
    let rules = rules_dir(
        "domain: flag\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    );
    let (http, grpc) = (common::free_port(), common::free_port());
    let child = common::binary_without_rls_env()
        .envs(env)
        .env("PORT", http.to_string())
        .env("GRPC_PORT", grpc.to_string())
        .arg("--config")
        .arg(rules.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start");
    let _child = common::ChildGuard(child);
    common::until_ok(
        &format!("http://127.0.0.1:{http}/readyz"),
        "never ready: the rules of --config were not loaded",
    )
    .await;
    let mut c = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .expect("connect");
    let mut codes = Vec::new();
    for _ in 0..2 {
        let r = c
            .should_rate_limit(request("flag", vec![descriptor(&[("k", "v")])]))
            .await
            .expect("decided")
            .into_inner();
        codes.push(r.overall_code);
    }
    assert_eq!(codes, [Code::Ok as i32, Code::OverLimit as i32]);
}

/// A rollout with rules over xDS (#68): envoyproxy/ratelimit's pods and
/// ours take one snapshot (`CONFIG_TYPE=GRPC_XDS_SOTW`, over mTLS) and
/// count in its keys on one Redis; calls alternate between its decision
/// (replayed from its source, `common::ratelimit_peer`) and ours, and the
/// two admit one budget: 5 of 12 on a limit of 5 an hour.
#[tokio::test]
async fn a_rollout_with_rules_over_xds_is_one_budget() {
    use common::ratelimit_peer::{hour_with_room, Peer, PeerDescriptor, PeerLimit};
    let redis = common::redis::RedisServer::standalone();
    let mut m = mtls_ads().await;
    let p = |path: &std::path::Path| path.display().to_string();
    let env = [
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".to_string()),
        (
            "CONFIG_GRPC_XDS_SERVER_URL",
            format!("localhost:{}", m.port),
        ),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit".into()),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".into()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", p(&m.client_pem)),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", p(&m.client_key)),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", p(&m.ca.pem())),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".into()),
        ("REDIS_SOCKET_TYPE", "tcp".into()),
        ("REDIS_URL", format!("127.0.0.1:{}", redis.port)),
        ("CACHE_KEY_PREFIX", "rl:".into()),
    ];
    let unused = tempfile::tempdir().expect("tempdir");
    let snapshot = async {
        m.ads.next_request().await;
        m.ads
            .snapshot(
                "1",
                "a",
                &[eg_config(&[("rule-0-match-0", 5)], RateLimitUnit::Hour)],
            )
            .await
    };
    let ((_child, mut c), ack) =
        tokio::join!(common::ratelimit_binary(unused.path(), &env), snapshot);
    assert!(ack.error_detail.is_none(), "{ack:?}");
    let hour = hour_with_room().await;
    let entries = [
        ("first-route", "first-route"),
        ("rule-0-match-0", "rule-0-match-0"),
    ];
    let cli = |args: &[&str]| redis.cli(args);
    let peer = Peer::on("rl:", &cli);
    let theirs = [PeerDescriptor::new(&entries, Some(PeerLimit::per(5, 3600)))];
    let mut admitted = 0;
    for i in 0..12 {
        let over = match i % 2 {
            0 => peer.call("default/eg/http", &theirs, 1).over,
            _ => {
                let r = c
                    .should_rate_limit(request("default/eg/http", vec![descriptor(&entries)]))
                    .await
                    .expect("decided")
                    .into_inner();
                r.overall_code == Code::OverLimit as i32
            }
        };
        admitted += usize::from(!over);
    }
    assert_eq!(admitted, 5, "one budget");
    let key =
        format!("rl:default/eg/http_first-route_first-route_rule-0-match-0_rule-0-match-0_{hour}");
    assert_eq!(redis.cli(&["GET", &key]).trim(), "12");
    m.ads.stop().await;
}
