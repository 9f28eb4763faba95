//! envoyproxy/ratelimit's per-rule statistics, under the names its
//! Prometheus mapping gives them (`src/stats/prom/default_mapper.yaml`
//! there), so that dashboards and alerts written for it (Envoy Gateway's)
//! read this service unchanged: `ratelimit_service_rate_limit_{total_hits,
//! within_limit,near_limit,over_limit,shadow_mode}{domain, key1, key2}`,
//! counting hits (`hits_addend`), where `key1` and `key2` are the first two
//! elements of the rule's descriptor path (`key_value` or `key`) and `key2`
//! is empty for a path of one. On with `--ratelimit-metrics` (or
//! envoyproxy/ratelimit's `USE_PROMETHEUS=true`), beside our `rls_*`.
//!
//! With them, the service-wide ones of the same mapping (Envoy Gateway's
//! dashboard reads them): `ratelimit_service_total_requests{grpc_method}`,
//! `ratelimit_service_response_time_seconds{grpc_method}`,
//! `ratelimit_service_should_rate_limit_error{err_type}` (`redis_error`: the
//! store failed and the answer was an error; `service_error`: a request
//! refused as invalid), `ratelimit_service_config_load_success` and
//! `_error`. Counters saturate instead of wrapping.

use std::sync::Arc;

use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry};

use super::statsd::{StatsdCounters, STAT_NAMES};
use crate::bucket::Cost;
use crate::decision::{Decision, Verdict};

/// The five stats, counted under envoyproxy/ratelimit's Prometheus names,
/// over statsd, or both.
pub struct RatelimitStats {
    /// In [`STAT_NAMES`] order, each by (domain, key1, key2).
    prometheus: Option<[IntCounterVec; STAT_NAMES.len()]>,
    statsd: Option<Arc<StatsdCounters>>,
    /// A decision within the limit counts as near it once more than this
    /// fraction of the burst is spent (`NEAR_LIMIT_RATIO`, 0.8 there).
    near_ratio: f64,
    /// The service-wide counters, with the Prometheus ones.
    service: Option<ServiceStats>,
}

/// envoyproxy/ratelimit's service-wide statistics, under its names.
struct ServiceStats {
    requests: IntCounterVec,
    response_time: HistogramVec,
    errors: IntCounterVec,
    config_success: IntCounter,
    config_error: IntCounter,
}

/// envoyproxy/ratelimit's `err_type` of a call answered with `code`: a
/// request refused as invalid is `service_error`, anything else the store
/// failing (`redis_error`).
fn err_type(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::InvalidArgument => "service_error",
        _ => "redis_error",
    }
}

/// Adds `n` to `c`, stopping at the largest count instead of wrapping.
fn add_saturating(c: &IntCounter, n: u64) {
    c.inc_by(n.min(u64::MAX - c.get()));
}

