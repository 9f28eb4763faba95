//! The command line (docs/architecture.md §2): every flag has an environment twin.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `server`; names the settings of the rooms below it: `service`,
//! `quota`, `store`, `rules`, `sources::xds`, `telemetry`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

pub mod inspect;
pub mod ratelimit_env;

use crate::bucket::Algorithm;
use crate::rules::FailureMode;
use crate::telemetry::tracing::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "tokenbucket-rls",
    version,
    about = "Envoy rate-limit service with token buckets",
    after_help = "Every flag has an RLS_* environment variable (shown as [env: ...]). \
envoyproxy/ratelimit's environment (REDIS_URL, CONFIG_TYPE, USE_STATSD, ...) is read too, \
as the RLS_* variables it maps to: flags win over RLS_* variables, which win over it. \
A variable of its that this service cannot honour stops the start, naming it; one that \
changes nothing here is named in the start-up log. See \
docs/replacing-ratelimit.md."
)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// The most `--calendar-clock-offset` may move the calendar's clock: 100
/// years of seconds.
pub const MAX_CALENDAR_OFFSET_SECS: i64 = 100 * 365 * 86_400;

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Load and validate rules as the server would; print every error as `FILE: message`.
    CheckConfig {
        /// A rules file or a directory of *.yaml / *.yml files.
        path: PathBuf,
        /// One domain may span several files.
        #[arg(long, env = "RLS_MERGE_DOMAINS")]
        merge_domains: bool,
        /// How a rule that names no algorithm counts, as the server's
        /// --algorithm.
        #[arg(long, env = "RLS_ALGORITHM", default_value = "token_bucket", value_parser = parse_algorithm)]
        algorithm: Algorithm,
        /// Load what envoyproxy/ratelimit loads, as the server's
        /// --ratelimit-rules; what is ignored is printed as a warning.
        #[arg(long, env = "RLS_RATELIMIT_RULES")]
        ratelimit_rules: bool,
        /// Also print what RLQS assigns the buckets of each rule (the bucket
        /// id keys that reach it) and where it differs from ShouldRateLimit.
        #[arg(long)]
        rlqs: bool,
    },
    /// Show a descriptor's buckets on a running service, spending nothing
    /// (its admin port's /v1/buckets): the rule, what a next hit would
    /// get, debts, reservations and slots held, the keys in the store;
    /// --reset gives the descriptor its budget back (counted and logged).
    /// With --redis-url and --config: straight against Redis, no service.
    Inspect {
        /// The service's admin port, http://host:port.
        #[arg(long, default_value = "http://127.0.0.1:9090")]
        admin: String,
        /// Read Redis itself instead of asking a service (redis://,
        /// rediss://, redis-cluster://, as the service's --redis-url), with
        /// the rules of --config.
        #[arg(long, requires = "config")]
        redis_url: Option<String>,
        /// With --redis-url: the rules file or directory the service runs.
        #[arg(long, requires = "redis_url")]
        config: Option<PathBuf>,
        /// With --redis-url: the service's --redis-key-prefix.
        #[arg(long, env = "RLS_REDIS_KEY_PREFIX", default_value = "")]
        redis_key_prefix: String,
        /// With --redis-url: a file holding the Redis password (or
        /// `user:password` for an ACL user), as the service's.
        #[arg(long, env = "RLS_REDIS_PASSWORD_FILE")]
        redis_password_file: Option<PathBuf>,
        /// With --redis-url: the algorithm of rules that name none, as
        /// the service's RLS_ALGORITHM.
        #[arg(long, env = "RLS_ALGORITHM", default_value = "token_bucket", value_parser = parse_algorithm)]
        algorithm: Algorithm,
        #[arg(long)]
        domain: String,
        /// The descriptor's entries: key=value,key=value.
        #[arg(long)]
        descriptor: String,
        /// Forget the descriptor's buckets: full again, a window's count 0.
        #[arg(long)]
        reset: bool,
        /// The bearer token (the service's --admin-token-file).
        #[arg(long, env = "RLS_ADMIN_TOKEN_FILE")]
        token_file: Option<PathBuf>,
        /// Who asks, in the service's log of a reset (default: $USER).
        #[arg(long, env = "USER")]
        operator: Option<String>,
    },
}

/// `k1:v1,k2=v2` (envoyproxy/ratelimit's form for xDS node metadata and
/// headers), as pairs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pairs(pub Vec<(String, String)>);

