//! How a rule counts: its `algorithm:` (or the service's default) and its
//! limits' `calendar:`, checked against what each way of counting can
//! honour, every refusal with its reason (docs/rules.md, "Fixed windows",
//! "Sliding windows", "Calendar periods").

use std::sync::Arc;

use super::Scope;
use crate::bucket::{Algorithm, MAX_WINDOW_COUNT};
use crate::calendar::{Calendar, CalendarPeriods};
use crate::rules::error::ConfigErrors;
use crate::rules::matcher::{Limit, RuleAction};
use crate::rules::schema::{CalendarDoc, DescriptorDoc};

/// `algorithm:`: a fixed or sliding window sets every bucket of the rule
/// counting so (and its own bucket ids, so that a rule switched between
/// algorithms never reads one's state as another's); what has no meaning in
/// a window is refused with its reason. False when refused.
pub(super) fn compile_algorithm(
    scope: &Scope<'_>,
    doc: &DescriptorDoc,
    action: &mut Option<RuleAction>,
    global: bool,
    errors: &mut ConfigErrors,
) -> bool {
    if let Some(RuleAction::Limited(limits)) = action {
        if limits.iter().any(|l| l.calendar.is_some()) {
            return check_calendar(scope, doc, limits, global, errors);
        }
    }
    let named = match doc.algorithm.as_deref() {
        None => None,
        Some(name) => match Algorithm::from_name(name) {
            Some(a) => Some(a),
            None => {
                scope.error(
                    errors,
                    format!("algorithm '{name}' is not one of {}", Algorithm::names()),
                );
                return false;
            }
        },
    };
    // a usage domain's rules charge costs into debt: the default is a
    // token bucket there, whatever --algorithm says for the others
    let algorithm = named.unwrap_or(if scope.usage {
        Algorithm::TokenBucket
    } else {
        scope.default_algorithm
    });
    let (suffix, most) = match algorithm {
        // (a calendar is a limit's `calendar:`, above)
        Algorithm::TokenBucket | Algorithm::CalendarWindow => return true,
        Algorithm::FixedWindow => ("~fixed", u64::MAX),
        Algorithm::SlidingWindow => ("~sliding", MAX_WINDOW_COUNT),
    };
    let name = algorithm.name();
    // said of a rule that names no algorithm of its own
    let by_default = if named.is_some() {
        String::new()
    } else if !matches!(action, Some(RuleAction::Limited(_))) {
        // a node with no limit (a parent, `unlimited`, `concurrency`) has
        // nothing for the default to count
        return true;
    } else {
        format!(" (the service's default, --algorithm {name}, which envoyproxy/ratelimit's environment sets; say `algorithm: token_bucket` on the rule, or RLS_ALGORITHM=token_bucket for every rule, to keep token buckets)")
    };
    let refused = [
        (
            doc.lease.is_some(),
            "`lease` (tokens handed out ahead; a window has none to hand out)",
        ),
        (doc.max_debt.is_some(), "`max_debt` (a window has no debt)"),
        (
            global,
            "`scope: global` (regions share a token bucket's rate)",
        ),
        (
            scope.usage,
            "a usage domain (its rules charge costs into debt)",
        ),
    ];
    for (set, what) in refused {
        if set {
            scope.error(
                errors,
                format!("`algorithm: {name}` with {what}: use the token bucket for it{by_default}"),
            );
            return false;
        }
    }
    let Some(RuleAction::Limited(limits)) = action else {
        scope.error(
            errors,
            format!("`algorithm: {name}` on a rule with no limit to count: give it `rate_limit` or `limits`{by_default}"),
        );
        return false;
    };
    for l in limits.iter_mut() {
        if l.burst != l.requests_per_unit {
            scope.error(
                errors,
                format!(
                    "`algorithm: {name}` with burst {} on a limit of {} per window: a window allows requests_per_unit per window and has no burst; drop burst{by_default}",
                    l.burst, l.requests_per_unit
                ),
            );
            return false;
        }
        if u64::from(l.requests_per_unit) > most {
            scope.error(
                errors,
                format!(
                    "`algorithm: {name}` with requests_per_unit {}: a sliding window counts at most {most} per window; use a fixed window or the token bucket for more{by_default}",
                    l.requests_per_unit
                ),
            );
            return false;
        }
        l.params.algorithm = algorithm;
        l.algorithm = algorithm;
        l.bucket_id.push_str(suffix);
    }
    true
}

/// A rule whose limits count in calendar periods: all of them do (a
/// descriptor's buckets are decided by one arithmetic), it names no other
/// algorithm, and what a budget a period cannot honour is refused with its
/// reason. `overdraft` and usage domains are honoured: their charges count.
fn check_calendar(
    scope: &Scope<'_>,
    doc: &DescriptorDoc,
    limits: &[Limit],
    global: bool,
    errors: &mut ConfigErrors,
) -> bool {
    let mut refuse = |what: String| {
        scope.error(errors, what);
        false
    };
    if limits.iter().any(|l| l.calendar.is_none()) {
        return refuse("a limit with a calendar beside one without: a rule's limits count one way; put the calendar limit on a descriptor of its own (Envoy sends both)".to_string());
    }
    if let Some(a) = &doc.algorithm {
        return refuse(format!("`algorithm: {a}` with a calendar limit: a calendar period counts as a budget of its own (admitted hits and charges until the period ends); drop algorithm"));
    }
    let refused = [
        (
            doc.lease.is_some(),
            "`lease` (tokens handed out ahead; a period has none to hand out)",
        ),
        (
            doc.max_debt.is_some(),
            "`max_debt` (a period's charges are all counted, none forgiven)",
        ),
        (
            global,
            "`scope: global` (regions share a token bucket's rate)",
        ),
    ];
    for (set, what) in refused {
        if set {
            return refuse(format!(
                "a calendar limit with {what}: use the token bucket for it"
            ));
        }
    }
    for l in limits {
        if l.burst != l.requests_per_unit {
            return refuse(format!(
                "a calendar limit with burst {} on {} a period: a period allows requests_per_unit and has no burst; drop burst",
                l.burst, l.requests_per_unit
            ));
        }
    }
    true
}

/// A limit's `calendar:`: the limit counted in the periods of its unit in
/// the named zone, from the anchor, `unit_multiplier` of them at a time.
pub(super) fn compile_calendar(
    scope: &Scope<'_>,
    at: &str,
    calendar: &CalendarDoc,
    limit: Limit,
    errors: &mut ConfigErrors,
) -> Option<Limit> {
    let Some(zone) = calendar.time_zone.as_deref() else {
        scope.error(
            errors,
            format!("{at}: calendar has no time_zone; name one of the IANA database (e.g. time_zone: America/New_York, or UTC)"),
        );
        return None;
    };
    match Calendar::parse(limit.unit.as_str(), zone, calendar.starts.as_deref()) {
        Ok(c) => {
            let every = limit.unit_multiplier;
            Some(limit.with_calendar(Arc::new(CalendarPeriods::new(c.every(every)))))
        }
        Err(e) => {
            scope.error(errors, format!("{at}: calendar: {e}"));
            None
        }
    }
}
