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
//! reserve (their live shares: each member keeps its current one and its
//! earlier ones still live, as two envelopes (`fold`); and what it says
//! it [`Held`] without the ledger), so Σ of the replicas' shares stays ≤
//! the budget, whatever the order of steps; each replica keeps Σ of what
//! its Envoys may enforce within the largest of its live shares.
//! **Growth is tentative**: a share larger than the member's live one is
//! reserved [`GROW_MS`] until a later step keeps it (see there why).
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

/// How long a share that grows is reserved (and may be assigned) until a
/// later step keeps it: the shortest time to live an assignment has, with
/// its margin and a second for the answer to come back in. A share is
/// computed from every member's demand as recorded, and a member's first
/// real report lands at one replica a moment before the other: the first
/// to step took 0.9 of a 50/s budget from the other's stale demand, kept
/// it reserved for a whole time to live (15 s with Envoy's 5 s reports)
/// and held the other at 9.5/s all that time (issue 56's floor, 70 % of
/// r·t, missed). Growth is tentative for one step now.
pub const GROW_MS: i64 =
    ((super::MIN_TTL_MICROS + super::LIVE_MARGIN_MICROS + 1_000_000) / 1000) as i64;

/// One step's answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shared {
    /// The caller's share (zero when it left).
    pub share: Budget,
    /// Envoys (pairs) of the active members, the caller's included.
    pub members: u32,
    /// Σ of every member's live reservations after the step.
    pub reserved: Budget,
    /// Active members (replicas), the caller included unless it left: the
    /// replicas a safe share divides the budget by while the ledger cannot
    /// answer.
    pub replicas: u32,
    /// How long from the step the ledger reserves `share` (the step's time
    /// to live, or [`GROW_MS`] for a share that grew).
    pub life_ms: i64,
}

impl Shared {
    /// This answer within what the step asked about: read as untrusted
    /// (the ledger's hash can be written by anyone who reaches that
    /// Redis), the share at most `budget`, its life at most `ttl_ms`, the
    /// replicas at most [`crate::instances::MAX_COUNTED_INSTANCES`]. An
    /// answer the ledger's own script gave is unchanged; the caller counts
    /// one that is not (`rls_untrusted_input_refused_total{source="ledger"}`).
    pub fn within(self, budget: Budget, ttl_ms: i64) -> Self {
        Self {
            share: Budget {
                burst: self.share.burst.min(budget.burst.max(0.0)),
                rate: self.share.rate.min(budget.rate.max(0.0)),
            },
            replicas: self.replicas.min(crate::instances::MAX_COUNTED_INSTANCES),
            life_ms: self.life_ms.clamp(0, ttl_ms.max(0)),
            ..self
        }
    }
}

/// What a replica's Envoys may still enforce that the ledger did not give
/// (assigned while its steps failed): kept reserved for it, as an earlier
/// share of its own, for `for_ms` from the step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Held {
    pub budget: Budget,
    pub for_ms: i64,
}

/// The members' records of buckets, wherever they are kept.
#[async_trait]
pub trait QuotaLedger: Send + Sync + 'static {
    /// Steps `member` of `key`: records its `demand` (`None`: it leaves,
    /// keeping its shares reserved until they expire) and what it `held`
    /// without the ledger, and returns its share of `budget`, live for
    /// `ttl_ms`.
    async fn step(
        &self,
        key: &BucketKey,
        member: Member,
        demand: Option<Demand>,
        held: Option<Held>,
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
    /// What the member holds without the ledger (milli), and for how
    /// long from the step (0: nothing).
    pub held_burst: i64,
    pub held_rate: i64,
    pub held_ms: i64,
    /// How long a share that grows is reserved ([`GROW_MS`], at most the
    /// time to live).
    pub grow_ms: i64,
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
            held_burst: 0,
            held_rate: 0,
            held_ms: 0,
            grow_ms: GROW_MS.min(ttl_ms),
        }
    }

    /// These arguments, also recording `held` (nothing for `None`).
    pub fn holding(self, held: Option<Held>) -> Self {
        let Some(held) = held.filter(|h| h.for_ms > 0) else {
            return self;
        };
        let milli = |x: f64| (x * 1000.0).ceil().clamp(0.0, 1e15) as i64;
        Self {
            held_burst: milli(held.budget.burst),
            held_rate: milli(held.budget.rate),
            held_ms: held.for_ms,
            ..self
        }
    }

    /// `[demand, burst, rate, ttl, stale, floor ‰, reserve ‰, threshold ‰,
    /// pairs, held burst, held rate, held ms, grow ms]`: the script's ARGV
    /// after the member.
    pub fn argv(&self) -> [i64; 13] {
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
            self.held_burst,
            self.held_rate,
            self.held_ms,
            self.grow_ms,
        ]
    }
}

