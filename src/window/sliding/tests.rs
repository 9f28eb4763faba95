use super::*;
use crate::bucket::{Algorithm, MAX_WINDOW_COUNT};

const SEC: u64 = MICROS;

fn p(limit: u64, window_secs: u64) -> BucketParams {
    BucketParams {
        capacity: limit,
        tokens_per_unit: limit,
        unit_secs: window_secs,
        max_debt: None,
        algorithm: Algorithm::SlidingWindow,
        period: None,
    }
}

fn packed(previous: f64, current: f64) -> f64 {
    BucketState::sliding_window(previous, current, 0).tokens
}

/// Decides `cost` on one bucket at `now`, carrying the state along.
fn one(
    params: BucketParams,
    state: &mut Option<BucketState>,
    now: u64,
    cost: Cost,
) -> BucketOutcome {
    let (states, outcomes) = decide(&[params], &[*state], now, cost);
    *state = Some(states[0]);
    outcomes[0]
}

/// Hits of one at `now` until one is refused: how many were admitted.
fn admitted_at(params: BucketParams, state: &mut Option<BucketState>, now: u64) -> u64 {
    let mut n = 0;
    while one(params, state, now, Cost::Spend(1)).admitted {
        n += 1;
        assert!(
            n <= params.tokens_per_unit,
            "never more than the limit at once"
        );
    }
    n
}

#[test]
fn counts_pack_into_one_float_exactly() {
    let max = MAX_WINDOW_COUNT as f64;
    for (previous, current) in [(0.0, 0.0), (3.0, 5.0), (max, max), (0.0, 1.0), (1.0, 0.0)] {
        let state = BucketState::sliding_window(previous, current, 60 * SEC);
        assert_eq!(state.window_counts(), (previous, current));
    }
}

#[test]
fn no_double_burst_across_an_edge() {
    // 10 a minute: all ten in the last second of one window, then at the
    // first second of the next, where a fixed window admits ten more
    let w = p(10, 60);
    let mut s = None;
    assert_eq!(admitted_at(w, &mut s, 600 * SEC - SEC), 10);
    assert_eq!(admitted_at(w, &mut s, 600 * SEC), 0, "the edge");
    // 6 s in: the window before weighs 10 × 0.9 = 9, room for one
    assert_eq!(admitted_at(w, &mut s, 606 * SEC), 1);
    // half way: the ten weigh 5, one is counted here: room for four
    assert_eq!(admitted_at(w, &mut s, 630 * SEC), 4);
    // over any 60 s, at most the limit plus what the weighting lets in
    // at its linear estimate; two windows on, nothing weighs
    assert_eq!(admitted_at(w, &mut s, 720 * SEC), 10);
}

#[test]
fn a_refusal_waits_until_the_estimate_has_room() {
    let w = p(10, 60);
    // ten in the window before, none now, 6 s in: 9 counted, one fits
    let before = Some(BucketState {
        tokens: packed(0.0, 10.0),
        updated_micros: 540 * SEC,
    });
    let mut s = before;
    assert!(one(w, &mut s, 606 * SEC, Cost::Spend(1)).admitted);
    // now 9 + 1: a hit of one needs the window before to weigh 8, at 12 s
    let refused = one(w, &mut s, 606 * SEC, Cost::Spend(1));
    assert!(!refused.admitted);
    assert_eq!(refused.retry_after_secs, Some(6));
    assert_eq!(refused.remaining, 0);
    // a hit of three needs it to weigh 6: at 24 s
    let mut t = s;
    assert_eq!(
        one(w, &mut t, 606 * SEC, Cost::Spend(3)).retry_after_secs,
        Some(18)
    );
    // waited for exactly: admitted then, not a microsecond before
    let mut u = s;
    assert!(!one(w, &mut u, 612 * SEC - 1, Cost::Spend(1)).admitted);
    assert!(one(w, &mut u, 612 * SEC, Cost::Spend(1)).admitted);
}

#[test]
fn a_full_current_window_waits_into_the_next() {
    let w = p(10, 60);
    let mut s = Some(BucketState {
        tokens: packed(0.0, 10.0),
        updated_micros: 600 * SEC,
    });
    // 50 s into a window that counted ten: the next starts in 10 s, where
    // these ten weigh 10, falling to 9 (room for one) 6 s after it
    let refused = one(w, &mut s, 650 * SEC, Cost::Spend(1));
    assert_eq!(refused.retry_after_secs, Some(16));
    // estimate 0 two windows after this one's start
    assert_eq!(refused.full_in_secs, 70);
    assert_eq!(w.full_at_micros(&s.expect("state")), Some(720 * SEC));
}

#[test]
fn a_request_at_the_last_microsecond_of_a_window_belongs_to_it() {
    let w = p(2, 60);
    let mut s = None;
    let last = 660 * SEC - 1;
    assert_eq!(admitted_at(w, &mut s, last), 2);
    assert_eq!(s.map(|s| s.updated_micros), Some(600 * SEC));
    // a microsecond later the two weigh all but nothing: still full
    assert_eq!(admitted_at(w, &mut s, 660 * SEC), 0);
    assert_eq!(s.map(|s| s.window_counts()), Some((2.0, 0.0)));
}

