//! The memory store's attempt records ([`crate::attempt`]): one per
//! (descriptor, attempt), kept in the descriptor's shard beside its buckets
//! so that a call and its record change under one lock.
//!
//! **Bounded.** The store holds at most `--max-attempts` records and slots
//! together, and `--max-attempts` × [`BYTES_PER_ATTEMPT`] bytes of them (a
//! record counts [`ATTEMPT_FIXED_BYTES`] plus its key: long ids count for
//! more), whatever shards they are in (one hot descriptor may hold them
//! all). A record goes when it is forgotten (twice the rule's `ttl` after
//! its start), a slot when it returns; the sweeper drops them every
//! second, and a full store sweeps the shard of a new record first when
//! that shard has something due (a pass over the shard, at most once per
//! due time). Records of done calls whose attempt has no start here (what
//! Envoy sends for a request it refused, or a client's made-up ids) have a
//! room of their own, a quarter of that bound beside it ([`is_done_only`]):
//! however many such calls come, a start still finds room. One descriptor
//! holds at most three quarters of the bound, so that it never takes the
//! table from the others.
//! Then there is no room: the call says so
//! ([`crate::attempt::AttemptResult::Full`]); no live record is ever
//! dropped for a new one (it holds a reservation someone will settle, or
//! the memory of a charge).

use std::collections::HashMap;

use crate::attempt::{self, AttemptCall, AttemptRecord, AttemptResult, Phase, SlotOutcome, Slots};
use crate::labels::RuleId;
use crate::store::key::attempt_key_descriptor;

/// Attempt records held at most unless told otherwise (`--max-attempts`).
pub const DEFAULT_MAX_ATTEMPTS: usize = 1_000_000;

/// What a record is counted for against the store's memory: the record,
/// its rule, its map slot and allocation; its key comes on top.
pub const ATTEMPT_FIXED_BYTES: usize = 112;

/// The memory one record of `--max-attempts` stands for: records hold at
/// most `--max-attempts` × this many bytes, so that long ids count for more
/// than one.
pub const BYTES_PER_ATTEMPT: usize = 256;

pub(super) fn record_bytes(key: &[u8]) -> usize {
    ATTEMPT_FIXED_BYTES + key.len()
}

/// A record of a done call whose attempt has no start here: what Envoy
/// sends for a request it refused, or a client's made-up ids. These have
/// a room of their own, a quarter of `--max-attempts`
/// ([`super::MemoryStore`]), so that no flood of them refuses a start.
pub(super) fn is_done_only(record: &AttemptRecord) -> bool {
    record.started.is_none() && record.done
}

/// What a shard holds, counted against the store's bounds: records and
/// slots with their bytes, and apart from them the done-only records
/// ([`is_done_only`]) with theirs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Footprint {
    pub held: usize,
    pub bytes: usize,
    pub done_only: usize,
    pub done_only_bytes: usize,
}

/// One shard's attempt records and slots, and the bytes they are counted
/// for (a held slot counts as a record). The bound is the store's, over
/// every shard ([`super::MemoryStore`] keeps the totals from each call's
/// [`Attempts::footprint`] before and after).
#[derive(Debug, Default)]
pub(super) struct Attempts {
    records: HashMap<Box<[u8]>, (AttemptRecord, RuleId)>,
    /// The slots held per `concurrency` descriptor (by its slots key), and
    /// its rule.
    slots: HashMap<Box<[u8]>, (Slots, RuleId)>,
    /// Slots held, all descriptors together.
    held: usize,
    bytes: usize,
    /// Of the records, those of a done call with no start (never started
    /// here, or forgotten), and their bytes: kept apart, so that a flood
    /// of them never takes the room of a start ([`Footprint`]).
    done_only: usize,
    done_only_bytes: usize,
    /// Records per descriptor (by [`attempt_key_descriptor`]), done-only
    /// ones aside (they have their own room): a descriptor holds at most
    /// its share of the bound ([`super::MemoryStore`]).
    per_descriptor: HashMap<Box<[u8]>, usize>,
    /// No record is forgotten nor slot returned before this: a full store
    /// sweeps a shard only from then (a sweep is a pass over the shard).
    next_due: u64,
}

