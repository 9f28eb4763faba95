//! What a descriptor is decided by, found without deciding, and what it
//! holds: the bucket inspector's answer, for `admin`'s `/v1/buckets` and
//! an operator's reset, and for `tokenbucket-rls inspect --redis-url`
//! (no service: a limiter on a store of its own).

use std::sync::Arc;

use serde_json::{json, Value};

use super::plan::{plan, Plan};
use super::{DescriptorInput, Limiter};
use crate::bucket::Cost;
use crate::rules::{
    DescriptorEntry, Rule, RuleAction, RuleSet, MAX_ENTRIES, MAX_KEY_OR_VALUE_BYTES,
};
use crate::store::{DescriptorBuckets, StoreError};

impl Limiter {
    /// What `entries` in `domain` is decided by, without deciding: its
    /// rule and its buckets (none for a `concurrency` rule: the tag of its
    /// slots), for the bucket inspector; `None` when no rule with a limit
    /// applies. (A `max_values` rule's descriptor is shown in
    /// its own buckets, not in the overflow bucket it may be sent to.)
    pub fn buckets_of<E: DescriptorEntry>(
        &self,
        rules: &RuleSet,
        domain: &str,
        entries: &[E],
    ) -> Option<(Arc<Rule>, DescriptorBuckets)> {
        let input = [DescriptorInput {
            entries,
            cost: Cost::Check,
            limit_override: None,
            own_hits_addend: false,
        }];
        match plan(rules, domain, &input, self.calendar_now()).pop()? {
            Plan::Buckets {
                rule: Some(rule),
                buckets,
                ..
            } => Some((rule.clone(), buckets)),
            // a `concurrency` rule: its slots' tag, no buckets
            Plan::Slots { rule, slots, .. } => Some((rule.clone(), slots)),
            _ => None,
        }
    }

    /// The inspector's answer for `entries` in `domain`, whose `rule` and
    /// `buckets` [`Limiter::buckets_of`] found: the rule, its limits (each
    /// token bucket's debt), what a next hit would get (`next`, `remaining`,
    /// `reset_secs`: OK, the seconds until the buckets are full; OVER_LIMIT,
    /// until a retry can pass), the reservations and slots held, and the keys
    /// in the store. Nothing is spent. Also `tokenbucket-rls inspect
    /// --redis-url`'s, on a store of its own. Its errors: (HTTP status,
    /// JSON).
    pub async fn inspection(
        &self,
        rules: &RuleSet,
        domain: &str,
        entries: &[(String, String)],
        rule: &Rule,
        buckets: &DescriptorBuckets,
    ) -> Result<Value, (u16, Value)> {
        let unavailable = |e: StoreError| (503, json!({ "error": e.to_string() }));
        let held = self.store().held(buckets).await.map_err(unavailable)?;
        // a `concurrency` rule: its slots, no bucket to ask
        if let RuleAction::Concurrency { max } = rule.action {
            return Ok(json!({
                "domain": domain,
                "rule": rule.label(),
                "path": rule.path,
                "source": rule.source,
                "limits": [{ "algorithm": "concurrency", "max_slots": max }],
                "next": if held.slots < u64::from(max) { "ok" } else { "over_limit" },
                "slots": held.slots,
                "reservations": held.reservations,
                "store": self.store_name(),
                "keys": [],
            }));
        }
        let entries: Vec<(&str, &str)> = entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let input = [DescriptorInput {
            entries: entries.as_slice(),
            cost: Cost::Check,
            limit_override: None,
            own_hits_addend: false,
        }];
        let decision = self
            .decide(rules, domain, &input)
            .await
            .map_err(|e| (503, json!({ "error": e.to_string() })))?
            .pop()
            .ok_or_else(|| {
                (
                    404,
                    json!({ "error": "no rule with a limit matches this descriptor" }),
                )
            })?;
        let limits: Vec<_> = buckets
            .buckets
            .iter()
            .zip(held.debts.iter().chain(std::iter::repeat(&0)))
            .map(|(b, debt)| {
                json!({
                    "algorithm": b.params.algorithm.name(),
                    "capacity": b.params.capacity,
                    "per_unit": b.params.tokens_per_unit,
                    "unit_secs": b.params.unit_secs,
                    "debt": debt,
                })
            })
            .collect();
        Ok(json!({
            "domain": domain,
            "rule": rule.label(),
            "path": rule.path,
            "source": rule.source,
            "limits": limits,
            "next": decision.verdict.result_label(),
            "remaining": decision.remaining,
            "reset_secs": decision.reset_secs,
            "reservations": held.reservations,
            "slots": held.slots,
            "store": self.store_name(),
            "keys": self.store().key_names(buckets),
            "counted_as_envoyproxy_ratelimit": buckets.ratelimit_key.is_some(),
        }))
    }
}

/// `k=v,k2=v2` as entries; the reason when it is not one.
pub fn parse_descriptor(text: &str) -> Result<Vec<(String, String)>, String> {
    if text.is_empty() {
        return Err("descriptor is empty: give its entries as key=value,key=value".into());
    }
    let entries: Vec<&str> = text.split(',').collect();
    if entries.len() > MAX_ENTRIES {
        return Err(format!("descriptor has more than {MAX_ENTRIES} entries"));
    }
    entries
        .into_iter()
        .map(|e| {
            let (k, v) = e.split_once('=').ok_or_else(|| {
                let e: String = e.chars().take(64).collect();
                format!("descriptor entry '{e}' has no '=': give key=value")
            })?;
            if k.is_empty() || k.len() > MAX_KEY_OR_VALUE_BYTES || v.len() > MAX_KEY_OR_VALUE_BYTES {
                return Err(format!(
                    "a descriptor key is empty, or a key or value is longer than {MAX_KEY_OR_VALUE_BYTES} bytes"
                ));
            }
            Ok((k.to_string(), v.to_string()))
        })
        .collect()
}
