//! Rate Limit Quota Service (RLQS) state: which Envoy streams report which
//! bucket, what each bucket's rule says, and what to send to whom.
//!
//! Pure apart from the rules snapshot it reads: every entry point takes the
//! time and returns the messages to send per stream, which the gRPC face
//! (`service::quota`) writes. [`policy`] says what a bucket's rule gives it,
//! [`allocation`] splits it within this instance, [`ledger`] across
//! replicas, and [`assignment`] makes Envoy's messages.
//!
//! **Buckets and rules.** Envoy builds a bucket id (an unordered map of
//! strings) itself; it becomes a descriptor path of the stream's domain by
//! walking the rules tree ([`crate::rules::RuleSet::quota_path`]), and the
//! rule that path reaches decides: no rule, an `unlimited` rule or a
//! `shadow_mode` rule → ALLOW_ALL; `requests_per_unit: 0` → DENY_ALL; else a
//! token bucket, this Envoy's share of the rule's bucket (of the limit with
//! the lowest rate, when it has several). Each bucket id is one global bucket,
//! split between the Envoys reporting it.

pub mod allocation;
pub mod assignment;
pub mod ledger;
pub mod policy;
pub mod redis_ledger;

use std::collections::HashMap;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::BlanketRule;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaResponse};

use self::allocation::{smoothed, Allocation, Budget};
pub use self::assignment::token_bucket;
use self::assignment::{action, moved, outbox, Sent};
use self::ledger::Shared;
use self::policy::rule_label;
pub use self::policy::{describe_domain, expired_behavior, rule_notes, Policy};
use crate::rules::RuleSet;

/// One Envoy's stream.
pub type StreamId = u64;

/// Assignments live this many report intervals, so that a late report or
/// two never lets one expire while its Envoy still reports.
pub const TTL_INTERVALS: u64 = 3;
/// Bounds on an assignment's time to live.
pub const MIN_TTL_MICROS: u64 = 3_000_000;
pub const MAX_TTL_MICROS: u64 = 60_000_000;
/// A bucket a stream reports without requests for this long is abandoned.
pub const ABANDON_AFTER_MICROS: u64 = 300_000_000;
/// A stream quiet about a bucket for less than this stays in its split.
pub const MIN_QUIET_MICROS: u64 = 15_000_000;
/// An assignment counts as live this long beyond its time to live: Envoy
/// starts its clock when the message arrives, a little after it was planned.
pub const LIVE_MARGIN_MICROS: u64 = 500_000;
/// A share that moved by less than this fraction is not re-sent early.
pub const RESEND_THRESHOLD: f64 = 0.05;
/// Buckets one stream may hold; reports of more are not taken (Envoy
/// applies its `no_assignment_behavior` to them).
pub const MAX_BUCKETS_PER_STREAM: usize = 20_000;
/// (stream, bucket) pairs one instance holds at most, all streams together.
pub const MAX_SUBSCRIPTIONS: usize = 1_000_000;
/// With a shared ledger, a pair whose stream does not report is stepped
/// at every tick (once a second; this is a little less, so that a tick
/// coming early never skips it): well below [`ledger::STALE_MS`], so a live
/// replica never looks dead, and a third of the shortest time to live, so
/// refreshes are due in time.
pub const SHARED_REFRESH_MICROS: u64 = 900_000;

/// A bucket: its domain and its id's pairs, sorted.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketKey {
    pub domain: String,
    pub pairs: Vec<(String, String)>,
}

impl BucketKey {
    fn new(domain: &str, id: &BucketId) -> Self {
        let mut pairs: Vec<(String, String)> = id
            .bucket
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        pairs.sort_unstable();
        Self {
            domain: domain.to_owned(),
            pairs,
        }
    }

    pub fn id(&self) -> BucketId {
        BucketId {
            bucket: self.pairs.iter().cloned().collect(),
        }
    }
}

/// A bucket as one stream reports it.
#[derive(Debug, Clone, Default)]
struct Subscription {
    last_report_micros: u64,
    /// Smoothed time between reports.
    interval_micros: u64,
    /// What was last sent, when, and its time to live.
    sent: Option<(Sent, u64, u64)>,
    /// Since when every report said no requests; `None` while it has some.
    idle_since_micros: Option<u64>,
    /// Smoothed requests per second (for a shared ledger; the local split
    /// keeps its own).
    demand: Option<f64>,
    /// When a ledger step was last queued for it.
    stepped_micros: u64,
}

