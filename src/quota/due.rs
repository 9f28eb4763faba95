//! When each bucket must next be looked at without a report: a min-heap
//! of due times, and what makes a bucket due.

use super::*;

/// Never: a time later than any.
pub(super) const NEVER: u64 = u64::MAX;

/// A bucket to look at once `at` has come. A min-heap by time; entries
/// left behind by a bucket that was re-queued earlier, or has gone, are
/// passed over when they come up.
#[derive(Debug)]
pub(super) struct Due {
    pub(super) at: u64,
    pub(super) key: Arc<BucketKey>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // reversed: the earliest on top of the max-heap
        other.at.cmp(&self.at)
    }
}

/// Queues `bucket` for its due time unless it is queued for that or earlier.
pub(super) fn queue(due: &mut BinaryHeap<Due>, key: &Arc<BucketKey>, bucket: &mut Bucket) {
    if bucket.due_micros < bucket.queued_micros {
        bucket.queued_micros = bucket.due_micros;
        due.push(Due {
            at: bucket.due_micros,
            key: key.clone(),
        });
    }
}

/// When `bucket` must next be looked at without a report: `after` at the
/// earliest. With a shared ledger, a Shared bucket an Envoy reports is
/// stepped every [`SHARED_REFRESH_MICROS`].
pub(super) fn next_due(bucket: &Bucket, shared: bool, after: u64) -> u64 {
    let mut due = bucket.allocation.next_expiry().unwrap_or(NEVER);
    if shared && matches!(bucket.policy, Policy::Shared(_)) && !bucket.subs.is_empty() {
        due = due.min(bucket.stepped_micros.saturating_add(SHARED_REFRESH_MICROS));
    }
    for sub in &bucket.subs {
        let quiet = sub
            .last_report_micros
            .saturating_add(quiet_limit_micros(sub.interval_micros))
            .saturating_add(1);
        due = due.min(quiet);
        if let Some(t) = sub.idle_since_micros {
            due = due.min(t.saturating_add(ABANDON_AFTER_MICROS));
        }
        if let Some((_, at, sent_ttl)) = sub.sent {
            due = due.min(at.saturating_add(sub.ttl_micros().min(sent_ttl) / TTL_INTERVALS));
        }
    }
    due.max(after)
}
