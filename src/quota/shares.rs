//! The assigned fraction of each rule's buckets (`rls_quota_share`): an
//! index per (domain, rule), kept as buckets are planned.

use super::*;

/// Records `bucket`'s assigned fraction in `shares` (see [`Quotas::shares`]).
pub(super) fn index(
    shares: &mut HashMap<(String, Arc<str>), BTreeMap<u64, u32>>,
    key: &BucketKey,
    bucket: &mut Bucket,
    shared: bool,
    now_micros: u64,
) {
    let fraction = match (bucket.policy, &bucket.rule) {
        (Policy::Shared(budget), Some(_)) => {
            // of this instance's part of the budget, or with a shared
            // ledger, of the whole as the last step saw it
            let (budget, reserved) = if shared {
                (budget, bucket.shared_reserved)
            } else {
                (
                    bucket.allocation.budget(),
                    bucket.allocation.reserved(now_micros),
                )
            };
            let f = (reserved.rate / budget.rate).max(reserved.burst / budget.burst);
            (f.is_finite() && f >= 0.0).then_some(f.to_bits())
        }
        _ => None,
    };
    if fraction == bucket.fraction {
        return;
    }
    unindex(shares, key, bucket);
    if let (Some(bits), Some(rule)) = (fraction, &bucket.rule) {
        *shares
            .entry((key.domain.clone(), rule.clone()))
            .or_default()
            .entry(bits)
            .or_default() += 1;
        bucket.fraction = Some(bits);
    }
}

/// Takes `bucket`'s fraction out of `shares`.
pub(super) fn unindex(
    shares: &mut HashMap<(String, Arc<str>), BTreeMap<u64, u32>>,
    key: &BucketKey,
    bucket: &mut Bucket,
) {
    let (Some(bits), Some(rule)) = (bucket.fraction.take(), &bucket.rule) else {
        return;
    };
    let label = (key.domain.clone(), rule.clone());
    if let Some(counts) = shares.get_mut(&label) {
        if let Some(n) = counts.get_mut(&bits) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&bits);
            }
        }
        if counts.is_empty() {
            shares.remove(&label);
        }
    }
}

impl Quotas {
    /// For each (domain, rule) with a split bucket: the largest fraction of
    /// one of its buckets' budget that live assignments may enforce (as of
    /// each bucket's last plan; never above 1: the allocation's bound).
    pub fn assigned_fractions(&self) -> Vec<(String, String, f64)> {
        let mut out: Vec<(String, String, f64)> = self
            .shares
            .iter()
            .filter_map(|((domain, rule), counts)| {
                let (bits, _) = counts.last_key_value()?;
                Some((domain.clone(), rule.to_string(), f64::from_bits(*bits)))
            })
            .collect();
        out.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        out
    }
}
