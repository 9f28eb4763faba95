//! The gRPC face: `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
//!
//! Reads the request ([`request`]), takes the current rules snapshot, lets
//! the [`Limiter`] decide, and builds the answer ([`response`]).
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `serving`; uses `limiter` (and its `decision`), `quota`, `rules`,
//! `telemetry`, `tls` and leaves.

pub mod body;
pub mod ledger_watch;
pub mod mailbox;
pub mod quota;
pub mod refusal_log;
pub mod request;
pub mod response;
pub mod unknown_domains;
pub mod wire;

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::limiter::{Limiter, Verdict};
use crate::rules::{DescriptorEntry, SharedRules};
use crate::telemetry::tracing::{remote_context, SPAN_TARGET};
use crate::telemetry::Metrics;
pub use response::{LegacyHeaderNames, ResponseOptions};

pub struct RateLimitGrpc {
    rules: SharedRules,
    limiter: Arc<Limiter>,
    metrics: Arc<Metrics>,
    options: ResponseOptions,
    /// Domains asked about that no rule has, said once each.
    unknown_domains: unknown_domains::UnknownDomains,
    /// A line per refused request, at most `--refusal-log-rate` a second.
    refusals: refusal_log::RefusalLog,
}

impl RateLimitGrpc {
    pub fn new(
        rules: SharedRules,
        limiter: Arc<Limiter>,
        metrics: Arc<Metrics>,
        options: ResponseOptions,
    ) -> Self {
        Self {
            rules,
            limiter,
            metrics,
            options,
            unknown_domains: Default::default(),
            refusals: Default::default(),
        }
    }

    /// Logs at most `per_sec` refused requests a second (0: none), values
    /// shown as `shown` says.
    pub fn with_refusal_log(mut self, per_sec: u32, shown: crate::shown::ShownValues) -> Self {
        self.refusals = refusal_log::RefusalLog::new(per_sec).showing(shown);
        self
    }

    /// The whole decision for one request, without the gRPC wrapping.
    pub async fn should_rate_limit(
        &self,
        request: &RateLimitRequest,
        deadline: Option<Duration>,
    ) -> Result<RateLimitResponse, Status> {
        // when Envoy gives up and answers by its failure mode (a little
        // after it, counted from here rather than from arrival)
        let due = deadline.map(|d| Instant::now() + d);
        tracing::debug!(?request, "ShouldRateLimit");
        let inputs = request::descriptor_inputs(request).map_err(Status::invalid_argument)?;
        let rules = self.rules.load();
        let decisions = self
            .limiter
            .decide_request(
                &rules,
                &request.domain,
                &inputs,
                deadline.map(store_budget),
                due,
            )
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        // only a call no rule decided looks at its domain: every other
        // call's domain has rules
        if decisions.iter().all(|d| d.verdict == Verdict::NoRule)
            && !rules.has_domain(&request.domain)
        {
            self.unknown_domains.log(&request.domain);
        }
        let entries: Vec<_> = inputs.iter().map(|i| i.entries).collect();
        self.metrics
            .record_decisions(&rules, &request.domain, &entries, &decisions);
        if let Some(stats) = self.metrics.ratelimit_stats() {
            stats.record(&request.domain, &decisions, inputs.iter().map(|i| i.cost));
        }
        let answer = response::build(request, &decisions, &self.options);
        if self.options.shadow_mode && decisions.iter().any(|d| d.verdict.is_over_limit()) {
            self.metrics.global_shadow_answer();
        }
        if answer.overall_code == Code::OverLimit as i32 {
            self.log_refusal(request, &entries, &decisions, &answer);
        }
        Ok(answer)
    }

    /// One line for a refused request, when this second's lines are not
    /// spent: the refusing limits, their descriptors, what was left and
    /// the wait.
    fn log_refusal<E: DescriptorEntry>(
        &self,
        request: &RateLimitRequest,
        entries: &[&[E]],
        decisions: &[crate::limiter::Decision],
        answer: &RateLimitResponse,
    ) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let Some(held_back) = self.refusals.admit(now) else {
            return;
        };
        let descriptors: Vec<String> = decisions
            .iter()
            .zip(entries)
            .filter(|(d, _)| d.verdict.is_over_limit())
            .map(|(d, e)| {
                let pairs: Vec<String> = e
                    .iter()
                    .map(|e| self.refusals.show(e.key(), e.value()))
                    .collect();
                format!("{} (remaining {})", pairs.join(","), d.remaining)
            })
            .collect();
        let retry_after = answer
            .response_headers_to_add
            .iter()
            .find(|h| h.key == "retry-after")
            .map(|h| h.value.as_str())
            .unwrap_or("none");
        tracing::info!(
            domain = %crate::shown::escaped(&request.domain),
            refused_by = %response::refused_by(decisions).join(", "),
            descriptors = %descriptors.join("; "),
            retry_after,
            held_back,
            "refused"
        );
    }
}

/// The part of a caller's deadline (`grpc-timeout`, which Envoy sets to its
/// filter `timeout`) the store may use: 90 %, leaving the rest to answer by
/// the rule's failure mode before the caller gives up.
pub fn store_budget(deadline: Duration) -> Duration {
    deadline.saturating_sub(deadline / 10)
}

#[tonic::async_trait]
impl RateLimitService for RateLimitGrpc {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let started = Instant::now();
        let req = request.get_ref();
        let span = tracing::info_span!(
            target: SPAN_TARGET,
            "ShouldRateLimit",
            domain = %req.domain,
            descriptors = req.descriptors.len(),
            overall_code = tracing::field::Empty,
        );
        if !span.is_disabled() {
            // Continue Envoy's trace when it sent one.
            let _ = span.set_parent(remote_context(request.metadata()));
        }
        let deadline = request::grpc_timeout(request.metadata());
        let result = RateLimitGrpc::should_rate_limit(self, req, deadline)
            .instrument(span.clone())
            .await;
        if !span.is_disabled() {
            let code = match &result {
                Ok(r) if r.overall_code == 2 => "OVER_LIMIT",
                Ok(_) => "OK",
                Err(_) => "ERROR",
            };
            span.record("overall_code", code);
        }
        let seconds = started.elapsed().as_secs_f64();
        self.metrics.observe_call(seconds);
        if let Some(stats) = self.metrics.ratelimit_stats() {
            let error = result.as_ref().err().map(Status::code);
            stats.call("ShouldRateLimit", seconds, error);
        }
        result.map(Response::new)
    }
}