#[test]
fn checks_count_nothing_and_refunds_give_back() {
    let w = p(3, 60);
    let mut s = None;
    let check = one(w, &mut s, 60 * SEC, Cost::Check);
    assert!(check.admitted);
    assert_eq!((check.remaining, check.taken), (3, 0));
    assert_eq!(admitted_at(w, &mut s, 60 * SEC), 3);
    assert!(!one(w, &mut s, 60 * SEC, Cost::Check).admitted);
    let refund = one(w, &mut s, 60 * SEC, Cost::Refund(2));
    assert!(refund.admitted);
    assert_eq!(refund.remaining, 2);
    // never below nothing
    one(w, &mut s, 60 * SEC, Cost::Refund(10));
    assert_eq!(s.map(|s| s.window_counts()), Some((0.0, 0.0)));
}

#[test]
fn costs_it_can_never_hold_and_a_limit_of_zero_say_so() {
    let mut s = None;
    let above = one(p(3, 60), &mut s, 60 * SEC, Cost::Spend(4));
    assert_eq!(
        (above.admitted, above.never),
        (false, Some(NeverReason::CostAboveCapacity))
    );
    assert_eq!(above.retry_after_secs, None);
    let zero = one(p(0, 60), &mut s, 60 * SEC, Cost::Spend(1));
    assert_eq!(zero.never, Some(NeverReason::ZeroRate));
}

#[test]
fn several_limits_are_all_charged_or_none() {
    let (short, long) = (p(2, 1), p(3, 60));
    let mut states = vec![None, None];
    let mut decide_both = |now| {
        let (next, outcomes) = decide(&[short, long], &states, now, Cost::Spend(1));
        states = next.into_iter().map(Some).collect();
        outcomes
    };
    assert!(decide_both(60 * SEC)[0].admitted);
    assert!(decide_both(60 * SEC)[0].admitted);
    let refused = decide_both(60 * SEC);
    assert!(!refused[0].admitted);
    assert_eq!(refused[1].retry_after_secs, None, "the long one had room");
    assert_eq!(refused[1].remaining, 1, "and was not charged");
}

#[test]
fn a_clock_stepped_back_reads_the_stored_windows_unaged() {
    let w = p(4, 60);
    let mut s = None;
    assert_eq!(admitted_at(w, &mut s, 630 * SEC), 4);
    // back into the window before: the stored one stands, as at its start
    let back = one(w, &mut s, 590 * SEC, Cost::Spend(1));
    assert!(!back.admitted);
    assert_eq!(s.map(|s| s.updated_micros), Some(600 * SEC));
    // a window later (forward again) the four weigh as they should
    assert_eq!(admitted_at(w, &mut s, 690 * SEC), 2);
}

#[test]
fn a_state_two_windows_old_or_more_counts_nothing() {
    let w = p(5, 60);
    let mut s = Some(BucketState {
        tokens: packed(5.0, 5.0),
        updated_micros: 600 * SEC,
    });
    assert_eq!(admitted_at(w, &mut s, 720 * SEC), 5);
}

/// A client asking four times a second of a sliding window of 10 per 10 s
/// gets the limit in every span of a window's length (never the twice the
/// limit a fixed window lets through an edge), and the rate over a minute.
#[test]
fn a_steady_client_gets_the_limit_in_any_span_of_a_window() {
    let w = p(10, 10);
    let mut s = None;
    let mut admitted_at_second = Vec::new();
    for t in 100..160 {
        for _ in 0..4 {
            if one(w, &mut s, t * SEC, Cost::Spend(1)).admitted {
                admitted_at_second.push(t);
            }
        }
    }
    let most = (100..150)
        .map(|start| {
            admitted_at_second
                .iter()
                .filter(|t| (start..start + 10).contains(*t))
                .count()
        })
        .max();
    assert_eq!(most, Some(10));
    // the first ten at once, then a little under one a second (asking
    // four times at each second, a hit waits for the weight of the window
    // before to leave a whole hit of room): never above the rate
    assert_eq!(admitted_at_second.len(), 55);
}

#[test]
fn a_charge_counts_past_the_limit_and_a_give_back_goes_to_its_window() {
    let q = p(10, 60);
    let t = 1_000_000_020 * SEC;
    let mut s = None;
    let o = one(q, &mut s, t, Cost::Charge(12));
    assert_eq!((o.admitted, o.taken), (false, 12), "counted, answered over");
    assert_eq!(s.map(|s| s.window_counts()), Some((0.0, 12.0)));
    let back = |at: u64| Cost::GiveBack {
        tokens: 5,
        taken_micros: at,
    };
    let o = one(q, &mut s, t + SEC, back(t));
    assert_eq!((o.admitted, o.remaining), (true, 3));
    // the window after: the one before weighs, nothing given to this one
    let next = t + 60 * SEC;
    one(q, &mut s, next, Cost::Spend(0));
    let o = one(q, &mut s, next, back(t));
    assert!(o.admitted);
    assert_eq!(s.map(|s| s.window_counts()), Some((7.0, 0.0)));
    // a charge on a limit of 0 counts nothing (no debt could be repaid)
    let mut z = None;
    let o = one(p(0, 60), &mut z, t, Cost::Charge(3));
    assert_eq!((o.admitted, o.taken), (false, 0));
    // a huge charge is held to what a window can count
    let mut h = None;
    one(q, &mut h, t, Cost::Charge(u64::MAX));
    assert_eq!(
        h.map(|s| s.window_counts().1),
        Some(MAX_WINDOW_COUNT as f64)
    );
}