fn parse_pairs(text: &str) -> Result<Pairs, String> {
    text.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p
                .split_once(':')
                .or_else(|| p.split_once('='))
                .ok_or_else(|| format!("`{p}` is not key:value or key=value"))?;
            Ok((k.trim().to_string(), v.trim().to_string()))
        })
        .collect::<Result<_, _>>()
        .map(Pairs)
}

/// The shape of `--response-headers` (the service's own type).
pub use crate::service::response::HeaderFormat;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// Buckets in this process's memory.
    Memory,
    /// Buckets in Redis or Redis Cluster, shared by every instance (needs --redis-url).
    Redis,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Rules: a file, or a directory of *.yaml / *.yml files.
    #[arg(long, env = "RLS_CONFIG", default_value = "config")]
    pub config: PathBuf,
    /// Where ShouldRateLimit is served.
    #[arg(long, env = "RLS_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    pub grpc_addr: SocketAddr,
    /// How a rule that names no `algorithm` counts: token_bucket,
    /// fixed_window (envoyproxy/ratelimit's arithmetic) or sliding_window
    /// (the weighted two-window counter).
    #[arg(long, env = "RLS_ALGORITHM", default_value = "token_bucket", value_parser = parse_algorithm)]
    pub algorithm: Algorithm,
    /// Calendar periods (a limit's `calendar:`) end as if the clock read
    /// this many seconds later (negative: earlier): to rehearse a month's
    /// end in staging, or in tests. Every instance sharing a store must
    /// be given the same.
    /// At most 100 years either way: further, the periods cannot be
    /// computed (an offset of 300,000,000,000 s collapsed every period to
    /// a window of length 0 that never reset).
    #[arg(
        long,
        env = "RLS_CALENDAR_CLOCK_OFFSET",
        default_value_t = 0,
        allow_hyphen_values = true,
        value_parser = clap::value_parser!(i64).range(-MAX_CALENDAR_OFFSET_SECS..=MAX_CALENDAR_OFFSET_SECS)
    )]
    pub calendar_clock_offset: i64,
    /// Serve gRPC on this unix socket instead of --grpc-addr (a sidecar's
    /// Envoy reaching it as a `pipe` address); a socket left by a stopped
    /// process is replaced, any other file there stops the start. Also
    /// `unix:PATH`, `unix:///PATH`, and `@NAME` or `unix-abstract:NAME` for
    /// a Linux abstract socket (no file, no permissions).
    #[arg(long, env = "RLS_GRPC_UDS")]
    pub grpc_uds: Option<PathBuf>,
    /// Permissions of the --grpc-uds socket, octal: who may connect (a
    /// process needs write permission on a socket to connect to it).
    #[arg(long, env = "RLS_GRPC_UDS_MODE", default_value = "660", value_parser = parse_socket_mode)]
    pub grpc_uds_mode: u32,
    /// Where /metrics, /healthz, /readyz and /config are served.
    #[arg(long, env = "RLS_ADMIN_ADDR", default_value = "0.0.0.0:8080")]
    pub admin_addr: SocketAddr,
    /// Where buckets live.
    #[arg(long, env = "RLS_STORE", value_enum, default_value = "memory")]
    pub store: StoreKind,
    /// redis://, rediss://, redis-cluster://h1:p1,h2:p2, rediss-cluster://,
    /// redis-sentinel://s1:p1,s2:p2/master, rediss-sentinel:// or
    /// unix:///path/to/redis.sock; user:password@ allowed.
    #[arg(long, env = "RLS_REDIS_URL")]
    pub redis_url: Option<String>,
    /// A second Redis for the rules whose every bucket refills per second
    /// (envoyproxy/ratelimit's REDIS_PERSECOND layout); the same URL forms
    /// as --redis-url, and the same TLS files and key prefix.
    #[arg(long, env = "RLS_REDIS_PERSECOND_URL")]
    pub redis_persecond_url: Option<String>,
    /// --redis-pool-size for the per-second Redis (default: the same).
    #[arg(long, env = "RLS_REDIS_PERSECOND_POOL_SIZE")]
    pub redis_persecond_pool_size: Option<u32>,
    /// --redis-timeout for the per-second Redis (default: the same).
    #[arg(long, env = "RLS_REDIS_PERSECOND_TIMEOUT", value_parser = humantime::parse_duration)]
    pub redis_persecond_timeout: Option<Duration>,
    /// --redis-password-file for the per-second Redis: its password, read
    /// again for every new connection (its URL then has none).
    #[arg(
        long,
        env = "RLS_REDIS_PERSECOND_PASSWORD_FILE",
        requires = "redis_persecond_url"
    )]
    pub redis_persecond_password_file: Option<PathBuf>,
    /// Time allowed for one decision in Redis while its node is suspect or
    /// the caller sends no deadline. A caller's deadline (Envoy sends its
    /// filter timeout as grpc-timeout) caps it at 90 % of that; a node its
    /// breaker trusts is waited for up to that 90 % (at most 5 s).
    #[arg(long, env = "RLS_REDIS_TIMEOUT", default_value = "50ms", value_parser = humantime::parse_duration)]
    pub redis_timeout: Duration,
    /// For rediss://: PEM CA that signed the Redis servers' certificates (default: system roots).
    #[arg(long, env = "RLS_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
    /// A file holding the Redis password (the URL then has none), read
    /// again for every new connection: a rotated password (a Kubernetes
    /// Secret, an IAM token) is used without a restart.
    #[arg(long, env = "RLS_REDIS_PASSWORD_FILE")]
    pub redis_password_file: Option<PathBuf>,
    /// For rediss:// servers that require client certificates: PEM certificate (with --redis-client-key).
    #[arg(long, env = "RLS_REDIS_CLIENT_CERT", requires = "redis_client_key")]
    pub redis_client_cert: Option<PathBuf>,
    /// PEM private key of --redis-client-cert.
    #[arg(long, env = "RLS_REDIS_CLIENT_KEY", requires = "redis_client_cert")]
    pub redis_client_key: Option<PathBuf>,
    /// For `rediss://`: check the servers' certificates against the CA but
    /// not their names (envoyproxy/ratelimit's
    /// REDIS_TLS_SKIP_HOSTNAME_VERIFICATION; warned about at start).
    #[arg(long, env = "RLS_REDIS_TLS_SKIP_HOSTNAME_VERIFICATION")]
    pub redis_tls_skip_hostname_verification: bool,
    /// How buckets are written in Redis (both are read): `hash` only for the
    /// first step of a rolling upgrade from a version before 0.2.
    #[arg(
        long,
        env = "RLS_REDIS_BUCKET_LAYOUT",
        value_enum,
        default_value = "packed"
    )]
    pub redis_bucket_layout: crate::store::redis::BucketLayout,
    /// Put in front of every Redis key, to share a Redis with others
    /// (envoyproxy/ratelimit's CACHE_KEY_PREFIX). A brace is kept (each key
    /// goes to the slot Redis finds for it); an empty `{}` is refused.
    #[arg(long, env = "RLS_REDIS_KEY_PREFIX", default_value = "")]
    pub redis_key_prefix: String,
    /// The most seconds added at random to the expiry of a fixed window
    /// counted in envoyproxy/ratelimit's keys (its
    /// EXPIRATION_JITTER_MAX_SECONDS), so that a window's keys do not all
    /// expire in one second; 0: none.
    #[arg(long, env = "RLS_REDIS_EXPIRATION_JITTER_MAX_SECONDS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=31_536_000))]
    pub redis_expiration_jitter_max_seconds: u64,
    /// Redis connections to each primary, shared by all requests (each pipelines many calls).
    #[arg(long, env = "RLS_REDIS_POOL_SIZE", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub redis_pool_size: u32,
    /// Decisions one Redis script call carries at most: the decisions queued
    /// for one primary when its connection writes go out together in one
    /// call, each decided as if alone (Redis 7; Redis 6 gets one per call).
    /// Default: 16 with a Redis Cluster URL, whose primaries refuse keys of
    /// slots they do not hold; 1 (one per call) with a single-server URL,
    /// which may be a proxy that shards keys itself.
    #[arg(long, env = "RLS_REDIS_BATCH", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=crate::store::redis::batch::MAX as u64))]
    pub redis_batch: Option<usize>,
    /// Most buckets the memory store holds; past it, the buckets whose loss
    /// costs least are evicted (docs/limits.md).
    #[arg(long, env = "RLS_MAX_BUCKETS", default_value_t = crate::store::memory::DEFAULT_MAX_BUCKETS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_buckets: usize,
    /// Most attempt records the memory store holds, for rules with
    /// `attempts:` (each counted at most 256 bytes; docs/usage.md, "Attempts").
    #[arg(long, env = "RLS_MAX_ATTEMPTS", default_value_t = crate::store::memory::DEFAULT_MAX_ATTEMPTS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_attempts: usize,
    /// Store calls in flight at once; past it a call fails at once ("overloaded")
    /// and its rule's failure mode answers.
    #[arg(long, env = "RLS_MAX_IN_FLIGHT", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_in_flight: u64,
    /// Threads serving gRPC, each a single-threaded runtime that keeps its
    /// connections (handed out round-robin) and, with the Redis store, a
    /// decision connection of its own to every primary; 0 serves on the
    /// shared multi-thread runtime instead. Default: one per core. TLS is
    /// always served on the shared runtime.
    #[arg(long, env = "RLS_SERVING_THREADS")]
    pub serving_threads: Option<usize>,
    /// After SIGTERM or SIGINT: how long the service goes on answering
    /// while it says it is not ready (`/readyz` 503, gRPC health
    /// NOT_SERVING, both at once), so that Envoy's health check and
    /// Kubernetes withdraw it before it stops accepting
    /// (docs/operations.md). A second signal exits at once.
    #[arg(long, env = "RLS_SHUTDOWN_DELAY", default_value = "5s", value_parser = parse_shutdown_time)]
    pub shutdown_delay: Duration,
    /// Then, with no new connections taken and each open one sent a
    /// GOAWAY: how long the calls in flight have to be answered before
    /// what is left is ended.
    #[arg(long, env = "RLS_SHUTDOWN_GRACE", default_value = "20s", value_parser = parse_shutdown_time)]
    pub shutdown_grace: Duration,
    /// gRPC connections open at once, every listener together (TLS
    /// handshakes included); past it the next is accepted when one closes.
    #[arg(long, env = "RLS_MAX_CONNECTIONS", default_value_t = 10_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_connections: usize,
    /// A gRPC connection with no call open for this long is closed
    /// (GOAWAY; Envoy opens another when it next needs one). 0s: never.
    #[arg(long, env = "RLS_IDLE_TIMEOUT", default_value = "10m", value_parser = humantime::parse_duration)]
    pub idle_timeout: Duration,
    /// An HTTP/2 PING on a gRPC connection that has sent nothing for this
    /// long; a peer that does not answer it within
    /// `--http2-keepalive-timeout` is closed (a peer gone without a FIN).
    #[arg(long, env = "RLS_HTTP2_KEEPALIVE_INTERVAL", default_value = "30s", value_parser = parse_keepalive)]
    pub http2_keepalive_interval: Duration,
    #[arg(long, env = "RLS_HTTP2_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = parse_keepalive)]
    pub http2_keepalive_timeout: Duration,
    /// What rules without their own `failure_mode` do when the store fails.
    #[arg(long, env = "RLS_FAILURE_MODE", value_enum, default_value = "open")]
    pub failure_mode: FailureMode,
    /// Replicas sharing the store: the `local` failure mode gives each B/N
    /// and r/N, and RLQS splits 1/N of each budget among this instance's
    /// Envoys. Unset: 1 on the memory store; on the Redis store, counted by
    /// the instances themselves (each announces itself every 2 s, counted
    /// for 10 s; the last count kept while Redis does not answer).
    #[arg(long, env = "RLS_INSTANCES", value_parser = clap::value_parser!(u32).range(1..))]
    pub instances: Option<u32>,
    /// Add the IETF draft's RateLimit-Policy and RateLimit fields to every
    /// answer (see --response-headers-format).
    #[arg(long, env = "RLS_RESPONSE_HEADERS")]
    pub response_headers: bool,
    /// Which shape --response-headers has: `draft` (RateLimit-Policy and
    /// RateLimit, the current IETF draft's structured fields) or `legacy`
    /// (RateLimit-Limit, -Remaining and -Reset, as before).
    #[arg(
        long,
        env = "RLS_RESPONSE_HEADERS_FORMAT",
        value_enum,
        default_value = "draft"
    )]
    pub response_headers_format: HeaderFormat,
    /// A `retry-after` header (whole seconds until a retry can pass) on
    /// OVER_LIMIT answers. envoyproxy/ratelimit's environment turns it off
    /// unless LIMIT_RESPONSE_HEADERS_ENABLED is on, as its answers carry
    /// none otherwise.
    #[arg(long, env = "RLS_RETRY_AFTER", default_value_t = true, action = clap::ArgAction::Set)]
    pub retry_after: bool,
    /// The `legacy` format's three header names: limit, remaining, reset
    /// (envoyproxy/ratelimit's LIMIT_LIMIT_HEADER, LIMIT_REMAINING_HEADER,
    /// LIMIT_RESET_HEADER).
    #[arg(
        long,
        env = "RLS_LEGACY_HEADER_NAMES",
        value_delimiter = ',',
        default_value = "RateLimit-Limit,RateLimit-Remaining,RateLimit-Reset"
    )]
    pub legacy_header_names: Vec<String>,
    /// Answer OK to every request, also over the limit (envoyproxy/ratelimit's
    /// SHADOW_MODE): decisions, statuses and metrics as usual.
    #[arg(long, env = "RLS_SHADOW_MODE")]
    pub shadow_mode: bool,
    /// Every limit in quota mode (envoyproxy/ratelimit's QUOTA_MODE).
    #[arg(long, env = "RLS_QUOTA_MODE")]
    pub quota_mode: bool,
    /// Load rule files as envoyproxy/ratelimit loads them: a domain whose
    /// `descriptors:` is null or missing has no rules, `requests_per_unit`
    /// beside `unlimited: true` without a unit is ignored, a file's YAML
    /// documents after its first are ignored; each said in a warning at
    /// every load. Its environment sets it.
    #[arg(long, env = "RLS_RATELIMIT_RULES")]
    pub ratelimit_rules: bool,
    /// Each descriptor of a request spends on its own: a request one limit
    /// refuses keeps what its other descriptors took (envoyproxy/ratelimit
    /// without STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT). Off by default: a
    /// refused request is given back everything it took (docs/usage.md).
    #[arg(long, env = "RLS_PER_DESCRIPTOR_SPENDING")]
    pub per_descriptor_spending: bool,
    /// Put the request and the passing rules' `metadata` in the response's
    /// dynamic metadata (envoyproxy/ratelimit's RESPONSE_DYNAMIC_METADATA).
    #[arg(long, env = "RLS_RESPONSE_DYNAMIC_METADATA")]
    pub response_dynamic_metadata: bool,
    /// Name in this response header (e.g. x-ratelimit-rule) the limits that
    /// refused an OVER_LIMIT request (each limit's `name`, else its rule's
    /// descriptor path; never a request's value), and in the dynamic
    /// metadata's `refused_by`. Off unless given.
    #[arg(long, env = "RLS_REFUSED_BY_HEADER", value_parser = parse_header_name)]
    pub refused_by_header: Option<String>,
    /// At most this many log lines a second, one per refused request
    /// (domain, the refusing limits, the descriptors' keys, retry-after);
    /// the rest are counted in the next line. 0: none.
    #[arg(long, env = "RLS_REFUSAL_LOG_RATE", default_value_t = 5)]
    pub refusal_log_rate: u32,
    /// Descriptor keys whose values are shown pseudonymised wherever values
    /// are shown (the refusal log, the admin page and its JSON, the heavy
    /// hitters shared in Redis, `detailed_metric` series), e.g.
    /// user_id,remote_address (`*`: every key): `key=hmac:<24 hex>`,
    /// HMAC-SHA-256 under --pseudonym-key-file (needed with this).
    #[arg(long, env = "RLS_REFUSAL_LOG_HASH_KEYS", value_delimiter = ',')]
    pub refusal_log_hash_keys: Vec<String>,
    /// A file holding the secret (at least 16 bytes) the pseudonyms of
    /// --refusal-log-hash-keys are keyed with; every instance of one
    /// deployment reads the same (a Secret), so that a value has one
    /// pseudonym across them.
    #[arg(long, env = "RLS_PSEUDONYM_KEY_FILE")]
    pub pseudonym_key_file: Option<PathBuf>,
    /// Counters of each heavy-hitters summary (per rule, refused and
    /// admitted, last minute and hour: `/v1/hitters`, the admin page);
    /// a reported count is at most (hits in the window) / K above the
    /// truth. 0: none kept.
    #[arg(long, env = "RLS_HEAVY_HITTERS", default_value_t = crate::hitters::DEFAULT_COUNTERS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=256))]
    pub heavy_hitters: usize,
    /// A file holding a bearer token: `/`, `/v1/…` and `/config` on the
    /// admin port then need `Authorization: Bearer <token>` (read again
    /// at each request: a rotated Secret applies at once); `/healthz`,
    /// `/readyz`, `/healthcheck` and `/metrics` stay open for probes.
    #[arg(long, env = "RLS_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Host names (beside IP addresses and localhost) under which the
    /// admin port's guarded paths (`/v1/…`, `/config`) answer, e.g. the
    /// Service's DNS name; others get a 421, so that a web page whose name
    /// was made to resolve here (DNS rebinding) reads nothing. `*`: any.
    #[arg(long, env = "RLS_ADMIN_ALLOWED_HOSTS", value_delimiter = ',')]
    pub admin_allowed_hosts: Vec<String>,
    /// PEM certificate chain: serve the admin port over HTTPS (with
    /// --admin-tls-key; reloaded when the files change, as --tls-cert).
    #[arg(long, env = "RLS_ADMIN_TLS_CERT", requires = "admin_tls_key")]
    pub admin_tls_cert: Option<PathBuf>,
    /// PEM private key of --admin-tls-cert.
    #[arg(long, env = "RLS_ADMIN_TLS_KEY", requires = "admin_tls_cert")]
    pub admin_tls_key: Option<PathBuf>,
    /// PEM CA (with --admin-tls-cert): `/`, `/v1/…` and `/config` need a
    /// client certificate it signed (mTLS); `/healthz`, `/readyz`,
    /// `/healthcheck` and `/metrics` stay open to clients without one
    /// (probes, scrapers). With --admin-token-file too, both are needed.
    #[arg(long, env = "RLS_ADMIN_TLS_CLIENT_CA", requires = "admin_tls_cert")]
    pub admin_tls_client_ca: Option<PathBuf>,
    /// One domain may span several files.
    #[arg(long, env = "RLS_MERGE_DOMAINS")]
    pub merge_domains: bool,
    /// Domains (comma-separated, `*` matches any run of characters) where a
    /// descriptor's own hits_addend is a usage charge: deducted even beyond
    /// what the bucket holds, as on an `overdraft: true` rule. For rules
    /// that cannot say `overdraft` themselves (over xDS, from Envoy
    /// Gateway's `cost.response`).
    #[arg(long, env = "RLS_USAGE_DOMAINS", value_delimiter = ',')]
    pub usage_domains: Vec<String>,
    /// PEM certificate chain: serve gRPC over TLS (with --tls-key).
    #[arg(long, env = "RLS_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "RLS_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA: clients must present a certificate it signed (mTLS).
    #[arg(long, env = "RLS_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// With --tls-client-ca: a client certificate must also carry this
    /// subject alternative name, as envoyproxy/ratelimit's
    /// GRPC_CLIENT_TLS_SAN: a DNS name (without case, wildcards in the
    /// certificate), an IP address, or a URI such as a SPIFFE ID (exactly);
    /// others fail the handshake.
    #[arg(long, env = "RLS_TLS_CLIENT_SAN", requires = "tls_client_ca")]
    pub tls_client_san: Option<String>,
    /// OTLP/gRPC collector for traces, e.g. http://127.0.0.1:4317 (none:
    /// tracing off). OpenTelemetry's OTEL_EXPORTER_OTLP_ENDPOINT is read as
    /// its default, unless envoyproxy/ratelimit's TRACING_ENABLED says
    /// otherwise.
    #[arg(long, env = "RLS_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Also count envoyproxy/ratelimit's statistics under its Prometheus
    /// names (ratelimit_service_rate_limit_*{domain, key1, key2}).
    #[arg(long, env = "RLS_RATELIMIT_METRICS")]
    pub ratelimit_metrics: bool,
    /// A decision within the limit counts as near it past this fraction of
    /// the burst spent (for --ratelimit-metrics).
    #[arg(long, env = "RLS_NEAR_LIMIT_RATIO", default_value_t = 0.8)]
    pub near_limit_ratio: f64,
    /// Also send envoyproxy/ratelimit's statistics over statsd (UDP) to
    /// HOST:PORT, as its USE_STATSD does.
    #[arg(long, env = "RLS_STATSD_ADDR")]
    pub statsd_addr: Option<String>,
    /// How often the statsd counters are sent.
    #[arg(long, env = "RLS_STATSD_FLUSH_INTERVAL", value_parser = humantime::parse_duration, default_value = "10s")]
    pub statsd_flush_interval: Duration,
    /// Also serve the metrics on this address (at --prometheus-path), as
    /// envoyproxy/ratelimit does on PROMETHEUS_ADDR.
    #[arg(long, env = "RLS_PROMETHEUS_ADDR")]
    pub prometheus_addr: Option<SocketAddr>,
    #[arg(long, env = "RLS_PROMETHEUS_PATH", default_value = "/metrics")]
    pub prometheus_path: String,
    /// Take the rules from this xDS server (ADS, state of the world;
    /// `http://host:port`, or `https://` for TLS) instead of --config.
    #[arg(long, env = "RLS_XDS_SERVER")]
    pub xds_server: Option<String>,
    /// The node id sent to the xDS server.
    #[arg(long, env = "RLS_XDS_NODE_ID", default_value = "default")]
    pub xds_node_id: String,
    /// The node's metadata sent to the xDS server: `k1:v1,k2=v2`.
    #[arg(long, env = "RLS_XDS_NODE_METADATA", value_parser = parse_pairs, default_value = "")]
    pub xds_node_metadata: Pairs,
    /// gRPC metadata sent on the xDS stream: `name:value,name2:value2`.
    #[arg(long, env = "RLS_XDS_HEADERS", value_parser = parse_pairs, default_value = "")]
    pub xds_headers: Pairs,
    /// The name the xDS server's certificate must carry, when not the URL's host.
    #[arg(long, env = "RLS_XDS_SERVER_NAME")]
    pub xds_server_name: Option<String>,
    /// PEM CA of the xDS server's certificate (https://).
    #[arg(long, env = "RLS_XDS_CA_FILE")]
    pub xds_ca_file: Option<PathBuf>,
    /// This instance is a region: `scope: global` rules spend the share of
    /// their global budget that the global tier at this URL (another
    /// tokenbucket-rls's gRPC port, http://HOST:PORT, or https:// for TLS)
    /// gives this region.
    #[arg(long, env = "RLS_QUOTA_UPSTREAM", requires_all = ["region", "regions"])]
    pub quota_upstream: Option<String>,
    /// This region's name, the same on all of its instances (with --quota-upstream).
    #[arg(long, env = "RLS_REGION", requires = "quota_upstream")]
    pub region: Option<String>,
    /// How many regions share the global budgets, the same on every region:
    /// cut off, a region falls back to B/N and r/N (with --quota-upstream).
    #[arg(long, env = "RLS_REGIONS", requires = "quota_upstream", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub regions: Option<u32>,
    /// PEM CA of the global tier's certificate (an https:// --quota-upstream).
    #[arg(long, env = "RLS_QUOTA_UPSTREAM_CA_FILE", requires = "quota_upstream")]
    pub quota_upstream_ca_file: Option<PathBuf>,
    /// PEM client certificate this region shows the global tier (naming the
    /// region: DNS SAN <region>.regions.<domain>), with
    /// --quota-upstream-client-key. Read again when it changes on disk.
    #[arg(long, env = "RLS_QUOTA_UPSTREAM_CLIENT_CERT", requires_all = ["quota_upstream", "quota_upstream_client_key"])]
    pub quota_upstream_client_cert: Option<PathBuf>,
    #[arg(
        long,
        env = "RLS_QUOTA_UPSTREAM_CLIENT_KEY",
        requires = "quota_upstream_client_cert"
    )]
    pub quota_upstream_client_key: Option<PathBuf>,
    /// The name the global tier's certificate must carry, when not the URL's host.
    #[arg(
        long,
        env = "RLS_QUOTA_UPSTREAM_SERVER_NAME",
        requires = "quota_upstream"
    )]
    pub quota_upstream_server_name: Option<String>,
    /// PEM client certificate for the xDS server (mTLS), with --xds-client-key.
    #[arg(long, env = "RLS_XDS_CLIENT_CERT", requires = "xds_client_key")]
    pub xds_client_cert: Option<PathBuf>,
    #[arg(long, env = "RLS_XDS_CLIENT_KEY", requires = "xds_client_cert")]
    pub xds_client_key: Option<PathBuf>,
    /// Ready before the first xDS snapshot (answering OK to everything
    /// until it comes).
    #[arg(long, env = "RLS_XDS_READY_WITHOUT_RULES")]
    pub xds_ready_without_rules: bool,
    /// First wait before opening a failed xDS stream again; doubles up to
    /// --xds-max-backoff.
    #[arg(long, env = "RLS_XDS_BACKOFF", value_parser = humantime::parse_duration, default_value = "1s")]
    pub xds_backoff: Duration,
    #[arg(long, env = "RLS_XDS_MAX_BACKOFF", value_parser = humantime::parse_duration, default_value = "30s")]
    pub xds_max_backoff: Duration,
    /// The largest xDS snapshot taken, in bytes (one gRPC message); a
    /// larger one fails the stream, logged at error level.
    #[arg(long, env = "RLS_XDS_MAX_MESSAGE_SIZE", default_value_t = crate::sources::xds::DEFAULT_MAX_MESSAGE_SIZE)]
    pub xds_max_message_size: usize,
    /// Log lines as text or JSON (level from RUST_LOG, default info).
    #[arg(long, env = "RLS_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// `--algorithm`: as rules name it.