#[derive(Debug)]
struct Bucket {
    policy: Policy,
    /// The label of the rule reached (metrics), if any.
    rule: Option<String>,
    generation: u64,
    allocation: Allocation<StreamId>,
    /// With a shared ledger: Σ reserved by all replicas' Envoys, as the
    /// last step saw it.
    shared_reserved: Budget,
}

#[derive(Debug, Default)]
struct Stream {
    domain: Option<String>,
    buckets: HashMap<BucketKey, Subscription>,
}

/// Every stream and bucket.
#[derive(Debug, Default)]
pub struct Quotas {
    streams: HashMap<StreamId, Stream>,
    buckets: HashMap<BucketKey, Bucket>,
    /// Instances serving RLQS (`--instances`): each splits 1/N of every
    /// budget among its own Envoys, so N of them never assign more than
    /// the budget together. 0 is taken as 1. Not used with a shared ledger.
    instances: u32,
    /// Whether a shared ledger splits the budgets ([`ledger`]): then
    /// Shared buckets are not planned here but queued as [`Step`]s, and
    /// [`Quotas::granted`] takes the ledger's answers.
    shared: bool,
    /// Queued ledger steps, one per (stream, bucket): a newer one replaces
    /// an older one not taken yet, so the queue never outgrows the pairs.
    steps: HashMap<(StreamId, BucketKey), Step>,
    /// Bucket reports not taken since the last [`Quotas::take_dropped`]:
    /// (invalid, over a limit).
    dropped: (u64, u64),
}

/// A step of the shared ledger to take for one stream and bucket: its
/// demand (`None`: it leaves the bucket) and the bucket's budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub stream: StreamId,
    pub key: BucketKey,
    pub demand: Option<f64>,
    pub budget: Budget,
    pub ttl_micros: u64,
}

/// Messages to write, per stream.
pub type Outbox = Vec<(StreamId, RateLimitQuotaResponse)>;

impl Quotas {
    /// State for one of `instances` instances (see [`Quotas::instances`]).
    pub fn for_instances(instances: u32) -> Self {
        Self {
            instances,
            ..Self::default()
        }
    }

    /// State whose budgets a shared ledger splits between replicas.
    pub fn shared() -> Self {
        Self {
            shared: true,
            ..Self::default()
        }
    }

    /// Bucket reports not taken since the last call: (without a valid
    /// bucket id, over [`MAX_BUCKETS_PER_STREAM`] or [`MAX_SUBSCRIPTIONS`]).
    pub fn take_dropped(&mut self) -> (u64, u64) {
        std::mem::take(&mut self.dropped)
    }

    /// The ledger steps queued since the last call.
    pub fn take_steps(&mut self) -> Vec<Step> {
        self.steps.drain().map(|(_, step)| step).collect()
    }

    pub fn open(&mut self, stream: StreamId) {
        self.streams.entry(stream).or_default();
    }

