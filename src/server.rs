//! Wiring: load the rules, build store → limiter → service, serve gRPC and
//! admin HTTP until told to stop, then drain in-flight calls.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): the
//! top room under `main`: uses every room below it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, AdminState};
use crate::cli::{ServeArgs, StoreKind};
use crate::clock::MonotonicClock;
use crate::health::{Draining, Health};
use crate::instances::{Instances, ANNOUNCE_EVERY, ANNOUNCE_TTL};
use crate::limiter::Limiter;
use crate::quota::ledger::QuotaLedger;
use crate::quota::redis_ledger::RedisLedger;
use crate::rules::SharedRules;
use crate::rules::{self, DomainPatterns, LoadOptions};
use crate::service::quota::{QuotaHub, RateLimitQuotaGrpc};
use crate::service::{LegacyHeaderNames, RateLimitGrpc, ResponseOptions};
use crate::serving;
use crate::sources::reload::Reloader;
use crate::sources::xds::XdsSettings;
use crate::store::breaker::Breakers;
use crate::store::memory::MemoryStore;
use crate::store::per_second::PerSecondSplit;
use crate::store::redis::{RedisSettings, RedisStore};
use crate::store::Store;
use crate::telemetry::statsd::{self, StatsdCounters};
use crate::telemetry::Metrics;
use crate::tls::{ReloadingTls, TlsFiles, TlsListener, TlsPeer};

/// The largest `RateLimitRequest` accepted (tonic answers RESOURCE_EXHAUSTED
/// past it). Envoy's requests are a few hundred bytes.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;
/// HTTP/2 streams one connection may have open at once.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;

/// How often leases are checked for expired or outdated tokens.
pub const LEASE_SWEEP: Duration = Duration::from_millis(100);
/// How long shutdown waits for unspent lease tokens to go back.
const LEASE_RETURN_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a shutdown waits for what it flushes after the calls are
/// answered (this instance's withdrawal from the count of instances, its
/// last heavy-hitter summaries).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// A started server: its bound addresses and a way to stop it.
pub struct RunningServer {
    /// Where gRPC is served (port 0 when it is served on `--grpc-uds`).
    pub grpc_addr: SocketAddr,
    /// `--grpc-uds`: a socket file is removed at shutdown.
    grpc_uds: Option<serving::UdsAddress>,
    pub admin_addr: SocketAddr,
    pub rules: SharedRules,
    pub reloader: Arc<Reloader>,
    pub metrics: Arc<Metrics>,
    limiter: Arc<Limiter>,
    quota_hub: Arc<QuotaHub>,
    draining: Arc<Draining>,
    /// `--shutdown-grace`: how long the calls in flight have, and each
    /// connection's close (an HTTP/2 peer that never answers the GOAWAY's
    /// ping, hung or cut off, would hold the shutdown for ever).
    grace: Duration,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<Result<()>>>,
    /// Tasks that write their last state when stopped: waited for.
    flushers: Vec<JoinHandle<()>>,
    /// A region's client of the global tier: ended at shutdown, so that
    /// the region's streams close with it.
    upstream: Option<JoinHandle<()>>,
}

impl RunningServer {
    /// The shutdown's first step: `/readyz` and the gRPC health service
    /// say not ready from now on, while every call is still answered.
    pub fn begin_draining(&self) {
        self.draining.begin();
    }