impl ServiceStats {
    fn new(registry: &Registry) -> prometheus::Result<Self> {
        let requests = IntCounterVec::new(
            Opts::new(
                "ratelimit_service_total_requests",
                "Calls served, by gRPC method (envoyproxy/ratelimit's name)",
            ),
            &["grpc_method"],
        )?;
        let response_time = HistogramVec::new(
            HistogramOpts::new(
                "ratelimit_service_response_time_seconds",
                "Time to answer a call, by gRPC method (envoyproxy/ratelimit's name)",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0,
            ]),
            &["grpc_method"],
        )?;
        let errors = IntCounterVec::new(
            Opts::new(
                "ratelimit_service_should_rate_limit_error",
                "Calls answered with an error, by err_type (envoyproxy/ratelimit's name)",
            ),
            &["err_type"],
        )?;
        let config_success = IntCounter::new(
            "ratelimit_service_config_load_success",
            "Rules loaded and swapped in (envoyproxy/ratelimit's name)",
        )?;
        let config_error = IntCounter::new(
            "ratelimit_service_config_load_error",
            "Rules refused, the previous ones kept (envoyproxy/ratelimit's name)",
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(response_time.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(config_success.clone()))?;
        registry.register(Box::new(config_error.clone()))?;
        Ok(Self {
            requests,
            response_time,
            errors,
            config_success,
            config_error,
        })
    }
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

/// envoyproxy/ratelimit's split of a fixed window's `hits` (its
/// `checkOverLimitThreshold` and `checkNearLimitThreshold`): (within_limit,
/// near_limit, over_limit), from the window's count after them. Near is
/// past `limit × near_ratio` (multiplied in 32-bit floats and rounded down,
/// as there); a hit that crosses a threshold counts in each range it
/// covers, and an over-limit one counts the part between the near
/// threshold (or the count before it) and the limit as near.
pub fn window_split(limit: u64, near_ratio: f64, hits: u64, after: u64) -> (u64, u64, u64) {
    let near_at = f64::from(limit as f32 * near_ratio as f32).floor() as u64;
    let before = after.saturating_sub(hits);
    if after > limit {
        if before >= limit {
            (0, 0, hits)
        } else {
            (0, limit.saturating_sub(near_at.max(before)), after - limit)
        }
    } else if after > near_at {
        (
            hits,
            if before >= near_at {
                hits
            } else {
                after - near_at
            },
            0,
        )
    } else {
        (hits, 0, 0)
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
        let service = match prometheus {
            false => None,
            true => Some(ServiceStats::new(registry)?),
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
            service,
        })
    }

    /// One call of `method` answered in `seconds`, with an error (its gRPC
    /// code) or not.
    pub fn call(&self, method: &str, seconds: f64, error: Option<tonic::Code>) {
        let Some(s) = &self.service else { return };
        add_saturating(&s.requests.with_label_values(&[method]), 1);
        s.response_time
            .with_label_values(&[method])
            .observe(seconds);
        if let Some(e) = error {
            add_saturating(&s.errors.with_label_values(&[err_type(e)]), 1);
        }
    }

    /// Rules loaded (`ok`) or refused.
    pub fn config_load(&self, ok: bool) {
        let Some(s) = &self.service else { return };
        add_saturating(
            if ok {
                &s.config_success
            } else {
                &s.config_error
            },
            1,
        );
    }

    /// Counts one request's decisions, each with what it cost.
    pub fn record(&self, domain: &str, decisions: &[Decision], costs: impl Iterator<Item = Cost>) {
        for (d, cost) in decisions.iter().zip(costs) {
            let (Some(rule), Some(limit)) = (&d.rule, &d.limit) else {
                continue;
            };
            let hits = match cost {
                Cost::Spend(n) | Cost::Charge(n) => n,
                Cost::Check | Cost::Refund(_) | Cost::GiveBack { .. } | Cost::Lease { .. } => 0,
            };
            let spent = limit.burst.saturating_sub(d.remaining) as f64;
            let near = spent > limit.burst as f64 * self.near_ratio;
            let Some(mut which) = stats_of(d.verdict, near) else {
                continue;
            };
            // total_hits, within_limit, near_limit, over_limit, shadow_mode
            let mut amounts = [hits; STAT_NAMES.len()];
            if let Some(after) = d.window_count {
                // a fixed window: a weighted hit split as envoyproxy/ratelimit does
                let (within, near, over) = window_split(
                    u64::from(limit.requests_per_unit),
                    self.near_ratio,
                    hits,
                    after,
                );
                which[2] = near > 0;
                amounts[1..4].copy_from_slice(&[within, near, over]);
            }
            if let Some(counters) = &self.prometheus {
                let mut path = rule.path.splitn(3, '.');
                let key1 = path.next().unwrap_or_default();
                let key2 = path.next().unwrap_or_default();
                let labels = [domain, key1, key2];
                for ((c, on), n) in counters.iter().zip(which).zip(amounts) {
                    if on {
                        add_saturating(&c.with_label_values(&labels), n);
                    }
                }
            }
            if let Some(statsd) = &self.statsd {
                statsd.add(domain, &rule.path, which, amounts);
            }
        }
    }
}
