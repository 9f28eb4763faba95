//! One table of token-bucket cases, run against both copies of the
//! arithmetic: the Rust one (`src/bucket.rs`, used by the memory store) and
//! the Lua one (`store/redis/bucket.lua`) on a real `redis-server`. Each case
//! writes a bucket state into Redis relative to the server's clock, decides,
//! and compares every field of the outcome with the Rust answer for the same
//! state and time, plus the state Redis stored.
//!
//! The server's clock moves a little between set-up and the script, so the
//! rates are chosen so that those microseconds cannot change a whole number.

mod common;

use common::redis::{stored_bucket, RedisServer};
use fred::prelude::*;
use tokenbucket_rls::bucket::{self, BucketOutcome, BucketParams, BucketState, Cost};
use tokenbucket_rls::store::redis::{
    batch, redis_key, tag_hash, BucketLayout, RedisSettings, RedisStore,
};
use tokenbucket_rls::store::{BucketRef, DescriptorBuckets, Store};

const SEC: i64 = 1_000_000;

struct Case {
    name: &'static str,
    /// Per bucket: params and the stored state as (tokens, age in µs; negative = in the future).
    buckets: Vec<(BucketParams, Option<(f64, i64)>)>,
    cost: Cost,
}

fn p(capacity: u64, tokens_per_unit: u64, unit_secs: u64) -> BucketParams {
    BucketParams {
        capacity,
        tokens_per_unit,
        unit_secs,
        max_debt: None,
        algorithm: Default::default(),
        period: None,
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "new bucket starts full",
            buckets: vec![(p(10, 6, 60), None)],
            cost: Cost::Spend(1),
        },
        Case {
            name: "weighted cost",
            buckets: vec![(p(10, 6, 60), None)],
            cost: Cost::Spend(7),
        },
        Case {
            name: "refill over 30 s",
            buckets: vec![(p(100, 60, 60), Some((0.0, 30 * SEC)))],
            cost: Cost::Spend(1),
        },
        Case {
            name: "refill capped at B",
            buckets: vec![(p(10, 60, 60), Some((5.0, 3600 * SEC)))],
            cost: Cost::Spend(1),
        },
        Case {
            name: "empty bucket rejects with retry",
            buckets: vec![(p(10, 6, 60), Some((0.0, 0)))],
            cost: Cost::Spend(1),
        },
        Case {
            name: "retry for a weighted cost",
            buckets: vec![(p(10, 6, 60), Some((1.0, 0)))],
            cost: Cost::Spend(4),
        },
        Case {
            name: "fractional tokens are not enough",
            buckets: vec![(p(5, 1, 60), Some((0.5, 0)))],
            cost: Cost::Spend(1),
        },
        Case {
            name: "fractional tokens add up",
            buckets: vec![(p(5, 1, 60), Some((0.5, 45 * SEC)))],
            cost: Cost::Spend(1),
        },
        Case {
            name: "cost above B never passes",
            buckets: vec![(p(5, 5, 1), None)],
            cost: Cost::Spend(6),
        },
        Case {
            name: "r = 0 rejects everything",
            buckets: vec![(p(0, 0, 1), None)],
            cost: Cost::Spend(1),
        },
        Case {
            name: "r = 0 with a burst still rejects",
            buckets: vec![(p(10, 0, 1), Some((10.0, 0)))],
            cost: Cost::Spend(1),
        },
        Case {
            name: "long idle yearly bucket",
            buckets: vec![(p(365, 365, 31_536_000), Some((0.0, 400 * 86_400 * SEC)))],
            cost: Cost::Spend(1),
        },
        Case {
            name: "check spends nothing",
            buckets: vec![(p(10, 6, 60), Some((3.0, 0)))],
            cost: Cost::Check,
        },
        Case {
            name: "check on an empty bucket",
            buckets: vec![(p(10, 6, 60), Some((0.2, 0)))],
            cost: Cost::Check,
        },
        Case {
            name: "clock behind the stored time adds nothing",
            buckets: vec![(p(10, 60, 60), Some((2.0, -3600 * SEC)))],
            cost: Cost::Spend(1),
        },
        Case {
            name: "refund into a spent bucket",
            buckets: vec![(p(10, 6, 60), Some((2.0, 0)))],
            cost: Cost::Refund(3),
        },
        Case {
            name: "refund capped at B",
            buckets: vec![(p(10, 6, 60), Some((8.0, 0)))],
            cost: Cost::Refund(50),
        },
        Case {
            name: "refund into a missing (full) bucket",
            buckets: vec![(p(10, 6, 60), None)],
            cost: Cost::Refund(2),
        },
        Case {
            name: "refund to several buckets",
            buckets: vec![
                (p(5, 6, 60), Some((1.0, 0))),
                (p(20, 20, 3600), Some((19.5, 0))),
            ],
            cost: Cost::Refund(2),
        },
        Case {
            name: "refund on a rule of rate 0 is admitted and stores nothing",
            buckets: vec![(p(0, 0, 1), None)],
            cost: Cost::Refund(2),
        },
        Case {
            name: "refund to a bucket of rate 0 and another",
            buckets: vec![
                (p(10, 0, 1), Some((3.0, 0))),
                (p(10, 6, 60), Some((2.0, 0))),
            ],
            cost: Cost::Refund(2),
        },
        Case {
            name: "lease from a full bucket takes up to its size",
            buckets: vec![(p(100, 60, 60), None)],
            cost: Cost::Lease {
                needed: 1,
                up_to: 20,
            },
        },
        Case {
            name: "lease takes what is there, below its size",
            buckets: vec![(p(100, 6, 60), Some((3.5, 0)))],
            cost: Cost::Lease {
                needed: 1,
                up_to: 20,
            },
        },
        Case {
            name: "lease larger than B takes B",
            buckets: vec![(p(10, 6, 60), None)],
            cost: Cost::Lease {
                needed: 2,
                up_to: 50,
            },
        },
        Case {
            name: "lease rejected below what it needs",
            buckets: vec![(p(100, 6, 60), Some((2.5, 0)))],
            cost: Cost::Lease {
                needed: 3,
                up_to: 20,
            },
        },
        Case {
            name: "lease of several buckets takes the fewest tokens",
            buckets: vec![
                (p(50, 6, 60), Some((40.0, 0))),
                (p(20, 20, 3600), Some((7.5, 0))),
            ],
            cost: Cost::Lease {
                needed: 1,
                up_to: 30,
            },
        },
        Case {
            name: "a cost of 2^63 is above capacity, not a lease",
            buckets: vec![(p(5, 1, 1), None)],
            cost: Cost::Spend(1 << 63),
        },
        Case {
            name: "a cost of 2^64-1 is above capacity",
            buckets: vec![(p(5, 1, 1), Some((2.0, 0)))],
            cost: Cost::Spend(u64::MAX),
        },
        Case {
            name: "a refund of 2^64-1 stops at B",
            buckets: vec![(p(5, 1, 1), Some((2.0, 0)))],
            cost: Cost::Refund(u64::MAX),
        },
        Case {
            name: "a bucket that takes millions of years to fill does not expire",
            buckets: vec![(p(10_000_000, 1, 31_536_000), None)],
            cost: Cost::Spend(5_000_000),
        },
        Case {
            name: "a year's refill in one call (the TTL fits)",
            buckets: vec![(p(1000, 1000, 31_536_000), Some((900.0, 0)))],
            cost: Cost::Spend(899),
        },
        Case {
            name: "several buckets: one rejects, none pays",
            buckets: vec![
                (p(5, 6, 60), Some((4.0, 0))),
                (p(2, 2, 3600), Some((0.0, 0))),
            ],
            cost: Cost::Spend(1),
        },
        Case {
            name: "several buckets: all admit, all pay",
            buckets: vec![
                (p(5, 6, 60), Some((4.0, 0))),
                (p(20, 20, 3600), Some((3.0, 0))),
            ],
            cost: Cost::Spend(2),
        },
        // usage accounting (`overdraft`): a charge is never refused
        Case {
            name: "charge within the balance",
            buckets: vec![(p(1000, 1000, 60), Some((1000.0, 0)))],
            cost: Cost::Charge(600),
        },
        Case {
            name: "charge beyond the balance goes into debt, OVER_LIMIT",
            buckets: vec![(p(1000, 1000, 60), Some((400.0, 0)))],
            cost: Cost::Charge(600),
        },
        Case {
            name: "charge stops at minus the burst",
            buckets: vec![(p(1000, 1000, 60), Some((-800.0, 0)))],
            cost: Cost::Charge(600),
        },
        // issue 51: the debt bound forgave absurd usage differently
        Case {
            name: "an absurd charge is forgiven alike",
            buckets: vec![(p(1000, 1000, 60), Some((400.0, 0)))],
            cost: Cost::Charge(u64::MAX),
        },
        Case {
            name: "a charge of 2^53 is forgiven alike",
            buckets: vec![(p(1000, 1000, 60), Some((400.5, 0)))],
            cost: Cost::Charge(1 << 53),
        },
        Case {
            name: "a huge charge on a fractional balance is forgiven alike",
            buckets: vec![(p(7, 3, 60), Some((2.25, 0)))],
            cost: Cost::Charge((1 << 53) - 1),
        },
        Case {
            name: "a rule's max_debt bounds a charge's debt",
            buckets: vec![(
                BucketParams {
                    max_debt: Some(50),
                    ..p(100, 60, 60)
                },
                Some((10.0, 0)),
            )],
            cost: Cost::Charge(100),
        },
        Case {
            name: "max_debt 0: a charge takes what is there and no more",
            buckets: vec![(
                BucketParams {
                    max_debt: Some(0),
                    ..p(100, 60, 60)
                },
                Some((30.0, 0)),
            )],
            cost: Cost::Charge(45),
        },
        Case {
            name: "two limits, each its own debt bound",
            buckets: vec![
                (p(100, 60, 60), Some((0.0, 0))),
                (
                    BucketParams {
                        max_debt: Some(20),
                        ..p(1000, 1000, 3600)
                    },
                    Some((0.0, 0)),
                ),
            ],
            cost: Cost::Charge(70),
        },
        Case {
            name: "charge above the burst is charged, never admitted",
            buckets: vec![(p(100, 60, 60), Some((50.0, 0)))],
            cost: Cost::Charge(250),
        },
        Case {
            // a reload lowered the burst from 100 to 10 while the bucket
            // owed 98: a charge never raises a balance, so the debt stays
            name: "charge after the burst was lowered below the debt keeps the debt",
            buckets: vec![(p(10, 10, 60), Some((-98.0, 0)))],
            cost: Cost::Charge(1),
        },
        Case {
            name: "check in debt waits until the debt is repaid",
            buckets: vec![(p(1000, 1000, 60), Some((-200.0, 0)))],
            cost: Cost::Check,
        },
        Case {
            name: "debt repaid by the refill",
            buckets: vec![(p(1000, 1000, 60), Some((-200.0, 30 * SEC)))],
            cost: Cost::Check,
        },
        Case {
            name: "refund into a debt",
            buckets: vec![(p(1000, 1000, 60), Some((-200.0, 0)))],
            cost: Cost::Refund(150),
        },
        Case {
            name: "spend (not a charge) in debt is refused and pays nothing",
            buckets: vec![(p(1000, 1000, 60), Some((-200.0, 0)))],
            cost: Cost::Spend(1),
        },
        Case {
            name: "charge on several buckets: each into its own debt",
            buckets: vec![
                (p(1000, 1000, 60), Some((400.0, 0))),
                (p(5000, 5000, 3600), Some((4000.0, 0))),
            ],
            cost: Cost::Charge(600),
        },
        Case {
            name: "charge on a rate of 0 is refused and charges nothing",
            buckets: vec![(p(10, 0, 1), Some((10.0, 0)))],
            cost: Cost::Charge(3),
        },
    ]
}