    /// Stops accepting, lets in-flight calls finish (within
    /// `--shutdown-grace`), waits for the servers, gives unspent lease
    /// tokens back to their buckets and flushes what is written at stop.
    pub async fn shutdown(self) -> Result<()> {
        self.draining.begin();
        let _ = self.stop.send(true);
        // RLQS streams last as long as their Envoy: end them, or draining
        // would wait for them for ever; first, what each Envoy holds is
        // made to last until it has reconnected elsewhere
        if tokio::time::timeout(FLUSH_TIMEOUT, self.quota_hub.farewell())
            .await
            .is_err()
        {
            tracing::warn!(
                "RLQS: the farewell assignments took over {FLUSH_TIMEOUT:?}; streams end now"
            );
        }
        self.quota_hub.close_all();
        if let Some(upstream) = &self.upstream {
            upstream.abort();
        }
        let mut tasks = self.tasks;
        let grace = self.grace;
        let drained = tokio::time::timeout(grace, async {
            for task in &mut tasks {
                task.await.context("server task panicked")??;
            }
            Ok::<(), anyhow::Error>(())
        })
        .await;
        match drained {
            Ok(result) => result?,
            Err(_) => {
                tracing::warn!("connections still open {grace:?} (--shutdown-grace) after the shutdown began: ended");
                for task in &tasks {
                    task.abort();
                }
            }
        }
        let returned = tokio::time::timeout(LEASE_RETURN_TIMEOUT, self.limiter.leases().return_all())
            .await
            .unwrap_or_else(|_| {
                tracing::warn!("gave up returning lease tokens after {LEASE_RETURN_TIMEOUT:?}; see rls_lease_tokens_held");
                0
            });
        if returned > 0 {
            tracing::info!(tokens = returned, "returned unspent lease tokens");
        }
        let flushed =
            tokio::time::timeout(FLUSH_TIMEOUT, futures::future::join_all(self.flushers)).await;
        if flushed.is_err() {
            tracing::warn!(
                "gave up writing this instance's last state to Redis after {FLUSH_TIMEOUT:?}"
            );
        }
        if let Some(serving::UdsAddress::Path(path)) = &self.grpc_uds {
            let _ = std::fs::remove_file(path);
        }
        Ok(())
    }

    /// Waits until either server stops on its own (an error). The tasks
    /// stay here while it waits: when a signal ends the wait instead,
    /// [`RunningServer::shutdown`] still has every one of them to drain
    /// (it once moved them out, and a SIGTERM then dropped them with the
    /// wait: the process exited with calls in flight, #66).
    pub async fn wait(&mut self) -> Result<()> {
        let (result, index, _) = futures::future::select_all(self.tasks.iter_mut()).await;
        self.tasks.remove(index);
        result.context("server task panicked")?
    }
}

/// Where gRPC is served: `--grpc-addr`, or `--grpc-uds`.
enum GrpcListener {
    Tcp(TcpListener),
    Unix(tokio::net::UnixListener),
}

/// `--legacy-header-names`: three header names.
fn legacy_header_names(names: &[String]) -> Result<LegacyHeaderNames> {
    match names {
        [limit, remaining, reset]
            if names
                .iter()
                .all(|n| axum::http::HeaderName::from_bytes(n.trim().as_bytes()).is_ok()) =>
        {
            Ok(LegacyHeaderNames::new(limit, remaining, reset))
        }
        _ => anyhow::bail!(
            "--legacy-header-names {}: give three header names (limit, remaining, reset), e.g. RateLimit-Limit,RateLimit-Remaining,RateLimit-Reset",
            names.join(",")
        ),
    }
}

/// `--statsd-addr` checked as HOST:PORT; the name is resolved at each
/// flush ([`statsd::flush_every`]), so one that does not resolve yet does
/// not stop the start.
fn statsd_target(addr: &str) -> Result<String> {
    let port = addr.rsplit_once(':').map(|(_, port)| port.parse::<u16>());
    match port {
        Some(Ok(_)) => Ok(addr.to_string()),
        _ => anyhow::bail!("--statsd-addr {addr}: give HOST:PORT, e.g. localhost:8125"),
    }
}

