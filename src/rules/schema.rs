//! The YAML rule format as written by operators, before validation.
//!
//! A superset of envoyproxy/ratelimit's schema (see docs/architecture.md §3). Every struct
//! denies unknown fields, so `ratelimit:` for `rate_limit:` is an error with
//! a line number instead of a rule that silently does nothing. Keys and values
//! accept any YAML scalar (`value: 500` means the string "500"), as Go's YAML
//! decoder does for envoyproxy/ratelimit.

use serde::{Deserialize, Deserializer, Serialize};

/// One rules file: one domain.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RulesFile {
    #[serde(default, deserialize_with = "opt_scalar_string")]
    pub domain: Option<String>,
    /// Outer `None`: the field is absent; `Some(None)`: present but null.
    #[serde(
        default,
        deserialize_with = "present_or_null",
        skip_serializing_if = "Option::is_none"
    )]
    pub descriptors: Option<Option<Vec<DescriptorDoc>>>,
}

/// One node of the descriptor tree.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorDoc {
    #[serde(default, deserialize_with = "opt_scalar_string")]
    pub key: Option<String>,
    #[serde(
        default,
        deserialize_with = "opt_scalar_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitDoc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<Vec<RateLimitDoc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub descriptors: Option<Vec<DescriptorDoc>>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub shadow_mode: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub quota_mode: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub detailed_metric: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub value_to_metric: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub share_threshold: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_yaml::Value>,
    /// Hot keys: spend the shared bucket through local leases (ours, not in
    /// envoyproxy/ratelimit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseDoc>,
    /// Usage accounting: a spend is never refused, the bucket may go into
    /// debt down to minus its burst (ours, not in envoyproxy/ratelimit).
    #[serde(default, skip_serializing_if = "is_false")]
    pub overdraft: bool,
    /// How the rule counts: `token_bucket` (the default), `fixed_window`
    /// (envoyproxy/ratelimit's arithmetic) or `sliding_window` (the
    /// weighted two-window counter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    /// At most this many distinct descriptors of the rule get buckets of
    /// their own; the rest share one (ours, not in envoyproxy/ratelimit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_values: Option<u64>,
    /// `regional` (the default) or `global`: with `global`, the regions
    /// started with `--quota-upstream` share one budget for the rule
    /// (docs/regions.md; ours, not in envoyproxy/ratelimit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// Attempt identity (ours): the descriptor entry naming the attempt,
    /// how long it is remembered, and on an `overdraft` rule the
    /// reservation a start makes when it brings no cost of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<AttemptsDoc>,
    /// At most this many attempts in flight per descriptor (ours): a slot
    /// taken by the request-time call, released by the done call or by
    /// the attempts' `ttl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    /// On an `overdraft` rule: the most debt a charge may leave, in tokens
    /// (ours; default one burst). What it cuts off is counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_debt: Option<u64>,
    /// Redis store: an admission is answered only once this many replicas
    /// hold it (ours; docs/redis.md "Failovers that lose nothing").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<ReplicationDoc>,
}

/// `replication: {replicas: 2, timeout: 50ms}`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicationDoc {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    #[serde(
        default,
        deserialize_with = "opt_scalar_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub timeout: Option<String>,
}

/// `attempts: {key: request_id, ttl: 5m, reserve: 600, phase_key: phase}`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AttemptsDoc {
    #[serde(
        default,
        deserialize_with = "opt_scalar_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub key: Option<String>,
    #[serde(
        default,
        deserialize_with = "opt_scalar_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub ttl: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve: Option<u64>,
    #[serde(
        default,
        deserialize_with = "opt_scalar_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub phase_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_repeats: Option<u32>,
}

/// `lease: {size: 50, ttl: 1s}`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseDoc {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u32>,
    #[serde(
        default,
        deserialize_with = "opt_scalar_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub ttl: Option<String>,
}

/// A `rate_limit:` block, or one entry of `limits:`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitDoc {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_unit: Option<u32>,
    /// The window is this many units (Envoy's and Envoy Gateway's name):
    /// `unit: second, unit_multiplier: 30` is "per 30 seconds".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit_multiplier: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub unlimited: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaces: Option<Vec<ReplacesDoc>>,
    /// Count in calendar periods of `unit` (day, week, month, year) in a
    /// time zone, from an optional anchor (ours: see docs/rules.md,
    /// "Calendar periods").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calendar: Option<CalendarDoc>,
}

/// `calendar:` on a limit: the IANA time zone, and where a period starts.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CalendarDoc {
    #[serde(default, deserialize_with = "opt_scalar_string")]
    pub time_zone: Option<String>,
    /// A week's first day, a month's billing day (1–31), a year's MM-DD.
    #[serde(default, deserialize_with = "opt_scalar_string")]
    pub starts: Option<String>,
}

/// One `replaces:` entry: the name of a limit this one supersedes.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReplacesDoc {
    #[serde(default, deserialize_with = "opt_scalar_string")]
    pub name: Option<String>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn present_or_null<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// Any YAML scalar as a string; null as `None`; maps and lists are errors.
fn opt_scalar_string<'de, D>(d: D) -> Result<Option<String>, D::Error>
where
    D: Deserializer<'de>,
{
    use serde::de::Error;
    use serde_yaml::Value;
    match Value::deserialize(d)? {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s)),
        Value::Bool(b) => Ok(Some(b.to_string())),
        Value::Number(n) => Ok(Some(n.to_string())),
        Value::Sequence(_) => Err(D::Error::custom("expected a string, found a list")),
        Value::Mapping(_) => Err(D::Error::custom("expected a string, found a map")),
        Value::Tagged(_) => Err(D::Error::custom("expected a string, found a tagged value")),
    }
}
