//! The admin HTTP endpoint: `/metrics`, `/healthz`, `/readyz`, `/config`,
//! and who is limited: the live page at `/` and the JSON behind it
//! (`/v1/…`, [`v1`]); with `--admin-token-file`, all but the probes,
//! `/metrics` and the page's static shell need the bearer token, and with
//! `--admin-tls-client-ca` a client certificate (the port then speaks
//! HTTPS: `--admin-tls-cert`). A bucket reset needs one of those to be
//! configured at all, and an operator named ([`guard`]).
//!
//! Sits beside the request path and only reads shared state, but for an
//! operator's reset.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `server`; uses `health`, `quota`, `rules`, `telemetry`.

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{Html, IntoResponse, Json};
use axum::routing::get;
use axum::Router;
use serde_json::json;

use crate::health::Health;
use crate::rules::SharedRules;
use crate::telemetry::Metrics;

#[derive(Clone)]
pub struct AdminState {
    pub rules: SharedRules,
    pub health: Health,
    pub metrics: Arc<Metrics>,
    /// `--admin-token-file`: the bearer token `/`, `/v1/…` and `/config`
    /// need, read again at each request.
    pub token_file: Option<PathBuf>,
    /// `--admin-tls-client-ca`: `/v1/…` and `/config` need a client
    /// certificate that CA signed (the connection's TLS peer).
    pub client_cert_required: bool,
    /// `--admin-allowed-hosts`: names (beyond addresses and `localhost`)
    /// the guarded paths answer under ([`guard::host_allowed`]).
    pub allowed_hosts: Vec<String>,
    /// The Redis store the instances share their heavy hitters in: the
    /// page shows them all, added up (`None`: this instance's own).
    pub shared_hitters: Option<Arc<crate::store::redis::RedisStore>>,
}

mod buckets;
pub mod guard;
mod v1;

/// The admin page: one file, no build step, nothing fetched from
/// elsewhere; it reads `/v1/…` every second.
const PAGE: &str = include_str!("admin/page.html");
const PAGE_SCRIPT: &str = include_str!("admin/page.js");
const PAGE_STYLE: &str = include_str!("admin/page.css");

pub fn router(state: AdminState) -> Router {
    // what changes state: an operator, with a credential (guard.rs)
    let writes = Router::new()
        .route("/v1/buckets/reset", axum::routing::post(buckets::reset))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            guard::operator,
        ));
    // what shows or could show request values: behind the credential, if
    // any, and answered only under a host of this port's
    let guarded = Router::new()
        .route("/v1/hitters", get(v1::hitters))
        .route("/v1/rules", get(v1::rules))
        .route("/v1/store", get(v1::store))
        .route("/v1/rlqs", get(v1::rlqs))
        .route("/v1/regions", get(v1::regions))
        .route("/v1/buckets", get(buckets::inspect))
        .route("/config", get(config))
        .merge(writes)
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            guard::credential,
        ))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard::host));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        // envoyproxy/ratelimit's probe path (Envoy Gateway and Istio probe it)
        .route("/healthcheck", get(readyz))
        .route("/metrics", get(metrics))
        // the page's shell: no values in it (it reads them from /v1/…)
        .route("/", get(|| async { Html(PAGE) }))
        .route(
            "/page.js",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
                    PAGE_SCRIPT,
                )
            }),
        )
        .route(
            "/page.css",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
                    PAGE_STYLE,
                )
            }),
        )
        .merge(guarded)
        .layer(middleware::from_fn(guard::headers))
        .with_state(state)
}

/// `/metrics` alone at `path` (`--prometheus-addr`).
pub fn metrics_router(path: &str, metrics: Arc<Metrics>) -> Router {
    Router::new().route(
        path,
        get(move || {
            let metrics = metrics.clone();
            async move {
                (
                    [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    metrics.render(),
                )
            }
        }),
    )
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    match state.health.readiness() {
        Ok(detail) => (StatusCode::OK, format!("ready: {detail}\n")),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        ),
    }
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}

async fn config(State(state): State<AdminState>) -> impl IntoResponse {
    let rules = state.rules.load();
    let mut domains: Vec<_> = rules
        .domains()
        .map(|d| {
            json!({
                "domain": &*d.name,
                "files": d.files,
                "usage_domain": d.usage,
                "rules": rules.rules(&d.name),
                "rlqs": crate::quota::describe_domain(&rules, &d.name),
            })
        })
        .collect();
    domains.sort_by(|a, b| a["domain"].as_str().cmp(&b["domain"].as_str()));
    Json(json!({
        "generation": rules.generation(),
        "store": state.health.limiter.store_name(),
        "files": rules.files(),
        "domains": domains,
    }))
}
