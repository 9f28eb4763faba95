//! What each descriptor of a request will be decided by, worked out
//! without any I/O: its rule (or the request's own limit override), the
//! limits left after `replaces`, its buckets and their keys (a calendar
//! limit's with the periods holding now), its cost, and the call of an
//! attempt it makes.

use std::collections::HashSet;
use std::sync::Arc;

use super::key::{self, KeyOrigin};
use super::DescriptorInput;
use crate::attempt::{AttemptCall, AttemptMode, Phase};
use crate::bucket::{Algorithm, BucketParams, Cost};
use crate::decision::{Decision, ShownLimit, Verdict};
use crate::labels::RuleId;
use crate::rules::{
    AttemptsConfig, BucketValue, DescriptorEntry, Limit, Rule, RuleAction, RuleSet, Unit,
};
use crate::store::{BucketRef, DescriptorBuckets};

/// What a descriptor will be decided by, before any store call.
pub(super) enum Plan<'a> {
    Done(Decision),
    Buckets {
        rule: Option<&'a Arc<Rule>>,
        limits: Vec<LimitRef<'a>>,
        buckets: DescriptorBuckets,
        cost: Cost,
        /// A `scope: global` rule's bucket id (the descriptor's entries),
        /// for a region's share of it.
        global: Option<Vec<(&'a str, std::borrow::Cow<'a, str>)>>,
        /// The call of an attempt, on a rule with `attempts:`.
        attempt: Option<AttemptCall>,
        /// The rule has `attempts:` and the descriptor named none.
        no_id: bool,
    },
    /// A `concurrency` rule: a slot of the descriptor taken or released.
    Slots {
        rule: &'a Arc<Rule>,
        /// The descriptor's tag (no buckets).
        slots: DescriptorBuckets,
        max: u64,
        /// `None`: the descriptor named no attempt.
        attempt: Option<AttemptCall>,
    },
}

impl Plan<'_> {
    /// The descriptor is an attempt's stream-done call: its request ran.
    pub(super) fn is_stream_done(&self) -> bool {
        let attempt = match self {
            Plan::Buckets { attempt, .. } | Plan::Slots { attempt, .. } => attempt.as_ref(),
            Plan::Done(_) => None,
        };
        attempt.is_some_and(|a| a.phase == Phase::Done)
    }
}

/// A limit taken from a rule, or made from a request override.
pub(super) enum LimitRef<'a> {
    Rule(&'a Limit),
    Override(u32, Unit),
}

impl LimitRef<'_> {
    pub(super) fn shown(&self) -> ShownLimit {
        match self {
            LimitRef::Rule(l) => ShownLimit {
                name: l.name.clone().unwrap_or_default(),
                requests_per_unit: l.requests_per_unit,
                unit: l.unit,
                window_secs: l.window_secs,
                burst: l.params.capacity,
            },
            LimitRef::Override(rpu, unit) => ShownLimit {
                name: String::new(),
                requests_per_unit: *rpu,
                unit: *unit,
                window_secs: unit.seconds(),
                burst: u64::from(*rpu),
            },
        }
    }
}

/// Now by the calendar's clock, for the periods of calendar limits.
#[derive(Debug, Clone, Copy)]
pub(super) struct CalendarNow {
    pub(super) unix_secs: i64,
    pub(super) offset_secs: i64,
}

