//! The JSON behind the admin page (`/v1/…`), read by the page and by
//! anyone: who is limited (`/v1/hitters`), the rules in force and their
//! decisions (`/v1/rules`), the store's health (`/v1/store`), RLQS streams
//! (`/v1/rlqs`) and regions (`/v1/regions`). Bad input gets a 400 naming
//! the parameter; nothing here spends.

use std::collections::HashMap;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use serde_json::json;

use super::AdminState;

/// The most rows `n` may ask for: with `--heavy-hitters` at most 256,
/// one read of 100 rules stays within a few MB (docs/security.md).
const MAX_ROWS: usize = 100;

/// A 400 with `message`, as JSON.
pub(super) fn bad_request(message: String) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({ "error": message }))).into_response()
}

/// A 400 naming the first of `query`'s parameters that is not `known`.
pub(super) fn unknown_parameter(
    query: &HashMap<String, String>,
    known: &[&str],
) -> Option<Response> {
    let other = query.keys().find(|k| !known.contains(&k.as_str()))?;
    let other: String = other.chars().take(64).collect();
    Some(bad_request(if known.is_empty() {
        format!("unknown parameter '{other}' (this path takes none)")
    } else {
        format!("unknown parameter '{other}' (known: {})", known.join(", "))
    }))
}

