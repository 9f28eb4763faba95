//! Splitting a bucket between Envoys that report to different replicas: the
//! shared ledger. Each bucket's record (in Redis: one hash, one field per
//! member) holds every member's smoothed demand, how many Envoys (pairs) it
//! sums, when it last stepped, and the share it may still hand out. A
//! member is one replica: it steps the bucket (when an Envoy joins, and
//! every second), summing its own Envoys' demand, and splits the share it
//! gets between them itself ([`super::allocation`], the share as its
//! budget). One step, atomic on the record, updates the caller's demand
//! and returns its share, so every replica computes shares from the same
//! demand.
//!
//! **Cost.** A step reads every member's record: it costs the replicas
//! splitting a bucket, not the Envoys reporting it, and a bucket is stepped
//! about once a second per replica however many Envoys report it.
//!
//! **Bound.** A step gives the caller at most what the other members do not
//! reserve (their live shares: each member keeps its current one and the
//! largest of the earlier ones still live), so Σ of the replicas' shares
//! stays ≤ the budget, whatever the order of steps; each replica keeps Σ
//! of what its Envoys may enforce within the largest of its live shares.
//! **Shares.** As in [`super::allocation`], counted in Envoys: [`NEWCOMER_RESERVE`]
//! held back, the rest split with a floor of [`FLOOR_FRACTION`] of an equal
//! share per Envoy and the remainder by demand among the Envoys of the
//! members active now (stepped within
//! [`STALE_MS`]: a replica that died stops counting after that, while its
//! assignments stay reserved until they expire). A share within
//! [`super::RESEND_THRESHOLD`] of the live one is kept as it is, so that
//! small moves of demand neither re-send nor pile up reservations.
//!
//! [`Ledger`] is the Rust copy of `ledger.lua` (the Redis ledger, see
//! [`super::redis_ledger`]); `tests/rlqs.rs` checks that both answer
//! alike. Numbers cross as integers: milli-tokens, milli-requests per second,
//! milliseconds.

use std::collections::BTreeMap;

use async_trait::async_trait;

use super::allocation::{Budget, FLOOR_FRACTION, NEWCOMER_RESERVE};
use super::{BucketKey, RESEND_THRESHOLD};
use crate::store::StoreError;

/// A member that has not stepped for this long no longer counts as active
/// (its replica died or lost the bucket); replicas step every second.
pub const STALE_MS: i64 = 5_000;

/// One step's answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shared {
    /// The caller's share (zero when it left).
    pub share: Budget,
    /// Envoys (pairs) of the active members, the caller's included.
    pub members: u32,
    /// Σ of every member's live reservations after the step.
    pub reserved: Budget,
}

/// The members' records of buckets, wherever they are kept.
#[async_trait]
pub trait QuotaLedger: Send + Sync + 'static {
    /// Steps `member` of `key`: records its `demand` (`None`: it leaves,
    /// keeping its shares reserved until they expire) and returns its
    /// share of `budget`, live for `ttl_ms`.
    async fn step(
        &self,
        key: &BucketKey,
        member: Member,
        demand: Option<Demand>,
        budget: Budget,
        ttl_ms: i64,
    ) -> Result<Shared, StoreError>;
}

/// A replica's demand for a bucket: Σ of its Envoys' smoothed requests per
/// second, and how many Envoys (pairs) that is (at least one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    pub per_sec: f64,
    pub pairs: u32,
}

/// A member: a replica (random at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    pub replica: u32,
}

impl Member {
    /// Its field in the record: `r<replica>` (a record's fields of
    /// `replica:stream`, one per Envoy, are older replicas' and count too).
    pub fn field(&self) -> String {
        format!("r{}", self.replica)
    }
}

