//! A replica's farewell to its streams when it shuts down (#66): what
//! each Envoy holds must outlive its reconnection to another replica.

use super::*;

/// How often Envoy 1.40 reports a bucket, whatever its
/// `reporting_interval` says (see [`MIN_QUIET_MICROS`]): so, at most how
/// long it takes to open a new stream after its stream ended.
pub const ENVOY_REPORT_MICROS: u64 = 5_000_000;

impl Quotas {
    /// This replica is leaving (shutdown, after its delay): each stream
    /// will end, and its Envoy reconnect to another replica on its next
    /// report, up to [`ENVOY_REPORT_MICROS`] away. What a stream was sent
    /// must outlive that, even a stream that came here seconds ago and
    /// whose assignments live [`MIN_TTL_MICROS`]: from now on every
    /// stream's cadence is taken as at least Envoy's, so what it is sent
    /// lives three of its reports (reserved that long in the shared ledger
    /// first, where there is one), and is sent again at once when that is
    /// longer than what it holds. Every bucket is looked at now.
    pub fn farewell(&mut self, rules: &RuleSet, now_micros: u64) -> Outbox {
        self.leaving = true;
        for (key, bucket) in &mut self.buckets {
            for sub in &mut bucket.subs {
                sub.interval_micros = sub.interval_micros.max(ENVOY_REPORT_MICROS);
            }
            // a ledger step is due at once, for the longer life
            bucket.stepped_micros = 0;
            bucket.due_micros = now_micros;
            queue(&mut self.due, key, bucket);
        }
        self.tick(rules, now_micros)
    }
}