/// Works out, without any I/O, what each descriptor will be decided by.
pub(super) fn plan<'a, E: DescriptorEntry>(
    rules: &'a RuleSet,
    domain: &str,
    descriptors: &'a [DescriptorInput<'a, E>],
    calendar: CalendarNow,
) -> Vec<Plan<'a>> {
    // looked up once for every descriptor of the call
    let rules_of_domain = rules.domain(domain);
    let known_domain = rules_of_domain.is_some();
    // a domain's attempt entries take no part in matching or bucket keys
    let attempt_keys: &[String] = rules_of_domain.map_or(&[], |d| &d.attempt_keys);
    let matching = |e: &&E| attempt_keys.is_empty() || !attempt_keys.iter().any(|k| k == e.key());
    let matches: Vec<_> = descriptors
        .iter()
        .map(|d| {
            if d.limit_override.is_some() && known_domain {
                None
            } else {
                rules_of_domain.and_then(|r| r.lookup(d.entries))
            }
        })
        .collect();

    // A limit named in another matched limit's `replaces` is dropped, an
    // unlimited one included (then the descriptor has no rule), as in
    // envoyproxy/ratelimit.
    // (built only when a matched rule replaces something: most calls
    // have no `replaces` at all)
    let mut replaced: HashSet<&str> = HashSet::new();
    for m in matches.iter().flatten() {
        match &m.rule.action {
            RuleAction::Limited(limits) => {
                for l in limits {
                    replaced.extend(l.replaces.iter().map(String::as_str));
                }
            }
            RuleAction::Unlimited { replaces, .. } => {
                replaced.extend(replaces.iter().map(String::as_str));
            }
            RuleAction::Concurrency { .. } => {}
        }
    }

    descriptors
        .iter()
        .zip(matches)
        .map(|(d, m)| {
            if let (Some(limit), Some(of_domain)) = (d.limit_override, rules_of_domain) {
                return override_plan(of_domain, domain, d, limit, &matching);
            }
            let Some(m) = m else {
                return Plan::Done(Decision::without_limit(Verdict::NoRule, None));
            };
            // the descriptor's tag: its entries and the values they matched
            let tag_of = || {
                key::descriptor_tag(
                    KeyOrigin::Rule,
                    domain,
                    d.entries
                        .iter()
                        .filter(matching)
                        .map(|e| e.key())
                        .zip(m.values.iter().copied()),
                )
            };
            let limits: Vec<&Limit> = match &m.rule.action {
                RuleAction::Unlimited {
                    name: Some(name), ..
                } if replaced.contains(name.as_str()) => {
                    return Plan::Done(Decision::without_limit(
                        Verdict::NoRule,
                        Some(m.rule.clone()),
                    ))
                }
                RuleAction::Unlimited { .. } => {
                    return Plan::Done(Decision {
                        remaining: u64::from(u32::MAX),
                        ..Decision::without_limit(Verdict::Unlimited, Some(m.rule.clone()))
                    })
                }
                RuleAction::Limited(limits) => limits
                    .iter()
                    .filter(|l| l.name.as_deref().is_none_or(|n| !replaced.contains(n)))
                    .collect(),
                RuleAction::Concurrency { max } => {
                    let tag = tag_of();
                    return Plan::Slots {
                        rule: m.rule,
                        slots: DescriptorBuckets {
                            tag,
                            buckets: Vec::new(),
                            replication: None,
                            ratelimit_key: None,
                        },
                        max: u64::from(*max),
                        attempt: m
                            .rule
                            .attempts
                            .as_ref()
                            .and_then(|a| attempt_call(a, d.entries)),
                    };
                }
            };
            if limits.is_empty() {
                return Plan::Done(Decision::without_limit(
                    Verdict::NoRule,
                    Some(m.rule.clone()),
                ));
            }
            let tag = tag_of();
            let buckets = limits
                .iter()
                .map(|l| BucketRef {
                    key: key::bucket_key(&tag, &l.bucket_id),
                    params: l.params_at(calendar.unix_secs, calendar.offset_secs),
                    rule: m.rule.id,
                })
                .collect();
            // on a usage-accounting rule a spend is a charge, never refused
            let usual = match d.cost {
                Cost::Spend(n) if m.rule.overdraft => Cost::Charge(n),
                Cost::Spend(n) if m.rule.usage_charges && d.own_hits_addend => Cost::Charge(n),
                other => other,
            };
            // a rule whose `attempts:` a reload removed still settles the
            // done calls of attempts started before it, from their records
            let attempts = m.rule.attempts.as_ref().or_else(|| {
                let retired = rules_of_domain.filter(|r| !r.retired_attempts.is_empty())?;
                let now_ms = calendar.unix_secs.saturating_sub(calendar.offset_secs);
                let now_ms = u64::try_from(now_ms).unwrap_or(0).saturating_mul(1000);
                retired.retired_attempts(&m.rule.path, now_ms)
            });
            let attempt = attempts
                .and_then(|a| attempt_call(a, d.entries))
                .filter(|call| m.rule.attempts.is_some() || call.phase == Phase::Done);
            let cost = match (attempts, &attempt) {
                (Some(a), Some(call)) => attempt_cost(a, call, d, usual),
                _ => usual,
            };
            let no_id = m.rule.attempts.is_some() && attempt.is_none();
            let global = m.rule.global.then(|| {
                d.entries
                    .iter()
                    .filter(matching)
                    .map(|e| (e.key(), crate::rules::bounded_value(e.value())))
                    .collect::<Vec<_>>()
            });
            Plan::Buckets {
                rule: Some(m.rule),
                limits: limits.into_iter().map(LimitRef::Rule).collect(),
                buckets: DescriptorBuckets {
                    tag,
                    buckets,
                    replication: m.rule.replication,
                    // every entry the request sent, as that service keys them
                    ratelimit_key: m.rule.ratelimit_keys.then(|| {
                        let values = m
                            .values
                            .iter()
                            .copied()
                            .map(Some)
                            .chain(std::iter::repeat(None));
                        key::ratelimit_key(
                            domain,
                            d.entries.iter().filter(matching).zip(values).map(|(e, v)| {
                                (
                                    e.key(),
                                    v.filter(|v| matches!(v, BucketValue::Shared(_)))
                                        .unwrap_or(BucketValue::Value(e.value())),
                                )
                            }),
                        )
                    }),
                },
                cost,
                global,
                attempt,
                no_id,
            }
        })
        .collect()
}

