//! Arbitrary bytes as what the service reads back from a Redis anyone may
//! have written to, or a peer sent (#65): a shared heavy-hitter summary, a
//! quota ledger's reply, an instances count, a global tier's assignments
//! to a region. Each reader must refuse or clamp, never panic, and never
//! allocate by a size the input claims.
#![no_main]

use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tokenbucket_rls::bucket::{Algorithm, BucketParams};
use tokenbucket_rls::quota::region::{RegionLimit, RegionShares};
use tokenbucket_rls::rules::FailureMode;
use tokenbucket_rls::instances::{plausible, MAX_COUNTED_INSTANCES};
use tokenbucket_rls::quota::ledger::shared_from_reply;
use tokenbucket_rls::quota::allocation::Budget;
use tokenbucket_rls::telemetry::hitters::{merge_shared, SharedSummary};

/// The counters this reader keeps: the most `--heavy-hitters` allows.
const MAX_K: usize = 256;

/// A global rule's bucket: B = 90, 30 a second.
const RULE: BucketParams = BucketParams {
    capacity: 90,
    tokens_per_unit: 30,
    unit_secs: 1,
    max_debt: None,
    algorithm: Algorithm::TokenBucket,
    period: None,
};

/// What a region decides the bucket with after the global tier's answer
/// `data`: never more than the rule's own budget.
fn region_after(data: &[u8]) {
    let Ok(answer) = RateLimitQuotaResponse::decode(data) else {
        return;
    };
    let shares = RegionShares::new(3);
    let limit = |now| {
        shares.limit(
            "d",
            b"tag-a",
            [("api_key", "a")].into_iter(),
            RULE,
            FailureMode::Local,
            now,
        )
    };
    let now = shares.now_micros();
    let _ = limit(now);
    shares.apply("d", &answer.bucket_action, now);
    if let RegionLimit::Share(p) | RegionLimit::Floor(p) = limit(now) {
        assert!(p.capacity <= RULE.capacity && p.tokens_per_unit <= RULE.tokens_per_unit);
    }
}

fuzz_target!(|data: &[u8]| {
    // a summary: refused, or within what this reader keeps
    if let Ok(summary) = SharedSummary::parse(data, MAX_K) {
        assert!(summary.k <= MAX_K && summary.counters.len() <= summary.k);
        let (top, _) = merge_shared(&[summary.clone(), summary], 10, &[]);
        assert!(top.len() <= 10);
    }
    // a ledger reply: seven integers, kept within the step's budget
    let ints: Vec<i64> = data
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect();
    let budget = Budget { burst: 200.0, rate: 100.0 };
    if let Ok(shared) = shared_from_reply(&ints) {
        let s = shared.within(budget, 15_000);
        assert!(s.share.burst <= 200.0 && s.share.rate <= 100.0);
        assert!((0..=15_000).contains(&s.life_ms));
        assert!(s.replicas <= MAX_COUNTED_INSTANCES);
    }
    region_after(data);
    // an instances count
    if let Some(&first) = ints.first() {
        let n = u32::try_from(first).unwrap_or(u32::MAX);
        if let Some(counted) = plausible(n) {
            assert!((1..=MAX_COUNTED_INSTANCES).contains(&counted));
        }
    }
});
