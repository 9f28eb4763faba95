//! envoyproxy/ratelimit's environment, as our settings: the one place where
//! its variables (`src/settings/settings.go` there) become ours, so that an
//! image swap in Istio's sample (or any Deployment written for it) starts
//! this service with the same meaning and no flags.
//!
//! [`translate`] is pure: from the environment it gives the `RLS_*`
//! variables to set (the binary sets each only where the user has not set
//! it, so flags win over `RLS_*`, which win over these), the variables that
//! mean nothing here (named once in the start-up log), or an error naming
//! the variable and value for one whose meaning this service does not have
//! yet: refused rather than silently ignored.

use std::collections::BTreeMap;

/// What envoyproxy/ratelimit's environment asks of this service.
#[derive(Debug, Default, PartialEq)]
pub struct Translated {
    /// `RLS_*` (or `RUST_LOG`) variables and their values.
    pub settings: Vec<(&'static str, String)>,
    /// envoyproxy/ratelimit variables set that change nothing here, each
    /// with why.
    pub unused: Vec<String>,
}

/// Variables that only tune what this service does its own way, or belong
/// to a part it does not have (memcache, statsd while off, xDS while rules
/// come from files): accepted, and named once.
const NO_MEANING_HERE: &[(&str, &str)] = &[
    (
        "DEBUG_HOST",
        "no debug port: /metrics, /config and probes are on HOST:PORT",
    ),
    (
        "DEBUG_PORT",
        "no debug port: /metrics, /config and probes are on HOST:PORT",
    ),
    ("GRPC_MAX_CONNECTION_AGE", "connections are not aged out"),
    (
        "GRPC_MAX_CONNECTION_AGE_GRACE",
        "connections are not aged out",
    ),
    (
        "RUNTIME_WATCH_ROOT",
        "the rules directory is watched, ConfigMap swaps (..data) included",
    ),
    ("RUNTIME_IGNOREDOTFILES", "dot files are always skipped"),
    ("LOCAL_CACHE_SIZE_IN_BYTES", "no local over-limit cache"),
    (
        "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
        "ready once the rules are loaded",
    ),
    (
        "REDIS_PIPELINE_WINDOW",
        "the decisions queued for a primary go out in one write when its connection wakes, with no window to wait (batched into script calls by --redis-batch)",
    ),
    (
        "REDIS_PIPELINE_LIMIT",
        "the decisions queued for a primary go out in one write, up to 256 KB (batched into script calls of up to --redis-batch decisions)",
    ),
    (
        "REDIS_CLUSTER_PIPELINE_PARALLELISM",
        "the Redis client pipelines on its own",
    ),
    (
        "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
        "each Redis node has its own breaker and probes",
    ),
    (
        "REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR",
        "always on here: a READONLY answer has the address dialled again at once (docs/failure-modes.md)",
    ),
    (
        "REDIS_POOL_ON_EMPTY_BEHAVIOR",
        "calls share pipelined connections",
    ),
    (
        "REDIS_STARTUP_INITIAL_INTERVAL",
        "starts without Redis and reconnects on its own",
    ),
    (
        "REDIS_STARTUP_MAX_INTERVAL",
        "starts without Redis and reconnects on its own",
    ),
    (
        "REDIS_STARTUP_MAX_ELAPSED_TIME",
        "starts without Redis and reconnects on its own",
    ),
    ("STATSD_HOST", "statsd is off"),
    ("STATSD_PORT", "statsd is off"),
    ("EXTRA_TAGS", "statsd is off"),
    ("STATS_FLUSH_INTERVAL", "statsd is off"),
    ("USE_DOG_STATSD_MOGRIFIERS", "statsd is off"),
    ("PROMETHEUS_ADDR", "USE_PROMETHEUS is off"),
    ("PROMETHEUS_PATH", "USE_PROMETHEUS is off"),
    ("PROMETHEUS_MAPPER_YAML", "USE_PROMETHEUS is off"),
    (
        "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
        "USE_PROMETHEUS is off",
    ),
    ("TRACING_SERVICE_NAME", "tracing is off"),
    ("TRACING_SERVICE_NAMESPACE", "tracing is off"),
    ("TRACING_SERVICE_INSTANCE_ID", "tracing is off"),
    ("TRACING_SAMPLING_RATE", "tracing is off"),
    ("TRACING_EXPORTER_PROTOCOL", "tracing is off"),
];

/// Prefixes of variable families with no meaning here.
const NO_MEANING_PREFIXES: &[(&str, &str)] = &[
    ("MEMCACHE_", "no memcache backend"),
    (
        "CONFIG_GRPC_XDS_",
        "rules come from files (CONFIG_TYPE=FILE)",
    ),
    ("XDS_CLIENT_", "rules come from files (CONFIG_TYPE=FILE)"),
    ("REDIS_PERSECOND_", "REDIS_PERSECOND is off"),
];

fn is_true(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "true" | "1" | "t" | "yes"
    )
}

