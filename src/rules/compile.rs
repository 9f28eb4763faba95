//! Validation and compilation of parsed rule files into the matcher tree.
//!
//! Everything the YAML types cannot express is checked here, and every
//! problem is reported (not just the first) with its file and its place in
//! the tree, e.g. `domain 'edge', descriptor tenant=acme > api_key: …`.

use std::cell::RefCell;
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use super::error::{ConfigError, ConfigErrors};
use super::matcher::{
    AttemptsConfig, KeyBranch, LeaseConfig, Level, Limit, Node, Rule, RuleAction, WildcardNode,
};
use super::schema::{AttemptsDoc, DescriptorDoc, LeaseDoc, RateLimitDoc};
use super::unit::{FailureMode, Unit};
use super::wildcard::Wildcard;
use crate::attempt::AttemptMode;
use crate::bucket::Algorithm;

mod algorithm;
mod replication;

/// What a descriptor passes down to the ones nested in it.
#[derive(Clone)]
struct Scope<'a> {
    file: &'a Path,
    /// `--ratelimit-rules`: what envoyproxy/ratelimit ignores is ignored
    /// here too, said in `warnings`.
    ratelimit_files: bool,
    warnings: &'a RefCell<Vec<ConfigError>>,
    domain: &'a Arc<str>,
    /// Human-readable place, for error messages.
    place: String,
    /// Config path, for the rule's metric label.
    path: String,
    /// The descriptor keys down to here (an RLQS bucket id's keys).
    keys: Vec<String>,
    /// The `share_threshold` patterns down to here, as (key, pattern).
    shared_values: Vec<(String, String)>,
    failure_mode: Option<FailureMode>,
    detailed_metric: bool,
    /// The domain is one of `--usage-domains`.
    usage: bool,
    /// `--algorithm`: how a rule that names none counts.
    default_algorithm: Algorithm,
}

impl Scope<'_> {
    fn error(&self, errors: &mut ConfigErrors, message: impl AsRef<str>) {
        errors.push(ConfigError::new(
            self.file,
            format!("{}: {}", self.place, message.as_ref()),
        ));
    }

    fn warn(&self, message: impl AsRef<str>) {
        self.warnings.borrow_mut().push(ConfigError::new(
            self.file,
            format!("{}: {}", self.place, message.as_ref()),
        ));
    }
}

/// Compiles the top-level descriptors of one domain, which may come from
/// several files (with `--merge-domains`), into `root`.
pub(super) fn compile_top_level(
    root: &mut Level,
    domain: &Arc<str>,
    (usage, default_algorithm): (bool, Algorithm),
    (file, ratelimit_files, warnings): (&Path, bool, &RefCell<Vec<ConfigError>>),
    docs: &[DescriptorDoc],
    errors: &mut ConfigErrors,
) {
    let scope = Scope {
        file,
        ratelimit_files,
        warnings,
        domain,
        place: format!("domain '{domain}'"),
        path: String::new(),
        keys: Vec::new(),
        shared_values: Vec::new(),
        failure_mode: None,
        detailed_metric: false,
        usage,
        default_algorithm,
    };
    compile_level(root, &scope, docs, errors);
}