/// The script's expiry margin and its longest expiry (100 years).
const MARGIN_MS: f64 = 1000.0;
const MAX_TTL_MS: f64 = 3_153_600_000_000.0;

/// A written bucket expires once it would be full (plus the margin), never
/// sooner; one that takes longer than 100 years does not expire.
fn assert_ttl(case: &str, params: &BucketParams, tokens: f64, ttl: i64) {
    let full_ms = ((params.capacity as f64 - tokens) / params.rate_per_sec() * 1000.0).ceil();
    if full_ms + MARGIN_MS > MAX_TTL_MS {
        assert_eq!(ttl, -1, "case '{case}': persisted, full in {full_ms} ms");
    } else {
        assert!(
            ttl > 0 && ttl as f64 <= full_ms + MARGIN_MS && ttl as f64 >= full_ms,
            "case '{case}': TTL {ttl} ms, full in {full_ms} ms"
        );
    }
}

/// The store under test and a raw client, both on `redis`.
async fn store_and_client(redis: &RedisServer, layout: BucketLayout) -> (RedisStore, Client) {
    let store = RedisStore::connect(&RedisSettings {
        url: redis.url(),
        timeout: std::time::Duration::from_secs(2),
        pool_size: 1,
        serving_threads: 0,
        batch: Some(tokenbucket_rls::store::redis::batch::DEFAULT_MAX),
        ca_file: None,
        client_cert: None,
        layout,
        key_prefix: String::new(),
        skip_hostname_verification: false,
        password_file: None,
        expiry_jitter_max_secs: 0,
    })
    .await
    .expect("connect");
    let client = Builder::from_config(Config::from_url(&redis.url()).expect("url"))
        .build()
        .expect("client");
    client.init().await.expect("raw client connects");
    (store, client)
}