    /// Streams open now.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// Buckets with at least one reporting stream or a live assignment.
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// One message of usage reports from `stream`. The first message names
    /// the domain; later ones are in it whatever they say.
    pub fn report(
        &mut self,
        stream: StreamId,
        domain: &str,
        usages: &[BucketQuotaUsage],
        rules: &RuleSet,
        now_micros: u64,
    ) -> Result<Outbox, String> {
        self.prune(now_micros);
        let mut held: usize = self.streams.values().map(|s| s.buckets.len()).sum();
        let entry = self.streams.entry(stream).or_default();
        let domain = match &entry.domain {
            Some(d) => d.clone(),
            None if domain.is_empty() => {
                return Err("the first usage report of a stream must name its domain".into())
            }
            None => {
                entry.domain = Some(domain.to_owned());
                domain.to_owned()
            }
        };
        let mut touched = Vec::with_capacity(usages.len());
        for usage in usages {
            // a report Envoy should not send is passed over, not the stream
            // ended: its other buckets stay served
            let Some(id) = usage.bucket_id.as_ref().filter(|id| !id.bucket.is_empty()) else {
                self.dropped.0 += 1;
                continue;
            };
            let key = BucketKey::new(&domain, id);
            if !entry.buckets.contains_key(&key) {
                if entry.buckets.len() >= MAX_BUCKETS_PER_STREAM || held >= MAX_SUBSCRIPTIONS {
                    self.dropped.1 += 1;
                    continue;
                }
                held += 1;
            }
            let sub = entry.buckets.entry(key.clone()).or_default();
            // a report without elapsed time counts over the usual interval
            let given = usage
                .time_elapsed
                .as_ref()
                .map_or(0.0, |d| d.seconds as f64 + f64::from(d.nanos) / 1e9);
            let elapsed_secs = if given > 0.0 {
                given
            } else if sub.interval_micros > 0 {
                sub.interval_micros as f64 / 1e6
            } else {
                1.0
            };
            // the first report comes when the bucket is new (its elapsed
            // time is since then): the cadence is learnt from the gaps
            if sub.last_report_micros > 0 {
                let gap = now_micros.saturating_sub(sub.last_report_micros);
                sub.interval_micros = if sub.interval_micros == 0 {
                    gap
                } else {
                    (sub.interval_micros + gap) / 2
                };
            }
            sub.last_report_micros = now_micros;
            let requests = usage
                .num_requests_allowed
                .saturating_add(usage.num_requests_denied);
            if requests > 0 {
                sub.idle_since_micros = None;
            } else if sub.idle_since_micros.is_none() {
                sub.idle_since_micros = Some(now_micros);
            }
            let bucket = self.buckets.entry(key.clone()).or_insert_with(|| Bucket {
                policy: Policy::of(rules, &key.domain, &key.pairs),
                rule: rule_label(rules, &key.domain, &key.pairs),
                generation: rules.generation(),
                allocation: Allocation::new(Budget::ZERO),
                shared_reserved: Budget::ZERO,
            });
            if self.shared {
                sub.demand = Some(smoothed(sub.demand, requests, elapsed_secs));
            } else {
                bucket.allocation.report(&stream, requests, elapsed_secs);
            }
            touched.push(key);
        }
        touched.sort_unstable();
        touched.dedup();
        Ok(self.assign(&touched, rules, now_micros, Some(stream)))
    }

    /// A stream closed: its buckets are re-split between the others.
    pub fn close(&mut self, stream: StreamId, rules: &RuleSet, now_micros: u64) -> Outbox {
        let Some(s) = self.streams.remove(&stream) else {
            return Vec::new();
        };
        let keys: Vec<BucketKey> = s.buckets.into_keys().collect();
        for key in &keys {
            leave(
                &mut self.buckets,
                &mut self.steps,
                self.shared,
                stream,
                key,
                now_micros,
            );
        }
        self.assign(&keys, rules, now_micros, None)
    }

    /// Periodic work: streams that stopped reporting a bucket leave it,
    /// every bucket is re-planned (old assignments expire, reloads apply),
    /// and buckets nobody holds are forgotten.
    pub fn tick(&mut self, rules: &RuleSet, now_micros: u64) -> Outbox {
        self.prune(now_micros);
        let mut out = self.abandon_idle(now_micros);
        let keys: Vec<BucketKey> = self.buckets.keys().cloned().collect();
        out.extend(self.assign(&keys, rules, now_micros, None));
        if self.shared {
            let subscribed: std::collections::HashSet<&BucketKey> = self
                .streams
                .values()
                .flat_map(|s| s.buckets.keys())
                .collect();
            self.buckets.retain(|k, _| subscribed.contains(k));
        } else {
            self.buckets.retain(|_, b| {
                b.allocation.members() > 0 || b.allocation.reserved(now_micros).rate > 0.0
            });
        }
        out
    }

    /// Buckets a stream has reported without requests for [`ABANDON_AFTER_MICROS`]:
    /// Envoy is told to drop them (`abandon_action`; it subscribes again
    /// with its next request there) and the stream leaves their split.
    fn abandon_idle(&mut self, now_micros: u64) -> Outbox {
        let mut out = Vec::new();
        for (id, s) in &mut self.streams {
            let mut actions = Vec::new();
            s.buckets.retain(|key, sub| {
                let idle = sub
                    .idle_since_micros
                    .is_some_and(|t| now_micros.saturating_sub(t) >= ABANDON_AFTER_MICROS);
                if idle {
                    leave(
                        &mut self.buckets,
                        &mut self.steps,
                        self.shared,
                        *id,
                        key,
                        now_micros,
                    );
                    actions.push(BucketAction {
                        bucket_id: Some(key.id()),
                        bucket_action: Some(bucket_action::BucketAction::AbandonAction(
                            bucket_action::AbandonAction {},
                        )),
                    });
                }
                !idle
            });
            if !actions.is_empty() {
                out.push((
                    *id,
                    RateLimitQuotaResponse {
                        bucket_action: actions,
                    },
                ));
            }
        }
        out.sort_unstable_by_key(|(s, _)| *s);
        out
    }

