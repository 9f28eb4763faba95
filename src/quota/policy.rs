//! What the rules say about an RLQS bucket: the policy its rule gives it
//! (a share of a budget, or a blanket rule), and the descriptions of that
//! mapping that `/config` and `check-config --rlqs` show.

use super::allocation::Budget;
use super::{BucketKey, MAX_BUCKETS_PER_STREAM, MAX_PAIRS_PER_SHARED_BUCKET};
use crate::rules::matcher::{BucketValue, Rule, RuleAction};
use crate::rules::unit::FailureMode;
use crate::rules::RuleSet;

/// What a bucket's rule says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    AllowAll,
    DenyAll,
    /// Split this budget between the Envoys reporting the bucket.
    Shared(Budget),
}

impl Policy {
    /// The rule `pairs` reach in `domain`.
    pub fn of(rules: &RuleSet, domain: &str, pairs: &[(String, String)]) -> Policy {
        let entries: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let Some(path) = rules.quota_path(domain, &entries) else {
            return Policy::AllowAll;
        };
        match rules.lookup(domain, &path) {
            Some(m) => Policy::of_rule(m.rule),
            None => Policy::AllowAll,
        }
    }

    /// What RLQS gives the buckets that reach `rule`.
    pub fn of_rule(rule: &Rule) -> Policy {
        if rule.shadow_mode {
            return Policy::AllowAll;
        }
        let RuleAction::Limited(limits) = &rule.action else {
            return Policy::AllowAll;
        };
        let strictest = limits
            .iter()
            .min_by(|a, b| a.params.rate_per_sec().total_cmp(&b.params.rate_per_sec()));
        match strictest {
            None => Policy::AllowAll,
            Some(l) if l.params.tokens_per_unit == 0 || l.params.capacity == 0 => Policy::DenyAll,
            Some(l) => Policy::Shared(Budget {
                burst: l.params.capacity as f64,
                rate: l.params.rate_per_sec(),
            }),
        }
    }
}

/// The shared bucket bucket id `id` spends: `None` when the rule it
/// reaches names its bucket by its own values only; else, where that rule's
/// path has a `share_threshold` pattern, the id with each such value
/// replaced by the pattern (and marked so in [`BucketKey::shared`]), as
/// `ShouldRateLimit` spends one bucket for every value the pattern matches.
pub fn shared_key(rules: &RuleSet, id: &BucketKey) -> Option<BucketKey> {
    let entries: Vec<(&str, &str)> = id
        .pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let path = rules.quota_path(&id.domain, &entries)?;
    let found = rules.lookup(&id.domain, &path)?;
    if !found
        .values
        .iter()
        .any(|v| matches!(v, BucketValue::Shared(_)))
    {
        return None;
    }
    let mut pairs: Vec<(String, String, bool)> = path
        .iter()
        .zip(&found.values)
        .map(|((k, v), value)| match value {
            BucketValue::Shared(pattern) => (k.to_string(), pattern.to_string(), true),
            BucketValue::Value(_) => (k.to_string(), v.to_string(), false),
        })
        .collect();
    pairs.sort_unstable();
    let shared = pairs
        .iter()
        .enumerate()
        .filter(|(_, (_, _, shared))| *shared)
        .fold(0u64, |bits, (i, _)| bits | 1 << i);
    Some(BucketKey {
        domain: id.domain.clone(),
        pairs: pairs.into_iter().map(|(k, v, _)| (k, v)).collect(),
        shared,
    })
}

/// For `/config`: what RLQS gives the buckets of each rule of `domain`,
/// and the `bucket_id` keys that reach it (the rule's descriptor keys, in
/// any order), by path.
pub fn describe_domain(rules: &RuleSet, domain: &str) -> serde_json::Value {
    let mut domain_rules = rules.rules(domain);
    domain_rules.sort_by(|a, b| a.path.cmp(&b.path));
    let entries: Vec<serde_json::Value> = domain_rules
        .into_iter()
        .map(|rule| {
            let assignment = match Policy::of_rule(rule) {
                Policy::AllowAll => serde_json::json!("ALLOW_ALL"),
                Policy::DenyAll => serde_json::json!("DENY_ALL"),
                Policy::Shared(b) => serde_json::json!({
                    "split_between_envoys": {"burst": b.burst, "per_second": b.rate},
                }),
            };
            serde_json::json!({
                "rule": rule.label(),
                "path": rule.path,
                "bucket_id_keys": rule.keys,
                "assignment": assignment,
                "expired_assignment_behavior": expired_behavior(rule),
                "notes": rule_notes(rule),
            })
        })
        .collect();
    serde_json::Value::Array(entries)
}

