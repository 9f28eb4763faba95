//! A region's client of the global tier (`--quota-upstream`): one RLQS
//! stream per domain with global rules, opened with the region's name
//! ([`crate::service::quota::REGION_HEADER`]), reporting the region's
//! demand every interval and handing the shares it is assigned to
//! [`RegionShares`].
//!
//! Decisions never wait for it. While the stream is down the region keeps
//! its live shares until they expire, then each rule's `failure_mode`
//! applies ([`super::region`]). The connection sends HTTP/2 pings every
//! second and gives up after two without an answer, so a global tier that
//! hangs (a frozen process, a link that drops packets) counts as cut off,
//! as one that refuses connections does; it is made again at once, then
//! every [`RETRY`] until it answers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

use super::policy::rule_label;
use super::region::RegionShares;
use crate::service::quota::{REGIONS_HEADER, REGION_HEADER};
use crate::service::SharedRules;
use crate::telemetry::Metrics;

/// How often demand is reported (and a lost stream noticed at the latest).
pub const REPORT_INTERVAL: Duration = Duration::from_secs(1);
/// Wait between attempts to reach a global tier that does not answer.
pub const RETRY: Duration = Duration::from_millis(500);

/// `--quota-upstream`, `--region`, `--regions`.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    /// `http://host:port` of the global tier's gRPC port.
    pub url: String,
    pub region: String,
    pub regions: u32,
}

impl UpstreamSettings {
    /// Checks what can be checked before start: a URL this client can
    /// reach, a region name that fits a gRPC header.
    pub fn validate(&self) -> anyhow::Result<()> {
        if !self.url.starts_with("http://") {
            anyhow::bail!(
                "--quota-upstream {}: give the global tier's gRPC address as http://HOST:PORT (TLS to the global tier is not supported yet)",
                self.url
            );
        }
        Endpoint::from_shared(self.url.clone())
            .map_err(|e| anyhow::anyhow!("--quota-upstream {}: {e}", self.url))?;
        if self.region.is_empty()
            || tonic::metadata::MetadataValue::<tonic::metadata::Ascii>::try_from(
                self.region.as_str(),
            )
            .is_err()
        {
            anyhow::bail!(
                "--region '{}': give the region a name of visible ASCII characters (it is sent to the global tier in the {REGION_HEADER} header)",
                self.region
            );
        }
        Ok(())
    }
}

/// Reports and takes assignments for as long as the process runs.
pub async fn run(
    settings: UpstreamSettings,
    shares: Arc<RegionShares>,
    rules: SharedRules,
    metrics: Arc<Metrics>,
) {
    tracing::info!(upstream = %settings.url, region = %settings.region, regions = settings.regions, "global budgets from the global tier");
    let mut tick = tokio::time::interval(REPORT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // why the last stream was refused: until an assignment comes, the
    // global tier is not counted reachable, whatever its health says
    let mut refused: Option<String> = None;
    // whether "cannot reach" was logged since the tier last answered
    let mut unreachable_logged = false;
    loop {
        let reached = match connect(&settings.url).await {
            Ok(channel) => answers(&channel).await.map(|()| channel),
            Err(e) => Err(e),
        };
        let channel = match reached {
            Ok(channel) => channel,
            Err(e) => {
                shares.set_reachable(false);
                publish(&shares, &rules, &metrics);
                if !unreachable_logged {
                    tracing::warn!(upstream = %settings.url, error = %e, "cannot reach the global tier (--quota-upstream); global rules use live shares until they expire, then their failure_mode; trying again every 500 ms");
                    unreachable_logged = true;
                }
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        unreachable_logged = false;
        if refused.is_none() {
            shares.set_reachable(true);
            tracing::info!(upstream = %settings.url, "connected to the global tier");
        }
        let ended = serve(&settings, channel, &shares, &rules, &metrics, &mut tick).await;
        shares.set_reachable(false);
        publish(&shares, &rules, &metrics);
        if ended.refused {
            if refused.as_deref() != Some(ended.why.as_str()) {
                tracing::error!(upstream = %settings.url, error = %ended.why, "the global tier refused this region's stream; global rules use live shares until they expire, then their failure_mode");
            }
            refused = Some(ended.why);
        } else {
            refused = None;
            tracing::warn!(upstream = %settings.url, error = %ended.why, "lost the global tier; live shares are kept until they expire, then each global rule's failure_mode applies");
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// Why a connection's streams ended, and whether the global tier refused
/// this region (a status it answers on purpose, not a lost link).
struct Ended {
    why: String,
    refused: bool,
}

impl Ended {
    fn lost(why: impl Into<String>) -> Self {
        Self {
            why: why.into(),
            refused: false,
        }
    }
}

/// Whether `status` is the global tier refusing the stream.
fn is_refusal(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::FailedPrecondition
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated
            | tonic::Code::InvalidArgument
    )
}

/// Whether the global tier answers on `channel` (its gRPC health check,
/// within a second): a connection alone is not an answer (a proxy or a
/// hung process accepts one).
async fn answers(channel: &Channel) -> anyhow::Result<()> {
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    tokio::time::timeout(
        Duration::from_secs(1),
        health.check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        }),
    )
    .await
    .map_err(|_| anyhow::anyhow!("no answer to a health check within 1s"))??;
    Ok(())
}

async fn connect(url: &str) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(1))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(2))
        .keep_alive_while_idle(true)
        .connect()
        .await?)
}

