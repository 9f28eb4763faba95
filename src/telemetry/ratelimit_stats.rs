//! envoyproxy/ratelimit's per-rule statistics, under the names its
//! Prometheus mapping gives them (`src/stats/prom/default_mapper.yaml`
//! there), so that dashboards and alerts written for it (Envoy Gateway's)
//! read this service unchanged: `ratelimit_service_rate_limit_{total_hits,
//! within_limit,near_limit,over_limit,shadow_mode}{domain, key1, key2}`,
//! counting hits (`hits_addend`), where `key1` and `key2` are the first two
//! elements of the rule's descriptor path (`key_value` or `key`) and `key2`
//! is empty for a path of one. On with `--ratelimit-metrics` (or
//! envoyproxy/ratelimit's `USE_PROMETHEUS=true`), beside our `rls_*`.

use std::sync::Arc;

use prometheus::{IntCounterVec, Opts, Registry};

use super::statsd::{StatsdCounters, STAT_NAMES};
use crate::bucket::Cost;
use crate::limiter::{Decision, Verdict};

/// The five stats, counted under envoyproxy/ratelimit's Prometheus names,
/// over statsd, or both.
pub struct RatelimitStats {
    /// In [`STAT_NAMES`] order, each by (domain, key1, key2).
    prometheus: Option<[IntCounterVec; STAT_NAMES.len()]>,
    statsd: Option<Arc<StatsdCounters>>,
    /// A decision within the limit counts as near it once more than this
    /// fraction of the burst is spent (`NEAR_LIMIT_RATIO`, 0.8 there).
    near_ratio: f64,
}

/// Which of [`STAT_NAMES`] a verdict counts in (`None`: none).
fn stats_of(verdict: Verdict, near: bool) -> Option<[bool; STAT_NAMES.len()]> {
    // total_hits, within_limit, near_limit, over_limit, shadow_mode
    match verdict {
        Verdict::Ok => Some([true, true, near, false, false]),
        Verdict::OverLimit | Verdict::QuotaExceeded => Some([true, false, false, true, false]),
        Verdict::Shadow => Some([true, false, false, true, true]),
        Verdict::Unlimited | Verdict::NoRule | Verdict::FailedOpen => None,
    }
}

impl RatelimitStats {
    /// The stats, as Prometheus counters registered in `registry` (when
    /// `prometheus`) and for `statsd` (when given).
    pub fn new(
        registry: &Registry,
        prometheus: bool,
        statsd: Option<Arc<StatsdCounters>>,
        near_ratio: f64,
    ) -> prometheus::Result<Self> {
        let counter = |name: &str, help: &str| -> prometheus::Result<IntCounterVec> {
            let c = IntCounterVec::new(
                Opts::new(format!("ratelimit_service_rate_limit_{name}"), help),
                &["domain", "key1", "key2"],
            )?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let prometheus = match prometheus {
            false => None,
            true => Some([
                counter(
                    STAT_NAMES[0],
                    "Hits decided by a rule (envoyproxy/ratelimit's name)",
                )?,
                counter(
                    STAT_NAMES[1],
                    "Hits within the limit (envoyproxy/ratelimit's name)",
                )?,
                counter(
                    STAT_NAMES[2],
                    "Hits within the limit past the near-limit ratio of the burst (envoyproxy/ratelimit's name)",
                )?,
                counter(
                    STAT_NAMES[3],
                    "Hits over the limit, shadow and quota mode included (envoyproxy/ratelimit's name)",
                )?,
                counter(
                    STAT_NAMES[4],
                    "Hits over the limit of a shadow_mode rule (envoyproxy/ratelimit's name)",
                )?,
            ]),
        };
        Ok(Self {
            prometheus,
            statsd,
            near_ratio,
        })
    }

    /// Counts one request's decisions, each with what it cost.
    pub fn record(&self, domain: &str, decisions: &[Decision], costs: impl Iterator<Item = Cost>) {
        for (d, cost) in decisions.iter().zip(costs) {
            let (Some(rule), Some(limit)) = (&d.rule, &d.limit) else {
                continue;
            };
            let hits = match cost {
                Cost::Spend(n) | Cost::Charge(n) => n,
                Cost::Check | Cost::Refund(_) | Cost::Lease { .. } => 0,
            };
            let spent = limit.burst.saturating_sub(d.remaining) as f64;
            let near = spent > limit.burst as f64 * self.near_ratio;
            let Some(which) = stats_of(d.verdict, near) else {
                continue;
            };
            if let Some(counters) = &self.prometheus {
                let mut path = rule.path.splitn(3, '.');
                let key1 = path.next().unwrap_or_default();
                let key2 = path.next().unwrap_or_default();
                let labels = [domain, key1, key2];
                for (c, on) in counters.iter().zip(which) {
                    if on {
                        c.with_label_values(&labels).inc_by(hits);
                    }
                }
            }
            if let Some(statsd) = &self.statsd {
                statsd.add(domain, &rule.path, which, hits);
            }
        }
    }
}
