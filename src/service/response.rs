//! Building the `RateLimitResponse` from the limiter's decisions (docs/architecture.md §4).

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::{value::Kind, Duration, ListValue, Struct, Value};

use std::collections::HashMap;
use std::sync::Arc;

use crate::limiter::{Decision, ShownLimit, Verdict};

/// The shape of the rate-limit headers (`--response-headers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum HeaderFormat {
    /// `RateLimit-Policy: "name";q=B;w=S` and `RateLimit: "name";r=N;t=S`.
    #[default]
    Draft,
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`.
    Legacy,
}

/// The names of the `legacy` rate-limit headers: limit, remaining, reset
/// (envoyproxy/ratelimit's `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`,
/// `LIMIT_RESET_HEADER`), lowercase as HTTP/2 sends them.
#[derive(Debug, Clone)]
pub struct LegacyHeaderNames(Arc<[String; 3]>);

impl LegacyHeaderNames {
    pub fn new(limit: &str, remaining: &str, reset: &str) -> Self {
        Self(Arc::new(
            [limit, remaining, reset].map(|n| n.trim().to_ascii_lowercase()),
        ))
    }
}

impl Default for LegacyHeaderNames {
    fn default() -> Self {
        Self::new("ratelimit-limit", "ratelimit-remaining", "ratelimit-reset")
    }
}

/// What to add beyond the statuses, and service-wide modes.
#[derive(Debug, Clone)]
pub struct ResponseOptions {
    /// Rate-limit fields for the descriptor closest to its limit, in this
    /// shape; `None`: none.
    pub rate_limit_headers: Option<HeaderFormat>,
    /// The `legacy` shape's header names.
    pub legacy_header_names: LegacyHeaderNames,
    /// `--shadow-mode` (envoyproxy/ratelimit's `SHADOW_MODE`): a request
    /// over the limit is answered OK; the statuses still say which
    /// descriptors were over.
    pub shadow_mode: bool,
    /// `--response-dynamic-metadata` (`RESPONSE_DYNAMIC_METADATA`): the
    /// request (domain, descriptors, hits) and the `metadata` of the rules
    /// that passed, in the response's dynamic metadata.
    pub dynamic_metadata: bool,
    /// `--quota-mode` (`QUOTA_MODE`): every limit in quota mode (the
    /// service turns over-limit verdicts into quota ones before building).
    pub quota_mode: bool,
    /// `--refused-by-header`: the header naming the limits that refused an
    /// OVER_LIMIT answer (also `refused_by` in the dynamic metadata).
    pub refused_by_header: Option<String>,
    /// `--retry-after`: a `retry-after` header on OVER_LIMIT answers.
    pub retry_after: bool,
}

impl Default for ResponseOptions {
    fn default() -> Self {
        Self {
            rate_limit_headers: None,
            legacy_header_names: LegacyHeaderNames::default(),
            shadow_mode: false,
            dynamic_metadata: false,
            quota_mode: false,
            refused_by_header: None,
            retry_after: true,
        }
    }
}

/// The limits that refused: each over-limit descriptor's limit `name`, else
/// its rule's label (the descriptor path), in order, without repeats; never
/// a request's value.
pub fn refused_by(decisions: &[Decision]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for d in decisions.iter().filter(|d| d.verdict.is_over_limit()) {
        let named = d
            .limit
            .as_ref()
            .map(|l| l.name.as_str())
            .filter(|n| !n.is_empty());
        let label = named
            .or_else(|| d.rule.as_deref().map(|r| r.label()))
            .unwrap_or("override");
        if !out.iter().any(|o| o == label) {
            out.push(label.to_string());
        }
    }
    out
}

/// The answer to `request`, decided as `decisions` say.
pub fn build(
    request: &RateLimitRequest,
    decisions: &[Decision],
    opts: &ResponseOptions,
) -> RateLimitResponse {
    let statuses: Vec<DescriptorStatus> = decisions.iter().map(status).collect();
    let over = decisions.iter().any(|d| d.verdict.is_over_limit());
    let mut headers = Vec::new();
    // in shadow mode nothing is refused, so nothing says when to retry
    if over && !opts.shadow_mode {
        // The request passes only once every rejecting descriptor would admit
        // it; one that never will (no retry time) means no retry-after at all.
        let retry = decisions
            .iter()
            .filter(|d| d.verdict.is_over_limit())
            .map(|d| d.reset_secs)
            .collect::<Option<Vec<u64>>>()
            .and_then(|waits| waits.into_iter().max());
        if let Some(secs) = retry.filter(|_| opts.retry_after) {
            headers.push(header("retry-after", secs.to_string()));
        }
        if let Some(name) = &opts.refused_by_header {
            headers.push(header(name, refused_by(decisions).join(", ")));
        }
    }
    if let Some(format) = opts.rate_limit_headers {
        if let Some(closest) = decisions
            .iter()
            .filter(|d| d.limit.is_some())
            .min_by_key(|d| (!d.verdict.is_over_limit(), d.remaining))
        {
            if let Some(limit) = &closest.limit {
                headers.extend(rate_limit_fields(
                    closest,
                    limit,
                    format,
                    &opts.legacy_header_names,
                ));
            }
        }
    }
    let mut metadata = quota_metadata(decisions, opts.quota_mode);
    if opts.dynamic_metadata {
        let fields = &mut metadata.get_or_insert_with(Struct::default).fields;
        fields.extend(request_metadata(request, decisions).fields);
    }
    if over && !opts.shadow_mode && opts.refused_by_header.is_some() {
        let names = refused_by(decisions)
            .into_iter()
            .map(|n| Value {
                kind: Some(Kind::StringValue(n)),
            })
            .collect();
        metadata.get_or_insert_with(Struct::default).fields.insert(
            "refused_by".to_string(),
            Value {
                kind: Some(Kind::ListValue(ListValue { values: names })),
            },
        );
    }
    RateLimitResponse {
        overall_code: if over && !opts.shadow_mode {
            Code::OverLimit
        } else {
            Code::Ok
        } as i32,
        statuses,
        response_headers_to_add: headers,
        dynamic_metadata: metadata,
        ..Default::default()
    }
}

/// envoyproxy/ratelimit's `RESPONSE_DYNAMIC_METADATA`: `domain`,
/// `descriptors` (each `entries` as `"key=value"`, and its own `limit` and
/// `hitsAddend` when it has them), the request's `hitsAddend` (when not 0),
/// and `metadata`: the rules' `metadata` of the descriptors that passed,
/// merged (the first descriptor's value wins where two differ).
fn request_metadata(request: &RateLimitRequest, decisions: &[Decision]) -> Struct {
    let string = |s: String| Value {
        kind: Some(Kind::StringValue(s)),
    };
    let number = |n: f64| Value {
        kind: Some(Kind::NumberValue(n)),
    };
    let list = |values: Vec<Value>| Value {
        kind: Some(Kind::ListValue(ListValue { values })),
    };
    let object = |fields: HashMap<String, Value>| Value {
        kind: Some(Kind::StructValue(Struct { fields })),
    };
    let descriptors = request
        .descriptors
        .iter()
        .map(|d| {
            let mut fields = HashMap::new();
            let entries = d
                .entries
                .iter()
                .map(|e| string(format!("{}={}", e.key, e.value)))
                .collect();
            fields.insert("entries".to_string(), list(entries));
            if let Some(l) = &d.limit {
                let unit = crate::rules::Unit::from_proto(l.unit)
                    .map_or("UNKNOWN".to_string(), |u| {
                        format!("{u:?}").to_ascii_uppercase()
                    });
                fields.insert(
                    "limit".to_string(),
                    string(format!(
                        "requests_per_unit:{} unit:{unit}",
                        l.requests_per_unit
                    )),
                );
            }
            if let Some(h) = &d.hits_addend {
                fields.insert("hitsAddend".to_string(), number(h.value as f64));
            }
            object(fields)
        })
        .collect();
    let mut fields = HashMap::new();
    fields.insert("domain".to_string(), string(request.domain.clone()));
    fields.insert("descriptors".to_string(), list(descriptors));
    if request.hits_addend != 0 {
        fields.insert(
            "hitsAddend".to_string(),
            number(f64::from(request.hits_addend)),
        );
    }
    let mut passed = Struct::default();
    for d in decisions.iter().filter(|d| !d.verdict.is_over_limit()) {
        if let Some(m) = d.rule.as_ref().and_then(|r| r.metadata.as_ref()) {
            crate::pb_struct::merge(&mut passed, m);
        }
    }
    if !passed.fields.is_empty() {
        fields.insert(
            "metadata".to_string(),
            Value {
                kind: Some(Kind::StructValue(passed)),
            },
        );
    }
    Struct { fields }
}

/// The rate-limit fields for `d`, decided by `limit`.
///
/// `Draft` (draft-ietf-httpapi-ratelimit-headers, structured fields): the
/// policy `"name";q=B;w=S` (its quota is the burst, refilled in full over
/// `S` seconds: a token bucket's window) and the state `"name";r=N;t=S`
/// (whole tokens left; seconds until a retry can pass, or until full).
/// `Legacy`: `RateLimit-Limit` (requests per unit), `-Remaining`, `-Reset`.
fn rate_limit_fields(
    d: &Decision,
    limit: &ShownLimit,
    format: HeaderFormat,
    names: &LegacyHeaderNames,
) -> Vec<HeaderValue> {
    let reset = d.reset_secs;
    match format {
        HeaderFormat::Legacy => {
            let [limit_name, remaining_name, reset_name] = &*names.0;
            vec![
                header(limit_name, limit.on_the_wire().0.to_string()),
                header(remaining_name, d.remaining.to_string()),
                header(reset_name, reset.unwrap_or(0).to_string()),
            ]
        }
        HeaderFormat::Draft => {
            let name = sf_string(match (&limit.name, &d.rule) {
                (n, _) if !n.is_empty() => n,
                (_, Some(rule)) => rule.label(),
                _ => "limit",
            });
            let mut policy = format!("{name};q={}", limit.burst);
            let per_sec = f64::from(limit.requests_per_unit) / limit.window_secs.max(1) as f64;
            if per_sec > 0.0 {
                let window = (limit.burst as f64 / per_sec).ceil().max(1.0) as u64;
                policy.push_str(&format!(";w={window}"));
            }
            let mut state = format!("{name};r={}", d.remaining);
            if let Some(t) = reset {
                state.push_str(&format!(";t={t}"));
            }
            vec![
                header("ratelimit-policy", policy),
                header("ratelimit", state),
            ]
        }
    }
}

/// `name` as a structured-field string (RFC 8941): quoted, `\` and `"`
/// escaped, anything outside printable ASCII replaced by `_`.
fn sf_string(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 2);
    out.push('"');
    for c in name.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
    out
}