fn parse_algorithm(s: &str) -> Result<Algorithm, String> {
    Algorithm::from_name(s).ok_or_else(|| format!("'{s}' is not one of {}", Algorithm::names()))
}

/// A response header's name as Envoy passes it on: a token of letters,
/// digits and `-`, lowercased (HTTP/2 sends names in lowercase).
fn parse_header_name(raw: &str) -> Result<String, String> {
    let name = raw.trim().to_ascii_lowercase();
    if name.is_empty()
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        || name.starts_with(':')
    {
        return Err(format!(
            "'{raw}' is not a header name: give letters, digits and '-' (e.g. x-ratelimit-rule)"
        ));
    }
    Ok(name)
}

/// `--shutdown-delay`, `--shutdown-grace`: a duration of at most 10 minutes
/// (past Kubernetes' longest sensible `terminationGracePeriodSeconds`).
fn parse_shutdown_time(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d > Duration::from_secs(600) {
        return Err(format!("{text}: at most 10m"));
    }
    Ok(d)
}

/// `--http2-keepalive-*`: 1 s to 1 hour (a PING more often than each second
/// is traffic of its own; keepalive cannot be turned off: it is what
/// closes a peer gone without a FIN).
fn parse_keepalive(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&d) {
        return Err(format!("{text}: between 1s and 1h"));
    }
    Ok(d)
}

