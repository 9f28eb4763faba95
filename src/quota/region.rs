//! A region's side of a global budget (`scope: global` rules on an
//! instance started with `--quota-upstream`): which share of each global
//! bucket this region may spend now, and the demand to report for it.
//!
//! Pure apart from a lock: every entry point takes the time. The limiter
//! asks [`RegionShares::limit`] what a global rule's bucket may hold for a
//! request and records the outcome ([`RegionShares::record`]); the
//! upstream client ([`super::upstream`]) takes the reports every interval
//! and hands back the global tier's assignments.
//!
//! **What a bucket may hold.**
//! - A live assignment from the global tier: that share (B_r, r_r), spent in
//!   this region's own store, so exactly across the region's instances.
//! - No live assignment while the global tier is reachable (a bucket new to
//!   this region, or one its share lapsed for): the floor, B/N and r/N
//!   (N = `--regions`). The global tier keeps that much of every budget
//!   out of its split for each region that is not in it, so a first
//!   request is decided at once and the sum stays within the budget.
//! - No live assignment while the global tier is unreachable: the rule's
//!   `failure_mode` for the global budget: `local` → the same B/N and r/N,
//!   `closed` → UNAVAILABLE, `open` → no limit.
//!
//! **Bounded.** At most [`MAX_BUCKETS`] buckets; a bucket idle for
//! [`IDLE_MICROS`] with no live share is forgotten. A request for a
//! bucket past the bound is decided at the floor and not reported.
//!
//! **Trusting the global tier only so far.** An assignment is cut to the
//! rule's own burst and rate (a region never spends more than the whole
//! budget, whatever it is told) and to the longest time to live the global
//! tier sends ([`crate::quota::MAX_TTL_MICROS`]), so that a share outlives
//! a vanished tier by at most that; what was cut is counted
//! ([`RegionShares::take_clamped`]).
//!
//! **Reachable** means a stream the global tier took: true at start (a
//! new region spends its floors at once), false once an attempt fails or a
//! stream is refused, true again only once an assignment arrives.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use parking_lot::Mutex;

use super::assignment::micros_of;
use crate::bucket::{Algorithm, BucketParams};
use crate::clock::{Clock, MonotonicClock};
use crate::rules::FailureMode;

/// Global buckets one region holds at most.
pub const MAX_BUCKETS: usize = 100_000;
/// A bucket without requests and without a live share for this long is
/// forgotten (and no longer reported: the global tier lets it go).
pub const IDLE_MICROS: u64 = 30_000_000;

/// What a global rule's bucket may hold for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionLimit {
    /// The share the global tier assigned, live.
    Share(BucketParams),
    /// B/N and r/N: no live share (the global tier is reachable and keeps
    /// this much for the region, or it is not and the rule fails `local`).
    Floor(BucketParams),
    /// Unreachable, no live share, the rule fails `closed`.
    Closed,
    /// Unreachable, no live share, the rule fails `open`.
    Open,
}

/// B/N and r/N of a rule's bucket: at least one token, as for the `local`
/// failure mode (so the world's burst is at most max(B, N)).
pub fn floor(params: BucketParams, regions: u32) -> BucketParams {
    let n = u64::from(regions.max(1));
    BucketParams {
        capacity: (params.capacity / n).max(1),
        tokens_per_unit: params.tokens_per_unit,
        unit_secs: params.unit_secs.saturating_mul(n),
        max_debt: None,
        algorithm: Algorithm::TokenBucket,
        period: None,
    }
}

/// Assignments cut to range since the last [`RegionShares::take_clamped`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Clamped {
    pub burst: u64,
    pub rate: u64,
    pub ttl: u64,
}

/// A live assignment.
#[derive(Debug, Clone, Copy)]
struct Assigned {
    params: BucketParams,
    expires_micros: u64,
}

#[derive(Debug)]
struct Entry {
    domain: String,
    /// [`canonical`] of the domain and id: how the global tier's answers
    /// find it.
    name: String,
    /// The bucket id reported: the descriptor's entries.
    id: BucketId,
    /// The rule's own numbers, as of its last request: no share exceeds them.
    rule: BucketParams,
    share: Option<Assigned>,
    /// The numbers the last decision was given (share or floor).
    last: Option<BucketParams>,
    /// A share that grows is given to decisions at the numbers before it
    /// until one is admitted (a spend writes the bucket's refill at those
    /// numbers; a rejection writes nothing), for at most [`SETTLE_MICROS`]:
    /// until then ([`RegionShares::apply`]).
    settle: Option<u64>,
    allowed: u64,
    denied: u64,
    last_request_micros: u64,
    last_report_micros: u64,
}