/// Reads a step's integer answer: share burst, rate, members, reserved
/// burst, rate (milli), replicas, the share's life (ms).
pub fn shared_from_reply(reply: &[i64]) -> Result<Shared, StoreError> {
    let [b, r, n, rb, rr, replicas, life] = reply else {
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
        replicas: u32::try_from(*replicas).unwrap_or(u32::MAX),
        life_ms: (*life).max(0),
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
    /// Earlier assignments still live, as two envelopes (burst, rate,
    /// until) ([`fold`]): a large share that expires soon and a smaller
    /// one that lives on are kept apart, not joined into the large one
    /// living on.
    earlier: (f64, f64, f64),
    older: (f64, f64, f64),
    /// The Envoys its demand sums.
    pairs: f64,
}

/// The entries of `items` still live at `now` and not covered by `cover`
/// (no larger and no longer), as at most two envelopes: exactly when two
/// or fewer, else the ones expiring first joined (the larger burst and
/// rate, the later expiry) until two are left, so what they reserve is
/// never less than the items did. Ordered by expiry, then burst, then
/// rate: `ledger.lua` joins the same ones.
fn fold(items: &[(f64, f64, f64)], cover: (f64, f64, f64), now: f64) -> [(f64, f64, f64); 2] {
    let mut live: Vec<(f64, f64, f64)> = items
        .iter()
        .copied()
        .filter(|&(b, r, u)| u > now && !(b <= cover.0 && r <= cover.1 && u <= cover.2))
        .collect();
    live.sort_by(|x, y| {
        x.2.total_cmp(&y.2)
            .then(x.0.total_cmp(&y.0))
            .then(x.1.total_cmp(&y.1))
    });
    while live.len() > 2 {
        let first = live.remove(0);
        let next = &mut live[0];
        *next = (
            f64::max(first.0, next.0),
            f64::max(first.1, next.1),
            f64::max(first.2, next.2),
        );
    }
    let none = (0.0, 0.0, 0.0);
    [
        live.first().copied().unwrap_or(none),
        live.get(1).copied().unwrap_or(none),
    ]
}

impl Record {
    /// What the member may enforce at `now`.
    fn reserved(&self, now: f64) -> (f64, f64) {
        let (mut b, mut r) = (0.0, 0.0);
        if self.current.2 > now {
            (b, r) = (self.current.0, self.current.1);
        }
        for (eb, er, eu) in [self.earlier, self.older] {
            if eu > now {
                (b, r) = (f64::max(b, eb), f64::max(r, er));
            }
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
    pub fn step(&mut self, member: &str, args: StepArgs, now_ms: i64) -> [i64; 7] {
        let now = now_ms as f64;
        let demand = args.demand as f64;
        let (budget_b, budget_r) = (args.burst as f64, args.rate as f64);
        let ttl = args.ttl_ms as f64;
        let mut life = ttl;
        let stale = args.stale_ms as f64;
        let threshold = (RESEND_THRESHOLD * 1000.0).round() / 1000.0;
        let floor_fraction = (FLOOR_FRACTION * 1000.0).round() / 1000.0;
        let reserve = (NEWCOMER_RESERVE * 1000.0).round() / 1000.0;
        let (mut others_b, mut others_r, mut total, mut n) = (0.0, 0.0, 0.0, 0.0);
        let mut replicas = 0;
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
                replicas += 1;
            }
            if !active && rec.current.2 <= now && rec.earlier.2 <= now && rec.older.2 <= now {
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
        // what is still live besides the current share: the earlier ones,
        // and what it assigned without the ledger
        let mut earlier = vec![mine.earlier, mine.older];
        if args.held_ms > 0 {
            earlier.push((
                args.held_burst as f64,
                args.held_rate as f64,
                now + args.held_ms as f64,
            ));
        }
        let (mut share_b, mut share_r) = (0.0, 0.0);
        let my_pairs = args.pairs as f64;
        if demand >= 0.0 {
            replicas += 1;
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
                // more than the live share: tentative until a step keeps it
                let (live_b, live_r) = if cu > now { (cb, cr) } else { (0.0, 0.0) };
                if share_b > live_b || share_r > live_r {
                    life = f64::min(ttl, args.grow_ms as f64);
                }
                earlier.push(mine.current);
                mine.current = (share_b, share_r, now + life);
            }
        }
        [mine.earlier, mine.older] = fold(&earlier, mine.current, now);
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
            replicas,
            life as i64,
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
        held: Option<Held>,
        budget: Budget,
        ttl_ms: i64,
    ) -> Result<Shared, StoreError> {
        let now_ms = (self.clock.now_micros() / 1000) as i64;
        let reply = self.buckets.lock().entry(key.clone()).or_default().step(
            &member.field(),
            StepArgs::new(demand, budget, ttl_ms).holding(held),
            now_ms,
        );
        shared_from_reply(&reply)
    }
}

#[cfg(test)]
mod tests;
