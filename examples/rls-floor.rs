//! The floor for CPU per decision: a `ShouldRateLimit` server built from the
//! same dependencies as the service (tonic, envoy-types, tokio's default
//! runtime) that answers OK without looking at the request. What the gRPC
//! stack costs per call; `integration/bench-cpu.sh` measures the service
//! against it.
//!
//!   cargo run --release --example rls-floor -- [ADDR]   (default 127.0.0.1:18581)

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

struct Floor;

#[tonic::async_trait]
impl RateLimitService for Floor {
    async fn should_rate_limit(
        &self,
        _request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            ..RateLimitResponse::default()
        }))
    }
}

fn main() -> anyhow::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18581".to_string())
        .parse()?;
    tokio::runtime::Runtime::new()?.block_on(async move {
        tonic::transport::Server::builder()
            .add_service(RateLimitServiceServer::new(Floor))
            .serve(addr)
            .await
    })?;
    Ok(())
}
