//! One bucket as the memory store keeps it (40 bytes): its state, when it
//! is full again, its rule, and what ranks it for eviction (how it is used,
//! when it last rejected, the tokens it misses).

use crate::bucket::{BucketParams, BucketState};
use crate::labels::RuleId;

/// A bucket's state, the clock's second by which it is full again (and can
/// be forgotten; rounded up), the rule it belongs to (for counting
/// evictions), its size and refill (for what evicting it gives back), and
/// how it is used and when it last rejected. 40 bytes, packed to keep a
/// million idle buckets near 160 MB.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    pub(super) state: BucketState,
    pub(super) full_at: FullAt,
    pub(super) rule: RuleId,
    pub(super) use_: Use,
    pub(super) rejected: Rejected,
    pub(super) capacity: f32,
    /// Tokens per second.
    pub(super) rate: f32,
}

impl Entry {
    pub(super) fn new(
        state: BucketState,
        params: &BucketParams,
        rule: RuleId,
        now_micros: u64,
    ) -> Self {
        Self {
            state,
            full_at: FullAt::of(params.full_at_micros(&state)),
            rule,
            use_: Use::first(now_micros),
            rejected: Rejected::default(),
            capacity: params.capacity as f32,
            rate: params.rate_per_sec() as f32,
        }
    }

    /// Tokens it misses at `now`: what evicting it would give back.
    pub(super) fn missing(&self, now_micros: u64) -> f32 {
        let elapsed = now_micros.saturating_sub(self.state.updated_micros) as f32 / 1e6;
        let tokens = self.state.tokens as f32 + self.rate * elapsed;
        // a bucket in debt (`overdraft`) gives back more than its burst
        (self.capacity - tokens).clamp(0.0, 2.0 * self.capacity.max(0.0))
    }

    /// Its rank for eviction: lowest first (see the module's doc).
    pub(super) fn eviction_rank(&self, now_micros: u64) -> (bool, bool, u32) {
        // the bits of an f32 ≥ 0 order like the numbers
        (
            self.rejected.recently(now_micros),
            self.use_.tier(now_micros) == 2,
            self.missing(now_micros).to_bits(),
        )
    }
}

/// How a bucket is used, for eviction.
#[derive(Debug, Clone, Copy)]
pub(super) struct Use {
    /// The clock's second (mod 256) of the bucket's last decision.
    touched_secs: u8,
    /// Decisions in a row, each at most a second or so after the last.
    streak: u8,
}

impl Use {
    pub(super) fn first(now: u64) -> Self {
        Self {
            touched_secs: secs(now),
            streak: 1,
        }
    }

    pub(super) fn touch(&mut self, now: u64) {
        let now = secs(now);
        self.streak = if now.wrapping_sub(self.touched_secs) <= 1 {
            self.streak.saturating_add(1)
        } else {
            1
        };
        self.touched_secs = now;
    }

    /// 0: idle (no decision in this second or the one before); 1: recent,
    /// once (as each of a flood of new values is); 2: in steady use.
    pub(super) fn tier(self, now: u64) -> u8 {
        match (secs(now).wrapping_sub(self.touched_secs) <= 1, self.streak) {
            (false, _) => 0,
            (true, 1) => 1,
            (true, _) => 2,
        }
    }
}

/// A bucket that rejected within this many seconds counts as throttling
/// its client, and is evicted last.
pub const REJECTED_RECENTLY_SECS: u32 = 120;

/// When a bucket last rejected a request: the clock's whole second plus
/// one (0: never). A second kept in a `u8` wrapped every 256 s, so that a
/// bucket that rejected once ranked as "rejected recently" for 121 of
/// every 256 s, for ever; a `u32` wraps after 136 years.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Rejected(u32);

impl Rejected {
    pub(super) fn set(&mut self, now_micros: u64) {
        self.0 = whole_secs(now_micros).saturating_add(1);
    }

    pub(super) fn recently(self, now_micros: u64) -> bool {
        self.0 != 0
            && whole_secs(now_micros)
                .saturating_add(1)
                .saturating_sub(self.0)
                <= REJECTED_RECENTLY_SECS
    }
}

/// The clock's whole second (136 years before it stops counting).
pub(super) fn whole_secs(micros: u64) -> u32 {
    u32::try_from(micros / 1_000_000).unwrap_or(u32::MAX)
}

/// The clock's whole second by which a bucket is full, rounded up;
/// `u32::MAX`: never (136 years).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct FullAt(pub(super) u32);

impl FullAt {
    pub(super) fn of(micros: Option<u64>) -> Self {
        match micros {
            Some(m) => FullAt(u32::try_from(m.div_ceil(1_000_000)).unwrap_or(u32::MAX)),
            None => FullAt(u32::MAX),
        }
    }

    /// Whether the bucket is full at `now_micros`.
    pub(super) fn passed(self, now_micros: u64) -> bool {
        u64::from(self.0) * 1_000_000 <= now_micros
    }
}

/// The clock's whole second, as kept in [`Use`] (wrapping: only
/// differences of a second or two are read).
pub(super) fn secs(micros: u64) -> u8 {
    (micros / 1_000_000) as u8
}
