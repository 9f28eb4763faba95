//! Arbitrary bytes as what the service reads back from a Redis anyone may
//! have written to (#65): a shared heavy-hitter summary, a quota ledger's
//! reply, an instances count. Each decoder must refuse or clamp, never
//! panic, and never allocate by a size the input claims.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenbucket_rls::instances::{plausible, MAX_COUNTED_INSTANCES};
use tokenbucket_rls::quota::ledger::shared_from_reply;
use tokenbucket_rls::quota::allocation::Budget;
use tokenbucket_rls::telemetry::hitters::{merge_shared, SharedSummary};

/// The counters this reader keeps: the most `--heavy-hitters` allows.
const MAX_K: usize = 256;

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
    // an instances count
    if let Some(&first) = ints.first() {
        let n = u32::try_from(first).unwrap_or(u32::MAX);
        if let Some(counted) = plausible(n) {
            assert!((1..=MAX_COUNTED_INSTANCES).contains(&counted));
        }
    }
});
