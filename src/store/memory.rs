//! The embedded store: bucket state in process memory.
//!
//! Buckets are spread over many mutex-guarded shards by the descriptor's tag,
//! so one descriptor's buckets sit in one shard and are decided under one
//! short lock, and unrelated requests rarely meet. Time comes from a
//! monotonic [`Clock`]. A bucket that has refilled completely is the same as
//! no bucket, so a sweeper drops such entries: memory is bounded by the
//! buckets that are not full, not by every key ever seen.
//!
//! Request values choose buckets, so a client sending random values could
//! still create them faster than they refill: the store holds at most
//! `max_buckets`, and at most [`BYTES_PER_BUCKET`] bytes for each of them
//! (a bucket counts [`BUCKET_FIXED_BYTES`] plus its key: long values make
//! it count for more), each shard its share. A shard at its share makes room
//! before an insert by dropping, in one pass, the eighth of its buckets
//! whose loss costs least. A dropped bucket comes back full, so dropping
//! one that holds `t` of its `B` tokens hands its client `B − t` tokens
//! back: full buckets go first (they cost nothing), then the others by the
//! tokens they miss, fewest first; buckets in steady use (decisions in a
//! row, at most a second apart: their client is back at once, so evicting
//! one hands it tokens pass after pass) after those; and a bucket that
//! rejected a request in the last [`REJECTED_RECENTLY_SECS`] (a throttled
//! client) only after every other. So a flood of new values, each missing a
//! few tokens, never resets a throttled or drained client while a cheaper
//! bucket exists. And when only throttled clients' buckets are left to
//! evict, none is: a new value is then decided against its rule's overflow
//! bucket (one per rule and shard, shared by every value that found no
//! room), so a flood whose own buckets are throttled too limits itself
//! instead of handing a throttled client its tokens back.
//! One pass (a sort of the shard by that rank) per eighth of a shard:
//! amortised O(log n) per insert, under the shard's own lock only.
//!
//! **Rooms.** This file: the store (shards, deciding under one shard's
//! lock, the sweeper). Below it: [`entry`] (one bucket as kept, and its
//! rank for eviction) and [`shard`] (a shard's buckets and bytes, the
//! overflow buckets, making room).

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

use self::attempts::{record_bytes, Attempts};
pub use self::attempts::{ATTEMPT_FIXED_BYTES, BYTES_PER_ATTEMPT, DEFAULT_MAX_ATTEMPTS};
pub use self::entry::REJECTED_RECENTLY_SECS;
use self::entry::{Entry, FullAt};
use self::shard::{bucket_bytes, make_room, overflow_key, Shard, ShardState, OVERFLOW_PREFIX};
pub use self::shard::{BUCKET_FIXED_BYTES, BYTES_PER_BUCKET};
use super::key::{attempt_key, slots_key};
use super::{debt_of, AttemptOutcome, DescriptorBuckets, Held, Store, StoreError};
use crate::attempt::{self, AttemptCall, AttemptMode, AttemptResult, Phase, SlotOutcome};
use crate::bucket::{self, Algorithm, BucketOutcome, BucketState, Cost};
use crate::clock::Clock;
use crate::labels::RuleId;
use crate::telemetry::Metrics;

mod attempts;
mod entry;
mod shard;

/// Buckets held at most unless told otherwise (`--max-buckets`): about
/// 340 MB at the measured 168 bytes per bucket with short values.
pub const DEFAULT_MAX_BUCKETS: usize = 2_000_000;

/// Told how many buckets of a rule were evicted to make room.
pub type EvictionSink = Arc<dyn Fn(RuleId, u64) + Send + Sync>;

/// In-memory buckets for one process.
pub struct MemoryStore<C: Clock> {
    shards: Box<[Shard]>,
    /// Most buckets one shard holds: its share of `max_buckets`.
    shard_cap: usize,
    /// Keyed SipHash: request values pick the shard, so the seed must be secret.
    hasher: RandomState,
    clock: C,
    on_evict: Option<EvictionSink>,
    /// Most attempt records and slots the store holds (`--max-attempts`),
    /// in all shards together, and those held now, and their bytes.
    max_attempts: usize,
    attempts_held: AtomicUsize,
    attempt_bytes: AtomicUsize,
    /// Done-only records held, and their bytes: in a room of their own.
    done_only_held: AtomicUsize,
    done_only_bytes: AtomicUsize,
    /// Told of each reservation whose time to live passed unsettled.
    on_expired: Option<EvictionSink>,
}