/// Loads the rules and starts serving on the configured addresses (port 0 picks one).
pub async fn start(args: &ServeArgs) -> Result<RunningServer> {
    let (rules, opts, xds) = load_rules(args)?;
    let metrics = start_metrics(args, xds.is_some())?;
    let reloader = keep_rules_current(args, opts, xds, &rules, &metrics)?;
    let (store, quota_ledger, redis) = open_store(args, &metrics).await?;
    let instances = first_count_of_instances(args, redis.as_deref(), &metrics).await;
    warn_of_attempts_in_memory(args, &rules.load());
    let (limiter, upstream_task) = build_limiter(args, store, &instances, &rules, &metrics)?;
    let generation = {
        let rules = rules.clone();
        move || rules.load().generation()
    };
    limiter.leases().spawn_sweeper(LEASE_SWEEP, generation);
    limiter.spawn_local_sweeper(Duration::from_secs(1));
    let service = RateLimitGrpc::new(
        rules.clone(),
        limiter.clone(),
        metrics.clone(),
        ResponseOptions {
            rate_limit_headers: args
                .response_headers
                .then_some(args.response_headers_format),
            legacy_header_names: legacy_header_names(&args.legacy_header_names)?,
            shadow_mode: args.shadow_mode,
            dynamic_metadata: args.response_dynamic_metadata,
            quota_mode: args.quota_mode,
            refused_by_header: args.refused_by_header.clone(),
            retry_after: args.retry_after,
        },
    )
    .with_refusal_log(args.refusal_log_rate, shown_values(args)?);

    let grpc_uds = args
        .grpc_uds
        .as_deref()
        .map(serving::UdsAddress::parse)
        .transpose()?;
    let grpc_listener = match &grpc_uds {
        Some(address) => {
            if args.tls_cert.is_some() {
                anyhow::bail!("--grpc-uds with --tls-cert: TLS over the unix socket is not offered (a socket's permissions say who may connect)");
            }
            GrpcListener::Unix(serving::bind_unix(address, args.grpc_uds_mode)?)
        }
        None => GrpcListener::Tcp(
            TcpListener::bind(args.grpc_addr)
                .await
                .with_context(|| format!("cannot listen for gRPC on {}", args.grpc_addr))?,
        ),
    };
    let admin_listener = TcpListener::bind(args.admin_addr)
        .await
        .with_context(|| format!("cannot listen for admin HTTP on {}", args.admin_addr))?;
    let grpc_addr = match &grpc_listener {
        GrpcListener::Tcp(listener) => listener.local_addr()?,
        GrpcListener::Unix(_) => SocketAddr::from(([0, 0, 0, 0], 0)),
    };
    let admin_addr = admin_listener.local_addr()?;

    let (stop, stopped) = watch::channel(false);
    let until_stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let mut flushers = Vec::new();
    if let Some(redis) = &redis {
        flushers.extend(crate::store::redis::hitters::spawn_sharing(
            redis.clone(),
            metrics.clone(),
            instances.1.clone(),
            instances.0.clone(),
            stopped.clone(),
        ));
    }
    let shared_hitters = redis.clone();
    if let (Some(redis), None) = (redis, args.instances) {
        flushers.push(keep_counting_instances(
            redis,
            instances.0.clone(),
            instances.1,
            metrics.clone(),
            stopped.clone(),
        ));
    }
    let quota_hub = QuotaHub::new(
        rules.clone(),
        metrics.clone(),
        instances.0.clone(),
        quota_ledger,
    )?;
    quota_hub.spawn_ticker();
    let draining = Arc::new(Draining::default());
    let health = Health {
        rules: rules.clone(),
        limiter: limiter.clone(),
        quota: Some(quota_hub.clone()),
        draining: draining.clone(),
        ready_without_rules: args.xds_ready_without_rules,
    };
    let (reporter, health_service) = tonic_health::server::health_reporter();
    health.clone().start_grpc_sync(reporter).await;

    // strings that are not UTF-8 decided, not failed (service::wire)
    let rls = crate::service::wire::RateLimitServer::new(service, MAX_REQUEST_BYTES);
    let rlqs = RateLimitQuotaServiceServer::new(
        RateLimitQuotaGrpc::new(quota_hub.clone())
            .with_region_certificates(args.tls_cert.is_some() && args.tls_client_ca.is_some()),
    )
    .max_decoding_message_size(MAX_REQUEST_BYTES);
    // every service but `ShouldRateLimit`, which every listener hands to
    // `rls` by its path (serving::GrpcRoutes)
    let routes = tonic::service::Routes::new(health_service)
        .add_service(rlqs)
        .prepare();
    let routes = serving::GrpcRoutes::new(crate::service::wire::PATH, rls, routes);
    let grpc = serve_grpc(grpc_listener, args, routes, &metrics, stopped.clone())?;
    check_admin_token(args)?;
    let admin_router = admin::router(AdminState {
        rules: rules.clone(),
        health,
        metrics: metrics.clone(),
        token_file: args.admin_token_file.clone(),
        client_cert_required: args.admin_tls_client_ca.is_some(),
        allowed_hosts: args.admin_allowed_hosts.clone(),
        shared_hitters,
    });
    let admin: futures::future::BoxFuture<'static, Result<()>> =
        match (&args.admin_tls_cert, &args.admin_tls_key) {
            (Some(cert), Some(key)) => {
                let tls = ReloadingTls::load(TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: args.admin_tls_client_ca.clone(),
                    client_san: None,
                    client_cert_optional: true,
                    alpn: &[b"http/1.1"],
                })
                .context("the admin port's TLS files")?;
                tls.spawn_reloader();
                let serve = axum::serve(
                    TlsListener::new(&tls, admin_listener)?,
                    admin_router.into_make_service_with_connect_info::<TlsPeer>(),
                )
                .with_graceful_shutdown(until_stopped(stopped.clone()));
                Box::pin(async move { serve.await.context("admin server failed") })
            }
            _ => {
                let serve = axum::serve(admin_listener, admin_router)
                    .with_graceful_shutdown(until_stopped(stopped.clone()));
                Box::pin(async move { serve.await.context("admin server failed") })
            }
        };

    let mut tasks = vec![tokio::spawn(grpc), tokio::spawn(admin)];
    if let Some(addr) = args.prometheus_addr {
        // the metrics alone, where envoyproxy/ratelimit serves them
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on --prometheus-addr {addr}"))?;
        let scrape = axum::serve(
            listener,
            admin::metrics_router(&args.prometheus_path, metrics.clone()),
        )
        .with_graceful_shutdown(until_stopped(stopped));
        tasks.push(tokio::spawn(async move {
            scrape.await.context("metrics server failed")
        }));
    }
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        %grpc_addr,
        grpc_uds = grpc_uds.as_ref().map(|a| a.to_string()),
        %admin_addr,
        store = limiter.store_name(),
        generation = rules.load().generation(),
        domains = rules.load().domains().count(),
        "tokenbucket-rls serving"
    );
    Ok(RunningServer {
        grpc_addr,
        grpc_uds,
        admin_addr,
        rules,
        reloader,
        metrics,
        limiter,
        quota_hub,
        draining,
        grace: args.shutdown_grace,
        stop,
        tasks,
        flushers,
        upstream: upstream_task,
    })
}

