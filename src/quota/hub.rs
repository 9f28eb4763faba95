//! The global tier's side of regions (an instance that regional instances
//! report to with `--quota-upstream`): which RLQS streams are regions,
//! how many regions there are, and each region's demand per bucket as the
//! sum of what its instances report.
//!
//! Pure: every entry point takes the time. [`super::Quotas`] asks it
//! whether a stream is a region, what floor a region joining may spend at
//! once, and which part of a bucket's budget the regions reporting it
//! split (B/N stays kept for each of the others, their floor: see
//! [`super::region`] for the region's side).
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! part of `quota`; uses its allocation's arithmetic only.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::allocation::{self, smoothed, Budget};
use super::key::BucketKey;
use super::subscription::Subscription;
use super::{Pair, StreamId, PART_QUIET_MICROS};

/// One instance's part of a region's demand for a bucket: its stream, its
/// smoothed demand, when it last reported.
type RegionPart = (StreamId, f64, u64);

/// The regions reporting to this instance.
#[derive(Debug, Default)]
pub(super) struct RegionStreams {
    /// Regions (`--regions` of the regional instances; 0: none has
    /// reported): of a bucket's budget, those reporting it split their
    /// number's part, and B/N is kept for each of the others.
    regions: u32,
    /// The streams that are regions (one per region and domain).
    streams: HashSet<StreamId>,
    /// A region's demand for a bucket, per instance reporting it: (the
    /// instance's stream, its smoothed demand, when it last reported). The
    /// region's demand is their sum: each instance reports only what its
    /// own requests did.
    parts: HashMap<(Pair, Arc<BucketKey>), Vec<RegionPart>>,
}

impl RegionStreams {
    /// `stream` is a region's, one of `regions`.
    pub(super) fn add(&mut self, stream: StreamId, regions: u32) {
        self.regions = regions.max(1);
        self.streams.insert(stream);
    }

    /// Whether `stream` is a region's.
    pub(super) fn contains(&self, stream: StreamId) -> bool {
        self.streams.contains(&stream)
    }

    /// `stream` closed: it and its instances' parts are forgotten.
    pub(super) fn close(&mut self, stream: StreamId) {
        if self.streams.remove(&stream) {
            self.parts.retain(|((s, _), _), _| *s != stream);
        }
    }

    /// What a region joining a bucket of `budget` may spend at once, B/N
    /// and r/N: kept for it outside the split until its first assignment
    /// surely is live.
    pub(super) fn floor(&self, budget: Budget) -> Budget {
        let n = f64::from(self.regions.max(1));
        Budget {
            burst: budget.burst / n,
            rate: budget.rate / n,
        }
    }

    /// `part`, one of the region `pair`'s instances, reported `requests`
    /// over `elapsed_secs` for `key`: the region's demand, the sum of its
    /// instances' that reported within [`PART_QUIET_MICROS`] (an instance
    /// gone quiet, stopped or its stream moved, leaves the sum).
    pub(super) fn demand(
        &mut self,
        pair: Pair,
        key: &Arc<BucketKey>,
        part: StreamId,
        requests: u64,
        elapsed_secs: f64,
        now_micros: u64,
    ) -> f64 {
        let parts = self.parts.entry((pair, key.clone())).or_default();
        match parts.iter_mut().find(|p| p.0 == part) {
            Some(p) => {
                p.1 = smoothed(Some(p.1), requests, elapsed_secs);
                p.2 = now_micros;
            }
            None => parts.push((part, smoothed(None, requests, elapsed_secs), now_micros)),
        }
        parts.retain(|p| now_micros.saturating_sub(p.2) <= PART_QUIET_MICROS);
        parts.iter().map(|p| p.1).sum()
    }

    /// Of a bucket's budget, the part this instance splits between `subs`
    /// and the newcomer reserve to hold back from it, where regions report
    /// to it (`None`: none does, the split is as for Envoys alone). The
    /// regions reporting the bucket split their number's part, B/N stays
    /// with each of the others; a bucket only regions report needs no
    /// newcomer reserve (a region joining spends the floor kept for it).
    pub(super) fn part_of(&self, subs: &[Subscription]) -> Option<(f64, f64)> {
        if self.streams.is_empty() {
            return None;
        }
        let n = self.regions.max(1);
        let reporting = subs.iter().filter(|s| self.contains(s.stream)).count();
        let part = if reporting > 0 {
            f64::from(u32::try_from(reporting).unwrap_or(n).min(n)) / f64::from(n)
        } else {
            1.0
        };
        let reserve = if reporting == subs.len() {
            0.0
        } else {
            allocation::NEWCOMER_RESERVE
        };
        Some((part, reserve))
    }
}