fn refused(name: &str, value: &str, why: &str) -> String {
    format!("{name}={value}: {why} (unset it, or see docs/replacing-ratelimit.md)")
}

/// An OTLP endpoint as a URL: `host:port` (which OpenTelemetry's Go
/// exporter takes) gets `http://`.
fn otlp_url(endpoint: &str) -> String {
    if endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    }
}

/// The variables of one Redis in envoyproxy/ratelimit's environment.
struct RedisVars {
    prefix: &'static str,
}

impl RedisVars {
    const MAIN: Self = Self { prefix: "REDIS_" };
    const PER_SECOND: Self = Self {
        prefix: "REDIS_PERSECOND_",
    };

    fn name(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }
}

/// The Redis URL of envoyproxy/ratelimit's variables `v` (`REDIS_*`, or
/// `REDIS_PERSECOND_*`), `url` being its `_URL`. Its `_SOCKET_TYPE` unset
/// (unix there by default), a path is a unix socket and anything else
/// (`host:port`, a list, a URL) is reached over tcp, as it was meant.
fn redis_url<'a>(
    v: &RedisVars,
    url: &'a str,
    get: &dyn Fn(&str) -> Option<&'a str>,
    on: &dyn Fn(&str) -> bool,
) -> Result<String, String> {
    let unix = match get(&v.name("SOCKET_TYPE")) {
        None => url.starts_with('/') || url.starts_with("unix://"),
        Some(t) if t.eq_ignore_ascii_case("tcp") => false,
        Some(t) if t.eq_ignore_ascii_case("unix") => true,
        Some(t) => {
            return Err(refused(
                &v.name("SOCKET_TYPE"),
                t,
                "Redis is reached over tcp or unix",
            ))
        }
    };
    let sentinel = get(&v.name("TYPE")).is_some_and(|k| k.eq_ignore_ascii_case("sentinel"));
    if let (Some(_), false) = (get(&v.name("SENTINEL_AUTH")), sentinel) {
        return Err(refused(
            &v.name("SENTINEL_AUTH"),
            "***",
            &format!(
                "the sentinels' credentials, with {}=sentinel only",
                v.name("TYPE")
            ),
        ));
    }
    Ok(if unix {
        unix_url(v, url, get, on)?
    } else if sentinel {
        sentinel_url(v, url, get, on)?
    } else {
        let kind = get(&v.name("TYPE")).map(str::to_ascii_lowercase);
        let mut cluster = match kind.as_deref() {
            None | Some("single") => false,
            Some("cluster") => true,
            Some(other) => {
                return Err(refused(
                    &v.name("TYPE"),
                    other,
                    "Redis is single, cluster or sentinel",
                ))
            }
        };
        let mut tls = on(&v.name("TLS"));
        // a URL with a scheme: REDIS_TYPE, REDIS_TLS and REDIS_AUTH apply to
        // it too, or the start is refused naming the conflict
        let (mut hosts, mut has_auth) = (url, false);
        if let Some((scheme, rest)) = url.split_once("://") {
            let (scheme_tls, scheme_cluster) = match scheme {
                "redis" => (false, false),
                "rediss" => (true, false),
                "redis-cluster" => (false, true),
                "rediss-cluster" => (true, true),
                other => {
                    let why = format!(
                        "the scheme {other}:// is not redis://, rediss://, \
                         redis-cluster:// or rediss-cluster:// (or give host:port)"
                    );
                    let shown = crate::store::redis::url::redact(url);
                    return Err(refused(&v.name("URL"), &shown, &why));
                }
            };
            // redis:// is also what one writes for a cluster's seed node
            if kind.as_deref() == Some("single") && scheme_cluster {
                return Err(refused(
                    &v.name("TYPE"),
                    get(&v.name("TYPE")).unwrap_or_default(),
                    &format!("{}'s scheme {scheme}:// says otherwise", v.name("URL")),
                ));
            }
            if get(&v.name("TLS")).is_some() && !tls && scheme_tls {
                return Err(refused(
                    &v.name("TLS"),
                    get(&v.name("TLS")).unwrap_or_default(),
                    &format!("{}'s scheme {scheme}:// is TLS", v.name("URL")),
                ));
            }
            cluster |= scheme_cluster;
            tls |= scheme_tls;
            hosts = rest;
            has_auth = rest.contains('@');
        }
        let scheme = match (cluster, tls) {
            (false, false) => "redis",
            (false, true) => "rediss",
            (true, false) => "redis-cluster",
            (true, true) => "rediss-cluster",
        };
        let auth = match get(&v.name("AUTH")) {
            None => String::new(),
            Some(_) if has_auth => {
                return Err(refused(
                    &v.name("AUTH"),
                    "***",
                    &format!(
                        "{} carries its own user:password@; give one of them",
                        v.name("URL")
                    ),
                ))
            }
            Some(a) => userinfo_of(a),
        };
        format!("{scheme}://{auth}{hosts}")
    })
}