/// A descriptor carrying Envoy's `limit` override: a bucket of the
/// override's own (its numbers part of the key: two overrides on the same
/// entries are two buckets). Where the domain counts envoyproxy/ratelimit's
/// way (`--algorithm fixed_window`, which its environment sets), a fixed
/// window in its key (`domain_key_value_…_` and the window's start, as its
/// `GetLimit` keys an override), so that both services count one budget.
fn override_plan<'a, E: DescriptorEntry>(
    of_domain: &crate::rules::Domain,
    domain: &str,
    d: &'a DescriptorInput<'a, E>,
    (rpu, unit): (u32, Unit),
    matching: &impl Fn(&&E) -> bool,
) -> Plan<'a> {
    let entries = || {
        d.entries
            .iter()
            .filter(matching)
            .map(|e| (e.key(), BucketValue::Value(e.value())))
    };
    let tag = key::descriptor_tag(KeyOrigin::Override, domain, entries());
    let fixed = of_domain.override_algorithm == Algorithm::FixedWindow;
    let params = BucketParams {
        capacity: u64::from(rpu),
        tokens_per_unit: u64::from(rpu),
        unit_secs: unit.seconds(),
        max_debt: None,
        algorithm: match fixed {
            true => Algorithm::FixedWindow,
            false => Algorithm::TokenBucket,
        },
        period: None,
    };
    Plan::Buckets {
        rule: None,
        limits: vec![LimitRef::Override(rpu, unit)],
        buckets: DescriptorBuckets {
            buckets: vec![BucketRef {
                key: key::bucket_key(&tag, &format!("override/{rpu}/{}", unit.seconds())),
                params,
                rule: RuleId::of(domain, "override"),
            }],
            tag,
            replication: None,
            ratelimit_key: fixed.then(|| key::ratelimit_key(domain, entries())),
        },
        cost: match d.cost {
            Cost::Spend(n) if d.own_hits_addend && rpu > 0 && of_domain.usage => Cost::Charge(n),
            other => other,
        },
        global: None,
        attempt: None,
        no_id: false,
    }
}

/// The call of an attempt a descriptor makes on a rule with `attempts`:
/// its id (the value of the entry the rule names; `None` when it has none,
/// or an empty one) and its phase (`done` when the phase entry says so).
fn attempt_call<E: DescriptorEntry>(a: &AttemptsConfig, entries: &[E]) -> Option<AttemptCall> {
    let id = entries
        .iter()
        .find(|e| e.key() == a.key)
        .map(|e| e.value())
        .filter(|v| !v.is_empty())?;
    let done = entries
        .iter()
        .any(|e| e.key() == a.phase_key && e.value() == "done");
    Some(AttemptCall {
        id: crate::rules::bounded_value(id).as_bytes().to_vec(),
        phase: if done { Phase::Done } else { Phase::Start },
        mode: a.mode,
        ttl_micros: u64::try_from(a.ttl.as_micros()).unwrap_or(u64::MAX),
        max_repeats: a.max_repeats,
    })
}

/// What a call of an attempt costs before its record is read: a
/// reservation's start spends its estimate (its own `hits_addend`, at
/// least the rule's `reserve`; without one of its own, the `reserve`) and
/// is refused when the buckets do not hold it; a done call brings what was
/// used (the record turns it into the settlement); a dedupe rule's call
/// costs what it would without attempts. A start whose own estimate was 0
/// (a check) reserved nothing, so twenty chats started at once on a budget
/// that holds one (issue 51): the rule's `reserve` is a floor.
fn attempt_cost<E>(
    a: &AttemptsConfig,
    call: &AttemptCall,
    d: &DescriptorInput<'_, E>,
    usual: Cost,
) -> Cost {
    match (call.mode, call.phase, d.cost) {
        (AttemptMode::Reserve, Phase::Start, Cost::Spend(_) | Cost::Check) => {
            let own = match d.cost {
                Cost::Spend(n) if d.own_hits_addend => Some(n),
                Cost::Check => Some(0),
                _ => None,
            };
            match (own, a.reserve) {
                (Some(n), Some(floor)) => Cost::Spend(n.max(floor)),
                (None, Some(estimate)) => Cost::Spend(estimate),
                // no `reserve` to fall back on: the call as it came
                (_, None) => d.cost,
            }
        }
        (AttemptMode::Reserve, Phase::Done, cost) => cost,
        _ => usual,
    }
}