async fn server_now(client: &Client) -> i64 {
    let t: Vec<String> = client
        .custom(fred::cmd!("TIME"), Vec::<String>::new())
        .await
        .expect("TIME");
    t[0].parse::<i64>().expect("secs") * SEC + t[1].parse::<i64>().expect("micros")
}

/// A case's buckets written into Redis (or not, for a new bucket), and
/// the states written.
struct Seeded {
    case: Case,
    descriptor: DescriptorBuckets,
    states: Vec<Option<BucketState>>,
}

/// Every case twice: seeded in the packed layout, then in the hash of
/// earlier versions (a rolling upgrade: the script reads both and writes
/// packed); each named by `tag`.
fn every_case() -> impl Iterator<Item = (Vec<u8>, Case, bool)> {
    [false, true].into_iter().flat_map(|hash| {
        cases().into_iter().enumerate().map(move |(n, c)| {
            let tag = format!("case-{n}-{}", if hash { "hash" } else { "packed" });
            (tag.into_bytes(), c, hash)
        })
    })
}

/// Writes `case`'s stored states, aged from `now` (server time), with the
/// commands queued on `pipeline`.
async fn seed(
    pipeline: &fred::clients::Pipeline<Client>,
    tag: Vec<u8>,
    case: Case,
    seed_hash: bool,
    now: i64,
) -> Seeded {
    let descriptor = buckets_of(&tag, case.buckets.iter().map(|(p, _)| *p));
    let mut states = Vec::new();
    for (b, (_, state)) in descriptor.buckets.iter().zip(&case.buckets) {
        let key = redis_key(tag_hash(&descriptor.tag), &b.key);
        states.push(state.map(|(tokens, age)| BucketState {
            tokens,
            updated_micros: (now - age) as u64,
        }));
        match state {
            Some((tokens, age)) if seed_hash => {
                let _: () = pipeline
                    .hset(
                        key,
                        [
                            ("t", format!("{tokens:.17}")),
                            ("u", (now - age).to_string()),
                        ],
                    )
                    .await
                    .expect("HSET");
            }
            Some((tokens, age)) => {
                // no expiry, like the hash above
                let packed: Vec<u8> = [*tokens, (now - age) as f64, 0.0]
                    .iter()
                    .flat_map(|f| f.to_le_bytes())
                    .collect();
                let _: () = pipeline
                    .set(key, packed.as_slice(), None, None, false)
                    .await
                    .expect("SET");
            }
            None => {}
        }
    }
    Seeded {
        case,
        descriptor,
        states,
    }
}

/// Compares the script's answer `lua` for `seeded` (decided just after
/// `now`) with Rust's, and what Redis stored with what Rust would store.
async fn check(client: &Client, seeded: &Seeded, now: i64, lua: Vec<bucket::BucketOutcome>) {
    let Seeded {
        case,
        descriptor,
        states,
    } = seeded;
    let params: Vec<_> = case.buckets.iter().map(|(p, _)| *p).collect();
    let (rust_states, rust) = bucket::decide(&params, states, now as u64, case.cost);
    assert_eq!(lua, rust, "case '{}'", case.name);
    // the server's clock ran on between `now` and the script: the stored
    // float may hold that much more refill
    let drift_secs = (server_now(client).await - now) as f64 / 1e6;

    // what Redis stored is what Rust would store (within the clock's drift)
    // a charge is written also when answered OVER_LIMIT
    let admitted_and_spent = (rust[0].admitted && case.cost.deducted() != 0)
        || (matches!(case.cost, Cost::Charge(_)) && rust[0].taken > 0);
    for ((b, rust_state), before) in descriptor.buckets.iter().zip(&rust_states).zip(states) {
        let key = redis_key(tag_hash(&descriptor.tag), &b.key);
        let stored = stored_bucket(client, &key).await.map(|(t, _)| t);
        match (stored, admitted_and_spent, before) {
            // rate 0: only a refund is admitted, and it writes nothing
            (stored, true, before) if b.params.rate_per_sec() == 0.0 => {
                assert_eq!(
                    stored,
                    before.map(|s| s.tokens),
                    "case '{}': a bucket of rate 0 is not written",
                    case.name
                );
            }
            (Some(t), true, _) => {
                let kind: String = client.r#type(key.clone()).await.expect("TYPE");
                assert_eq!(kind, "string", "case '{}': written packed", case.name);
                let tolerance = b.params.rate_per_sec() * drift_secs + 1e-6;
                assert!(
                    (t - rust_state.tokens).abs() <= tolerance,
                    "case '{}': stored {t}, rust {}",
                    case.name,
                    rust_state.tokens
                );
                let ttl: i64 = client.pttl(key).await.expect("PTTL");
                assert_ttl(case.name, &b.params, t, ttl);
            }
            (None, false, None) => {}
            (Some(t), false, Some(before)) => {
                assert!(
                    (t - before.tokens).abs() < 1e-9,
                    "case '{}': a rejection or check writes nothing",
                    case.name
                );
            }
            (s, spent, b) => panic!(
                "case '{}': stored {s:?}, spent {spent}, before {b:?}",
                case.name
            ),
        }
    }
}

