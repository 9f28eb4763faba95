//! The memory store under hostile cardinality: a flood of 2,000,000 distinct
//! API keys at full speed against `--max-buckets 100000` keeps the resident
//! set within the cap's budget, counts every eviction, and a client spending
//! steadily on its own key meanwhile keeps its exact budget. Its own test
//! binary, so that the resident-set reading sees only this test.

mod common;

use std::sync::Arc;

use common::footprint::{api_key, rss};
use common::sample;
use tokenbucket_rls::bucket::{BucketParams, Cost};
use tokenbucket_rls::clock::ManualClock;
use tokenbucket_rls::labels::RuleId;
use tokenbucket_rls::store::memory::MemoryStore;
use tokenbucket_rls::telemetry::Metrics;

const CAP: usize = 100_000;
const FLOOD: usize = 2_000_000;

#[test]
fn a_flood_of_new_values_stays_within_the_cap_and_a_steady_client_keeps_its_budget() {
    let metrics = Arc::new(Metrics::new());
    // A manual clock at 200,000 new values per second: what "in steady use"
    // means is then the test's own pace, not how the machine schedules it (a
    // busy machine pausing this process for a second made the steady client
    // look idle).
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::with_cap(clock.clone(), CAP, Some(metrics.eviction_sink()));
    // `api_key` at 10 per day, burst 100: a flood bucket is 2.4 h from full,
    // so none refills during the test; every one that goes is evicted.
    let rule = RuleId::of("edge", "per_key");
    let params = BucketParams {
        capacity: 100,
        tokens_per_unit: 10,
        unit_secs: 86_400,
        max_debt: None,
        algorithm: Default::default(),
        period: None,
    };
    let descriptor = |value: &str| api_key(value, params, rule);
    let steady = descriptor("the-steady-client");
    // Fill to the cap first (the allocator and the shards' tables grown),
    // then measure the flood beyond it.
    for i in 0..CAP {
        store.decide_now(&descriptor(&format!("warm-{i}")), Cost::Spend(1));
    }
    let before = rss();
    let mut steady_admitted = 0;
    // The steady client is in steady use before the flood starts: a bucket
    // with one request behind it ranks with the warm-up's 100,000 (spent
    // once at the same instant), and the cap may evict any of them (a
    // CI run evicted it so, once: 101 admitted).
    for _ in 0..2 {
        steady_admitted += usize::from(store.decide_now(&steady, Cost::Spend(1))[0].admitted);
        clock.advance_micros(5_000);
    }
    let mut peak = 0;
    for i in 0..FLOOD {
        clock.advance_micros(5);
        assert!(store.decide_now(&descriptor(&format!("flood-{i}")), Cost::Spend(1))[0].admitted);
        if i % 1_000 == 0 {
            // every 5 ms: in steady use
            steady_admitted += usize::from(store.decide_now(&steady, Cost::Spend(1))[0].admitted);
        }
        if i % 100_000 == 0 {
            peak = peak.max(rss());
        }
    }
    let after = rss().max(peak);
    let held = store.len();
    assert!(held <= store.max_buckets(), "{held} held");
    assert!(store.max_buckets() <= CAP);
    let growth = after.saturating_sub(before);
    eprintln!(
        "flood of {FLOOD} against a cap of {CAP}: {held} held, resident set +{} KiB",
        growth >> 10
    );
    // The cap's budget: 200 B per bucket, plus 4 MiB of fixed overhead.
    assert!(
        growth <= (CAP * 200 + (4 << 20)) as u64,
        "resident set grew by {growth} bytes"
    );
    assert_eq!(
        steady_admitted, 100,
        "the steady client's burst, exactly: never evicted (it would come back full)"
    );
    let evicted = sample(
        &metrics.render(),
        "rls_buckets_evicted_total{domain=\"edge\",rule=\"per_key\"}",
    )
    .expect("evictions counted");
    assert_eq!(
        evicted as usize + held,
        CAP + FLOOD + 1,
        "every bucket is held or counted as evicted"
    );
}
