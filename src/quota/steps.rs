//! The shared ledger's side of the state: the steps a replica queues (one
//! per bucket: when an Envoy joins it, and every second) and the answers
//! it takes back, each split between the replica's own Envoys.

use super::*;

/// A step of the shared ledger to take for this replica and one bucket:
/// its Envoys' demand (`None`: the last of them left) and the bucket's
/// budget; the share is kept reserved `ttl_micros` from when the ledger
/// takes the step (which is after `at_micros`, when it was queued).
/// `held`: the safe share this replica assigned while its steps failed, and
/// until when its Envoys may enforce it (the ledger reserves it too).
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub key: BucketKey,
    pub demand: Option<ledger::Demand>,
    pub budget: Budget,
    pub ttl_micros: u64,
    pub at_micros: u64,
    pub held: Option<(Budget, u64)>,
}

impl Step {
    /// What this replica holds without the ledger, as the step tells it at
    /// `now_micros` (rounded up to whole milliseconds).
    pub fn held_at(&self, now_micros: u64) -> Option<ledger::Held> {
        let (budget, until) = self.held?;
        let left = until.checked_sub(now_micros).filter(|l| *l > 0)?;
        Some(ledger::Held {
            budget,
            for_ms: i64::try_from(left.div_ceil(1000)).unwrap_or(i64::MAX),
        })
    }
}

/// Queues a ledger step for `bucket` (this replica's Envoys' demand, or
/// its leaving when the last has gone) if one is due: an Envoy is waiting
/// for its first assignment, or, at a tick (`by_tick`),
/// [`SHARED_REFRESH_MICROS`] have passed. Reports only change the demand
/// the next refresh carries, so a bucket is stepped about once a second
/// however many Envoys report it. True if it queued one.
pub(super) fn step_if_due(
    bucket: &mut Bucket,
    steps: &mut HashMap<BucketKey, Step>,
    key: &BucketKey,
    budget: Budget,
    by_tick: bool,
    now_micros: u64,
) -> bool {
    let demand = if bucket.subs.is_empty() {
        if !bucket.in_ledger {
            return false;
        }
        bucket.in_ledger = false;
        bucket.ledger_share = None;
        None
    } else {
        let waiting = bucket.subs.iter().any(|s| s.sent.is_none());
        let refresh =
            by_tick && now_micros.saturating_sub(bucket.stepped_micros) >= SHARED_REFRESH_MICROS;
        if !(waiting || refresh || !bucket.in_ledger) {
            return false;
        }
        bucket.in_ledger = true;
        let (per_sec, pairs) = bucket.allocation.demand();
        Some(ledger::Demand {
            per_sec,
            pairs: u32::try_from(pairs.max(bucket.subs.len()).max(1)).unwrap_or(u32::MAX),
        })
    };
    bucket.stepped_micros = now_micros;
    // reserved in the ledger as long as the longest-lived member's, with
    // its margin and a second for the answer to come back in (what is
    // assigned from it lives whole seconds)
    let ttl = bucket
        .subs
        .iter()
        .map(Subscription::ttl_micros)
        .max()
        .unwrap_or(MIN_TTL_MICROS);
    steps.insert(
        key.clone(),
        Step {
            key: key.clone(),
            demand,
            budget,
            ttl_micros: ttl
                .saturating_add(LIVE_MARGIN_MICROS)
                .saturating_add(1_000_000),
            at_micros: now_micros,
            held: bucket.unconfirmed.filter(|(_, until)| *until > now_micros),
        },
    );
    true
}

/// `micros` rounded down to whole seconds (what Envoy keeps of a time to
/// live).
pub(super) fn whole_seconds(micros: u64) -> u64 {
    micros / 1_000_000 * 1_000_000
}

impl Quotas {
    /// The map's own key of the bucket a step was queued for (shared with
    /// the due queue and the shares index); `None` once it has gone.
    fn step_key(&self, step: &Step) -> Option<Arc<BucketKey>> {
        self.buckets
            .get_key_value(&step.key)
            .map(|(k, _)| k.clone())
    }

    /// The ledger steps queued since the last call.
    pub fn take_steps(&mut self) -> Vec<Step> {
        self.steps.drain().map(|(_, step)| step).collect()
    }
    /// The shared ledger's answers to [`Quotas::take_steps`]: this
    /// replica's share of each bucket, split between its Envoys at once
    /// (what each must be sent, as [`Quotas::plan`] decides). An answer for
    /// a bucket that has gone since is dropped.
    pub fn granted(&mut self, answers: Vec<(Step, Shared)>, now_micros: u64) -> Outbox {
        let mut pending = Pending::new();
        for (step, shared) in answers {
            let Some(key) = self.step_key(&step) else {
                continue;
            };
            let Some(bucket) = self.buckets.get_mut(&key) else {
                continue;
            };
            if bucket.ledger_failing.take().is_some() {
                self.without_ledger -= 1;
            }
            if bucket
                .unconfirmed
                .is_some_and(|(_, until)| until <= now_micros)
            {
                bucket.unconfirmed = None;
            }
            bucket.ledger_replicas = shared.replicas;
            bucket.shared_reserved = shared.reserved;
            if step.demand.is_none() || !bucket.in_ledger {
                index(&mut self.shares, &key, bucket, self.shared, now_micros);
                continue;
            }
            // the ledger keeps a share that grew for less than the step asked
            let life = u64::try_from(shared.life_ms)
                .unwrap_or(0)
                .saturating_mul(1000)
                .min(step.ttl_micros);
            let until = step.at_micros.saturating_add(life);
            // an answer older than the one in hand changes nothing
            if bucket.ledger_share.is_none_or(|(_, u)| u <= until) {
                bucket.ledger_share = Some((shared.share, until));
            }
            self.assign(&key, now_micros, now_micros, &mut pending);
        }
        outbox(pending)
    }

    /// The steps of [`Quotas::take_steps`] the ledger did not answer (an
    /// error, or no answer in time). Never fail open: each bucket's Envoys
    /// are sent, at once and at every failed step after, this replica's
    /// last confirmed share while the ledger surely keeps it reserved, then
    /// a safe share ([`safe_share`]: the budget divided by the replicas the
    /// last answer counted) living the members' own time to live, which
    /// outlasts a missed step. The next answer takes over (told what the
    /// safe share left live, so that no other replica is given it).
    pub fn refused(&mut self, steps: Vec<Step>, now_micros: u64) -> Outbox {
        let mut pending = Pending::new();
        for step in steps {
            let Some(key) = self.step_key(&step) else {
                continue;
            };
            let Some(bucket) = self.buckets.get_mut(&key) else {
                continue;
            };
            if step.demand.is_none() || !bucket.in_ledger || bucket.subs.is_empty() {
                continue;
            }
            if bucket.ledger_failing.is_none() {
                bucket.ledger_failing = Some(now_micros);
                self.without_ledger += 1;
            }
            self.assign(&key, now_micros, now_micros, &mut pending);
        }
        outbox(pending)
    }
}