/// The arguments of one step, as integers (both ledgers see the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepArgs {
    /// Milli-requests per second; -1: leaving.
    pub demand: i64,
    pub burst: i64,
    pub rate: i64,
    pub ttl_ms: i64,
    /// [`STALE_MS`] but in tests.
    pub stale_ms: i64,
    /// The Envoys the demand sums (0 when leaving).
    pub pairs: i64,
}

impl StepArgs {
    pub fn new(demand: Option<Demand>, budget: Budget, ttl_ms: i64) -> Self {
        let milli = |x: f64| (x * 1000.0).floor().clamp(0.0, 1e15) as i64;
        Self {
            demand: demand.map_or(-1, |d| milli(d.per_sec)),
            burst: milli(budget.burst),
            rate: milli(budget.rate),
            ttl_ms,
            stale_ms: STALE_MS,
            pairs: demand.map_or(0, |d| i64::from(d.pairs.max(1))),
        }
    }

    /// `[demand, burst, rate, ttl, stale, floor ‰, reserve ‰, threshold ‰,
    /// pairs]`: the script's ARGV after the member.
    pub fn argv(&self) -> [i64; 9] {
        [
            self.demand,
            self.burst,
            self.rate,
            self.ttl_ms,
            self.stale_ms,
            (FLOOR_FRACTION * 1000.0).round() as i64,
            (NEWCOMER_RESERVE * 1000.0).round() as i64,
            (RESEND_THRESHOLD * 1000.0).round() as i64,
            self.pairs,
        ]
    }
}

/// Reads a step's integer answer: share burst, rate, members, reserved
/// burst, rate (milli).
pub fn shared_from_reply(reply: &[i64]) -> Result<Shared, StoreError> {
    let [b, r, n, rb, rr] = reply else {
        return Err(StoreError::Script(format!(
            "unexpected quota ledger reply of {} values",
            reply.len()
        )));
    };
    let unmilli = |x: i64| x.max(0) as f64 / 1000.0;
    Ok(Shared {
        share: Budget {
            burst: unmilli(*b),
            rate: unmilli(*r),
        },
        members: u32::try_from(*n).unwrap_or(0),
        reserved: Budget {
            burst: unmilli(*rb),
            rate: unmilli(*rr),
        },
    })
}

/// One member's record (all in milli units and milliseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Record {
    /// -1: not taking part.
    demand: f64,
    seen: f64,
    /// The current assignment (burst, rate) and until when it is live.
    current: (f64, f64, f64),
    /// The largest earlier assignments still live, and the latest expiry
    /// among them.
    earlier: (f64, f64, f64),
    /// The Envoys its demand sums.
    pairs: f64,
}

impl Record {
    /// What the member may enforce at `now`.
    fn reserved(&self, now: f64) -> (f64, f64) {
        let (mut b, mut r) = (0.0, 0.0);
        if self.current.2 > now {
            (b, r) = (self.current.0, self.current.1);
        }
        if self.earlier.2 > now {
            (b, r) = (f64::max(b, self.earlier.0), f64::max(r, self.earlier.1));
        }
        (b, r)
    }
}

/// One bucket's record: the Rust copy of `ledger.lua`. Keep the expressions
/// in the same order.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    members: BTreeMap<String, Record>,
}