/// Serves until SIGTERM or SIGINT, then shuts down gracefully: not ready
/// at once, answering for `--shutdown-delay`, then draining within
/// `--shutdown-grace` (docs/operations.md). A second signal exits at once.
pub async fn run(args: ServeArgs) -> Result<()> {
    // watched before the ports open: a SIGTERM that comes while starting
    // (an orchestrator that gave up waiting) stops it cleanly, not by the
    // signal's default action
    let mut signals = Signals::watch()?;
    let mut server = start(&args).await?;
    tokio::select! {
        result = server.wait() => return result,
        signal = signals.next() => signal?,
    }
    server.begin_draining();
    tokio::spawn(async move {
        if signals.next().await.is_ok() {
            tracing::warn!("a second signal: exiting at once, calls in flight are cut");
            std::process::exit(1);
        }
    });
    if !args.shutdown_delay.is_zero() {
        tracing::info!(delay = ?args.shutdown_delay, "shutting down: not ready, still answering while this instance is withdrawn (--shutdown-delay)");
        tokio::time::sleep(args.shutdown_delay).await;
    }
    tracing::info!(grace = ?args.shutdown_grace, "shutting down: no new connections, draining the calls in flight");
    server.shutdown().await
}

/// The gRPC listener served within `--max-connections` and the other
/// connection bounds (serving::bounds) until `stopped`.
fn serve_grpc<M: serving::Method>(
    listener: GrpcListener,
    args: &ServeArgs,
    routes: serving::GrpcRoutes<M>,
    metrics: &Arc<Metrics>,
    stopped: watch::Receiver<bool>,
) -> Result<futures::future::BoxFuture<'static, Result<()>>> {
    let bounds = serving::ConnectionBounds::new(
        args.max_connections,
        MAX_STREAMS_PER_CONNECTION,
        args.idle_timeout,
        (args.http2_keepalive_interval, args.http2_keepalive_timeout),
    );
    keep_counting_connections(&bounds, args.max_connections, metrics, stopped.clone());
    let until_stopped = {
        let mut stopped = stopped.clone();
        Box::pin(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
    };
    let threads = args.serving_threads();
    Ok(match (listener, &args.tls_cert, &args.tls_key) {
        // on the main runtime: a sidecar's one Envoy, no serving threads
        (GrpcListener::Unix(listener), _, _) => {
            let incoming = serving::unix_incoming(listener, bounds.clone());
            Box::pin(async move {
                serving::serve_connections(incoming, routes, &bounds, None, until_stopped).await;
                Ok(())
            })
        }
        (GrpcListener::Tcp(listener), Some(cert), Some(key)) => {
            let tls = ReloadingTls::load(TlsFiles {
                client_cert_optional: false,
                alpn: &[b"h2"],
                cert: cert.clone(),
                key: key.clone(),
                client_ca: args.tls_client_ca.clone(),
                client_san: args.tls_client_san.clone(),
            })?;
            tls.spawn_reloader();
            let incoming = tls.incoming(listener, bounds.clone(), stopped);
            // each call is given its connection's certificates (a
            // region's stream is named by them), as tonic's server does
            let certificates =
                <crate::tls::ServerTlsStream as tonic::transport::server::Connected>::connect_info;
            Box::pin(async move {
                serving::serve_connections(
                    incoming,
                    routes,
                    &bounds,
                    Some(certificates),
                    until_stopped,
                )
                .await;
                Ok(())
            })
        }
        (GrpcListener::Tcp(listener), _, _) if threads > 0 => {
            let serving = serving::start(listener, threads, routes, bounds, stopped)?;
            Box::pin(async move { serving.await.context("serving threads panicked")? })
        }
        // --serving-threads 0: the same connections, on the shared runtime
        (GrpcListener::Tcp(listener), _, _) => {
            let incoming = serving::tcp_incoming(listener, bounds.clone());
            Box::pin(async move {
                serving::serve_connections(incoming, routes, &bounds, None, until_stopped).await;
                Ok(())
            })
        }
    })
}

