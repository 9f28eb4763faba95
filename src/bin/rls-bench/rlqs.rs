//! `rls-bench --rlqs`: simulated Envoys on RLQS streams.
//!
//! - `throughput`: `--streams` Envoys, each with `--buckets` buckets
//!   (`{<key>: k<i>}`), sending usage reports as fast as HTTP/2 flow control
//!   lets them for `--duration` (or once per `--report-every`, as Envoy
//!   does). What counts is what the service processed: with `--admin`, its
//!   `rls_quota_reports_total` before and after (waiting at the end until it
//!   stops moving); without, what was sent, said so. Also assignments
//!   received, with a warning when none was a token bucket (no rule for
//!   `--domain`/`--key`). Measure the server's CPU and resident set around
//!   it (`integration/bench-rlqs.sh`).
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
use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
    /// The service's admin address, to count what it processed.
    pub admin: Option<&'a str>,
    pub duration: Duration,
    pub json: bool,
}

pub async fn run(mode: Mode, s: Settings<'_>) -> Result<()> {
    match mode {
        Mode::Throughput => throughput(s).await,
        Mode::Converge => converge(s).await,
    }
}

/// Σ of `rls_quota_reports_total` (bucket reports processed, all domains)
/// on the admin address `admin`.
async fn processed(admin: &str) -> Result<f64> {
    let mut conn = tokio::net::TcpStream::connect(admin)
        .await
        .with_context(|| format!("cannot reach the admin address {admin}"))?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: rls\r\n\r\n")
        .await?;
    let mut text = String::new();
    conn.read_to_string(&mut text).await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("rls_quota_reports_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// Waits until the service's count of processed bucket reports stops
/// moving (unchanged for 2 s, at most 5 minutes): the count then, and when
/// it last moved.
async fn settled(admin: &str) -> Result<(f64, Instant)> {
    let mut last = processed(admin).await?;
    let mut moved = Instant::now();
    let give_up = Instant::now() + Duration::from_secs(300);
    while moved.elapsed() < Duration::from_secs(2) && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = processed(admin).await?;
        if now != last {
            last = now;
            moved = Instant::now();
        }
    }
    Ok((last, moved))
}

async fn throughput(s: Settings<'_>) -> Result<()> {
    let mut envoys = Vec::with_capacity(s.streams);
    for _ in 0..s.streams.max(1) {
        envoys.push(Envoy::open(s.target).await?);
    }
    let before = match s.admin {
        Some(admin) => Some(processed(admin).await?),
        None => None,
    };
    let reports = Arc::new(AtomicU64::new(0));
    let assignments = Arc::new(AtomicU64::new(0));
    let limited = Arc::new(AtomicU64::new(0));
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
        let (reports, assignments, limited) =
            (reports.clone(), assignments.clone(), limited.clone());
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
                if rate_of(&m).is_some() {
                    limited.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.context("a simulated Envoy panicked")?;
    }
    let sent_secs = started.elapsed().as_secs_f64();
    let reports = reports.load(Ordering::Relaxed);
    let sent = reports * s.buckets.max(1) as u64;
    let assignments = assignments.load(Ordering::Relaxed);
    // what the service processed: from its own count, once it settles
    // (the streams closed with the tasks above)
    let (bucket_reports, secs, counted) = match (s.admin, before) {
        (Some(admin), Some(before)) => {
            let (after, last) = settled(admin).await?;
            let secs = last.saturating_duration_since(started).as_secs_f64();
            (
                (after - before).max(0.0) as u64,
                secs.max(sent_secs),
                "processed",
            )
        }
        _ => (
            sent,
            sent_secs,
            "sent (pass --admin to count what the service processed)",
        ),
    };
    if s.json {
        println!(
            "{}",
            serde_json::json!({
                "mode": "rlqs-throughput",
                "streams": s.streams,
                "buckets_per_stream": s.buckets,
                "seconds": secs,
                "counted": if s.admin.is_some() { "processed" } else { "sent" },
                "report_messages_sent": reports,
                "bucket_reports_sent": sent,
                "bucket_reports": bucket_reports,
                "assignments": assignments,
                "bucket_reports_per_sec": bucket_reports as f64 / secs,
            })
        );
    } else {
        println!(
            "RLQS: {} streams x {} buckets, {secs:.1} s: {bucket_reports} bucket reports {counted} ({:.0}/s; {sent} sent in {sent_secs:.1} s), {assignments} assignments received",
            s.streams,
            s.buckets,
            bucket_reports as f64 / secs,
        );
    }
    if limited.load(Ordering::Relaxed) == 0 {
        eprintln!(
            "warning: no assignment was a token bucket: domain {:?} has no limited rule for key {:?}, so this measured buckets without a limit (serve examples/bench/ for domain `bench`)",
            s.domain, s.key
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
    if rate_a == 0.0 && rate_b == 0.0 {
        eprintln!(
            "warning: no assignment was a token bucket: domain {:?} has no limited rule for key {:?} (serve examples/bench/ for domain `bench`)",
            s.domain, s.key
        );
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