fn compile_level(
    level: &mut Level,
    scope: &Scope<'_>,
    docs: &[DescriptorDoc],
    errors: &mut ConfigErrors,
) {
    for (i, doc) in docs.iter().enumerate() {
        let key = match doc.key.as_deref() {
            Some(k) if !k.is_empty() => k,
            _ => {
                let value = doc
                    .value
                    .as_deref()
                    .map(|v| format!(" (value '{v}')"))
                    .unwrap_or_default();
                scope.error(
                    errors,
                    format!("descriptors[{i}]{value}: `key` is missing or empty; every descriptor needs a key"),
                );
                continue;
            }
        };
        let value = doc.value.as_deref().filter(|v| !v.is_empty());
        let label = match value {
            Some(v) => format!("{key}={v}"),
            None => key.to_string(),
        };
        let here = Scope {
            place: format!("{}, descriptor {label}", scope.place),
            path: match (scope.path.is_empty(), value) {
                (true, Some(v)) => format!("{key}_{v}"),
                (true, None) => key.to_string(),
                (false, Some(v)) => format!("{}.{key}_{v}", scope.path),
                (false, None) => format!("{}.{key}", scope.path),
            },
            keys: scope
                .keys
                .iter()
                .cloned()
                .chain([key.to_string()])
                .collect(),
            shared_values: match value {
                Some(v) if doc.share_threshold && Wildcard::parse(v).is_some() => scope
                    .shared_values
                    .iter()
                    .cloned()
                    .chain([(key.to_string(), v.to_string())])
                    .collect(),
                _ => scope.shared_values.clone(),
            },
            ..scope.clone()
        };
        let here = match doc
            .failure_mode
            .as_deref()
            .map(|m| (m, FailureMode::parse(m)))
        {
            None => here,
            Some((_, Some(mode))) => Scope {
                failure_mode: Some(mode),
                ..here
            },
            Some((raw, None)) => {
                here.error(
                    errors,
                    format!("failure_mode '{raw}' is not one of {}", FailureMode::NAMES),
                );
                here
            }
        };
        let here = Scope {
            detailed_metric: here.detailed_metric || doc.detailed_metric,
            ..here
        };
        check_share_threshold(&here, doc, value, errors);

        let mut node = Node {
            rule: compile_rule(&here, doc, errors).map(Arc::new),
            ..Node::default()
        };
        if let Some(children) = &doc.descriptors {
            compile_level(&mut node.children, &here, children, errors);
        }

        let branch: &mut KeyBranch = level.keys.entry(key.to_string()).or_default();
        let duplicate = match value {
            None if branch.default.is_some() => true,
            None => {
                branch.default = Some(node);
                false
            }
            Some(v) => match Wildcard::parse(v) {
                Some(pattern) => {
                    if branch.wildcards.iter().any(|w| w.pattern == pattern) {
                        true
                    } else {
                        branch.wildcards.push(WildcardNode {
                            pattern,
                            share_threshold: doc.share_threshold,
                            node,
                        });
                        false
                    }
                }
                None if branch.exact.contains_key(v) => true,
                None => {
                    branch.exact.insert(v.to_string(), node);
                    false
                }
            },
        };
        if duplicate {
            here.error(
                errors,
                "defined twice at the same level (each key/value pair may appear once per level)",
            );
        }
    }
}

/// `share_threshold: true` shares the values a `*` pattern matches: on a
/// value without one it would share nothing (refused there too).
fn check_share_threshold(
    here: &Scope<'_>,
    doc: &DescriptorDoc,
    value: Option<&str>,
    errors: &mut ConfigErrors,
) {
    if doc.share_threshold && !value.is_some_and(|v| v.contains('*')) {
        here.error(
            errors,
            "`share_threshold: true` needs a value with `*` (the values the pattern matches share one bucket); without one it would share nothing, and envoyproxy/ratelimit refuses it too",
        );
    }
}