/// A snapshot for `/metrics`: per (domain, rule label), the live shares'
/// burst and rate summed over the rule's buckets.
pub type ShareTotals = BTreeMap<(String, String), (f64, f64)>;

/// The buckets, by the descriptor's bucket tag (what the store keys by),
/// and the tags by [`canonical`] name.
#[derive(Debug, Default)]
struct Buckets {
    by_tag: HashMap<Vec<u8>, Entry>,
    by_name: HashMap<String, Vec<u8>>,
}

/// A bucket id of a domain as one string, whatever the order of its pairs.
fn canonical<'a>(domain: &str, pairs: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    let mut pairs: Vec<_> = pairs.collect();
    pairs.sort_unstable();
    let mut name = domain.to_owned();
    for (k, v) in pairs {
        name.push('\u{1f}');
        name.push_str(k);
        name.push('\u{1e}');
        name.push_str(v);
    }
    name
}

/// One region's shares of the global buckets, and their demand.
#[derive(Debug)]
pub struct RegionShares {
    regions: u32,
    /// The time every caller passes (the limiter's and the upstream
    /// client's), so that an expiry means the same to both.
    clock: MonotonicClock,
    buckets: Mutex<Buckets>,
    /// Whether the global tier answers (true at start, until the first
    /// attempt to reach it fails).
    reachable: AtomicBool,
    /// When the last assignment arrived (0: never).
    last_assignment_micros: AtomicU64,
    /// Requests decided at the floor because [`MAX_BUCKETS`] were held.
    over_bound: AtomicU64,
    /// Assignments cut to range, not yet taken.
    clamped: Mutex<Clamped>,
}

impl RegionShares {
    /// For one of `regions` regions (`--regions`).
    pub fn new(regions: u32) -> Self {
        Self {
            regions: regions.max(1),
            clock: MonotonicClock::new(),
            buckets: Mutex::new(Buckets::default()),
            // until the first attempt to reach it fails: a region that
            // starts spends its floors at once (always within the bound:
            // the global tier keeps B/N for a region not in its split)
            reachable: AtomicBool::new(true),
            last_assignment_micros: AtomicU64::new(0),
            over_bound: AtomicU64::new(0),
            clamped: Mutex::new(Clamped::default()),
        }
    }

    /// Assignments cut to range since the last call.
    pub fn take_clamped(&self) -> Clamped {
        std::mem::take(&mut *self.clamped.lock())
    }

    pub fn regions(&self) -> u32 {
        self.regions
    }

    /// Now, as every entry point of this region's state should be told.
    pub fn now_micros(&self) -> u64 {
        self.clock.now_micros()
    }

    /// The upstream client says whether its stream is up.
    pub fn set_reachable(&self, up: bool) {
        self.reachable.store(up, Ordering::Relaxed);
    }

    pub fn reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// Microseconds since the last assignment arrived; `None` before one.
    pub fn since_last_assignment(&self, now_micros: u64) -> Option<u64> {
        match self.last_assignment_micros.load(Ordering::Relaxed) {
            0 => None,
            t => Some(now_micros.saturating_sub(t)),
        }
    }

    /// Requests decided at the floor, unreported, because the bound was
    /// reached, since the last call.
    pub fn take_over_bound(&self) -> u64 {
        self.over_bound.swap(0, Ordering::Relaxed)
    }