#[tokio::test]
async fn lua_and_rust_give_the_same_answers() {
    let redis = RedisServer::standalone();
    let (lean, client) = store_and_client(&redis, BucketLayout::Packed).await;
    let (bucket_lua, _) = store_and_client(&redis, BucketLayout::Packed).await;
    let bucket_lua = bucket_lua.with_bucket_lua_only();
    // one.lua where it takes the decision (one bucket), then bucket.lua
    for (script, store) in [("one.lua", &lean), ("bucket.lua", &bucket_lua)] {
        for (tag, case, seed_hash) in every_case() {
            let tag = [script.as_bytes(), b"-", &tag].concat();
            let now = server_now(&client).await;
            let pipeline = client.pipeline();
            let seeded = seed(&pipeline, tag, case, seed_hash, now).await;
            let _: Vec<Value> = pipeline.all().await.expect("seeded");
            let lua = store
                .decide(&seeded.descriptor, seeded.case.cost)
                .await
                .expect("script runs");
            check(&client, &seeded, now, lua).await;
        }
    }
    let (sha, _) = batch::scripts().of(batch::DecisionScript::One);
    assert_eq!(
        redis.cli(&["SCRIPT", "EXISTS", sha]).trim(),
        "1",
        "one.lua ran"
    );
}

/// The same cases decided at once: they reach Redis as a few batches
/// (several decisions in one script call, each with its own keys and
/// arguments), and each answer is the one it gets alone.
#[tokio::test]
async fn decisions_batched_into_one_call_give_the_same_answers() {
    let redis = RedisServer::standalone();
    let (store, client) = store_and_client(&redis, BucketLayout::Packed).await;
    // the store's connection is up, and the script loaded
    let warm = DescriptorBuckets {
        tag: b"warm".to_vec(),
        buckets: vec![BucketRef {
            key: b"warm#0".to_vec(),
            params: p(1, 1, 1),
            rule: Default::default(),
        }],
        replication: None,
        ratelimit_key: None,
    };
    store.decide(&warm, Cost::Spend(0)).await.expect("warm");
    let _: () = client
        .custom(fred::cmd!("CONFIG"), vec!["RESETSTAT"])
        .await
        .expect("CONFIG RESETSTAT");

    let now = server_now(&client).await;
    let pipeline = client.pipeline();
    let mut all = Vec::new();
    for (tag, case, seed_hash) in every_case() {
        all.push(seed(&pipeline, tag, case, seed_hash, now).await);
    }
    let _: Vec<Value> = pipeline.all().await.expect("seeded");
    let answers =
        futures::future::join_all(all.iter().map(|s| store.decide(&s.descriptor, s.case.cost)))
            .await;
    for (seeded, lua) in all.iter().zip(answers) {
        check(&client, seeded, now, lua.expect("script runs")).await;
    }
    let calls = common::redis::command_calls(&redis.cli(&["INFO", "commandstats"]), "evalsha");
    assert!(
        calls > 0 && calls * 4 <= all.len() as u64,
        "{} decisions in {calls} script calls: batched",
        all.len()
    );
}

/// Audit 6: after a reload lowers a bucket's rate, the next decision on it
/// (a rejection or a check, which store no state) lengthens its TTL to the
/// new time to full; with unchanged numbers a rejection writes nothing.
#[tokio::test]
async fn a_lowered_rate_lengthens_the_ttl_at_the_next_decision() {
    let redis = RedisServer::standalone();
    let (store, client) = store_and_client(&redis, BucketLayout::Packed).await;
    let descriptor = |unit_secs| DescriptorBuckets {
        tag: b"lowered".to_vec(),
        buckets: vec![BucketRef {
            key: b"lowered#0".to_vec(),
            params: p(5, 1, unit_secs),
            rule: Default::default(),
        }],
        replication: None,
        ratelimit_key: None,
    };
    let key = redis_key(tag_hash(b"lowered"), b"lowered#0");
    for _ in 0..5 {
        let o = store
            .decide(&descriptor(1), Cost::Spend(1))
            .await
            .expect("ok");
        assert!(o[0].admitted);
    }
    let ttl: i64 = client.pttl(key.clone()).await.expect("PTTL");
    assert!(
        (5_000..=6_000).contains(&ttl),
        "{{second, 1, burst 5}} drained: {ttl}"
    );
    // writes: SET (the packed layout) and PEXPIRE (the hash layout)
    let pexpires = || async {
        let info = redis.cli(&["INFO", "commandstats"]);
        ["cmdstat_set:", "cmdstat_pexpire:"]
            .iter()
            .map(|name| {
                info.lines()
                    .find(|l| l.starts_with(name))
                    .and_then(|l| l.split("calls=").nth(1))
                    .and_then(|v| v.split(',').next())
                    .map_or(0, |v| v.parse::<u64>().expect("calls"))
            })
            .sum::<u64>()
    };
    let before = pexpires().await;
    let o = store
        .decide(&descriptor(1), Cost::Spend(1))
        .await
        .expect("ok");
    assert!(!o[0].admitted);
    assert_eq!(
        pexpires().await,
        before,
        "an unchanged rule's rejection writes nothing"
    );
    // reloaded: {hour, 1, burst 5}
    let o = store
        .decide(&descriptor(3600), Cost::Check)
        .await
        .expect("ok");
    assert!(!o[0].admitted);
    // fewer than 1 token left (the 6th spend was rejected): at one per
    // hour the bucket needs more than 4 hours to fill
    let ttl: i64 = client.pttl(key).await.expect("PTTL");
    assert!(
        ttl > 4 * 3600 * 1000,
        "the TTL follows the new rate: {ttl} ms"
    );
}