impl Attempts {
    /// The live record under `key` at `now` (a forgotten one is none).
    pub(super) fn get(&self, key: &[u8], now: u64) -> Option<AttemptRecord> {
        self.records
            .get(key)
            .map(|(r, _)| *r)
            .filter(|r| now < r.forget_micros)
    }

    /// Reservations whose records' keys start with `prefix` (a
    /// descriptor's: [`super::attempt_key`] with an empty id, less its
    /// length byte) started, not settled, not expired at `now`.
    pub(super) fn reservations_under(&self, prefix: &[u8], now: u64) -> u64 {
        self.records
            .iter()
            .filter(|(k, (r, _))| {
                k.starts_with(prefix)
                    && r.started.is_some_and(|t| t > 0)
                    && !r.done
                    && now < r.expires_micros
            })
            .count() as u64
    }

    /// Slots held under `key` at `now`, not yet returned.
    pub(super) fn slots_under(&self, key: &[u8], now: u64) -> u64 {
        self.slots.get(key).map_or(0, |(s, _)| s.live(now) as u64)
    }

    /// Whether a record is kept under `key` already.
    pub(super) fn has(&self, key: &[u8]) -> bool {
        self.records.contains_key(key)
    }

    /// What this shard holds, counted against the store's bounds.
    pub(super) fn footprint(&self) -> Footprint {
        Footprint {
            held: self.records.len() + self.held - self.done_only,
            bytes: self.bytes - self.done_only_bytes,
            done_only: self.done_only,
            done_only_bytes: self.done_only_bytes,
        }
    }

    /// Records held of the descriptor whose record keys start as `key`'s.
    pub(super) fn held_by_descriptor(&self, key: &[u8]) -> usize {
        self.per_descriptor
            .get(attempt_key_descriptor(key))
            .copied()
            .unwrap_or(0)
    }

    /// One record more (`add`) or fewer under `key`'s descriptor.
    fn count_descriptor(&mut self, key: &[u8], add: bool) {
        let descriptor = attempt_key_descriptor(key);
        if add {
            *self.per_descriptor.entry(descriptor.into()).or_default() += 1;
        } else if let Some(n) = self.per_descriptor.get_mut(descriptor) {
            *n -= 1;
            if *n == 0 {
                self.per_descriptor.remove(descriptor);
            }
        }
    }

    /// Moves the done-only counts by `sign` for `record` under `key`.
    fn count_done_only(&mut self, key: &[u8], record: &AttemptRecord, add: bool) {
        if !is_done_only(record) {
            return;
        }
        if add {
            self.done_only += 1;
            self.done_only_bytes += record_bytes(key);
        } else {
            self.done_only -= 1;
            self.done_only_bytes -= record_bytes(key);
        }
    }

    /// Whether a sweep at `now` would find something to drop.
    pub(super) fn due(&self, now: u64) -> bool {
        self.next_due != 0 && now >= self.next_due
    }

    fn remember_due(&mut self, at: u64) {
        if self.next_due == 0 || at < self.next_due {
            self.next_due = at;
        }
    }

    /// One call of a `concurrency` rule's attempt on the slots under `key`
    /// (at most `max`); with `full` (the store's bound reached) a start
    /// takes no new slot, refused as all slots held would be.
    pub(super) fn slot(
        &mut self,
        key: &[u8],
        max: u64,
        call: &AttemptCall,
        rule: RuleId,
        full: bool,
        now: u64,
    ) -> SlotOutcome {
        let (held, _) = self
            .slots
            .entry(key.into())
            .or_insert_with(|| (Slots::new(), rule));
        let before = held.len();
        // each slot counts as a record of its id, plus the slots' key
        let bytes = |held: &Slots| held.id_bytes() + held.len() * (ATTEMPT_FIXED_BYTES + key.len());
        let bytes_before = bytes(held);
        let outcome = match call.phase {
            Phase::Start if full && !held.holds(&call.id) => {
                // expired ones still go; no new slot past the bound
                SlotOutcome {
                    result: AttemptResult::Full,
                    ..attempt::take_slot(held, &call.id, 0, call.ttl_micros, call.max_repeats, now)
                }
            }
            Phase::Start => {
                attempt::take_slot(held, &call.id, max, call.ttl_micros, call.max_repeats, now)
            }
            Phase::Done | Phase::Withdraw => attempt::release_slot(held, &call.id, now),
        };
        let bytes_after = bytes(held);
        let after = held.len();
        if after == 0 {
            self.slots.remove(key);
        }
        self.held = self.held + after - before;
        self.bytes = self.bytes + bytes_after - bytes_before;
        if after > before {
            self.remember_due(now.saturating_add(call.ttl_micros));
        }
        outcome
    }

