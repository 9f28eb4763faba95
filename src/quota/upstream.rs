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
//!
//! Over TLS (`https://`), the global tier's certificate is checked against
//! `--quota-upstream-ca-file` for the URL's host (or
//! `--quota-upstream-server-name`), and the region shows its own client
//! certificate, which names it (docs/regions.md). The files are
//! read at each connection, and a connection is made again when they change
//! on disk, so a renewed certificate is used without a restart.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
use tokio::sync::mpsc;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::policy::rule_label;
use super::region::RegionShares;
use crate::rules::SharedRules;

/// gRPC metadata a regional instance opens its streams with: its region's
/// name, and how many regions share the global budgets (`--region`,
/// `--regions`). Streams without them are Envoys'.
pub const REGION_HEADER: &str = "x-rls-region";
pub const REGIONS_HEADER: &str = "x-rls-regions";
use crate::telemetry::Metrics;

/// How often demand is reported (and a lost stream noticed at the latest).
pub const REPORT_INTERVAL: Duration = Duration::from_secs(1);
/// Wait between attempts to reach a global tier that does not answer.
pub const RETRY: Duration = Duration::from_millis(500);

/// `--quota-upstream`, `--region`, `--regions`, and TLS.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    /// `http://host:port` of the global tier's gRPC port, or `https://`.
    pub url: String,
    pub region: String,
    pub regions: u32,
    pub tls: UpstreamTls,
}

/// `--quota-upstream-ca-file`, `-client-cert`/`-client-key`, `-server-name`.
#[derive(Debug, Clone, Default)]
pub struct UpstreamTls {
    pub ca_file: Option<std::path::PathBuf>,
    pub client_cert: Option<(std::path::PathBuf, std::path::PathBuf)>,
    pub server_name: Option<String>,
}

impl UpstreamTls {
    fn given(&self) -> Vec<&'static str> {
        [
            (self.ca_file.is_some(), "--quota-upstream-ca-file"),
            (
                self.client_cert.is_some(),
                "--quota-upstream-client-cert/--quota-upstream-client-key",
            ),
            (self.server_name.is_some(), "--quota-upstream-server-name"),
        ]
        .into_iter()
        .filter_map(|(set, name)| set.then_some(name))
        .collect()
    }

    /// The client's TLS configuration, its files read now.
    fn config(&self) -> anyhow::Result<ClientTlsConfig> {
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &self.ca_file {
            let pem = std::fs::read(ca)
                .map_err(|e| anyhow::anyhow!("--quota-upstream-ca-file {}: {e}", ca.display()))?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        if let Some((cert, key)) = &self.client_cert {
            let read = |p: &std::path::Path| {
                std::fs::read(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
            };
            tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        if let Some(name) = &self.server_name {
            tls = tls.domain_name(name.clone());
        }
        Ok(tls)
    }

    /// The files' contents, hashed: a change means a renewed certificate.
    fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        let files = self
            .ca_file
            .iter()
            .chain(self.client_cert.iter().flat_map(|(c, k)| [c, k]));
        for path in files {
            std::fs::read(path).ok().hash(&mut h);
        }
        h.finish()
    }
}

impl UpstreamSettings {
    /// Checks what can be checked before start: a URL this client can
    /// reach, TLS files only with TLS (and readable), a region name that
    /// fits a gRPC header.
    pub fn validate(&self) -> anyhow::Result<()> {
        let tls = self.url.starts_with("https://");
        if !tls && !self.url.starts_with("http://") {
            anyhow::bail!(
                "--quota-upstream {}: give the global tier's gRPC address as http://HOST:PORT, or https://HOST:PORT for TLS",
                self.url
            );
        }
        let given = self.tls.given();
        if !tls && !given.is_empty() {
            anyhow::bail!(
                "--quota-upstream {}: {} given for a plaintext URL; use https://, or leave them out",
                self.url,
                given.join(", ")
            );
        }
        if tls {
            self.tls.config()?;
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
    let tls = settings.url.starts_with("https://");
    let mut tick = tokio::time::interval(REPORT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // why the last stream was refused: until an assignment comes, the
    // global tier is not counted reachable, whatever its health says
    let mut refused: Option<String> = None;
    // whether "cannot reach" was logged since the tier last answered
    let mut unreachable_logged = false;
    loop {
        let reached = match connect(&settings.url, tls.then_some(&settings.tls)).await {
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

async fn connect(url: &str, tls: Option<&UpstreamTls>) -> anyhow::Result<Channel> {
    let mut endpoint = Endpoint::from_shared(url.to_owned())?;
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls.config()?)?;
    }
    Ok(endpoint
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
    let files = settings.tls.fingerprint();
    loop {
        tick.tick().await;
        if settings.tls.fingerprint() != files {
            return Ended::lost("the TLS files changed on disk: connecting again with them");
        }
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
    let clamped = shares.take_clamped();
    metrics.region_clamped(clamped.burst, clamped.rate, clamped.ttl);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(url: &str, tls: UpstreamTls) -> UpstreamSettings {
        UpstreamSettings {
            url: url.into(),
            region: "eu".into(),
            regions: 2,
            tls,
        }
    }

    /// TLS files with a plaintext URL would be ignored: refused, named; an
    /// https:// URL's files must be readable at start.
    #[test]
    fn tls_settings_need_an_https_url_and_files_that_read() {
        let ca = UpstreamTls {
            ca_file: Some("/no/such/ca.pem".into()),
            ..UpstreamTls::default()
        };
        let e = settings("http://tier:8081", ca.clone())
            .validate()
            .expect_err("plaintext with a CA");
        assert!(e.to_string().contains("--quota-upstream-ca-file"), "{e}");
        let e = settings("https://tier:8081", ca)
            .validate()
            .expect_err("a CA that does not read");
        assert!(e.to_string().contains("/no/such/ca.pem"), "{e}");
        let named = UpstreamTls {
            server_name: Some("tier.example.com".into()),
            ..UpstreamTls::default()
        };
        assert!(settings("http://tier:8081", named.clone())
            .validate()
            .is_err());
        assert!(settings("https://tier:8081", named).validate().is_ok());
        assert!(settings("grpc://tier:8081", UpstreamTls::default())
            .validate()
            .is_err());
        assert!(settings("http://tier:8081", UpstreamTls::default())
            .validate()
            .is_ok());
    }
}