fn status(d: &Decision) -> DescriptorStatus {
    // over a quota-mode limit says so, the request passing or not (as
    // envoyproxy/ratelimit's statuses do)
    let code = if d.verdict.is_over_limit() || d.verdict == Verdict::QuotaExceeded {
        Code::OverLimit
    } else {
        Code::Ok
    };
    DescriptorStatus {
        code: code as i32,
        current_limit: d.limit.as_ref().map(|l| {
            let (requests_per_unit, unit) = l.on_the_wire();
            RateLimit {
                name: l.name.clone(),
                requests_per_unit,
                unit: unit.to_proto(),
            }
        }),
        limit_remaining: u32::try_from(d.remaining).unwrap_or(u32::MAX),
        duration_until_reset: d.limit.as_ref().map(|limit| Duration {
            seconds: i64::try_from(d.reset_secs.unwrap_or_else(|| window_left(limit)))
                .unwrap_or(i64::MAX),
            nanos: 0,
        }),
        quota: None,
    }
}

/// Where no wait can be told (a limit of 0, more hits than it holds): the
/// time until the limit's window ends, as envoyproxy/ratelimit's
/// `CalculateReset` always says (its statuses always carry one).
fn window_left(limit: &ShownLimit) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let window = limit.window_secs.max(1);
    window - now % window
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue {
        key: key.to_string(),
        value,
        ..Default::default()
    }
}

