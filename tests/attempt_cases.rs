//! One table of attempt sequences, run against both copies of the
//! attempts' arithmetic: the Rust one (`src/attempt.rs` in the memory
//! store) and the Lua one (`store/redis/bucket.lua`) on a real
//! `redis-server`. Each sequence is a list of calls on one descriptor; every
//! call's outcome (verdict, remaining, retry, full-in, taken) and result
//! must be the same on both stores. Buckets refill one token a day, so the
//! time between calls cannot change a whole number.

mod common;

use std::time::Duration;

use common::redis::RedisServer;
use tokenbucket_rls::attempt::{AttemptCall, AttemptMode, AttemptResult, Phase};
use tokenbucket_rls::bucket::{Algorithm, BucketParams, Cost};
use tokenbucket_rls::clock::MonotonicClock;
use tokenbucket_rls::labels::RuleId;
use tokenbucket_rls::store::memory::MemoryStore;
use tokenbucket_rls::store::redis::{BucketLayout, RedisSettings, RedisStore};
use tokenbucket_rls::store::{BucketRef, DescriptorBuckets, Store};

use AttemptMode::{Dedupe, Reserve};
use Phase::{Done, Start, Withdraw};

/// One call: attempt id, phase, mode, cost, and the result both stores
/// must give.
type Step = (&'static str, Phase, AttemptMode, Cost, AttemptResult);

#[derive(Clone)]
struct Sequence {
    name: &'static str,
    /// Bursts of the descriptor's buckets (each refills 1 a day).
    bursts: Vec<u64>,
    steps: Vec<Step>,
}

fn sequences() -> Vec<Sequence> {
    use AttemptResult::{First, Repeat, Settled, Unknown};
    vec![
        Sequence {
            name: "reserve, repeat, settle above, repeat the settlement",
            bursts: vec![1000],
            steps: vec![
                ("a", Start, Reserve, Cost::Spend(600), First),
                ("a", Start, Reserve, Cost::Spend(600), Repeat),
                ("b", Start, Reserve, Cost::Spend(600), First),
                ("a", Done, Reserve, Cost::Spend(750), Settled),
                ("a", Done, Reserve, Cost::Spend(750), Repeat),
            ],
        },
        Sequence {
            name: "settle below, nothing used, a check as usage",
            bursts: vec![1000],
            steps: vec![
                ("a", Start, Reserve, Cost::Spend(600), First),
                ("a", Done, Reserve, Cost::Spend(100), Settled),
                ("b", Start, Reserve, Cost::Spend(900), First),
                ("b", Done, Reserve, Cost::Check, Settled),
                ("c", Start, Reserve, Cost::Spend(900), First),
                ("c", Done, Reserve, Cost::Refund(7), Settled),
            ],
        },
        Sequence {
            name: "settlements into debt stop at minus the burst",
            bursts: vec![100],
            steps: vec![
                ("a", Start, Reserve, Cost::Spend(100), First),
                ("a", Done, Reserve, Cost::Spend(180), Settled),
                ("b", Start, Reserve, Cost::Spend(1), First),
                ("x", Done, Reserve, Cost::Spend(500), Unknown),
                ("x", Done, Reserve, Cost::Spend(500), Repeat),
                ("c", Start, Reserve, Cost::Check, First),
            ],
        },
        Sequence {
            name: "a refused start is decided afresh; a check is not remembered",
            bursts: vec![10],
            steps: vec![
                ("a", Start, Reserve, Cost::Spend(11), First),
                ("a", Start, Reserve, Cost::Spend(11), First),
                ("b", Start, Reserve, Cost::Check, First),
                ("b", Start, Reserve, Cost::Spend(4), First),
                ("b", Start, Reserve, Cost::Spend(4), Repeat),
            ],
        },
        Sequence {
            name: "dedupe tells the phases apart",
            bursts: vec![5],
            steps: vec![
                ("a", Start, Dedupe, Cost::Spend(1), First),
                ("a", Start, Dedupe, Cost::Spend(1), Repeat),
                ("a", Done, Dedupe, Cost::Spend(2), First),
                ("a", Done, Dedupe, Cost::Spend(2), Repeat),
                ("b", Start, Dedupe, Cost::Spend(3), First),
                ("b", Start, Dedupe, Cost::Spend(3), First),
                ("c", Start, Dedupe, Cost::Refund(2), First),
                ("c", Start, Dedupe, Cost::Refund(2), Repeat),
            ],
        },
        Sequence {
            name: "an ended attempt's id starts a new attempt (issue 51: no free pass)",
            bursts: vec![2000],
            steps: vec![
                ("a", Start, Reserve, Cost::Spend(600), First),
                ("a", Done, Reserve, Cost::Spend(100), Settled),
                ("a", Start, Reserve, Cost::Spend(600), First),
                ("a", Start, Reserve, Cost::Spend(600), Repeat),
                ("b", Start, Reserve, Cost::Spend(600), First),
                ("a", Done, Reserve, Cost::Spend(0), Settled),
                ("b", Done, Reserve, Cost::Spend(900), Settled),
                ("x", Done, Reserve, Cost::Spend(5), Unknown),
                ("x", Start, Reserve, Cost::Spend(5), Repeat),
                ("d", Start, Dedupe, Cost::Spend(1), First),
                ("d", Done, Dedupe, Cost::Spend(1), First),
                ("d", Start, Dedupe, Cost::Spend(1), First),
                ("d", Start, Dedupe, Cost::Spend(1), Repeat),
            ],
        },
        Sequence {
            name: "a start given back (settled as using nothing), in both modes",
            bursts: vec![10],
            steps: vec![
                ("a", Start, Dedupe, Cost::Spend(4), First),
                ("a", Done, Reserve, Cost::Charge(0), Settled),
                ("a", Done, Reserve, Cost::Charge(0), Repeat),
                ("a", Start, Dedupe, Cost::Spend(4), First),
                ("b", Start, Reserve, Cost::Spend(6), First),
                ("b", Done, Reserve, Cost::Charge(0), Settled),
                ("c", Start, Reserve, Cost::Spend(6), First),
            ],
        },
        Sequence {
            name: "a done call before its start: charged once, in full (issue 51)",
            bursts: vec![1000],
            steps: vec![
                ("x", Done, Reserve, Cost::Spend(600), Unknown),
                ("x", Start, Reserve, Cost::Spend(300), Repeat),
                ("x", Done, Reserve, Cost::Spend(600), Repeat),
                ("y", Start, Reserve, Cost::Spend(400), First),
                ("y", Done, Reserve, Cost::Spend(0), Settled),
                ("d", Done, Dedupe, Cost::Spend(2), First),
                ("d", Start, Dedupe, Cost::Spend(2), First),
            ],
        },
        Sequence {
            name: "a start answered too late is withdrawn: a done call after it charges in full",
            bursts: vec![1000],
            steps: vec![
                ("a", Start, Reserve, Cost::Spend(600), First),
                ("a", Withdraw, Reserve, Cost::Check, Settled),
                ("a", Withdraw, Reserve, Cost::Check, Repeat),
                ("a", Done, Reserve, Cost::Spend(100), Unknown),
                ("a", Done, Reserve, Cost::Spend(100), Repeat),
                ("b", Start, Dedupe, Cost::Spend(3), First),
                ("b", Withdraw, Dedupe, Cost::Check, Settled),
                ("b", Start, Dedupe, Cost::Spend(3), First),
                ("c", Withdraw, Reserve, Cost::Check, Repeat),
                ("c", Start, Reserve, Cost::Spend(100), First),
            ],
        },
        Sequence {
            name: "a live start repeated past max_repeats (3) is a reuse (issue 51)",
            bursts: vec![10],
            steps: vec![
                ("a", Start, Dedupe, Cost::Spend(1), First),
                ("a", Start, Dedupe, Cost::Spend(1), Repeat),
                ("a", Start, Dedupe, Cost::Spend(1), Repeat),
                ("a", Start, Dedupe, Cost::Spend(1), Repeat),
                ("a", Start, Dedupe, Cost::Spend(1), AttemptResult::Reused),
                ("a", Start, Dedupe, Cost::Spend(1), AttemptResult::Reused),
                ("a", Done, Dedupe, Cost::Spend(1), First),
                ("a", Start, Dedupe, Cost::Spend(1), First),
                ("a", Start, Dedupe, Cost::Spend(1), Repeat),
                ("r", Start, Reserve, Cost::Spend(2), First),
                ("r", Start, Reserve, Cost::Spend(2), Repeat),
                ("r", Start, Reserve, Cost::Spend(2), Repeat),
                ("r", Start, Reserve, Cost::Spend(2), Repeat),
                ("r", Start, Reserve, Cost::Spend(2), AttemptResult::Reused),
                ("r", Done, Reserve, Cost::Spend(1), Settled),
            ],
        },
        Sequence {
            name: "absurd usage is forgiven alike (issue 51)",
            bursts: vec![1000],
            steps: vec![
                ("a", Start, Reserve, Cost::Spend(600), First),
                ("a", Done, Reserve, Cost::Spend(u64::MAX), Settled),
                ("b", Done, Reserve, Cost::Spend(u64::MAX), Unknown),
                ("c", Start, Dedupe, Cost::Charge(u64::MAX), First),
            ],
        },
        Sequence {
            name: "two limits: reserved and settled in both",
            bursts: vec![1000, 700],
            steps: vec![
                ("a", Start, Reserve, Cost::Spend(600), First),
                ("b", Start, Reserve, Cost::Spend(600), First),
                ("a", Done, Reserve, Cost::Check, Settled),
                ("b", Start, Reserve, Cost::Spend(600), First),
                ("b", Done, Reserve, Cost::Spend(900), Settled),
            ],
        },
    ]
}

fn descriptor(tag: &str, bursts: &[u64]) -> DescriptorBuckets {
    DescriptorBuckets {
        tag: tag.as_bytes().to_vec(),
        buckets: bursts
            .iter()
            .enumerate()
            .map(|(i, &capacity)| BucketRef {
                key: format!("{tag}#{i}").into_bytes(),
                params: BucketParams {
                    capacity,
                    tokens_per_unit: 1,
                    unit_secs: 86_400,
                    max_debt: None,
                    algorithm: Default::default(),
                    period: None,
                },
                rule: RuleId::of("cases", "attempts"),
            })
            .collect(),
        replication: None,
        ratelimit_key: None,
    }
}

/// Calendar periods (a budget a period, reservations and dedupe as on a
/// token bucket, issue 51): the period holding now runs a month more.
fn calendar_sequences() -> Vec<Sequence> {
    use AttemptResult::{First, Repeat, Settled, Unknown};
    vec![
        Sequence {
            name: "a month's budget: reserve, refuse past it, settle both ways",
            bursts: vec![1000],
            steps: vec![
                ("a", Start, Reserve, Cost::Spend(600), First),
                ("b", Start, Reserve, Cost::Spend(600), First),
                ("a", Start, Reserve, Cost::Spend(600), Repeat),
                ("a", Done, Reserve, Cost::Spend(100), Settled),
                ("a", Done, Reserve, Cost::Spend(100), Repeat),
                ("b", Start, Reserve, Cost::Spend(600), First),
                ("b", Done, Reserve, Cost::Spend(900), Settled),
                ("c", Start, Reserve, Cost::Spend(1), First),
                ("x", Done, Reserve, Cost::Spend(50), Unknown),
                ("x", Start, Reserve, Cost::Spend(50), Repeat),
            ],
        },
        Sequence {
            name: "a month's budget: dedupe, a withdrawal, two limits",
            bursts: vec![10, 7],
            steps: vec![
                ("d", Start, Dedupe, Cost::Spend(2), First),
                ("d", Start, Dedupe, Cost::Spend(2), Repeat),
                ("w", Start, Dedupe, Cost::Spend(3), First),
                ("w", Withdraw, Dedupe, Cost::Check, Settled),
                ("w", Withdraw, Dedupe, Cost::Check, Repeat),
                ("e", Start, Dedupe, Cost::Spend(6), First),
                ("e", Start, Dedupe, Cost::Spend(6), First),
            ],
        },
    ]
}

/// Fixed and sliding windows of a day (reservations and dedupe as on a
/// token bucket, issue 51): a give-back takes off the count of the window
/// that counted the start; on a fixed window a refused hit counts too.
fn window_sequences() -> Vec<Sequence> {
    use AttemptResult::{First, Repeat, Settled, Unknown};
    vec![
        Sequence {
            name: "a window's reservations: settle both ways, refuse past it",
            bursts: vec![1000],
            steps: vec![
                ("a", Start, Reserve, Cost::Spend(600), First),
                ("a", Start, Reserve, Cost::Spend(600), Repeat),
                ("a", Done, Reserve, Cost::Spend(100), Settled),
                ("a", Done, Reserve, Cost::Spend(100), Repeat),
                ("b", Start, Reserve, Cost::Spend(600), First),
                // refused: a reservation takes nothing, on a fixed window
                // too (so that b's settlement below fits)
                ("y", Start, Reserve, Cost::Spend(600), First),
                ("b", Done, Reserve, Cost::Spend(900), Settled),
                ("c", Start, Reserve, Cost::Spend(1), First),
                ("x", Done, Reserve, Cost::Spend(50), Unknown),
                ("x", Start, Reserve, Cost::Spend(50), Repeat),
                ("c", Start, Reserve, Cost::Spend(1), First),
            ],
        },
        Sequence {
            name: "a window's dedupe: a withdrawal, two limits, refused past one",
            bursts: vec![10, 7],
            steps: vec![
                ("d", Start, Dedupe, Cost::Spend(2), First),
                ("d", Start, Dedupe, Cost::Spend(2), Repeat),
                ("w", Start, Dedupe, Cost::Spend(3), First),
                ("w", Withdraw, Dedupe, Cost::Check, Settled),
                ("w", Withdraw, Dedupe, Cost::Check, Repeat),
                ("d", Done, Dedupe, Cost::Spend(1), First),
                ("d", Done, Dedupe, Cost::Spend(1), Repeat),
                // refused past the limit of 7 (a fixed window counts it,
                // a sliding one does not): not remembered
                ("e", Start, Dedupe, Cost::Spend(6), First),
                ("e", Start, Dedupe, Cost::Spend(6), First),
                ("f", Start, Dedupe, Cost::Spend(1), First),
            ],
        },
    ]
}

/// A descriptor of day-long windows counting as `algorithm`, one per limit
/// in `limits`.
fn window_descriptor(tag: &str, limits: &[u64], algorithm: Algorithm) -> DescriptorBuckets {
    let mut d = descriptor(tag, limits);
    for (b, &limit) in d.buckets.iter_mut().zip(limits) {
        b.params = BucketParams {
            capacity: limit,
            tokens_per_unit: limit,
            unit_secs: 86_400,
            max_debt: None,
            algorithm,
            period: None,
        };
    }
    d
}

/// A descriptor of calendar periods, one per limit in `limits`.
fn calendar_descriptor(tag: &str, limits: &[u64]) -> DescriptorBuckets {
    let now = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs(),
    )
    .expect("seconds fit");
    let mut d = descriptor(tag, limits);
    for (b, &limit) in d.buckets.iter_mut().zip(limits) {
        b.params = BucketParams {
            capacity: limit,
            tokens_per_unit: limit,
            unit_secs: 30 * 86_400,
            max_debt: None,
            algorithm: Algorithm::CalendarWindow,
            period: Some(tokenbucket_rls::calendar::Periods {
                start: now - 86_400,
                end: now + 30 * 86_400,
                next_end: now + 60 * 86_400,
            }),
        };
    }
    d
}

