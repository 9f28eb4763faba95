//! The admin HTTP endpoint: `/metrics`, `/healthz`, `/readyz` and `/config`.
//!
//! Sits beside the request path and only reads shared state.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `server`; uses `health`, `quota`, `rules`, `telemetry`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Json};
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
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        // envoyproxy/ratelimit's probe path (Envoy Gateway and Istio probe it)
        .route("/healthcheck", get(readyz))
        .route("/metrics", get(metrics))
        .route("/config", get(config))
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