/// For rules in `quota_mode`: which descriptors exceeded their quota (the
/// request refused once all did), in the response's dynamic metadata.
fn quota_metadata(decisions: &[Decision], all_quota: bool) -> Option<Struct> {
    let enabled = all_quota
        || decisions
            .iter()
            .any(|d| d.rule.as_ref().is_some_and(|r| r.quota_mode));
    if !enabled {
        return None;
    }
    let violations = decisions
        .iter()
        .enumerate()
        .filter(|(_, d)| {
            let quota = all_quota || d.rule.as_ref().is_some_and(|r| r.quota_mode);
            d.verdict == Verdict::QuotaExceeded || (quota && d.verdict.is_over_limit())
        })
        .map(|(i, _)| Value {
            kind: Some(Kind::NumberValue(i as f64)),
        })
        .collect();
    let mut fields = std::collections::HashMap::new();
    fields.insert(
        "quotaModeEnabled".to_string(),
        Value {
            kind: Some(Kind::BoolValue(true)),
        },
    );
    fields.insert(
        "quotaModeViolations".to_string(),
        Value {
            kind: Some(Kind::ListValue(ListValue { values: violations })),
        },
    );
    Some(Struct { fields })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_structured_field_strings() {
        assert_eq!(sf_string("keys"), "\"keys\"");
        assert_eq!(sf_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert_eq!(sf_string("café\tx"), "\"caf__x\"");
    }

    fn over(reset_secs: Option<u64>) -> Decision {
        Decision {
            verdict: Verdict::OverLimit,
            limit: None,
            remaining: 0,
            reset_secs,
            rule: None,
            window_count: None,
        }
    }

    fn retry_after(decisions: &[Decision]) -> Option<String> {
        build(
            &RateLimitRequest::default(),
            decisions,
            &ResponseOptions::default(),
        )
        .response_headers_to_add
        .iter()
        .find(|h| h.key == "retry-after")
        .map(|h| h.value.clone())
    }

    /// As envoyproxy/ratelimit's statuses: a limit always comes with a
    /// `duration_until_reset`, the end of its window where no wait can be
    /// told; `--retry-after false` leaves the header out.
    #[test]
    fn a_limit_always_says_when_it_resets() {
        let never = Decision {
            limit: Some(ShownLimit {
                name: String::new(),
                requests_per_unit: 0,
                unit: crate::rules::Unit::Minute,
                window_secs: 60,
                burst: 0,
            }),
            ..over(None)
        };
        let status = status(&never);
        let secs = status.duration_until_reset.expect("always set").seconds;
        assert!((1..=60).contains(&secs), "{secs}");
        assert_eq!(status.code, Code::OverLimit as i32);
        let plain = ResponseOptions {
            retry_after: false,
            ..ResponseOptions::default()
        };
        let answer = build(&RateLimitRequest::default(), &[over(Some(5))], &plain);
        assert!(answer.response_headers_to_add.is_empty());
        assert_eq!(retry_after(&[over(Some(5))]).as_deref(), Some("5"));
    }

    fn over_named(name: &str) -> Decision {
        Decision {
            limit: Some(ShownLimit {
                name: name.to_string(),
                requests_per_unit: 5,
                unit: crate::rules::Unit::Minute,
                window_secs: 60,
                burst: 5,
            }),
            ..over(Some(6))
        }
    }

    fn header_of(decisions: &[Decision], opts: &ResponseOptions, name: &str) -> Option<String> {
        build(&RateLimitRequest::default(), decisions, opts)
            .response_headers_to_add
            .iter()
            .find(|h| h.key == name)
            .map(|h| h.value.clone())
    }

    #[test]
    fn a_refusal_names_the_limits_that_refused_it_when_asked() {
        let opts = ResponseOptions {
            refused_by_header: Some("x-ratelimit-rule".into()),
            ..Default::default()
        };
        let ok = Decision {
            verdict: Verdict::Ok,
            ..over_named("passed")
        };
        let decisions = [
            over_named("login-burst"),
            ok,
            over_named("login-burst"),
            over_named("hourly"),
            over(Some(1)),
        ];
        assert_eq!(
            header_of(&decisions, &opts, "x-ratelimit-rule").as_deref(),
            Some("login-burst, hourly, override")
        );
        let answer = build(&RateLimitRequest::default(), &decisions, &opts);
        let listed = &answer.dynamic_metadata.expect("metadata").fields["refused_by"];
        let Some(Kind::ListValue(list)) = &listed.kind else {
            panic!("{listed:?}")
        };
        assert_eq!(list.values.len(), 3);
        // not asked, admitted, or in shadow mode: none
        assert_eq!(
            header_of(&decisions, &ResponseOptions::default(), "x-ratelimit-rule"),
            None
        );
        let admitted = [Decision {
            verdict: Verdict::Ok,
            ..over_named("a")
        }];
        assert_eq!(header_of(&admitted, &opts, "x-ratelimit-rule"), None);
        let shadow = ResponseOptions {
            shadow_mode: true,
            ..opts.clone()
        };
        assert_eq!(header_of(&decisions, &shadow, "x-ratelimit-rule"), None);
        assert!(build(&RateLimitRequest::default(), &decisions, &shadow)
            .dynamic_metadata
            .is_none());
    }

    #[test]
    fn retry_after_is_the_longest_wait() {
        assert_eq!(
            retry_after(&[over(Some(1)), over(Some(7))]).as_deref(),
            Some("7")
        );
    }

    /// Audit 10: a descriptor that can never pass (rate 0, cost above the
    /// burst) means the request never passes: no retry-after at all.
    #[test]
    fn no_retry_after_when_a_descriptor_can_never_pass() {
        assert_eq!(retry_after(&[over(None), over(Some(1))]), None);
        assert_eq!(retry_after(&[over(Some(1)), over(None)]), None);
    }
}
