//! How full each Redis primary is.
//!
//! With `maxmemory-policy noeviction` (the recommended policy: evicting a
//! bucket resets it to full), a primary at its `maxmemory` refuses every
//! write with `OOM`, and every descriptor on it answers by its rule's failure
//! mode. So the store reads `used_memory` and `maxmemory` from each primary
//! every [`MEMORY_WATCH`] (on the probe connection, never behind decisions),
//! exports them per node, and warns at `/readyz` from [`WARNING_SHARE`] on,
//! before writes start failing. And once at start-up, the eviction
//! policy: anything but `noeviction` is warned about.

use std::sync::Arc;
use std::time::Duration;

use fred::interfaces::{ClientLike, ConfigInterface};
use fred::types::config::Options;

use super::{RedisStore, PROBE_TIMEOUT};
use crate::telemetry::Metrics;

/// How often each primary's memory is read.
pub const MEMORY_WATCH: Duration = Duration::from_secs(1);

/// Share of `maxmemory` from which a primary is reported as nearly full.
pub const WARNING_SHARE: f64 = 0.8;

/// One primary's memory, from `INFO memory`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeMemory {
    pub used: u64,
    /// 0: no limit.
    pub max: u64,
}

impl NodeMemory {
    /// Reads `used_memory` and `maxmemory` from `INFO memory` text.
    pub fn parse(info: &str) -> Option<Self> {
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        Some(Self {
            used: field("used_memory")?,
            max: field("maxmemory")?,
        })
    }

    /// A warning for `/readyz` when the node is at [`WARNING_SHARE`] of its
    /// limit or more.
    pub fn warning(self, node: &str) -> Option<String> {
        if self.max == 0 {
            return None;
        }
        let share = self.used as f64 / self.max as f64;
        (share >= WARNING_SHARE).then(|| {
            format!(
                "{node}: used_memory {} of maxmemory {} ({:.0} %): at 100 % new buckets fail with OOM and their rules' failure modes answer",
                self.used,
                self.max,
                share * 100.0
            )
        })
    }
}

impl RedisStore {
    /// Warns when a server may evict keys: every bucket key has a TTL, so
    /// `volatile-*` policies would evict them too, resetting budgets silently.
    pub async fn check_eviction_policy(&self) {
        let routing = self.routing.read().clone();
        let mut warnings = Vec::new();
        for node in &routing.nodes {
            let opts = Options {
                timeout: Some(Duration::from_secs(2)),
                ..Options::default()
            };
            let name = &node.name;
            match node
                .clients
                .probe
                .with_options(&opts)
                .config_get::<Vec<String>, _>("maxmemory-policy")
                .await
            {
                Ok(v) => {
                    let policy = v.get(1).cloned().unwrap_or_default();
                    if policy != "noeviction" {
                        tracing::warn!(server = %name, policy = %policy, "Redis may evict rate-limit buckets (maxmemory-policy is not noeviction): evicted buckets reset to full");
                        warnings.push(format!(
                            "{name}: maxmemory-policy is {policy}, not noeviction"
                        ));
                    }
                }
                Err(e) => {
                    tracing::info!(server = %name, error = %e, "cannot read maxmemory-policy (CONFIG may be disabled); make sure it is noeviction")
                }
            }
        }
        self.status.write().eviction_warnings = warnings;
    }

    /// Reads every primary's memory every [`MEMORY_WATCH`] until the
    /// store is gone: gauges per node, and warnings for `/readyz`.
    pub fn spawn_memory_watch(self: &Arc<Self>, metrics: Arc<Metrics>) {
        crate::periodic::spawn_every(self, MEMORY_WATCH, move |store| {
            let routing = store.routing.read().clone();
            let status = store.status.clone();
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let opts = Options {
                    timeout: Some(PROBE_TIMEOUT),
                    fail_fast: true,
                    max_attempts: Some(1),
                    ..Options::default()
                };
                let reads = routing.nodes.iter().map(|node| async {
                    let info: Result<String, _> = node
                        .clients
                        .probe
                        .with_options(&opts)
                        .info(Some(fred::types::InfoKind::Memory))
                        .await;
                    (
                        node.name.clone(),
                        info.ok().as_deref().and_then(NodeMemory::parse),
                    )
                });
                let mut warnings = Vec::new();
                for (name, read) in futures::future::join_all(reads).await {
                    let Some(m) = read else { continue };
                    metrics.node_memory(&name, m.used, m.max);
                    warnings.extend(m.warning(&name));
                }
                status.write().memory_warnings = warnings;
            });
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_info_memory() {
        let info = "# Memory\r\nused_memory:1048576\r\nused_memory_human:1.00M\r\nmaxmemory:2097152\r\nmaxmemory_human:2.00M\r\n";
        let m = NodeMemory::parse(info).expect("parsed");
        assert_eq!(
            m,
            NodeMemory {
                used: 1_048_576,
                max: 2_097_152
            }
        );
        assert!(m.warning("n").is_none(), "50 %");
        assert!(NodeMemory::parse("used_memory_human:1M").is_none());
    }

    #[test]
    fn warns_from_80_percent_of_a_limit() {
        let at = |used, max| NodeMemory { used, max }.warning("10.0.0.1:6379");
        assert!(at(79, 100).is_none());
        let w = at(80, 100).expect("warned");
        assert!(
            w.starts_with("10.0.0.1:6379: used_memory 80 of maxmemory 100 (80 %)"),
            "{w}"
        );
        assert!(at(1 << 40, 0).is_none(), "no limit, no warning");
    }
}