impl<C: Clock> MemoryStore<C> {
    /// A store of at most [`DEFAULT_MAX_BUCKETS`] buckets.
    pub fn new(clock: C) -> Self {
        Self::with_cap(clock, DEFAULT_MAX_BUCKETS, None)
    }

    /// A store of at most `max_buckets` buckets (at least one); `on_evict`
    /// hears of every bucket evicted to make room.
    pub fn with_cap(clock: C, max_buckets: usize, on_evict: Option<EvictionSink>) -> Self {
        let max_buckets = max_buckets.max(1);
        // 16 shards per core, but never more shards than buckets, so that
        // every shard's share is at least one and their sum at most the cap
        let count = (std::thread::available_parallelism().map_or(4, |n| n.get()) * 16)
            .next_power_of_two()
            .min(1 << max_buckets.ilog2());
        Self {
            shards: (0..count).map(|_| Mutex::default()).collect(),
            shard_cap: max_buckets / count,
            hasher: RandomState::new(),
            clock,
            on_evict,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            attempts_held: AtomicUsize::new(0),
            attempt_bytes: AtomicUsize::new(0),
            done_only_held: AtomicUsize::new(0),
            done_only_bytes: AtomicUsize::new(0),
            on_expired: None,
        }
    }

    /// Holds at most `max_attempts` attempt records and slots (at least
    /// one), and tells `on_expired` of each reservation whose time to live
    /// passed unsettled and each slot that returned by itself.
    pub fn with_attempts(mut self, max_attempts: usize, on_expired: Option<EvictionSink>) -> Self {
        self.max_attempts = max_attempts.max(1);
        self.on_expired = on_expired;
        self
    }

    /// The most attempt records and slots the store holds.
    pub fn max_attempts(&self) -> usize {
        self.max_attempts
    }

    /// Attempt records and slots held now (forgotten ones until a sweep).
    pub fn attempts(&self) -> usize {
        self.attempts_held.load(Ordering::Relaxed) + self.done_only_held.load(Ordering::Relaxed)
    }

    /// Done-only records held at most: a quarter of `--max-attempts`, in
    /// a room of their own ([`attempts::is_done_only`]).
    fn max_done_only(&self) -> usize {
        (self.max_attempts / 4).max(1)
    }

    /// Records one descriptor may hold at most: the bound less a quarter
    /// kept for the others (the whole bound below 4), so that no one
    /// descriptor takes the table.
    fn max_per_descriptor(&self) -> usize {
        self.max_attempts - self.max_attempts / 4
    }

    /// Whether one more record or slot of `bytes` fits the bound: a
    /// done-only record (`done_only`) in its own room, anything else in
    /// the rest.
    fn attempt_fits(&self, bytes: usize, done_only: bool) -> bool {
        let (held, held_bytes, max) = if done_only {
            (
                self.done_only_held.load(Ordering::Relaxed),
                self.done_only_bytes.load(Ordering::Relaxed),
                self.max_done_only(),
            )
        } else {
            (
                self.attempts_held.load(Ordering::Relaxed),
                self.attempt_bytes.load(Ordering::Relaxed),
                self.max_attempts,
            )
        };
        held < max && held_bytes + bytes <= max.saturating_mul(BYTES_PER_ATTEMPT)
    }

    /// Moves the store's totals by a shard's change from `before` to
    /// `after` ([`Attempts::footprint`]).
    fn account(&self, before: attempts::Footprint, after: attempts::Footprint) {
        for (total, (b, a)) in [
            (&self.attempts_held, (before.held, after.held)),
            (&self.attempt_bytes, (before.bytes, after.bytes)),
            (&self.done_only_held, (before.done_only, after.done_only)),
            (
                &self.done_only_bytes,
                (before.done_only_bytes, after.done_only_bytes),
            ),
        ] {
            if a >= b {
                total.fetch_add(a - b, Ordering::Relaxed);
            } else {
                total.fetch_sub(b - a, Ordering::Relaxed);
            }
        }
    }

