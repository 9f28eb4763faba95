use super::*;

const BUDGET: Budget = Budget {
    burst: 200.0,
    rate: 100.0,
};
const TTL_MS: i64 = 15_000;

fn step(l: &mut Ledger, member: &str, demand: Option<f64>, now_ms: i64) -> Shared {
    step_pairs(l, member, demand, 1, now_ms)
}

/// A step of a replica whose `pairs` Envoys together ask `demand`.
fn step_pairs(
    l: &mut Ledger,
    member: &str,
    demand: Option<f64>,
    pairs: u32,
    now_ms: i64,
) -> Shared {
    let demand = demand.map(|per_sec| Demand { per_sec, pairs });
    let reply = l.step(member, StepArgs::new(demand, BUDGET, TTL_MS), now_ms);
    shared_from_reply(&reply).expect("five values")
}

/// Σ of what every member may enforce at `now`, in milli units.
fn reserved(l: &Ledger, now_ms: i64) -> (f64, f64) {
    l.members
        .values()
        .map(|r| r.reserved(now_ms as f64))
        .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
}

fn assert_bounded(l: &Ledger, now_ms: i64) {
    let (b, r) = reserved(l, now_ms);
    assert!(
        b <= BUDGET.burst * 1000.0 + 1e-6 && r <= BUDGET.rate * 1000.0 + 1e-6,
        "over the budget at {now_ms}: {b} {r}"
    );
}

#[test]
fn one_member_gets_all_but_the_newcomer_reserve() {
    let mut l = Ledger::default();
    let s = step(&mut l, "a:1", Some(500.0), 0);
    assert_eq!(
        s.share,
        Budget {
            burst: 180.0,
            rate: 90.0
        }
    );
    assert_eq!(s.members, 1);
    assert_eq!(s.reserved, s.share);
}

#[test]
fn members_of_two_replicas_split_by_demand_with_a_floor() {
    let mut l = Ledger::default();
    // 900 and 100 requests/s, each stepping every second from its replica
    let mut now = 0;
    let (mut a, mut b) = (
        step(&mut l, "1:1", Some(900.0), now),
        step(&mut l, "2:1", Some(100.0), now),
    );
    for _ in 0..40 {
        now += 1_000;
        a = step(&mut l, "1:1", Some(900.0), now);
        b = step(&mut l, "2:1", Some(100.0), now);
        assert_bounded(&l, now);
    }
    // targets: 90 × (0.1 + 0.8 × 0.9) = 73.8 and 90 × (0.1 + 0.8 × 0.1) = 16.2
    assert!((a.share.rate - 73.8).abs() < 0.01, "{a:?}");
    assert!((b.share.rate - 16.2).abs() < 0.01, "{b:?}");
    assert_eq!(a.members, 2);
}

#[test]
fn a_leaving_member_keeps_its_reservation_until_it_expires() {
    let mut l = Ledger::default();
    step(&mut l, "1:1", Some(100.0), 0);
    let b = step(&mut l, "2:1", Some(100.0), 0);
    // the first took 90 before the second came: the second gets what is left
    assert_eq!(b.share.rate, 10.0);
    step(&mut l, "1:1", None, 1_000);
    // until the leaver's assignment expires (15 s after 0), 10/s is all
    let b = step(&mut l, "2:1", Some(100.0), 2_000);
    assert_eq!(b.share.rate, 10.0);
    assert_eq!(b.members, 1);
    let b = step(&mut l, "2:1", Some(100.0), 15_001);
    assert_eq!(b.share.rate, 90.0);
    // and the leaver's record is gone
    assert_eq!(l.records(), 1);
}

#[test]
fn a_member_that_stopped_stepping_no_longer_counts_after_stale_ms() {
    let mut l = Ledger::default();
    step(&mut l, "1:1", Some(100.0), 0);
    // kept by a second step: reserved for the whole time to live
    step(&mut l, "1:1", Some(100.0), 1);
    let b = step(&mut l, "2:1", Some(100.0), 1);
    assert_eq!(b.members, 2);
    // replica 1 dies: still counted (and its 90/s reserved) for STALE_MS
    let b = step(&mut l, "2:1", Some(100.0), STALE_MS + 1);
    assert_eq!(b.members, 2);
    let b = step(&mut l, "2:1", Some(100.0), STALE_MS + 2);
    assert_eq!(b.members, 1);
    assert_eq!(b.reserved.rate, 100.0, "the dead one's 90 is still live");
}

/// A share that grows is reserved [`GROW_MS`] until a later step keeps it:
/// a replica whose Envoy's first real report lands first takes most of the
/// budget from the other's stale demand, but keeps it reserved only that
/// long, and the other grows into it once it has shrunk (before, it held
/// the other to what was left for a whole time to live).
#[test]
fn a_share_that_grows_is_tentative_for_one_step() {
    let mut l = Ledger::default();
    // both replicas' Envoys have sent only their first report (1/s)
    for t in [0, 1_000, 2_000] {
        step(&mut l, "a", Some(1.0), t);
        step(&mut l, "b", Some(1.0), t);
    }
    // a's Envoy reports 8,000/s first: a takes 0.9 of the budget's 90 %
    let a = step(&mut l, "a", Some(8_000.0), 3_000);
    assert!(a.share.rate > 80.0, "{:?}", a.share);
    assert_eq!(a.life_ms, GROW_MS);
    // b's report lands a moment later: b is held to what a leaves
    let b = step(&mut l, "b", Some(8_000.0), 3_100);
    assert!(b.share.rate < 20.0, "{:?}", b.share);
    // a shrinks to its half at its next step; its grown share is reserved
    // until GROW_MS after it was taken, then b grows into the rest
    let a = step(&mut l, "a", Some(8_000.0), 4_000);
    assert_eq!(a.share.rate, 45.0);
    assert_eq!(a.life_ms, TTL_MS, "a shrinking share is not tentative");
    let b = step(&mut l, "b", Some(8_000.0), 3_000 + GROW_MS + 1);
    assert_eq!(b.share.rate, 45.0);
    // once kept, a share lives the whole time to live
    let b = step(&mut l, "b", Some(8_000.0), 3_000 + GROW_MS + 1_000);
    assert_eq!((b.share.rate, b.life_ms), (45.0, TTL_MS));
}

