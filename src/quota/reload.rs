//! A reload reaching a bucket: its policy and rule again, and the pairs
//! whose bucket id now spends another bucket moved there with their live
//! grant carried.

use super::*;

impl Quotas {
    /// The rules were reloaded since `key` was last planned: its policy and
    /// rule again, and members whose bucket id now spends another bucket
    /// (a `share_threshold` added or taken away) leave it: their next
    /// report joins that one, and what they were sent stays reserved here
    /// until it expires, and is carried into the bucket they move to,
    /// reserved there as well until then (Envoy enforces it for that id
    /// until its new assignment comes): the first to report there cannot
    /// take what another still enforces.
    pub(super) fn reload(&mut self, key: &Arc<BucketKey>, rules: &RuleSet, now_micros: u64) {
        let Some(bucket) = self.buckets.get(key) else {
            return;
        };
        let own_moved = key.shared == 0 && shared_key(rules, key).is_some();
        // (stream, the id it reports, what it was last sent: share, when, ttl)
        type Moved = (StreamId, Arc<BucketKey>, Option<(Sent, u64, u64)>);
        let moved: Vec<Moved> = bucket
            .subs
            .iter()
            .filter(|sub| match &sub.id {
                Some(id) => shared_key(rules, id).as_ref() != Some(&**key),
                None => own_moved,
            })
            .map(|sub| {
                let id = sub.id.clone().unwrap_or_else(|| key.clone());
                (sub.stream, id, sub.sent)
            })
            .collect();
        for (stream, id, sent) in moved {
            self.unsubscribe(key, stream, &id, now_micros);
            if let Some((Sent::Share(share), at, ttl)) = sent {
                let until = at.saturating_add(ttl).saturating_add(LIVE_MARGIN_MICROS);
                if until > now_micros {
                    self.carry(rules, stream, &id, share, until);
                }
            }
        }
        let Some(bucket) = self.buckets.get_mut(key) else {
            return;
        };
        unindex(&mut self.shares, key, bucket);
        let probe = bucket
            .subs
            .first()
            .and_then(|sub| sub.id.clone())
            .unwrap_or_else(|| key.clone());
        bucket.policy = Policy::of(rules, &probe.domain, &probe.pairs);
        bucket.rule =
            rule_label(rules, &probe.domain, &probe.pairs).map(|l| intern(&mut self.labels, l));
        bucket.generation = rules.generation();
    }
    /// Reserves `share`, live until `until` for `stream`'s bucket id `id`,
    /// in the bucket `id` spends under `rules` (made if need be, within
    /// [`MAX_KEY_BYTES`]): a member of its own that reports nothing, gone
    /// once the share expires (with a shared ledger, within this replica's
    /// share there).
    fn carry(
        &mut self,
        rules: &RuleSet,
        stream: StreamId,
        id: &Arc<BucketKey>,
        share: Budget,
        until: u64,
    ) {
        let target = shared_key(rules, id).unwrap_or_else(|| BucketKey::clone(id));
        let key = match self.buckets.get_key_value(&target) {
            Some((key, _)) => key.clone(),
            None if self.key_bytes + target.bytes() > MAX_KEY_BYTES => return,
            None => {
                self.key_bytes += target.bytes();
                Arc::new(target)
            }
        };
        let bucket = self
            .buckets
            .entry(key.clone())
            .or_insert_with(|| Box::new(new_bucket(rules, id, &mut self.labels)));
        if !matches!(bucket.policy, Policy::Shared(_)) {
            return;
        }
        // a member of its own per carried id (a stream may carry several
        // into one shared bucket: each is enforced)
        let tag = u64::MAX - (hash_of(id) >> 1);
        bucket.allocation.seed(&(stream, tag), share, until);
        // looked at by then (and forgotten once nothing it holds lives)
        bucket.due_micros = bucket.due_micros.min(until);
        queue(&mut self.due, &key, bucket);
    }
}