fn compile_rule(scope: &Scope<'_>, doc: &DescriptorDoc, errors: &mut ConfigErrors) -> Option<Rule> {
    let action = compile_action(scope, doc, errors);
    let lease = match &doc.lease {
        None => None,
        Some(l) => {
            let limits = limits_for(
                scope,
                doc,
                &action,
                "`lease`",
                "no bucket to lease from",
                errors,
            )?;
            Some(compile_lease(scope, l, limits, errors)?)
        }
    };
    let max_values = match doc.max_values {
        None => None,
        Some(n) => {
            limits_for(
                scope,
                doc,
                &action,
                "`max_values`",
                "no bucket to bound",
                errors,
            )?;
            if n == 0 {
                scope.error(
                    errors,
                    "`max_values: 0`: at least one descriptor must have buckets of its own",
                );
                return None;
            }
            Some(n)
        }
    };
    let global = compile_scope(scope, doc, &action, errors)?;
    let overdraft = doc.overdraft && compile_overdraft(scope, doc, &action, &lease, errors);
    let mut action = action;
    if let Some(debt) = doc.max_debt {
        if !doc.overdraft {
            scope.error(
                errors,
                "`max_debt` without `overdraft: true`: only a usage charge goes into debt; add `overdraft: true`, or drop max_debt",
            );
            return None;
        }
        if global {
            scope.error(
                errors,
                "`max_debt` with `scope: global`: a region's share holds one burst of debt at most; drop max_debt",
            );
            return None;
        }
        if let Some(RuleAction::Limited(limits)) = &mut action {
            for l in limits {
                l.params.max_debt = Some(debt);
                l.max_debt = Some(debt);
            }
        }
    }
    if !algorithm::compile_algorithm(scope, doc, &mut action, global, errors) {
        return None;
    }
    // In a usage domain, every rule that could take `overdraft` charges
    // the costs descriptors bring (the others spend as usual).
    let usage_charges = scope.usage
        && !overdraft
        && lease.is_none()
        && matches!(&action, Some(RuleAction::Limited(limits))
            if limits.iter().all(|l| l.requests_per_unit > 0));
    let attempts = match (&doc.attempts, &action) {
        (None, _) => None,
        // its slots: its own errors say what is missing
        (Some(a), Some(RuleAction::Concurrency { .. })) => Some(compile_attempts(
            scope,
            doc,
            a,
            &[],
            AttemptMode::Slot,
            errors,
        )?),
        (Some(a), _) => {
            let limits = limits_for(
                scope,
                doc,
                &action,
                "`attempts`",
                "no bucket to charge an attempt to",
                errors,
            )?;
            let mode = if overdraft {
                AttemptMode::Reserve
            } else {
                AttemptMode::Dedupe
            };
            Some(compile_attempts(scope, doc, a, limits, mode, errors)?)
        }
    };
    let replication = replication::compile_replication(scope, doc, &action, errors)?;
    let metadata = match &doc.metadata {
        None | Some(serde_yaml::Value::Null) => None,
        Some(m @ serde_yaml::Value::Mapping(_)) => Some(crate::pb_struct::struct_from_yaml(m)),
        Some(_) => {
            scope.error(
                errors,
                "`metadata` must be a map (e.g. `metadata: {service: a}`), as envoyproxy/ratelimit reads it",
            );
            return None;
        }
    };
    let mut rule = Rule {
        domain: scope.domain.clone(),
        path: scope.path.clone(),
        keys: scope.keys.clone(),
        shared_values: scope.shared_values.clone(),
        source: scope.file.to_path_buf(),
        action: action?,
        shadow_mode: doc.shadow_mode,
        quota_mode: doc.quota_mode,
        detailed_metric: scope.detailed_metric,
        value_to_metric: doc.value_to_metric,
        failure_mode: scope.failure_mode,
        lease,
        overdraft,
        usage_charges,
        metadata,
        max_values,
        global,
        attempts,
        replication,
        ratelimit_keys: false,
        id: Default::default(),
    };
    rule.ratelimit_keys = rule.counts_in_ratelimit_keys();
    rule.id = crate::labels::RuleId::of(&rule.domain, rule.label());
    Some(rule)
}

/// `scope:` as a flag (`global` or not); `None`, with the reason reported,
/// for a value that is neither, or a global rule the regions could not
/// share: it needs exactly one limit (the budget split between regions),
/// and no `lease` or `share_threshold` (each is its own way of sharing a
/// bucket).
fn compile_scope(
    scope: &Scope<'_>,
    doc: &DescriptorDoc,
    action: &Option<RuleAction>,
    errors: &mut ConfigErrors,
) -> Option<bool> {
    match doc.scope.as_deref() {
        None | Some("regional") => return Some(false),
        Some("global") => {}
        Some(other) => {
            scope.error(
                errors,
                format!("scope '{other}' is not one of regional, global"),
            );
            return None;
        }
    }
    let limits = limits_for(
        scope,
        doc,
        action,
        "`scope: global`",
        "no budget to share",
        errors,
    )?;
    let mut ok = true;
    if limits.len() != 1 {
        scope.error(
            errors,
            format!(
                "`scope: global` with {} limits: a global rule has one budget to split between regions; give it one `rate_limit`",
                limits.len()
            ),
        );
        ok = false;
    }
    if doc.lease.is_some() {
        scope.error(
            errors,
            "`scope: global` and `lease` together: the region's share is already spent locally; drop the lease",
        );
        ok = false;
    }
    if doc.max_values.is_some() {
        scope.error(
            errors,
            "`scope: global` and `max_values` together: a region holds at most 100000 global buckets already; drop max_values",
        );
        ok = false;
    }
    if !scope.shared_values.is_empty() {
        scope.error(
            errors,
            "`scope: global` under a `share_threshold` pattern: not supported; give the global rule its own descriptor",
        );
        ok = false;
    }
    // a region names a bucket to the global tier by an RLQS bucket id, a
    // map of key to value: a key twice on the path would be one entry, and
    // two descriptors would collapse into one bucket
    let mut seen: Vec<&str> = Vec::with_capacity(scope.keys.len());
    for key in &scope.keys {
        if seen.contains(&key.as_str()) {
            scope.error(
                errors,
                format!(
                    "`scope: global` on a path where the key '{key}' comes twice: the global tier names a bucket by a map of key to value, where two values of '{key}' would be one; rename one of the keys"
                ),
            );
            ok = false;
            break;
        }
        seen.push(key);
    }
    ok.then_some(true)
}