    /// Whether a new record of `bytes` fits, after sweeping `attempts`
    /// when the store is full and that shard has something due.
    fn attempt_room(
        &self,
        attempts: &mut Attempts,
        bytes: usize,
        done_only: bool,
        now: u64,
        expired: &mut Vec<RuleId>,
    ) -> bool {
        if self.attempt_fits(bytes, done_only) {
            return true;
        }
        self.sweep_if_due(attempts, now, expired);
        self.attempt_fits(bytes, done_only)
    }

    /// Whether a new record under `key` fits its descriptor's share
    /// ([`MemoryStore::max_per_descriptor`]) and the store's bound
    /// ([`MemoryStore::attempt_room`]), sweeping first when due.
    fn record_room(
        &self,
        attempts: &mut Attempts,
        key: &[u8],
        done_only: bool,
        now: u64,
        expired: &mut Vec<RuleId>,
    ) -> bool {
        if attempts.held_by_descriptor(key) >= self.max_per_descriptor() {
            self.sweep_if_due(attempts, now, expired);
            if attempts.held_by_descriptor(key) >= self.max_per_descriptor() {
                return false;
            }
        }
        self.attempt_room(attempts, record_bytes(key), done_only, now, expired)
    }

    fn sweep_if_due(&self, attempts: &mut Attempts, now: u64, expired: &mut Vec<RuleId>) {
        if attempts.due(now) {
            let before = attempts.footprint();
            attempts.sweep(now, expired);
            self.account(before, attempts.footprint());
        }
    }

    /// The most buckets the store holds.
    pub fn max_buckets(&self) -> usize {
        self.shard_cap * self.shards.len()
    }

    /// The most bytes of buckets the store holds (see [`BYTES_PER_BUCKET`]).
    pub fn max_bytes(&self) -> usize {
        self.shard_cap * BYTES_PER_BUCKET * self.shards.len()
    }

    /// The bytes the buckets held now are counted for.
    pub fn bytes(&self) -> usize {
        self.shards.iter().map(|s| s.lock().bytes).sum()
    }

    fn shard(&self, tag: &[u8]) -> &Shard {
        let h = self.hasher.hash_one(tag) as usize;
        &self.shards[h & (self.shards.len() - 1)]
    }

    /// Decides synchronously; the [`Store`] impl wraps this.
    pub fn decide_now(&self, descriptor: &DescriptorBuckets, cost: Cost) -> Vec<BucketOutcome> {
        let mut shard = self.shard(&descriptor.tag).lock();
        let now = self.clock.now_micros();
        let mut evicted = Vec::new();
        let outcomes = self.decide_in(&mut shard, descriptor, cost, now, &mut evicted, true);
        drop(shard);
        if !evicted.is_empty() {
            self.report(evicted);
        }
        outcomes
    }

