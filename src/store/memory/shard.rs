//! One shard of the memory store: its buckets and the bytes they are
//! counted for, each rule's overflow bucket, and making room at the
//! shard's caps by dropping the buckets whose loss costs least (the order
//! is in [`super`]'s doc).

use std::collections::HashMap;

use parking_lot::Mutex;

use super::attempts::Attempts;
use super::entry::Entry;
use crate::labels::RuleId;

pub(super) type Buckets = HashMap<Box<[u8]>, Entry>;

/// What a bucket is counted for against the store's memory: its entry, its
/// map slot and allocation, and its key.
pub const BUCKET_FIXED_BYTES: usize = 136;
/// The memory one bucket of `--max-buckets` stands for: what a bucket with a
/// short key costs (168 bytes measured, keys of about 32 bytes). A store of
/// N buckets holds at most N × this many bytes of buckets, so buckets with
/// long values count for more than one.
pub const BYTES_PER_BUCKET: usize = 168;

pub(super) fn bucket_bytes(key: &[u8]) -> usize {
    BUCKET_FIXED_BYTES + key.len()
}

/// One shard's buckets and the bytes they are counted for.
#[derive(Debug, Default)]
pub(super) struct ShardState {
    pub(super) buckets: Buckets,
    pub(super) bytes: usize,
    /// The attempt records of the shard's descriptors (their own bound).
    pub(super) attempts: Attempts,
}

impl ShardState {
    /// Keeps the buckets `keep` says to keep (told each one's key),
    /// counting what goes.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&[u8], &Entry) -> bool) {
        let mut freed = 0;
        self.buckets.retain(|k, e| {
            let kept = keep(k, e);
            if !kept {
                freed += bucket_bytes(k);
            }
            kept
        });
        self.bytes -= freed;
    }
}

#[cfg(test)]
impl From<Buckets> for ShardState {
    fn from(buckets: Buckets) -> Self {
        let bytes = buckets.keys().map(|k| bucket_bytes(k)).sum();
        Self {
            buckets,
            bytes,
            attempts: Attempts::default(),
        }
    }
}

pub(super) type Shard = Mutex<ShardState>;

/// What an overflow bucket's key starts with: never a request's (those
/// are text).
pub(super) const OVERFLOW_PREFIX: &[u8] = b"\xffoverflow:";

/// The key of `rule`'s overflow bucket in a shard.
pub(super) fn overflow_key(rule: RuleId) -> Vec<u8> {
    let mut key = OVERFLOW_PREFIX.to_vec();
    key.extend_from_slice(&(rule.index() as u64).to_le_bytes());
    key
}

/// Makes room in a shard at one of its caps (buckets, bytes) for a bucket
/// of `incoming` bytes: drops those full already, and if that does not
/// leave an eighth of both caps free, the cheapest others (see the
/// module's doc) until it does; with `spare_throttled`, never a bucket that
/// rejected recently. Whether there is room now. Evicted buckets' rules go
/// to `evicted`.
pub(super) fn make_room(
    shard: &mut ShardState,
    (cap, byte_cap): (usize, usize),
    incoming: usize,
    now: u64,
    evicted: &mut Vec<RuleId>,
    spare_throttled: bool,
) -> bool {
    let target = cap - (cap / 8).max(1);
    let byte_target = byte_cap - byte_cap / 8;
    shard.retain(|_, e| !e.full_at.passed(now));
    let need_count = shard.buckets.len().saturating_sub(target);
    let need_bytes = (shard.bytes + incoming).saturating_sub(byte_target);
    if need_count == 0 && need_bytes == 0 {
        return true;
    }
    // Order of eviction: see the module's doc. Take the cheapest until both
    // are freed, then drop everything cheaper than the last one taken and as
    // many of its equals as were taken.
    let rank = |e: &Entry| e.eviction_rank(now);
    // an overflow bucket is never evicted (one per rule: evicting it would
    // refund every value that shares it); swept once full like any other
    let mut ranks: Vec<((bool, bool, u32), usize)> = shard
        .buckets
        .iter()
        .filter(|(k, _)| !k.starts_with(OVERFLOW_PREFIX))
        .map(|(k, e)| (rank(e), bucket_bytes(k)))
        .collect();
    ranks.sort_unstable_by_key(|r| r.0);
    let (mut taken, mut freed) = (0, 0);
    for (rank, bytes) in &ranks {
        if taken >= need_count && freed >= need_bytes {
            break;
        }
        if spare_throttled && rank.0 {
            // the rest rejected recently: spared
            break;
        }
        taken += 1;
        freed += bytes;
    }
    let room = taken >= need_count && freed >= need_bytes
        // what a bucket's removal at the caps needs, at the least
        || (shard.buckets.len() - taken < cap && shard.bytes - freed + incoming <= byte_cap);
    let Some(&(last, _)) = taken.checked_sub(1).and_then(|i| ranks.get(i)) else {
        return room;
    };
    let mut equal_quota = ranks[..taken].iter().filter(|r| r.0 == last).count();
    shard.retain(|k, e| {
        if k.starts_with(OVERFLOW_PREFIX) {
            return true;
        }
        let r = rank(e);
        let drop = r < last || (r == last && equal_quota > 0);
        if drop {
            if r == last {
                equal_quota -= 1;
            }
            evicted.push(e.rule);
        }
        !drop
    });
    room
}
