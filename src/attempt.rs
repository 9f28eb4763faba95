//! Attempts: the calls one request makes, identified by an id the rule
//! names (Envoy fills it from `x-request-id`), and what a store remembers
//! of them so that each is charged once.
//!
//! Pure: no I/O, every entry point takes the time. A store keeps one
//! [`AttemptRecord`] per (descriptor, attempt) beside the descriptor's
//! buckets and, under the same lock or in the same script call, asks
//! [`plan`] what a call costs given the record, decides that against the
//! buckets, and keeps what [`record_after`] returns.
//!
//! **Phases.** An attempt's request-time call is its *start*; the call
//! Envoy makes when the stream is done (`apply_on_stream_done`, with the
//! descriptor entry `phase: done`) is its *done* call.
//!
//! **Modes.**
//! - [`AttemptMode::Dedupe`] (a rule without `overdraft`): a call that
//!   repeats an admitted call of the same attempt and phase is answered
//!   OK and charges nothing (a start only while the attempt is live: one
//!   after its done call, a settlement or a give-back is a new attempt,
//!   in every mode). A refused call is not remembered: it took
//!   nothing, so a repeat is decided afresh (and charged only if admitted
//!   then, once).
//! - [`AttemptMode::Reserve`] (an `overdraft` rule): the start reserves its
//!   cost (the estimate): admitted only if every bucket holds it, nothing
//!   taken when refused. The done call carries what was used: the
//!   difference to the reservation is charged (into debt, down to minus
//!   the burst, as `overdraft` does) or given back, once. A reservation not
//!   settled within the time to live is kept as spent (counted as
//!   expired); its record stays another time to live, so that a late done
//!   call still settles exactly. A done call for an attempt with no record
//!   (never started here, or forgotten) is charged in full, counted as
//!   unknown.
//! - **Slots** (a rule with `concurrency: N`): a start takes one of the
//!   descriptor's N slots (a repeat of a start that holds one is answered
//!   OK and takes none), refused while all N are held; the done call
//!   releases it. A slot not released within the time to live returns by
//!   itself (counted as expired), so a crashed Envoy cannot leak slots.
//!   [`take_slot`] and [`release_slot`] are the arithmetic.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! a leaf; uses only `bucket`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use serde::Serialize;

use crate::bucket::Cost;

/// Which call of an attempt this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// At request time.
    Start,
    /// When the stream is done (the descriptor carries `phase: done`).
    Done,
    /// The service's own: the start's answer came after the caller's
    /// deadline, so Envoy's failure mode answered instead. What the start
    /// took is given back and its record dropped: a done call that follows
    /// (the failure mode may have let the request run) is charged in full,
    /// as one of an attempt never started.
    Withdraw,
}

/// What a rule does with the attempts its descriptors carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptMode {
    /// Repeats of an admitted call are answered as it was, free.
    Dedupe,
    /// The start reserves, the done call settles (an `overdraft` rule).
    Reserve,
    /// The start takes a slot, the done call releases it (a
    /// `concurrency` rule; see [`take_slot`]).
    Slot,
}

/// One call of an attempt, as a store sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptCall {
    /// The attempt id (the value of the entry the rule names).
    pub id: Vec<u8>,
    pub phase: Phase,
    pub mode: AttemptMode,
    /// How long a reservation may stay unsettled, and a repeat is known.
    pub ttl_micros: u64,
    /// How often a live attempt's start is answered as a repeat (the
    /// rule's `attempts.max_repeats`); past it, [`AttemptResult::Reused`].
    pub max_repeats: u32,
}

/// What a store remembers of one attempt on one descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptRecord {
    /// Tokens the admitted start took (its reservation); `None`: no start
    /// was admitted.
    pub started: Option<u64>,
    /// An admitted (dedupe) or settled (reserve) done call was seen.
    pub done: bool,
    /// When an unsettled reservation counts as expired (start + ttl).
    pub expires_micros: u64,
    /// When the record goes (expiry + ttl: a late done call settles).
    pub forget_micros: u64,
    /// The expiry of an unsettled reservation was counted.
    pub expired_counted: bool,
    /// Starts answered as repeats of the live start.
    pub repeats: u32,
}

impl AttemptRecord {
    /// When the start was admitted: a record is kept `ttl` to expiry and
    /// `ttl` more to be forgotten, so it is `2 × expires − forget` (with the
    /// ttl of the start, whatever a reload made it since). The Lua copy
    /// computes the same from its record.
    pub fn started_micros(&self) -> u64 {
        (2 * self.expires_micros).saturating_sub(self.forget_micros)
    }