#[test]
fn a_small_move_keeps_the_share_and_a_large_one_keeps_the_old_reserved() {
    let mut l = Ledger::default();
    step(&mut l, "1:1", Some(100.0), 0);
    step(&mut l, "2:1", Some(100.0), 0);
    // equal demand: once the first one's 90 has expired, both get 45
    for t in 1..=20 {
        step(&mut l, "1:1", Some(100.0), t * 1_000);
        step(&mut l, "2:1", Some(100.0), t * 1_000);
    }
    let a = step(&mut l, "1:1", Some(100.0), 21_000);
    assert_eq!(a.share.rate, 45.0);
    let before = l.members["2:1"];
    // 104 against 100 would be 45.9, within 5 % of 45: kept, only extended
    let b = step(&mut l, "2:1", Some(104.0), 22_000);
    assert_eq!(b.share.rate, 45.0);
    let after = l.members["2:1"];
    assert_eq!(after.earlier, before.earlier);
    assert_eq!(after.current.2, 22_000.0 + TTL_MS as f64);
    // a large move down: the new share at once, the old one stays reserved
    let b = step(&mut l, "2:1", Some(10.0), 23_000);
    assert!(b.share.rate < 30.0, "{b:?}");
    let after = l.members["2:1"];
    assert_eq!(after.earlier.1, 45_000.0);
    assert_eq!(after.earlier.2, 22_000.0 + TTL_MS as f64);
    assert_eq!(b.reserved.rate, 90.0);
}

/// Random steps, leaves and clock moves of five members on two replicas:
/// after every step the members' live assignments never exceed the budget,
/// and no share exceeds its member's target.
#[test]
fn no_sequence_of_steps_assigns_more_than_the_budget() {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let members = ["1:1", "1:2", "2:1", "2:2", "2:3"];
    let mut l = Ledger::default();
    let mut now = 0;
    for _ in 0..20_000 {
        let m = members[next(5) as usize];
        match next(10) {
            0 => {
                step(&mut l, m, None, now);
            }
            1 | 2 => now += next(4_000) as i64,
            _ => {
                let demand = next(1_000) as f64;
                let s = step(&mut l, m, Some(demand), now);
                assert!(s.share.rate <= 90.0 && s.share.burst <= 180.0, "{s:?}");
            }
        }
        assert_bounded(&l, now);
    }
}

/// A replica's step counts its Envoys: one replica of three Envoys and one
/// of one, all idle, split as four Envoys would (3/4 and 1/4 of the
/// assignable 180 and 90), not half and half.
#[test]
fn a_replica_counts_as_the_envoys_it_sums() {
    let mut l = Ledger::default();
    step_pairs(&mut l, "r1", Some(0.0), 3, 0);
    // r1's first share (all of the assignable 180 and 90) lives: r2 gets
    // what it leaves
    let one = step_pairs(&mut l, "r2", Some(0.0), 1, 0);
    assert_eq!(one.members, 4);
    assert_eq!(
        one.share,
        Budget {
            burst: 20.0,
            rate: 10.0
        }
    );
    let three = step_pairs(&mut l, "r1", Some(0.0), 3, 1);
    assert_eq!(
        three.share,
        Budget {
            burst: 135.0,
            rate: 67.5
        }
    );
    assert_bounded(&l, 1);
    // once r1's first share has expired, r2 has its quarter (both step
    // now and then, as replicas do every second, so both stay active)
    step_pairs(&mut l, "r2", Some(0.0), 1, TTL_MS - 1000);
    step_pairs(&mut l, "r1", Some(0.0), 3, TTL_MS - 1000);
    let later = step_pairs(&mut l, "r2", Some(0.0), 1, TTL_MS + 2);
    assert_eq!(
        later.share,
        Budget {
            burst: 45.0,
            rate: 22.5
        }
    );
    assert_bounded(&l, TTL_MS + 2);
}

/// #65: a reply read back from a Redis someone else wrote to is kept
/// within what the step asked: no share over the budget, no life past the
/// time to live, no replica count past any fleet.
#[test]
fn a_forged_reply_is_kept_within_the_step() {
    let forged = [i64::MAX, i64::MAX, 5, 0, 0, i64::MAX, i64::MAX];
    let s = shared_from_reply(&forged)
        .expect("seven values")
        .within(BUDGET, TTL_MS);
    assert!(
        s.share.burst <= BUDGET.burst && s.share.rate <= BUDGET.rate,
        "{s:?}"
    );
    assert_eq!(s.life_ms, TTL_MS);
    assert_eq!(s.replicas, crate::instances::MAX_COUNTED_INSTANCES);
    // an honest answer is unchanged
    let mut l = Ledger::default();
    let honest = step(&mut l, "a", Some(10.0), 0);
    assert_eq!(honest.within(BUDGET, TTL_MS), honest);
}
