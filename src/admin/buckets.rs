//! The bucket inspector (`GET /v1/buckets`) and an operator's reset
//! (`POST /v1/buckets/reset`): a descriptor named in the query, its rule
//! and buckets found as a request's would be, then asked whether one more
//! hit would pass (`hits_addend: 0`: nothing spent) or its buckets
//! forgotten (counted in `rls_bucket_resets_total`, logged with who asked).

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Json, Response};
use serde_json::json;

use super::v1::{bad_request, unknown_parameter};
use super::AdminState;
use crate::limiter::parse_descriptor;
use crate::rules::Rule;
use crate::shown::{cut_at, escaped};
use crate::store::DescriptorBuckets;

/// The domain and entries a query names, found in the rules in force.
struct Asked {
    domain: String,
    entries: Vec<(String, String)>,
}

impl Asked {
    fn borrowed(&self) -> Vec<(&str, &str)> {
        self.entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }
}

fn asked(state: &AdminState, query: &HashMap<String, String>) -> Result<Asked, Box<Response>> {
    if let Some(refused) = unknown_parameter(query, &["domain", "descriptor"]) {
        return Err(Box::new(refused));
    }
    let (Some(domain), Some(descriptor)) = (query.get("domain"), query.get("descriptor")) else {
        return Err(Box::new(bad_request(
            "give domain and descriptor (key=value,key=value)".into(),
        )));
    };
    let entries = parse_descriptor(descriptor).map_err(|e| Box::new(bad_request(e)))?;
    if !state.rules.load().has_domain(domain) {
        let domain: String = domain.chars().take(128).collect();
        return Err(Box::new(not_found(format!(
            "no domain '{domain}' in the rules in force"
        ))));
    }
    Ok(Asked {
        domain: domain.clone(),
        entries,
    })
}

/// What the query names, its rule and its buckets in the rules in force;
/// else the 4xx to answer.
fn found(
    state: &AdminState,
    query: &HashMap<String, String>,
) -> Result<(Asked, Arc<Rule>, DescriptorBuckets), Box<Response>> {
    let a = asked(state, query)?;
    let rules = state.rules.load();
    let (rule, buckets) = state
        .health
        .limiter
        .buckets_of(&rules, &a.domain, &a.borrowed())
        .ok_or_else(|| Box::new(no_rule()))?;
    Ok((a, rule, buckets))
}

fn not_found(message: String) -> Response {
    (StatusCode::NOT_FOUND, Json(json!({ "error": message }))).into_response()
}

fn no_rule() -> Response {
    not_found("no rule with a limit matches this descriptor".into())
}

/// `GET /v1/buckets?domain=D&descriptor=k=v,…`: the inspector's answer
/// (`Limiter::inspection`).
pub(super) async fn inspect(
    State(state): State<AdminState>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let credential = state.token_file.is_some() || state.client_cert_required;
    if state.metrics.shown().pseudonymises() && !credential {
        // it would tell anyone whether a value is limited: pseudonyms
        // elsewhere would hide nothing
        return (
            StatusCode::FORBIDDEN,
            Json(json!({ "error": "values are pseudonymised (--refusal-log-hash-keys): the inspector needs an operator credential (--admin-token-file or --admin-tls-client-ca)" })),
        )
            .into_response();
    }
    let (a, rule, buckets) = match found(&state, &query) {
        Ok(found) => found,
        Err(refused) => return *refused,
    };
    let rules = state.rules.load();
    let limiter = &state.health.limiter;
    match limiter
        .inspection(&rules, &a.domain, &a.entries, &rule, &buckets)
        .await
    {
        Ok(answer) => Json(answer).into_response(),
        Err((status, answer)) => (
            StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            Json(answer),
        )
            .into_response(),
    }
}

/// `POST /v1/buckets/reset?domain=D&descriptor=k=v,…`: the descriptor's
/// buckets forgotten (full again, a window's count 0), counted and logged
/// with who asked (`X-Rls-Operator`, which [`super::guard::operator`]
/// required, behind the operator credential), every part escaped.
pub(super) async fn reset(
    State(state): State<AdminState>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let (a, rule, buckets) = match found(&state, &query) {
        Ok(found) => found,
        Err(refused) => return *refused,
    };
    let limiter = &state.health.limiter;
    let who = headers
        .get(super::guard::OPERATOR_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    let who = escaped(cut_at(&who, 128)).into_owned();
    match limiter.store().forget(&buckets).await {
        Ok(removed) => {
            state.metrics.bucket_reset(rule.id);
            let shown = state.metrics.shown();
            let shown: Vec<String> = a.entries.iter().map(|(k, v)| shown.show(k, v)).collect();
            tracing::warn!(
                domain = %escaped(&a.domain),
                rule = rule.label(),
                descriptor = %shown.join(","),
                removed,
                by = %who,
                "buckets reset by an operator"
            );
            Json(json!({
                "domain": a.domain,
                "rule": rule.label(),
                "removed": removed,
                "keys": limiter.store().key_names(&buckets),
            }))
            .into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": e.to_string() })),
        )
            .into_response(),
    }
}
