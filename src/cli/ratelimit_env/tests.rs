use super::*;

fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn setting(t: &Translated, name: &str) -> Option<String> {
    t.settings
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.clone())
}

/// Istio's ratelimit sample (samples/ratelimit/rate-limit-service.yaml):
/// rules from a ConfigMap under /data/ratelimit/config, Redis over TCP.
#[test]
fn istios_sample_environment() {
    let t = translate(&env(&[
        ("LOG_LEVEL", "debug"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis:6379"),
        ("USE_STATSD", "false"),
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_CONFIG").as_deref(),
        Some("/data/ratelimit/config")
    );
    assert_eq!(setting(&t, "RLS_STORE").as_deref(), Some("redis"));
    assert_eq!(
        setting(&t, "RLS_REDIS_URL").as_deref(),
        Some("redis://redis:6379")
    );
    assert_eq!(
        setting(&t, "RUST_LOG").as_deref(),
        Some("info,tokenbucket_rls=debug,fred=error")
    );
    // its counting, in its keys: one budget across the swap
    assert_eq!(
        setting(&t, "RLS_ALGORITHM").as_deref(),
        Some("fixed_window")
    );
    assert_eq!(
        t.unused,
        [
            "RUNTIME_IGNOREDOTFILES: dot files are always skipped",
            "RUNTIME_WATCH_ROOT: the rules directory is watched, ConfigMap swaps (..data) included",
        ]
    );
}

#[test]
fn grpc_on_a_unix_socket() {
    let t = translate(&env(&[("GRPC_UDS", "/var/run/rl/ratelimit.sock")])).expect("translated");
    assert_eq!(
        setting(&t, "RLS_GRPC_UDS").as_deref(),
        Some("/var/run/rl/ratelimit.sock")
    );
    let t = translate(&env(&[("GRPC_UDS", "@ratelimit")])).expect("an abstract name");
    assert_eq!(setting(&t, "RLS_GRPC_UDS").as_deref(), Some("@ratelimit"));
}

#[test]
fn addresses_ports_and_tls() {
    let t = translate(&env(&[
        ("PORT", "18080"),
        ("GRPC_PORT", "18081"),
        ("GRPC_HOST", "127.0.0.1"),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
        ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
        ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_ADMIN_ADDR").as_deref(),
        Some("0.0.0.0:18080")
    );
    assert_eq!(
        setting(&t, "RLS_GRPC_ADDR").as_deref(),
        Some("127.0.0.1:18081")
    );
    assert_eq!(
        setting(&t, "RLS_TLS_CERT").as_deref(),
        Some("/certs/tls.crt")
    );
    assert_eq!(
        setting(&t, "RLS_TLS_CLIENT_CA").as_deref(),
        Some("/certs/ca.crt")
    );
    // Istio's sample listens on every IPv6 (and IPv4) address
    let t = translate(&env(&[("HOST", "::"), ("GRPC_HOST", "::")])).expect("translated");
    assert_eq!(setting(&t, "RLS_ADMIN_ADDR").as_deref(), Some("[::]:8080"));
    assert_eq!(setting(&t, "RLS_GRPC_ADDR").as_deref(), Some("[::]:8081"));
    let err = translate(&env(&[("GRPC_SERVER_USE_TLS", "true")])).expect_err("no cert");
    assert!(err.contains("GRPC_SERVER_TLS_CERT"), "{err}");
    // the client certificate's SAN, with mTLS only
    let t = translate(&env(&[
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
        ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
        ("GRPC_CLIENT_TLS_CACERT", "/certs/ca.crt"),
        ("GRPC_CLIENT_TLS_SAN", "envoy.edge.example"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_TLS_CLIENT_SAN").as_deref(),
        Some("envoy.edge.example")
    );
    let t =
        translate(&env(&[("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true")])).expect("translated");
    assert_eq!(
        setting(&t, "RLS_REDIS_TLS_SKIP_HOSTNAME_VERIFICATION").as_deref(),
        Some("true")
    );
    let err =
        translate(&env(&[("GRPC_CLIENT_TLS_SAN", "envoy.edge.example")])).expect_err("no mTLS");
    assert!(
        err.contains("GRPC_CLIENT_TLS_SAN") && err.contains("mTLS only"),
        "{err}"
    );
}

#[test]
fn sentinel_as_envoyproxy_ratelimit_names_it() {
    let url = |pairs: &[(&str, &str)]| {
        setting(
            &translate(&env(pairs)).expect("translated"),
            "RLS_REDIS_URL",
        )
        .expect("url")
    };
    assert_eq!(
        url(&[
            ("REDIS_TYPE", "sentinel"),
            ("REDIS_URL", "mymaster,s1:26379, s2:26379")
        ]),
        "redis-sentinel://s1:26379,s2:26379/mymaster"
    );
    assert_eq!(
        url(&[
            ("REDIS_TYPE", "SENTINEL"),
            ("REDIS_URL", "mymaster,s1:26379"),
            ("REDIS_AUTH", "rls:p@ss"),
            ("REDIS_SENTINEL_AUTH", "watch:s3"),
            ("REDIS_TLS", "true"),
        ]),
        "rediss-sentinel://rls:p%40ss@s1:26379/mymaster?sentinel_username=watch&sentinel_password=s3"
    );
    assert_eq!(
        url(&[
            ("REDIS_TYPE", "sentinel"),
            ("REDIS_URL", "m,s1:1"),
            ("REDIS_SENTINEL_AUTH", "s3"),
        ]),
        "redis-sentinel://s1:1/m?sentinel_password=s3"
    );
    // what it becomes is a URL the store reads as such
    let parsed = master_of(&url(&[
        ("REDIS_TYPE", "sentinel"),
        ("REDIS_URL", "my master,s1:1"),
        ("REDIS_AUTH", "p"),
    ]));
    assert_eq!(parsed, "my master");
}

fn master_of(url: &str) -> String {
    match crate::store::redis::url::parse(url)
        .expect("a URL the store reads")
        .server
    {
        fred::types::config::ServerConfig::Sentinel { service_name, .. } => service_name,
        other => panic!("sentinel, got {other:?}"),
    }
}

#[test]
fn redis_forms() {
    let url = |pairs: &[(&str, &str)]| {
        setting(
            &translate(&env(pairs)).expect("translated"),
            "RLS_REDIS_URL",
        )
        .expect("url")
    };
    assert_eq!(
        url(&[("REDIS_TYPE", "cluster"), ("REDIS_URL", "a:7000,b:7001")]),
        "redis-cluster://a:7000,b:7001"
    );
    assert_eq!(
        url(&[
            ("REDIS_URL", "r:6380"),
            ("REDIS_TLS", "true"),
            ("REDIS_AUTH", "s3cr@t")
        ]),
        "rediss://:s3cr%40t@r:6380"
    );
    assert_eq!(
        url(&[("REDIS_URL", "r:6379"), ("REDIS_AUTH", "rls:pw")]),
        "redis://rls:pw@r:6379"
    );
    assert_eq!(url(&[("REDIS_URL", "redis://x:1")]), "redis://x:1");
    // a URL with a scheme takes REDIS_AUTH, REDIS_TLS and REDIS_TYPE too
    // (they were dropped: NOAUTH on every call, or plaintext)
    assert_eq!(
        url(&[("REDIS_URL", "redis://x:1"), ("REDIS_AUTH", "pw")]),
        "redis://:pw@x:1"
    );
    assert_eq!(
        url(&[("REDIS_URL", "redis://x:1"), ("REDIS_TLS", "true")]),
        "rediss://x:1"
    );
    assert_eq!(
        url(&[("REDIS_URL", "redis://a:1,b:2"), ("REDIS_TYPE", "cluster")]),
        "redis-cluster://a:1,b:2"
    );
    assert_eq!(
        url(&[("REDIS_URL", "rediss-cluster://u:p@a:1")]),
        "rediss-cluster://u:p@a:1"
    );
    for (pairs, named) in [
        (
            vec![("REDIS_URL", "redis://u:p@x:1"), ("REDIS_AUTH", "pw")],
            "REDIS_AUTH=***",
        ),
        (
            vec![("REDIS_URL", "rediss://x:1"), ("REDIS_TLS", "false")],
            "REDIS_TLS=false",
        ),
        (
            vec![
                ("REDIS_URL", "redis-cluster://x:1"),
                ("REDIS_TYPE", "single"),
            ],
            "REDIS_TYPE=single",
        ),
        (vec![("REDIS_URL", "http://x:1")], "REDIS_URL=http://x:1"),
    ] {
        let e = translate(&env(&pairs)).expect_err("a conflict");
        assert!(e.contains(named), "{pairs:?}: {e}");
        assert!(!e.contains("pw"), "no password in {e}");
    }
    let t = translate(&env(&[
        ("REDIS_URL", "r:6379"),
        ("REDIS_POOL_SIZE", "10"),
        ("REDIS_TIMEOUT", "10s"),
        ("REDIS_TLS_CACERT", "/ca.pem"),
    ]))
    .expect("translated");
    assert_eq!(setting(&t, "RLS_REDIS_POOL_SIZE").as_deref(), Some("10"));
    assert_eq!(setting(&t, "RLS_REDIS_TIMEOUT").as_deref(), Some("10s"));
    assert_eq!(setting(&t, "RLS_REDIS_CA_FILE").as_deref(), Some("/ca.pem"));
}

/// What this service cannot do yet is refused, naming the variable and
/// value; never ignored.
#[test]
fn what_has_a_meaning_we_lack_is_refused() {
    for (pairs, named) in [
        (vec![("CONFIG_TYPE", "REST")], "CONFIG_TYPE=REST"),
        (
            vec![
                ("REDIS_URL", "/var/run/r.sock"),
                ("REDIS_SOCKET_TYPE", "udp"),
            ],
            "REDIS_SOCKET_TYPE=udp",
        ),
        (
            vec![("REDIS_URL", "r:1"), ("REDIS_TYPE", "SENTINEL")],
            "REDIS_URL=r:1",
        ),
        (
            vec![("REDIS_URL", "mymaster"), ("REDIS_TYPE", "sentinel")],
            "REDIS_URL=mymaster",
        ),
        (
            vec![("REDIS_URL", "redis://u:p@s:1"), ("REDIS_TYPE", "sentinel")],
            "REDIS_URL=redis://u:***@s:1",
        ),
        (
            vec![("REDIS_URL", "r:1"), ("REDIS_SENTINEL_AUTH", "x")],
            "REDIS_SENTINEL_AUTH=***",
        ),
        (
            vec![("REDIS_URL", "r:1"), ("REDIS_TYPE", "ring")],
            "REDIS_TYPE=ring",
        ),
        (vec![("REDIS_PERSECOND", "true")], "REDIS_PERSECOND=true"),
        (vec![("USE_DOG_STATSD", "true")], "USE_DOG_STATSD=true"),
        (vec![("BACKEND_TYPE", "memcache")], "BACKEND_TYPE=memcache"),
        (vec![("LOG_LEVEL", "loud")], "LOG_LEVEL=loud"),
        (
            vec![("GRPC_UDS", "ratelimit.sock")],
            "GRPC_UDS=ratelimit.sock",
        ),
        (vec![("GRPC_UDS", "@")], "GRPC_UDS=@"),
        (
            vec![("REDIS_URL", "http://u:hunter2@r:1")],
            "REDIS_URL=http://u:***@r:1: the scheme http:// is not redis://, rediss://, redis-cluster:// or rediss-cluster://",
        ),
    ] {
        let err = translate(&env(&pairs)).expect_err(named);
        assert!(err.starts_with(named), "{err}");
    }
}

#[test]
fn statsd_off_and_others_are_named_not_refused() {
    let t = translate(&env(&[
        ("USE_STATSD", "false"),
        ("STATSD_HOST", "statsd"),
        ("MEMCACHE_HOST_PORT", "m:11211"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
        ("MERGE_DOMAIN_CONFIG", "true"),
        ("SOMETHING_ELSE", "x"),
    ]))
    .expect("translated");
    assert_eq!(
        t.unused,
        [
            "MEMCACHE_HOST_PORT: no memcache backend",
            "STATSD_HOST: statsd is off"
        ]
    );
    assert_eq!(
        setting(&t, "RLS_RESPONSE_HEADERS_FORMAT").as_deref(),
        Some("legacy")
    );
    assert_eq!(setting(&t, "RLS_MERGE_DOMAINS").as_deref(), Some("true"));
}

#[test]
fn an_empty_environment_changes_nothing() {
    assert_eq!(
        translate(&BTreeMap::new()).expect("translated"),
        Translated::default()
    );
}

/// Envoy Gateway's metrics settings: its names, on its address.
#[test]
fn prometheus_where_envoy_gateway_scrapes_it() {
    let t = translate(&env(&[
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", ":19001"),
        ("PROMETHEUS_MAPPER_YAML", "mappings: []"),
        ("NEAR_LIMIT_RATIO", "0.9"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_RATELIMIT_METRICS").as_deref(),
        Some("true")
    );
    assert_eq!(
        setting(&t, "RLS_PROMETHEUS_ADDR").as_deref(),
        Some("0.0.0.0:19001")
    );
    assert_eq!(setting(&t, "RLS_NEAR_LIMIT_RATIO").as_deref(), Some("0.9"));
    assert_eq!(
        t.unused,
        ["PROMETHEUS_MAPPER_YAML: the default mapping's names are used (ratelimit_service_rate_limit_*)"]
    );
}

/// Envoy Gateway's ratelimit Deployment (internal/infrastructure/kubernetes/
/// ratelimit/resource.go there): rules over xDS with mTLS, forced start.
#[test]
fn envoy_gateways_environment() {
    let t = translate(&env(&[
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("LOG_LEVEL", "info"),
        ("USE_STATSD", "false"),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
        ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
        ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ("CONFIG_GRPC_XDS_NODE_METADATA", "cluster:eg,zone=a"),
        ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "x-tenant:eg"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "envoy-gateway"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis.redis-system.svc.cluster.local:6379"),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", ":19001"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_XDS_SERVER").as_deref(),
        Some("https://envoy-gateway:18001")
    );
    assert_eq!(
        setting(&t, "RLS_XDS_NODE_ID").as_deref(),
        Some("envoy-ratelimit")
    );
    assert_eq!(
        setting(&t, "RLS_XDS_CA_FILE").as_deref(),
        Some("/certs/ca.crt")
    );
    assert_eq!(
        setting(&t, "RLS_XDS_CLIENT_CERT").as_deref(),
        Some("/certs/tls.crt")
    );
    assert_eq!(
        setting(&t, "RLS_XDS_READY_WITHOUT_RULES").as_deref(),
        Some("true")
    );
    assert_eq!(
        setting(&t, "RLS_XDS_NODE_METADATA").as_deref(),
        Some("cluster:eg,zone=a")
    );
    assert_eq!(
        setting(&t, "RLS_XDS_HEADERS").as_deref(),
        Some("x-tenant:eg")
    );
    assert_eq!(
        setting(&t, "RLS_XDS_SERVER_NAME").as_deref(),
        Some("envoy-gateway")
    );
    assert_eq!(
        setting(&t, "RLS_TLS_CLIENT_CA").as_deref(),
        Some("/certs/ca.crt")
    );
    assert_eq!(
        setting(&t, "RLS_PROMETHEUS_ADDR").as_deref(),
        Some("0.0.0.0:19001")
    );
    assert!(
        t.unused.iter().all(|u| !u.starts_with("CONFIG_GRPC_XDS_")),
        "{:?}",
        t.unused
    );
}

#[test]
fn statsd_where_it_sends_them() {
    let t = translate(&env(&[
        ("USE_STATSD", "true"),
        ("STATSD_HOST", "statsd.monitoring"),
        ("STATSD_PORT", "9125"),
        ("STATS_FLUSH_INTERVAL", "5s"),
        ("EXTRA_TAGS", "team:edge"),
    ]))
    .expect("statsd on");
    assert_eq!(
        setting(&t, "RLS_STATSD_ADDR").as_deref(),
        Some("statsd.monitoring:9125")
    );
    assert_eq!(
        setting(&t, "RLS_STATSD_FLUSH_INTERVAL").as_deref(),
        Some("5s")
    );
    assert_eq!(t.unused.len(), 1, "{:?}", t.unused);
    assert!(t.unused[0].starts_with("EXTRA_TAGS"), "{:?}", t.unused);
    let t = translate(&env(&[("USE_STATSD", "true")])).expect("defaults");
    assert_eq!(
        setting(&t, "RLS_STATSD_ADDR").as_deref(),
        Some("localhost:8125")
    );
    let t = translate(&env(&[("USE_STATSD", "false"), ("STATSD_HOST", "x")])).expect("off");
    assert_eq!(setting(&t, "RLS_STATSD_ADDR"), None);
    assert!(t.unused.iter().any(|u| u.starts_with("STATSD_HOST")));
}

#[test]
fn service_wide_modes() {
    let t = translate(&env(&[
        ("SHADOW_MODE", "true"),
        ("QUOTA_MODE", "true"),
        ("RESPONSE_DYNAMIC_METADATA", "true"),
    ]))
    .expect("modes");
    for name in [
        "RLS_SHADOW_MODE",
        "RLS_QUOTA_MODE",
        "RLS_RESPONSE_DYNAMIC_METADATA",
    ] {
        assert_eq!(setting(&t, name).as_deref(), Some("true"), "{name}");
    }
    let t = translate(&env(&[("SHADOW_MODE", "false")])).expect("off");
    assert_eq!(setting(&t, "RLS_SHADOW_MODE"), None);
}

#[test]
fn response_header_names() {
    let t = translate(&env(&[
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
        ("LIMIT_REMAINING_HEADER", "X-RateLimit-Remaining"),
    ]))
    .expect("names");
    assert_eq!(
        setting(&t, "RLS_LEGACY_HEADER_NAMES").as_deref(),
        Some("RateLimit-Limit,X-RateLimit-Remaining,RateLimit-Reset")
    );
    assert_eq!(
        setting(&t, "RLS_RESPONSE_HEADERS_FORMAT").as_deref(),
        Some("legacy")
    );
}

/// TRACING_ENABLED decides: true sends spans to the OTLP endpoint (a bare
/// host:port made a URL; OTLP/HTTP, its default protocol, refused by
/// name), false keeps them off whatever OTEL_EXPORTER_OTLP_ENDPOINT says;
/// unset, OpenTelemetry's own variable turns them on.
#[test]
fn tracing_follows_tracing_enabled() {
    let endpoint = |pairs: &[(&str, &str)]| {
        setting(
            &translate(&env(pairs)).expect("translated"),
            "RLS_OTLP_ENDPOINT",
        )
    };
    assert_eq!(
        endpoint(&[
            ("TRACING_ENABLED", "true"),
            ("TRACING_EXPORTER_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317"),
        ])
        .as_deref(),
        Some("http://collector:4317")
    );
    assert_eq!(
        endpoint(&[
            ("TRACING_ENABLED", "false"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
        ]),
        None
    );
    let off = translate(&env(&[
        ("TRACING_ENABLED", "false"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
    ]))
    .expect("translated");
    assert!(
        off.unused
            .iter()
            .any(|u| u.starts_with("OTEL_EXPORTER_OTLP_ENDPOINT: tracing is off")),
        "{:?}",
        off.unused
    );
    assert_eq!(
        endpoint(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")]).as_deref(),
        Some("http://collector:4317")
    );
    let e = translate(&env(&[
        ("TRACING_ENABLED", "true"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
    ]))
    .expect_err("http is its default protocol");
    assert!(e.contains("TRACING_EXPORTER_PROTOCOL=http"), "{e}");
}

#[test]
fn a_redis_on_a_unix_socket() {
    let t = translate(&env(&[
        ("REDIS_SOCKET_TYPE", "unix"),
        ("REDIS_URL", "/var/run/redis/redis.sock"),
        ("REDIS_AUTH", "s3cret"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_REDIS_URL").as_deref(),
        Some("unix://:s3cret@/var/run/redis/redis.sock")
    );
    assert_eq!(setting(&t, "RLS_STORE").as_deref(), Some("redis"));
    for (bad, why) in [
        (
            vec![("REDIS_SOCKET_TYPE", "unix"), ("REDIS_URL", "redis.sock")],
            "absolute path",
        ),
        (
            vec![
                ("REDIS_SOCKET_TYPE", "unix"),
                ("REDIS_URL", "/r.sock"),
                ("REDIS_TYPE", "cluster"),
            ],
            "reaches one server",
        ),
        (
            vec![
                ("REDIS_SOCKET_TYPE", "unix"),
                ("REDIS_URL", "/r.sock"),
                ("REDIS_TLS", "true"),
            ],
            "not reached over TLS",
        ),
        (
            vec![("REDIS_SOCKET_TYPE", "udp"), ("REDIS_URL", "/r.sock")],
            "tcp or unix",
        ),
    ] {
        let err = translate(&env(&bad)).expect_err("refused");
        assert!(err.contains(why), "{bad:?}: {err}");
    }
}

#[test]
fn a_per_second_redis_as_envoyproxy_ratelimit_lays_it_out() {
    let t = translate(&env(&[
        ("REDIS_URL", "r:6379"),
        ("REDIS_PERSECOND", "true"),
        ("REDIS_PERSECOND_SOCKET_TYPE", "tcp"),
        ("REDIS_PERSECOND_URL", "p:6380"),
        ("REDIS_PERSECOND_AUTH", "s3"),
        ("REDIS_PERSECOND_POOL_SIZE", "3"),
        ("REDIS_PERSECOND_TIMEOUT", "20ms"),
        ("REDIS_PERSECOND_PIPELINE_WINDOW", "150us"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_REDIS_URL").as_deref(),
        Some("redis://r:6379")
    );
    assert_eq!(
        setting(&t, "RLS_REDIS_PERSECOND_URL").as_deref(),
        Some("redis://:s3@p:6380")
    );
    assert_eq!(
        setting(&t, "RLS_REDIS_PERSECOND_POOL_SIZE").as_deref(),
        Some("3")
    );
    assert_eq!(
        setting(&t, "RLS_REDIS_PERSECOND_TIMEOUT").as_deref(),
        Some("20ms")
    );
    assert_eq!(t.unused.len(), 1, "{:?}", t.unused);
    assert!(
        t.unused[0].starts_with("REDIS_PERSECOND_PIPELINE_WINDOW: the decisions queued"),
        "{:?}",
        t.unused
    );

    // their defaults: a twemproxy socket
    let t = translate(&env(&[
        ("REDIS_URL", "r:6379"),
        ("REDIS_PERSECOND", "true"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_REDIS_PERSECOND_URL").as_deref(),
        Some("unix:///var/run/nutcracker/ratelimitpersecond.sock")
    );
    // any form the main one takes, named by its own variables when wrong
    let t = translate(&env(&[
        ("REDIS_URL", "r:6379"),
        ("REDIS_PERSECOND", "true"),
        ("REDIS_PERSECOND_SOCKET_TYPE", "tcp"),
        ("REDIS_PERSECOND_TYPE", "sentinel"),
        ("REDIS_PERSECOND_URL", "m,s1:26379"),
        ("REDIS_PERSECOND_SENTINEL_AUTH", "w"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_REDIS_PERSECOND_URL").as_deref(),
        Some("redis-sentinel://s1:26379/m?sentinel_password=w")
    );
    let e = translate(&env(&[
        ("REDIS_URL", "r:6379"),
        ("REDIS_PERSECOND", "true"),
        ("REDIS_PERSECOND_SOCKET_TYPE", "tcp"),
        ("REDIS_PERSECOND_TYPE", "ring"),
        ("REDIS_PERSECOND_URL", "p:1"),
    ]))
    .expect_err("an unknown type");
    assert!(e.starts_with("REDIS_PERSECOND_TYPE=ring"), "{e}");
    // off: its variables change nothing, and say so
    let t = translate(&env(&[
        ("REDIS_URL", "r:6379"),
        ("REDIS_PERSECOND_URL", "p:1"),
    ]))
    .expect("translated");
    assert_eq!(t.unused, ["REDIS_PERSECOND_URL: REDIS_PERSECOND is off"]);
}

#[test]
fn closing_connections_on_readonly_is_named_as_always_on() {
    let t = translate(&env(&[
        ("REDIS_URL", "redis:6379"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR", "true"),
        ("REDIS_PERSECOND", "true"),
        ("REDIS_PERSECOND_URL", "/r.sock"),
        ("REDIS_PERSECOND_CLOSE_CONNECTION_ON_READONLY_ERROR", "true"),
    ]))
    .expect("translated");
    assert_eq!(t.unused.len(), 2, "{:?}", t.unused);
    assert!(
        t.unused
            .iter()
            .all(|u| u.contains("always on here: a READONLY answer has the address dialled again")),
        "{:?}",
        t.unused
    );
}

#[test]
fn an_unset_socket_type_takes_a_path_as_a_socket_and_the_rest_as_tcp() {
    // unix by default there: a path, as its default REDIS_URL is
    let t =
        translate(&env(&[("REDIS_URL", "/var/run/nutcracker/ratelimit.sock")])).expect("a path");
    assert_eq!(
        setting(&t, "RLS_REDIS_URL").as_deref(),
        Some("unix:///var/run/nutcracker/ratelimit.sock")
    );
    // host:port is reached over tcp, as it was meant, for either store
    let t = translate(&env(&[
        ("REDIS_URL", "redis:6379"),
        ("REDIS_PERSECOND", "true"),
        ("REDIS_PERSECOND_URL", "redis-ps:6379"),
    ]))
    .expect("host:port");
    assert_eq!(
        setting(&t, "RLS_REDIS_URL").as_deref(),
        Some("redis://redis:6379")
    );
    assert_eq!(
        setting(&t, "RLS_REDIS_PERSECOND_URL").as_deref(),
        Some("redis://redis-ps:6379")
    );
    // sentinels too
    let t = translate(&env(&[
        ("REDIS_URL", "redis:6379"),
        ("REDIS_PERSECOND", "true"),
        ("REDIS_PERSECOND_TYPE", "sentinel"),
        ("REDIS_PERSECOND_URL", "m,s1:26379"),
    ]))
    .expect("sentinels");
    assert_eq!(
        setting(&t, "RLS_REDIS_PERSECOND_URL").as_deref(),
        Some("redis-sentinel://s1:26379/m")
    );
}

/// STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT decides, as there: its default
/// (each descriptor spends on its own) under their environment, ours (a
/// refused request keeps nothing) when it is true; nothing said without
/// their environment.
#[test]
fn stop_cache_key_increment_decides_whether_a_refused_request_keeps_its_spending() {
    let spending = |pairs: &[(&str, &str)]| {
        let t = translate(&env(pairs)).expect("translated");
        assert!(
            !t.unused.iter().any(|u| u.contains("STOP_CACHE")),
            "it means something here: {:?}",
            t.unused
        );
        setting(&t, "RLS_PER_DESCRIPTOR_SPENDING")
    };
    let redis = ("REDIS_URL", "redis:6379");
    assert_eq!(spending(&[redis]).as_deref(), Some("true"));
    assert_eq!(
        spending(&[("RUNTIME_ROOT", "/data")]).as_deref(),
        Some("true")
    );
    for stop in ["true", "TRUE", "1"] {
        assert_eq!(
            spending(&[redis, ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", stop)]).as_deref(),
            Some("false")
        );
    }
    assert_eq!(
        spending(&[redis, ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "false")]).as_deref(),
        Some("true")
    );
    assert_eq!(
        spending(&[("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "true")]).as_deref(),
        Some("false")
    );
    assert_eq!(spending(&[]), None, "our own default holds");
}

#[test]
fn its_expiry_jitter_is_kept() {
    let t = translate(&env(&[
        ("REDIS_URL", "redis:6379"),
        ("EXPIRATION_JITTER_MAX_SECONDS", "300"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_REDIS_EXPIRATION_JITTER_MAX_SECONDS").as_deref(),
        Some("300")
    );
    assert!(t.unused.is_empty(), "{:?}", t.unused);
    // unset under its environment: its own default, 300 s
    let t = translate(&env(&[("REDIS_URL", "redis:6379")])).expect("translated");
    assert_eq!(
        setting(&t, "RLS_REDIS_EXPIRATION_JITTER_MAX_SECONDS").as_deref(),
        Some("300")
    );
    // without its environment, the service's own default stands
    let t = translate(&env(&[("GRPC_PORT", "8081")])).expect("translated");
    assert_eq!(setting(&t, "RLS_ALGORITHM"), None);
    assert_eq!(setting(&t, "RLS_REDIS_EXPIRATION_JITTER_MAX_SECONDS"), None);
}

/// Its answers carry no rate-limit header unless LIMIT_RESPONSE_HEADERS_ENABLED
/// asks for them: no `retry-after` either, under its environment.
#[test]
fn retry_after_only_with_its_response_headers() {
    let t = translate(&env(&[("REDIS_URL", "redis:6379")])).expect("translated");
    assert_eq!(setting(&t, "RLS_RETRY_AFTER").as_deref(), Some("false"));
    let t = translate(&env(&[
        ("REDIS_URL", "redis:6379"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
    ]))
    .expect("translated");
    assert_eq!(setting(&t, "RLS_RETRY_AFTER"), None);
    assert_eq!(setting(&t, "RLS_RESPONSE_HEADERS").as_deref(), Some("true"));
    // without its environment, the service's own default stands
    let t = translate(&env(&[("GRPC_PORT", "8081")])).expect("translated");
    assert_eq!(setting(&t, "RLS_RETRY_AFTER"), None);
}

/// Its environment loads its files as it does (`--ratelimit-rules`).
#[test]
fn its_files_load_as_there() {
    let t = translate(&env(&[("RUNTIME_ROOT", "/data")])).expect("translated");
    assert_eq!(setting(&t, "RLS_RATELIMIT_RULES").as_deref(), Some("true"));
    let t = translate(&env(&[("GRPC_PORT", "8081")])).expect("translated");
    assert_eq!(setting(&t, "RLS_RATELIMIT_RULES"), None);
}

/// A hash tag in CACHE_KEY_PREFIX is kept, as there; an empty one, which
/// would scatter a descriptor's keys over slots, stops the start.
#[test]
fn a_hash_tag_in_its_prefix_is_kept() {
    let t = translate(&env(&[
        ("REDIS_URL", "redis:6379"),
        ("CACHE_KEY_PREFIX", "{rl}:"),
    ]))
    .expect("translated");
    assert_eq!(
        setting(&t, "RLS_REDIS_KEY_PREFIX").as_deref(),
        Some("{rl}:")
    );
    let refused = translate(&env(&[
        ("REDIS_URL", "redis:6379"),
        ("CACHE_KEY_PREFIX", "x{}"),
    ]))
    .map(|_| ())
    .expect_err("refused")
    .to_string();
    assert!(refused.contains("CACHE_KEY_PREFIX=x{}"), "{refused}");
}
