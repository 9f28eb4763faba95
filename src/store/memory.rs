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

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

use super::{DescriptorBuckets, Store, StoreError};
use crate::bucket::{self, BucketOutcome, BucketParams, BucketState, Cost};
use crate::clock::Clock;
use crate::labels::RuleId;
use crate::telemetry::Metrics;

/// Buckets held at most unless told otherwise (`--max-buckets`): about
/// 340 MB at the measured 168 bytes per bucket with short values.
pub const DEFAULT_MAX_BUCKETS: usize = 2_000_000;

/// A bucket's state, the clock's second by which it is full again (and can
/// be forgotten; rounded up), the rule it belongs to (for counting
/// evictions), its size and refill (for what evicting it gives back), and
/// how it is used and when it last rejected. 40 bytes, packed to keep a
/// million idle buckets near 160 MB.
#[derive(Debug, Clone, Copy)]
struct Entry {
    state: BucketState,
    full_at: FullAt,
    rule: RuleId,
    use_: Use,
    rejected: Rejected,
    capacity: f32,
    /// Tokens per second.
    rate: f32,
}

impl Entry {
    fn new(state: BucketState, params: &BucketParams, rule: RuleId, now_micros: u64) -> Self {
        Self {
            state,
            full_at: FullAt::of(params.full_at_micros(&state)),
            rule,
            use_: Use::first(now_micros),
            rejected: Rejected::default(),
            capacity: params.capacity as f32,
            rate: params.rate_per_sec() as f32,
        }
    }

    /// Tokens it misses at `now`: what evicting it would give back.
    fn missing(&self, now_micros: u64) -> f32 {
        let elapsed = now_micros.saturating_sub(self.state.updated_micros) as f32 / 1e6;
        let tokens = self.state.tokens as f32 + self.rate * elapsed;
        // a bucket in debt (`overdraft`) gives back more than its burst
        (self.capacity - tokens).clamp(0.0, 2.0 * self.capacity.max(0.0))
    }

    /// Its rank for eviction: lowest first (see the module's doc).
    fn eviction_rank(&self, now_micros: u64) -> (bool, bool, u32) {
        // the bits of an f32 ≥ 0 order like the numbers
        (
            self.rejected.recently(now_micros),
            self.use_.tier(now_micros) == 2,
            self.missing(now_micros).to_bits(),
        )
    }
}

/// How a bucket is used, for eviction.
#[derive(Debug, Clone, Copy)]
struct Use {
    /// The clock's second (mod 256) of the bucket's last decision.
    touched_secs: u8,
    /// Decisions in a row, each at most a second or so after the last.
    streak: u8,
}

impl Use {
    fn first(now: u64) -> Self {
        Self {
            touched_secs: secs(now),
            streak: 1,
        }
    }

    fn touch(&mut self, now: u64) {
        let now = secs(now);
        self.streak = if now.wrapping_sub(self.touched_secs) <= 1 {
            self.streak.saturating_add(1)
        } else {
            1
        };
        self.touched_secs = now;
    }

    /// 0: idle (no decision in this second or the one before); 1: recent,
    /// once (as each of a flood of new values is); 2: in steady use.
    fn tier(self, now: u64) -> u8 {
        match (secs(now).wrapping_sub(self.touched_secs) <= 1, self.streak) {
            (false, _) => 0,
            (true, 1) => 1,
            (true, _) => 2,
        }
    }
}

/// A bucket that rejected within this many seconds counts as throttling
/// its client, and is evicted last.
pub const REJECTED_RECENTLY_SECS: u32 = 120;

/// When a bucket last rejected a request: the clock's whole second plus
/// one (0: never). A second kept in a `u8` wrapped every 256 s, so that a
/// bucket that rejected once ranked as "rejected recently" for 121 of
/// every 256 s, for ever; a `u32` wraps after 136 years.
#[derive(Debug, Clone, Copy, Default)]
struct Rejected(u32);

impl Rejected {
    fn set(&mut self, now_micros: u64) {
        self.0 = whole_secs(now_micros).saturating_add(1);
    }

    fn recently(self, now_micros: u64) -> bool {
        self.0 != 0
            && whole_secs(now_micros)
                .saturating_add(1)
                .saturating_sub(self.0)
                <= REJECTED_RECENTLY_SECS
    }
}

