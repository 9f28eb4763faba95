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
/// numbers and id added), written in `layout`: the group's numbers packed
/// in one argument (`struct.unpack` in the script costs less than one
/// `tonumber` of a decimal: nine of them were a fifth of a plain
/// decision's instructions), then an attempt's id.
pub(super) fn decision(
    descriptor: &DescriptorBuckets,
    cost: Cost,
    attempt: Option<&AttemptCall>,
    layout: BucketLayout,
) -> Vec<Value> {
    let n = descriptor.buckets.len();
    let mut group = Vec::with_capacity(8 + 24 + 32 * n + 18);
    // at most a rule's limits: far below 2^16
    group.extend_from_slice(&u16::try_from(n).unwrap_or(u16::MAX).to_le_bytes());
    let algorithm = descriptor.buckets.first().map(|b| b.params.algorithm);
    group.extend_from_slice(&[
        u8::from(layout == BucketLayout::Hash),
        u8::from(matches!(cost, Cost::Charge(_))),
        u8::from(attempt.is_some()),
        u8::from(algorithm == Some(Algorithm::FixedWindow)),
        u8::from(algorithm == Some(Algorithm::SlidingWindow)),
        u8::from(algorithm == Some(Algorithm::CalendarWindow)),
    ]);
    // every number is an integer below 2^53: exact as a double
    let mut number = |v: i64| group.extend_from_slice(&(v as f64).to_le_bytes());
    // needed() is at most MAX_COST (2^53), so the cast keeps it positive.
    number(cost.needed() as i64);
    number(cost.deducted());
    number(EXPIRY_MARGIN_MS);
    for b in descriptor.buckets.iter().take(usize::from(u16::MAX)) {
        match b.params.period {
            // a calendar period: its periods' boundaries (Unix seconds)
            // in the places a bucket's burst, unit and debt go
            Some(p) if b.params.algorithm == Algorithm::CalendarWindow => {
                number(p.start);
                number(b.params.tokens_per_unit as i64);
                number(p.end);
                number(p.next_end);
            }
            _ => {
                number(b.params.capacity.min(MAX_COST) as i64);
                number(b.params.tokens_per_unit as i64);
                number(b.params.unit_secs.min(MAX_COST) as i64);
                number(b.params.max_debt.map_or(-1, |d| d.min(MAX_COST) as i64));
            }
        }
    }
    let mut args = Vec::with_capacity(2);
    if let Some(call) = attempt {
        group.push(match call.phase {
            Phase::Start => 0,
            Phase::Done => 1,
            Phase::Withdraw => 2,
        });
        group.push(u8::from(call.mode == AttemptMode::Reserve));
        let ttl_ms = i64::try_from(call.ttl_micros / 1000)
            .unwrap_or(i64::MAX)
            .clamp(1, MAX_COST as i64);
        group.extend_from_slice(&(ttl_ms as f64).to_le_bytes());
        group.extend_from_slice(&f64::from(call.max_repeats).to_le_bytes());
        args.push(Value::Bytes(Bytes::from(group)));
        args.push(Value::Bytes(Bytes::from(call.id.clone())));
    } else {
        args.push(Value::Bytes(Bytes::from(group)));
    }
    args
}

/// Whether a decision runs `one.lua`: one bucket, not an attempt's call,
/// written in the packed layout (see its header).
pub(super) fn fits_one_script(
    descriptor: &DescriptorBuckets,
    attempt: Option<&AttemptCall>,
    layout: BucketLayout,
) -> bool {
    attempt.is_none() && descriptor.buckets.len() == 1 && layout == BucketLayout::Packed
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