/// Whether `overdraft: true` can apply to this descriptor: it needs limits
/// that refill (a debt on a rate of 0 would never be repaid) and no lease
/// (a lease takes whole tokens that are there; a debt has none). Every
/// problem is reported.
fn compile_overdraft(
    scope: &Scope<'_>,
    doc: &DescriptorDoc,
    action: &Option<RuleAction>,
    lease: &Option<LeaseConfig>,
    errors: &mut ConfigErrors,
) -> bool {
    let Some(limits) = limits_for(
        scope,
        doc,
        action,
        "`overdraft`",
        "no bucket to charge",
        errors,
    ) else {
        return false;
    };
    let mut ok = true;
    if limits.iter().any(|l| l.requests_per_unit == 0) {
        scope.error(
            errors,
            "`overdraft` with `requests_per_unit: 0`: a debt that never refills would never be repaid",
        );
        ok = false;
    }
    if lease.is_some() || doc.lease.is_some() {
        scope.error(
            errors,
            "`overdraft` and `lease` together: a lease takes tokens that are in the bucket, a debt has none; use one or the other",
        );
        ok = false;
    }
    ok
}

/// The limits of the descriptor carrying `option` (which needs buckets);
/// `None`, with the reason reported, when it has none: no limits at all, an
/// unlimited rule (`unlimited`: what is missing), or limits that failed to
/// compile (their own errors say why).
fn limits_for<'a>(
    scope: &Scope<'_>,
    doc: &DescriptorDoc,
    action: &'a Option<RuleAction>,
    option: &str,
    unlimited: &str,
    errors: &mut ConfigErrors,
) -> Option<&'a [Limit]> {
    match action {
        Some(RuleAction::Limited(limits)) => Some(limits),
        Some(RuleAction::Concurrency { .. }) => {
            scope.error(
                errors,
                format!("{option} on a `concurrency` rule: it holds slots, there is {unlimited}"),
            );
            None
        }
        Some(RuleAction::Unlimited { .. }) => {
            scope.error(
                errors,
                format!("{option} on an unlimited rule: there is {unlimited}"),
            );
            None
        }
        None if doc.rate_limit.is_none() && doc.limits.is_none() => {
            scope.error(
                errors,
                format!("{option} needs a `rate_limit` or `limits` on the same descriptor"),
            );
            None
        }
        None => None,
    }
}

/// `concurrency: N`, a rule of its own: no buckets beside it, and its
/// attempts named (the id holds and releases a slot; the ttl returns one
/// never released). `None`, with every reason reported, when it cannot be.
fn compile_concurrency(
    scope: &Scope<'_>,
    doc: &DescriptorDoc,
    max: u32,
    errors: &mut ConfigErrors,
) -> Option<RuleAction> {
    let mut ok = true;
    let mut refuse = |what: &str| {
        scope.error(errors, what);
        ok = false;
    };
    if max == 0 {
        refuse("`concurrency: 0` would refuse every request; give the attempts one value may have in flight, or use `requests_per_unit: 0`");
    }
    if doc.rate_limit.is_some() || doc.limits.is_some() {
        refuse("`concurrency` with `rate_limit` or `limits` on one descriptor: a concurrency limit holds slots, not tokens; put each on a descriptor of its own (Envoy sends both)");
    }
    if doc.attempts.is_none() {
        refuse("`concurrency` needs `attempts: {key: ..., ttl: ...}`: the attempt id holds and releases a slot, and the ttl returns a slot never released (a crashed Envoy's)");
    }
    for (set, what) in [
        (doc.overdraft, "overdraft"),
        (doc.lease.is_some(), "lease"),
        (doc.max_values.is_some(), "max_values"),
        (doc.scope.as_deref() == Some("global"), "scope: global"),
        (doc.share_threshold, "share_threshold"),
    ] {
        if set {
            refuse(&format!(
                "`concurrency` and `{what}` together: not supported (a concurrency limit holds slots per descriptor value, no tokens)"
            ));
        }
    }
    if doc.attempts.as_ref().is_some_and(|a| a.reserve.is_some()) {
        refuse("attempts.reserve on a `concurrency` rule: a slot is one request, there is nothing to reserve");
    }
    ok.then_some(RuleAction::Concurrency { max })
}