/// Sets `rls_grpc_connections` each second from the slots `bounds` has
/// given out, until `stopped`.
fn keep_counting_connections(
    bounds: &serving::ConnectionBounds,
    limit: usize,
    metrics: &Arc<Metrics>,
    mut stopped: watch::Receiver<bool>,
) {
    let (gate, metrics) = (bounds.gate.clone(), metrics.clone());
    metrics.grpc_connections(0, limit);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stopped.wait_for(|s| *s) => return,
            }
            let open = limit.saturating_sub(gate.available_permits());
            metrics.grpc_connections(open, limit);
        }
    });
}

/// Step 1: the rules to start with, from `--config` (or none yet, to come
/// with xDS's first snapshot), the options every later load uses, and the
/// xDS settings if rules come from there.
fn load_rules(args: &ServeArgs) -> Result<(SharedRules, LoadOptions, Option<XdsSettings>)> {
    let opts = LoadOptions {
        merge_domains: args.merge_domains,
        usage_domains: DomainPatterns::new(&args.usage_domains),
        default_algorithm: args.algorithm,
        ratelimit_files: args.ratelimit_rules,
    };
    let xds = args.xds_settings();
    if let Some(settings) = &xds {
        settings.check()?;
    }
    let loaded = match &xds {
        // rules come with the first snapshot
        Some(_) => rules::load_sources(Vec::new(), opts.clone())
            .map_err(|e| anyhow::anyhow!("cannot start without rules: {e}"))?,
        None => rules::load_path(&args.config, opts.clone()).map_err(|e| {
            anyhow::anyhow!("cannot load rules from {}:\n{e}", args.config.display())
        })?,
    };
    loaded.say_warnings();
    if loaded.domains().count() == 0 && xds.is_none() {
        tracing::warn!(config = %args.config.display(), "no rules loaded: every request will be answered OK");
    }
    let rules: SharedRules = Arc::new(ArcSwap::from_pointee(loaded.with_generation(1)));
    Ok((rules, opts, xds))
}

/// `--admin-token-file`, when given, holds a token now: a Secret that is
/// missing stops the start instead of refusing every operator later.
fn check_admin_token(args: &ServeArgs) -> Result<()> {
    if let Some(file) = &args.admin_token_file {
        anyhow::ensure!(
            admin::guard::read_token(file).is_some(),
            "--admin-token-file {}: cannot be read, or is empty",
            file.display()
        );
    }
    Ok(())
}

