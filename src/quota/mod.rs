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
//! split between the Envoys reporting it, except where its rule's path has a
//! `share_threshold` pattern: as `ShouldRateLimit` spends one bucket for
//! every value the pattern matches, every bucket id reaching that rule with
//! such a value spends one budget, split between the (Envoy, bucket id)
//! pairs reporting them (a shared bucket, keyed by the pattern: see
//! [`BucketKey::shared`]).
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `limiter`; uses `store` (the ledger's Redis), `rules`, `telemetry`
//! and leaves.

pub mod allocation;
pub mod assignment;
mod due;
mod hub;
mod key;
pub mod ledger;
pub mod policy;
pub mod redis_ledger;
pub mod region;
mod reload;
mod shares;
mod steps;
mod subscription;
pub mod upstream;

use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::BlanketRule;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
#[cfg(test)]
use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse;

use self::allocation::{Allocation, Budget};
use self::assignment::{action, moved, Sent};
pub use self::assignment::{outbox, token_bucket};
use self::due::{next_due, queue, Due, NEVER};
use self::hub::RegionStreams;
pub use self::key::BucketKey;
use self::key::{hash_of, valid_id};
use self::ledger::Shared;
pub use self::policy::{describe_domain, expired_behavior, rule_notes, Policy};
use self::policy::{rule_label, shared_key};
use self::shares::{index, unindex};
pub use self::steps::Step;
use self::steps::{step_if_due, whole_seconds};
use self::subscription::{quiet_limit_micros, ttl_micros, Subscription};
use crate::instances::Instances;
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
/// (stream, bucket id) pairs one `share_threshold` bucket is split between
/// at most; reports of more are not taken (each pair is one member of its
/// split, looked up in a vector: this bounds what one report costs).
pub const MAX_PAIRS_PER_SHARED_BUCKET: usize = 4096;
/// A bucket planned this recently is not planned again for a report of an
/// Envoy it has already answered: the plan waits until this long after the
/// last one and serves every report in between (a bucket many Envoys
/// report is planned at most once a second, not once per report).
pub const COALESCE_MICROS: u64 = 1_000_000;
/// Bytes of bucket ids (their keys and values, and the domain) one
/// instance holds at most, all buckets together: with the bounds on one id
/// below, state is bounded in bytes, not only in counts.
pub const MAX_KEY_BYTES: usize = 256 * 1024 * 1024;
/// Entries of one bucket id, and bytes of one of its keys or values, at
/// most (as for a descriptor); a bucket id over them is counted `invalid`.
pub const MAX_ID_ENTRIES: usize = crate::rules::MAX_ENTRIES;
pub const MAX_ID_KEY_OR_VALUE_BYTES: usize = crate::rules::MAX_KEY_OR_VALUE_BYTES;
/// With a shared ledger, a pair whose stream does not report is stepped
/// at every tick (once a second; this is a little less, so that a tick
/// coming early never skips it): well below [`ledger::STALE_MS`], so a live
/// replica never looks dead, and a third of the shortest time to live, so
/// refreshes are due in time.
pub const SHARED_REFRESH_MICROS: u64 = 900_000;
/// A region's instance that has not reported a bucket for this long no
/// longer counts in the region's demand for it (five report intervals).
pub const PART_QUIET_MICROS: u64 = 5_000_000;

/// A member of a bucket's split: a stream, and which of its bucket ids
/// (0 for a bucket id's own bucket: one per stream; else a number the
/// stream gave the id in a shared bucket).
pub type Pair = (StreamId, u64);

#[derive(Debug)]
struct Bucket {
    policy: Policy,
    /// The label of the rule reached (metrics), if any; one allocation per
    /// rule, shared by its buckets.
    rule: Option<Arc<str>>,
    generation: u64,
    allocation: Allocation<Pair>,
    /// With a shared ledger: Σ reserved by all replicas, as the last step
    /// saw it.
    shared_reserved: Budget,
    /// With a shared ledger: this replica's share of the bucket, as the
    /// last step answered, and until when the ledger surely keeps it
    /// reserved (what is assigned from it must expire by then).
    ledger_share: Option<(Budget, u64)>,
    /// With a shared ledger: when a step was last queued, and whether this
    /// replica takes part in the record (a leaving step is queued once,
    /// when its last Envoy goes).
    stepped_micros: u64,
    in_ledger: bool,
    /// With a shared ledger: the replicas splitting it at the last answer
    /// (0: none yet), what the safe share divides the budget by.
    ledger_replicas: u32,
    /// With a shared ledger: since when its steps have failed (`None`: the
    /// last one was answered). Counted in [`Quotas::without_ledger`].
    ledger_failing: Option<u64>,
    /// With a shared ledger: the largest safe share assigned while its
    /// steps failed, and until when what was assigned from it may be
    /// enforced; told to the ledger with each step until then.
    unconfirmed: Option<(Budget, u64)>,
    /// The streams reporting it (few per bucket: a vector, not a map).
    subs: Vec<Subscription>,
    /// When it must next be looked at without a report: a member falls
    /// quiet or idle, a refresh or ledger step is due, or an assignment
    /// expires (which frees budget for the others).
    due_micros: u64,
    /// The earliest time it is queued for in [`Quotas::due`].
    queued_micros: u64,
    /// Its entry in [`Quotas::shares`] (the bits of a fraction).
    fraction: Option<u64>,
    /// When it was last planned (reports within [`COALESCE_MICROS`] of
    /// that wait for one plan together).
    planned_micros: u64,
    /// Regions report it: it is split here, between the regions, also on a
    /// global tier whose Envoys' buckets a shared ledger splits (the
    /// regions all report to one global-tier instance).
    regional: bool,
    /// Counted in [`Quotas::held`].
    held: bool,
}

impl Bucket {
    /// Whether the shared ledger splits it (else this instance does).
    fn ledger_splits(&self, shared: bool) -> bool {
        shared && !self.regional
    }
}

#[derive(Debug, Default)]
struct Stream {
    domain: Option<String>,
    /// The bucket ids it reports, each with the shared bucket it spends
    /// (`None`: its own).
    buckets: HashMap<Arc<BucketKey>, Option<Arc<BucketKey>>>,
    /// The last [`Pair`] tag given to one of its ids in a shared bucket.
    last_tag: u64,
}

/// Actions per stream not yet made into messages.
pub type Pending = HashMap<StreamId, Vec<BucketAction>>;

/// Every stream and bucket.
///
/// **Cost.** Each bucket holds its own subscribers and its next due time
/// in a queue: a report costs the buckets in it (and their members), a
/// tick the buckets that are due, never buckets × streams.
#[derive(Debug, Default)]
pub struct Quotas {
    streams: HashMap<StreamId, Stream>,
    /// Boxed: the map's slots stay small (it is at half its capacity right
    /// after growing), each bucket allocated at its own size.
    buckets: HashMap<Arc<BucketKey>, Box<Bucket>>,
    /// (stream, bucket) pairs held, all streams together.
    pairs: usize,
    /// Bytes of the bucket ids held (see [`MAX_KEY_BYTES`]).
    key_bytes: usize,
    /// Buckets by when they are due (see [`Due`]).
    due: BinaryHeap<Due>,
    /// The rules generation every bucket was planned with; a reload makes
    /// them all due once.
    generation: u64,
    /// Rule labels, one allocation each.
    labels: HashSet<Arc<str>>,
    /// Per (domain, rule): how many of its buckets have each assigned
    /// fraction (bits of an `f64` ≥ 0, which order like the numbers), so
    /// the largest is at hand without a pass over the buckets.
    shares: HashMap<(String, Arc<str>), BTreeMap<u64, u32>>,
    /// Instances serving RLQS (`--instances`): each splits 1/N of every
    /// budget among its own Envoys, so N of them never assign more than
    /// the budget together. Not used with a shared ledger.
    instances: Instances,
    /// Whether a shared ledger splits the budgets between replicas
    /// ([`ledger`]): then each Shared bucket queues a [`Step`] (when an
    /// Envoy joins it, and every [`SHARED_REFRESH_MICROS`]), and
    /// [`Quotas::granted`] takes the ledger's answer: this replica's share,
    /// which its own split divides between its Envoys.
    shared: bool,
    /// Queued ledger steps, one per bucket: a newer one replaces an older
    /// one not taken yet, so the queue never outgrows the buckets.
    steps: HashMap<BucketKey, Step>,
    /// Buckets whose split holds what departed Envoys were sent (its
    /// [`allocation::Envelope`]) while no Envoy reports them: each counts
    /// as a pair against [`MAX_SUBSCRIPTIONS`].
    held: usize,
    /// Bucket reports not taken since the last [`Quotas::take_dropped`]:
    /// (invalid, over a limit).
    dropped: (u64, u64),
    /// Subscriptions looked at since the last [`Quotas::take_visited`].
    visited: u64,
    /// Buckets whose ledger steps fail (see [`Quotas::refused`]).
    without_ledger: usize,
    /// The regions reporting here, at the global tier (see [`hub`]).
    regions: RegionStreams,
    /// This replica is shutting down ([`Quotas::farewell`]).
    leaving: bool,
}

/// Messages to write, per stream.
pub type Outbox = Vec<(StreamId, RateLimitQuotaResponse)>;

impl Quotas {
    /// State for one of `instances` instances (see [`Quotas::instances`]).
    pub fn for_instances(instances: impl Into<Instances>) -> Self {
        Self {
            instances: instances.into(),
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

    /// With a shared ledger, the replicas a bucket's safe share assumes
    /// before any answer has said how many there are (`--instances`).
    pub fn with_instances(mut self, instances: impl Into<Instances>) -> Self {
        self.instances = instances.into();
        self
    }

    /// Buckets this replica assigns without the shared ledger now (their
    /// steps fail; see [`Quotas::refused`]).
    pub fn without_ledger(&self) -> usize {
        self.without_ledger
    }

    /// `stream` is a region's, one of `regions`: its buckets are split as
    /// [`Quotas::regions`] says.
    pub fn add_region_stream(&mut self, stream: StreamId, regions: u32) {
        self.regions.add(stream, regions);
    }

    /// Bucket reports not taken since the last call: (without a valid
    /// bucket id, over [`MAX_BUCKETS_PER_STREAM`] or [`MAX_SUBSCRIPTIONS`]).
    pub fn take_dropped(&mut self) -> (u64, u64) {
        std::mem::take(&mut self.dropped)
    }

    /// (stream, bucket) subscriptions looked at since the last call: the
    /// work done, for tests and benchmarks of what a report or tick costs.
    pub fn take_visited(&mut self) -> u64 {
        std::mem::take(&mut self.visited)
    }

    /// Streams open now.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// Buckets with at least one reporting stream or a live assignment.
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// (stream, bucket) pairs held, all streams together.
    pub fn pairs(&self) -> usize {
        self.pairs
    }

    /// Buckets that only hold what departed Envoys were sent (counted as
    /// pairs against [`MAX_SUBSCRIPTIONS`]).
    pub fn held(&self) -> usize {
        self.held
    }

    /// One message of usage reports from `stream`. The first message names
    /// the domain; later ones are in it whatever they say. Costs the
    /// buckets in it and their members, nothing else.
    pub fn report(
        &mut self,
        stream: StreamId,
        domain: &str,
        usages: &[BucketQuotaUsage],
        rules: &RuleSet,
        now_micros: u64,
    ) -> Result<Outbox, String> {
        self.report_part(stream, stream, domain, usages, rules, now_micros)
    }

    /// [`Quotas::report`] from `part`, one of the instances that report as
    /// the region `stream` (see [`Quotas::add_region_stream`]; `part ==
    /// stream` for an Envoy): the region's demand for each bucket is the
    /// sum of its instances'.
    pub fn report_part(
        &mut self,
        stream: StreamId,
        part: StreamId,
        domain: &str,
        usages: &[BucketQuotaUsage],
        rules: &RuleSet,
        now_micros: u64,
    ) -> Result<Outbox, String> {
        if self.buckets.is_empty() {
            // nothing planned with older rules
            self.generation = rules.generation();
        }
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
        // the buckets reported, each with whether one of its pairs is new
        let mut touched: Vec<(Arc<BucketKey>, bool)> = Vec::with_capacity(usages.len());
        for usage in usages {
            // a report Envoy should not send is passed over, not the stream
            // ended: its other buckets stay served
            let Some(id) = usage.bucket_id.as_ref().filter(|id| valid_id(id)) else {
                self.dropped.0 += 1;
                continue;
            };
            let id = BucketKey::new(&domain, id);
            let entry = self.streams.entry(stream).or_default();
            let (id, key) = match entry.buckets.get_key_value(&id) {
                Some((id, shared)) => (id.clone(), shared.clone().unwrap_or_else(|| id.clone())),
                None if entry.buckets.len() >= MAX_BUCKETS_PER_STREAM
                    || self.pairs + self.held >= MAX_SUBSCRIPTIONS =>
                {
                    self.dropped.1 += 1;
                    continue;
                }
                None => {
                    let Some((id, key)) = self.admit(rules, id) else {
                        self.dropped.1 += 1;
                        continue;
                    };
                    let bucket = self.buckets.entry(key.clone()).or_insert_with(|| {
                        Box::new(new_bucket(
                            rules,
                            id.as_deref().unwrap_or(&key),
                            &mut self.labels,
                        ))
                    });
                    let entry = self.streams.entry(stream).or_default();
                    let tag = if id.is_some() {
                        entry.last_tag += 1;
                        entry.last_tag
                    } else {
                        0
                    };
                    let sub = Subscription::new(stream, tag, id.clone());
                    if self.regions.contains(stream) {
                        bucket.regional = true;
                    }
                    if let (true, Policy::Shared(budget)) =
                        (self.regions.contains(stream), bucket.policy)
                    {
                        // a region joining may already spend its floor:
                        // live for it until its first assignment surely is
                        let floor = self.regions.floor(budget);
                        let until = now_micros
                            .saturating_add(ttl_micros(0))
                            .saturating_add(LIVE_MARGIN_MICROS);
                        bucket.allocation.seed(&sub.pair(), floor, until);
                    }
                    allocation::push_compact(&mut bucket.subs, sub);
                    self.pairs += 1;
                    let id = id.unwrap_or_else(|| key.clone());
                    let shared = (!Arc::ptr_eq(&id, &key)).then(|| key.clone());
                    entry.buckets.insert(id.clone(), shared);
                    (id, key)
                }
            };
            let Some(bucket) = self.buckets.get_mut(&key) else {
                continue;
            };
            self.visited += 1;
            let Some(sub) = bucket.subs.iter_mut().find(|s| s.is(stream, &id)) else {
                continue;
            };
            let fresh = sub.sent.is_none();
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
            if part != stream {
                let pair = sub.pair();
                let demand =
                    self.regions
                        .demand(pair, &key, part, requests, elapsed_secs, now_micros);
                bucket.allocation.set_demand(&pair, demand);
            } else {
                let pair = sub.pair();
                bucket.allocation.report(&pair, requests, elapsed_secs);
            }
            touched.push((key, fresh));
        }
        // each bucket once, new if one of its pairs is
        touched.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        touched.dedup_by(|a, b| a.0 == b.0);
        let mut pending = Pending::new();
        for (key, fresh) in &touched {
            let Some(bucket) = self.buckets.get_mut(key) else {
                continue;
            };
            let next = bucket.planned_micros.saturating_add(COALESCE_MICROS);
            if !fresh && bucket.planned_micros > 0 && now_micros < next {
                // planned a moment ago: once more when the moment is over
                bucket.due_micros = bucket.due_micros.min(next);
                queue(&mut self.due, key, bucket);
                continue;
            }
            self.plan(key, rules, now_micros, Some(stream), &mut pending);
        }
        Ok(outbox(pending))
    }

    /// A bucket id a stream reports for the first time: the bucket it
    /// spends (its own, or the shared one of its rule's `share_threshold`
    /// pattern) and, for a shared one, the id to keep with the stream's
    /// subscription; their bytes counted. `None` when that would go over
    /// [`MAX_KEY_BYTES`] or [`MAX_PAIRS_PER_SHARED_BUCKET`].
    fn admit(
        &mut self,
        rules: &RuleSet,
        id: BucketKey,
    ) -> Option<(Option<Arc<BucketKey>>, Arc<BucketKey>)> {
        let Some(shared) = shared_key(rules, &id) else {
            let key = match self.buckets.get_key_value(&id) {
                Some((key, _)) => key.clone(),
                None if self.key_bytes + id.bytes() > MAX_KEY_BYTES => return None,
                None => {
                    self.key_bytes += id.bytes();
                    Arc::new(id)
                }
            };
            return Some((None, key));
        };
        let (key, key_bytes) = match self.buckets.get_key_value(&shared) {
            Some((_, b)) if b.subs.len() >= MAX_PAIRS_PER_SHARED_BUCKET => return None,
            Some((key, _)) => (key.clone(), 0),
            None => {
                let bytes = shared.bytes();
                (Arc::new(shared), bytes)
            }
        };
        let bytes = key_bytes + id.bytes();
        if self.key_bytes + bytes > MAX_KEY_BYTES {
            return None;
        }
        self.key_bytes += bytes;
        Some((Some(Arc::new(id)), key))
    }

    /// Takes `stream`'s subscription to bucket id `id` out of the bucket
    /// `key` (see [`Quotas::unsubscribe_at`]).
    fn unsubscribe(
        &mut self,
        key: &Arc<BucketKey>,
        stream: StreamId,
        id: &Arc<BucketKey>,
        now_micros: u64,
    ) {
        let at = self
            .buckets
            .get(key)
            .and_then(|b| b.subs.iter().position(|s| s.is(stream, id)));
        if let Some(at) = at {
            self.unsubscribe_at(key, at, now_micros);
        }
    }

    /// Takes the subscription at `at` out of the bucket `key`: its pair,
    /// its bytes and its stream's entry are uncounted, and the split
    /// forgets it (what it was sent stays reserved until it expires).
    fn unsubscribe_at(
        &mut self,
        key: &Arc<BucketKey>,
        at: usize,
        now_micros: u64,
    ) -> Option<Subscription> {
        let bucket = self.buckets.get_mut(key)?;
        if at >= bucket.subs.len() {
            return None;
        }
        let sub = bucket.subs.swap_remove(at);
        self.pairs -= 1;
        if let Some(own) = &sub.id {
            self.key_bytes -= own.bytes();
        }
        if let Some(s) = self.streams.get_mut(&sub.stream) {
            s.buckets.remove(sub.id(key));
        }
        bucket.allocation.leave(&sub.pair(), now_micros);
        Some(sub)
    }

    /// A stream closed: its buckets are re-split between the others.
    pub fn close(&mut self, stream: StreamId, rules: &RuleSet, now_micros: u64) -> Outbox {
        self.regions.close(stream);
        let Some(s) = self.streams.remove(&stream) else {
            return Vec::new();
        };
        let mut keys = Vec::with_capacity(s.buckets.len());
        for (id, shared) in s.buckets {
            let key = shared.unwrap_or_else(|| id.clone());
            self.visited += 1;
            self.unsubscribe(&key, stream, &id, now_micros);
            keys.push(key);
        }
        keys.sort_unstable();
        keys.dedup();
        let mut pending = Pending::new();
        for key in &keys {
            self.plan(key, rules, now_micros, None, &mut pending);
        }
        outbox(pending)
    }

    /// Periodic work: every bucket that is due (a member fell quiet or
    /// idle, a refresh or an expiry came, the rules were reloaded) is
    /// looked at again; buckets nobody holds are forgotten.
    pub fn tick(&mut self, rules: &RuleSet, now_micros: u64) -> Outbox {
        let mut pending = Pending::new();
        while self.tick_some(rules, now_micros, usize::MAX, &mut pending) {}
        outbox(pending)
    }

    /// Like [`Quotas::tick`], for at most `max_buckets` of the due buckets,
    /// adding what to send to `pending`; true if more are due (so that a
    /// caller can let others at the state in between).
    pub fn tick_some(
        &mut self,
        rules: &RuleSet,
        now_micros: u64,
        max_buckets: usize,
        pending: &mut Pending,
    ) -> bool {
        if self.generation != rules.generation() {
            // a reload: every bucket is looked at once, with the new rules
            self.generation = rules.generation();
            for (key, b) in &mut self.buckets {
                b.due_micros = now_micros;
                queue(&mut self.due, key, b);
            }
        }
        let mut done = 0;
        while done < max_buckets && self.due.peek().is_some_and(|d| d.at <= now_micros) {
            let Some(Due { at, key }) = self.due.pop() else {
                break;
            };
            let Some(b) = self.buckets.get_mut(&key) else {
                continue;
            };
            if b.queued_micros != at {
                continue;
            }
            b.queued_micros = NEVER;
            if b.due_micros > now_micros {
                queue(&mut self.due, &key, b);
                continue;
            }
            self.plan(&key, rules, now_micros, None, pending);
            done += 1;
        }
        self.due.peek().is_some_and(|d| d.at <= now_micros)
    }

    /// Looks at one bucket: quiet members leave it, idle ones are told to
    /// abandon it, it is planned, and what each member must be sent is
    /// added to `pending`: a changed share at once, an unchanged one when a
    /// third of its time to live has passed (which only extends it). Then
    /// it is queued for when it is next due, or forgotten when nobody holds
    /// it and nothing it assigned lives.
    ///
    /// With a shared ledger, Shared buckets queue steps instead: for the
    /// `reporter`'s pairs at once, for every other pair every
    /// [`SHARED_REFRESH_MICROS`] (so that shifts of demand on other replicas
    /// reach it, and the ledger sees it is alive).
    fn plan(
        &mut self,
        key: &Arc<BucketKey>,
        rules: &RuleSet,
        now_micros: u64,
        reporter: Option<StreamId>,
        pending: &mut Pending,
    ) {
        if self
            .buckets
            .get(key)
            .is_some_and(|b| b.generation != rules.generation())
        {
            self.reload(key, rules, now_micros);
        }
        let Some(bucket) = self.buckets.get(key) else {
            return;
        };
        self.visited += bucket.subs.len() as u64;
        // members quiet for too long leave; idle ones are told to abandon it
        let leaving: Vec<(usize, bool)> = bucket
            .subs
            .iter()
            .enumerate()
            .filter_map(|(at, sub)| {
                let quiet = now_micros.saturating_sub(sub.last_report_micros)
                    > quiet_limit_micros(sub.interval_micros);
                // (abandoned by a tick, not by the report that found it idle)
                let idle = reporter.is_none()
                    && sub
                        .idle_since_micros
                        .is_some_and(|t| now_micros.saturating_sub(t) >= ABANDON_AFTER_MICROS);
                (quiet || idle).then_some((at, idle))
            })
            .collect();
        // from the last: a removal moves the last member into its place
        for (at, idle) in leaving.into_iter().rev() {
            let Some(sub) = self.unsubscribe_at(key, at, now_micros) else {
                continue;
            };
            if idle {
                pending.entry(sub.stream).or_default().push(BucketAction {
                    bucket_id: Some(sub.id(key).id()),
                    bucket_action: Some(bucket_action::BucketAction::AbandonAction(
                        bucket_action::AbandonAction {},
                    )),
                });
            }
        }
        // a tick moves on past now; after a report, a tick at the same
        // time does what the report left (an idle member's abandon)
        let after = if reporter.is_some() {
            now_micros
        } else {
            now_micros + 1
        };
        if let Some(bucket) = self.buckets.get_mut(key) {
            if let (Policy::Shared(budget), true) =
                (bucket.policy, bucket.ledger_splits(self.shared))
            {
                let by_tick = reporter.is_none();
                if step_if_due(bucket, &mut self.steps, key, budget, by_tick, now_micros) {
                    // the answer splits the new share ([`Quotas::granted`])
                    bucket.due_micros = next_due(bucket, true, after);
                    queue(&mut self.due, key, bucket);
                    return;
                }
            }
        }
        self.assign(key, now_micros, after, pending);
    }

    /// Splits `key`'s budget between its members and adds what each must be
    /// sent to `pending` (see [`Quotas::plan`]); then queues the bucket for
    /// when it is next due (`after` at the earliest), or forgets it when
    /// nobody holds it and nothing it assigned lives. With a shared ledger,
    /// the budget split is this replica's last share, and what is assigned
    /// from it expires before the ledger stops reserving it.
    fn assign(&mut self, key: &Arc<BucketKey>, now_micros: u64, after: u64, pending: &mut Pending) {
        let Some(bucket) = self.buckets.get_mut(key) else {
            return;
        };
        let shared = bucket.ledger_splits(self.shared);
        // what each member is sent lives by its own cadence; with a shared
        // ledger, never beyond what the ledger keeps reserved
        let cover = match bucket.ledger_share {
            Some((_, until)) if shared => whole_seconds(
                until
                    .saturating_sub(now_micros)
                    .saturating_sub(LIVE_MARGIN_MICROS),
            ),
            _ => NEVER,
        };
        // while steps fail, the refresh a second later must come while
        // what is sent now still lives: a share with less than 2 s left is
        // no longer sent (it would expire as the next one arrives)
        let needed = if bucket.ledger_failing.is_some() {
            2_000_000
        } else {
            1_000_000
        };
        let confirmed = bucket
            .ledger_share
            .filter(|_| shared && cover >= needed)
            .map(|(share, _)| share);
        // the ledger cannot answer and the last confirmed share has no
        // time left: the safe share, living by the members' own cadence
        let safe = shared && confirmed.is_none() && bucket.ledger_failing.is_some();
        let ttl_of = |sub: &Subscription| {
            if safe {
                sub.ttl_micros()
            } else {
                sub.ttl_micros().min(cover)
            }
        };
        let planned: Vec<(Pair, Sent)> = match bucket.policy {
            Policy::Shared(budget) if shared => match confirmed {
                Some(share) => {
                    // the ledger holds the reserve for newcomers back from
                    // every replica's share: an Envoy joining here steps
                    // at once, and this replica's share grows into it
                    bucket.allocation.set_reserve(0.0);
                    bucket.allocation.set_budget(share);
                    split(&mut bucket.allocation, &bucket.subs, ttl_of, now_micros)
                }
                None if safe => {
                    let share = safe_share(budget, bucket.ledger_replicas, self.instances.get());
                    bucket.allocation.set_reserve(0.0);
                    bucket.allocation.set_budget(share);
                    let last = bucket.subs.iter().map(ttl_of).max().unwrap_or(0);
                    let until = now_micros
                        .saturating_add(last)
                        .saturating_add(LIVE_MARGIN_MICROS);
                    bucket.unconfirmed = Some(match bucket.unconfirmed {
                        Some((held, u)) if u > now_micros => (held.max(share), u.max(until)),
                        _ => (share, until),
                    });
                    split(&mut bucket.allocation, &bucket.subs, ttl_of, now_micros)
                }
                // nothing to split yet, or no time left to assign it in:
                // what the members hold stands until the next answer
                None => Vec::new(),
            },
            Policy::Shared(budget) => {
                let mut share = 1.0 / f64::from(self.instances.get());
                if let Some((part, reserve)) = self.regions.part_of(&bucket.subs) {
                    share *= part;
                    bucket.allocation.set_reserve(reserve);
                }
                bucket.allocation.set_budget(Budget {
                    burst: budget.burst * share,
                    rate: budget.rate * share,
                });
                split(&mut bucket.allocation, &bucket.subs, ttl_of, now_micros)
            }
            Policy::AllowAll | Policy::DenyAll => {
                let rule = if bucket.policy == Policy::DenyAll {
                    BlanketRule::DenyAll
                } else {
                    BlanketRule::AllowAll
                };
                bucket
                    .subs
                    .iter()
                    .map(|sub| (sub.pair(), Sent::Blanket(rule)))
                    .collect()
            }
        };
        // the members' places, so that offering to each is not a search
        let places: HashMap<Pair, usize> = if planned.len() > 8 {
            bucket
                .subs
                .iter()
                .enumerate()
                .map(|(i, sub)| (sub.pair(), i))
                .collect()
        } else {
            HashMap::new()
        };
        for (pair, what) in planned {
            let place = places
                .get(&pair)
                .copied()
                .or_else(|| bucket.subs.iter().position(|s| s.pair() == pair));
            let Some(sub) = place.and_then(|i| bucket.subs.get_mut(i)) else {
                continue;
            };
            let exact = self.regions.contains(pair.0);
            let ttl = ttl_of(sub);
            if let Some(a) = offer(sub, key, what, ttl, now_micros, exact, self.leaving) {
                pending.entry(pair.0).or_default().push(a);
            }
        }
        bucket.planned_micros = now_micros;
        let holds = bucket.subs.is_empty() && !bucket.allocation.departed().is_empty();
        if holds != bucket.held {
            bucket.held = holds;
            if holds {
                self.held += 1;
            } else {
                self.held -= 1;
            }
        }
        let forget = bucket.subs.is_empty()
            && !bucket.in_ledger
            && bucket.allocation.members() == 0
            && bucket.allocation.reserved(now_micros).rate <= 0.0
            && bucket.allocation.reserved(now_micros).burst <= 0.0;
        if forget {
            if bucket.held {
                self.held -= 1;
            }
            if bucket.ledger_failing.is_some() {
                self.without_ledger -= 1;
            }
            unindex(&mut self.shares, key, bucket);
            self.buckets.remove(key);
            self.key_bytes -= key.bytes();
            return;
        }
        index(&mut self.shares, key, bucket, shared, now_micros);
        bucket.due_micros = next_due(bucket, shared, after);
        queue(&mut self.due, key, bucket);
    }
}

/// What a replica assigns of `budget` while the shared ledger cannot
/// answer and its last confirmed share has expired: the budget divided by
/// the replicas the last answer counted (this one among them), or by
/// `--instances` before any answer, less the newcomer reserve the ledger
/// holds back too: with equal demand it is the share the ledger gave, so
/// the Envoys' token buckets do not change (Envoy 1.40 starts a changed
/// one full). Every replica cut off alike keeps Σ within the budget; see
/// docs/rlqs.md for one cut off alone.
pub fn safe_share(budget: Budget, replicas: u32, instances: u32) -> Budget {
    let n = f64::from(if replicas > 0 { replicas } else { instances }.max(1));
    budget.scaled((1.0 - allocation::NEWCOMER_RESERVE) / n)
}

/// A bucket seen for the first time, for bucket id `id` (its own, or the
/// first of a shared one's).
fn new_bucket(rules: &RuleSet, id: &BucketKey, labels: &mut HashSet<Arc<str>>) -> Bucket {
    Bucket {
        policy: Policy::of(rules, &id.domain, &id.pairs),
        rule: rule_label(rules, &id.domain, &id.pairs).map(|l| intern(labels, l)),
        generation: rules.generation(),
        allocation: Allocation::new(Budget::ZERO),
        shared_reserved: Budget::ZERO,
        ledger_share: None,
        stepped_micros: 0,
        in_ledger: false,
        ledger_replicas: 0,
        ledger_failing: None,
        unconfirmed: None,
        subs: Vec::new(),
        due_micros: NEVER,
        queued_micros: NEVER,
        fraction: None,
        planned_micros: 0,
        regional: false,
        held: false,
    }
}

fn intern(labels: &mut HashSet<Arc<str>>, label: String) -> Arc<str> {
    if let Some(l) = labels.get(label.as_str()) {
        return l.clone();
    }
    let l: Arc<str> = Arc::from(label);
    labels.insert(l.clone());
    l
}

/// The allocation's plan as shares to send, each member's assignment
/// living `ttl_of` its subscription (and the margin).
fn split(
    allocation: &mut Allocation<Pair>,
    subs: &[Subscription],
    ttl_of: impl Fn(&Subscription) -> u64,
    now_micros: u64,
) -> Vec<(Pair, Sent)> {
    let ttls: HashMap<Pair, u64> = subs.iter().map(|sub| (sub.pair(), ttl_of(sub))).collect();
    allocation
        .plan_each(now_micros, |pair| {
            ttls.get(pair).copied().unwrap_or(MIN_TTL_MICROS) + LIVE_MARGIN_MICROS
        })
        .into_iter()
        .map(|(s, share)| (s, Sent::Share(share)))
        .collect()
}

/// The action to send `stream` for `key` if `what` moved from what it
/// was last sent, or a third of the sent one's time to live has passed
/// (re-sending the same only extends it), or (`leaving`, see
/// [`Quotas::farewell`]) it would live longer than what was sent; records
/// it as sent. `exact`: the member is a region (our own client), which
/// refills continuously and takes a share's rate as precisely as whole
/// numbers can say it; an Envoy gets [`token_bucket`]'s rounding.
fn offer(
    sub: &mut Subscription,
    key: &BucketKey,
    what: Sent,
    ttl: u64,
    now_micros: u64,
    exact: bool,
    leaving: bool,
) -> Option<BucketAction> {
    // the refresh is due by the life of what Envoy holds: when the
    // cadence was just learnt, the new time to live is longer
    let due = match sub.sent {
        None => true,
        Some((before, at, sent_ttl)) => {
            moved(before, what)
                || now_micros.saturating_sub(at) >= ttl.min(sent_ttl) / TTL_INTERVALS
                || (leaving && ttl > sent_ttl.saturating_sub(now_micros.saturating_sub(at)))
        }
    };
    due.then(|| {
        sub.sent = Some((what, now_micros, ttl));
        tracing::debug!(stream = ?sub.stream, bucket = ?key, ?what, ttl_ms = ttl / 1000, "RLQS assignment sent");
        action(sub.id(key), what, ttl, exact)
    })
}

mod farewell;
pub use farewell::ENVOY_REPORT_MICROS;

#[cfg(test)]
mod tests;
