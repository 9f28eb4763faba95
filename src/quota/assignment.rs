//! What Envoy is sent: a bucket's share or blanket rule as a
//! `BucketAction`, and when a changed share is worth sending early.

use std::collections::HashMap;

use prost::Message;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    self, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse;
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};

use super::allocation::Budget;
use super::{BucketKey, Outbox, StreamId, RESEND_THRESHOLD};

/// What one stream was sent for a bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sent {
    Blanket(BlanketRule),
    Share(Budget),
}

/// The largest response message sent, encoded: well below the 4 MiB that
/// gRPC clients accept by default; more actions go in further messages.
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

/// Per-stream actions as the messages to write, in stream order, each at
/// most [`MAX_MESSAGE_BYTES`].
pub fn outbox(per_stream: HashMap<StreamId, Vec<BucketAction>>) -> Outbox {
    let mut out: Outbox = Vec::with_capacity(per_stream.len());
    for (stream, actions) in per_stream {
        let mut message = RateLimitQuotaResponse::default();
        let mut bytes = 0;
        for a in actions {
            // the field's tag and length prefix: a few bytes each
            let size = a.encoded_len() + 8;
            if bytes + size > MAX_MESSAGE_BYTES && !message.bucket_action.is_empty() {
                out.push((stream, std::mem::take(&mut message)));
                bytes = 0;
            }
            bytes += size;
            message.bucket_action.push(a);
        }
        if !message.bucket_action.is_empty() {
            out.push((stream, message));
        }
    }
    // stable: a stream's messages stay in order
    out.sort_by_key(|(s, _)| *s);
    out
}

/// Whether a share moved enough to be sent before its refresh is due.
pub fn moved(before: Sent, now: Sent) -> bool {
    match (before, now) {
        (Sent::Share(a), Sent::Share(b)) => {
            let rel = |x: f64, y: f64| (x - y).abs() > RESEND_THRESHOLD * x.max(y);
            // a decrease always goes out at once: the bound counts on it
            b.rate < a.rate || b.burst < a.burst || rel(a.rate, b.rate) || rel(a.burst, b.burst)
        }
        (a, b) => a != b,
    }
}

pub fn action(key: &BucketKey, what: Sent, ttl_micros: u64, exact: bool) -> BucketAction {
    let strategy = match what {
        Sent::Blanket(rule) => Strategy::BlanketRule(rule as i32),
        Sent::Share(share) if exact => region_token_bucket(share),
        Sent::Share(share) => token_bucket(share),
    };
    BucketAction {
        bucket_id: Some(key.id()),
        bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(
            QuotaAssignmentAction {
                assignment_time_to_live: Some(duration(ttl_micros)),
                rate_limit_strategy: Some(RateLimitStrategy {
                    strategy: Some(strategy),
                }),
            },
        )),
    }
}

/// A share as Envoy's token bucket, never more than the share: whole tokens
/// rounded down, refilled every whole number of seconds (Envoy 1.40 admitted
/// every request under a fill interval with a fraction of a second: measured
/// with two Envoys, see tests/envoy_e2e.rs), so the rate is rounded down to
/// what whole tokens per whole seconds give. Less than one token: DENY_ALL.
pub fn token_bucket(share: Budget) -> Strategy {
    let max_tokens = share.burst.floor().min(f64::from(u32::MAX)) as u32;
    if max_tokens == 0 || share.rate <= 0.0 {
        return Strategy::BlanketRule(BlanketRule::DenyAll as i32);
    }
    // every second when the rate gives a whole token a second, else every
    // as many seconds as one token takes
    let secs = if share.rate >= 1.0 {
        1.0
    } else {
        (1.0 / share.rate).ceil()
    };
    let per_fill = (share.rate * secs).floor().clamp(1.0, f64::from(u32::MAX));
    Strategy::TokenBucket(TokenBucket {
        max_tokens,
        tokens_per_fill: Some(UInt32Value {
            value: per_fill as u32,
        }),
        fill_interval: Some(duration((secs as u64).saturating_mul(1_000_000))),
    })
}

/// The seconds a region's share is refilled over: its rate said as whole
/// tokens per this many seconds loses less than a token an hour.
const REGION_FILL_SECS: u64 = 3600;

/// A share as a region's token bucket: a region (our own client) refills
/// continuously at `tokens_per_fill / fill_interval`, so the rate is sent
/// per hour, rounded down (2.25/s is 8,100 an hour, where Envoy's rounding
/// gives 2/s), and the burst in whole tokens. Less than one token: DENY_ALL.
pub fn region_token_bucket(share: Budget) -> Strategy {
    let max_tokens = share.burst.floor().min(f64::from(u32::MAX)) as u32;
    let per_fill = (share.rate * REGION_FILL_SECS as f64).floor();
    if per_fill > f64::from(u32::MAX) {
        // over a million a second: a second's worth is precise enough
        return token_bucket(share);
    }
    if max_tokens == 0 || per_fill < 1.0 {
        return Strategy::BlanketRule(BlanketRule::DenyAll as i32);
    }
    Strategy::TokenBucket(TokenBucket {
        max_tokens,
        tokens_per_fill: Some(UInt32Value {
            value: per_fill as u32,
        }),
        fill_interval: Some(duration(REGION_FILL_SECS * 1_000_000)),
    })
}

/// A protobuf duration's microseconds (negative parts as none).
pub fn micros_of(d: &PbDuration) -> u64 {
    u64::try_from(d.seconds)
        .unwrap_or(0)
        .saturating_mul(1_000_000)
        .saturating_add(u64::try_from(d.nanos).unwrap_or(0) / 1000)
}

/// Microseconds as a protobuf duration.
pub fn duration(micros: u64) -> PbDuration {
    PbDuration {
        seconds: i64::try_from(micros / 1_000_000).unwrap_or(i64::MAX),
        nanos: ((micros % 1_000_000) * 1_000) as i32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate_of(strategy: &Strategy) -> f64 {
        match strategy {
            Strategy::TokenBucket(tb) => {
                let per_fill = tb.tokens_per_fill.as_ref().map_or(1, |v| v.value);
                let secs = tb.fill_interval.as_ref().map_or(1, |d| d.seconds);
                f64::from(per_fill) / secs as f64
            }
            _ => 0.0,
        }
    }

    /// A region's share keeps its rate (to a token an hour); Envoy's is
    /// rounded to whole tokens per whole seconds.
    #[test]
    fn a_regions_share_keeps_its_rate() {
        let share = Budget {
            burst: 3.6,
            rate: 2.25,
        };
        assert_eq!(rate_of(&token_bucket(share)), 2.0);
        assert_eq!(rate_of(&region_token_bucket(share)), 2.25);
        let slow = Budget {
            burst: 1.0,
            rate: 0.45,
        };
        assert!((rate_of(&region_token_bucket(slow)) - 0.45).abs() < 1.0 / 3600.0);
        assert!(rate_of(&token_bucket(slow)) < 0.34, "1 every 3 s");
        let none = Budget {
            burst: 0.5,
            rate: 2.0,
        };
        assert_eq!(
            region_token_bucket(none),
            Strategy::BlanketRule(BlanketRule::DenyAll as i32)
        );
    }
}