    /// Decides one call of an attempt synchronously, its record read and
    /// written under the same lock as its buckets ([`crate::attempt`]).
    pub fn decide_attempt_now(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        call: &AttemptCall,
    ) -> AttemptOutcome {
        let mut shard = self.shard(&descriptor.tag).lock();
        let now = self.clock.now_micros();
        let mut evicted = Vec::new();
        let mut expired = Vec::new();
        let key = attempt_key(&descriptor.tag, &call.id);
        let record = shard.attempts.get(&key, now);
        let planned = attempt::plan(call, record.as_ref(), cost, now);
        let footprint = shard.attempts.footprint();
        let outcome = match planned.cost {
            // a repeat (or a reuse past the bound, which the limiter
            // refuses): answered from the buckets as they are (a refund of
            // nothing admits and writes nothing); a repeat of the live
            // start is counted in its record
            None => {
                if let Some(r) = attempt::after_repeat(call, record.as_ref(), &planned) {
                    shard.attempts.put(&key, r, rule_of(descriptor));
                }
                AttemptOutcome {
                    outcomes: self.decide_in(
                        &mut shard,
                        descriptor,
                        Cost::Refund(0),
                        now,
                        &mut evicted,
                        true,
                    ),
                    result: planned.result,
                    expired: 0,
                }
            }
            Some(cost)
                if planned.records
                    && record.is_none()
                    && !shard.attempts.has(&key)
                    && !self.record_room(
                        &mut shard.attempts,
                        &key,
                        call.phase == Phase::Done,
                        now,
                        &mut expired,
                    ) =>
            {
                if call.mode == AttemptMode::Reserve && call.phase == Phase::Start {
                    // a reservation nobody could settle is not taken
                    let mut outcomes = self.decide_in(
                        &mut shard,
                        descriptor,
                        Cost::Refund(0),
                        now,
                        &mut evicted,
                        true,
                    );
                    for o in &mut outcomes {
                        o.admitted = false;
                        o.retry_after_secs = Some(1);
                    }
                    AttemptOutcome {
                        outcomes,
                        result: AttemptResult::Full,
                        expired: 0,
                    }
                } else {
                    AttemptOutcome {
                        outcomes: self.decide_in(
                            &mut shard,
                            descriptor,
                            cost,
                            now,
                            &mut evicted,
                            true,
                        ),
                        result: AttemptResult::Full,
                        expired: 0,
                    }
                }
            }
            Some(cost) => {
                // a reservation refused took nothing, a fixed window's too
                let refused_counts =
                    !(call.mode == AttemptMode::Reserve && call.phase == Phase::Start);
                let outcomes = self.decide_in(
                    &mut shard,
                    descriptor,
                    cost,
                    now,
                    &mut evicted,
                    refused_counts,
                );
                let admitted = outcomes.iter().all(|o| o.admitted);
                let taken = if admitted {
                    u64::try_from(cost.deducted()).unwrap_or(0)
                } else {
                    0
                };
                if attempt::drops_record(call, &planned) {
                    shard.attempts.remove(&key);
                } else if let Some(r) =
                    attempt::record_after(call, record.as_ref(), &planned, admitted, taken, now)
                {
                    shard.attempts.put(&key, r, rule_of(descriptor));
                }
                AttemptOutcome {
                    outcomes,
                    result: planned.result,
                    expired: 0,
                }
            }
        };
        self.account(footprint, shard.attempts.footprint());
        drop(shard);
        if !evicted.is_empty() {
            self.report(evicted);
        }
        self.report_expired(expired);
        outcome
    }

    /// One call of a `concurrency` rule's attempt on `descriptor`'s slots
    /// (at most `max`), synchronously, under its shard's lock.
    pub fn decide_slot_now(
        &self,
        descriptor: &DescriptorBuckets,
        max: u64,
        call: &AttemptCall,
        rule: RuleId,
    ) -> SlotOutcome {
        let mut shard = self.shard(&descriptor.tag).lock();
        let now = self.clock.now_micros();
        let key = slots_key(&descriptor.tag);
        let before = shard.attempts.footprint();
        let mut expired = Vec::new();
        let full = call.phase == Phase::Start
            && !self.attempt_room(
                &mut shard.attempts,
                record_bytes(&call.id) + key.len(),
                false,
                now,
                &mut expired,
            );
        // the slots that returned by themselves are in the outcome, for the
        // caller to count (the sweep counts those it drops)
        let outcome = shard.attempts.slot(&key, max, call, rule, full, now);
        self.account(before, shard.attempts.footprint());
        drop(shard);
        self.report_expired(expired);
        outcome
    }