    /// Buckets held now.
    pub fn len(&self) -> usize {
        self.buckets.lock().by_tag.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the bucket `tag` of a global rule (its own numbers `params`,
    /// failing `mode`) may hold now; `entries` name it to the global tier.
    pub fn limit<'e>(
        &self,
        domain: &str,
        tag: &[u8],
        entries: impl Iterator<Item = (&'e str, &'e str)>,
        params: BucketParams,
        mode: FailureMode,
        now_micros: u64,
    ) -> RegionLimit {
        let mut buckets = self.buckets.lock();
        let held = buckets.by_tag.len();
        let share = match buckets.by_tag.get_mut(tag) {
            Some(entry) => {
                entry.last_request_micros = now_micros;
                entry.rule = params;
                let live = entry.share.filter(|a| a.expires_micros > now_micros);
                let given = match (live, entry.last) {
                    // a decision soon after the share grew refills at the
                    // numbers before it: the time before the growth is not
                    // credited at the new rate
                    (Some(a), Some(before))
                        if entry.settle.is_some_and(|until| now_micros < until) =>
                    {
                        Some(Assigned {
                            params: before,
                            ..a
                        })
                    }
                    (live, _) => live,
                };
                entry.last = match given {
                    Some(a) => Some(a.params),
                    None if self.reachable() || mode == FailureMode::Local => {
                        Some(floor(params, self.regions))
                    }
                    None => None,
                };
                given
            }
            None if held >= MAX_BUCKETS => {
                self.over_bound.fetch_add(1, Ordering::Relaxed);
                return RegionLimit::Floor(floor(params, self.regions));
            }
            None => {
                let id = BucketId {
                    bucket: entries.map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
                };
                let name = canonical(
                    domain,
                    id.bucket.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                );
                buckets.by_name.insert(name.clone(), tag.to_owned());
                buckets.by_tag.insert(
                    tag.to_owned(),
                    Entry {
                        domain: domain.to_owned(),
                        name,
                        id,
                        rule: params,
                        share: None,
                        last: Some(floor(params, self.regions)),
                        settle: None,
                        allowed: 0,
                        denied: 0,
                        last_request_micros: now_micros,
                        last_report_micros: 0,
                    },
                );
                None
            }
        };
        drop(buckets);
        match share {
            Some(a) => RegionLimit::Share(a.params),
            None if self.reachable() => RegionLimit::Floor(floor(params, self.regions)),
            None => match mode {
                FailureMode::Local => RegionLimit::Floor(floor(params, self.regions)),
                FailureMode::Closed => RegionLimit::Closed,
                FailureMode::Open => RegionLimit::Open,
            },
        }
    }

    /// Counts one decision of the bucket `tag` (its demand for the report).
    pub fn record(&self, tag: &[u8], admitted: bool) {
        if let Some(entry) = self.buckets.lock().by_tag.get_mut(tag) {
            if admitted {
                entry.allowed += 1;
                entry.settle = None;
            } else {
                entry.denied += 1;
            }
        }
    }

    /// The reports to send now, per domain: every bucket with requests
    /// since its last report, and every bucket with a live share active
    /// within [`IDLE_MICROS`] (a report of none keeps the region in the
    /// split). Buckets idle that long without a live share are forgotten.
    pub fn take_reports(&self, now_micros: u64) -> BTreeMap<String, Vec<BucketQuotaUsage>> {
        let mut out: BTreeMap<String, Vec<BucketQuotaUsage>> = BTreeMap::new();
        let mut buckets = self.buckets.lock();
        let Buckets { by_tag, by_name } = &mut *buckets;
        by_tag.retain(|_, e| {
            let live = e.share.is_some_and(|a| a.expires_micros > now_micros);
            let idle = now_micros.saturating_sub(e.last_request_micros) >= IDLE_MICROS;
            let requests = e.allowed + e.denied;
            if requests == 0 && idle && !live {
                by_name.remove(&e.name);
                return false;
            }
            if requests > 0 || !idle {
                let elapsed = if e.last_report_micros == 0 {
                    1_000_000
                } else {
                    now_micros.saturating_sub(e.last_report_micros).max(1)
                };
                out.entry(e.domain.clone())
                    .or_default()
                    .push(BucketQuotaUsage {
                        bucket_id: Some(e.id.clone()),
                        time_elapsed: Some(PbDuration {
                            seconds: i64::try_from(elapsed / 1_000_000).unwrap_or(i64::MAX),
                            nanos: ((elapsed % 1_000_000) * 1000) as i32,
                        }),
                        num_requests_allowed: e.allowed,
                        num_requests_denied: e.denied,
                    });
                e.allowed = 0;
                e.denied = 0;
                e.last_report_micros = now_micros;
            }
            true
        });
        out
    }

    /// The global tier's answer for `domain`: each action sets or drops a
    /// bucket's share, cut to the rule's numbers and the longest time to
    /// live. Returns how many were taken (an id this region does not hold
    /// is passed over). An answer means the global tier took this region's
    /// stream: reachable.
    pub fn apply(&self, domain: &str, actions: &[BucketAction], now_micros: u64) -> usize {
        self.set_reachable(true);
        let mut taken = 0;
        let mut clamped = Clamped::default();
        let mut buckets = self.buckets.lock();
        let Buckets { by_tag, by_name } = &mut *buckets;
        for action in actions {
            let Some(id) = &action.bucket_id else {
                continue;
            };
            let name = canonical(
                domain,
                id.bucket.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            );
            let Some(entry) = by_name.get(&name).and_then(|tag| by_tag.get_mut(tag)) else {
                continue;
            };
            match &action.bucket_action {
                Some(bucket_action::BucketAction::QuotaAssignmentAction(a)) => {
                    let mut ttl = a.assignment_time_to_live.as_ref().map_or(0, micros_of);
                    if ttl > MAX_SHARE_TTL_MICROS {
                        ttl = MAX_SHARE_TTL_MICROS;
                        clamped.ttl += 1;
                    }
                    let params = a
                        .rate_limit_strategy
                        .as_ref()
                        .and_then(|s| s.strategy.as_ref())
                        .and_then(params_of)
                        .map(|p| within_rule(p, entry.rule, &mut clamped));
                    // grown beyond what the bucket was last decided with:
                    // settle at the old numbers, where they can admit at all
                    entry.settle = match (params, entry.last) {
                        (Some(new), Some(before))
                            if before.capacity > 0
                                && before.tokens_per_unit > 0
                                && grows(before, new) =>
                        {
                            Some(now_micros.saturating_add(SETTLE_MICROS))
                        }
                        _ => None,
                    };
                    entry.share = params.map(|params| Assigned {
                        params,
                        expires_micros: now_micros.saturating_add(ttl),
                    });
                    taken += 1;
                }
                Some(bucket_action::BucketAction::AbandonAction(_)) => {
                    entry.share = None;
                    taken += 1;
                }
                None => {}
            }
        }
        drop(buckets);
        if clamped != Clamped::default() {
            let mut total = self.clamped.lock();
            total.burst += clamped.burst;
            total.rate += clamped.rate;
            total.ttl += clamped.ttl;
        }
        if taken > 0 {
            self.last_assignment_micros
                .store(now_micros.max(1), Ordering::Relaxed);
        }
        taken
    }

    /// The live shares per (domain, `label` of the bucket's rule).
    pub fn totals(
        &self,
        label: impl Fn(&str, &BucketId) -> Option<String>,
        now_micros: u64,
    ) -> ShareTotals {
        let mut totals = ShareTotals::new();
        for e in self.buckets.lock().by_tag.values() {
            let Some(a) = e.share.filter(|a| a.expires_micros > now_micros) else {
                continue;
            };
            let Some(rule) = label(&e.domain, &e.id) else {
                continue;
            };
            let t = totals.entry((e.domain.clone(), rule)).or_default();
            t.0 += a.params.capacity as f64;
            t.1 += a.params.tokens_per_unit as f64 / a.params.unit_secs.max(1) as f64;
        }
        totals
    }
}

/// The longest time to live a share is held: the longest the global tier
/// sends (and its margin).
pub const MAX_SHARE_TTL_MICROS: u64 = super::MAX_TTL_MICROS + super::LIVE_MARGIN_MICROS;

/// How long a share that grew is given at the numbers before it, at most
/// (a decision admitted ends it sooner).
pub const SETTLE_MICROS: u64 = 2_000_000;

/// Whether `a` refills faster than `b` (compared exactly: x/y > z/w as
/// x·w > z·y).
fn faster(a: BucketParams, b: BucketParams) -> bool {
    u128::from(a.tokens_per_unit) * u128::from(b.unit_secs.max(1))
        > u128::from(b.tokens_per_unit) * u128::from(a.unit_secs.max(1))
}

/// Whether `after` holds more tokens or refills faster than `before`.
fn grows(before: BucketParams, after: BucketParams) -> bool {
    after.capacity > before.capacity || faster(after, before)
}

/// `share` cut to the rule's burst and rate (counted in `clamped`): a
/// region never holds more than the whole budget.
fn within_rule(share: BucketParams, rule: BucketParams, clamped: &mut Clamped) -> BucketParams {
    let mut out = share;
    if out.capacity > rule.capacity {
        out.capacity = rule.capacity;
        clamped.burst += 1;
    }
    if faster(out, rule) {
        out.tokens_per_unit = rule.tokens_per_unit;
        out.unit_secs = rule.unit_secs;
        clamped.rate += 1;
    }
    out
}

/// A strategy as bucket numbers: a token bucket as it is (whole tokens,
/// whole seconds: what [`super::token_bucket`] sends); DENY_ALL as a bucket
/// that never admits; ALLOW_ALL (the global tier has no limit for it) as
/// `None`: no share, so the floor applies.
fn params_of(strategy: &Strategy) -> Option<BucketParams> {
    match strategy {
        Strategy::TokenBucket(tb) => {
            let per_fill = tb.tokens_per_fill.as_ref().map_or(1, |v| v.value);
            let secs = tb
                .fill_interval
                .as_ref()
                .map_or(1, |d| micros_of(d) / 1_000_000);
            Some(BucketParams {
                capacity: u64::from(tb.max_tokens),
                tokens_per_unit: u64::from(per_fill),
                unit_secs: secs.max(1),
                max_debt: None,
                algorithm: Algorithm::TokenBucket,
                period: None,
            })
        }
        Strategy::BlanketRule(r) if *r == BlanketRule::DenyAll as i32 => Some(BucketParams {
            capacity: 0,
            tokens_per_unit: 0,
            unit_secs: 1,
            max_debt: None,
            algorithm: Algorithm::TokenBucket,
            period: None,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
