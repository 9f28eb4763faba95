//! RLQS's metrics: streams, reports, assignments, what was dropped, the
//! thread's busy time, the outbox's bytes.

use prometheus::{IntCounterVec, IntGauge, Opts};

/// RLQS: streams, reports and assignments.
pub(super) struct QuotaMetrics {
    pub(super) streams: IntGauge,
    pub(super) share: prometheus::GaugeVec,
    /// The (domain, rule) series `share` has now.
    pub(super) share_series: parking_lot::Mutex<Vec<(String, String)>>,
    pub(super) reports: IntCounterVec,
    pub(super) assignments: IntCounterVec,
    pub(super) dropped: IntCounterVec,
    pub(super) busy: prometheus::CounterVec,
    pub(super) outbox_bytes: IntGauge,
    pub(super) without_ledger: IntCounterVec,
    pub(super) buckets_without_ledger: IntGauge,
}

impl QuotaMetrics {
    pub(super) fn new() -> Self {
        let by_domain = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["domain"]).expect("valid metric")
        };
        let dropped = IntCounterVec::new(
            Opts::new(
                "rls_quota_dropped_total",
                "RLQS: bucket reports not taken (invalid: no or an empty bucket_id; bucket_limit: over the buckets one stream or the instance may hold), streams refused (stream_limit: too many open), and assignments not written (outbox_full: past a stream's or all streams' outbox bound; expired_waiting: its time to live passed while its Envoy did not read)",
            ),
            &["reason"],
        )
        .expect("valid metric");
        for reason in [
            "invalid",
            "bucket_limit",
            "outbox_full",
            "expired_waiting",
            "stream_limit",
        ] {
            dropped.with_label_values(&[reason]);
        }
        Self {
            streams: IntGauge::new(
                "rls_quota_streams",
                "RLQS streams open now (one per Envoy and domain)",
            )
            .expect("valid metric"),
            share: prometheus::GaugeVec::new(
                Opts::new(
                    "rls_quota_share",
                    "RLQS: the largest fraction of one of the rule's buckets that live assignments may enforce (at most 1): of the whole budget with the Redis store (all replicas' Envoys, as the last ledger step saw it), else of this instance's part (1/--instances)",
                ),
                &["domain", "rule"],
            )
            .expect("valid metric"),
            share_series: parking_lot::Mutex::default(),
            reports: by_domain(
                "rls_quota_reports_total",
                "RLQS bucket usage reports received",
            ),
            assignments: by_domain(
                "rls_quota_assignments_total",
                "RLQS bucket assignments sent (new shares, refreshes, blanket rules)",
            ),
            dropped,
            without_ledger: by_domain(
                "rls_quota_assignments_without_ledger_total",
                "RLQS with the Redis store: assignments sent while the bucket's shared-ledger steps failed (this replica's last confirmed share, then the budget divided by the replicas known)",
            ),
            buckets_without_ledger: IntGauge::new(
                "rls_quota_buckets_without_ledger",
                "RLQS with the Redis store: buckets this replica assigns without the shared ledger now (their steps fail)",
            )
            .expect("valid metric"),
            outbox_bytes: IntGauge::new(
                "rls_quota_outbox_bytes",
                "RLQS: bytes of assignments waiting for their Envoys to read them, all streams together",
            )
            .expect("valid metric"),
            busy: {
                let busy = prometheus::CounterVec::new(
                    Opts::new(
                        "rls_quota_busy_seconds_total",
                        "RLQS: seconds the rls-quota thread spent on the state (work: report, tick), not counting the sending of messages",
                    ),
                    &["work"],
                )
                .expect("valid metric");
                for work in ["report", "tick"] {
                    busy.with_label_values(&[work]);
                }
                busy
            },
        }
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.busy.clone()),
            Box::new(self.streams.clone()),
            Box::new(self.share.clone()),
            Box::new(self.reports.clone()),
            Box::new(self.dropped.clone()),
            Box::new(self.outbox_bytes.clone()),
            Box::new(self.assignments.clone()),
            Box::new(self.without_ledger.clone()),
            Box::new(self.buckets_without_ledger.clone()),
        ]
    }
}
