//! Prometheus metrics, with the names and labels of docs/architecture.md §7.
//!
//! Label values come from the rules (domain names, rule names or descriptor
//! paths), never from raw request values unless a rule asks for
//! `detailed_metric` or `value_to_metric`; a domain no rule file defines is
//! counted as `_unknown`, so clients cannot grow the label set.

use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::decision::{Decision, Verdict};
use crate::labels::RuleId;
use crate::rules::{DescriptorEntry, FailureMode, RuleSet};

mod attempt;
mod connections;
mod lease;
mod quota;
mod region;

use self::attempt::AttemptMetrics;
use self::connections::ConnectionMetrics;
pub use self::lease::LeaseCounts;
use self::lease::LeaseMetrics;
use self::quota::QuotaMetrics;
use self::region::RegionMetrics;

/// Every `kind` of `rls_store_errors_total` (the store's errors name
/// theirs from this list), present from the start.
pub const STORE_ERROR_KINDS: [&str; 8] = [
    "timeout",
    "connection",
    "script",
    "oom",
    "breaker_open",
    "overloaded",
    "upstream",
    "not_replicated",
];

/// Latency buckets in seconds: fine below a millisecond, where a healthy
/// decision lives, up to a second.
const LATENCY_BUCKETS: &[f64] = &[
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.000_75, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Label for decisions in a domain the rules do not define.
pub const UNKNOWN_DOMAIN: &str = "_unknown";
/// Rule label of a descriptor no rule matched.
pub const NO_RULE: &str = "_none";

/// The `result` labels of `rls_decisions_total`, in [`RuleCounters`]' order.
const RESULTS: [&str; 5] = ["ok", "over_limit", "shadow", "unlimited", "no_rule"];

/// What [`Metrics::store_health`] counts.
pub struct StoreHealth {
    /// Each Redis node's breaker: (node, open).
    pub breakers: Vec<(String, bool)>,
    /// The answers each failure mode gave: (mode, answers).
    pub answers: Vec<(String, u64)>,
}

/// One rule's `rls_decisions_total` series by result, resolved once, so a
/// decision costs one atomic add instead of a hashed, locked label lookup.
type RuleCounters = [IntCounter; RESULTS.len()];

pub struct Metrics {
    registry: Registry,
    decisions: IntCounterVec,
    /// Decisions of rules with `detailed_metric` or `value_to_metric`, by
    /// the request's values (beside `decisions`, which keeps the rule's
    /// own series).
    decisions_detailed: IntCounterVec,
    /// By [`RuleId`] index; grows as rules are first counted.
    rule_decisions: ArcSwap<Vec<Option<Arc<RuleCounters>>>>,
    duration: Histogram,
    store_calls: IntCounterVec,
    store_duration: HistogramVec,
    /// The series of the first store observed (a server has one store).
    store_call_series: OnceLock<(String, IntCounter, Histogram)>,
    store_errors: IntCounterVec,
    store_retries: IntCounterVec,
    primary_events: IntCounterVec,
    node_errors: IntCounterVec,
    breaker_open: IntGaugeVec,
    failure_policy: IntCounterVec,
    config_reloads: IntCounterVec,
    config_generation: IntGauge,
    instances: IntGauge,
    connections: ConnectionMetrics,
    buckets: IntGaugeVec,
    buckets_evicted: IntCounterVec,
    node_memory: IntGaugeVec,
    values_overflowed: IntCounterVec,
    bucket_resets: IntCounterVec,
    untrusted_refused: IntCounterVec,
    lease: LeaseMetrics,
    attempt: AttemptMetrics,
    quota: QuotaMetrics,
    region: RegionMetrics,
    /// envoyproxy/ratelimit's statistics, once turned on.
    ratelimit: OnceLock<super::ratelimit_stats::RatelimitStats>,
    global_shadow: OnceLock<IntCounter>,
    /// Who is being limited, once turned on (`--heavy-hitters`).
    hitters: OnceLock<super::hitters::HeavyHitters>,
    /// How values are shown in `detailed_metric` series (escaped, cut,
    /// pseudonymised): as on the page and in the log.
    shown: OnceLock<crate::shown::ShownValues>,
    /// `rls_refusals_top_share`, registered at the first scrape with
    /// heavy hitters kept.
    top_share: OnceLock<prometheus::GaugeVec>,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let decisions = IntCounterVec::new(
            Opts::new(
                "rls_decisions_total",
                "Descriptor decisions by domain, rule and result",
            ),
            &["domain", "rule", "result"],
        )
        .expect("valid metric");
        let decisions_detailed = IntCounterVec::new(
            Opts::new(
                "rls_decisions_detailed_total",
                "Descriptor decisions of rules with detailed_metric or value_to_metric, by the request's values",
            ),
            &["domain", "rule", "descriptor", "result"],
        )
        .expect("valid metric");
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "rls_decision_duration_seconds",
                "Time to answer a whole ShouldRateLimit call",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        let store_calls = IntCounterVec::new(
            Opts::new("rls_store_calls_total", "Calls to the bucket store"),
            &["store"],
        )
        .expect("valid metric");
        let store_duration = HistogramVec::new(
            HistogramOpts::new(
                "rls_store_call_duration_seconds",
                "Time of one store call (one descriptor)",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["store"],
        )
        .expect("valid metric");
        let store_errors = IntCounterVec::new(
            Opts::new("rls_store_errors_total", "Store calls that failed, by kind"),
            &["kind"],
        )
        .expect("valid metric");
        let store_retries = IntCounterVec::new(
            Opts::new(
                "rls_store_retries_total",
                "Store calls sent again because they did not run (tryagain: keys split by a slot migration)",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let primary_events = IntCounterVec::new(
            Opts::new(
                "rls_store_primary_events_total",
                "What the watch of a single Redis primary saw: sentinels_disagree, moved (decisions went to another primary), demoted (the server the connections are on says it is a replica)",
            ),
            &["event"],
        )
        .expect("valid metric");
        let node_errors = IntCounterVec::new(
            Opts::new(
                "rls_store_node_errors_total",
                "Store calls to one Redis node that timed out or lost their connection",
            ),
            &["node", "kind"],
        )
        .expect("valid metric");
        let breaker_open = IntGaugeVec::new(
            Opts::new(
                "rls_store_breaker_open",
                "1 while the circuit breaker of a Redis node is open",
            ),
            &["node"],
        )
        .expect("valid metric");
        let failure_policy = IntCounterVec::new(
            Opts::new(
                "rls_failure_policy_total",
                "Descriptors decided by a failure mode instead of the store",
            ),
            &["mode"],
        )
        .expect("valid metric");
        let config_reloads = IntCounterVec::new(
            Opts::new("rls_config_reloads_total", "Rule reloads by result"),
            &["result"],
        )
        .expect("valid metric");
        let instances = IntGauge::new(
            "rls_instances",
            "Instances sharing the store, as this one counts them: --instances when given, else those announcing themselves in the Redis store within 10 s (the last count kept while it does not answer), 1 on the memory store",
        )
        .expect("valid metric");
        instances.set(1);
        let config_generation =
            IntGauge::new("rls_config_generation", "Generation of the rules in force")
                .expect("valid metric");
        let buckets = IntGaugeVec::new(
            Opts::new(
                "rls_buckets",
                "Buckets held by the memory store (not yet full again)",
            ),
            &["store"],
        )
        .expect("valid metric");
        let buckets_evicted = IntCounterVec::new(
            Opts::new(
                "rls_buckets_evicted_total",
                "Buckets evicted before they were full, to keep the store within --max-buckets",
            ),
            &["domain", "rule"],
        )
        .expect("valid metric");
        let node_memory = IntGaugeVec::new(
            Opts::new(
                "rls_store_node_memory_bytes",
                "A Redis primary's used_memory and maxmemory (0: no limit), read every second",
            ),
            &["node", "kind"],
        )
        .expect("valid metric");
        let values_overflowed = IntCounterVec::new(
            Opts::new(
                "rls_values_overflowed_total",
                "Descriptors of a max_values rule decided by its shared overflow bucket",
            ),
            &["domain", "rule"],
        )
        .expect("valid metric");
        let bucket_resets = IntCounterVec::new(
            Opts::new(
                "rls_bucket_resets_total",
                "Descriptors whose buckets an operator reset (/v1/buckets/reset)",
            ),
            &["domain", "rule"],
        )
        .expect("valid metric");
        let untrusted_refused = IntCounterVec::new(
            Opts::new(
                "rls_untrusted_input_refused_total",
                "Data read back from Redis or a peer that was refused as malformed or oversized, by source and reason",
            ),
            &["source", "reason"],
        )
        .expect("valid metric");
        let lease = LeaseMetrics::new();
        let connections = ConnectionMetrics::new();
        let attempt = AttemptMetrics::new();
        let quota = QuotaMetrics::new();
        let region = RegionMetrics::new();
        for c in [
            Box::new(decisions.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(decisions_detailed.clone()),
            Box::new(duration.clone()),
            Box::new(store_calls.clone()),
            Box::new(store_duration.clone()),
            Box::new(store_errors.clone()),
            Box::new(store_retries.clone()),
            Box::new(primary_events.clone()),
            Box::new(node_errors.clone()),
            Box::new(breaker_open.clone()),
            Box::new(failure_policy.clone()),
            Box::new(config_reloads.clone()),
            Box::new(config_generation.clone()),
            Box::new(instances.clone()),
            Box::new(buckets.clone()),
            Box::new(buckets_evicted.clone()),
            Box::new(node_memory.clone()),
            Box::new(values_overflowed.clone()),
            Box::new(bucket_resets.clone()),
            Box::new(untrusted_refused.clone()),
        ]
        .into_iter()
        .chain(lease.collectors())
        .chain(connections.collectors())
        .chain(attempt.collectors())
        .chain(quota.collectors())
        .chain(region.collectors())
        {
            registry.register(c).expect("metric names are unique");
        }
        // Present from the start, so dashboards and alerts see zeros, not gaps.
        for result in ["ok", "error"] {
            config_reloads.with_label_values(&[result]);
        }
        for mode in [FailureMode::Open, FailureMode::Closed, FailureMode::Local] {
            failure_policy.with_label_values(&[mode.as_str()]);
        }
        for kind in STORE_ERROR_KINDS {
            store_errors.with_label_values(&[kind]);
        }
        store_retries.with_label_values(&["tryagain"]);
        Self {
            registry,
            decisions,
            decisions_detailed,
            rule_decisions: ArcSwap::from_pointee(Vec::new()),
            store_call_series: OnceLock::new(),
            duration,
            store_calls,
            store_duration,
            store_errors,
            store_retries,
            primary_events,
            node_errors,
            breaker_open,
            failure_policy,
            config_reloads,
            config_generation,
            instances,
            connections,
            buckets,
            buckets_evicted,
            node_memory,
            values_overflowed,
            bucket_resets,
            untrusted_refused,
            lease,
            attempt,
            quota,
            region,
            ratelimit: OnceLock::new(),
            hitters: OnceLock::new(),
            shown: OnceLock::new(),
            top_share: OnceLock::new(),
            global_shadow: OnceLock::new(),
        }
    }

    /// Also counts envoyproxy/ratelimit's statistics: under its Prometheus
    /// names (`prometheus`, `--ratelimit-metrics`) and for statsd (`statsd`,
    /// `--statsd-addr`); a decision within the limit is near it past
    /// `near_ratio` of the burst. Once: later calls change nothing.
    pub fn enable_ratelimit_stats(
        &self,
        prometheus: bool,
        statsd: Option<std::sync::Arc<super::statsd::StatsdCounters>>,
        near_ratio: f64,
    ) {
        if self.ratelimit.get().is_some() || (!prometheus && statsd.is_none()) {
            return;
        }
        if let Ok(stats) = super::ratelimit_stats::RatelimitStats::new(
            &self.registry,
            prometheus,
            statsd,
            near_ratio,
        ) {
            let _ = self.ratelimit.set(stats);
        }
    }

    /// A request over the limit answered OK by `--shadow-mode`
    /// (`rls_global_shadow_mode_total`, envoyproxy/ratelimit's
    /// `ratelimit.service.global_shadow_mode`).
    pub fn global_shadow_answer(&self) {
        self.global_shadow
            .get_or_init(|| {
                let c = IntCounter::new(
                    "rls_global_shadow_mode_total",
                    "Requests over the limit answered OK by --shadow-mode",
                )
                .expect("valid metric");
                let _ = self.registry.register(Box::new(c.clone()));
                c
            })
            .inc();
    }

    /// `rls_statsd_send_errors_total`, registered on first use.
    pub fn statsd_send_errors(&self) -> IntCounter {
        let counter = IntCounter::new(
            "rls_statsd_send_errors_total",
            "statsd packets that could not be sent (dropped)",
        )
        .expect("valid metric");
        // registered once; a second call gets a counter of its own
        let _ = self.registry.register(Box::new(counter.clone()));
        counter
    }

    /// Keeps each rule's heavy hitters in summaries of `k` counters (0:
    /// none), the values of `shown`'s keys hashed; the first call decides.
    /// How request values are shown (escaped, cut, some pseudonymised), as
    /// [`Metrics::enable_hitters`] was told.
    pub fn shown(&self) -> &crate::shown::ShownValues {
        self.shown.get_or_init(Default::default)
    }

    pub fn enable_hitters(&self, k: usize, shown: crate::shown::ShownValues) {
        let _ = self.shown.set(shown.clone());
        if k > 0 {
            let _ = self
                .hitters
                .set(super::hitters::HeavyHitters::new(k, shown));
        }
    }

    /// `rls_refusals_top_share{domain,rule}`, from the heavy hitters, set
    /// at each scrape: registered at the first, when they are kept.
    fn set_top_shares(&self) {
        let Some(hitters) = self.hitters.get() else {
            return;
        };
        let gauge = self.top_share.get_or_init(|| {
            let g = prometheus::GaugeVec::new(
                Opts::new(
                    "rls_refusals_top_share",
                    "Share of a rule's refusals in the last minute that its most refused descriptor value took (heavy hitters; the values are at the admin page)",
                ),
                &["domain", "rule"],
            )
            .expect("valid metric");
            let _ = self.registry.register(Box::new(g.clone()));
            g
        });
        for r in hitters.top(1) {
            let share = match (r.refused.minute.first(), r.refused.minute_hits) {
                (Some(top), hits) if hits > 0 => (top.count.min(hits) as f64) / hits as f64,
                _ => 0.0,
            };
            gauge.with_label_values(&[&r.domain, &r.rule]).set(share);
        }
    }

    /// The heavy hitters, when kept.
    pub fn hitters(&self) -> Option<&super::hitters::HeavyHitters> {
        self.hitters.get()
    }

    /// Each rule's decisions so far, for `/v1/rules`: (domain, rule,
    /// admitted, refused), rules that have decided.
    pub fn rule_totals(&self) -> Vec<(Arc<str>, Arc<str>, u64, u64)> {
        let ok = RESULTS.iter().position(|r| *r == "ok").unwrap_or(0);
        let over = RESULTS.iter().position(|r| *r == "over_limit").unwrap_or(1);
        self.rule_decisions
            .load()
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let c = c.as_ref()?;
                let (domain, rule) = RuleId::from_index(i)?.labels();
                Some((domain, rule, c[ok].get(), c[over].get()))
            })
            .collect()
    }

    /// The store's health as counted: each Redis node's breaker (open or
    /// not), and the answers each failure mode gave, for `/v1/store`.
    pub fn store_health(&self) -> StoreHealth {
        use prometheus::core::Collector;
        let label = |m: &prometheus::proto::Metric| {
            m.get_label()
                .first()
                .map(|l| l.value().to_string())
                .unwrap_or_default()
        };
        let breakers = self
            .breaker_open
            .collect()
            .iter()
            .flat_map(|f| f.get_metric())
            .map(|m| (label(m), m.get_gauge().get_value() > 0.0))
            .collect();
        let answers = self
            .failure_policy
            .collect()
            .iter()
            .flat_map(|f| f.get_metric())
            .map(|m| (label(m), m.get_counter().get_value() as u64))
            .collect();
        StoreHealth { breakers, answers }
    }

    /// envoyproxy/ratelimit's statistics, when turned on.
    pub fn ratelimit_stats(&self) -> Option<&super::ratelimit_stats::RatelimitStats> {
        self.ratelimit.get()
    }

    /// Counts one request's decisions.
    pub fn record_decisions<E: DescriptorEntry>(
        &self,
        rules: &RuleSet,
        domain: &str,
        entries: &[&[E]],
        decisions: &[Decision],
    ) {
        // a decision by a rule says the domain has rules; else look
        let known = decisions.iter().any(|d| d.rule.is_some()) || rules.has_domain(domain);
        let domain_label = if known { domain } else { UNKNOWN_DOMAIN };
        for (decision, entries) in decisions.iter().zip(entries) {
            let rule = match &decision.rule {
                None => NO_RULE,
                Some(r) => r.label(),
            };
            let result = if decision.verdict == Verdict::NoRule && decision.rule.is_some() {
                // matched, but its limits were replaced by another descriptor's
                "ok"
            } else {
                decision.verdict.result_label()
            };
            match (&decision.rule, RESULTS.iter().position(|r| *r == result)) {
                (Some(r), Some(i)) if r.id != RuleId::default() => {
                    self.rule_counters(r.id)[i].inc()
                }
                _ => self
                    .decisions
                    .with_label_values(&[domain_label, rule, result])
                    .inc(),
            }
            if let (Some(h), Some(r)) = (self.hitters.get(), &decision.rule) {
                match decision.verdict {
                    Verdict::Ok => h.record(r.id, entries, true),
                    Verdict::OverLimit => h.record(r.id, entries, false),
                    _ => {}
                }
            }
            // the request's values in a series of their own: the rule's
            // series above stays what dashboards and alerts read
            if let Some(r) = decision
                .rule
                .as_ref()
                .filter(|r| r.detailed_metric || r.value_to_metric)
            {
                let shown = self.shown();
                let mut descriptor = String::new();
                for (i, e) in entries.iter().enumerate() {
                    if i > 0 {
                        descriptor.push('.');
                    }
                    crate::shown::escape_into(&mut descriptor, crate::shown::cut_at(e.key(), 64));
                    descriptor.push('_');
                    shown.write_value(&mut descriptor, e.key(), e.value());
                }
                self.decisions_detailed
                    .with_label_values(&[domain_label, r.label(), &descriptor, result])
                    .inc();
            }
        }
    }

    /// The decision counters of rule `id` (whose labels are the rule's
    /// domain and label), resolved on its first decision.
    fn rule_counters(&self, id: RuleId) -> Arc<RuleCounters> {
        if let Some(Some(c)) = self.rule_decisions.load().get(id.index()) {
            return c.clone();
        }
        let (domain, rule) = id.labels();
        let counters: Arc<RuleCounters> = Arc::new(
            RESULTS.map(|result| self.decisions.with_label_values(&[&domain, &rule, result])),
        );
        self.rule_decisions.rcu(|table| {
            let mut table = Vec::clone(table);
            if table.len() <= id.index() {
                table.resize(id.index() + 1, None);
            }
            table[id.index()] = Some(counters.clone());
            table
        });
        counters
    }

    pub fn observe_call(&self, seconds: f64) {
        self.duration.observe(seconds);
    }

    pub fn observe_store_call(&self, store: &str, seconds: f64) {
        let (name, calls, duration) = self.store_call_series.get_or_init(|| {
            (
                store.to_owned(),
                self.store_calls.with_label_values(&[store]),
                self.store_duration.with_label_values(&[store]),
            )
        });
        if name == store {
            calls.inc();
            duration.observe(seconds);
        } else {
            self.store_calls.with_label_values(&[store]).inc();
            self.store_duration
                .with_label_values(&[store])
                .observe(seconds);
        }
    }

    pub fn store_error(&self, kind: &str) {
        self.store_errors.with_label_values(&[kind]).inc();
    }

    /// A store call that did not run was sent again, for `reason`.
    pub fn store_retry(&self, reason: &str) {
        self.store_retries.with_label_values(&[reason]).inc();
    }

    /// The watch of a single Redis primary saw `event`.
    pub fn primary_event(&self, event: &str) {
        self.primary_events.with_label_values(&[event]).inc();
    }

    /// `event`'s series, at zero until it happens (a store that has such a
    /// watch shows them from the start).
    pub fn primary_event_series(&self, event: &str) {
        self.primary_events.with_label_values(&[event]);
    }

    /// A call to `node` timed out or lost its connection (`kind`:
    /// `timeout`, `connection`).
    pub fn node_error(&self, node: &str, kind: &str) {
        self.node_errors.with_label_values(&[node, kind]).inc();
    }

    /// A Redis node is first seen: its series start at zero.
    pub fn node_seen(&self, node: &str) {
        self.breaker_open(node, false);
        for kind in ["timeout", "connection"] {
            self.node_errors.with_label_values(&[node, kind]);
        }
    }

    /// `node`'s breaker opened (or closed).
    /// How many buckets `store` holds now.
    pub fn buckets_held(&self, store: &str, n: usize) {
        self.buckets
            .with_label_values(&[store])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A Redis primary's memory (`kind` `used` and `max`).
    pub fn node_memory(&self, node: &str, used: u64, max: u64) {
        for (kind, v) in [("used", used), ("max", max)] {
            self.node_memory
                .with_label_values(&[node, kind])
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        }
    }

    /// An operator reset a descriptor's buckets of `rule`.
    /// Data from `source` (`hitters`, …) refused for `reason`: counted,
    /// and logged at most once a minute per source.
    pub fn untrusted_refused(&self, source: &'static str, reason: &str) {
        let counter = self.untrusted_refused.with_label_values(&[source, reason]);
        let before = counter.get();
        counter.inc();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let last = LAST.load(std::sync::atomic::Ordering::Relaxed);
        if before == 0 || now >= last + 60 {
            LAST.store(now, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(source, reason, "data read back from the store refused (rls_untrusted_input_refused_total; logged at most once a minute)");
        }
    }

    pub fn bucket_reset(&self, rule: RuleId) {
        let (domain, rule) = rule.labels();
        self.bucket_resets
            .with_label_values(&[&domain, &rule])
            .inc();
    }

    /// A descriptor of a `max_values` rule sent to its overflow bucket.
    pub fn value_overflowed(&self, rule: RuleId) {
        let (domain, rule) = rule.labels();
        self.values_overflowed
            .with_label_values(&[&domain, &rule])
            .inc();
    }

    /// `n` buckets of `rule` evicted to make room.
    pub fn buckets_evicted(&self, rule: RuleId, n: u64) {
        let (domain, rule) = rule.labels();
        self.buckets_evicted
            .with_label_values(&[&domain, &rule])
            .inc_by(n);
    }

    /// `n` calls of `rule`'s attempts ended as `result` (an
    /// [`crate::attempt::AttemptResult`] label).
    pub fn attempts(&self, rule: RuleId, result: &str, n: u64) {
        self.attempt.count(rule, result, n);
    }

    /// `n` tokens of `rule`'s charges cut off by its debt bound.
    pub fn debt_forgiven(&self, rule: RuleId, n: u64) {
        let (domain, rule) = rule.labels();
        self.attempt
            .forgiven
            .with_label_values(&[&domain, &rule])
            .inc_by(n);
    }

    /// One descriptor given back what it took, for `reason` (refused,
    /// late); `result`: ok, failed.
    pub fn given_back(&self, rule: RuleId, reason: &str, result: &str) {
        let (domain, rule) = rule.labels();
        self.attempt
            .given_back
            .with_label_values(&[&domain, &rule, reason, result])
            .inc();
    }

    /// What the memory store tells of reservations that expired unsettled
    /// (its attempt sink), counted here as `expired`.
    pub fn expiry_sink(self: &Arc<Self>) -> Arc<dyn Fn(RuleId, u64) + Send + Sync> {
        let metrics = Arc::downgrade(self);
        Arc::new(move |rule, n| {
            if let Some(m) = metrics.upgrade() {
                m.attempts(rule, "expired", n);
            }
        })
    }

    /// What the memory store tells of evictions (its `EvictionSink`),
    /// counted here.
    pub fn eviction_sink(self: &Arc<Self>) -> Arc<dyn Fn(RuleId, u64) + Send + Sync> {
        let metrics = Arc::downgrade(self);
        Arc::new(move |rule, n| {
            if let Some(m) = metrics.upgrade() {
                m.buckets_evicted(rule, n);
            }
        })
    }

    pub fn breaker_open(&self, node: &str, open: bool) {
        self.breaker_open
            .with_label_values(&[node])
            .set(i64::from(open));
    }

    pub fn failure_policy(&self, mode: FailureMode) {
        self.failure_policy
            .with_label_values(&[mode.as_str()])
            .inc();
    }

    pub fn config_reload(&self, ok: bool, generation: u64) {
        self.config_reloads
            .with_label_values(&[if ok { "ok" } else { "error" }])
            .inc();
        if let Some(stats) = self.ratelimit.get() {
            stats.config_load(ok);
        }
        self.set_generation(generation);
    }

    /// `rls_grpc_connections` and `rls_grpc_connections_limit`.
    pub fn grpc_connections(&self, open: usize, limit: usize) {
        self.connections.set(open, limit);
    }

    /// `rls_instances`.
    pub fn set_instances(&self, n: u32) {
        self.instances.set(i64::from(n));
    }

    pub fn set_generation(&self, generation: u64) {
        self.config_generation
            .set(i64::try_from(generation).unwrap_or(i64::MAX));
    }

    /// `rls_config_reloads_total{result}`.
    pub fn reloads(&self, result: &str) -> u64 {
        self.config_reloads.with_label_values(&[result]).get()
    }

    pub fn quota_streams(&self, open: usize) {
        self.quota
            .streams
            .set(i64::try_from(open).unwrap_or(i64::MAX));
    }

    /// The `domain` label of an RLQS stream: its domain if the rules define
    /// it, else [`UNKNOWN_DOMAIN`] (clients cannot grow the label set).
    pub fn quota_domain_label(&self, rules: &RuleSet, domain: &str) -> String {
        if rules.has_domain(domain) {
            domain.to_owned()
        } else {
            UNKNOWN_DOMAIN.to_owned()
        }
    }

    /// A global rule's decision made without a live share (`mode`: floor,
    /// closed, open, over_bound).
    pub fn region_fallback(&self, mode: &str, n: u64) {
        if n > 0 {
            self.region.fallback.with_label_values(&[mode]).inc_by(n);
        }
    }

    /// Assignments cut to range: their burst, rate, time to live.
    pub fn region_clamped(&self, burst: u64, rate: u64, ttl: u64) {
        for (part, n) in [("burst", burst), ("rate", rate), ("ttl", ttl)] {
            if n > 0 {
                self.region.clamped.with_label_values(&[part]).inc_by(n);
            }
        }
    }

    /// A region stream refused on the global tier, and why.
    pub fn region_refused(&self, reason: &str) {
        self.region.refused.with_label_values(&[reason]).inc();
    }

    pub fn region_reports(&self, n: usize) {
        self.region.reports.inc_by(n as u64);
    }

    pub fn region_assignments(&self, n: usize) {
        self.region.assignments.inc_by(n as u64);
    }

    /// The region's state, as the upstream client sees it at each report.
    pub fn region_state(&self, up: bool, since_assignment_secs: Option<f64>, buckets: usize) {
        self.region.reachable.set(i64::from(up));
        self.region
            .since_assignment
            .set(since_assignment_secs.unwrap_or(-1.0));
        self.region
            .buckets
            .set(i64::try_from(buckets).unwrap_or(i64::MAX));
    }

    /// Sets `rls_region_share` for every (domain, rule) given, and drops
    /// the series of rules with no live share now.
    /// `totals`: (burst, rate) per (domain, rule).
    pub fn region_shares(&self, totals: &std::collections::BTreeMap<(String, String), (f64, f64)>) {
        let mut series = self.region.share_series.lock();
        let mut now = Vec::with_capacity(totals.len() * 2);
        for ((domain, rule), (burst, rate)) in totals {
            for (part, v) in [("burst", *burst), ("rate", *rate)] {
                self.region
                    .share
                    .with_label_values(&[domain.as_str(), rule.as_str(), part])
                    .set(v);
                now.push((domain.clone(), rule.clone(), part));
            }
        }
        for old in series.iter() {
            if !now.contains(old) {
                let _ =
                    self.region
                        .share
                        .remove_label_values(&[old.0.as_str(), old.1.as_str(), old.2]);
            }
        }
        *series = now;
    }

    /// Sets `rls_quota_share` for every rule given, and drops the series of
    /// rules no longer split.
    pub fn quota_shares(&self, fractions: &[(String, String, f64)]) {
        let mut series = self.quota.share_series.lock();
        for (domain, rule, fraction) in fractions {
            self.quota
                .share
                .with_label_values(&[domain, rule])
                .set(*fraction);
        }
        for (domain, rule) in series.iter() {
            if !fractions.iter().any(|(d, r, _)| d == domain && r == rule) {
                let _ = self.quota.share.remove_label_values(&[domain, rule]);
            }
        }
        *series = fractions
            .iter()
            .map(|(d, r, _)| (d.clone(), r.clone()))
            .collect();
    }

    pub fn quota_reports(&self, domain: &str, buckets: usize) {
        self.quota
            .reports
            .with_label_values(&[domain])
            .inc_by(buckets as u64);
    }

    pub fn quota_assignments(&self, domain: &str, actions: usize) {
        self.quota
            .assignments
            .with_label_values(&[domain])
            .inc_by(actions as u64);
    }

    /// Assignments sent to `domain`'s Envoys while their buckets' ledger
    /// steps failed.
    pub fn quota_without_ledger(&self, domain: &str, actions: u64) {
        if actions > 0 {
            self.quota
                .without_ledger
                .with_label_values(&[domain])
                .inc_by(actions);
        }
    }

    /// Buckets assigned without the shared ledger now.
    pub fn quota_buckets_without_ledger(&self, buckets: usize) {
        self.quota
            .buckets_without_ledger
            .set(i64::try_from(buckets).unwrap_or(i64::MAX));
    }

    /// Time the RLQS thread spent on `work` (report or tick).
    pub fn quota_busy(&self, work: &str, spent: std::time::Duration) {
        self.quota
            .busy
            .with_label_values(&[work])
            .inc_by(spent.as_secs_f64());
    }

    pub fn quota_outbox_bytes(&self, bytes: usize) {
        self.quota
            .outbox_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    pub fn quota_dropped(&self, reason: &str, n: u64) {
        if n > 0 {
            self.quota.dropped.with_label_values(&[reason]).inc_by(n);
        }
    }

    /// Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        self.set_top_shares();
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