    /// For each (domain, rule) with a split bucket: the largest fraction of
    /// one of its buckets' budget that live assignments may enforce now
    /// (never above 1: the allocation's bound).
    pub fn assigned_fractions(&self, now_micros: u64) -> Vec<(String, String, f64)> {
        let mut by_rule: HashMap<(String, String), f64> = HashMap::new();
        for (key, b) in &self.buckets {
            let (Policy::Shared(_), Some(rule)) = (b.policy, &b.rule) else {
                continue;
            };
            // of this instance's part of the budget, or with a shared
            // ledger, of the whole as the last step saw it
            let (budget, reserved) = match b.policy {
                Policy::Shared(budget) if self.shared => (budget, b.shared_reserved),
                _ => (b.allocation.budget(), b.allocation.reserved(now_micros)),
            };
            let fraction = (reserved.rate / budget.rate).max(reserved.burst / budget.burst);
            let entry = by_rule
                .entry((key.domain.clone(), rule.clone()))
                .or_insert(0.0);
            *entry = entry.max(fraction);
        }
        let mut out: Vec<_> = by_rule.into_iter().map(|((d, r), f)| (d, r, f)).collect();
        out.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        out
    }

    /// Streams quiet about a bucket for longer than [`quiet_limit_micros`] leave it.
    fn prune(&mut self, now_micros: u64) {
        for (id, s) in &mut self.streams {
            s.buckets.retain(|key, sub| {
                let quiet = now_micros.saturating_sub(sub.last_report_micros);
                let keep = quiet <= quiet_limit_micros(sub.interval_micros);
                if !keep {
                    leave(
                        &mut self.buckets,
                        &mut self.steps,
                        self.shared,
                        *id,
                        key,
                        now_micros,
                    );
                }
                keep
            });
        }
    }

    /// Plans `keys` and collects what each member stream must be sent: a
    /// changed share at once, an unchanged one when a third of its time to
    /// live has passed (which only extends it).
    ///
    /// With a shared ledger, Shared buckets queue steps instead: for the
    /// `reporter`'s pairs at once, for every other pair every
    /// [`SHARED_REFRESH_MICROS`] (so that shifts of demand on other replicas
    /// reach it, and the ledger sees it is alive).
    fn assign(
        &mut self,
        keys: &[BucketKey],
        rules: &RuleSet,
        now_micros: u64,
        reporter: Option<StreamId>,
    ) -> Outbox {
        let mut per_stream: HashMap<StreamId, Vec<BucketAction>> = HashMap::new();
        for key in keys {
            let Some(bucket) = self.buckets.get_mut(key) else {
                continue;
            };
            if bucket.generation != rules.generation() {
                bucket.policy = Policy::of(rules, &key.domain, &key.pairs);
                bucket.rule = rule_label(rules, &key.domain, &key.pairs);
                bucket.generation = rules.generation();
            }
            // the bucket's time to live: the slowest reporter's
            let interval = self
                .streams
                .values()
                .filter_map(|s| s.buckets.get(key))
                .map(|sub| sub.interval_micros)
                .max()
                .unwrap_or(0);
            let ttl = ttl_micros(interval);
            let planned: Vec<(StreamId, Sent)> = match bucket.policy {
                Policy::Shared(budget) if self.shared => {
                    for (id, s) in self.streams.iter_mut() {
                        let Some(sub) = s.buckets.get_mut(key) else {
                            continue;
                        };
                        let due = Some(*id) == reporter
                            || now_micros.saturating_sub(sub.stepped_micros)
                                >= SHARED_REFRESH_MICROS;
                        if !due {
                            continue;
                        }
                        sub.stepped_micros = now_micros;
                        self.steps.insert(
                            (*id, key.clone()),
                            Step {
                                stream: *id,
                                key: key.clone(),
                                demand: Some(sub.demand.unwrap_or(0.0)),
                                budget,
                                ttl_micros: ttl,
                            },
                        );
                    }
                    Vec::new()
                }
                Policy::Shared(budget) => {
                    let share = 1.0 / f64::from(self.instances.max(1));
                    bucket.allocation.set_budget(Budget {
                        burst: budget.burst * share,
                        rate: budget.rate * share,
                    });
                    bucket
                        .allocation
                        .plan(now_micros, ttl + LIVE_MARGIN_MICROS)
                        .into_iter()
                        .map(|(s, share)| (s, Sent::Share(share)))
                        .collect()
                }
                Policy::AllowAll | Policy::DenyAll => {
                    let rule = if bucket.policy == Policy::DenyAll {
                        BlanketRule::DenyAll
                    } else {
                        BlanketRule::AllowAll
                    };
                    self.streams
                        .iter()
                        .filter(|(_, s)| s.buckets.contains_key(key))
                        .map(|(id, _)| (*id, Sent::Blanket(rule)))
                        .collect()
                }
            };
            for (stream, what) in planned {
                if let Some(a) = self.offer(stream, key, what, ttl, now_micros) {
                    per_stream.entry(stream).or_default().push(a);
                }
            }
        }
        outbox(per_stream)
    }

