use super::entry::Rejected;
use super::shard::{Buckets, ShardState};
use super::*;
use crate::attempt::{AttemptCall, AttemptMode, AttemptResult, Phase};
use crate::bucket::BucketParams;
use crate::clock::ManualClock;
use crate::store::BucketRef;
use std::collections::HashMap;

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
                max_debt: None,
                algorithm: Default::default(),
                period: None,
            },
        }],
        replication: None,
        ratelimit_key: None,
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
        max_debt: None,
        algorithm: Default::default(),
        period: None,
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
                max_debt: None,
                algorithm: Default::default(),
                period: None,
            },
        }],
        replication: None,
        ratelimit_key: None,
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
    let same_shard = |key: &str| std::ptr::eq(store.shard(key.as_bytes()), store.shard(b"active"));
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

/// A bucket of 100 that refills 1 a day: nothing refills within a test.
fn slow(key: &str) -> DescriptorBuckets {
    let mut d = descriptor(key, 100, 1);
    d.buckets[0].params.unit_secs = 86_400;
    d
}

fn attempt(id: &str, phase: Phase, mode: AttemptMode) -> AttemptCall {
    AttemptCall {
        id: id.as_bytes().to_vec(),
        phase,
        mode,
        ttl_micros: 10_000_000,
        max_repeats: 3,
    }
}

/// A reservation unsettled at its time to live is kept as spent and
/// counted once, by the sweep; a late done call still settles exactly; a
/// record is forgotten after twice the time to live.
#[test]
fn an_unsettled_reservation_expires_as_spent_and_a_late_settlement_is_exact() {
    let clock = ManualClock::new(1_000_000);
    let (counted, sink) = counting();
    let store = MemoryStore::with_cap(clock.clone(), 1_000, None).with_attempts(1_000, Some(sink));
    let d = slow("u");
    let start = attempt("a1", Phase::Start, AttemptMode::Reserve);
    let done = attempt("a1", Phase::Done, AttemptMode::Reserve);
    let o = store.decide_attempt_now(&d, Cost::Spend(60), &start);
    assert_eq!(
        (o.outcomes[0].admitted, o.outcomes[0].remaining),
        (true, 40)
    );
    clock.advance_micros(9_000_000);
    store.evict_full();
    assert!(counted.lock().is_empty(), "not expired yet");
    clock.advance_micros(1_000_000);
    store.evict_full();
    store.evict_full();
    assert_eq!(counted.lock().values().sum::<u64>(), 1, "counted once");
    // kept as spent: still 40 (rate 0: nothing refills)
    let late = store.decide_attempt_now(&d, Cost::Charge(10), &done);
    assert_eq!(late.result, AttemptResult::Late);
    assert_eq!(late.outcomes[0].remaining, 90, "50 of the 60 back");
    assert_eq!(store.attempts(), 1);
    clock.advance_micros(11_000_000);
    store.evict_full();
    assert_eq!(store.attempts(), 0, "forgotten after twice the ttl");
}

/// A shard with no room for a record refuses a reservation (nobody could
/// settle it) and decides a dedupe call without remembering it; a live
/// record is never dropped for a new one.
#[test]
fn a_full_attempt_table_refuses_reservations_and_keeps_its_live_records() {
    let clock = ManualClock::new(1_000_000);
    // one shard: every record in it
    let store = MemoryStore::with_cap(clock.clone(), 1, None).with_attempts(2, None);
    assert_eq!(store.max_attempts(), 2);
    let d = slow("u");
    for id in ["a", "b"] {
        let o = store.decide_attempt_now(
            &d,
            Cost::Spend(10),
            &attempt(id, Phase::Start, AttemptMode::Reserve),
        );
        assert_eq!(o.result, AttemptResult::First);
    }
    let o = store.decide_attempt_now(
        &d,
        Cost::Spend(10),
        &attempt("c", Phase::Start, AttemptMode::Reserve),
    );
    assert_eq!(o.result, AttemptResult::Full);
    assert!(!o.outcomes[0].admitted);
    assert_eq!(o.outcomes[0].remaining, 80, "nothing taken");
    let o = store.decide_attempt_now(
        &d,
        Cost::Spend(10),
        &attempt("d", Phase::Start, AttemptMode::Dedupe),
    );
    assert_eq!(
        (o.result, o.outcomes[0].admitted),
        (AttemptResult::Full, true)
    );
    // the live ones still settle
    let o = store.decide_attempt_now(
        &d,
        Cost::Charge(0),
        &attempt("a", Phase::Done, AttemptMode::Reserve),
    );
    assert_eq!(o.result, AttemptResult::Settled);
    assert_eq!(o.outcomes[0].remaining, 80, "70 after d, and a's 10 back");
    // once forgotten, room again
    clock.advance_micros(21_000_000);
    let o = store.decide_attempt_now(
        &d,
        Cost::Spend(10),
        &attempt("e", Phase::Start, AttemptMode::Reserve),
    );
    assert_eq!(o.result, AttemptResult::First);
}