/// The `expired_assignment_behavior` to give the Envoy bucket settings of
/// `rule`'s buckets, from its `failure_mode` (what Envoy does when it holds
/// no live assignment, the RLQS counterpart of a store failure): `open`
/// admits, `closed` denies, `local` enforces a token bucket of its share
/// (give it the rule's budget divided by the number of Envoys). Envoy 1.40
/// applies only `fallback_rate_limit` there (`reuse_last_assignment` falls
/// back to `no_assignment_behavior`).
pub fn expired_behavior(rule: &Rule) -> String {
    match rule.failure_mode {
        Some(FailureMode::Open) => "fallback_rate_limit: {blanket_rule: ALLOW_ALL}".into(),
        Some(FailureMode::Closed) => "fallback_rate_limit: {blanket_rule: DENY_ALL}".into(),
        Some(FailureMode::Local) => match Policy::of_rule(rule) {
            Policy::Shared(b) => format!(
                "fallback_rate_limit: {{token_bucket: ...}} of 1/N of burst {} and of {}/s (N: the Envoys)",
                b.burst,
                (b.rate * 1000.0).round() / 1000.0
            ),
            Policy::AllowAll => "fallback_rate_limit: {blanket_rule: ALLOW_ALL}".into(),
            Policy::DenyAll => "fallback_rate_limit: {blanket_rule: DENY_ALL}".into(),
        },
        None => "as the server's --failure-mode (open: ALLOW_ALL, closed: DENY_ALL)".into(),
    }
}

/// What RLQS does differently from `ShouldRateLimit` with `rule`, for
/// `check-config --rlqs` and `/config`.
pub fn rule_notes(rule: &Rule) -> Vec<String> {
    let mut notes = Vec::new();
    if rule.shadow_mode {
        notes.push("shadow_mode: RLQS assigns ALLOW_ALL".to_string());
    }
    if let RuleAction::Limited(limits) = &rule.action {
        if limits.len() > 1 {
            notes.push(format!(
                "{} limits: RLQS splits the one with the lowest rate only",
                limits.len()
            ));
        }
        let windows: Vec<&str> = limits
            .iter()
            .filter(|l| l.algorithm != crate::bucket::Algorithm::TokenBucket)
            .map(|l| l.algorithm.name())
            .collect();
        if let Some(name) = windows.first() {
            notes.push(format!(
                "{name}: RLQS's token buckets have no windows or calendar periods; it assigns a token bucket of the same average rate (requests_per_unit over the unit, a month as 30 days)"
            ));
        }
    }
    for (key, pattern) in &rule.shared_values {
        notes.push(format!(
            "share_threshold: every bucket id whose '{key}' matches '{pattern}' spends one budget, split between the (Envoy, bucket id) pairs reporting them (at most {MAX_PAIRS_PER_SHARED_BUCKET})"
        ));
    }
    if let RuleAction::Concurrency { max } = &rule.action {
        notes.push(format!(
            "concurrency {max}: applies to ShouldRateLimit only (RLQS sees no attempts); RLQS assigns ALLOW_ALL"
        ));
    }
    if rule.overdraft {
        notes.push(
            "overdraft: applies to ShouldRateLimit only (Envoy's own token buckets hold no debt)"
                .to_string(),
        );
    }
    if rule.lease.is_some() {
        notes.push(
            "lease: applies to ShouldRateLimit only (RLQS splits the budget between Envoys itself)"
                .to_string(),
        );
    }
    if rule.max_values.is_some() {
        notes.push(format!(
            "max_values: applies to ShouldRateLimit only (RLQS: every bucket id is its own bucket, at most {MAX_BUCKETS_PER_STREAM} per stream)"
        ));
    }
    notes
}

/// The metric label of the rule `pairs` reach in `domain`.
pub(crate) fn rule_label(
    rules: &RuleSet,
    domain: &str,
    pairs: &[(String, String)],
) -> Option<String> {
    let entries: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let path = rules.quota_path(domain, &entries)?;
    rules
        .lookup(domain, &path)
        .map(|m| m.rule.label().to_owned())
}
