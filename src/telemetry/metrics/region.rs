//! A region's metrics: its shares of global budgets, reports and
//! assignments, reachability, what decided without a share, what was cut
//! to range, and streams the global tier refused.

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts};

/// A region's side of global budgets ([`crate::quota::region`]).
pub(super) struct RegionMetrics {
    pub(super) share: prometheus::GaugeVec,
    pub(super) share_series: parking_lot::Mutex<Vec<(String, String, &'static str)>>,
    pub(super) reports: IntCounter,
    pub(super) assignments: IntCounter,
    pub(super) since_assignment: prometheus::Gauge,
    pub(super) reachable: IntGauge,
    pub(super) fallback: IntCounterVec,
    pub(super) buckets: IntGauge,
    pub(super) clamped: IntCounterVec,
    pub(super) refused: IntCounterVec,
}

impl RegionMetrics {
    pub(super) fn new() -> Self {
        let fallback = IntCounterVec::new(
            Opts::new(
                "rls_region_fallback_total",
                "Decisions of global rules made without a live share from the global tier, by what decided: floor (B/N while the global tier is reachable, or failing local), closed (UNAVAILABLE), open (no limit), over_bound (past the buckets a region holds)",
            ),
            &["mode"],
        )
        .expect("valid metric");
        for mode in ["floor", "closed", "open", "over_bound"] {
            fallback.with_label_values(&[mode]);
        }
        let clamped = IntCounterVec::new(
            Opts::new(
                "rls_region_assignments_clamped_total",
                "Assignments from the global tier out of range, cut to what this region's rules allow: part=burst, rate (above the rule's own) or ttl (longer than any the global tier sends)",
            ),
            &["part"],
        )
        .expect("valid metric");
        for part in ["burst", "rate", "ttl"] {
            clamped.with_label_values(&[part]);
        }
        let refused = IntCounterVec::new(
            Opts::new(
                "rls_region_streams_refused_total",
                "Region streams this global tier refused, by why: certificate (its client certificate names no such region), count (another --regions), instances (this global tier has --instances above 1)",
            ),
            &["reason"],
        )
        .expect("valid metric");
        for reason in ["certificate", "count", "instances"] {
            refused.with_label_values(&[reason]);
        }
        Self {
            share: prometheus::GaugeVec::new(
                Opts::new(
                    "rls_region_share",
                    "This region's live shares of a global rule, summed over the rule's buckets: part=burst (tokens) or part=rate (tokens a second)",
                ),
                &["domain", "rule", "part"],
            )
            .expect("valid metric"),
            share_series: parking_lot::Mutex::default(),
            reports: IntCounter::new(
                "rls_region_reports_total",
                "Bucket usage reports this region sent to the global tier",
            )
            .expect("valid metric"),
            assignments: IntCounter::new(
                "rls_region_assignments_total",
                "Bucket assignments (and abandons) this region received from the global tier",
            )
            .expect("valid metric"),
            since_assignment: prometheus::Gauge::new(
                "rls_region_seconds_since_assignment",
                "Seconds since this region last received an assignment from the global tier (-1: never)",
            )
            .expect("valid metric"),
            reachable: IntGauge::new(
                "rls_region_upstream_up",
                "1 while this region's stream to the global tier (--quota-upstream) is up",
            )
            .expect("valid metric"),
            fallback,
            clamped,
            refused,
            buckets: IntGauge::new(
                "rls_region_buckets",
                "Global buckets this region holds (shares and demand)",
            )
            .expect("valid metric"),
        }
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.share.clone()),
            Box::new(self.reports.clone()),
            Box::new(self.assignments.clone()),
            Box::new(self.since_assignment.clone()),
            Box::new(self.reachable.clone()),
            Box::new(self.fallback.clone()),
            Box::new(self.buckets.clone()),
            Box::new(self.clamped.clone()),
            Box::new(self.refused.clone()),
        ]
    }
}
