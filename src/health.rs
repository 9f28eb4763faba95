//! Readiness: whether this instance can answer correctly right now.
//!
//! Ready when rules are loaded and either the store is reachable or every
//! rule has a failure mode that can answer without it (`open` or `local`).
//! The same verdict feeds `/readyz` and the gRPC health service
//! (`grpc.health.v1`, service `ratelimit` and the empty name).

use std::sync::Arc;
use std::time::Duration;

use crate::limiter::Limiter;
use crate::rules::FailureMode;
use crate::service::SharedRules;

/// The gRPC health service name Envoy and Kubernetes probes ask about.
pub const SERVICE_NAME: &str = "ratelimit";

#[derive(Clone)]
pub struct Health {
    pub rules: SharedRules,
    pub limiter: Arc<Limiter>,
}

impl Health {
    /// `Ok(detail)` when ready, `Err(reason)` when not.
    pub fn readiness(&self) -> Result<String, String> {
        let rules = self.rules.load();
        if rules.files().is_empty() {
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
            let default = self.limiter.default_failure_mode();
            let closed = rules
                .domains()
                .flat_map(|d| rules.rules(&d.name))
                .any(|r| r.failure_mode.unwrap_or(default) == FailureMode::Closed);
            if closed {
                return Err(format!(
                    "{detail}: store unreachable and some rules fail closed"
                ));
            }
            detail.push_str(": store unreachable, failure policies answer");
        }
        for w in store.warnings() {
            detail.push_str("; warning: ");
            detail.push_str(&w);
        }
        Ok(detail)
    }

    /// Keeps the gRPC health service in step with readiness, checking every second.
    pub fn spawn_grpc_sync(self, reporter: tonic_health::server::HealthReporter) {
        tokio::spawn(async move {
            let mut last = None;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let ready = self.readiness().is_ok();
                if last != Some(ready) {
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
                    last = Some(ready);
                }
            }
        });
    }
}
