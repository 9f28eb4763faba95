//! The second gRPC face: `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`
//! (RLQS), served on the same port as `ShouldRateLimit`.
//!
//! Each Envoy holds one bidirectional stream per domain: it streams usage
//! reports, and the server pushes assignments whenever shares move. The
//! decisions are [`crate::quota::Quotas`]'; this file only carries messages
//! between it and the streams, and re-plans every [`TICK`] so that expired
//! assignments, quiet Envoys and reloads take effect without a report.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use futures::Stream;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use super::SharedRules;
use crate::clock::{Clock, MonotonicClock};
use crate::quota::{Outbox, Quotas, StreamId};
use crate::telemetry::tracing::SPAN_TARGET;
use crate::telemetry::Metrics;

/// How often every bucket is re-planned without a report.
pub const TICK: Duration = Duration::from_secs(1);

type Reply = Result<RateLimitQuotaResponse, Status>;

/// The RLQS state and the open streams' outboxes.
pub struct QuotaHub {
    rules: SharedRules,
    metrics: Arc<Metrics>,
    clock: MonotonicClock,
    quotas: Mutex<Quotas>,
    /// Each open stream's outbox and domain (its metric label, once known).
    streams: Mutex<HashMap<StreamId, (mpsc::UnboundedSender<Reply>, String)>>,
    next_stream: AtomicU64,
    /// Set at shutdown: every stream's reader stops.
    closing: tokio::sync::watch::Sender<bool>,
}

impl QuotaHub {
    /// For one of `instances` instances serving RLQS (`--instances`).
    pub fn new(rules: SharedRules, metrics: Arc<Metrics>, instances: u32) -> Arc<Self> {
        Arc::new(Self {
            rules,
            metrics,
            clock: MonotonicClock::new(),
            quotas: Mutex::new(Quotas::for_instances(instances)),
            streams: Mutex::new(HashMap::new()),
            next_stream: AtomicU64::new(1),
            closing: tokio::sync::watch::channel(false).0,
        })
    }

    /// Re-plans every [`TICK`] for as long as the hub lives.
    pub fn spawn_ticker(self: &Arc<Self>) {
        crate::periodic::spawn_every(self, TICK, |hub| {
            let now = hub.clock.now_micros();
            let rules = hub.rules.load();
            let (out, fractions) = {
                let mut quotas = hub.quotas.lock();
                let out = quotas.tick(&rules, now);
                (out, quotas.assigned_fractions(now))
            };
            hub.send(out);
            hub.metrics.quota_shares(&fractions);
        });
    }

    fn open(&self) -> (StreamId, mpsc::UnboundedReceiver<Reply>) {
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        self.streams.lock().insert(id, (tx, String::new()));
        self.quotas.lock().open(id);
        self.metrics.quota_streams(self.streams.lock().len());
        (id, rx)
    }

    fn report(&self, id: StreamId, reports: &RateLimitQuotaUsageReports) -> Result<(), Status> {
        // one span per report message (exported only with --otlp-endpoint)
        let _span = tracing::info_span!(
            target: SPAN_TARGET,
            "RLQS report",
            stream = id,
            domain = %reports.domain,
            buckets = reports.bucket_quota_usages.len(),
        )
        .entered();
        let rules = self.rules.load();
        let out = self
            .quotas
            .lock()
            .report(
                id,
                &reports.domain,
                &reports.bucket_quota_usages,
                &rules,
                self.clock.now_micros(),
            )
            .map_err(Status::invalid_argument)?;
        let domain = {
            let mut streams = self.streams.lock();
            match streams.get_mut(&id) {
                Some((_, d)) if d.is_empty() => {
                    *d = self.metrics.quota_domain_label(&rules, &reports.domain);
                    d.clone()
                }
                Some((_, d)) => d.clone(),
                None => String::new(),
            }
        };
        self.metrics
            .quota_reports(&domain, reports.bucket_quota_usages.len());
        self.send(out);
        Ok(())
    }

    fn close(&self, id: StreamId) {
        self.streams.lock().remove(&id);
        self.metrics.quota_streams(self.streams.lock().len());
        let out = self
            .quotas
            .lock()
            .close(id, &self.rules.load(), self.clock.now_micros());
        self.send(out);
    }

    fn send(&self, out: Outbox) {
        if out.is_empty() {
            return;
        }
        let streams = self.streams.lock();
        for (id, response) in out {
            tracing::debug!(stream = id, ?response, "RLQS assignment");
            if let Some((tx, domain)) = streams.get(&id) {
                self.metrics
                    .quota_assignments(domain, response.bucket_action.len());
                // a closed receiver: the stream is going; close() follows
                let _ = tx.send(Ok(response));
            }
        }
    }

    /// Ends every stream (the server is shutting down): each Envoy sees its
    /// stream close and reconnects to another instance.
    pub fn close_all(&self) {
        self.closing.send_replace(true);
        self.streams.lock().clear();
    }

    /// Streams open now.
    pub fn streams(&self) -> usize {
        self.streams.lock().len()
    }
}

/// The gRPC service.
pub struct RateLimitQuotaGrpc {
    hub: Arc<QuotaHub>,
}

impl RateLimitQuotaGrpc {
    pub fn new(hub: Arc<QuotaHub>) -> Self {
        Self { hub }
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for RateLimitQuotaGrpc {
    type StreamRateLimitQuotasStream = Pin<Box<dyn Stream<Item = Reply> + Send>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let mut inbound = request.into_inner();
        let (id, mut outbound) = self.hub.open();
        let hub = self.hub.clone();
        let mut closing = hub.closing.subscribe();
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    next = inbound.message() => next,
                    // shutting down: dropping the request ends the call
                    _ = closing.wait_for(|c| *c) => break,
                };
                match next {
                    Ok(Some(reports)) => {
                        if let Err(status) = hub.report(id, &reports) {
                            tracing::debug!(stream = id, %status, "RLQS stream refused");
                            if let Some((tx, _)) = hub.streams.lock().get(&id) {
                                let _ = tx.send(Err(status));
                            }
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(stream = id, %status, "RLQS stream ended");
                        break;
                    }
                }
            }
            hub.close(id);
        });
        let replies = futures::stream::poll_fn(move |cx| outbound.poll_recv(cx));
        Ok(Response::new(Box::pin(replies)))
    }
}