    /// The shared ledger's answers to [`Quotas::take_steps`]: what each
    /// stream must be sent (as [`Quotas::assign`] decides for a local
    /// split). A step whose stream or bucket has gone since is dropped.
    pub fn granted(&mut self, answers: Vec<(Step, Shared)>, now_micros: u64) -> Outbox {
        let mut per_stream: HashMap<StreamId, Vec<BucketAction>> = HashMap::new();
        for (step, shared) in answers {
            let Some(bucket) = self.buckets.get_mut(&step.key) else {
                continue;
            };
            bucket.shared_reserved = shared.reserved;
            if step.demand.is_none() {
                continue;
            }
            let what = Sent::Share(shared.share);
            if let Some(a) = self.offer(step.stream, &step.key, what, step.ttl_micros, now_micros) {
                per_stream.entry(step.stream).or_default().push(a);
            }
        }
        outbox(per_stream)
    }

    /// The action to send `stream` for `key` if `what` moved from what it
    /// was last sent, or a third of the sent one's time to live has passed
    /// (re-sending the same only extends it); records it as sent.
    fn offer(
        &mut self,
        stream: StreamId,
        key: &BucketKey,
        what: Sent,
        ttl: u64,
        now_micros: u64,
    ) -> Option<BucketAction> {
        let sub = self.streams.get_mut(&stream)?.buckets.get_mut(key)?;
        // the refresh is due by the life of what Envoy holds: when the
        // cadence was just learnt, the new time to live is longer
        let due = match sub.sent {
            None => true,
            Some((before, at, sent_ttl)) => {
                moved(before, what)
                    || now_micros.saturating_sub(at) >= ttl.min(sent_ttl) / TTL_INTERVALS
            }
        };
        due.then(|| {
            sub.sent = Some((what, now_micros, ttl));
            action(key, what, ttl)
        })
    }
}

/// `stream` leaves `key`'s split: locally, or with a shared ledger by a
/// leaving step (its assignments stay reserved until they expire).
fn leave(
    buckets: &mut HashMap<BucketKey, Bucket>,
    steps: &mut HashMap<(StreamId, BucketKey), Step>,
    shared: bool,
    stream: StreamId,
    key: &BucketKey,
    now_micros: u64,
) {
    let Some(b) = buckets.get_mut(key) else {
        return;
    };
    match b.policy {
        Policy::Shared(budget) if shared => {
            steps.insert(
                (stream, key.clone()),
                Step {
                    stream,
                    key: key.clone(),
                    demand: None,
                    budget,
                    ttl_micros: 0,
                },
            );
        }
        _ => b.allocation.leave(&stream, now_micros),
    }
}

/// How long a stream may be quiet about a bucket before it leaves it:
/// three report intervals, and never less than [`MIN_QUIET_MICROS`] (Envoy
/// 1.40 reports about every five seconds, whatever `reporting_interval` says).
fn quiet_limit_micros(interval_micros: u64) -> u64 {
    interval_micros
        .saturating_mul(TTL_INTERVALS)
        .max(MIN_QUIET_MICROS)
}

/// An assignment's time to live for a bucket reported every `interval`, in
/// whole seconds (Envoy 1.40 drops the fraction of a second, so what is
/// counted live is what Envoy holds).
fn ttl_micros(interval_micros: u64) -> u64 {
    interval_micros
        .saturating_mul(TTL_INTERVALS)
        .clamp(MIN_TTL_MICROS, MAX_TTL_MICROS)
        .div_ceil(1_000_000)
        .saturating_mul(1_000_000)
}

#[cfg(test)]
mod tests;