    /// Decides `cost` against `descriptor`'s buckets in its locked `shard`.
    /// A fixed window counts a refused hit unless `refused_counts` is
    /// false (a reservation's start: refused, it took nothing).
    fn decide_in(
        &self,
        shard: &mut ShardState,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        now: u64,
        evicted: &mut Vec<RuleId>,
        refused_counts: bool,
    ) -> Vec<BucketOutcome> {
        let params: Vec<_> = descriptor.buckets.iter().map(|b| b.params).collect();
        let byte_cap = self.shard_cap * BYTES_PER_BUCKET;
        let caps = (self.shard_cap, byte_cap);
        // where each bucket is kept: its own key, or, for a new one in a
        // shard where only throttled clients' buckets could make room, its
        // rule's overflow bucket
        // (borrowed: a decision on a bucket held copies no key)
        let keys: Vec<std::borrow::Cow<'_, [u8]>> = descriptor
            .buckets
            .iter()
            .map(|b| {
                // (a check stores nothing: it needs no room)
                if cost.deducted() == 0 || shard.buckets.contains_key(b.key.as_slice()) {
                    return b.key.as_slice().into();
                }
                let incoming = bucket_bytes(&b.key);
                let full =
                    shard.buckets.len() >= self.shard_cap || shard.bytes + incoming > byte_cap;
                if !full || make_room(shard, caps, incoming, now, evicted, true) {
                    b.key.as_slice().into()
                } else {
                    overflow_key(b.rule).into()
                }
            })
            .collect();
        let states: Vec<Option<BucketState>> = keys
            .iter()
            .map(|k| shard.buckets.get(k.as_ref()).map(|e| e.state))
            .collect();
        let algorithm = params
            .first()
            .map_or(Algorithm::TokenBucket, |p| p.algorithm);
        let fixed_window = algorithm == Algorithm::FixedWindow;
        let (new_states, outcomes) = match algorithm {
            Algorithm::TokenBucket => bucket::decide(&params, &states, now, cost),
            Algorithm::FixedWindow | Algorithm::CalendarWindow => {
                crate::window::decide(&params, &states, now, cost)
            }
            Algorithm::SlidingWindow => crate::window::sliding::decide(&params, &states, now, cost),
        };
        // Only an admitted request that spends (or refunds), or a charge,
        // changes anything: a rejection or a check leaves the state as it
        // was (refill is a pure function of it). In a fixed window every
        // hit counts, refused or not.
        let admitted = outcomes.first().is_some_and(|o| o.admitted);
        let charged =
            matches!(cost, Cost::Charge(_)) && outcomes.first().is_some_and(|o| o.taken > 0);
        let writes = (admitted && cost.deducted() != 0)
            || charged
            || (fixed_window && refused_counts && cost.deducted() > 0);
        if !writes {
            // Nothing to store, but a reload may have lowered the rate since
            // the bucket was written: it is full later now, not at the time
            // its old numbers gave (the Lua script lengthens the TTL alike).
            for ((key, p), o) in keys.iter().zip(&params).zip(&outcomes) {
                if let Some(e) = shard.buckets.get_mut(key.as_ref()) {
                    e.full_at = e.full_at.max(FullAt::of(p.full_at_micros(&e.state)));
                    e.capacity = p.capacity as f32;
                    e.rate = p.rate_per_sec() as f32;
                    e.use_.touch(now);
                    if !o.admitted {
                        e.rejected.set(now);
                    }
                }
            }
        }
        if writes {
            for (((b, key), state), p) in descriptor
                .buckets
                .iter()
                .zip(&keys)
                .zip(new_states)
                .zip(&params)
            {
                if p.rate_per_sec() <= 0.0 && p.algorithm != Algorithm::FixedWindow {
                    // rate 0 (only a refund gets here): never refills,
                    // nothing of it is worth keeping; a fixed window's
                    // count is kept whatever its limit (every hit counts:
                    // a check after hits on a limit of 0 is over, as
                    // envoyproxy/ratelimit's `INCRBY 0` and the Lua copy)
                    continue;
                }
                let full_at = FullAt::of(p.full_at_micros(&state));
                match shard.buckets.get_mut(key.as_ref()) {
                    Some(e) => {
                        e.state = state;
                        e.full_at = full_at;
                        e.rule = b.rule;
                        e.capacity = p.capacity as f32;
                        e.rate = p.rate_per_sec() as f32;
                        e.use_.touch(now);
                    }
                    None => {
                        let entry = Entry::new(state, p, b.rule, now);
                        let incoming = bucket_bytes(key);
                        // a rule's overflow bucket takes nobody's place: a
                        // shard holds one per rule beyond its share
                        if (shard.buckets.len() >= self.shard_cap
                            || shard.bytes + incoming > byte_cap)
                            && !key.starts_with(OVERFLOW_PREFIX)
                        {
                            make_room(shard, caps, incoming, now, evicted, false);
                        }
                        shard.bytes += incoming;
                        shard.buckets.insert(key.to_vec().into_boxed_slice(), entry);
                    }
                }
            }
        }
        outcomes
    }

