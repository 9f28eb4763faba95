//! What one decision sends `bucket.lua` besides its keys: its numbers,
//! flags and buckets in the order the script's header gives, and what the
//! script's answer then holds.

use fred::bytes::Bytes;
use fred::types::Value;

use super::BucketLayout;
use crate::attempt::{AttemptCall, AttemptMode, Phase};
use crate::bucket::{Algorithm, Cost, MAX_COST};
use crate::store::DescriptorBuckets;

/// Added to a bucket's refill time for its expiry, so a key never expires
/// before its bucket would be full.
const EXPIRY_MARGIN_MS: i64 = 1_000;

/// One decision's arguments (of an attempt when `attempt` says so: its
/// numbers and id added), written in `layout`.
pub(super) fn decision(
    descriptor: &DescriptorBuckets,
    cost: Cost,
    attempt: Option<&AttemptCall>,
    layout: BucketLayout,
) -> Vec<Value> {
    let mut args: Vec<Value> = Vec::with_capacity(8 + 4 * descriptor.buckets.len());
    // needed() is at most MAX_COST (2^53), so the cast keeps it positive.
    args.extend([
        Value::Integer(descriptor.buckets.len() as i64),
        Value::Integer(cost.needed() as i64),
        Value::Integer(cost.deducted()),
        Value::Integer(EXPIRY_MARGIN_MS),
        // flags: 1 the hash layout, 2 a charge, 4 an attempt, 8 a
        // fixed window, 16 a sliding one, 32 a calendar period (see
        // bucket.lua)
        Value::Integer(
            i64::from(layout == BucketLayout::Hash)
                + 2 * i64::from(matches!(cost, Cost::Charge(_)))
                + 4 * i64::from(attempt.is_some())
                + match descriptor.buckets.first().map(|b| b.params.algorithm) {
                    Some(Algorithm::FixedWindow) => 8,
                    Some(Algorithm::SlidingWindow) => 16,
                    Some(Algorithm::CalendarWindow) => 32,
                    _ => 0,
                },
        ),
    ]);
    for b in &descriptor.buckets {
        match b.params.period {
            // a calendar period: its periods' boundaries (Unix seconds)
            // in the places a bucket's burst, unit and debt go
            Some(p) if b.params.algorithm == Algorithm::CalendarWindow => args.extend([
                Value::Integer(p.start),
                Value::Integer(b.params.tokens_per_unit as i64),
                Value::Integer(p.end),
                Value::Integer(p.next_end),
            ]),
            _ => args.extend([
                Value::Integer(b.params.capacity as i64),
                Value::Integer(b.params.tokens_per_unit as i64),
                Value::Integer(b.params.unit_secs as i64),
                Value::Integer(b.params.max_debt.map_or(-1, |d| d.min(MAX_COST) as i64)),
            ]),
        }
    }
    if let Some(call) = attempt {
        args.extend([
            Value::Integer(match call.phase {
                Phase::Start => 0,
                Phase::Done => 1,
                Phase::Withdraw => 2,
            }),
            Value::Integer(i64::from(call.mode == AttemptMode::Reserve)),
            Value::Integer(
                i64::try_from(call.ttl_micros / 1000)
                    .unwrap_or(i64::MAX)
                    .max(1),
            ),
            Value::Bytes(Bytes::from(call.id.clone())),
            Value::Integer(i64::from(call.max_repeats)),
        ]);
    }
    args
}

/// Whether a descriptor's buckets are fixed windows, whose answer carries
/// each window's count after the hit where a bucket's says what a charge
/// forgave.
pub(super) fn answers_window_counts(descriptor: &DescriptorBuckets) -> bool {
    descriptor
        .buckets
        .first()
        .is_some_and(|b| b.params.algorithm == Algorithm::FixedWindow)
}