/// A rolling upgrade from 0.1 (hashes): while 0.1 instances still run, new
/// ones with `--redis-bucket-layout hash` spend the same buckets and leave
/// them readable to 0.1; once none is left, the packed layout takes over
/// the hashes. One bucket {burst 10, 1 per day}, spent in turn: exact.
#[tokio::test]
async fn a_rolling_upgrade_shares_buckets_with_the_previous_version() {
    let redis = RedisServer::standalone();
    let (step_one, client) = store_and_client(&redis, BucketLayout::Hash).await;
    let (step_two, _) = store_and_client(&redis, BucketLayout::Packed).await;
    let old_script = include_str!("fixtures/bucket-0.1.lua");
    let descriptor = DescriptorBuckets {
        tag: b"upgrade".to_vec(),
        buckets: vec![BucketRef {
            key: b"upgrade#0".to_vec(),
            params: p(10, 1, 86_400),
            rule: Default::default(),
        }],
        replication: None,
        ratelimit_key: None,
    };
    let key = redis_key(tag_hash(b"upgrade"), b"upgrade#0");
    // 0.1's call: needed, deducted, margin, then capacity, rate, unit
    let old_spend = |n: i64| {
        let (client, key) = (client.clone(), key.clone());
        async move {
            let reply: Vec<i64> = client
                .eval(old_script, vec![key], vec![n, n, 1_000, 10, 1, 86_400])
                .await
                .expect("0.1's script runs");
            (reply[0] == 1, reply[1])
        }
    };
    let kind = || async {
        let kind: String = client.r#type(key.clone()).await.expect("TYPE");
        kind
    };
    async fn spend(store: &RedisStore, d: &DescriptorBuckets, n: u64) -> (bool, i64) {
        let o = store.decide(d, Cost::Spend(n)).await.expect("script runs");
        (o[0].admitted, o[0].remaining as i64)
    }
    assert_eq!(old_spend(3).await, (true, 7));
    assert_eq!(spend(&step_one, &descriptor, 3).await, (true, 4));
    assert_eq!(kind().await, "hash", "step one writes what 0.1 reads");
    assert_eq!(old_spend(2).await, (true, 2));
    assert_eq!(spend(&step_two, &descriptor, 2).await, (true, 0));
    assert_eq!(kind().await, "string", "step two converts the hash");
    assert!(!spend(&step_two, &descriptor, 1).await.0);
    assert!(
        !spend(&step_one, &descriptor, 1).await.0,
        "step one reads packed too"
    );
    assert_eq!(kind().await, "string", "a rejection writes nothing");
}

/// One bucket of each of `params`, keyed `<tag>#<i>`, under `tag`.
fn buckets_of(tag: &[u8], params: impl IntoIterator<Item = BucketParams>) -> DescriptorBuckets {
    DescriptorBuckets {
        buckets: params
            .into_iter()
            .enumerate()
            .map(|(i, params)| BucketRef {
                key: [tag, format!("#{i}").as_bytes()].concat(),
                params,
                rule: Default::default(),
            })
            .collect(),
        tag: tag.to_vec(),
        replication: None,
        ratelimit_key: None,
    }
}

/// Writes `state` into bucket `b`'s key in the packed layout (no expiry).
async fn store_packed(
    client: &Client,
    descriptor: &DescriptorBuckets,
    b: &BucketRef,
    state: BucketState,
) {
    let packed: Vec<u8> = [state.tokens, state.updated_micros as f64, 0.0]
        .iter()
        .flat_map(|f| f.to_le_bytes())
        .collect();
    let key = redis_key(tag_hash(&descriptor.tag), &b.key);
    let _: () = client
        .set(key, packed.as_slice(), None, None, false)
        .await
        .expect("SET");
}

/// A fixed window's bucket (#41): `limit` per `window_secs`.
fn fw(limit: u64, window_secs: u64) -> BucketParams {
    BucketParams {
        capacity: limit,
        tokens_per_unit: limit,
        unit_secs: window_secs,
        max_debt: None,
        algorithm: tokenbucket_rls::bucket::Algorithm::FixedWindow,
        period: None,
    }
}

