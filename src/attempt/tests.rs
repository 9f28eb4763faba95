use super::*;

const S: u64 = 1_000_000;

fn call(phase: Phase, mode: AttemptMode) -> AttemptCall {
    AttemptCall {
        id: b"req-1".to_vec(),
        phase,
        mode,
        ttl_micros: 60 * S,
        max_repeats: 3,
    }
}

/// Runs one call through plan and record_after, as a store does, with the
/// buckets admitting (`admitted`) and taking what the cost deducts.
fn step(
    record: &mut Option<AttemptRecord>,
    call: &AttemptCall,
    cost: Cost,
    admitted: bool,
    now: u64,
) -> Planned {
    let planned = plan(call, record.as_ref(), cost, now);
    if let Some(cost) = planned.cost {
        let taken = if admitted {
            u64::try_from(cost.deducted().max(0)).unwrap_or(0)
        } else {
            0
        };
        if let Some(r) = record_after(call, record.as_ref(), &planned, admitted, taken, now) {
            *record = Some(r);
        }
    }
    planned
}

#[test]
fn a_repeated_start_is_answered_free_once_admitted() {
    let start = call(Phase::Start, AttemptMode::Dedupe);
    let mut record = None;
    let first = step(&mut record, &start, Cost::Spend(3), true, 10 * S);
    assert_eq!(first.cost, Some(Cost::Spend(3)));
    assert_eq!(first.result, AttemptResult::First);
    let again = step(&mut record, &start, Cost::Spend(3), true, 11 * S);
    assert_eq!(again.cost, None);
    assert_eq!(again.result, AttemptResult::Repeat);
    // known for twice the time to live, then decided afresh
    let late = plan(&start, record.as_ref(), Cost::Spend(3), 10 * S + 120 * S);
    assert_eq!(late.result, AttemptResult::First);
}

#[test]
fn a_refused_start_is_not_remembered() {
    let start = call(Phase::Start, AttemptMode::Reserve);
    let mut record = None;
    step(&mut record, &start, Cost::Spend(600), false, 10 * S);
    assert_eq!(record, None);
    let again = step(&mut record, &start, Cost::Spend(600), true, 12 * S);
    assert_eq!(again.result, AttemptResult::First, "decided afresh");
    assert_eq!(record.and_then(|r| r.started), Some(600));
}

#[test]
fn a_check_is_never_remembered() {
    let start = call(Phase::Start, AttemptMode::Reserve);
    let mut record = None;
    step(&mut record, &start, Cost::Check, true, 10 * S);
    assert_eq!(record, None);
}

#[test]
fn a_done_call_settles_the_difference_once() {
    let (start, done) = (
        call(Phase::Start, AttemptMode::Reserve),
        call(Phase::Done, AttemptMode::Reserve),
    );
    // used more than reserved: the rest is charged
    let mut record = None;
    step(&mut record, &start, Cost::Spend(600), true, 10 * S);
    let settle = step(&mut record, &done, Cost::Charge(750), true, 20 * S);
    assert_eq!(settle.cost, Some(Cost::Charge(150)));
    assert_eq!(settle.result, AttemptResult::Settled);
    let again = step(&mut record, &done, Cost::Charge(750), true, 21 * S);
    assert_eq!((again.cost, again.result), (None, AttemptResult::Repeat));
    // used less: the rest given back; used nothing (a check): all of it
    let mut record = None;
    step(&mut record, &start, Cost::Spend(600), true, 10 * S);
    let settle = step(&mut record, &done, Cost::Charge(200), true, 20 * S);
    assert_eq!(settle.cost, Some(given(400, 10 * S)));
    let mut record = None;
    step(&mut record, &start, Cost::Spend(600), true, 10 * S);
    let settle = step(&mut record, &done, Cost::Check, true, 20 * S);
    assert_eq!(settle.cost, Some(given(600, 10 * S)));
    // exactly what was reserved: nothing moves
    assert_eq!(settlement(600, 600, 10 * S), Cost::Charge(0));
}