/// `--grpc-uds-mode`: octal permission bits, at most 777.
fn parse_socket_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("'{s}' is not an octal file mode such as 660 or 600"))
}

impl ServeArgs {
    /// Where rules come from when not from --config.
    /// `--quota-upstream`, `--region`, `--regions`, when this is a region.
    pub fn upstream_settings(&self) -> Option<crate::quota::upstream::UpstreamSettings> {
        Some(crate::quota::upstream::UpstreamSettings {
            url: self.quota_upstream.clone()?,
            region: self.region.clone().unwrap_or_default(),
            regions: self.regions.unwrap_or(1),
            tls: crate::quota::upstream::UpstreamTls {
                ca_file: self.quota_upstream_ca_file.clone(),
                client_cert: self
                    .quota_upstream_client_cert
                    .clone()
                    .zip(self.quota_upstream_client_key.clone()),
                server_name: self.quota_upstream_server_name.clone(),
            },
        })
    }

    pub fn xds_settings(&self) -> Option<crate::sources::xds::XdsSettings> {
        Some(crate::sources::xds::XdsSettings {
            server: self.xds_server.clone()?,
            node_id: self.xds_node_id.clone(),
            node_metadata: self.xds_node_metadata.0.clone(),
            headers: self.xds_headers.0.clone(),
            server_name: self.xds_server_name.clone(),
            ca_file: self.xds_ca_file.clone(),
            client_cert: self
                .xds_client_cert
                .clone()
                .zip(self.xds_client_key.clone()),
            backoff: self.xds_backoff,
            max_backoff: self.xds_max_backoff.max(self.xds_backoff),
            max_message_size: self.xds_max_message_size,
        })
    }