/// The clock's whole second (136 years before it stops counting).
fn whole_secs(micros: u64) -> u32 {
    u32::try_from(micros / 1_000_000).unwrap_or(u32::MAX)
}

/// The clock's whole second by which a bucket is full, rounded up;
/// `u32::MAX`: never (136 years).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct FullAt(u32);

impl FullAt {
    fn of(micros: Option<u64>) -> Self {
        match micros {
            Some(m) => FullAt(u32::try_from(m.div_ceil(1_000_000)).unwrap_or(u32::MAX)),
            None => FullAt(u32::MAX),
        }
    }

    /// Whether the bucket is full at `now_micros`.
    fn passed(self, now_micros: u64) -> bool {
        u64::from(self.0) * 1_000_000 <= now_micros
    }
}

/// The clock's whole second, as kept in [`Use`] (wrapping: only
/// differences of a second or two are read).
fn secs(micros: u64) -> u8 {
    (micros / 1_000_000) as u8
}

type Buckets = HashMap<Box<[u8]>, Entry>;

/// What a bucket is counted for against the store's memory: its entry, its
/// map slot and allocation, and its key.
pub const BUCKET_FIXED_BYTES: usize = 136;
/// The memory one bucket of `--max-buckets` stands for: what a bucket with a
/// short key costs (168 bytes measured, keys of about 32 bytes). A store of
/// N buckets holds at most N × this many bytes of buckets, so buckets with
/// long values count for more than one.
pub const BYTES_PER_BUCKET: usize = 168;

fn bucket_bytes(key: &[u8]) -> usize {
    BUCKET_FIXED_BYTES + key.len()
}

/// One shard's buckets and the bytes they are counted for.
#[derive(Debug, Default)]
struct ShardState {
    buckets: Buckets,
    bytes: usize,
}

impl ShardState {
    /// Keeps the buckets `keep` says to keep (told each one's key),
    /// counting what goes.
    fn retain(&mut self, mut keep: impl FnMut(&[u8], &Entry) -> bool) {
        let mut freed = 0;
        self.buckets.retain(|k, e| {
            let kept = keep(k, e);
            if !kept {
                freed += bucket_bytes(k);
            }
            kept
        });
        self.bytes -= freed;
    }
}

#[cfg(test)]
impl From<Buckets> for ShardState {
    fn from(buckets: Buckets) -> Self {
        let bytes = buckets.keys().map(|k| bucket_bytes(k)).sum();
        Self { buckets, bytes }
    }
}

type Shard = Mutex<ShardState>;

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
        let params: Vec<_> = descriptor.buckets.iter().map(|b| b.params).collect();
        let mut shard = self.shard(&descriptor.tag).lock();
        let now = self.clock.now_micros();
        let byte_cap = self.shard_cap * BYTES_PER_BUCKET;
        let caps = (self.shard_cap, byte_cap);
        let mut evicted = Vec::new();
        // where each bucket is kept: its own key, or, for a new one in a
        // shard where only throttled clients' buckets could make room, its
        // rule's overflow bucket
        let keys: Vec<Vec<u8>> = descriptor
            .buckets
            .iter()
            .map(|b| {
                // (a check stores nothing: it needs no room)
                if cost.deducted() == 0 || shard.buckets.contains_key(b.key.as_slice()) {
                    return b.key.clone();
                }
                let incoming = bucket_bytes(&b.key);
                let full =
                    shard.buckets.len() >= self.shard_cap || shard.bytes + incoming > byte_cap;
                if !full || make_room(&mut shard, caps, incoming, now, &mut evicted, true) {
                    b.key.clone()
                } else {
                    overflow_key(b.rule)
                }
            })
            .collect();
        let states: Vec<Option<BucketState>> = keys
            .iter()
            .map(|k| shard.buckets.get(k.as_slice()).map(|e| e.state))
            .collect();
        let (new_states, outcomes) = bucket::decide(&params, &states, now, cost);
        // Only an admitted request that spends (or refunds), or a charge,
        // changes anything: a rejection or a check leaves the state as it
        // was (refill is a pure function of it).
        let admitted = outcomes.first().is_some_and(|o| o.admitted);
        let charged =
            matches!(cost, Cost::Charge(_)) && outcomes.first().is_some_and(|o| o.taken > 0);
        let writes = (admitted && cost.deducted() != 0) || charged;
        if !writes {
            // Nothing to store, but a reload may have lowered the rate since
            // the bucket was written: it is full later now, not at the time
            // its old numbers gave (the Lua script lengthens the TTL alike).
            for ((key, p), o) in keys.iter().zip(&params).zip(&outcomes) {
                if let Some(e) = shard.buckets.get_mut(key.as_slice()) {
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
                if p.rate_per_sec() <= 0.0 {
                    // rate 0 (only a refund gets here): never refills,
                    // nothing of it is worth keeping
                    continue;
                }
                let full_at = FullAt::of(p.full_at_micros(&state));
                match shard.buckets.get_mut(key.as_slice()) {
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
                            make_room(&mut shard, caps, incoming, now, &mut evicted, false);
                        }
                        shard.bytes += incoming;
                        shard.buckets.insert(key.clone().into_boxed_slice(), entry);
                    }
                }
            }
        }
        drop(shard);
        if !evicted.is_empty() {
            self.report(evicted);
        }
        outcomes
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
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let before = shard.buckets.len();
            shard.retain(|_, e| !e.full_at.passed(now));
            dropped += before - shard.buckets.len();
            let buckets = &mut shard.buckets;
            if buckets.capacity() > 64 && buckets.capacity() > buckets.len() * 4 {
                buckets.shrink_to_fit();
            }
        }
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