#[test]
fn a_late_done_call_still_settles_exactly_and_an_unknown_one_is_charged_in_full() {
    let (start, done) = (
        call(Phase::Start, AttemptMode::Reserve),
        call(Phase::Done, AttemptMode::Reserve),
    );
    let mut record = None;
    step(&mut record, &start, Cost::Spend(600), true, 10 * S);
    let r = record.expect("recorded");
    assert!(!r.expired_unsettled(69 * S));
    assert!(
        r.expired_unsettled(70 * S),
        "kept as spent at the time to live"
    );
    let late = step(&mut record, &done, Cost::Charge(100), true, 100 * S);
    assert_eq!(
        late.cost,
        Some(given(500, 10 * S)),
        "to the window of its start"
    );
    assert_eq!(late.result, AttemptResult::Late);
    assert!(!record.expect("kept").expired_unsettled(100 * S), "settled");
    // after twice the time to live the record is gone: charged in full
    let mut record = None;
    step(&mut record, &start, Cost::Spend(600), true, 10 * S);
    let unknown = step(&mut record, &done, Cost::Charge(100), true, 131 * S);
    assert_eq!(unknown.cost, Some(Cost::Charge(100)));
    assert_eq!(unknown.result, AttemptResult::Unknown);
    let again = step(&mut record, &done, Cost::Charge(100), true, 132 * S);
    assert_eq!(again.result, AttemptResult::Repeat, "charged once");
}

/// What an attempt's start, taken at `at`, gives back.
fn given(tokens: u64, at: u64) -> Cost {
    Cost::GiveBack {
        tokens,
        taken_micros: at,
    }
}

#[test]
fn a_dedupe_rule_tells_the_phases_apart() {
    let (start, done) = (
        call(Phase::Start, AttemptMode::Dedupe),
        call(Phase::Done, AttemptMode::Dedupe),
    );
    let mut record = None;
    step(&mut record, &start, Cost::Spend(1), true, 10 * S);
    let d = step(&mut record, &done, Cost::Spend(5), true, 11 * S);
    assert_eq!(
        (d.cost, d.result),
        (Some(Cost::Spend(5)), AttemptResult::First)
    );
    let d = step(&mut record, &done, Cost::Spend(5), true, 12 * S);
    assert_eq!(d.result, AttemptResult::Repeat);
    // the attempt ended: a start with its id again is a new attempt,
    // charged (no free pass for a client that reuses an id)
    let s = step(&mut record, &start, Cost::Spend(1), true, 12 * S);
    assert_eq!(
        (s.cost, s.result),
        (Some(Cost::Spend(1)), AttemptResult::First)
    );
    let s = step(&mut record, &start, Cost::Spend(1), true, 13 * S);
    assert_eq!(
        s.result,
        AttemptResult::Repeat,
        "a repeat of the live start"
    );
}

#[test]
fn a_settled_or_given_back_reservation_is_no_free_pass() {
    let (start, done) = (
        call(Phase::Start, AttemptMode::Reserve),
        call(Phase::Done, AttemptMode::Reserve),
    );
    let mut record = None;
    step(&mut record, &start, Cost::Spend(600), true, 10 * S);
    // given back: settled as having used nothing
    let back = step(&mut record, &done, Cost::Charge(0), true, 11 * S);
    assert_eq!(
        (back.cost, back.result),
        (Some(given(600, 10 * S)), AttemptResult::Settled)
    );
    let again = step(&mut record, &start, Cost::Spend(600), true, 12 * S);
    assert_eq!(
        (again.cost, again.result),
        (Some(Cost::Spend(600)), AttemptResult::First),
        "reserved afresh"
    );
    let settle = step(&mut record, &done, Cost::Charge(100), true, 13 * S);
    assert_eq!(settle.cost, Some(given(500, 12 * S)), "settles the new one");
}

#[test]
fn a_negative_usage_counts_as_nothing_used() {
    let (start, done) = (
        call(Phase::Start, AttemptMode::Reserve),
        call(Phase::Done, AttemptMode::Reserve),
    );
    let mut record = None;
    step(&mut record, &start, Cost::Spend(10), true, 10 * S);
    let d = step(&mut record, &done, Cost::Refund(50), true, 11 * S);
    assert_eq!(
        d.cost,
        Some(given(10, 10 * S)),
        "the reservation back, no more"
    );
}

#[test]
fn slots_hold_at_most_max_and_return_on_release_or_expiry() {
    let mut held = Slots::new();
    for id in ["a", "b", "c"] {
        let o = take_slot(&mut held, id.as_bytes(), 3, 10 * S, 3, S);
        assert_eq!((o.admitted, o.result), (true, AttemptResult::First));
    }
    let o = take_slot(&mut held, b"d", 3, 10 * S, 3, 2 * S);
    assert_eq!((o.admitted, o.in_flight), (false, 3));
    let o = take_slot(&mut held, b"b", 3, 10 * S, 3, 2 * S);
    assert_eq!(
        (o.admitted, o.result),
        (true, AttemptResult::Repeat),
        "held already"
    );
    let o = release_slot(&mut held, b"b", 3 * S);
    assert_eq!((o.result, o.in_flight), (AttemptResult::Released, 2));
    let o = release_slot(&mut held, b"b", 3 * S);
    assert_eq!(o.result, AttemptResult::NotHeld, "released once");
    let o = take_slot(&mut held, b"d", 3, 10 * S, 3, 4 * S);
    assert!(o.admitted);
    // a and c were never released: back by themselves at 11 s
    let o = take_slot(&mut held, b"e", 3, 10 * S, 3, 11 * S);
    assert_eq!((o.admitted, o.expired, o.in_flight), (true, 2, 2));
}

