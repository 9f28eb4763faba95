//! The admin HTTP endpoint: `/healthz`, `/readyz` and `/config`.
//!
//! Sits beside the request path and only reads the shared rules snapshot.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json};
use axum::routing::get;
use axum::Router;
use serde_json::json;

use crate::service::SharedRules;

#[derive(Clone)]
pub struct AdminState {
    pub rules: SharedRules,
    pub store: &'static str,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/config", get(config))
        .with_state(state)
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    let rules = state.rules.load();
    if rules.generation() == 0 {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "rules not loaded\n".to_string(),
        )
    } else {
        (
            StatusCode::OK,
            format!(
                "ready: rules generation {}, store {}\n",
                rules.generation(),
                state.store
            ),
        )
    }
}

async fn config(State(state): State<AdminState>) -> impl IntoResponse {
    let rules = state.rules.load();
    let mut domains: Vec<_> = rules
        .domains()
        .map(|d| {
            json!({
                "domain": &*d.name,
                "files": d.files,
                "rules": rules.rules(&d.name),
            })
        })
        .collect();
    domains.sort_by(|a, b| a["domain"].as_str().cmp(&b["domain"].as_str()));
    Json(json!({
        "generation": rules.generation(),
        "store": state.store,
        "files": rules.files(),
        "domains": domains,
    }))
}