    /// A reservation that was never settled and whose time to live passed:
    /// kept as spent, to be counted once.
    pub fn expired_unsettled(&self, now_micros: u64) -> bool {
        self.started.is_some_and(|r| r > 0)
            && !self.done
            && !self.expired_counted
            && now_micros >= self.expires_micros
    }
}

/// What happened to a call, for the `rls_attempts_total` counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptResult {
    /// The attempt's first call of its phase: decided as usual.
    First,
    /// A repeat of an admitted call: answered OK, nothing charged.
    Repeat,
    /// A done call settled its reservation within the time to live.
    Settled,
    /// A done call settled a reservation after its time to live.
    Late,
    /// A done call for an attempt with no record: charged in full.
    Unknown,
    /// A start with no room left to remember it: a reservation is refused,
    /// a dedupe call decided without being remembered.
    Full,
    /// A reservation's time to live passed unsettled: kept as spent.
    Expired,
    /// The rule names an attempt entry and the call carried none (or an
    /// empty one): decided without attempt identity.
    NoId,
    /// A done call released its attempt's slot.
    Released,
    /// A start of a live attempt repeated more often than the rule's
    /// `max_repeats` (a retry policy's retries): a client reusing one id;
    /// refused, nothing charged.
    Reused,
    /// A done call found no slot of its attempt: its start was refused
    /// (Envoy sends the stream-done call of a request the start refused
    /// too), or the slot had returned by itself. Nothing to release, and
    /// no alarm: it comes with every refusal on a concurrency route.
    NotHeld,
}

impl AttemptResult {
    /// The `result` label.
    pub fn label(self) -> &'static str {
        match self {
            AttemptResult::First => "first",
            AttemptResult::Repeat => "repeat",
            AttemptResult::Settled => "settled",
            AttemptResult::Late => "late",
            AttemptResult::Unknown => "unknown",
            AttemptResult::Full => "full",
            AttemptResult::Expired => "expired",
            AttemptResult::NoId => "no_id",
            AttemptResult::Released => "released",
            AttemptResult::NotHeld => "not_held",
            AttemptResult::Reused => "reused",
        }
    }
}

/// What a call costs, given what is remembered of its attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    /// The cost to decide against the buckets; `None`: a repeat, answered
    /// OK from the buckets as they are, nothing written.
    pub cost: Option<Cost>,
    pub result: AttemptResult,
    /// Whether an admitted outcome must be remembered (a start, a done
    /// call of a dedupe rule, or the done call of an attempt with no
    /// record), so that there must be room for it.
    pub records: bool,
}

/// What `call`, costing `cost` as the limiter made it, does given the
/// attempt's live `record` (a record past its `forget_micros` is none).
/// For a reservation's done call `cost` carries what was used
/// (`Cost::Charge(used)`; a check is 0 used).
pub fn plan(call: &AttemptCall, record: Option<&AttemptRecord>, cost: Cost, now: u64) -> Planned {
    let record = record.filter(|r| now < r.forget_micros);
    let first = Planned {
        cost: Some(cost),
        result: AttemptResult::First,
        records: true,
    };
    let repeat = Planned {
        cost: None,
        result: AttemptResult::Repeat,
        records: false,
    };
    match (call.phase, call.mode) {
        // a start whose attempt was settled, released or given back is
        // a new attempt: ended attempts are no free pass
        (Phase::Start, mode) => match record {
            Some(r) if r.started.is_some() && !r.done && r.repeats < call.max_repeats => repeat,
            Some(r) if r.started.is_some() && !r.done => Planned {
                cost: None,
                result: AttemptResult::Reused,
                records: false,
            },
            // a reservation whose done call came first (its start slow, or
            // retried) was charged in full by it: the late start takes
            // nothing, or the reservation would never settle and be kept
            // as spent besides (issue 51)
            Some(r) if r.started.is_none() && r.done && mode == AttemptMode::Reserve => repeat,
            _ => first,
        },
        (Phase::Withdraw, _) => match record {
            Some(
                r @ AttemptRecord {
                    started: Some(taken),
                    done: false,
                    ..
                },
            ) => Planned {
                cost: Some(Cost::GiveBack {
                    tokens: *taken,
                    taken_micros: r.started_micros(),
                }),
                result: AttemptResult::Settled,
                records: false,
            },
            // nothing live to withdraw
            _ => repeat,
        },
        (Phase::Done, AttemptMode::Dedupe | AttemptMode::Slot) => match record {
            Some(r) if r.done => repeat,
            _ => first,
        },
        (Phase::Done, AttemptMode::Reserve) => {
            let used = used_of(cost);
            match record {
                Some(r) if r.done => repeat,
                Some(
                    r @ AttemptRecord {
                        started: Some(reserved),
                        expires_micros,
                        ..
                    },
                ) => Planned {
                    cost: Some(settlement(used, *reserved, r.started_micros())),
                    result: if now < *expires_micros {
                        AttemptResult::Settled
                    } else {
                        AttemptResult::Late
                    },
                    records: false,
                },
                // remembered (a repeat of it charges nothing), so it needs
                // room: done calls of attempts never started were stored
                // past --max-attempts (500,000 took 92 MiB), and then every
                // start was refused as full for twice the ttl
                _ => Planned {
                    cost: Some(Cost::Charge(used)),
                    result: AttemptResult::Unknown,
                    records: true,
                },
            }
        }
    }
}