#[test]
fn slots_stay_exact_and_their_queue_bounded_at_any_count() {
    let mut held = Slots::new();
    // a flood of short requests: taken and released, the queue's stale
    // entries dropped as they outnumber the live ones
    for i in 0..10_000u64 {
        let id = format!("r{i}");
        assert!(take_slot(&mut held, id.as_bytes(), 3, 10 * S, 3, S + i).admitted);
        let o = release_slot(&mut held, id.as_bytes(), S + i);
        assert_eq!(o.result, AttemptResult::Released);
    }
    assert!(held.is_empty());
    assert_eq!(held.id_bytes(), 0);
    assert!(
        held.queue.len() <= 2 * held.len() + 65,
        "{}",
        held.queue.len()
    );
    // a slot taken again after its release keeps only its new time
    take_slot(&mut held, b"x", 3, 10 * S, 3, S);
    release_slot(&mut held, b"x", 2 * S);
    take_slot(&mut held, b"x", 3, 10 * S, 3, 5 * S);
    let o = take_slot(&mut held, b"y", 3, 10 * S, 3, 12 * S);
    assert_eq!((o.expired, o.in_flight), (0, 2), "x held until 15 s");
    let o = take_slot(&mut held, b"z", 3, 10 * S, 3, 15 * S);
    assert_eq!((o.expired, o.in_flight), (1, 2));
    // 200,000 held: a start is refused, a repeat answered, then they all
    // return at once with their bytes
    let mut many = Slots::new();
    for i in 0..200_000u64 {
        take_slot(
            &mut many,
            format!("{i:06}").as_bytes(),
            200_000,
            10 * S,
            3,
            S,
        );
    }
    let o = take_slot(&mut many, b"one-more", 200_000, 10 * S, 3, 2 * S);
    assert_eq!((o.admitted, o.in_flight), (false, 200_000));
    assert_eq!(
        take_slot(&mut many, b"000007", 200_000, 10 * S, 3, 2 * S).result,
        AttemptResult::Repeat
    );
    assert_eq!(many.id_bytes(), 200_000 * 6);
    assert_eq!(many.expire(11 * S), (200_000, 200_000 * 6));
    assert!(many.is_empty());
}

#[test]
fn a_live_starts_repeats_are_bounded_and_past_the_bound_it_is_a_reuse() {
    let (start, done) = (
        call(Phase::Start, AttemptMode::Dedupe),
        call(Phase::Done, AttemptMode::Dedupe),
    );
    let mut record = None;
    let mut results = Vec::new();
    for i in 0..6 {
        let planned = step(&mut record, &start, Cost::Spend(1), true, 10 * S + i);
        if let Some(r) = after_repeat(&start, record.as_ref(), &planned) {
            record = Some(r);
        }
        results.push(planned.result);
    }
    use AttemptResult::{First, Repeat, Reused};
    assert_eq!(
        results,
        [First, Repeat, Repeat, Repeat, Reused, Reused],
        "max_repeats 3"
    );
    assert_eq!(record.map(|r| r.repeats), Some(3));
    // its done call ends it; a start after is a new attempt, counted afresh
    step(&mut record, &done, Cost::Spend(1), true, 11 * S);
    let again = step(&mut record, &start, Cost::Spend(1), true, 12 * S);
    assert_eq!(again.result, First);
    assert_eq!(record.map(|r| r.repeats), Some(0));
}

#[test]
fn a_slots_start_repeated_past_max_repeats_is_a_reuse() {
    let mut held = Slots::new();
    let results: Vec<_> = (0..5)
        .map(|i| {
            let o = take_slot(&mut held, b"same", 3, 10 * S, 2, S + i);
            (o.admitted, o.result)
        })
        .collect();
    use AttemptResult::{First, Repeat, Reused};
    assert_eq!(
        results,
        [
            (true, First),
            (true, Repeat),
            (true, Repeat),
            (false, Reused),
            (false, Reused)
        ]
    );
    assert_eq!(held.len(), 1, "one slot whatever the repeats");
    release_slot(&mut held, b"same", 2 * S);
    let o = take_slot(&mut held, b"same", 3, 10 * S, 2, 3 * S);
    assert_eq!((o.admitted, o.result), (true, First), "a new attempt");
}