/// `GET /v1/hitters[?n=10][&domain=d]`: per rule, the `n` descriptor
/// values refused most and admitted most over the last minute and hour.
pub(super) async fn hitters(
    State(state): State<AdminState>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    if let Some(refused) = unknown_parameter(&query, &["n", "domain"]) {
        return refused;
    }
    let n = match query.get("n").map(|v| v.parse::<usize>()) {
        None => 10,
        Some(Ok(n)) if (1..=MAX_ROWS).contains(&n) => n,
        Some(_) => return bad_request(format!("n must be a whole number from 1 to {MAX_ROWS}")),
    };
    let Some(hitters) = state.metrics.hitters() else {
        return Json(json!({
            "counters": 0,
            "rules": [],
            "note": "heavy hitters are off (--heavy-hitters 0)",
        }))
        .into_response();
    };
    // behind several instances on one Redis: every instance's, added up
    let mut merged = false;
    let mut rules = match &state.shared_hitters {
        None => hitters.top(n),
        Some(redis) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let shared = match redis.shared_hitter_rules().await {
                Ok(names) => {
                    let names = rules_in_force(&state, names);
                    let metrics = &state.metrics;
                    crate::telemetry::hitters::shared_tops(
                        &names,
                        now,
                        n,
                        hitters.counters(),
                        |key| async move { redis.shared_hitters(&key).await },
                        |why| metrics.untrusted_refused("hitters", why.label()),
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            match shared {
                Ok(tops) => {
                    merged = true;
                    tops
                }
                Err(e) => {
                    tracing::debug!(error = %e, "shared heavy hitters not read: this instance's own shown");
                    hitters.top(n)
                }
            }
        }
    };
    if let Some(domain) = query.get("domain") {
        if !state.rules.load().has_domain(domain) {
            let domain: String = domain.chars().take(128).collect();
            return (
                StatusCode::NOT_FOUND,
                Json(json!({ "error": format!("no domain '{domain}' in the rules in force") })),
            )
                .into_response();
        }
        rules.retain(|r| &r.domain == domain);
    }
    Json(json!({
        "counters": hitters.counters(),
        "instances": if merged { "all sharing the Redis store (written every 2 s)" } else { "this one" },
        "bound": "each count is at most `error` above the true count, and error ≤ hits / counters",
        "rules": rules,
    }))
    .into_response()
}

/// Of the rules named in Redis (`<domain>\0<rule>`), those in force here:
/// a name anyone wrote there costs no read.
fn rules_in_force(state: &AdminState, names: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let rules = state.rules.load();
    names
        .into_iter()
        .filter(|name| {
            let name = String::from_utf8_lossy(name);
            name.split_once('\0').is_some_and(|(domain, rule)| {
                rules.has_domain(domain) && rules.rules(domain).iter().any(|r| r.label() == rule)
            })
        })
        .collect()
}

/// `GET /v1/rules`: the rules in force (domain, rule, the file it came
/// from), with the decisions each has made since start.
pub(super) async fn rules(State(state): State<AdminState>) -> Response {
    let rules = state.rules.load();
    let totals: HashMap<(String, String), (u64, u64)> = state
        .metrics
        .rule_totals()
        .into_iter()
        .map(|(d, r, ok, over)| ((d.to_string(), r.to_string()), (ok, over)))
        .collect();
    let mut out = Vec::new();
    for domain in rules.domains() {
        for rule in rules.rules(&domain.name) {
            let key = (domain.name.to_string(), rule.label().to_string());
            let (admitted, refused) = totals.get(&key).copied().unwrap_or_default();
            out.push(json!({
                "domain": &*domain.name,
                "rule": rule.label(),
                "path": rule.path,
                "source": rule.source,
                "admitted": admitted,
                "refused": refused,
            }));
        }
    }
    out.sort_by(|a, b| {
        (a["domain"].as_str(), a["rule"].as_str()).cmp(&(b["domain"].as_str(), b["rule"].as_str()))
    });
    Json(json!({
        "generation": rules.generation(),
        "in_force_since": rules.in_force_since(),
        "files": rules.files().iter().map(|f| &f.path).collect::<Vec<_>>(),
        "rules": out,
    }))
    .into_response()
}

/// `GET /v1/store`: readiness, each Redis node's breaker, and the answers
/// each failure mode gave since start.
pub(super) async fn store(State(state): State<AdminState>) -> Response {
    let health = state.metrics.store_health();
    let (breakers, answers) = (health.breakers, health.answers);
    let readiness = state.health.readiness();
    Json(json!({
        "store": state.health.limiter.store_name(),
        "ready": readiness.is_ok(),
        "detail": readiness.unwrap_or_else(|e| e),
        "breakers": breakers
            .into_iter()
            .map(|(node, open)| json!({ "node": node, "open": open }))
            .collect::<Vec<_>>(),
        "failure_mode_answers": answers
            .into_iter()
            .map(|(mode, n)| json!({ "mode": mode, "answers": n }))
            .collect::<Vec<_>>(),
    }))
    .into_response()
}

/// `GET /v1/rlqs`: the RLQS face, when it runs: streams open (by domain),
/// buckets, (stream, bucket) pairs and those only held for departed
/// Envoys, bytes queued to streams, and the shared ledger's state.
pub(super) async fn rlqs(
    State(state): State<AdminState>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    if let Some(refused) = unknown_parameter(&query, &[]) {
        return refused;
    }
    match &state.health.quota {
        Some(hub) => {
            let s = hub.snapshot();
            Json(json!({
                "running": true,
                "streams": s.streams,
                "streams_by_domain": s
                    .streams_by_domain
                    .iter()
                    .map(|(domain, n)| json!({ "domain": domain, "streams": n }))
                    .collect::<Vec<_>>(),
                "buckets": s.buckets,
                "pairs": s.pairs,
                "held": s.held,
                "outbox_bytes": s.outbox_bytes,
                "ledger": s.ledger,
                "ledger_trouble": s.ledger_trouble,
            }))
            .into_response()
        }
        None => Json(json!({ "running": false })).into_response(),
    }
}

/// `GET /v1/regions`: this instance's place among regions. As a region
/// (`--quota-upstream`): the regions counted, whether the global tier is
/// reachable, the global rules' buckets held and the seconds since the
/// last assignment. As the global tier (regions report here): the
/// regions expected and those reporting.
pub(super) async fn regions(
    State(state): State<AdminState>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    if let Some(refused) = unknown_parameter(&query, &[]) {
        return refused;
    }
    let region = state.health.limiter.region_shares().map(|shares| {
        let since = shares.since_last_assignment(shares.now_micros());
        json!({
            "regions": shares.regions(),
            "upstream_reachable": shares.reachable(),
            "buckets": shares.len(),
            "since_last_assignment_secs": since.map(|us| us as f64 / 1e6),
        })
    });
    // (the regions alone: not the RLQS state's lock)
    let global = state.health.quota.as_ref().and_then(|hub| {
        let (expected, reporting) = hub.regions_reporting();
        (expected.is_some() || !reporting.is_empty()).then(|| {
            json!({
                "regions_expected": expected,
                "regions_reporting": reporting,
            })
        })
    });
    Json(json!({ "region": region, "global_tier": global })).into_response()
}