/// A Redis store on `redis`, batching decisions or not.
async fn connect(redis: &RedisServer, batched: bool) -> RedisStore {
    RedisStore::connect(&RedisSettings {
        url: redis.url(),
        timeout: Duration::from_secs(2),
        pool_size: 1,
        serving_threads: 0,
        batch: batched.then_some(tokenbucket_rls::store::redis::batch::DEFAULT_MAX),
        ca_file: None,
        client_cert: None,
        layout: BucketLayout::Packed,
        key_prefix: String::new(),
        skip_hostname_verification: false,
        password_file: None,
        expiry_jitter_max_secs: 0,
    })
    .await
    .expect("connect")
}

/// The call as the stores get it from the limiter: a reservation's done
/// call carries what was used.
fn call(id: &str, phase: Phase, mode: AttemptMode) -> AttemptCall {
    AttemptCall {
        id: id.as_bytes().to_vec(),
        phase,
        mode,
        ttl_micros: 60_000_000,
        max_repeats: 3,
    }
}

#[tokio::test]
async fn lua_and_rust_settle_attempts_alike() {
    let redis = RedisServer::standalone();
    let redis_store = connect(&redis, true).await;
    let memory = MemoryStore::new(MonotonicClock::new());
    let all = sequences()
        .into_iter()
        .map(|s| (s, Algorithm::TokenBucket))
        .chain(
            calendar_sequences()
                .into_iter()
                .map(|s| (s, Algorithm::CalendarWindow)),
        )
        .chain(window_sequences().into_iter().flat_map(|s| {
            [
                (s.clone(), Algorithm::FixedWindow),
                (s, Algorithm::SlidingWindow),
            ]
        }));
    for (n, (seq, algorithm)) in all.enumerate() {
        let tag = format!("seq{n}");
        let d = match algorithm {
            Algorithm::TokenBucket => descriptor(&tag, &seq.bursts),
            Algorithm::CalendarWindow => calendar_descriptor(&tag, &seq.bursts),
            windows => window_descriptor(&tag, &seq.bursts, windows),
        };
        for (i, (id, phase, mode, cost, want)) in seq.steps.iter().enumerate() {
            let c = call(id, *phase, *mode);
            let rust = memory.decide_attempt_now(&d, *cost, &c);
            let lua = redis_store
                .decide_attempt(&d, *cost, &c, None)
                .await
                .unwrap_or_else(|e| panic!("{}, step {i}: {e}", seq.name));
            let place = format!(
                "{} ({algorithm:?}), step {i} ({id} {phase:?} {cost:?})",
                seq.name
            );
            assert_eq!(rust.result, *want, "{place}: Rust");
            assert_eq!(lua.result, *want, "{place}: Lua");
            assert_eq!(rust.outcomes.len(), lua.outcomes.len(), "{place}");
            for (r, l) in rust.outcomes.iter().zip(&lua.outcomes) {
                assert_eq!(
                    (
                        r.admitted,
                        r.remaining,
                        r.retry_after_secs,
                        r.never,
                        r.taken,
                        r.forgiven
                    ),
                    (
                        l.admitted,
                        l.remaining,
                        l.retry_after_secs,
                        l.never,
                        l.taken,
                        l.forgiven
                    ),
                    "{place}: Rust (left) and Lua (right)"
                );
                // a day's refill: the seconds may differ by the one the
                // clocks crossed between the calls
                assert!(
                    r.full_in_secs.abs_diff(l.full_in_secs) <= 1,
                    "{place}: full in {} and {}",
                    r.full_in_secs,
                    l.full_in_secs
                );
            }
        }
    }
}

