//! envoyproxy/ratelimit's per-rule statistics, under the names its
//! Prometheus mapping gives them (`src/stats/prom/default_mapper.yaml`
//! there), so that dashboards and alerts written for it (Envoy Gateway's)
//! read this service unchanged: `ratelimit_service_rate_limit_{total_hits,
//! within_limit,near_limit,over_limit,shadow_mode}{domain, key1, key2}`,
//! counting hits (`hits_addend`), where `key1` and `key2` are the first two
//! elements of the rule's descriptor path (`key_value` or `key`) and `key2`
//! is empty for a path of one. On with `--ratelimit-metrics` (or
//! envoyproxy/ratelimit's `USE_PROMETHEUS=true`), beside our `rls_*`.

use prometheus::{IntCounterVec, Opts, Registry};

use crate::bucket::Cost;
use crate::limiter::{Decision, Verdict};

/// The five counters, each by (domain, key1, key2).
pub struct RatelimitStats {
    total_hits: IntCounterVec,
    within_limit: IntCounterVec,
    near_limit: IntCounterVec,
    over_limit: IntCounterVec,
    shadow_mode: IntCounterVec,
    /// A decision within the limit counts as near it once more than this
    /// fraction of the burst is spent (`NEAR_LIMIT_RATIO`, 0.8 there).
    near_ratio: f64,
}

impl RatelimitStats {
    /// The counters, registered in `registry`.
    pub fn register(registry: &Registry, near_ratio: f64) -> prometheus::Result<Self> {
        let counter = |name: &str, help: &str| -> prometheus::Result<IntCounterVec> {
            let c = IntCounterVec::new(Opts::new(name, help), &["domain", "key1", "key2"])?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        Ok(Self {
            total_hits: counter(
                "ratelimit_service_rate_limit_total_hits",
                "Hits decided by a rule (envoyproxy/ratelimit's name)",
            )?,
            within_limit: counter(
                "ratelimit_service_rate_limit_within_limit",
                "Hits within the limit (envoyproxy/ratelimit's name)",
            )?,
            near_limit: counter(
                "ratelimit_service_rate_limit_near_limit",
                "Hits within the limit past the near-limit ratio of the burst (envoyproxy/ratelimit's name)",
            )?,
            over_limit: counter(
                "ratelimit_service_rate_limit_over_limit",
                "Hits over the limit, shadow and quota mode included (envoyproxy/ratelimit's name)",
            )?,
            shadow_mode: counter(
                "ratelimit_service_rate_limit_shadow_mode",
                "Hits over the limit of a shadow_mode rule (envoyproxy/ratelimit's name)",
            )?,
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
            let mut path = rule.path.splitn(3, '.');
            let key1 = path.next().unwrap_or_default();
            let key2 = path.next().unwrap_or_default();
            let labels = [domain, key1, key2];
            let add = |c: &IntCounterVec| c.with_label_values(&labels).inc_by(hits);
            match d.verdict {
                Verdict::Ok => {
                    add(&self.total_hits);
                    add(&self.within_limit);
                    let spent = limit.burst.saturating_sub(d.remaining) as f64;
                    if spent > limit.burst as f64 * self.near_ratio {
                        add(&self.near_limit);
                    }
                }
                Verdict::OverLimit | Verdict::QuotaExceeded => {
                    add(&self.total_hits);
                    add(&self.over_limit);
                }
                Verdict::Shadow => {
                    add(&self.total_hits);
                    add(&self.over_limit);
                    add(&self.shadow_mode);
                }
                Verdict::Unlimited | Verdict::NoRule | Verdict::FailedOpen => {}
            }
        }
    }
}