/// One domain's stream: its reports' queue, and whether it has ended.
struct DomainStream {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    ended: tokio::sync::oneshot::Receiver<Ended>,
}

/// Reports every tick on `channel` until a stream fails; returns why.
async fn serve(
    settings: &UpstreamSettings,
    channel: Channel,
    shares: &Arc<RegionShares>,
    rules: &SharedRules,
    metrics: &Arc<Metrics>,
    tick: &mut tokio::time::Interval,
) -> Ended {
    let client = RateLimitQuotaServiceClient::new(channel.clone());
    let mut streams: HashMap<String, DomainStream> = HashMap::new();
    loop {
        tick.tick().await;
        for (domain, s) in &mut streams {
            if let Ok(ended) = s.ended.try_recv() {
                return Ended {
                    why: format!("the stream for domain {domain} ended: {}", ended.why),
                    refused: ended.refused,
                };
            }
        }
        if streams.is_empty() {
            // nothing reported yet: still answering?
            if let Err(e) = answers(&channel).await {
                return Ended::lost(e.to_string());
            }
        }
        let reports = shares.take_reports(shares.now_micros());
        for (domain, usages) in reports {
            let stream = match streams.get(&domain) {
                Some(s) => s,
                None => match open(settings, client.clone(), &domain, shares, metrics).await {
                    Ok(s) => streams.entry(domain.clone()).or_insert(s),
                    Err(e) => {
                        return Ended {
                            refused: e.downcast_ref::<tonic::Status>().is_some_and(is_refusal),
                            why: format!("cannot open a stream for domain {domain}: {e}"),
                        }
                    }
                },
            };
            let n = usages.len();
            let message = RateLimitQuotaUsageReports {
                domain: domain.clone(),
                bucket_quota_usages: usages,
            };
            if stream.reports.send(message).await.is_err() {
                return Ended::lost(format!("the stream for domain {domain} closed"));
            }
            metrics.region_reports(n);
        }
        publish(shares, rules, metrics);
    }
}

/// Opens `domain`'s stream; its answers go to `shares` as they come.
async fn open(
    settings: &UpstreamSettings,
    mut client: RateLimitQuotaServiceClient<Channel>,
    domain: &str,
    shares: &Arc<RegionShares>,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<DomainStream> {
    let (tx, rx) = mpsc::channel::<RateLimitQuotaUsageReports>(4);
    let mut rx = rx;
    let mut request = tonic::Request::new(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    request
        .metadata_mut()
        .insert(REGION_HEADER, settings.region.parse()?);
    request
        .metadata_mut()
        .insert(REGIONS_HEADER, settings.regions.to_string().parse()?);
    let mut answers = client.stream_rate_limit_quotas(request).await?.into_inner();
    let (ended_tx, ended) = tokio::sync::oneshot::channel();
    let shares = shares.clone();
    let metrics = metrics.clone();
    let domain = domain.to_owned();
    tokio::spawn(async move {
        let why = loop {
            match answers.message().await {
                Ok(Some(answer)) => {
                    let now = shares.now_micros();
                    let taken = shares.apply(&domain, &answer.bucket_action, now);
                    metrics.region_assignments(taken);
                }
                Ok(None) => break Ended::lost("closed by the global tier"),
                Err(status) => {
                    break Ended {
                        refused: is_refusal(&status),
                        why: status.to_string(),
                    }
                }
            }
        };
        let _ = ended_tx.send(why);
    });
    Ok(DomainStream { reports: tx, ended })
}

/// The region's gauges.
fn publish(shares: &RegionShares, rules: &SharedRules, metrics: &Metrics) {
    let now = shares.now_micros();
    metrics.region_state(
        shares.reachable(),
        shares.since_last_assignment(now).map(|m| m as f64 / 1e6),
        shares.len(),
    );
    metrics.region_fallback("over_bound", shares.take_over_bound());
    metrics.region_clamped(shares.take_clamped());
    let rules = rules.load();
    let totals = shares.totals(
        |domain, id| {
            let pairs: Vec<(String, String)> = id
                .bucket
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            rule_label(&rules, domain, &pairs)
        },
        now,
    );
    metrics.region_shares(&totals);
}