/// Calls of attempts batched with plain decisions into one script call
/// (one connection takes every call queued beside it): each group is read
/// with its own keys, its record included, and answered on its own.
#[tokio::test]
async fn attempts_in_a_batch_with_plain_decisions_are_each_decided_alone() {
    let redis = RedisServer::standalone();
    let store = connect(&redis, true).await;
    let round = |first: bool| {
        let store = &store;
        futures::future::join_all((0..32).map(move |i| async move {
            let d = descriptor(&format!("mixed{i}"), &[10, 20]);
            if i % 2 == 0 {
                let r = store
                    .decide_attempt(&d, Cost::Spend(3), &call("a", Start, Reserve), None)
                    .await
                    .expect("decided");
                (r.result, r.outcomes)
            } else {
                let cost = if first { Cost::Spend(3) } else { Cost::Check };
                let r = store.decide(&d, cost).await.expect("decided");
                (AttemptResult::First, r)
            }
        }))
    };
    for (i, (result, outcomes)) in round(true).await.into_iter().enumerate() {
        assert_eq!(result, AttemptResult::First, "{i}");
        let remaining: Vec<u64> = outcomes.iter().map(|o| o.remaining).collect();
        assert_eq!(remaining, [7, 17], "{i}");
    }
    for (i, (result, outcomes)) in round(false).await.into_iter().enumerate() {
        let want = if i % 2 == 0 {
            AttemptResult::Repeat
        } else {
            AttemptResult::First
        };
        assert_eq!(result, want, "{i}");
        assert!(outcomes.iter().all(|o| o.admitted), "{i}");
        let remaining: Vec<u64> = outcomes.iter().map(|o| o.remaining).collect();
        assert_eq!(remaining, [7, 17], "{i}: charged once");
    }
    // and they did share calls: fewer script calls than decisions
    let stats = redis.cli(&["INFO", "commandstats"]);
    let calls: u64 = stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    assert!(
        (1..64).contains(&calls),
        "{calls} script calls for 64 decisions:\n{stats}"
    );
}