/// The bound is the store's, not a shard's share: one hot descriptor may
/// hold three quarters of every record (with per-shard shares it held 1/32
/// of them and was refused past that, sweeping its shard on every call),
/// and since #65 no more: a quarter stays for the other descriptors.
#[test]
fn one_hot_descriptor_may_hold_three_quarters_of_the_attempt_bound() {
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::with_cap(clock.clone(), 1_000_000, None).with_attempts(100, None);
    let mut d = slow("hot");
    d.buckets[0].params.capacity = 1_000;
    for i in 0..75 {
        let o = store.decide_attempt_now(
            &d,
            Cost::Spend(1),
            &attempt(&format!("a{i}"), Phase::Start, AttemptMode::Dedupe),
        );
        assert_eq!(o.result, AttemptResult::First, "{i}");
    }
    assert_eq!(store.attempts(), 75);
    let o = store.decide_attempt_now(
        &d,
        Cost::Spend(1),
        &attempt("over", Phase::Start, AttemptMode::Dedupe),
    );
    assert_eq!(
        (o.result, o.outcomes[0].admitted),
        (AttemptResult::Full, true)
    );
    // another descriptor still finds room
    let other = slow("other");
    let o = store.decide_attempt_now(
        &other,
        Cost::Spend(1),
        &attempt("o1", Phase::Start, AttemptMode::Dedupe),
    );
    assert_eq!(o.result, AttemptResult::First);
    // forgotten after twice the ttl: the sweep frees them all
    clock.advance_micros(21_000_000);
    store.evict_full();
    assert_eq!(store.attempts(), 0);
}

/// A fixed window (#41) in the memory store: every hit counts, the refused
/// ones too (a refusal is stored, unlike a token bucket's), the next window
/// starts from nothing, and the count is forgotten when its window ends.
#[test]
fn a_fixed_window_counts_every_hit_and_is_forgotten_at_its_end() {
    let clock = ManualClock::new(600 * 1_000_000 + 30 * 1_000_000);
    let store = MemoryStore::new(clock.clone());
    let mut d = descriptor("fw", 2, 2);
    d.buckets[0].params.unit_secs = 60;
    d.buckets[0].params.algorithm = crate::bucket::Algorithm::FixedWindow;
    let outcomes: Vec<(bool, u64, Option<u64>)> = (0..4)
        .map(|_| {
            let o = store.decide_now(&d, Cost::Spend(1))[0];
            (o.admitted, o.remaining, o.retry_after_secs)
        })
        .collect();
    assert_eq!(
        outcomes,
        [
            (true, 1, None),
            (true, 0, None),
            (false, 0, Some(30)),
            (false, 0, Some(30))
        ]
    );
    assert_eq!(store.len(), 1, "the refused hits are stored");
    clock.advance_secs_f64(30.0);
    let next = store.decide_now(&d, Cost::Spend(1))[0];
    assert!(next.admitted);
    assert_eq!((next.remaining, next.full_in_secs), (1, 60));
    clock.advance_secs_f64(60.0);
    store.evict_full();
    assert!(store.is_empty(), "forgotten when its window ended");
}

#[test]
fn a_sliding_window_counts_admitted_hits_and_is_forgotten_when_it_weighs_nothing() {
    let clock = ManualClock::new(600 * 1_000_000 + 50 * 1_000_000);
    let store = MemoryStore::new(clock.clone());
    let mut d = descriptor("sw", 2, 2);
    d.buckets[0].params.unit_secs = 60;
    d.buckets[0].params.algorithm = crate::bucket::Algorithm::SlidingWindow;
    let outcomes: Vec<(bool, u64, Option<u64>)> = (0..3)
        .map(|_| {
            let o = store.decide_now(&d, Cost::Spend(1))[0];
            (o.admitted, o.remaining, o.retry_after_secs)
        })
        .collect();
    // full 50 s into the window: the next starts in 10 s, where these two
    // weigh 2, falling to 1 (room for one) 30 s after it
    assert_eq!(
        outcomes,
        [(true, 1, None), (true, 0, None), (false, 0, Some(40))]
    );
    // 10 s on, the window's edge: a fixed window would admit two more
    clock.advance_secs_f64(10.0);
    assert!(!store.decide_now(&d, Cost::Spend(1))[0].admitted);
    clock.advance_secs_f64(30.0);
    assert!(store.decide_now(&d, Cost::Spend(1))[0].admitted);
    assert!(!store.decide_now(&d, Cost::Spend(1))[0].admitted);
    // the one counted at 690 s weighs until 780 s
    clock.advance_secs_f64(89.0);
    store.evict_full();
    assert_eq!(store.len(), 1, "still weighs");
    clock.advance_secs_f64(1.0);
    store.evict_full();
    assert!(
        store.is_empty(),
        "forgotten two windows after the one it counted in"
    );
}

