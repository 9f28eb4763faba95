//! A bucket as one stream reports it: its cadence, what it was last sent,
//! since when it has been idle, and how long what it is sent lives.

use std::sync::Arc;

use super::assignment::Sent;
use super::{
    BucketKey, Pair, StreamId, MAX_TTL_MICROS, MIN_QUIET_MICROS, MIN_TTL_MICROS, TTL_INTERVALS,
};

/// A bucket as one stream reports it.
#[derive(Debug, Clone)]
pub(super) struct Subscription {
    pub(super) stream: StreamId,
    /// See [`Pair`].
    pub(super) tag: u64,
    /// In a shared bucket: the bucket id Envoy reports (what its actions
    /// name). `None` in a bucket id's own bucket.
    pub(super) id: Option<Arc<BucketKey>>,
    pub(super) last_report_micros: u64,
    /// Smoothed time between reports.
    pub(super) interval_micros: u64,
    /// What was last sent, when, and its time to live.
    pub(super) sent: Option<(Sent, u64, u64)>,
    /// Since when every report said no requests; `None` while it has some.
    pub(super) idle_since_micros: Option<u64>,
}

impl Subscription {
    pub(super) fn new(stream: StreamId, tag: u64, id: Option<Arc<BucketKey>>) -> Self {
        Self {
            stream,
            tag,
            id,
            last_report_micros: 0,
            interval_micros: 0,
            sent: None,
            idle_since_micros: None,
        }
    }

    pub(super) fn pair(&self) -> Pair {
        (self.stream, self.tag)
    }

    /// Whether it is `stream`'s subscription to bucket id `id`.
    pub(super) fn is(&self, stream: StreamId, id: &Arc<BucketKey>) -> bool {
        self.stream == stream && self.id.as_ref().is_none_or(|own| Arc::ptr_eq(own, id))
    }

    /// The bucket id Envoy knows, in the bucket `key`.
    pub(super) fn id<'a>(&'a self, key: &'a BucketKey) -> &'a BucketKey {
        self.id.as_deref().unwrap_or(key)
    }

    /// How long what it is sent lives: three of its own report intervals
    /// (see [`ttl_micros`]). A newcomer's, before its cadence is known, is
    /// the shortest: refreshed every tick while it stays, and what it was
    /// given stops counting soon after it goes.
    pub(super) fn ttl_micros(&self) -> u64 {
        ttl_micros(self.interval_micros)
    }
}

/// How long a stream may be quiet about a bucket before it leaves it:
/// three report intervals, and never less than [`MIN_QUIET_MICROS`] (Envoy
/// 1.40 reports about every five seconds, whatever `reporting_interval` says).
pub(super) fn quiet_limit_micros(interval_micros: u64) -> u64 {
    interval_micros
        .saturating_mul(TTL_INTERVALS)
        .max(MIN_QUIET_MICROS)
}

/// An assignment's time to live for a bucket reported every `interval`, in
/// whole seconds (Envoy 1.40 drops the fraction of a second, so what is
/// counted live is what Envoy holds).
pub(super) fn ttl_micros(interval_micros: u64) -> u64 {
    interval_micros
        .saturating_mul(TTL_INTERVALS)
        .clamp(MIN_TTL_MICROS, MAX_TTL_MICROS)
        .div_ceil(1_000_000)
        .saturating_mul(1_000_000)
}