    /// `--serving-threads`, or its default for the store.
    pub fn serving_threads(&self) -> usize {
        self.serving_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_socket_mode, Cli, MAX_CALENDAR_OFFSET_SECS};
    use clap::Parser;

    #[test]
    fn a_calendar_offset_whose_periods_cannot_be_computed_stops_the_start() {
        for bad in ["300000000000", "-300000000000", &i64::MAX.to_string()] {
            let e = Cli::try_parse_from(["tokenbucket-rls", "--calendar-clock-offset", bad])
                .expect_err(bad)
                .to_string();
            assert!(e.contains("--calendar-clock-offset"), "{e}");
        }
        let most = MAX_CALENDAR_OFFSET_SECS.to_string();
        let cli = Cli::try_parse_from(["tokenbucket-rls", "--calendar-clock-offset", &most])
            .expect("a century ahead is a clock");
        assert_eq!(cli.serve.calendar_clock_offset, MAX_CALENDAR_OFFSET_SECS);
    }

    #[test]
    fn socket_modes_are_octal() {
        assert_eq!(parse_socket_mode("660"), Ok(0o660));
        assert_eq!(parse_socket_mode("0600"), Ok(0o600));
        assert_eq!(parse_socket_mode("0o770"), Ok(0o770));
        for bad in ["888", "1777", "rw-rw----", ""] {
            let e = parse_socket_mode(bad).expect_err(bad);
            assert!(e.contains("octal file mode"), "{e}");
        }
    }
}
