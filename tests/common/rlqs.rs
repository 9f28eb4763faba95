//! RLQS streams, as an Envoy opens them.

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};

/// Opens an RLQS stream to `target` and sends one report for the bucket
/// `{user: value}` of domain `d`; the stream stays open while the sender lives.
pub async fn report(
    target: &str,
    value: &str,
    requests: u64,
) -> (
    tokio::sync::mpsc::UnboundedSender<RateLimitQuotaUsageReports>,
    tonic::Streaming<envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse>,
) {
    let mut quota = RateLimitQuotaServiceClient::connect(target.to_string())
        .await
        .expect("connect");
    let (keep_open, rx) = tokio::sync::mpsc::unbounded_channel();
    keep_open
        .send(RateLimitQuotaUsageReports {
            domain: "d".into(),
            bucket_quota_usages: vec![BucketQuotaUsage {
                bucket_id: Some(BucketId {
                    bucket: [("user".to_string(), value.to_string())].into(),
                }),
                time_elapsed: Some(envoy_types::pb::google::protobuf::Duration {
                    seconds: 1,
                    nanos: 0,
                }),
                num_requests_allowed: requests,
                num_requests_denied: 0,
            }],
        })
        .expect("queued");
    let outbound =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let assignments = quota
        .stream_rate_limit_quotas(outbound)
        .await
        .expect("stream")
        .into_inner();
    (keep_open, assignments)
}