/// The slots' sequences, the same from `take_slot`/`release_slot` (the
/// memory store) and `slots.lua` (Redis): taken up to the most, refused
/// past it, a repeated start holding its one slot, released once, a
/// release of no slot held, and slots that return by themselves.
#[tokio::test]
async fn lua_and_rust_hold_slots_alike() {
    use AttemptResult::{First, NotHeld, Released, Repeat, Reused};
    let redis = RedisServer::standalone();
    let store = connect(&redis, false).await;
    let memory = MemoryStore::new(MonotonicClock::new());
    let rule = RuleId::of("cases", "slots");
    // (id, phase, admitted, in flight after, result)
    let steps: [(&str, Phase, bool, u64, AttemptResult); 13] = [
        ("a", Start, true, 1, First),
        ("b", Start, true, 2, First),
        ("c", Start, false, 2, First),
        ("a", Start, true, 2, Repeat),
        // max_repeats 3: two more repeats, then a reuse, refused
        ("a", Start, true, 2, Repeat),
        ("a", Start, true, 2, Repeat),
        ("a", Start, false, 2, Reused),
        ("a", Start, false, 2, Reused),
        ("a", Done, true, 1, Released),
        ("a", Done, true, 1, NotHeld),
        ("c", Start, true, 2, First),
        ("z", Done, true, 2, NotHeld),
        ("d", Start, false, 2, First),
    ];
    let d = descriptor("slots", &[]);
    let slot_call = |id: &str, phase| AttemptCall {
        ttl_micros: 60_000_000,
        max_repeats: 3,
        ..call(id, phase, AttemptMode::Slot)
    };
    for (i, (id, phase, admitted, in_flight, result)) in steps.into_iter().enumerate() {
        let c = slot_call(id, phase);
        let rust = memory.decide_slot_now(&d, 2, &c, rule);
        let lua = store
            .decide_slot(&d, 2, &c, rule, None)
            .await
            .expect("decided");
        let want = (admitted, in_flight, result, 0);
        assert_eq!(
            (rust.admitted, rust.in_flight, rust.result, rust.expired),
            want,
            "step {i}: Rust"
        );
        assert_eq!(
            (lua.admitted, lua.in_flight, lua.result, lua.expired),
            want,
            "step {i}: Lua"
        );
    }
    // slots of a short ttl return by themselves, counted by the next call
    let short = |id: &str| AttemptCall {
        ttl_micros: 200_000,
        max_repeats: 3,
        ..slot_call(id, Start)
    };
    let e = descriptor("expiring", &[]);
    for id in ["p", "q"] {
        assert!(memory.decide_slot_now(&e, 2, &short(id), rule).admitted);
        assert!(
            store
                .decide_slot(&e, 2, &short(id), rule, None)
                .await
                .expect("decided")
                .admitted
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rust = memory.decide_slot_now(&e, 2, &short("r"), rule);
    let lua = store
        .decide_slot(&e, 2, &short("r"), rule, None)
        .await
        .expect("decided");
    assert_eq!(
        (rust.admitted, rust.in_flight, rust.expired),
        (true, 1, 2),
        "Rust"
    );
    assert_eq!(
        (lua.admitted, lua.in_flight, lua.expired),
        (true, 1, 2),
        "Lua"
    );
}

/// On Redis a reservation whose ttl passes unsettled is kept as spent and
/// counted by the descriptor's next reservation call (a sorted set of the
/// unsettled ones beside the records); a settled one never is.
#[tokio::test]
async fn redis_counts_reservations_that_expire_unsettled() {
    let redis = RedisServer::standalone();
    let store = connect(&redis, false).await;
    let d = descriptor("expiring-reservations", &[1000]);
    let short = |id: &str, phase| AttemptCall {
        ttl_micros: 200_000,
        max_repeats: 3,
        ..call(id, phase, Reserve)
    };
    for id in ["kept", "settled"] {
        let o = store
            .decide_attempt(&d, Cost::Spend(100), &short(id, Start), None)
            .await
            .expect("decided");
        assert_eq!((o.result, o.expired), (AttemptResult::First, 0));
    }
    let o = store
        .decide_attempt(&d, Cost::Spend(100), &short("settled", Done), None)
        .await
        .expect("decided");
    assert_eq!(o.result, AttemptResult::Settled);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let o = store
        .decide_attempt(&d, Cost::Spend(100), &short("next", Start), None)
        .await
        .expect("decided");
    assert_eq!(o.expired, 1, "the one never settled, once");
    assert_eq!(
        o.outcomes[0].remaining, 700,
        "kept as spent: 1000 - 100 - 100 - 100"
    );
    let o = store
        .decide_attempt(&d, Cost::Spend(100), &short("after", Start), None)
        .await
        .expect("decided");
    assert_eq!(o.expired, 0, "counted once");
}

/// Sleeps until a little after the next start of a window of `secs`
/// seconds (windows aligned to the Unix epoch).
async fn next_window(secs: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_micros() as u64;
    let length = secs * 1_000_000;
    let wait = length - now % length + 50_000;
    tokio::time::sleep(Duration::from_micros(wait)).await;
}

/// One call of an attempt on the memory store or on Redis.
async fn on(
    store: &str,
    memory: &MemoryStore<MonotonicClock>,
    redis: &RedisStore,
    d: &DescriptorBuckets,
    cost: Cost,
    c: &AttemptCall,
) -> tokenbucket_rls::store::AttemptOutcome {
    if store == "memory" {
        memory.decide_attempt_now(d, cost, c)
    } else {
        redis.decide_attempt(d, cost, c, None).await.expect("redis")
    }
}

/// What a reservation did not use goes back to the window that counted
/// it, and only there: settled in the window after, it would give the new
/// window tokens it never counted (issue 51). Both windows, both stores.
#[tokio::test]
async fn a_reservation_gives_back_only_to_the_window_that_counted_it() {
    let redis = RedisServer::standalone();
    let redis_store = connect(&redis, false).await;
    let memory = MemoryStore::new(MonotonicClock::new());
    let stores = ["memory", "redis"];
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        let mut d = window_descriptor(&format!("edge-{algorithm:?}"), &[100], algorithm);
        d.buckets[0].params.unit_secs = 4;
        let d = &d;
        let run = |store, cost, id, phase| {
            let c = call(id, phase, Reserve);
            let (memory, redis_store) = (&memory, &redis_store);
            async move { on(store, memory, redis_store, d, cost, &c).await }
        };
        next_window(4).await;
        for store in stores {
            run(store, Cost::Spend(60), "a", Start).await;
            // settled in its own window: 50 of the 60 come back
            let o = run(store, Cost::Spend(10), "a", Done).await;
            assert_eq!(o.outcomes[0].remaining, 90, "{algorithm:?} {store}");
            let o = run(store, Cost::Spend(20), "b", Start).await;
            assert_eq!(o.outcomes[0].remaining, 70, "{algorithm:?} {store}");
        }
        next_window(4).await;
        for store in stores {
            let o = run(store, Cost::Spend(40), "c", Start).await;
            assert!(o.outcomes[0].admitted, "{algorithm:?} {store}");
            // b settles in the window after its own, having used
            // nothing: its 20 are not given to this window
            let o = run(store, Cost::Check, "b", Done).await;
            assert_eq!(o.result, AttemptResult::Settled, "{algorithm:?} {store}");
            let left = o.outcomes[0].remaining;
            if algorithm == Algorithm::FixedWindow {
                // 100 − 40 (given here: 80)
                assert_eq!(left, 60, "{algorithm:?} {store}");
            } else {
                // 100 − 40 − the 30 of the window before, weighted by
                // the part of it still covered (given here: 20 more
                // whatever the weight)
                assert!(left < 50, "{algorithm:?} {store}: {left}");
            }
        }
    }
}
