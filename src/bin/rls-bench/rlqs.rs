//! `rls-bench --rlqs`: simulated Envoys on RLQS streams.
//!
//! - `throughput`: `--streams` Envoys, each with `--buckets` buckets
//!   (`{<key>: k<i>}`), sending usage reports as fast as the server takes
//!   them for `--duration` (or once per `--report-every`, as Envoy does):
//!   report messages and bucket reports per second, and assignments
//!   received. Measure the server's CPU and resident set around it
//!   (`integration/bench-rlqs.sh`).
//! - `converge`: two Envoys on one bucket reporting every second, demand
//!   900:100 requests/s, then swapped: the seconds from the swap until the
//!   shares follow (the formerly quiet Envoy's rate above the other's).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tokio::sync::mpsc;
use tonic::Streaming;

#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
pub enum Mode {
    Throughput,
    Converge,
}

/// One simulated Envoy's stream.
struct Envoy {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    assignments: Streaming<RateLimitQuotaResponse>,
}

impl Envoy {
    async fn open(target: &str) -> Result<Self> {
        let mut client = RateLimitQuotaServiceClient::connect(target.to_string())
            .await
            .with_context(|| format!("cannot connect to {target}"))?;
        let (reports, rx) = mpsc::channel(4);
        let outbound =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        let assignments = client
            .stream_rate_limit_quotas(outbound)
            .await
            .context("the service refused the RLQS stream")?
            .into_inner();
        Ok(Self {
            reports,
            assignments,
        })
    }
}

fn usage(key: &str, value: &str, requests: u64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: [(key.to_string(), value.to_string())].into(),
        }),
        time_elapsed: Some(PbDuration {
            seconds: 1,
            nanos: 0,
        }),
        num_requests_allowed: requests,
        num_requests_denied: 0,
    }
}

pub struct Settings<'a> {
    pub target: &'a str,
    pub domain: &'a str,
    pub key: &'a str,
    pub streams: usize,
    pub buckets: usize,
    /// `None`: as fast as the service takes reports.
    pub report_every: Option<Duration>,
    /// Each stream its own buckets, else the same for all.
    pub distinct: bool,
    pub duration: Duration,
    pub json: bool,
}

pub async fn run(mode: Mode, s: Settings<'_>) -> Result<()> {
    match mode {
        Mode::Throughput => throughput(s).await,
        Mode::Converge => converge(s).await,
    }
}