    /// Tells the attempt sink of reservations that expired unsettled.
    fn report_expired(&self, mut expired: Vec<RuleId>) {
        let Some(sink) = &self.on_expired else {
            return;
        };
        expired.sort_unstable();
        for run in expired.chunk_by(|a, b| a == b) {
            sink(run[0], run.len() as u64);
        }
    }

    /// Tells the sink about evictions, one call per rule.
    fn report(&self, mut evicted: Vec<RuleId>) {
        let Some(sink) = &self.on_evict else {
            return;
        };
        evicted.sort_unstable();
        for run in evicted.chunk_by(|a, b| a == b) {
            sink(run[0], run.len() as u64);
        }
    }

    /// Drops every bucket that is full again; returns how many were dropped.
    pub fn evict_full(&self) -> usize {
        let now = self.clock.now_micros();
        let mut dropped = 0;
        let mut expired = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let before = shard.attempts.footprint();
            shard.attempts.sweep(now, &mut expired);
            self.account(before, shard.attempts.footprint());
            let before = shard.buckets.len();
            shard.retain(|_, e| !e.full_at.passed(now));
            dropped += before - shard.buckets.len();
            let buckets = &mut shard.buckets;
            if buckets.capacity() > 64 && buckets.capacity() > buckets.len() * 4 {
                buckets.shrink_to_fit();
            }
        }
        self.report_expired(expired);
        dropped
    }

    /// Buckets currently held (not full).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().buckets.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<C: Clock> MemoryStore<C> {
    /// Runs [`MemoryStore::evict_full`] every `every` until the store is
    /// dropped, and sets the `rls_buckets` gauge.
    pub fn spawn_sweeper(self: &Arc<Self>, every: Duration, metrics: Arc<Metrics>) {
        metrics.buckets_held("memory", 0);
        crate::periodic::spawn_every(self, every, move |store| {
            store.evict_full();
            metrics.buckets_held("memory", store.len());
        });
    }
}

/// The rule an attempt's record is counted for: its descriptor's.
fn rule_of(descriptor: &DescriptorBuckets) -> RuleId {
    descriptor
        .buckets
        .first()
        .map(|b| b.rule)
        .unwrap_or_default()
}

#[async_trait]
impl<C: Clock> Store for MemoryStore<C> {
    fn answers_at_once(&self) -> bool {
        true
    }

    async fn decide(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        Ok(self.decide_now(descriptor, cost))
    }

    async fn decide_attempt(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        call: &AttemptCall,
        _patience: Option<Duration>,
    ) -> Result<AttemptOutcome, StoreError> {
        Ok(self.decide_attempt_now(descriptor, cost, call))
    }

    async fn decide_slot(
        &self,
        descriptor: &DescriptorBuckets,
        max: u64,
        call: &AttemptCall,
        rule: RuleId,
        _patience: Option<Duration>,
    ) -> Result<SlotOutcome, StoreError> {
        Ok(self.decide_slot_now(descriptor, max, call, rule))
    }

    async fn held(&self, descriptor: &DescriptorBuckets) -> Result<Held, StoreError> {
        let shard = self.shard(&descriptor.tag).lock();
        let now = self.clock.now_micros();
        let debts = descriptor
            .buckets
            .iter()
            .map(|b| match shard.buckets.get(b.key.as_slice()) {
                Some(entry) if b.params.algorithm == Algorithm::TokenBucket => {
                    debt_of(b.params.refill(Some(entry.state), now).tokens)
                }
                _ => 0,
            })
            .collect();
        // a descriptor's records share the key up to the id's length
        let record = attempt_key(&descriptor.tag, b"");
        let prefix = &record[..record.len().saturating_sub(1)];
        Ok(Held {
            debts,
            reservations: shard.attempts.reservations_under(prefix, now),
            slots: shard.attempts.slots_under(&slots_key(&descriptor.tag), now),
        })
    }

    async fn forget(&self, descriptor: &DescriptorBuckets) -> Result<u64, StoreError> {
        let mut shard = self.shard(&descriptor.tag).lock();
        let before = shard.buckets.len();
        shard.retain(|k, _| !descriptor.buckets.iter().any(|b| b.key.as_slice() == k));
        Ok((before - shard.buckets.len()) as u64)
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests;
