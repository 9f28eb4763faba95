//! What a descriptor is decided by, found without deciding: for the
//! bucket inspector and an operator's reset (`admin`'s `/v1/buckets`).

use std::sync::Arc;

use super::plan::{plan, Plan};
use super::{DescriptorInput, Limiter};
use crate::bucket::Cost;
use crate::rules::{DescriptorEntry, Rule, RuleSet};
use crate::store::DescriptorBuckets;

impl Limiter {
    /// What `entries` in `domain` is decided by, without deciding: its
    /// rule and its buckets, for the bucket inspector; `None` when no rule
    /// with a limit applies. (A `max_values` rule's descriptor is shown in
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
            _ => None,
        }
    }
}
