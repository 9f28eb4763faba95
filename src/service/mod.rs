//! The gRPC face: `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
//!
//! Reads the request ([`request`]), takes the current rules snapshot, lets
//! the [`Limiter`] decide, and builds the answer ([`response`]).

pub mod request;
pub mod response;

use std::sync::Arc;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

use crate::limiter::Limiter;
use crate::rules::RuleSet;
pub use response::ResponseOptions;

/// The rules currently in force, swapped whole on reload.
pub type SharedRules = Arc<ArcSwap<RuleSet>>;

pub struct RateLimitGrpc {
    rules: SharedRules,
    limiter: Arc<Limiter>,
    options: ResponseOptions,
}

impl RateLimitGrpc {
    pub fn new(rules: SharedRules, limiter: Arc<Limiter>, options: ResponseOptions) -> Self {
        Self {
            rules,
            limiter,
            options,
        }
    }

    /// The whole decision for one request, without the gRPC wrapping.
    pub async fn should_rate_limit(
        &self,
        request: &RateLimitRequest,
    ) -> Result<RateLimitResponse, Status> {
        tracing::debug!(?request, "ShouldRateLimit");
        let inputs = request::descriptor_inputs(request).map_err(Status::invalid_argument)?;
        let rules = self.rules.load();
        let decisions = self
            .limiter
            .decide(&rules, &request.domain, &inputs)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(response::build(&decisions, self.options))
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimitGrpc {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        RateLimitGrpc::should_rate_limit(self, request.get_ref())
            .await
            .map(Response::new)
    }
}