impl Ledger {
    /// One step at `now_ms`; returns the script's integer reply.
    pub fn step(&mut self, member: &str, args: StepArgs, now_ms: i64) -> [i64; 5] {
        let now = now_ms as f64;
        let demand = args.demand as f64;
        let (budget_b, budget_r) = (args.burst as f64, args.rate as f64);
        let ttl = args.ttl_ms as f64;
        let stale = args.stale_ms as f64;
        let threshold = (RESEND_THRESHOLD * 1000.0).round() / 1000.0;
        let floor_fraction = (FLOOR_FRACTION * 1000.0).round() / 1000.0;
        let reserve = (NEWCOMER_RESERVE * 1000.0).round() / 1000.0;
        let (mut others_b, mut others_r, mut total, mut n) = (0.0, 0.0, 0.0, 0.0);
        let mut mine = Record {
            demand: -1.0,
            ..Record::default()
        };
        let mut gone = Vec::new();
        for (field, rec) in &self.members {
            if field == member {
                mine = *rec;
                continue;
            }
            let active = rec.demand >= 0.0 && now - rec.seen <= stale;
            if active {
                total += rec.demand;
                n += rec.pairs;
            }
            if !active && rec.current.2 <= now && rec.earlier.2 <= now {
                gone.push(field.clone());
            } else {
                let (b, r) = rec.reserved(now);
                others_b += b;
                others_r += r;
            }
        }
        for field in gone {
            self.members.remove(&field);
        }
        let (mut share_b, mut share_r) = (0.0, 0.0);
        let my_pairs = args.pairs as f64;
        if demand >= 0.0 {
            n += my_pairs;
            total += demand;
            let weight = if total > 0.0 {
                demand / total
            } else {
                my_pairs / n
            };
            let part = floor_fraction * my_pairs / n + (1.0 - floor_fraction) * weight;
            let target_b = budget_b * (1.0 - reserve) * part;
            let target_r = budget_r * (1.0 - reserve) * part;
            share_b = f64::min(target_b, f64::max(0.0, budget_b - others_b));
            share_r = f64::min(target_r, f64::max(0.0, budget_r - others_r));
            let (cb, cr, cu) = mine.current;
            let near = |a: f64, b: f64| (a - b).abs() <= threshold * f64::max(a, b);
            if cu > now
                && near(cb, share_b)
                && near(cr, share_r)
                && cb <= budget_b - others_b
                && cr <= budget_r - others_r
            {
                (share_b, share_r) = (cb, cr);
            }
            if cu > now && cb == share_b && cr == share_r {
                mine.current.2 = now + ttl;
            } else {
                let (lb, lr) = mine.reserved(now);
                let mut lu = 0.0;
                if mine.current.2 > now {
                    lu = mine.current.2;
                }
                if mine.earlier.2 > now {
                    lu = f64::max(lu, mine.earlier.2);
                }
                mine.earlier = (lb, lr, lu);
                mine.current = (share_b, share_r, now + ttl);
            }
        }
        mine.demand = demand;
        mine.seen = now;
        mine.pairs = my_pairs;
        let (mb, mr) = mine.reserved(now);
        self.members.insert(member.to_owned(), mine);
        [
            share_b.floor() as i64,
            share_r.floor() as i64,
            n as i64,
            (others_b + mb).floor() as i64,
            (others_r + mr).floor() as i64,
        ]
    }

    /// Members with a record (active or still reserving).
    pub fn records(&self) -> usize {
        self.members.len()
    }
}

/// A ledger in this process's memory: one replica only (for tests and
/// benchmarks of the shared path without Redis). The clock is the caller's.
pub struct MemoryLedger<C> {
    clock: C,
    buckets: parking_lot::Mutex<std::collections::HashMap<BucketKey, Ledger>>,
}

impl<C: crate::clock::Clock> MemoryLedger<C> {
    pub fn new(clock: C) -> Self {
        Self {
            clock,
            buckets: parking_lot::Mutex::default(),
        }
    }
}

#[async_trait]
impl<C: crate::clock::Clock + Send + Sync + 'static> QuotaLedger for MemoryLedger<C> {
    async fn step(
        &self,
        key: &BucketKey,
        member: Member,
        demand: Option<Demand>,
        budget: Budget,
        ttl_ms: i64,
    ) -> Result<Shared, StoreError> {
        let now_ms = (self.clock.now_micros() / 1000) as i64;
        let reply = self.buckets.lock().entry(key.clone()).or_default().step(
            &member.field(),
            StepArgs::new(demand, budget, ttl_ms),
            now_ms,
        );
        shared_from_reply(&reply)
    }
}

#[cfg(test)]
mod tests;
