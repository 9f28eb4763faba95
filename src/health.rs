//! Readiness: whether *this instance* can answer right now.
//!
//! Ready when rules are loaded and the instance is not draining (shutting
//! down). The store's state is not part of it: every instance shares the
//! same Redis, so a store outage would take every instance out of the
//! Service at once, and then Envoy's own `failure_mode_deny` would decide
//! every request, fail-open rules included, instead of the rules' failure
//! modes. The store's state (reachable, nodes with an open breaker,
//! warnings) is in the body, for people and dashboards. The same verdict
//! feeds `/readyz` and the gRPC health service (`grpc.health.v1`, service
//! `ratelimit` and the empty name).
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `server`; uses `service` (RLQS's ledger), `limiter`, `rules`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::limiter::Limiter;
use crate::rules::SharedRules;
use crate::service::quota::QuotaHub;

/// The gRPC health service name Envoy and Kubernetes probes ask about.
pub const SERVICE_NAME: &str = "ratelimit";

/// Whether shutdown has begun: set once, by the first SIGTERM or SIGINT,
/// and told to whoever waits on it.
#[derive(Default)]
pub struct Draining {
    began: AtomicBool,
    told: Notify,
}

impl Draining {
    /// Shutdown begins: readiness turns false from now on.
    pub fn begin(&self) {
        self.began.store(true, Ordering::Release);
        self.told.notify_waiters();
    }

    pub fn began(&self) -> bool {
        self.began.load(Ordering::Acquire)
    }

    /// Resolves when [`Draining::begin`] is next called (at once if it
    /// was, for a waiter that looks after it).
    async fn notified(&self) {
        let told = self.told.notified();
        if self.began() {
            return;
        }
        told.await;
    }
}

#[derive(Clone)]
pub struct Health {
    pub rules: SharedRules,
    pub limiter: Arc<Limiter>,
    /// The RLQS face: whether it assigns without the shared ledger.
    pub quota: Option<Arc<QuotaHub>>,
    /// Set when shutdown begins.
    pub draining: Arc<Draining>,
    /// Ready before any rules are loaded (rules over xDS, with
    /// `--xds-ready-without-rules`: envoyproxy/ratelimit's
    /// FORCE_START_WITHOUT_INITIAL_CONFIG).
    pub ready_without_rules: bool,
}

impl Health {
    /// `Ok(detail)` when ready, `Err(reason)` when not.
    pub fn readiness(&self) -> Result<String, String> {
        if self.draining.began() {
            return Err("draining: shutting down".into());
        }
        let rules = self.rules.load();
        if rules.files().is_empty() && !self.ready_without_rules {
            return Err("no rules loaded".into());
        }
        let store = self.limiter.store();
        let mut detail = format!(
            "rules generation {}, {} domain(s), store {}",
            rules.generation(),
            rules.domains().count(),
            store.name()
        );
        if !store.reachable() {
            detail.push_str(
                ": store not fully reachable, failure modes answer for what it cannot decide",
            );
        }
        let rlqs = self.quota.as_ref().and_then(|q| q.ledger_trouble());
        for w in store.warnings().into_iter().chain(rlqs) {
            detail.push_str("; warning: ");
            detail.push_str(&w);
        }
        Ok(detail)
    }

    /// Keeps the gRPC health service in step with readiness, checking every
    /// second. The first status is set before this returns, so a health
    /// check never meets an unregistered service once the port is open.
    pub async fn start_grpc_sync(self, reporter: tonic_health::server::HealthReporter) {
        let mut last = None;
        self.sync_grpc(&reporter, &mut last).await;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                // a shutdown is told at once (Envoy's health check and
                // Kubernetes withdraw the instance while it still answers)
                if self.draining.began() {
                    tick.tick().await;
                } else {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = self.draining.notified() => {}
                    }
                }
                self.sync_grpc(&reporter, &mut last).await;
            }
        });
    }

    async fn sync_grpc(
        &self,
        reporter: &tonic_health::server::HealthReporter,
        last: &mut Option<bool>,
    ) {
        let ready = self.readiness().is_ok();
        if *last != Some(ready) {
            let status = if ready {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            reporter.set_service_status(SERVICE_NAME, status).await;
            reporter.set_service_status("", status).await;
            if last.is_some() {
                tracing::info!(ready, "readiness changed");
            }
            *last = Some(ready);
        }
    }
}