    /// Drops the record under `key`, if any.
    pub(super) fn remove(&mut self, key: &[u8]) {
        if let Some((record, _)) = self.records.remove(key) {
            self.bytes -= record_bytes(key);
            self.count_done_only(key, &record, false);
            if !is_done_only(&record) {
                self.count_descriptor(key, false);
            }
        }
    }

    /// Keeps `record` under `key` (replacing what was there).
    pub(super) fn put(&mut self, key: &[u8], record: AttemptRecord, rule: RuleId) {
        self.remember_due(record.expires_micros.min(record.forget_micros));
        let before = self.records.get(key).map(|(r, _)| *r);
        match self.records.get_mut(key) {
            Some(held) => *held = (record, rule),
            None => {
                self.bytes += record_bytes(key);
                self.records.insert(key.into(), (record, rule));
            }
        }
        let counted_before = before.is_some_and(|b| !is_done_only(&b));
        if let Some(before) = before {
            self.count_done_only(key, &before, false);
        }
        self.count_done_only(key, &record, true);
        match (counted_before, !is_done_only(&record)) {
            (false, true) => self.count_descriptor(key, true),
            (true, false) => self.count_descriptor(key, false),
            _ => {}
        }
    }

    /// Counts each reservation whose time to live passed unsettled (once,
    /// its rule to `expired`: kept as spent), drops the forgotten records
    /// and the slots that returned by themselves (each one's rule to
    /// `expired`).
    pub(super) fn sweep(&mut self, now: u64, expired: &mut Vec<RuleId>) {
        let mut freed = 0;
        let (mut done_only, mut done_only_bytes) = (self.done_only, self.done_only_bytes);
        let mut dropped: Vec<Box<[u8]>> = Vec::new();
        let mut next = u64::MAX;
        self.records.retain(|k, (r, rule)| {
            if r.expired_unsettled(now) {
                r.expired_counted = true;
                expired.push(*rule);
            }
            let keep = now < r.forget_micros;
            if keep {
                next = next.min(
                    if r.expired_unsettled(now) || r.expired_counted || now >= r.expires_micros {
                        r.forget_micros
                    } else {
                        r.expires_micros
                    },
                );
            } else {
                freed += record_bytes(k);
                if is_done_only(r) {
                    done_only -= 1;
                    done_only_bytes -= record_bytes(k);
                } else {
                    dropped.push(attempt_key_descriptor(k).into());
                }
            }
            keep
        });
        self.bytes -= freed;
        (self.done_only, self.done_only_bytes) = (done_only, done_only_bytes);
        for descriptor in dropped {
            self.count_descriptor(&descriptor, false);
        }
        let (mut held, mut bytes) = (self.held, self.bytes);
        self.slots.retain(|key, (slots, rule)| {
            let (n, id_bytes) = slots.expire(now);
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            bytes -= id_bytes + n * (ATTEMPT_FIXED_BYTES + key.len());
            if let Some(at) = slots.next_return() {
                next = next.min(at);
            }
            expired.extend(std::iter::repeat_n(*rule, n));
            held -= n;
            !slots.is_empty()
        });
        self.held = held;
        self.bytes = bytes;
        self.next_due = if next == u64::MAX { 0 } else { next };
        if self.records.capacity() > 64 && self.records.capacity() > self.records.len() * 4 {
            self.records.shrink_to_fit();
        }
    }
}