/// Shortest and longest attempt `ttl` accepted.
const ATTEMPT_TTL_RANGE: (std::time::Duration, std::time::Duration) = (
    std::time::Duration::from_secs(1),
    std::time::Duration::from_secs(24 * 3600),
);

/// `attempts:`; `None`, with every reason reported, when it cannot apply.
fn compile_attempts(
    scope: &Scope<'_>,
    doc: &DescriptorDoc,
    attempts: &AttemptsDoc,
    limits: &[Limit],
    mode: AttemptMode,
    errors: &mut ConfigErrors,
) -> Option<AttemptsConfig> {
    let mut ok = true;
    let key = attempts.key.clone().unwrap_or_default();
    if key.is_empty() {
        scope.error(
            errors,
            "attempts.key is missing or empty; name the descriptor entry that carries the attempt id (e.g. `key: request_id`, filled by Envoy from x-request-id)",
        );
        ok = false;
    }
    let phase_key = attempts
        .phase_key
        .clone()
        .unwrap_or_else(|| "phase".to_string());
    if phase_key.is_empty() || phase_key == key {
        scope.error(
            errors,
            format!("attempts.phase_key '{phase_key}' must be a key of its own, not empty and not the attempt key"),
        );
        ok = false;
    }
    let ttl = match attempts.ttl.as_deref().map(humantime::parse_duration) {
        None => {
            scope.error(
                errors,
                "attempts.ttl is missing; give how long an attempt is remembered and a reservation may stay unsettled (e.g. `ttl: 5m`, longer than the longest request)",
            );
            None
        }
        Some(Err(e)) => {
            scope.error(errors, format!("attempts.ttl: {e}"));
            None
        }
        Some(Ok(t)) if t < ATTEMPT_TTL_RANGE.0 || t > ATTEMPT_TTL_RANGE.1 => {
            scope.error(
                errors,
                format!(
                    "attempts.ttl {} is outside 1s..24h",
                    humantime::format_duration(t)
                ),
            );
            None
        }
        Some(Ok(t)) => Some(t),
    };
    match attempts.reserve {
        // a concurrency rule says so itself
        Some(_) if mode == AttemptMode::Slot => {}
        Some(_) if mode == AttemptMode::Dedupe => {
            scope.error(
                errors,
                "attempts.reserve without `overdraft: true`: a reservation is settled by charging into debt or giving back; add `overdraft: true`, or drop reserve",
            );
            ok = false;
        }
        Some(0) => {
            scope.error(errors, "attempts.reserve: 0 reserves nothing; give the estimate a request reserves, or drop reserve");
            ok = false;
        }
        Some(n) => {
            if let Some(small) = limits.iter().find(|l| u64::from(l.burst) < n) {
                scope.error(
                    errors,
                    format!(
                        "attempts.reserve {n} is larger than the burst {} of {}: no bucket could ever hold the reservation",
                        small.burst,
                        small.name.as_deref().map_or_else(|| "the limit".to_string(), |n| format!("limit '{n}'"))
                    ),
                );
                ok = false;
            }
        }
        None => {}
    }
    if doc.lease.is_some() {
        scope.error(
            errors,
            "`attempts` and `lease` together: a lease spends locally, where no attempt is remembered; use one or the other",
        );
        ok = false;
    }
    if doc.scope.as_deref() == Some("global") {
        scope.error(
            errors,
            "`attempts` with `scope: global`: not supported (a region's share is spent without attempt records); give the rule `scope: regional`",
        );
        ok = false;
    }
    let max_repeats = attempts.max_repeats.unwrap_or(DEFAULT_MAX_REPEATS);
    if max_repeats > MAX_REPEATS {
        scope.error(
            errors,
            format!("attempts.max_repeats {max_repeats} is above {MAX_REPEATS}: it bounds how often one attempt's start is answered free as a repeat (a retry policy's retries, a few)"),
        );
        ok = false;
    }
    let ttl = ttl?;
    ok.then_some(AttemptsConfig {
        key,
        phase_key,
        ttl,
        reserve: attempts.reserve,
        mode,
        max_repeats,
    })
}