async fn throughput(s: Settings<'_>) -> Result<()> {
    let mut envoys = Vec::with_capacity(s.streams);
    for _ in 0..s.streams.max(1) {
        envoys.push(Envoy::open(s.target).await?);
    }
    let reports = Arc::new(AtomicU64::new(0));
    let assignments = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + s.duration;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (n, envoy) in envoys.into_iter().enumerate() {
        let usages: Vec<BucketQuotaUsage> = (0..s.buckets.max(1))
            .map(|i| {
                let value = if s.distinct {
                    format!("s{n}-k{i}")
                } else {
                    format!("k{i}")
                };
                usage(s.key, &value, 10 + (n as u64 % 7))
            })
            .collect();
        let domain = s.domain.to_string();
        let (reports, assignments) = (reports.clone(), assignments.clone());
        let report_every = s.report_every;
        let Envoy {
            reports: tx,
            assignments: mut rx,
        } = envoy;
        tasks.push(tokio::spawn(async move {
            let until = tokio::time::Instant::from_std(deadline);
            while Instant::now() < deadline {
                let message = RateLimitQuotaUsageReports {
                    domain: domain.clone(),
                    bucket_quota_usages: usages.clone(),
                };
                // bounded: a server that stops taking reports ends the run
                match tokio::time::timeout_at(until, tx.send(message)).await {
                    Ok(Ok(())) => reports.fetch_add(1, Ordering::Relaxed),
                    _ => break,
                };
                if let Some(every) = report_every {
                    let _ = tokio::time::timeout_at(until, tokio::time::sleep(every)).await;
                }
            }
        }));
        tasks.push(tokio::spawn(async move {
            let until = tokio::time::Instant::from_std(deadline);
            while let Ok(Ok(Some(m))) = tokio::time::timeout_at(until, rx.message()).await {
                assignments.fetch_add(m.bucket_action.len() as u64, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.context("a simulated Envoy panicked")?;
    }
    let secs = started.elapsed().as_secs_f64();
    let reports = reports.load(Ordering::Relaxed);
    let bucket_reports = reports * s.buckets.max(1) as u64;
    let assignments = assignments.load(Ordering::Relaxed);
    if s.json {
        println!(
            "{}",
            serde_json::json!({
                "mode": "rlqs-throughput",
                "streams": s.streams,
                "buckets_per_stream": s.buckets,
                "seconds": secs,
                "reports": reports,
                "bucket_reports": bucket_reports,
                "assignments": assignments,
                "reports_per_sec": reports as f64 / secs,
                "bucket_reports_per_sec": bucket_reports as f64 / secs,
            })
        );
    } else {
        println!(
            "RLQS: {} streams x {} buckets, {secs:.1} s: {reports} reports ({:.0}/s), {bucket_reports} bucket reports ({:.0}/s), {assignments} assignments received",
            s.streams,
            s.buckets,
            reports as f64 / secs,
            bucket_reports as f64 / secs
        );
    }
    Ok(())
}

/// The rate (tokens per second) of a token-bucket assignment in `m`.
fn rate_of(m: &RateLimitQuotaResponse) -> Option<f64> {
    m.bucket_action.iter().find_map(|a| match &a.bucket_action {
        Some(BucketAction::QuotaAssignmentAction(q)) => match q.rate_limit_strategy?.strategy? {
            Strategy::TokenBucket(b) => {
                let fill = b.fill_interval?;
                let secs = fill.seconds as f64 + f64::from(fill.nanos) / 1e9;
                Some(f64::from(b.tokens_per_fill.map_or(1, |v| v.value)) / secs)
            }
            _ => None,
        },
        _ => None,
    })
}

async fn converge(s: Settings<'_>) -> Result<()> {
    let (mut a, mut b) = (Envoy::open(s.target).await?, Envoy::open(s.target).await?);
    let report = |e: &Envoy, requests: u64| {
        let message = RateLimitQuotaUsageReports {
            domain: s.domain.to_string(),
            bucket_quota_usages: vec![usage(s.key, "converge", requests)],
        };
        let tx = e.reports.clone();
        async move { tx.send(message).await.is_ok() }
    };
    let (mut rate_a, mut rate_b) = (0.0, 0.0);
    // a second of reports, then whatever arrived
    async fn drain(e: &mut Envoy, rate: &mut f64) {
        while let Ok(Ok(Some(m))) =
            tokio::time::timeout(Duration::from_millis(20), e.assignments.message()).await
        {
            if let Some(r) = rate_of(&m) {
                *rate = r;
            }
        }
    }
    // settle on 900:100
    for _ in 0..10 {
        report(&a, 900).await;
        report(&b, 100).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        drain(&mut a, &mut rate_a).await;
        drain(&mut b, &mut rate_b).await;
    }
    if rate_a <= rate_b {
        bail!("shares did not follow the first demand: a {rate_a}/s, b {rate_b}/s (is there a limited rule for {}={} in domain {}?)", s.key, "converge", s.domain);
    }
    let before = (rate_a, rate_b);
    let shifted = Instant::now();
    let limit = shifted + s.duration.max(Duration::from_secs(60));
    while Instant::now() < limit {
        report(&a, 100).await;
        report(&b, 900).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        drain(&mut a, &mut rate_a).await;
        drain(&mut b, &mut rate_b).await;
        if rate_b > rate_a {
            let secs = shifted.elapsed().as_secs_f64();
            if s.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "mode": "rlqs-converge",
                        "seconds_to_follow": secs,
                        "before": {"a": before.0, "b": before.1},
                        "after": {"a": rate_a, "b": rate_b},
                    })
                );
            } else {
                println!(
                    "RLQS: demand 900:100 swapped; shares followed in {secs:.1} s (reports every 1 s): a {:.0} -> {rate_a:.0}/s, b {:.0} -> {rate_b:.0}/s",
                    before.0, before.1
                );
            }
            return Ok(());
        }
    }
    bail!("shares did not follow within {:?}", limit - shifted)
}
