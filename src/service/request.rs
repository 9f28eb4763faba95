//! Checking a `RateLimitRequest` before anything is looked up or stored.
//!
//! Anything a client controls is bounded here; a bad request is answered
//! with INVALID_ARGUMENT and a message naming the offending field.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

use crate::limiter::bucket::Cost;
use crate::limiter::DescriptorInput;
use crate::rules::{DescriptorEntry, Unit};

pub const MAX_DESCRIPTORS: usize = 64;
pub const MAX_ENTRIES: usize = 32;
pub const MAX_KEY_OR_VALUE_BYTES: usize = 1024;

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
                if e.value.len() > MAX_KEY_OR_VALUE_BYTES {
                    return Err(format!(
                        "descriptors[{i}].entries[{j}].value is longer than {MAX_KEY_OR_VALUE_BYTES} bytes"
                    ));
                }
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
            })
        })
        .collect()
}