/// What an overflow bucket's key starts with: never a request's (those
/// are text).
const OVERFLOW_PREFIX: &[u8] = b"\xffoverflow:";

/// The key of `rule`'s overflow bucket in a shard.
fn overflow_key(rule: RuleId) -> Vec<u8> {
    let mut key = OVERFLOW_PREFIX.to_vec();
    key.extend_from_slice(&(rule.index() as u64).to_le_bytes());
    key
}

/// Makes room in a shard at one of its caps (buckets, bytes) for a bucket
/// of `incoming` bytes: drops those full already, and if that does not
/// leave an eighth of both caps free, the cheapest others (see the
/// module's doc) until it does; with `spare_throttled`, never a bucket that
/// rejected recently. Whether there is room now. Evicted buckets' rules go
/// to `evicted`.
fn make_room(
    shard: &mut ShardState,
    (cap, byte_cap): (usize, usize),
    incoming: usize,
    now: u64,
    evicted: &mut Vec<RuleId>,
    spare_throttled: bool,
) -> bool {
    let target = cap - (cap / 8).max(1);
    let byte_target = byte_cap - byte_cap / 8;
    shard.retain(|_, e| !e.full_at.passed(now));
    let need_count = shard.buckets.len().saturating_sub(target);
    let need_bytes = (shard.bytes + incoming).saturating_sub(byte_target);
    if need_count == 0 && need_bytes == 0 {
        return true;
    }
    // Order of eviction: see the module's doc. Take the cheapest until both
    // are freed, then drop everything cheaper than the last one taken and as
    // many of its equals as were taken.
    let rank = |e: &Entry| e.eviction_rank(now);
    // an overflow bucket is never evicted (one per rule: evicting it would
    // refund every value that shares it); swept once full like any other
    let mut ranks: Vec<((bool, bool, u32), usize)> = shard
        .buckets
        .iter()
        .filter(|(k, _)| !k.starts_with(OVERFLOW_PREFIX))
        .map(|(k, e)| (rank(e), bucket_bytes(k)))
        .collect();
    ranks.sort_unstable_by_key(|r| r.0);
    let (mut taken, mut freed) = (0, 0);
    for (rank, bytes) in &ranks {
        if taken >= need_count && freed >= need_bytes {
            break;
        }
        if spare_throttled && rank.0 {
            // the rest rejected recently: spared
            break;
        }
        taken += 1;
        freed += bytes;
    }
    let room = taken >= need_count && freed >= need_bytes
        // what a bucket's removal at the caps needs, at the least
        || (shard.buckets.len() - taken < cap && shard.bytes - freed + incoming <= byte_cap);
    let Some(&(last, _)) = taken.checked_sub(1).and_then(|i| ranks.get(i)) else {
        return room;
    };
    let mut equal_quota = ranks[..taken].iter().filter(|r| r.0 == last).count();
    shard.retain(|k, e| {
        if k.starts_with(OVERFLOW_PREFIX) {
            return true;
        }
        let r = rank(e);
        let drop = r < last || (r == last && equal_quota > 0);
        if drop {
            if r == last {
                equal_quota -= 1;
            }
            evicted.push(e.rule);
        }
        !drop
    });
    room
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

#[async_trait]
impl<C: Clock> Store for MemoryStore<C> {
    async fn decide(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        Ok(self.decide_now(descriptor, cost))
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::store::BucketRef;

    fn descriptor(key: &str, capacity: u64, rate: u64) -> DescriptorBuckets {
        DescriptorBuckets {
            tag: key.as_bytes().to_vec(),
            buckets: vec![BucketRef {
                key: key.as_bytes().to_vec(),
                rule: Default::default(),
                params: BucketParams {
                    capacity,
                    tokens_per_unit: rate,
                    unit_secs: 1,
                },
            }],
        }
    }

    #[test]
    fn admits_exactly_the_burst_then_refills() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::new(clock.clone());
        let d = descriptor("a", 3, 1);
        let admitted = (0..10)
            .filter(|_| store.decide_now(&d, Cost::Spend(1))[0].admitted)
            .count();
        assert_eq!(admitted, 3);
        clock.advance_secs_f64(1.0);
        assert!(store.decide_now(&d, Cost::Spend(1))[0].admitted);
        assert!(!store.decide_now(&d, Cost::Spend(1))[0].admitted);
    }

    #[test]
    fn rejections_and_checks_store_nothing() {
        let store = MemoryStore::new(ManualClock::new(1));
        store.decide_now(&descriptor("big", 2, 1), Cost::Spend(5));
        store.decide_now(&descriptor("check", 2, 1), Cost::Check);
        store.decide_now(&descriptor("zero", 0, 0), Cost::Spend(1));
        assert!(store.is_empty());
    }

    /// Audit 6: a reload lowers the rate of a drained bucket; a decision
    /// after it moves the time the bucket is forgotten to the new numbers.
    #[test]
    fn a_lowered_rate_keeps_the_bucket_until_the_new_full_time() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::new(clock.clone());
        let fast = descriptor("k", 5, 1); // {second, 1, burst 5}
        for _ in 0..5 {
            assert!(store.decide_now(&fast, Cost::Spend(1))[0].admitted);
        }
        let mut slow = fast.clone(); // reloaded: {hour, 1, burst 5}
        slow.buckets[0].params.unit_secs = 3600;
        clock.advance_secs_f64(1.5);
        let o = store.decide_now(&slow, Cost::Check)[0];
        assert_eq!(o.retry_after_secs, Some(3599), "1.5 s of the new rate");
        clock.advance_secs_f64(5.0);
        assert_eq!(store.evict_full(), 0, "not full under the new rate");
        let admitted = (0..6)
            .filter(|_| store.decide_now(&slow, Cost::Spend(1))[0].admitted)
            .count();
        assert_eq!(admitted, 0, "6.5 s at one per hour refill no token");
    }

    #[test]
    fn full_buckets_are_evicted_and_others_kept() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::new(clock.clone());
        for i in 0..100 {
            store.decide_now(&descriptor(&format!("fast{i}"), 10, 10), Cost::Spend(1));
        }
        store.decide_now(&descriptor("slow", 10, 1), Cost::Spend(5));
        assert_eq!(store.len(), 101);
        assert_eq!(store.evict_full(), 0, "nothing full yet");
        clock.advance_secs_f64(0.2); // fast buckets needed 0.1 s
        assert_eq!(store.evict_full(), 0, "kept to the whole second");
        clock.advance_secs_f64(0.8);
        assert_eq!(store.evict_full(), 100);
        assert_eq!(store.len(), 1);
        clock.advance_secs_f64(5.0);
        assert_eq!(store.evict_full(), 1);
        // a forgotten bucket behaves as a full one
        let d = descriptor("slow", 10, 1);
        assert_eq!(store.decide_now(&d, Cost::Spend(1))[0].remaining, 9);
    }

    /// One bucket of `rule` for `key`: burst 10, one token per second.
    fn of_rule(key: &str, rule: RuleId) -> DescriptorBuckets {
        let mut d = descriptor(key, 10, 1);
        d.buckets[0].rule = rule;
        d
    }

    type Counted = Arc<parking_lot::Mutex<HashMap<RuleId, u64>>>;

    fn counting() -> (Counted, EvictionSink) {
        let counted: Counted = Arc::default();
        let c = counted.clone();
        (
            counted,
            Arc::new(move |rule, n| *c.lock().entry(rule).or_default() += n),
        )
    }

    /// A bucket of `capacity` holding `tokens` at `now` (refill 1/s, full
    /// `capacity - tokens` seconds later), which rejected at `rejected`.
    fn entry(capacity: u64, tokens: f64, rejected: Option<u64>, rule: RuleId) -> Entry {
        let now = 1_000 * 1_000_000;
        let params = BucketParams {
            capacity,
            tokens_per_unit: 1,
            unit_secs: 1,
        };
        let state = BucketState {
            tokens,
            updated_micros: now,
        };
        // decided once, 50 s ago: not in steady use
        let mut e = Entry::new(state, &params, rule, now - 50_000_000);
        if let Some(at) = rejected {
            e.rejected.set(at);
        }
        e
    }

    #[test]
    fn an_entry_is_40_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 40);
    }

    /// A bucket that rejected once ranks as throttling for 120 s, and then
    /// never again (with a second kept mod 256 it did for 121 of every
    /// 256 s).
    #[test]
    fn a_rejection_is_recent_for_120_seconds_only() {
        let s = 1_000_000;
        let at = 1_000 * s;
        let mut r = Rejected::default();
        assert!(!r.recently(at));
        r.set(at);
        assert!(r.recently(at));
        assert!(r.recently(at + 120 * s));
        assert!(!r.recently(at + 121 * s));
        for later in [256, 300, 512, 10_000] {
            assert!(!r.recently(at + later * s), "{later} s later");
        }
    }

    #[test]
    fn making_room_drops_the_full_then_those_missing_fewest_tokens_and_rejecting_last() {
        let now = 1_000 * 1_000_000;
        let (a, b) = (RuleId::of("t", "a"), RuleId::of("t", "b"));
        let mut shard = Buckets::new();
        let mut put = |name: &str, e: Entry| shard.insert(name.as_bytes().into(), e);
        put("full", entry(10, 10.0, None, a)); // full already: dropped, not counted
        for i in 0..8 {
            put(
                &format!("near{i}"),
                entry(100, 99.0 - f64::from(i), None, a),
            ); // misses 1 + i
            put(&format!("drained{i}"), entry(100, 0.0, None, b)); // misses 100
                                                                   // misses only 1, but rejected (a throttled client's cost-5 requests) 3 s ago
            put(
                &format!("rejecting{i}"),
                entry(100, 99.0, Some(now - 3_000_000), b),
            );
        }
        let mut evicted = Vec::new();
        // cap 24: one pass frees an eighth, down to 21
        let mut state = ShardState::from(shard);
        make_room(&mut state, (24, usize::MAX), 0, now, &mut evicted, false);
        let shard = state.buckets;
        assert_eq!(shard.len(), 21);
        assert_eq!(evicted, vec![a, a, a], "the three missing fewest tokens");
        for i in 0..3 {
            assert!(!shard.contains_key(format!("near{i}").as_bytes()));
        }
        assert!(shard.contains_key(b"near3".as_slice()));
        // only drained and rejecting ones left: the drained go first, the
        // rejecting after every other
        let shard: Buckets = (0..4)
            .flat_map(|i| {
                [
                    (format!("drained{i}"), entry(100, 0.0, None, a)),
                    (format!("rejecting{i}"), entry(100, 99.0, Some(now), b)),
                ]
            })
            .map(|(k, e)| (k.into_bytes().into(), e))
            .collect();
        evicted.clear();
        let mut state = ShardState::from(shard);
        make_room(&mut state, (8, usize::MAX), 0, now, &mut evicted, false);
        assert_eq!(evicted, vec![a]);
        // a rejection long ago no longer protects
        let old = now - (u64::from(REJECTED_RECENTLY_SECS) + 5) * 1_000_000;
        let shard: Buckets = [
            ("old", entry(100, 90.0, Some(old), a)),
            ("recent", entry(100, 99.0, Some(now), b)),
        ]
        .into_iter()
        .map(|(k, e)| (k.as_bytes().into(), e))
        .collect();
        evicted.clear();
        let mut state = ShardState::from(shard);
        make_room(&mut state, (2, usize::MAX), 0, now, &mut evicted, false);
        assert_eq!(evicted, vec![a]);
    }

    /// A login rule's bucket for `user`: 1 an hour, burst 5.
    fn login(user: &str) -> DescriptorBuckets {
        DescriptorBuckets {
            tag: user.as_bytes().to_vec(),
            buckets: vec![BucketRef {
                key: user.as_bytes().to_vec(),
                rule: RuleId::of("auth", "login"),
                params: BucketParams {
                    capacity: 5,
                    tokens_per_unit: 1,
                    unit_secs: 3600,
                },
            }],
        }
    }

    /// The audit's case: a rule of 1/hour, burst 5; alice spends her five
    /// and is rejected three times; 3 s later a flood of new values fills
    /// the store many times over. She gets nothing more: her drained,
    /// rejecting bucket is never the one evicted (it was: idle buckets went
    /// first, and hers was idle for 3 s).
    #[test]
    fn a_flood_of_new_values_never_hands_a_throttled_client_its_budget_back() {
        let clock = ManualClock::new(1_000_000);
        let (counted, sink) = counting();
        let store = MemoryStore::with_cap(clock.clone(), 1024, Some(sink));
        let alice = login("alice");
        let mut answers = String::new();
        let spend = |answers: &mut String| {
            for _ in 0..8 {
                let ok = store.decide_now(&alice, Cost::Spend(1))[0].admitted;
                answers.push(if ok { 'A' } else { 'r' });
            }
        };
        spend(&mut answers);
        clock.advance_secs_f64(3.0);
        for i in 0..3_000 {
            store.decide_now(&login(&format!("user{i}")), Cost::Spend(1));
            clock.advance_secs_f64(0.0005);
        }
        assert!(
            counted.lock().values().sum::<u64>() > 1_000,
            "the flood evicted"
        );
        spend(&mut answers);
        assert_eq!(answers, "AAAAArrrrrrrrrrr");
    }

    /// The second audit's case (#43 item 4): the flood's users each drain
    /// their bucket and are refused once, so their buckets are throttled
    /// too. Alice's is never evicted for them (before: it was, among
    /// equals, and she was admitted again with 4 left); new values that
    /// find only throttled buckets to evict share their rule's overflow
    /// bucket, which limits the flood as one client.
    #[test]
    fn a_flood_that_is_throttled_too_never_hands_a_throttled_client_its_budget_back() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::with_cap(clock.clone(), 1024, None);
        let alice = login("alice");
        for _ in 0..6 {
            store.decide_now(&alice, Cost::Spend(1));
        }
        assert!(!store.decide_now(&alice, Cost::Spend(1))[0].admitted);
        let mut flood_admitted = 0;
        for i in 0..3_000 {
            let user = login(&format!("user{i}"));
            for _ in 0..6 {
                flood_admitted += usize::from(store.decide_now(&user, Cost::Spend(1))[0].admitted);
            }
            clock.advance_secs_f64(0.0005);
        }
        assert!(
            !store.decide_now(&alice, Cost::Spend(1))[0].admitted,
            "alice was handed her budget back"
        );
        eprintln!("the flood's 3,000 users, 6 calls each: {flood_admitted} admitted");
        // beyond the cap: at most one overflow bucket per shard (one rule)
        assert!(store.len() <= store.max_buckets() + store.shards.len());
        // 3,000 users of 5 tokens each would be 15,000: the overflow
        // buckets (one per shard) held the flood to far less
        assert!(flood_admitted < 15_000, "{flood_admitted} admitted");
    }

    #[test]
    fn a_full_store_never_holds_more_than_its_cap_and_counts_every_eviction() {
        let clock = ManualClock::new(1_000_000);
        let (counted, sink) = counting();
        let store = MemoryStore::with_cap(clock.clone(), 1_000, Some(sink));
        let rule = RuleId::of("t", "flood");
        for i in 0..10_000 {
            let d = of_rule(&format!("k{i}"), rule);
            assert!(store.decide_now(&d, Cost::Spend(5))[0].admitted);
            assert!(store.len() <= store.max_buckets());
        }
        let evicted = counted.lock().get(&rule).copied().unwrap_or(0);
        assert_eq!(evicted as usize + store.len(), 10_000, "held or counted");
        assert!(store.len() >= store.max_buckets() * 7 / 8 - store.shards.len());
    }

    /// A flood of new values, each decided once and far from full, keeps
    /// the shard at its cap and turns it over every 1.2 s; a bucket in
    /// steady use (every 0.3 s) is nearer to full than any of them, and
    /// still is never evicted.
    #[test]
    fn a_bucket_in_steady_use_outlives_a_flood_of_new_values() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::with_cap(clock.clone(), 64 * 64, None);
        let shard_cap = store.shard_cap;
        let active = of_rule("active", RuleId::default()); // burst 10, 1/s
        let same_shard =
            |key: &str| std::ptr::eq(store.shard(key.as_bytes()), store.shard(b"active"));
        let mut flood = (0..).map(|i| format!("new{i}")).filter(|k| same_shard(k));
        let mut admitted = 0;
        for _ in 0..40 {
            // spends every 0.3 s while new values keep its shard full
            clock.advance_secs_f64(0.3);
            admitted += usize::from(store.decide_now(&active, Cost::Spend(1))[0].admitted);
            // a quarter of the shard: it turns over every 1.2 s
            for _ in 0..shard_cap / 4 {
                let key = flood.next().expect("endless");
                // 100 of 1,000 tokens gone at one per second: full in 100 s
                store.decide_now(&descriptor(&key, 1_000, 1), Cost::Spend(100));
            }
        }
        // burst 10, then one per second from 0.3 s to 12 s: exactly 10 + 11
        // (an eviction would have brought it back full)
        assert_eq!(admitted, 10 + 11);
    }

    /// The store is bounded in bytes, not only in buckets: with values of
    /// 1,000 bytes a bucket counts for about seven short ones (a bucket of
    /// 1,000-byte values cost 1,223 bytes against the 168 the cap assumed).
    #[test]
    fn long_keys_count_for_more_and_the_bytes_stay_under_the_cap() {
        let clock = ManualClock::new(1_000_000);
        let (counted, sink) = counting();
        let store = MemoryStore::with_cap(clock.clone(), 4096, Some(sink));
        let long = "v".repeat(1_000);
        for i in 0..20_000 {
            let d = of_rule(&format!("{long}{i}"), RuleId::default());
            assert!(store.decide_now(&d, Cost::Spend(5))[0].admitted);
            assert!(
                store.bytes() <= store.max_bytes(),
                "{} bytes",
                store.bytes()
            );
        }
        let held = store.len();
        assert!(held < store.max_buckets() / 6, "{held} long buckets held");
        let evicted = counted.lock().values().sum::<u64>() as usize;
        assert_eq!(evicted + held, 20_000, "held or counted");
        // keys of 1,001 to 1,005 bytes
        let per = store.bytes() as f64 / held as f64;
        assert!(
            (1_001.0..=1_005.0).contains(&(per - BUCKET_FIXED_BYTES as f64)),
            "{per}"
        );
        // counted alike on the way in and out
        clock.advance_secs_f64(100.0);
        store.evict_full();
        assert_eq!((store.len(), store.bytes()), (0, 0));
    }

    #[test]
    fn a_refund_on_a_rule_of_rate_0_is_admitted_and_stores_nothing() {
        let store = MemoryStore::new(ManualClock::new(1_000_000));
        let zero = descriptor("blocked", 0, 0);
        assert!(store.decide_now(&zero, Cost::Refund(2))[0].admitted);
        assert!(!store.decide_now(&zero, Cost::Spend(1))[0].admitted);
        assert_eq!(store.len(), 0);
    }

    #[test]
    fn concurrent_spending_admits_exactly_the_capacity() {
        let store = Arc::new(MemoryStore::new(ManualClock::new(1)));
        let d = descriptor("hot", 200, 0);
        let d = DescriptorBuckets {
            buckets: vec![BucketRef {
                params: BucketParams {
                    tokens_per_unit: 1,
                    unit_secs: 86_400,
                    ..d.buckets[0].params
                },
                ..d.buckets[0].clone()
            }],
            ..d
        };
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (store, d) = (store.clone(), d.clone());
                std::thread::spawn(move || {
                    (0..250)
                        .filter(|_| store.decide_now(&d, Cost::Spend(1))[0].admitted)
                        .count()
                })
            })
            .collect();
        let total: usize = handles.into_iter().map(|h| h.join().expect("thread")).sum();
        assert_eq!(total, 200);
    }
}
