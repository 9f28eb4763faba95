//! RLQS over real gRPC streams (the service's own port, memory store): the
//! first assignment, the split when a second Envoy joins, blanket rules,
//! convergence once the first assignment has expired, a refused stream, and
//! the metrics. What Envoy's `rate_limit_quota` filter sends is built here
//! by hand: one stream per (Envoy, domain), the domain in the first message.

mod common;

use std::time::Duration;

use common::{rules_dir, sample, serve_args};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tokio::sync::mpsc;
use tonic::Streaming;

const RULES: &str = r#"
domain: edge
descriptors:
  - key: tenant
    value: acme
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 100, burst: 200}
  - key: tenant
    value: free
    rate_limit: {unit: second, requests_per_unit: 0}
"#;

/// One Envoy's stream: reports go in, assignments come out.
struct Envoy {
    reports: mpsc::UnboundedSender<RateLimitQuotaUsageReports>,
    assignments: Streaming<RateLimitQuotaResponse>,
}

impl Envoy {
    async fn connect(addr: std::net::SocketAddr) -> Self {
        let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
            .await
            .expect("connect");
        let (reports, rx) = mpsc::unbounded_channel();
        let outbound =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        let assignments = client
            .stream_rate_limit_quotas(outbound)
            .await
            .expect("stream opens")
            .into_inner();
        Self {
            reports,
            assignments,
        }
    }

    fn report(&self, domain: &str, bucket: &[(&str, &str)], requests: u64, secs: i64) {
        let usage = BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: bucket
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            }),
            time_elapsed: Some(PbDuration {
                seconds: secs,
                nanos: 0,
            }),
            num_requests_allowed: requests,
            num_requests_denied: 0,
        };
        self.reports
            .send(RateLimitQuotaUsageReports {
                domain: domain.to_string(),
                bucket_quota_usages: vec![usage],
            })
            .expect("stream open");
    }

    /// The next assignment for the bucket with `value` in its id that is
    /// not `skip` (refreshes of an unchanged share come every second on a
    /// slow machine), within 5 s.
    async fn next(&mut self, value: &str, skip: Option<&Strategy>) -> Strategy {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let message = tokio::time::timeout_at(deadline, self.assignments.message())
                .await
                .expect("an assignment within 5 s")
                .expect("no error")
                .expect("stream open");
            for action in &message.bucket_action {
                let ours = action
                    .bucket_id
                    .as_ref()
                    .is_some_and(|id| id.bucket.values().any(|v| v == value));
                let strategy = match &action.bucket_action {
                    Some(BucketAction::QuotaAssignmentAction(a)) => a
                        .rate_limit_strategy
                        .and_then(|s| s.strategy)
                        .expect("a strategy"),
                    other => panic!("not an assignment: {other:?}"),
                };
                if ours && Some(&strategy) != skip {
                    return strategy;
                }
            }
        }
    }
}

/// (max tokens, tokens per second) of a token bucket strategy.
fn bucket(s: &Strategy) -> (u32, f64) {
    match s {
        Strategy::TokenBucket(b) => {
            let fill = b.fill_interval.as_ref().expect("fill interval");
            let secs = fill.seconds as f64 + f64::from(fill.nanos) / 1e9;
            let per_fill = b.tokens_per_fill.as_ref().map_or(1, |v| v.value);
            (
                b.max_tokens,
                (f64::from(per_fill) / secs * 100.0).round() / 100.0,
            )
        }
        other => panic!("not a token bucket: {other:?}"),
    }
}

const ACME: &[(&str, &str)] = &[("api_key", "k1"), ("tenant", "acme")];