/// Percent-encodes what may not stand in a URL's user information.
/// envoyproxy/ratelimit's `REDIS_SOCKET_TYPE=unix`: `REDIS_URL` is the
/// socket's path (or our `unix://` URL), `REDIS_AUTH` its credentials; a
/// socket reaches one server, without TLS.
fn unix_url<'a>(
    v: &RedisVars,
    url: &'a str,
    get: &dyn Fn(&str) -> Option<&'a str>,
    on: &dyn Fn(&str) -> bool,
) -> Result<String, String> {
    if let Some(kind) = get(&v.name("TYPE")).filter(|k| !k.eq_ignore_ascii_case("single")) {
        return Err(refused(
            &v.name("TYPE"),
            kind,
            &format!(
                "a unix socket ({}=unix) reaches one server",
                v.name("SOCKET_TYPE")
            ),
        ));
    }
    if on(&v.name("TLS")) {
        return Err(refused(
            &v.name("TLS"),
            "true",
            &format!(
                "a unix socket ({}=unix) is not reached over TLS here",
                v.name("SOCKET_TYPE")
            ),
        ));
    }
    let path = url.strip_prefix("unix://").unwrap_or(url);
    let (own_auth, path) = match path.split_once('@') {
        Some((auth, path)) => (Some(auth), path),
        None => (None, path),
    };
    if !path.starts_with('/') {
        return Err(refused(
            &v.name("URL"),
            url,
            &format!(
                "with {}=unix, {} is the socket's absolute path",
                v.name("SOCKET_TYPE"),
                v.name("URL")
            ),
        ));
    }
    let auth = match (get(&v.name("AUTH")), own_auth) {
        (Some(_), Some(_)) => {
            return Err(refused(
                &v.name("AUTH"),
                "***",
                &format!(
                    "{} carries its own user:password@; give one of them",
                    v.name("URL")
                ),
            ))
        }
        (None, None) => String::new(),
        (None, Some(own)) => format!("{own}@"),
        (Some(a), None) => userinfo_of(a),
    };
    Ok(format!("unix://{auth}{path}"))
}

/// `REDIS_TYPE=sentinel`: `REDIS_URL` is `master-name,host:port[,…]` (the
/// sentinels), `REDIS_AUTH` the servers' credentials, `REDIS_SENTINEL_AUTH`
/// (`password` or `user:password`) the sentinels', `REDIS_TLS` for both.
fn sentinel_url<'a>(
    v: &RedisVars,
    url: &'a str,
    get: &dyn Fn(&str) -> Option<&'a str>,
    on: &dyn Fn(&str) -> bool,
) -> Result<String, String> {
    let form = &format!("with {}=sentinel, {} is master-name,host:port[,host:port…] (the master's name, then the sentinels)", v.name("TYPE"), v.name("URL"));
    if url.contains("://") || url.contains('@') {
        return Err(refused(
            &v.name("URL"),
            &crate::store::redis::url::redact(url),
            form,
        ));
    }
    let mut parts = url.split(',').map(str::trim).filter(|p| !p.is_empty());
    let master = parts.next().unwrap_or_default();
    let sentinels: Vec<&str> = parts.collect();
    if master.contains(':') || sentinels.is_empty() {
        return Err(refused(&v.name("URL"), url, form));
    }
    let scheme = if on(&v.name("TLS")) {
        "rediss-sentinel"
    } else {
        "redis-sentinel"
    };
    let auth = get(&v.name("AUTH")).map(userinfo_of).unwrap_or_default();
    let query = match get(&v.name("SENTINEL_AUTH")).map(credentials) {
        None => String::new(),
        Some((Some(user), password)) => {
            format!("?sentinel_username={user}&sentinel_password={password}")
        }
        Some((None, password)) => format!("?sentinel_password={password}"),
    };
    Ok(format!(
        "{scheme}://{auth}{}/{}{query}",
        sentinels.join(","),
        userinfo(master)
    ))
}

/// `password` or `user:password` (as `REDIS_AUTH` is written), each
/// percent-encoded.
fn credentials(auth: &str) -> (Option<String>, String) {
    match auth.split_once(':') {
        Some((user, password)) => (Some(userinfo(user)), userinfo(password)),
        None => (None, userinfo(auth)),
    }
}

/// A URL's user information from `password` or `user:password`, with its `@`.
fn userinfo_of(auth: &str) -> String {
    match credentials(auth) {
        (Some(user), password) => format!("{user}:{password}@"),
        (None, password) => format!(":{password}@"),
    }
}