/// Tokens a reservation's done call says were used, at most
/// [`crate::bucket::MAX_COST`] (as the Lua copy reads it: capped before
/// the reservation is taken off, or absurd usage was forgiven differently
/// by the two stores).
pub fn used_of(cost: Cost) -> u64 {
    match cost {
        Cost::Spend(n) | Cost::Charge(n) => n.min(crate::bucket::MAX_COST),
        Cost::Lease { needed, .. } => needed.min(crate::bucket::MAX_COST),
        // a check says nothing was used; a refund (Envoy's
        // `is_negative_hits`) is not a usage: nothing used
        Cost::Check | Cost::Refund(_) | Cost::GiveBack { .. } => 0,
    }
}

/// The cost that settles a reservation of `reserved`, taken at
/// `taken_micros`, that used `used`: the rest charged (into debt as
/// `overdraft` does), or the unused part given back (to a window only while
/// the window that counted it runs: [`Cost::GiveBack`]).
pub fn settlement(used: u64, reserved: u64, taken_micros: u64) -> Cost {
    if used >= reserved {
        Cost::Charge(used - reserved)
    } else {
        Cost::GiveBack {
            tokens: reserved - used,
            taken_micros,
        }
    }
}

/// The record to keep after `call` was decided as `planned` (admitted or
/// not, `taken` tokens), given the `record` before; `None`: nothing to
/// keep (a refused start, a repeat) and the record before stands.
pub fn record_after(
    call: &AttemptCall,
    record: Option<&AttemptRecord>,
    planned: &Planned,
    admitted: bool,
    taken: u64,
    now: u64,
) -> Option<AttemptRecord> {
    if planned.cost == Some(Cost::Check) {
        // a check took nothing: nothing to settle or to repeat
        return None;
    }
    let record = record.filter(|r| now < r.forget_micros).copied();
    let fresh = || AttemptRecord {
        started: None,
        done: false,
        expires_micros: now.saturating_add(call.ttl_micros),
        forget_micros: now.saturating_add(call.ttl_micros.saturating_mul(2)),
        expired_counted: false,
        repeats: 0,
    };
    match (planned.result, call.phase) {
        // a withdrawal drops the record ([`drops_record`])
        (AttemptResult::Repeat | AttemptResult::Expired | AttemptResult::NoId, _)
        | (_, Phase::Withdraw) => None,
        // a start begins the attempt afresh, whatever ended before it
        (_, Phase::Start) => admitted.then(|| AttemptRecord {
            started: Some(taken),
            ..fresh()
        }),
        (_, Phase::Done) if call.mode != AttemptMode::Reserve => admitted.then(|| AttemptRecord {
            done: true,
            ..record.unwrap_or_else(fresh)
        }),
        // a settlement (or an unknown attempt's charge) is done whatever
        // the verdict: a repeat of it charges nothing
        (_, Phase::Done) => Some(AttemptRecord {
            done: true,
            ..record.unwrap_or_else(fresh)
        }),
    }
}

/// The record after a start answered as a repeat of the live start: one
/// repeat more ([`plan`] bounds them); `None` for any other call.
pub fn after_repeat(
    call: &AttemptCall,
    record: Option<&AttemptRecord>,
    planned: &Planned,
) -> Option<AttemptRecord> {
    let r = record?;
    (call.phase == Phase::Start && planned.result == AttemptResult::Repeat && r.started.is_some())
        .then(|| AttemptRecord {
            repeats: r.repeats.saturating_add(1),
            ..*r
        })
}

/// Whether `call`, planned as `planned`, drops the attempt's record: a
/// withdrawal of a live start.
pub fn drops_record(call: &AttemptCall, planned: &Planned) -> bool {
    call.phase == Phase::Withdraw && planned.cost.is_some()
}

/// The slots of one descriptor held now: each attempt id with when it
/// returns by itself. Every call costs O(log n) in the slots held (a map
/// by id, and a queue by return time whose entries for slots released
/// since are skipped, and dropped once they outnumber the live ones), so a
/// start costs the same at any `concurrency` (issue 51: 200,000 held took
/// 292 ms for 64 starts when each call passed over all of them).
#[derive(Debug, Default)]
pub struct Slots {
    /// Each held id: when it returns, and the repeats of its start.
    until: HashMap<Box<[u8]>, (u64, u32)>,
    /// (return time, id), earliest first; some no longer held.
    queue: BinaryHeap<Reverse<(u64, Box<[u8]>)>>,
    /// The bytes of the held ids, together.
    id_bytes: usize,
}