#[tokio::test]
async fn two_envoys_split_a_rule_and_converge_on_equal_shares() {
    let rules = rules_dir(RULES);
    let server = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("server starts");
    let mut a = Envoy::connect(server.grpc_addr).await;
    a.report("edge", ACME, 100, 1);
    // alone: all but the 10 % newcomer reserve
    let alone = a.next("acme", None).await;
    assert_eq!(bucket(&alone), (180, 90.0));

    let mut b = Envoy::connect(server.grpc_addr).await;
    b.report("edge", ACME, 100, 1);
    // a shrinks to its half at once; b gets the reserve while a's first
    // assignment may still be enforced
    assert_eq!(bucket(&b.next("acme", None).await), (20, 10.0));
    assert_eq!(bucket(&a.next("acme", Some(&alone)).await), (90, 45.0));

    // a blanket rule for a bucket whose rule allows nothing
    a.report("edge", &[("tenant", "free")], 3, 1);
    assert_eq!(
        a.next("free", None).await,
        Strategy::BlanketRule(BlanketRule::DenyAll as i32)
    );

    // both keep reporting every second (a time to live of 3 s): once a's
    // first assignment has expired, b grows to its half
    let mut last_b = (20, 10.0);
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        a.report("edge", ACME, 100, 1);
        b.report("edge", ACME, 100, 1);
        while let Ok(Some(Ok(Some(m)))) = tokio::time::timeout(Duration::from_millis(50), async {
            Some(b.assignments.message().await)
        })
        .await
        {
            if let Some(BucketAction::QuotaAssignmentAction(q)) = &m.bucket_action[0].bucket_action
            {
                if let Some(s) = q.rate_limit_strategy.and_then(|s| s.strategy) {
                    last_b = bucket(&s);
                }
            }
        }
        if last_b == (90, 45.0) {
            break;
        }
    }
    assert_eq!(last_b, (90, 45.0), "b converged to its half");

    let text = server.metrics.render();
    assert_eq!(sample(&text, "rls_quota_streams"), Some(2.0));
    let reports = sample(&text, "rls_quota_reports_total{domain=\"edge\"}").expect("reports");
    assert!(reports >= 5.0, "{reports}");
    // streams still open: shutdown ends them instead of waiting for them
    tokio::time::timeout(Duration::from_secs(10), server.shutdown())
        .await
        .expect("shutdown does not wait for open RLQS streams")
        .expect("stop");
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = a.assignments.message().await {}
    })
    .await;
    assert!(end.is_ok(), "a's stream ended");
    drop(b);
}

#[tokio::test]
async fn a_stream_whose_first_report_has_no_domain_is_refused() {
    let rules = rules_dir(RULES);
    let server = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("server starts");
    let mut e = Envoy::connect(server.grpc_addr).await;
    e.report("", ACME, 1, 1);
    let status = tokio::time::timeout(Duration::from_secs(5), e.assignments.message())
        .await
        .expect("an answer")
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("domain"), "{status}");
    server.shutdown().await.expect("stop");
}

/// Two instances with `--instances 2`, one Envoy on each, on one bucket
/// (100/s, burst 200): each instance splits half, so the two Envoys
/// together are assigned at most the budget (each 90 % of its half).
#[tokio::test]
async fn two_instances_each_split_half_of_the_budget() {
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.instances = 2;
    let one = tokenbucket_rls::server::start(&args)
        .await
        .expect("first instance");
    let two = tokenbucket_rls::server::start(&args)
        .await
        .expect("second instance");
    let mut a = Envoy::connect(one.grpc_addr).await;
    let mut b = Envoy::connect(two.grpc_addr).await;
    a.report("edge", ACME, 100, 1);
    b.report("edge", ACME, 100, 1);
    let (share_a, share_b) = (
        bucket(&a.next("acme", None).await),
        bucket(&b.next("acme", None).await),
    );
    assert_eq!(share_a, (90, 45.0));
    assert_eq!(share_b, (90, 45.0));
    assert!(share_a.0 + share_b.0 <= 200 && share_a.1 + share_b.1 <= 100.0);
    one.shutdown().await.expect("stop");
    two.shutdown().await.expect("stop");
}
