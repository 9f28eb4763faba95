//! The admin HTTP endpoint: `/metrics`, `/healthz`, `/readyz`, `/config`,
//! and who is limited: the live page at `/` and the JSON behind it
//! (`/v1/…`, [`v1`]); with `--admin-token-file`, all but the probes and
//! `/metrics` need the bearer token, and with `--admin-tls-client-ca` a
//! client certificate (the port then speaks HTTPS: `--admin-tls-cert`).
//!
//! Sits beside the request path and only reads shared state.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `server`; uses `health`, `quota`, `rules`, `telemetry`.

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Json, Response};
use axum::routing::get;
use axum::Router;
use serde_json::json;

use crate::health::Health;
use crate::rules::SharedRules;
use crate::telemetry::Metrics;
use crate::tls::TlsPeer;

#[derive(Clone)]
pub struct AdminState {
    pub rules: SharedRules,
    pub health: Health,
    pub metrics: Arc<Metrics>,
    /// `--admin-token-file`: the bearer token `/`, `/v1/…` and `/config`
    /// need, read again at each request.
    pub token_file: Option<PathBuf>,
    /// `--admin-tls-client-ca`: `/`, `/v1/…` and `/config` need a client
    /// certificate that CA signed (the connection's [`TlsPeer`]).
    pub client_cert_required: bool,
    /// The Redis store the instances share their heavy hitters in: the
    /// page shows them all, added up (`None`: this instance's own).
    pub shared_hitters: Option<Arc<crate::store::redis::RedisStore>>,
}

mod buckets;
mod v1;

/// The admin page: one file, no build step, nothing fetched from
/// elsewhere; it reads `/v1/…` every second.
const PAGE: &str = include_str!("admin/page.html");

pub fn router(state: AdminState) -> Router {
    // what shows or could show request values: behind the token, if any
    let guarded = Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/v1/hitters", get(v1::hitters))
        .route("/v1/rules", get(v1::rules))
        .route("/v1/store", get(v1::store))
        .route("/v1/rlqs", get(v1::rlqs))
        .route("/v1/regions", get(v1::regions))
        .route("/v1/buckets", get(buckets::inspect))
        .route("/v1/buckets/reset", axum::routing::post(buckets::reset))
        .route("/config", get(config))
        .route_layer(middleware::from_fn_with_state(state.clone(), bearer));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        // envoyproxy/ratelimit's probe path (Envoy Gateway and Istio probe it)
        .route("/healthcheck", get(readyz))
        .route("/metrics", get(metrics))
        .merge(guarded)
        .with_state(state)
}

/// With `--admin-tls-client-ca`: the connection presented a certificate
/// that CA signed, else 403. With `--admin-token-file`: the request's
/// `Authorization: Bearer <token>` must be the file's token (read now: a
/// rotated Secret applies at once); else 401. A file that cannot be read
/// refuses every request (503, the file named, never its content).
async fn bearer(State(state): State<AdminState>, request: Request, next: Next) -> Response {
    if state.client_cert_required
        && !request
            .extensions()
            .get::<ConnectInfo<TlsPeer>>()
            .is_some_and(|peer| peer.0.certified)
    {
        return (
            StatusCode::FORBIDDEN,
            "a client certificate signed by --admin-tls-client-ca is needed\n",
        )
            .into_response();
    }
    let Some(file) = &state.token_file else {
        return next.run(request).await;
    };
    let token = match std::fs::read_to_string(file) {
        Ok(t) if !t.trim().is_empty() => t.trim().to_string(),
        Ok(_) | Err(_) => {
            tracing::warn!(file = %file.display(), "--admin-token-file cannot be read or is empty: the admin pages are refused");
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the admin token file {} cannot be read\n", file.display()),
            )
                .into_response();
        }
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    // compared without stopping at the first difference
    let same = given.is_some_and(|g| {
        g.len() == token.len()
            && g.bytes()
                .zip(token.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    });
    if same {
        return next.run(request).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        "a bearer token is needed (--admin-token-file)\n",
    )
        .into_response()
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