fn userinfo(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// envoyproxy/ratelimit's variables in `env` as ours; see the module doc.
pub fn translate(env: &BTreeMap<String, String>) -> Result<Translated, String> {
    let get = |name: &str| env.get(name).map(String::as_str).filter(|v| !v.is_empty());
    let on = |name: &str| get(name).is_some_and(is_true);
    let mut out = Translated::default();
    let mut set = |name: &'static str, value: String| out.settings.push((name, value));

    // rules over xDS (state of the world), as Envoy Gateway deploys it
    let xds = match get("CONFIG_TYPE") {
        None => false,
        Some(v) if v.eq_ignore_ascii_case("FILE") => false,
        Some(v) if v.eq_ignore_ascii_case("GRPC_XDS_SOTW") => true,
        Some(v) => {
            return Err(refused(
                "CONFIG_TYPE",
                v,
                "rules come from files (FILE) or over xDS (GRPC_XDS_SOTW)",
            ))
        }
    };
    if xds {
        let tls = on("CONFIG_GRPC_XDS_SERVER_USE_TLS");
        let server = get("CONFIG_GRPC_XDS_SERVER_URL").unwrap_or("localhost:18000");
        let url = if let Some(rest) = server.strip_prefix("http://").filter(|_| tls) {
            // USE_TLS is honoured whatever the scheme says
            format!("https://{rest}")
        } else if server.contains("://") {
            server.to_string()
        } else if tls {
            format!("https://{server}")
        } else {
            format!("http://{server}")
        };
        set("RLS_XDS_SERVER", url);
        set(
            "RLS_XDS_NODE_ID",
            get("CONFIG_GRPC_XDS_NODE_ID")
                .unwrap_or("default")
                .to_string(),
        );
        for (theirs, ours) in [
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "RLS_XDS_CA_FILE"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "RLS_XDS_CLIENT_CERT"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "RLS_XDS_CLIENT_KEY"),
            ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "RLS_XDS_BACKOFF"),
            ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "RLS_XDS_MAX_BACKOFF"),
            ("CONFIG_GRPC_XDS_NODE_METADATA", "RLS_XDS_NODE_METADATA"),
            (
                "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
                "RLS_XDS_HEADERS",
            ),
            ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "RLS_XDS_SERVER_NAME"),
            (
                "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
                "RLS_XDS_MAX_MESSAGE_SIZE",
            ),
        ] {
            if let Some(v) = get(theirs) {
                set(ours, v.to_string());
            }
        }
        if on("FORCE_START_WITHOUT_INITIAL_CONFIG") {
            set("RLS_XDS_READY_WITHOUT_RULES", "true".into());
        }
    }
    // gRPC on a unix socket instead of GRPC_HOST:GRPC_PORT, as there
    if let Some(v) = get("GRPC_UDS") {
        // Go listens on a path or, for @name, an abstract socket (Linux)
        let abstract_name = v.len() > 1 && v.starts_with('@');
        if !v.starts_with('/') && !abstract_name {
            return Err(refused(
                "GRPC_UDS",
                v,
                "the socket's absolute path, e.g. /var/run/ratelimit/ratelimit.sock, or @name (an abstract socket)",
            ));
        }
        set("RLS_GRPC_UDS", v.to_string());
    }
    if let Some(v) = get("BACKEND_TYPE").filter(|v| !v.eq_ignore_ascii_case("redis")) {
        return Err(refused(
            "BACKEND_TYPE",
            v,
            "the stores are Redis and this process's memory",
        ));
    }
    for (name, why) in [
        (
            "USE_DOG_STATSD",
            "DogStatsD tags are not sent: plain statsd (USE_STATSD=true) or Prometheus (USE_PROMETHEUS=true, or /metrics on HOST:PORT)",
        ),
    ] {
        if on(name) {
            return Err(refused(name, get(name).unwrap_or_default(), why));
        }
    }
    if on("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION") {
        set(
            "RLS_REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
            "true".to_string(),
        );
    }
    if let Some(prefix) = get("CACHE_KEY_PREFIX") {
        // a brace is kept, as there: the store routes each key to the slot
        // Redis finds for it; an empty `{}` would scatter them
        if crate::store::redis::empty_hash_tag(prefix) {
            return Err(refused(
                "CACHE_KEY_PREFIX",
                prefix,
                "an empty hash tag `{}` makes Redis Cluster hash each key whole, putting one descriptor's keys in different slots",
            ));
        }
        set("RLS_REDIS_KEY_PREFIX", prefix.to_string());
    }
    let names = [
        ("LIMIT_LIMIT_HEADER", "RateLimit-Limit"),
        ("LIMIT_REMAINING_HEADER", "RateLimit-Remaining"),
        ("LIMIT_RESET_HEADER", "RateLimit-Reset"),
    ];
    if names.iter().any(|(name, _)| get(name).is_some()) {
        for (name, _) in names {
            if let Some(v) = get(name).filter(|v| v.contains(',')) {
                return Err(refused(name, v, "a header name has no comma"));
            }
        }
        let names: Vec<&str> = names
            .iter()
            .map(|(name, default)| get(name).unwrap_or(default))
            .collect();
        set("RLS_LEGACY_HEADER_NAMES", names.join(","));
    }

    // addresses (Istio's sample listens on "::")
    let addr = |host: &str, port: &str| {
        if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        }
    };
    if get("HOST").is_some() || get("PORT").is_some() {
        let host = get("HOST").unwrap_or("0.0.0.0");
        set("RLS_ADMIN_ADDR", addr(host, get("PORT").unwrap_or("8080")));
    }
    if get("GRPC_HOST").is_some() || get("GRPC_PORT").is_some() {
        let host = get("GRPC_HOST").unwrap_or("0.0.0.0");
        set(
            "RLS_GRPC_ADDR",
            addr(host, get("GRPC_PORT").unwrap_or("8081")),
        );
    }

    // logs
    if let Some(level) = get("LOG_LEVEL") {
        let level = level.to_ascii_lowercase();
        let level = match level.as_str() {
            "trace" | "debug" | "info" | "warn" | "error" => level,
            "warning" => "warn".into(),
            "fatal" | "panic" => "error".into(),
            other => {
                return Err(refused(
                    "LOG_LEVEL",
                    other,
                    "not one of trace, debug, info, warn, error",
                ))
            }
        };
        // their LOG_LEVEL is the service's own; libraries stay at info
        let filter = match level.as_str() {
            "trace" | "debug" => format!("info,tokenbucket_rls={level},fred=error"),
            _ => format!("{level},fred=error"),
        };
        set("RUST_LOG", filter);
    }
    if let Some(format) = get("LOG_FORMAT") {
        match format.to_ascii_lowercase().as_str() {
            "json" => set("RLS_LOG_FORMAT", "json".into()),
            "text" => set("RLS_LOG_FORMAT", "text".into()),
            other => return Err(refused("LOG_FORMAT", other, "not text or json")),
        }
    }

    // rules: RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY
    if get("RUNTIME_ROOT").is_some() || get("RUNTIME_SUBDIRECTORY").is_some() {
        let mut path =
            std::path::PathBuf::from(get("RUNTIME_ROOT").unwrap_or("/srv/runtime_data/current"));
        if let Some(sub) = get("RUNTIME_SUBDIRECTORY") {
            path.push(sub);
        }
        path.push(get("RUNTIME_APPDIRECTORY").unwrap_or("config"));
        set("RLS_CONFIG", path.display().to_string());
    }
    for (theirs, ours) in [
        ("SHADOW_MODE", "RLS_SHADOW_MODE"),
        ("QUOTA_MODE", "RLS_QUOTA_MODE"),
        ("RESPONSE_DYNAMIC_METADATA", "RLS_RESPONSE_DYNAMIC_METADATA"),
    ] {
        if on(theirs) {
            set(ours, "true".into());
        }
    }
    if on("MERGE_DOMAIN_CONFIG") {
        set("RLS_MERGE_DOMAINS", "true".into());
    }
    // its choice holds: by default each descriptor spends on its own
    // there; STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true keeps nothing of
    // a refused request, our own default
    let theirs = ["REDIS_URL", "RUNTIME_ROOT", "CONFIG_TYPE", "USE_STATSD"]
        .iter()
        .any(|v| get(v).is_some());
    if get("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT").is_some() || theirs {
        let stop = on("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT");
        set("RLS_PER_DESCRIPTOR_SPENDING", (!stop).to_string());
    }
    // its counting: a rule that names no algorithm counts a fixed window,
    // in its keys on Redis (docs/replacing-ratelimit.md, "One budget
    // across the swap"); `RLS_ALGORITHM=token_bucket` or `algorithm:` on
    // a rule is the step to token buckets
    if theirs {
        set("RLS_ALGORITHM", "fixed_window".into());
        // its files load as there (what it ignores said in a warning)
        set("RLS_RATELIMIT_RULES", "true".into());
    }
    // its default when unset is 300 s (settings.go), not ours (0)
    match get("EXPIRATION_JITTER_MAX_SECONDS") {
        Some(v) => set("RLS_REDIS_EXPIRATION_JITTER_MAX_SECONDS", v.to_string()),
        None if theirs => set("RLS_REDIS_EXPIRATION_JITTER_MAX_SECONDS", "300".into()),
        None => {}
    }

    // Redis
    if let Some(url) = get("REDIS_URL") {
        let url = redis_url(&RedisVars::MAIN, url, &get, &on)?;
        set("RLS_STORE", "redis".into());
        set("RLS_REDIS_URL", url);
        // as envoyproxy/ratelimit: a store failure is answered with an
        // error, and Envoy decides (`failure_mode_deny`); a rule's own
        // `failure_mode` still wins
        set("RLS_FAILURE_MODE", "closed".into());
        if let Some(size) = get("REDIS_POOL_SIZE") {
            set("RLS_REDIS_POOL_SIZE", size.to_string());
        }
        if let Some(t) = get("REDIS_TIMEOUT") {
            set("RLS_REDIS_TIMEOUT", t.to_string());
        }
        for (theirs, ours) in [
            ("REDIS_TLS_CACERT", "RLS_REDIS_CA_FILE"),
            ("REDIS_TLS_CLIENT_CERT", "RLS_REDIS_CLIENT_CERT"),
            ("REDIS_TLS_CLIENT_KEY", "RLS_REDIS_CLIENT_KEY"),
        ] {
            if let Some(v) = get(theirs) {
                set(ours, v.to_string());
            }
        }
    }

    // a second Redis for per-second limits; its socket type defaults to
    // unix and its URL to a twemproxy socket there, as in
    // envoyproxy/ratelimit's settings
    if on("REDIS_PERSECOND") {
        if get("REDIS_URL").is_none() {
            return Err(refused(
                "REDIS_PERSECOND",
                "true",
                "the per-second Redis sits beside the main one: set REDIS_URL too",
            ));
        }
        let url =
            get("REDIS_PERSECOND_URL").unwrap_or("/var/run/nutcracker/ratelimitpersecond.sock");
        set(
            "RLS_REDIS_PERSECOND_URL",
            redis_url(&RedisVars::PER_SECOND, url, &get, &on)?,
        );
        if let Some(size) = get("REDIS_PERSECOND_POOL_SIZE") {
            set("RLS_REDIS_PERSECOND_POOL_SIZE", size.to_string());
        }
        if let Some(t) = get("REDIS_PERSECOND_TIMEOUT") {
            set("RLS_REDIS_PERSECOND_TIMEOUT", t.to_string());
        }
    }

    // TLS on the gRPC port, and client certificates
    let client_ca = get("GRPC_CLIENT_TLS_CACERT").or(get("GRPC_SERVER_TLS_CA_CERT"));
    if let (Some(san), false) = (
        get("GRPC_CLIENT_TLS_SAN"),
        on("GRPC_SERVER_USE_TLS") && client_ca.is_some(),
    ) {
        return Err(refused(
            "GRPC_CLIENT_TLS_SAN",
            san,
            "a client certificate's SAN is checked with mTLS only: set GRPC_SERVER_USE_TLS and GRPC_CLIENT_TLS_CACERT too",
        ));
    }
    if on("GRPC_SERVER_USE_TLS") {
        let (Some(cert), Some(key)) = (get("GRPC_SERVER_TLS_CERT"), get("GRPC_SERVER_TLS_KEY"))
        else {
            return Err(refused(
                "GRPC_SERVER_USE_TLS",
                "true",
                "needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY",
            ));
        };
        set("RLS_TLS_CERT", cert.to_string());
        set("RLS_TLS_KEY", key.to_string());
        // Envoy Gateway names the client CA GRPC_SERVER_TLS_CA_CERT
        if let Some(ca) = client_ca {
            set("RLS_TLS_CLIENT_CA", ca.to_string());
            if let Some(san) = get("GRPC_CLIENT_TLS_SAN") {
                set("RLS_TLS_CLIENT_SAN", san.to_string());
            }
        }
    }

    // metrics under its names, where it serves them
    if on("USE_PROMETHEUS") {
        set("RLS_RATELIMIT_METRICS", "true".into());
        let addr = get("PROMETHEUS_ADDR").unwrap_or(":9090");
        let addr = match addr.strip_prefix(':') {
            Some(port) => format!("0.0.0.0:{port}"),
            None => addr.to_string(),
        };
        set("RLS_PROMETHEUS_ADDR", addr);
        if let Some(path) = get("PROMETHEUS_PATH") {
            set("RLS_PROMETHEUS_PATH", path.to_string());
        }
    }
    // the same stats over statsd (on by default there; off unless set here)
    if on("USE_STATSD") {
        let host = get("STATSD_HOST").unwrap_or("localhost");
        let port = get("STATSD_PORT").unwrap_or("8125");
        set("RLS_STATSD_ADDR", addr(host, port));
        if let Some(every) = get("STATS_FLUSH_INTERVAL") {
            set("RLS_STATSD_FLUSH_INTERVAL", every.to_string());
        }
    }
    if let Some(ratio) = get("NEAR_LIMIT_RATIO") {
        set("RLS_NEAR_LIMIT_RATIO", ratio.to_string());
    }

    // response headers
    if on("LIMIT_RESPONSE_HEADERS_ENABLED") {
        set("RLS_RESPONSE_HEADERS", "true".into());
        set("RLS_RESPONSE_HEADERS_FORMAT", "legacy".into());
    } else if theirs {
        // its answers carry no rate-limit header unless asked to
        set("RLS_RETRY_AFTER", "false".into());
    }

    // traces: envoyproxy/ratelimit's TRACING_ENABLED decides where it is
    // set; elsewhere OpenTelemetry's own variable turns them on
    let endpoint = get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or(get("OTEL_EXPORTER_OTLP_ENDPOINT"));
    match get("TRACING_ENABLED") {
        Some(_) if on("TRACING_ENABLED") => {
            // its default protocol is OTLP/HTTP; ours is OTLP/gRPC only
            let protocol = get("TRACING_EXPORTER_PROTOCOL").unwrap_or("http");
            if !protocol.eq_ignore_ascii_case("grpc") {
                return Err(refused(
                    "TRACING_EXPORTER_PROTOCOL",
                    protocol,
                    "traces are exported over OTLP/gRPC only (its default is http): set TRACING_EXPORTER_PROTOCOL=grpc and point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's gRPC port (4317)",
                ));
            }
            let Some(endpoint) = endpoint else {
                return Err(refused(
                    "TRACING_ENABLED",
                    "true",
                    "needs OTEL_EXPORTER_OTLP_ENDPOINT",
                ));
            };
            set("RLS_OTLP_ENDPOINT", otlp_url(endpoint));
        }
        // TRACING_ENABLED=false: off, whatever the endpoint says
        Some(_) => {}
        None => {
            if let Some(endpoint) = endpoint {
                set("RLS_OTLP_ENDPOINT", otlp_url(endpoint));
            }
        }
    }

    // the rest: accepted, and named
    for (name, value) in env {
        if value.is_empty() {
            continue;
        }
        let why = NO_MEANING_HERE
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, why)| *why)
            .or_else(|| {
                NO_MEANING_PREFIXES
                    .iter()
                    .find(|(p, _)| name.starts_with(p))
                    .map(|(_, why)| *why)
            });
        // with tracing on, its settings are read above or take defaults
        if name.starts_with("TRACING_") && on("TRACING_ENABLED") {
            let why = match name.as_str() {
                "TRACING_ENABLED" | "TRACING_EXPORTER_PROTOCOL" => continue,
                "TRACING_SAMPLING_RATE" => "every call is traced (sample in the collector)",
                _ => "spans carry service.name tokenbucket-rls",
            };
            out.unused.push(format!("{name}: {why}"));
            continue;
        }
        if name.starts_with("OTEL_EXPORTER_OTLP_")
            && get("TRACING_ENABLED").is_some()
            && !on("TRACING_ENABLED")
        {
            out.unused.push(format!(
                "{name}: tracing is off (TRACING_ENABLED={})",
                get("TRACING_ENABLED").unwrap_or_default()
            ));
            continue;
        }
        // with xDS on, its settings are read above
        if xds && (name.starts_with("CONFIG_GRPC_XDS_") || name.starts_with("XDS_CLIENT_")) {
            let why = match name.as_str() {
                "XDS_CLIENT_BACKOFF_RANDOM_FACTOR" | "XDS_CLIENT_BACKOFF_JITTER" => {
                    "the wait doubles without jitter"
                }
                _ => continue,
            };
            out.unused.push(format!("{name}: {why}"));
            continue;
        }
        if name == "FORCE_START_WITHOUT_INITIAL_CONFIG" && !xds {
            out.unused
                .push(format!("{name}: rules come from files (CONFIG_TYPE=FILE)"));
            continue;
        }
        let why = match name.as_str() {
            "PROMETHEUS_MAPPER_YAML" if on("USE_PROMETHEUS") => {
                Some("the default mapping's names are used (ratelimit_service_rate_limit_*)")
            }
            "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS" if on("USE_PROMETHEUS") => {
                Some("response times are rls_decision_duration_seconds")
            }
            "PROMETHEUS_ADDR" | "PROMETHEUS_PATH" if on("USE_PROMETHEUS") => None,
            "STATSD_HOST" | "STATSD_PORT" | "STATS_FLUSH_INTERVAL" if on("USE_STATSD") => None,
            "EXTRA_TAGS" if on("USE_STATSD") => {
                Some("statsd lines carry no tags (plain statsd, as without EXTRA_TAGS)")
            }
            "USE_STATSD" => None,
            // the per-second Redis's: read above, or as the main one's
            n if on("REDIS_PERSECOND") && n.starts_with("REDIS_PERSECOND_") => {
                match &n["REDIS_PERSECOND_".len()..] {
                    "URL" | "SOCKET_TYPE" | "TYPE" | "AUTH" | "TLS" | "SENTINEL_AUTH"
                    | "POOL_SIZE" | "TIMEOUT" => None,
                    rest => Some(
                        NO_MEANING_HERE
                            .iter()
                            .find(|(n, _)| n.strip_prefix("REDIS_") == Some(rest))
                            .map_or("not read for the per-second Redis", |(_, why)| *why),
                    ),
                }
            }
            _ => why,
        };
        if let Some(why) = why {
            out.unused.push(format!("{name}: {why}"));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;

/// Which of envoyproxy/ratelimit's variables each of ours is made from,
/// where a value could be refused by our flag's parser.
const ORIGINS: &[(&str, &[&str])] = &[
    ("RLS_REDIS_TIMEOUT", &["REDIS_TIMEOUT"]),
    ("RLS_REDIS_POOL_SIZE", &["REDIS_POOL_SIZE"]),
    ("RLS_REDIS_PERSECOND_TIMEOUT", &["REDIS_PERSECOND_TIMEOUT"]),
    (
        "RLS_REDIS_PERSECOND_POOL_SIZE",
        &["REDIS_PERSECOND_POOL_SIZE"],
    ),
    (
        "RLS_REDIS_URL",
        &["REDIS_URL", "REDIS_AUTH", "REDIS_TYPE", "REDIS_TLS"],
    ),
    ("RLS_REDIS_KEY_PREFIX", &["CACHE_KEY_PREFIX"]),
    (
        "RLS_REDIS_EXPIRATION_JITTER_MAX_SECONDS",
        &["EXPIRATION_JITTER_MAX_SECONDS"],
    ),
    (
        "RLS_ALGORITHM",
        &["REDIS_URL", "RUNTIME_ROOT", "CONFIG_TYPE", "USE_STATSD"],
    ),
    ("RLS_XDS_SERVER", &["CONFIG_GRPC_XDS_SERVER_URL"]),
    ("RLS_XDS_BACKOFF", &["XDS_CLIENT_BACKOFF_INITIAL_INTERVAL"]),
    ("RLS_XDS_MAX_BACKOFF", &["XDS_CLIENT_BACKOFF_MAX_INTERVAL"]),
    (
        "RLS_XDS_MAX_MESSAGE_SIZE",
        &["XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES"],
    ),
    ("RLS_XDS_NODE_METADATA", &["CONFIG_GRPC_XDS_NODE_METADATA"]),
    (
        "RLS_XDS_HEADERS",
        &["CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS"],
    ),
    ("RLS_STATSD_ADDR", &["STATSD_HOST", "STATSD_PORT"]),
    ("RLS_STATSD_FLUSH_INTERVAL", &["STATS_FLUSH_INTERVAL"]),
    ("RLS_NEAR_LIMIT_RATIO", &["NEAR_LIMIT_RATIO"]),
    ("RLS_ADMIN_ADDR", &["HOST", "PORT"]),
    ("RLS_GRPC_ADDR", &["GRPC_HOST", "GRPC_PORT"]),
    ("RLS_PROMETHEUS_ADDR", &["PROMETHEUS_ADDR"]),
    ("RLS_OTLP_ENDPOINT", &["OTEL_EXPORTER_OTLP_ENDPOINT"]),
];

/// A command-line error about a value that came from envoyproxy/ratelimit's
/// environment (`translated`: our variables set from theirs), told with
/// the variable the user set: `REDIS_TIMEOUT=10: …`. `None` for any other
/// error (clap's own text names the flag or variable the user set).
pub fn name_their_variable(
    e: &clap::Error,
    translated: &[&str],
    env: &BTreeMap<String, String>,
) -> Option<String> {
    let arg = e.get(clap::error::ContextKind::InvalidArg)?.to_string();
    let flag = arg.split_whitespace().next()?.strip_prefix("--")?;
    let ours = format!("RLS_{}", flag.replace('-', "_").to_ascii_uppercase());
    if !translated.contains(&ours.as_str()) {
        return None;
    }
    let theirs: Vec<String> = ORIGINS
        .iter()
        .find(|(name, _)| *name == ours)
        .map(|(_, theirs)| *theirs)
        .unwrap_or_default()
        .iter()
        .filter_map(|name| env.get(*name).map(|v| format!("{name}={v}")))
        .collect();
    let why = e
        .to_string()
        .lines()
        .next()
        .unwrap_or_default()
        .trim_start_matches("error: ")
        .to_string();
    let source = if theirs.is_empty() {
        "envoyproxy/ratelimit's environment".to_string()
    } else {
        theirs.join(", ")
    };
    Some(format!(
        "{source} (envoyproxy/ratelimit's environment, read as --{flag}): {why}"
    ))
}