/// A slot start the attempt table has no room to remember is refused and
/// counted `full` (it was counted `first`), and the limiter answers it with
/// no slot left (it said three of three).
#[test]
fn a_slot_start_with_no_room_is_refused_as_full() {
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::with_cap(clock.clone(), 1, None).with_attempts(1, None);
    let d = slow("u");
    let rule = RuleId::of("streams", "user");
    let start = |id: &str| AttemptCall {
        ttl_micros: 10_000_000,
        max_repeats: 3,
        ..attempt(id, Phase::Start, AttemptMode::Slot)
    };
    let o = store.decide_slot_now(&d, 3, &start("a"), rule);
    assert_eq!((o.admitted, o.result), (true, AttemptResult::First));
    let e = slow("other");
    let o = store.decide_slot_now(&e, 3, &start("b"), rule);
    assert_eq!(
        (o.admitted, o.result, o.in_flight),
        (false, AttemptResult::Full, 0)
    );
}

/// Done calls of attempts never started are charged in full and kept only
/// while there is room: past `--max-attempts` they are counted `full` and
/// not remembered (500,000 of them took 92 MiB against the bound, issue
/// 51), and the table never holds more than its bound.
#[test]
fn done_calls_of_unknown_attempts_stay_within_the_attempt_bound() {
    let clock = ManualClock::new(1_000_000);
    // done-only records get a quarter of the bound: 2 of 8
    let store = MemoryStore::with_cap(clock.clone(), 1, None).with_attempts(8, None);
    let d = slow("u");
    let mut results = Vec::new();
    for i in 0..5 {
        let o = store.decide_attempt_now(
            &d,
            Cost::Charge(1),
            &attempt(&format!("never-{i}"), Phase::Done, AttemptMode::Reserve),
        );
        results.push(o.result);
        assert!(store.attempts() <= 2, "over the bound at {i}");
    }
    assert_eq!(
        results,
        [
            AttemptResult::Unknown,
            AttemptResult::Unknown,
            AttemptResult::Full,
            AttemptResult::Full,
            AttemptResult::Full
        ]
    );
    // each was charged in full, remembered or not
    let o = store.decide_attempt_now(
        &d,
        Cost::Check,
        &attempt("look", Phase::Start, AttemptMode::Dedupe),
    );
    assert_eq!(o.outcomes[0].remaining, 95);
    // #65: the flood took none of the starts' room: this descriptor takes
    // its share (6 of 8), another the rest, then the bound holds
    let v = slow("v");
    for (descriptor, n) in [(&d, 6), (&v, 2)] {
        for i in 0..n {
            let o = store.decide_attempt_now(
                descriptor,
                Cost::Spend(1),
                &attempt(&format!("start-{i}"), Phase::Start, AttemptMode::Reserve),
            );
            assert_eq!(o.result, AttemptResult::First, "start {i}");
        }
        let o = store.decide_attempt_now(
            descriptor,
            Cost::Spend(1),
            &attempt("one-too-many", Phase::Start, AttemptMode::Reserve),
        );
        assert_eq!(o.result, AttemptResult::Full, "a bound holds");
    }
}

/// #65 item 3: thousands of done calls for attempts never started (what
/// Envoy sends for requests it refused, or made-up ids) fill their own
/// room; another tenant's first start is still taken.
#[test]
fn a_flood_of_done_calls_never_refuses_another_tenants_start() {
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::with_cap(clock.clone(), 64, None).with_attempts(1000, None);
    let flooder = slow("flooder");
    for i in 0..5000 {
        let _ = store.decide_attempt_now(
            &flooder,
            Cost::Charge(0),
            &attempt(&format!("made-up-{i}"), Phase::Done, AttemptMode::Reserve),
        );
    }
    assert!(store.attempts() <= 250, "{}", store.attempts());
    // and its starts: at most three quarters of the bound
    let mut flooder_starts = 0;
    for i in 0..1000 {
        let o = store.decide_attempt_now(
            &flooder,
            Cost::Spend(0),
            &attempt(&format!("start-{i}"), Phase::Start, AttemptMode::Dedupe),
        );
        flooder_starts += usize::from(o.result == AttemptResult::First);
    }
    assert_eq!(flooder_starts, 750);
    let other = slow("other");
    let o = store.decide_attempt_now(
        &other,
        Cost::Spend(1),
        &attempt("first", Phase::Start, AttemptMode::Reserve),
    );
    assert_eq!(o.result, AttemptResult::First);
    assert!(o.outcomes.iter().all(|o| o.admitted));
}