/// How request values are shown in logs, on the page and in metrics:
/// `--refusal-log-hash-keys` pseudonymised under `--pseudonym-key-file`.
fn shown_values(args: &ServeArgs) -> Result<crate::shown::ShownValues> {
    let secret = match &args.pseudonym_key_file {
        None => None,
        Some(file) => Some(
            std::fs::read(file)
                .with_context(|| format!("--pseudonym-key-file {}", file.display()))?,
        ),
    };
    crate::shown::ShownValues::hashing(&args.refusal_log_hash_keys, secret.as_deref())
        .map_err(anyhow::Error::msg)
}

/// Step 2: the metrics, with envoyproxy/ratelimit's stats and statsd if
/// asked for.
fn start_metrics(args: &ServeArgs, over_xds: bool) -> Result<Arc<Metrics>> {
    let metrics = Arc::new(Metrics::new());
    metrics.enable_hitters(args.heavy_hitters, shown_values(args)?);
    let statsd = match &args.statsd_addr {
        None => None,
        Some(addr) => Some(statsd_target(addr)?),
    };
    let statsd_counters = statsd.as_ref().map(|_| Arc::new(StatsdCounters::default()));
    metrics.enable_ratelimit_stats(
        args.ratelimit_metrics,
        statsd_counters.clone(),
        args.near_limit_ratio,
    );
    if let (Some(stats), false) = (metrics.ratelimit_stats(), over_xds) {
        // the rules loaded at start (over xDS: with the first snapshot)
        stats.config_load(true);
    }
    if let (Some(target), Some(counters)) = (statsd, statsd_counters) {
        tracing::info!(%target, every = ?args.statsd_flush_interval, "statsd on");
        let errors = metrics.statsd_send_errors();
        let every = args.statsd_flush_interval.max(Duration::from_millis(10));
        tokio::spawn(async move {
            if let Err(e) = statsd::flush_every(counters, target, every, errors).await {
                tracing::error!(error = %e, "statsd stopped");
            }
        });
    }
    Ok(metrics)
}

/// Step 3: rules kept current, from xDS or by watching `--config`; the
/// reloader (also the admin face's `/reload`).
fn keep_rules_current(
    args: &ServeArgs,
    opts: LoadOptions,
    xds: Option<XdsSettings>,
    rules: &SharedRules,
    metrics: &Arc<Metrics>,
) -> Result<Arc<Reloader>> {
    let reloader = Reloader::new(
        args.config.clone(),
        opts.clone(),
        rules.clone(),
        metrics.clone(),
    );
    match xds {
        Some(settings) => {
            tracing::info!(server = %settings.server, node = %settings.node_id, "rules from xDS");
            tokio::spawn(crate::sources::xds::run(
                settings,
                opts,
                rules.clone(),
                metrics.clone(),
            ));
        }
        None => reloader
            .spawn()
            .with_context(|| format!("cannot watch {} for changes", args.config.display()))?,
    }

    Ok(reloader)
}

/// The store, the RLQS ledger with Redis, and the main Redis store itself.
type OpenStore = (
    Arc<dyn Store>,
    Option<Arc<dyn QuotaLedger>>,
    Option<Arc<RedisStore>>,
);

/// Step 4: the store (memory, or Redis behind its breakers) and, with
/// Redis, the RLQS ledger on the same connections.
async fn open_store(args: &ServeArgs, metrics: &Arc<Metrics>) -> Result<OpenStore> {
    let mut quota_ledger: Option<Arc<dyn QuotaLedger>> = None;
    let mut main_redis = None;
    let store: Arc<dyn Store> = match args.store {
        StoreKind::Memory => {
            let memory = Arc::new(
                MemoryStore::with_cap(
                    MonotonicClock::new(),
                    args.max_buckets,
                    Some(metrics.eviction_sink()),
                )
                .with_attempts(args.max_attempts, Some(metrics.expiry_sink())),
            );
            memory.spawn_sweeper(Duration::from_secs(1), metrics.clone());
            memory
        }
        StoreKind::Redis => {
            let url = args
                .redis_url
                .clone()
                .context("--store redis needs --redis-url (or RLS_REDIS_URL)")?;
            let (redis, settings) = open_redis(args, url, None, metrics).await?;
            main_redis = Some(redis.clone());
            // RLQS budgets are split across replicas in the same Redis,
            // through the decisions' breakers
            let guarded = Arc::new(Breakers::new(redis, metrics.clone()));
            quota_ledger = Some(Arc::new(RedisLedger::new(guarded.clone())));
            let main: Arc<dyn Store> = guarded;
            match &args.redis_persecond_url {
                None => main,
                Some(url) => {
                    let per_second = PerSecondSettings {
                        pool_size: args.redis_persecond_pool_size,
                        timeout: args.redis_persecond_timeout,
                        password_file: args.redis_persecond_password_file.clone(),
                    };
                    let (redis, _) = open_redis(args, url.clone(), Some(per_second), metrics)
                        .await
                        .context("the per-second Redis (--redis-persecond-url)")?;
                    tracing::info!(url = %crate::store::redis::url::redact(url), main = %crate::store::redis::url::redact(&settings.url), "rules whose every bucket refills per second are decided in the per-second Redis");
                    Arc::new(PerSecondSplit::new(
                        main,
                        Arc::new(Breakers::new(redis, metrics.clone())),
                    ))
                }
            }
        }
    };
    if args.redis_persecond_url.is_some() && args.store != StoreKind::Redis {
        anyhow::bail!("--redis-persecond-url needs --store redis: per-second rules go to a second Redis beside the first");
    }
    Ok((store, quota_ledger, main_redis))
}