/// A fixed-window case: its name; per bucket, its params and the stored
/// count, of this window (`0`) or of the one before (`-1`); the cost.
type FixedCase = (&'static str, Vec<(BucketParams, Option<(f64, i64)>)>, Cost);

fn fixed_window_cases() -> Vec<FixedCase> {
    vec![
        ("a new window", vec![(fw(3, 60), None)], Cost::Spend(1)),
        (
            "the last hit within",
            vec![(fw(3, 60), Some((2.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "over: refused, and counted",
            vec![(fw(3, 60), Some((3.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "the window before is none",
            vec![(fw(3, 60), Some((3.0, -1)))],
            Cost::Spend(1),
        ),
        (
            "a weighted hit over",
            vec![(fw(10, 60), Some((7.0, 0)))],
            Cost::Spend(4),
        ),
        (
            "a check counts nothing",
            vec![(fw(3, 60), Some((2.0, 0)))],
            Cost::Check,
        ),
        (
            "a check over",
            vec![(fw(3, 60), Some((3.0, 0)))],
            Cost::Check,
        ),
        (
            "refused by one limit, counted by both",
            vec![(fw(1, 60), Some((1.0, 0))), (fw(5, 3600), None)],
            Cost::Spend(1),
        ),
        ("a limit of 0", vec![(fw(0, 60), None)], Cost::Spend(1)),
        (
            "a window of a second",
            vec![(fw(2, 1), Some((1.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "a window of 30 s",
            vec![(fw(3, 30), Some((1.0, 0)))],
            Cost::Spend(2),
        ),
        (
            "a charge counts past the limit",
            vec![(fw(3, 60), Some((2.0, 0)))],
            Cost::Charge(5),
        ),
        (
            "a refund over the limit: answered OK, counts nothing",
            vec![(fw(3, 60), Some((5.0, 0)))],
            Cost::Refund(2),
        ),
        (
            "a cost above the limit can never pass: no wait",
            vec![(fw(3, 60), None)],
            Cost::Spend(5),
        ),
        (
            "a check after hits on a limit of 0: over, no wait",
            vec![(fw(0, 60), Some((2.0, 0)))],
            Cost::Check,
        ),
    ]
}

/// A fixed window of limit 0 keeps its count on both stores (issue 52:
/// the memory store skipped writing a bucket whose rate is 0, so a check
/// after two refused hits was OK there and OVER_LIMIT on Redis, as
/// envoyproxy/ratelimit's `INCRBY 0`), and its refusals carry no wait.
#[tokio::test]
async fn a_fixed_window_of_limit_0_counts_alike_on_both_stores() {
    let redis = RedisServer::standalone();
    let (store, _client) = store_and_client(&redis, BucketLayout::Packed).await;
    let memory = tokenbucket_rls::store::memory::MemoryStore::new(
        tokenbucket_rls::clock::MonotonicClock::new(),
    );
    let d = buckets_of(b"zero", [fw(0, 3600)]);
    for (i, cost) in [Cost::Spend(1), Cost::Spend(1), Cost::Check]
        .into_iter()
        .enumerate()
    {
        let lua = store.decide(&d, cost).await.expect("redis");
        let rust = memory.decide_now(&d, cost);
        for (name, o) in [("Lua", lua[0]), ("Rust", rust[0])] {
            assert!(!o.admitted, "call {i} {cost:?}: {name}");
            assert_eq!(
                o.retry_after_secs, None,
                "call {i}: {name} waits for nothing"
            );
            assert_eq!(
                o.never,
                Some(bucket::NeverReason::ZeroRate),
                "call {i}: {name}"
            );
        }
    }
}

/// The fixed window's two copies (`src/window.rs`, `bucket.lua` flag 8)
/// give the same answers and store the same counts (every hit counted, a
/// refused one too), expiring when the window ends.
#[tokio::test]
async fn fixed_windows_in_lua_and_rust_give_the_same_answers() {
    let cases = fixed_window_cases()
        .into_iter()
        .map(|(name, buckets, cost)| WindowCase {
            name,
            cost,
            setup: Box::new(move |now: i64| {
                let now_s = now / SEC;
                buckets
                    .iter()
                    .map(|(params, state)| {
                        let length = params.unit_secs as i64;
                        let start =
                            (now_s - now_s % length + state.map_or(0, |s| s.1) * length) * SEC;
                        let stored = state.map(|(count, _)| BucketState {
                            tokens: count,
                            updated_micros: start as u64,
                        });
                        (*params, stored)
                    })
                    .unzip()
            }),
        })
        .collect();
    lua_and_rust_agree(
        "fixed",
        cases,
        tokenbucket_rls::window::decide,
        |_, cost| cost.deducted() > 0,
        |params, state| state.updated_micros as i64 + params.unit_secs as i64 * SEC,
    )
    .await;
}

/// A sliding window's bucket (#41): `limit` per `window_secs`.
fn sw(limit: u64, window_secs: u64) -> BucketParams {
    BucketParams {
        algorithm: tokenbucket_rls::bucket::Algorithm::SlidingWindow,
        ..fw(limit, window_secs)
    }
}

/// A sliding-window case: its name; per bucket, its params and the stored
/// (window before's count, current count, window: `0` the one now
/// running, `-1` the one before, `1` one later than now, as after a clock
/// stepped back); the cost.
type SlidingCase = (
    &'static str,
    Vec<(BucketParams, Option<(f64, f64, i64)>)>,
    Cost,
);

fn sliding_window_cases() -> Vec<SlidingCase> {
    let most = tokenbucket_rls::bucket::MAX_WINDOW_COUNT;
    vec![
        ("a new window", vec![(sw(10, 60), None)], Cost::Spend(1)),
        (
            "the window before weighs",
            vec![(sw(10, 3600), Some((0.0, 10.0, -1)))],
            Cost::Spend(1),
        ),
        (
            "both windows count",
            vec![(sw(10, 60), Some((4.0, 3.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "a full window waits into the next",
            vec![(sw(10, 60), Some((0.0, 10.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "two windows old counts nothing",
            vec![(sw(10, 60), Some((9.0, 9.0, -2)))],
            Cost::Spend(1),
        ),
        (
            "a clock stepped back",
            vec![(sw(10, 60), Some((2.0, 5.0, 1)))],
            Cost::Spend(1),
        ),
        (
            "a weighted hit",
            vec![(sw(10, 60), Some((0.0, 3.0, 0)))],
            Cost::Spend(5),
        ),
        (
            "a weighted hit refused",
            vec![(sw(10, 3600), Some((8.0, 3.0, 0)))],
            Cost::Spend(6),
        ),
        (
            "a check",
            vec![(sw(10, 3600), Some((0.0, 10.0, -1)))],
            Cost::Check,
        ),
        (
            "a refund",
            vec![(sw(10, 60), Some((0.0, 5.0, 0)))],
            Cost::Refund(2),
        ),
        (
            "a refund below nothing",
            vec![(sw(10, 60), Some((3.0, 1.0, 0)))],
            Cost::Refund(5),
        ),
        (
            "a cost above the limit",
            vec![(sw(10, 60), None)],
            Cost::Spend(11),
        ),
        ("a limit of 0", vec![(sw(0, 60), None)], Cost::Spend(1)),
        (
            "one limit of two refuses, neither counts",
            vec![(sw(2, 60), Some((0.0, 2.0, 0))), (sw(5, 3600), None)],
            Cost::Spend(1),
        ),
        (
            "a window of 30 s",
            vec![(sw(5, 30), Some((3.0, 1.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "the most a window counts",
            vec![(sw(most, 60), Some((0.0, (most - 1) as f64, 0)))],
            Cost::Spend(1),
        ),
        (
            "a charge counts past the limit",
            vec![(sw(10, 60), Some((0.0, 8.0, 0)))],
            Cost::Charge(5),
        ),
        (
            "a charge above the limit, the window before weighing",
            vec![(sw(10, 3600), Some((6.0, 2.0, 0)))],
            Cost::Charge(30),
        ),
        (
            "a charge on a limit of 0 counts nothing",
            vec![(sw(0, 60), None)],
            Cost::Charge(3),
        ),
        (
            "a huge charge is held to what a window counts",
            vec![(sw(10, 60), Some((0.0, 4.0, 0)))],
            Cost::Charge(u64::MAX),
        ),
    ]
}

/// The sliding window's two copies (`src/window/sliding.rs`, `bucket.lua`
/// flag 16) give the same answers and store the same counts (admitted
/// hits only), expiring two windows after the current one's start.
#[tokio::test]
async fn sliding_windows_in_lua_and_rust_give_the_same_answers() {
    let cases = sliding_window_cases()
        .into_iter()
        .map(|(name, buckets, cost)| WindowCase {
            name,
            cost,
            setup: Box::new(move |now: i64| {
                buckets
                    .iter()
                    .map(|(params, state)| {
                        let length = params.unit_secs as i64 * SEC;
                        let start = now - now % length;
                        let stored = state.map(|(previous, current, window)| {
                            BucketState::sliding_window(
                                previous,
                                current,
                                (start + window * length) as u64,
                            )
                        });
                        (*params, stored)
                    })
                    .unzip()
            }),
        })
        .collect();
    lua_and_rust_agree(
        "sliding",
        cases,
        tokenbucket_rls::window::sliding::decide,
        // (a charge counts whatever the verdict: it took what it counted)
        |outcomes, cost| (outcomes[0].admitted || outcomes[0].taken > 0) && cost.deducted() != 0,
        |params, state| state.updated_micros as i64 + 2 * params.unit_secs as i64 * SEC,
    )
    .await;
}

/// A calendar period's bucket (#41): `limit` a period, its periods placed
/// around the test's present: (start, end, next end) in seconds from now.
fn cp(limit: u64, period: (i64, i64, i64)) -> (BucketParams, (i64, i64, i64)) {
    (
        BucketParams {
            algorithm: tokenbucket_rls::bucket::Algorithm::CalendarWindow,
            ..fw(limit, 30 * 86_400)
        },
        period,
    )
}

/// A calendar case: its name; per bucket, its params with its periods
/// around now, and the stored count with the period it is of (`0` the
/// first, `1` the second, `-1` one before the first); the cost.
type CalendarCase = (
    &'static str,
    Vec<((BucketParams, (i64, i64, i64)), Option<(f64, i64)>)>,
    Cost,
);

fn calendar_cases() -> Vec<CalendarCase> {
    // a day that began an hour ago, and the next
    let day = (-3600, 23 * 3600, 47 * 3600);
    vec![
        ("a new period", vec![(cp(3, day), None)], Cost::Spend(1)),
        (
            "the last hit within",
            vec![(cp(3, day), Some((2.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "full: refused, and not counted",
            vec![(cp(3, day), Some((3.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "a weighted hit that does not fit",
            vec![(cp(10, day), Some((7.0, 0)))],
            Cost::Spend(4),
        ),
        (
            "the period before is none",
            vec![(cp(3, day), Some((3.0, -1)))],
            Cost::Spend(1),
        ),
        (
            "a charge past the limit",
            vec![(cp(1000, day), Some((900.0, 0)))],
            Cost::Charge(300),
        ),
        (
            "a check over",
            vec![(cp(3, day), Some((3.0, 0)))],
            Cost::Check,
        ),
        (
            "a refund",
            vec![(cp(10, day), Some((5.0, 0)))],
            Cost::Refund(2),
        ),
        (
            "a refund below nothing",
            vec![(cp(10, day), Some((1.0, 0)))],
            Cost::Refund(5),
        ),
        (
            "a cost above the limit",
            vec![(cp(10, day), None)],
            Cost::Spend(11),
        ),
        ("a limit of 0", vec![(cp(0, day), None)], Cost::Spend(1)),
        (
            "a charge on a limit of 0",
            vec![(cp(0, day), None)],
            Cost::Charge(3),
        ),
        (
            "one period of two refuses, neither counts",
            vec![
                (cp(1, day), Some((1.0, 0))),
                (cp(5, (-86_400, 30 * 86_400, 61 * 86_400)), None),
            ],
            Cost::Spend(1),
        ),
        (
            "the first period has ended by the server's clock",
            vec![(cp(3, (-7200, -10, 86_390)), Some((2.0, 1)))],
            Cost::Spend(1),
        ),
        (
            "the first period has not begun by the server's clock",
            vec![(cp(3, (30, 3630, 7230)), Some((1.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "a period's last seconds",
            vec![(cp(3, (-3600, 2, 3602)), Some((1.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "a day of 23 hours (clocks forward), full",
            vec![(cp(2, (-3600, 22 * 3600, 46 * 3600)), Some((2.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "a day of 25 hours (clocks back), full",
            vec![(cp(2, (-3600, 24 * 3600, 48 * 3600)), Some((2.0, 0)))],
            Cost::Spend(1),
        ),
        (
            "a leap year's February (29 days), full",
            vec![(cp(5, (-86_400, 28 * 86_400, 59 * 86_400)), Some((5.0, 0)))],
            Cost::Spend(1),
        ),
    ]
}

/// The calendar period's two copies (`src/window.rs` `decide_calendar`,
/// `bucket.lua` flag 32) give the same answers and store the same counts
/// (admitted hits, and charges whatever the verdict), the periods handed
/// to both as the limiter hands them, expiring when the period ends.
#[tokio::test]
async fn calendar_periods_in_lua_and_rust_give_the_same_answers() {
    let cases = calendar_cases()
        .into_iter()
        .map(|(name, buckets, cost)| WindowCase {
            name,
            cost,
            setup: Box::new(move |now: i64| {
                let now_s = now / SEC;
                buckets
                    .iter()
                    .map(|((params, (start, end, next_end)), state)| {
                        let period = tokenbucket_rls::calendar::Periods {
                            start: now_s + start,
                            end: now_s + end,
                            next_end: now_s + next_end,
                        };
                        let stored = state.map(|(count, which)| {
                            let start = match which {
                                0 => period.start,
                                1 => period.end,
                                _ => period.start - 86_400,
                            };
                            BucketState {
                                tokens: count,
                                updated_micros: (start * SEC) as u64,
                            }
                        });
                        let params = BucketParams {
                            period: Some(period),
                            ..*params
                        };
                        (params, stored)
                    })
                    .unzip()
            }),
        })
        .collect();
    lua_and_rust_agree(
        "calendar",
        cases,
        tokenbucket_rls::window::decide,
        |outcomes, cost| {
            (outcomes[0].admitted || outcomes.iter().any(|o| o.taken > 0)) && cost.deducted() != 0
        },
        |params, state| {
            let (_, end) = tokenbucket_rls::window::period_of(params, state.updated_micros);
            end as i64
        },
    )
    .await;
}

/// A window case for [`lua_and_rust_agree`]: its name, its cost, and its
/// buckets' params and stored states for a decision at the server's time
/// (µs).
struct WindowCase {
    name: &'static str,
    cost: Cost,
    setup: Box<dyn Fn(i64) -> WindowBuckets>,
}

/// A case's buckets: their params, and their stored states (`None`: none).
type WindowBuckets = (Vec<BucketParams>, Vec<Option<BucketState>>);

/// A copy of a window's arithmetic in Rust.
type Decide = fn(
    &[BucketParams],
    &[Option<BucketState>],
    u64,
    Cost,
) -> (Vec<BucketState>, Vec<BucketOutcome>);

/// Runs each case through the scripts (`one.lua` where it takes the
/// decision: one bucket; and `bucket.lua` always) and through `rust` on the
/// same stored states: the same answers, and, where `written` says the call
/// stores its buckets, the same states in Redis, expiring at the time
/// `expires_at` gives (µs; plus the store's 1 s margin). The answer can
/// depend on the microsecond, which the script reads from the server's
/// clock: Rust decides at the server's time read just before the script
/// and just after; when both give the same answer, so must the script
/// (every field moves one way as time passes), else the case runs again.
async fn lua_and_rust_agree(
    label: &str,
    cases: Vec<WindowCase>,
    rust: Decide,
    written: fn(&[BucketOutcome], Cost) -> bool,
    expires_at: fn(&BucketParams, &BucketState) -> i64,
) {
    let redis = RedisServer::standalone();
    let (lean, client) = store_and_client(&redis, BucketLayout::Packed).await;
    let (bucket_lua, _) = store_and_client(&redis, BucketLayout::Packed).await;
    let bucket_lua = bucket_lua.with_bucket_lua_only();
    for ((n, case), (script, store)) in cases
        .iter()
        .enumerate()
        .flat_map(|c| [(c, ("lean", &lean)), (c, ("bucket.lua", &bucket_lua))])
    {
        let (name, cost) = (case.name, case.cost);
        let name = format!("{name} ({script})");
        let name = name.as_str();
        let mut tries = 0;
        loop {
            tries += 1;
            assert!(
                tries <= 10,
                "case '{name}': never decided within one answer"
            );
            let tag = format!("{label}-{script}-{n}-{tries}").into_bytes();
            let before = server_now(&client).await;
            let (params, states) = (case.setup)(before);
            let descriptor = buckets_of(&tag, params.iter().copied());
            for (b, state) in descriptor.buckets.iter().zip(&states) {
                if let Some(s) = state {
                    store_packed(&client, &descriptor, b, *s).await;
                }
            }
            let lua = store.decide(&descriptor, cost).await.expect("script runs");
            let after = server_now(&client).await;
            let (_, early) = rust(&params, &states, before as u64, cost);
            let (rust_states, late) = rust(&params, &states, after as u64, cost);
            if early != late {
                continue;
            }
            assert_eq!(lua, late, "case '{name}'");
            for ((b, rust_state), seeded) in
                descriptor.buckets.iter().zip(&rust_states).zip(&states)
            {
                let key = redis_key(tag_hash(&descriptor.tag), &b.key);
                let stored = stored_bucket(&client, &key).await;
                if written(&late, cost) {
                    let (tokens, start) =
                        stored.unwrap_or_else(|| panic!("case '{name}': written"));
                    assert_eq!(
                        (tokens, start as u64),
                        (rust_state.tokens, rust_state.updated_micros),
                        "case '{name}': the counts stored"
                    );
                    let ttl: i64 = client.pttl(key).await.expect("PTTL");
                    let until = (expires_at(&b.params, rust_state) - before) / 1000;
                    assert!(
                        ttl > until - 1000 && ttl <= until + 2000,
                        "case '{name}': expires at {until} ms from now, plus the 1 s margin; TTL {ttl} ms"
                    );
                } else {
                    assert_eq!(
                        stored.map(|s| s.0),
                        seeded.map(|s| s.tokens),
                        "case '{name}': nothing written"
                    );
                }
            }
            break;
        }
    }
    // the one-bucket cases ran one.lua (loaded by the EVAL after its
    // first EVALSHA met NOSCRIPT)
    let (sha, _) = batch::scripts().of(batch::DecisionScript::One);
    assert_eq!(
        redis.cli(&["SCRIPT", "EXISTS", sha]).trim(),
        "1",
        "{label}: one.lua ran"
    );
}
