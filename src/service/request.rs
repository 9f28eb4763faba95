//! Checking a `RateLimitRequest` before anything is looked up or stored.
//!
//! Anything a client controls is bounded here; a bad request is answered
//! with INVALID_ARGUMENT and a message naming the offending field.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

use crate::bucket::Cost;
use crate::limiter::DescriptorInput;
use crate::rules::{DescriptorEntry, Unit};

pub const MAX_DESCRIPTORS: usize = 64;
pub use crate::rules::{MAX_ENTRIES, MAX_KEY_OR_VALUE_BYTES};

impl DescriptorEntry for Entry {
    fn key(&self) -> &str {
        &self.key
    }
    fn value(&self) -> &str {
        &self.value
    }
}

/// Validates `request` and reads each descriptor's cost and override.
pub fn descriptor_inputs(
    request: &RateLimitRequest,
) -> Result<Vec<DescriptorInput<'_, Entry>>, String> {
    if request.domain.is_empty() {
        return Err("domain must not be empty".into());
    }
    if request.descriptors.is_empty() {
        return Err("the request has no descriptors".into());
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return Err(format!(
            "the request has {} descriptors; at most {MAX_DESCRIPTORS} are accepted",
            request.descriptors.len()
        ));
    }
    if request.domain.len() > MAX_KEY_OR_VALUE_BYTES {
        return Err(format!(
            "domain is longer than {MAX_KEY_OR_VALUE_BYTES} bytes"
        ));
    }
    // The request's hits_addend: 0 or unset means 1.
    let request_cost = Cost::Spend(u64::from(request.hits_addend.max(1)));
    request
        .descriptors
        .iter()
        .enumerate()
        .map(|(i, d)| {
            if d.entries.is_empty() {
                return Err(format!("descriptors[{i}] has no entries"));
            }
            if d.entries.len() > MAX_ENTRIES {
                return Err(format!(
                    "descriptors[{i}] has {} entries; at most {MAX_ENTRIES} are accepted",
                    d.entries.len()
                ));
            }
            for (j, e) in d.entries.iter().enumerate() {
                if e.key.is_empty() {
                    return Err(format!("descriptors[{i}].entries[{j}] has an empty key"));
                }
                if e.key.len() > MAX_KEY_OR_VALUE_BYTES {
                    return Err(format!(
                        "descriptors[{i}].entries[{j}].key is longer than {MAX_KEY_OR_VALUE_BYTES} bytes"
                    ));
                }
                // a value of any length is matched whole; keys and ids
                // hold a long one by its digest (rules::bounded_value)
            }
            let cost = match (&d.hits_addend, d.is_negative_hits) {
                // Envoy's refunds: the hits go back into the bucket.
                (Some(h), true) => Cost::Refund(h.value),
                (None, true) => Cost::Refund(u64::from(request.hits_addend.max(1))),
                (Some(h), false) if h.value == 0 => Cost::Check,
                (Some(h), false) => Cost::Spend(h.value),
                (None, false) => request_cost,
            };
            let limit_override = match &d.limit {
                None => None,
                Some(l) => match Unit::from_proto(l.unit) {
                    Some(unit) => Some((l.requests_per_unit, unit)),
                    None => {
                        return Err(format!(
                            "descriptors[{i}].limit.unit is {}; use SECOND, MINUTE, HOUR, DAY, WEEK, MONTH or YEAR",
                            l.unit
                        ))
                    }
                },
            };
            Ok(DescriptorInput {
                entries: &d.entries,
                cost,
                limit_override,
                own_hits_addend: d.hits_addend.is_some(),
            })
        })
        .collect()
}

/// The caller's deadline from its `grpc-timeout` header (`<digits><unit>`,
/// unit one of H M S m u n), if it sent a valid one.
pub fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    parse_grpc_timeout(metadata.get("grpc-timeout")?.to_str().ok()?)
}

/// A `grpc-timeout` value read: `<digits><unit>`, at most 8 digits.
pub fn parse_grpc_timeout(text: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `d` as a `grpc-timeout` value, in the finest unit that fits 8 digits.
pub fn grpc_timeout_text(d: std::time::Duration) -> String {
    const MOST: u128 = 99_999_999;
    match (d.as_micros(), d.as_millis()) {
        (us, _) if us <= MOST => format!("{us}u"),
        (_, ms) if ms <= MOST => format!("{ms}m"),
        _ => format!("{}S", d.as_secs().min(99_999_999)),
    }
}

#[cfg(test)]
mod deadline_tests {
    use super::grpc_timeout;
    use std::time::Duration;

    fn parse(value: &str) -> Option<Duration> {
        let mut m = tonic::metadata::MetadataMap::new();
        m.insert("grpc-timeout", value.parse().expect("ascii"));
        grpc_timeout(&m)
    }

    #[test]
    fn grpc_timeouts_are_read() {
        assert_eq!(parse("20m"), Some(Duration::from_millis(20)));
        assert_eq!(parse("1S"), Some(Duration::from_secs(1)));
        assert_eq!(parse("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse("1500u"), Some(Duration::from_micros(1500)));
        assert_eq!(parse("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "m", "20", "20x", "123456789m", "-5m", "5 m"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout(&tonic::metadata::MetadataMap::new()), None);
    }
}
