//! The memory store's attempt records ([`crate::attempt`]): one per
//! (descriptor, attempt), kept in the descriptor's shard beside its buckets
//! so that a call and its record change under one lock.
//!
//! **Bounded.** A shard holds at most its share of `--max-attempts`
//! records, and of `--max-attempts` × [`BYTES_PER_ATTEMPT`] bytes (a record
//! counts [`ATTEMPT_FIXED_BYTES`] plus its key: long ids count for more).
//! A record goes when it is forgotten (twice the rule's `ttl` after its
//! start); a full shard drops the forgotten ones first, and then has no
//! room: the call says so ([`crate::attempt::AttemptResult::Full`]), no
//! live record is ever dropped for a new one (it holds a reservation
//! someone will settle, or the memory of a charge).

use std::collections::HashMap;

use crate::attempt::{self, AttemptCall, AttemptRecord, Phase, SlotOutcome, Slots};
use crate::labels::RuleId;

/// Attempt records held at most unless told otherwise (`--max-attempts`).
pub const DEFAULT_MAX_ATTEMPTS: usize = 1_000_000;

/// What a record is counted for against the store's memory: the record,
/// its rule, its map slot and allocation; its key comes on top.
pub const ATTEMPT_FIXED_BYTES: usize = 112;

/// The memory one record of `--max-attempts` stands for: records hold at
/// most `--max-attempts` × this many bytes, so that long ids count for more
/// than one.
pub const BYTES_PER_ATTEMPT: usize = 256;

fn record_bytes(key: &[u8]) -> usize {
    ATTEMPT_FIXED_BYTES + key.len()
}

/// One shard's attempt records and slots, and the bytes they are counted
/// for (a held slot counts as a record).
#[derive(Debug, Default)]
pub(super) struct Attempts {
    records: HashMap<Box<[u8]>, (AttemptRecord, RuleId)>,
    /// The slots held per `concurrency` descriptor (by its slots key), and
    /// its rule.
    slots: HashMap<Box<[u8]>, (Slots, RuleId)>,
    /// Slots held, all descriptors together.
    held: usize,
    bytes: usize,
}

impl Attempts {
    /// The live record under `key` at `now` (a forgotten one is none).
    pub(super) fn get(&self, key: &[u8], now: u64) -> Option<AttemptRecord> {
        self.records
            .get(key)
            .map(|(r, _)| *r)
            .filter(|r| now < r.forget_micros)
    }

    /// Whether a new record of `key` fits within (`cap` records, `byte_cap`
    /// bytes), after dropping the forgotten ones when it would not; the
    /// expirations that counts go to `expired`.
    pub(super) fn room_for(
        &mut self,
        key: &[u8],
        (cap, byte_cap): (usize, usize),
        now: u64,
        expired: &mut Vec<RuleId>,
    ) -> bool {
        let fits =
            |a: &Self| a.records.len() + a.held < cap && a.bytes + record_bytes(key) <= byte_cap;
        if self.records.contains_key(key) || fits(self) {
            return true;
        }
        self.sweep(now, expired);
        fits(self)
    }

    /// One call of a `concurrency` rule's attempt on the slots under `key`
    /// (at most `max`), within (`cap` records, `byte_cap` bytes) counting
    /// each held slot as a record: a start finding no room is refused as
    /// all slots held would be.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn slot(
        &mut self,
        key: &[u8],
        max: u64,
        call: &AttemptCall,
        rule: RuleId,
        (cap, byte_cap): (usize, usize),
        now: u64,
    ) -> SlotOutcome {
        let (held, _) = self
            .slots
            .entry(key.into())
            .or_insert_with(|| (Slots::new(), rule));
        let before = held.len();
        let bytes = |held: &Slots| -> usize {
            held.iter()
                .map(|(id, _)| record_bytes(id) + key.len())
                .sum()
        };
        let bytes_before = bytes(held);
        let full = self.held >= cap || self.bytes + record_bytes(key) + call.id.len() > byte_cap;
        let outcome = match call.phase {
            Phase::Start if full && !held.iter().any(|(h, _)| **h == *call.id) => {
                // expired ones still go; no new slot past the bound
                attempt::take_slot(held, &call.id, 0, call.ttl_micros, now)
            }
            Phase::Start => attempt::take_slot(held, &call.id, max, call.ttl_micros, now),
            Phase::Done => attempt::release_slot(held, &call.id, now),
        };
        let bytes_after = bytes(held);
        let after = held.len();
        if after == 0 {
            self.slots.remove(key);
        }
        self.held = self.held + after - before;
        self.bytes = self.bytes + bytes_after - bytes_before;
        outcome
    }

    /// Keeps `record` under `key` (replacing what was there).
    pub(super) fn put(&mut self, key: &[u8], record: AttemptRecord, rule: RuleId) {
        match self.records.get_mut(key) {
            Some(held) => *held = (record, rule),
            None => {
                self.bytes += record_bytes(key);
                self.records.insert(key.into(), (record, rule));
            }
        }
    }

    /// Counts each reservation whose time to live passed unsettled (once,
    /// its rule to `expired`: kept as spent) and drops the forgotten.
    pub(super) fn sweep(&mut self, now: u64, expired: &mut Vec<RuleId>) {
        let mut freed = 0;
        self.records.retain(|k, (r, rule)| {
            if r.expired_unsettled(now) {
                r.expired_counted = true;
                expired.push(*rule);
            }
            let keep = now < r.forget_micros;
            if !keep {
                freed += record_bytes(k);
            }
            keep
        });
        self.bytes -= freed;
        self.sweep_slots(now, expired);
        if self.records.capacity() > 64 && self.records.capacity() > self.records.len() * 4 {
            self.records.shrink_to_fit();
        }
    }

    /// Records held (forgotten ones included until a sweep), and slots.
    pub(super) fn len(&self) -> usize {
        self.records.len() + self.held
    }

    /// Drops the slots whose time to live passed, each one's rule to
    /// `expired`.
    pub(super) fn sweep_slots(&mut self, now: u64, expired: &mut Vec<RuleId>) {
        let (mut held, mut bytes) = (self.held, self.bytes);
        self.slots.retain(|key, (slots, rule)| {
            let before = slots.len();
            slots.retain(|(id, until)| {
                let keep = now < *until;
                if !keep {
                    bytes -= record_bytes(id) + key.len();
                }
                keep
            });
            expired.extend(std::iter::repeat_n(*rule, before - slots.len()));
            held -= before - slots.len();
            !slots.is_empty()
        });
        self.held = held;
        self.bytes = bytes;
    }
}