/// How often a live attempt's start is answered as a repeat unless the
/// rule says (`attempts.max_repeats`): Envoy's `grpc_service`
/// `retry_policy` sends a call again `num_retries` times (1 by default),
/// and a lost answer may be retried by the route too.
pub const DEFAULT_MAX_REPEATS: u32 = 3;

/// The most `attempts.max_repeats` may say.
const MAX_REPEATS: u32 = 100;

/// Shortest and longest lease `ttl` accepted.
const LEASE_TTL_RANGE: (std::time::Duration, std::time::Duration) = (
    std::time::Duration::from_millis(10),
    std::time::Duration::from_secs(60),
);
/// The `ttl` of a lease that does not say.
pub const DEFAULT_LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(1);

fn compile_lease(
    scope: &Scope<'_>,
    doc: &LeaseDoc,
    limits: &[Limit],
    errors: &mut ConfigErrors,
) -> Option<LeaseConfig> {
    let size = match doc.size {
        None | Some(0) => {
            scope.error(
                errors,
                "lease.size is missing or 0; give the tokens one lease takes (e.g. `lease: {size: 50}`)",
            );
            return None;
        }
        Some(size) => size,
    };
    if let Some(small) = limits.iter().find(|l| l.burst < size) {
        let name = small
            .name
            .as_deref()
            .map(|n| format!("limit '{n}'"))
            .unwrap_or_else(|| "the limit".to_string());
        scope.error(
            errors,
            format!(
                "lease.size {size} is larger than the burst {} of {name}; a lease cannot hold more than the bucket",
                small.burst
            ),
        );
        return None;
    }
    let ttl = match doc.ttl.as_deref() {
        None => DEFAULT_LEASE_TTL,
        Some(raw) => match humantime::parse_duration(raw) {
            Ok(ttl) if ttl >= LEASE_TTL_RANGE.0 && ttl <= LEASE_TTL_RANGE.1 => ttl,
            Ok(_) => {
                scope.error(errors, format!("lease.ttl '{raw}' is outside 10ms..60s"));
                return None;
            }
            Err(e) => {
                scope.error(
                    errors,
                    format!("lease.ttl '{raw}' is not a duration like 500ms or 2s: {e}"),
                );
                return None;
            }
        },
    };
    Some(LeaseConfig {
        size: u64::from(size),
        ttl,
    })
}

fn compile_action(
    scope: &Scope<'_>,
    doc: &DescriptorDoc,
    errors: &mut ConfigErrors,
) -> Option<RuleAction> {
    if let Some(max) = doc.concurrency {
        return compile_concurrency(scope, doc, max, errors);
    }
    let action = match (&doc.rate_limit, &doc.limits) {
        (Some(_), Some(_)) => {
            scope.error(
                errors,
                "`rate_limit` and `limits` cannot both be set; put every bucket under `limits`",
            );
            return None;
        }
        (None, None) => return None,
        (Some(rl), None) if rl.unlimited => {
            let ignored = rl.unit.is_none() && rl.burst.is_none() && scope.ratelimit_files;
            if let (Some(n), true) = (rl.requests_per_unit, ignored) {
                scope.warn(format!("requests_per_unit {n} beside `unlimited: true` is ignored, as envoyproxy/ratelimit ignores it; remove it"));
            } else if rl.unit.is_some() || rl.requests_per_unit.is_some() || rl.burst.is_some() {
                scope.error(
                    errors,
                    "rate_limit has `unlimited: true` and also a unit, requests_per_unit or burst; an unlimited rule has none",
                );
                return None;
            }
            let replaces = check_replaces(scope, "rate_limit", rl, errors)?;
            RuleAction::Unlimited {
                name: rl.name.clone(),
                replaces,
            }
        }
        (Some(rl), None) => {
            RuleAction::Limited(vec![compile_limit(scope, "rate_limit", rl, "0", errors)?])
        }
        (None, Some(limits)) => {
            if limits.is_empty() {
                scope.error(
                    errors,
                    "`limits` is empty; list at least one limit or remove it",
                );
                return None;
            }
            let mut seen = HashSet::new();
            let mut compiled = Vec::with_capacity(limits.len());
            for (i, rl) in limits.iter().enumerate() {
                let at = format!("limits[{i}]");
                if rl.unlimited {
                    scope.error(
                        errors,
                        format!("{at}: `unlimited` belongs in `rate_limit`, not in `limits`"),
                    );
                    continue;
                }
                if let Some(name) = &rl.name {
                    if !seen.insert(name.clone()) {
                        scope.error(
                            errors,
                            format!("{at}: the name '{name}' is used by two limits"),
                        );
                        continue;
                    }
                }
                let bucket_id = rl.name.clone().unwrap_or_else(|| format!("#{i}"));
                // An unnamed limit's id is its position (`#0`); a name must
                // not take another limit's id, or both would spend one bucket.
                let clash = rl.name.as_deref().and_then(|name| {
                    limits
                        .iter()
                        .enumerate()
                        .find(|(j, other)| other.name.is_none() && format!("#{j}") == name)
                });
                if let (Some((j, _)), Some(name)) = (clash, &rl.name) {
                    scope.error(
                        errors,
                        format!("{at}: the name '{name}' is the bucket id of the unnamed limit at limits[{j}], so both would spend one bucket; choose another name"),
                    );
                    continue;
                }
                if let Some(limit) = compile_limit(scope, &at, rl, &bucket_id, errors) {
                    compiled.push(limit);
                }
            }
            if compiled.len() != limits.len() {
                return None;
            }
            RuleAction::Limited(compiled)
        }
    };
    Some(action)
}