/// This instance's id among those counting themselves in Redis.
fn instance_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// Step 4b: how many instances share the store: `--instances` when given;
/// else, on the Redis store, those announcing themselves there, this one
/// announced and counted once now (1 if Redis does not answer yet); else 1.
/// With this instance's id.
async fn first_count_of_instances(
    args: &ServeArgs,
    redis: Option<&RedisStore>,
    metrics: &Arc<Metrics>,
) -> (Instances, String) {
    let instances = Instances::new(args.instances.unwrap_or(1));
    let id = instance_id();
    if let (None, Some(redis)) = (args.instances, redis) {
        match redis.announce(&id, ANNOUNCE_TTL).await {
            Ok(n) if crate::instances::plausible(n).is_none() => {
                metrics.untrusted_refused("instances", "too_many");
            }
            Ok(n) => {
                instances.set(n);
                tracing::info!(
                    instances = n,
                    "instances counted in Redis (each announces itself; --instances overrides)"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "instances not counted yet (Redis did not answer): 1 until it does")
            }
        }
    }
    metrics.set_instances(instances.get());
    (instances, id)
}

/// Announces this instance every [`ANNOUNCE_EVERY`] and keeps `instances`
/// at the count, the last one while Redis does not answer, until `stopped`;
/// then withdraws the announcement (the others count one fewer at once).
fn keep_counting_instances(
    redis: Arc<RedisStore>,
    instances: Instances,
    id: String,
    metrics: Arc<Metrics>,
    mut stopped: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(ANNOUNCE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = async { stopped.wait_for(|s| *s).await.map(|_| ()) } => {
                    let _ = redis.announce(&id, Duration::ZERO).await;
                    return;
                }
            }
            match redis.announce(&id, ANNOUNCE_TTL).await {
                Ok(n) if crate::instances::plausible(n).is_none() => {
                    // a set someone else filled: the last count stands
                    metrics.untrusted_refused("instances", "too_many");
                }
                Ok(n) => {
                    let before = instances.set(n);
                    if before != n.max(1) {
                        tracing::info!(instances = n, before, "instances counted in Redis changed");
                    }
                    metrics.set_instances(instances.get());
                }
                Err(e) => {
                    tracing::debug!(error = %e, kept = instances.get(), "instances not counted (Redis did not answer): the last count stands")
                }
            }
        }
    })
}

/// What the per-second Redis sets apart from the main one.
struct PerSecondSettings {
    pool_size: Option<u32>,
    timeout: Option<Duration>,
    password_file: Option<std::path::PathBuf>,
}