impl Slots {
    pub fn new() -> Self {
        Self::default()
    }

    /// Slots held.
    pub fn len(&self) -> usize {
        self.until.len()
    }

    pub fn is_empty(&self) -> bool {
        self.until.is_empty()
    }

    /// The bytes of the ids held, together.
    pub fn id_bytes(&self) -> usize {
        self.id_bytes
    }

    /// Slots held at `now` and not yet returned by themselves.
    pub fn live(&self, now_micros: u64) -> usize {
        self.until
            .values()
            .filter(|(at, _)| *at > now_micros)
            .count()
    }

    /// Whether attempt `id` holds a slot (expired or not).
    pub fn holds(&self, id: &[u8]) -> bool {
        self.until.contains_key(id)
    }

    /// When the next slot returns by itself (or a little earlier).
    pub fn next_return(&self) -> Option<u64> {
        self.queue.peek().map(|Reverse((at, _))| *at)
    }

    fn insert(&mut self, id: &[u8], until: u64) {
        if self.until.insert(id.into(), (until, 0)).is_none() {
            self.id_bytes += id.len();
        }
        self.queue.push(Reverse((until, id.into())));
    }

    fn remove(&mut self, id: &[u8]) -> bool {
        let held = self.until.remove(id).is_some();
        if held {
            self.id_bytes -= id.len();
            // the queue's entries for released slots are skipped; dropped
            // once they outnumber the live ones
            if self.queue.len() > 2 * self.until.len() + 64 {
                let live = &self.until;
                self.queue
                    .retain(|Reverse((at, id))| live.get(id).map(|(u, _)| u) == Some(at));
            }
        }
        held
    }

    /// Drops the slots whose time to live passed at `now`; the number of
    /// them and of their ids' bytes.
    pub fn expire(&mut self, now: u64) -> (u64, usize) {
        let (mut n, mut bytes) = (0, 0);
        while let Some(Reverse((at, _))) = self.queue.peek() {
            if now < *at {
                break;
            }
            let Some(Reverse((at, id))) = self.queue.pop() else {
                break;
            };
            if self.until.get(&id).map(|(u, _)| *u) == Some(at) {
                self.until.remove(&id);
                self.id_bytes -= id.len();
                n += 1;
                bytes += id.len();
            }
        }
        (n, bytes)
    }
}

/// What a slot call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotOutcome {
    /// A start that holds a slot now (taken now, or held already).
    pub admitted: bool,
    /// Slots held after the call.
    pub in_flight: u64,
    /// [`AttemptResult::First`] (taken, or refused), `Repeat` (held
    /// already), `Released`, or `NotHeld` (a release of no slot held).
    pub result: AttemptResult,
    /// Slots that returned by themselves before this call (their time to
    /// live passed unreleased).
    pub expired: u64,
}

/// Attempt `id` asks for one of at most `max` slots of `held`, kept
/// `ttl_micros` unless released; a start of an attempt that holds one is
/// a repeat at most `max_repeats` times, then a reuse (refused).
pub fn take_slot(
    held: &mut Slots,
    id: &[u8],
    max: u64,
    ttl_micros: u64,
    max_repeats: u32,
    now: u64,
) -> SlotOutcome {
    let (expired, _) = held.expire(now);
    let repeats = held.until.get_mut(id).map(|(_, r)| r);
    let (admitted, result) = if let Some(repeats) = repeats {
        if *repeats < max_repeats {
            *repeats += 1;
            (true, AttemptResult::Repeat)
        } else {
            (false, AttemptResult::Reused)
        }
    } else if (held.len() as u64) < max {
        held.insert(id, now.saturating_add(ttl_micros));
        (true, AttemptResult::First)
    } else {
        (false, AttemptResult::First)
    };
    SlotOutcome {
        admitted,
        in_flight: held.len() as u64,
        result,
        expired,
    }
}

/// Attempt `id` is done: its slot in `held`, if it holds one, is released.
pub fn release_slot(held: &mut Slots, id: &[u8], now: u64) -> SlotOutcome {
    let (expired, _) = held.expire(now);
    let released = held.remove(id);
    SlotOutcome {
        admitted: true,
        in_flight: held.len() as u64,
        result: if released {
            AttemptResult::Released
        } else {
            AttemptResult::NotHeld
        },
        expired,
    }
}

#[cfg(test)]
mod tests;