fn compile_limit(
    scope: &Scope<'_>,
    at: &str,
    rl: &RateLimitDoc,
    bucket_id: &str,
    errors: &mut ConfigErrors,
) -> Option<Limit> {
    let unit = match rl.unit.as_deref() {
        None => {
            scope.error(
                errors,
                format!("{at}: `unit` is missing; use one of {}", Unit::NAMES),
            );
            None
        }
        Some(raw) => {
            let unit = Unit::parse(raw);
            if unit.is_none() {
                scope.error(
                    errors,
                    format!("{at}: unit '{raw}' is not one of {}", Unit::NAMES),
                );
            }
            unit
        }
    };
    // As in envoyproxy/ratelimit, a missing requests_per_unit is 0: block everything.
    let requests_per_unit = rl.requests_per_unit.unwrap_or(0);
    let burst = match rl.burst {
        Some(0) => {
            scope.error(
                errors,
                format!("{at}: burst is 0, so no request could ever pass; use requests_per_unit: 0 to block, or a burst of at least 1"),
            );
            return None;
        }
        Some(b) => b,
        None => requests_per_unit,
    };
    let replaces = check_replaces(scope, at, rl, errors)?;
    let unit = unit?;
    let multiplier = match rl.unit_multiplier {
        None => 1,
        Some(0) => {
            scope.error(
                errors,
                format!("{at}: unit_multiplier is 0, a window of no length; use 1 or more (unit_multiplier: 30 with unit: second is \"per 30 seconds\")"),
            );
            return None;
        }
        Some(m) => {
            let window = unit.seconds() * u64::from(m);
            if window > MAX_WINDOW_SECS {
                scope.error(
                    errors,
                    format!("{at}: unit_multiplier {m} makes a window of {window} s ({m} × {}), longer than a year ({MAX_WINDOW_SECS} s)", unit.as_str()),
                );
                return None;
            }
            m
        }
    };
    let limit = Limit::new(
        rl.name.clone(),
        unit,
        requests_per_unit,
        burst,
        replaces,
        bucket_id.to_string(),
    )
    .with_multiplier(multiplier);
    match &rl.calendar {
        None => Some(limit),
        Some(calendar) => algorithm::compile_calendar(scope, at, calendar, limit, errors),
    }
}

/// The longest window a limit may name: a year (365 days).
const MAX_WINDOW_SECS: u64 = 31_536_000;

fn check_replaces(
    scope: &Scope<'_>,
    at: &str,
    rl: &RateLimitDoc,
    errors: &mut ConfigErrors,
) -> Option<Vec<String>> {
    let mut names = Vec::new();
    let mut ok = true;
    for (i, r) in rl.replaces.iter().flatten().enumerate() {
        match r.name.as_deref() {
            None | Some("") => {
                scope.error(
                    errors,
                    format!("{at}.replaces[{i}]: `name` is missing or empty; name the limit being replaced"),
                );
                ok = false;
            }
            Some(name) if Some(name) == rl.name.as_deref() => {
                scope.error(
                    errors,
                    format!("{at}.replaces[{i}]: the limit '{name}' replaces itself"),
                );
                ok = false;
            }
            Some(name) => names.push(name.to_string()),
        }
    }
    ok.then_some(names)
}