/// Connects one Redis store (the main one, or with `per_second` the
/// per-second one) with the TLS files, layout and key prefix of `args`.
async fn open_redis(
    args: &ServeArgs,
    url: String,
    per_second: Option<PerSecondSettings>,
    metrics: &Arc<Metrics>,
) -> Result<(Arc<RedisStore>, RedisSettings)> {
    let (pool_size, timeout) = match &per_second {
        None => (args.redis_pool_size, args.redis_timeout),
        Some(p) => (
            p.pool_size.unwrap_or(args.redis_pool_size),
            p.timeout.unwrap_or(args.redis_timeout),
        ),
    };
    let settings = RedisSettings {
        url,
        timeout,
        pool_size: pool_size as usize,
        serving_threads: args.serving_threads(),
        batch: args.redis_batch,
        ca_file: args.redis_ca_file.clone(),
        client_cert: args
            .redis_client_cert
            .clone()
            .zip(args.redis_client_key.clone()),
        layout: args.redis_bucket_layout,
        key_prefix: args.redis_key_prefix.clone(),
        expiry_jitter_max_secs: args.redis_expiration_jitter_max_seconds,
        skip_hostname_verification: args.redis_tls_skip_hostname_verification,
        // each Redis its own (--redis-persecond-password-file)
        password_file: match &per_second {
            None => args.redis_password_file.clone(),
            Some(p) => p.password_file.clone(),
        },
    };
    if settings.skip_hostname_verification && per_second.is_none() {
        tracing::warn!(
            "--redis-tls-skip-hostname-verification: Redis servers' certificates are checked against the CA but not their names; any certificate the CA signed is taken for any server"
        );
    }
    let redis = RedisStore::connect(&settings)
        .await
        .map_err(anyhow::Error::msg)?
        .with_metrics(metrics.clone());
    let redis = Arc::new(redis);
    redis.spawn_memory_watch(metrics.clone());
    Ok((redis, settings))
}

/// Rules with `attempts:` on the memory store with `--instances` above 1:
/// each instance remembers only the attempts it decided, so behind one
/// Envoy a done call that reaches another instance finds nothing (a slot
/// stays held until its ttl, a reservation is charged twice). Said at
/// start, naming the rules (a reload that adds such a rule is not).
fn warn_of_attempts_in_memory(args: &ServeArgs, rules: &rules::RuleSet) {
    let instances = args.instances.unwrap_or(1);
    if args.store != StoreKind::Memory || instances <= 1 {
        return;
    }
    let with_attempts = rules.attempt_rules();
    if with_attempts.is_empty() {
        return;
    }
    tracing::warn!(
        instances,
        rules = %with_attempts.join(", "),
        "rules with attempts on the memory store with several instances: each instance remembers only its own attempts, so a done call that reaches another instance finds nothing (a slot stays held until its ttl, a reservation is charged twice); use --store redis for attempts across instances (docs/usage.md)"
    );
}

/// Step 5: the limiter over the store and, on a region, its share of the
/// global budgets and the client that keeps them.
fn build_limiter(
    args: &ServeArgs,
    store: Arc<dyn Store>,
    instances: &(Instances, String),
    rules: &SharedRules,
    metrics: &Arc<Metrics>,
) -> Result<(Arc<Limiter>, Option<JoinHandle<()>>)> {
    let mut limiter = Limiter::with_max_in_flight(
        store,
        args.failure_mode,
        instances.0.clone(),
        metrics.clone(),
        usize::try_from(args.max_in_flight).unwrap_or(usize::MAX),
    )
    .with_calendar_offset(args.calendar_clock_offset)
    .with_quota_mode(args.quota_mode)
    // nothing is refused in shadow mode, and each descriptor spends on its
    // own in envoyproxy/ratelimit's quota mode: nothing to give back
    .with_per_descriptor_spending(
        args.per_descriptor_spending || args.shadow_mode || args.quota_mode,
    );
    let mut upstream_task = None;
    if let Some(upstream) = args.upstream_settings() {
        upstream.validate()?;
        let shares = Arc::new(crate::quota::region::RegionShares::new(upstream.regions));
        limiter = limiter.with_regions(shares.clone());
        upstream_task = Some(tokio::spawn(crate::quota::upstream::run(
            upstream,
            shares,
            rules.clone(),
            metrics.clone(),
        )));
    }
    Ok((Arc::new(limiter), upstream_task))
}

/// SIGTERM and SIGINT, watched from [`Signals::watch`] on.
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn watch() -> Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                term: signal(SignalKind::terminate()).context("cannot watch SIGTERM")?,
                int: signal(SignalKind::interrupt()).context("cannot watch SIGINT")?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// The next SIGTERM or SIGINT.
    async fn next(&mut self) -> Result<()> {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.term.recv() => {}
                _ = self.int.recv() => {}
            }
            Ok(())
        }
        #[cfg(not(unix))]
        tokio::signal::ctrl_c().await.context("cannot watch Ctrl-C")
    }
}
