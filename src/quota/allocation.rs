//! Splitting one global token bucket between the Envoys that report it
//! (RLQS), by their demand. Pure: no clock of its own, no I/O; the caller
//! says what time it is and what was reported.
//!
//! **Shares.** Each Envoy's demand is its reported requests (allowed +
//! denied) per second, smoothed over reports. Of the budget (burst `B`,
//! rate `r`), [`NEWCOMER_RESERVE`] is held back for Envoys that are about
//! to join; the rest is split so that every Envoy gets at least
//! [`FLOOR_FRACTION`] of an equal share (a quiet or new Envoy is never
//! starved) and the remainder in proportion to demand; and at least one
//! whole token of burst where the budget holds one for each (less is sent
//! as DENY_ALL).
//!
//! **Never over the budget, also while shares move.** Envoy replaces its
//! assignment when a different one arrives, but the server cannot know
//! when that is, so an assignment counts as live until its time to live
//! has passed. Each Envoy reserves the largest burst and rate among its live
//! assignments; a share may grow only into what nobody reserves. So at every
//! moment, Σ of what Envoys may enforce ≤ `B` and ≤ `r` ([`Allocation::reserved`]
//! is the bound, checked by the tests at every step). Shrinking is
//! immediate; growing waits until the shrunk Envoys' old assignments expire
//! (one time to live), except into the reserve and any unreserved part.
//!
//! **Departed Envoys.** An Envoy that leaves (its stream closed, or it
//! fell quiet) keeps enforcing what it was sent until that expires, so its
//! assignments stay reserved; but it is no longer a member: what all the
//! departed hold is one [`Envelope`] per split, a sum per second of expiry
//! (at most [`ENVELOPE_SLOTS`] entries however many came and went), so
//! churn costs a split neither memory nor planning work beyond that.

/// Part of the budget held back for Envoys that are about to join, so a
/// newcomer has a share at once even while the others' assignments live.
pub const NEWCOMER_RESERVE: f64 = 0.1;
/// Every reporting Envoy gets at least this fraction of an equal share.
pub const FLOOR_FRACTION: f64 = 0.2;
/// Weight of the newest demand sample in the smoothed demand.
pub const SMOOTHING: f64 = 0.5;

/// A demand after one more report of `requests` over `elapsed_secs`.
pub fn smoothed(before: Option<f64>, requests: u64, elapsed_secs: f64) -> f64 {
    let sample = requests as f64 / elapsed_secs.max(1e-3);
    match before {
        None => sample,
        Some(d) => SMOOTHING * sample + (1.0 - SMOOTHING) * d,
    }
}

/// A token bucket's size and refill: tokens, and tokens per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    pub burst: f64,
    pub rate: f64,
}

impl Budget {
    pub const ZERO: Budget = Budget {
        burst: 0.0,
        rate: 0.0,
    };

    /// The larger burst and the larger rate of the two.
    pub fn max(self, other: Budget) -> Budget {
        Budget {
            burst: self.burst.max(other.burst),
            rate: self.rate.max(other.rate),
        }
    }

    /// Both scaled by `k`.
    pub fn scaled(self, k: f64) -> Budget {
        Budget {
            burst: self.burst * k,
            rate: self.rate * k,
        }
    }
}

/// What Envoys that left a split still hold: Σ of their reservations, by
/// when they expire (those expiring within a second of each other in one
/// entry, kept until the later: a little longer, never shorter), oldest
/// first.
#[derive(Debug, Clone, Default)]
pub struct Envelope {
    slots: Vec<(u64, Budget)>,
}

/// Entries of an [`Envelope`] at most: more than the seconds of the longest
/// time to live and its margin.
pub const ENVELOPE_SLOTS: usize = 64;

impl Envelope {
    /// Adds `share`, live until `expires_micros`: into an entry that
    /// expires less than a second later, or one that expires less than a
    /// second earlier (which then lives until `expires_micros`), else as an
    /// entry of its own. So entries are a second apart when made: at most
    /// one per second of the longest time to live (and never more than
    /// [`ENVELOPE_SLOTS`]: then the latest takes it).
    fn add(&mut self, share: Budget, expires_micros: u64) {
        const SECOND: u64 = 1_000_000;
        let at = self.slots.partition_point(|(e, _)| *e < expires_micros);
        let slot = if self
            .slots
            .get(at)
            .is_some_and(|(e, _)| e - expires_micros < SECOND)
        {
            Some(at)
        } else if at > 0 && expires_micros - self.slots[at - 1].0 < SECOND {
            self.slots[at - 1].0 = expires_micros;
            Some(at - 1)
        } else if self.slots.len() >= ENVELOPE_SLOTS {
            let last = self.slots.len() - 1;
            self.slots[last].0 = self.slots[last].0.max(expires_micros);
            Some(last)
        } else {
            self.slots.insert(at, (expires_micros, share));
            None
        };
        if let Some(i) = slot {
            let b = &mut self.slots[i].1;
            b.burst += share.burst;
            b.rate += share.rate;
        }
    }

    fn expire(&mut self, now_micros: u64) {
        self.slots.retain(|(at, _)| *at > now_micros);
    }

    /// Σ still live at `now_micros`.
    pub fn reserved(&self, now_micros: u64) -> Budget {
        self.slots
            .iter()
            .filter(|(at, _)| *at > now_micros)
            .fold(Budget::ZERO, |a, (_, b)| Budget {
                burst: a.burst + b.burst,
                rate: a.rate + b.rate,
            })
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Its entries (at most [`ENVELOPE_SLOTS`]).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    fn next_expiry(&self) -> Option<u64> {
        self.slots.first().map(|(at, _)| *at)
    }
}

/// An assignment sent to one Envoy, live until `expires_micros`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grant {
    pub share: Budget,
    pub expires_micros: u64,
}

/// One Envoy's part of an allocation.
#[derive(Debug, Clone, Default)]
struct Member {
    /// Smoothed requests per second; `None` before its first report.
    demand: Option<f64>,
    /// Assignments sent and not yet expired, newest last.
    live: Vec<Grant>,
}

impl Member {
    fn reserved(&self) -> Budget {
        self.live.iter().fold(Budget::ZERO, |r, g| r.max(g.share))
    }

    fn current(&self) -> Option<Budget> {
        self.live.last().map(|g| g.share)
    }
}

/// The split of one global bucket between the Envoys reporting it, keyed by
/// whatever identifies an Envoy's stream (`E`). Members are few per bucket
/// and the buckets many: a vector costs a bucket far less than a map.
#[derive(Debug, Clone)]
pub struct Allocation<E> {
    budget: Budget,
    members: Vec<(E, Member)>,
    /// Part of the budget held back for newcomers ([`NEWCOMER_RESERVE`]).
    reserve: f64,
    /// What departed members still hold.
    departed: Envelope,
}

impl<E: Clone + Eq> Allocation<E> {
    pub fn new(budget: Budget) -> Self {
        Self {
            budget,
            members: Vec::new(),
            reserve: NEWCOMER_RESERVE,
            departed: Envelope::default(),
        }
    }

    /// Holds back `reserve` of the budget for newcomers instead of
    /// [`NEWCOMER_RESERVE`]: none where every member that may join already
    /// has its part kept out of the budget (regions: their floors).
    pub fn set_reserve(&mut self, reserve: f64) {
        self.reserve = reserve.clamp(0.0, 1.0);
    }

    fn member(&self, envoy: &E) -> Option<&Member> {
        self.members
            .iter()
            .find(|(e, _)| e == envoy)
            .map(|(_, m)| m)
    }

    fn member_mut(&mut self, envoy: &E) -> &mut Member {
        let at = match self.members.iter().position(|(e, _)| e == envoy) {
            Some(at) => at,
            None => {
                push_compact(&mut self.members, (envoy.clone(), Member::default()));
                self.members.len() - 1
            }
        };
        &mut self.members[at].1
    }

    /// When the earliest live assignment expires (then the budget it
    /// reserved may go to others): the next time a plan can differ
    /// without a report.
    pub fn next_expiry(&self) -> Option<u64> {
        self.members
            .iter()
            .flat_map(|(_, m)| m.live.iter().map(|g| g.expires_micros))
            .chain(self.departed.next_expiry())
            .min()
    }

    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// A reload changed the rule's numbers: later plans split the new ones
    /// (a lowered budget still waits for the live assignments to expire).
    pub fn set_budget(&mut self, budget: Budget) {
        self.budget = budget;
    }

    /// Records one report: `requests` (allowed + denied) over `elapsed_secs`.
    pub fn report(&mut self, envoy: &E, requests: u64, elapsed_secs: f64) {
        let member = self.member_mut(envoy);
        member.demand = Some(smoothed(member.demand, requests, elapsed_secs));
    }

    /// Counts `share` as live for `envoy` until `expires_micros`, as if it
    /// had been sent: what a member may already enforce before its first
    /// assignment reaches it (a region's floor), kept out of the others'
    /// growth until then.
    pub fn seed(&mut self, envoy: &E, share: Budget, expires_micros: u64) {
        push_compact(
            &mut self.member_mut(envoy).live,
            Grant {
                share,
                expires_micros,
            },
        );
    }

    /// Sets a member's demand as it is (already smoothed elsewhere: a
    /// region's, the sum of its instances').
    pub fn set_demand(&mut self, envoy: &E, demand: f64) {
        self.member_mut(envoy).demand = Some(demand);
    }

    /// Forgets an Envoy (its stream closed, or it stopped reporting). What
    /// it was sent stays reserved until it expires, in the [`Envelope`] of
    /// the departed: the largest share it holds until the last expiry.
    pub fn leave(&mut self, envoy: &E, now_micros: u64) {
        self.expire(now_micros);
        let Some(at) = self.members.iter().position(|(e, _)| e == envoy) else {
            return;
        };
        let (_, member) = self.members.swap_remove(at);
        if let Some(until) = member.live.iter().map(|g| g.expires_micros).max() {
            self.departed.add(member.reserved(), until);
        }
    }

    /// What the departed still hold (see [`Envelope`]).
    pub fn departed(&self) -> &Envelope {
        &self.departed
    }

    /// Σ of the members' smoothed demand (requests per second), and how
    /// many members have one.
    pub fn demand(&self) -> (f64, usize) {
        self.members
            .iter()
            .filter_map(|(_, m)| m.demand)
            .fold((0.0, 0), |(sum, n), d| (sum + d, n + 1))
    }

    /// Entries held: members, departed ones not among them.
    #[cfg(test)]
    pub(crate) fn entries(&self) -> usize {
        self.members.len()
    }

    /// Envoys taking part (reported and not left).
    pub fn members(&self) -> usize {
        self.members
            .iter()
            .filter(|(_, m)| m.demand.is_some())
            .count()
    }

    /// Σ over Envoys of the largest share each may still enforce, the
    /// departed included: never above the budget.
    pub fn reserved(&self, now_micros: u64) -> Budget {
        let departed = self.departed.reserved(now_micros);
        self.members
            .iter()
            .map(|(_, m)| {
                m.live
                    .iter()
                    .filter(|g| g.expires_micros > now_micros)
                    .fold(Budget::ZERO, |r, g| r.max(g.share))
            })
            .fold(departed, |a, b| Budget {
                burst: a.burst + b.burst,
                rate: a.rate + b.rate,
            })
    }

    fn expire(&mut self, now_micros: u64) {
        self.departed.expire(now_micros);
        for (_, m) in &mut self.members {
            m.live.retain(|g| g.expires_micros > now_micros);
        }
        self.members
            .retain(|(_, m)| m.demand.is_some() || !m.live.is_empty());
    }

    /// Where each reporting Envoy's share should be, ignoring what is live.
    /// (index in `members`, target) for every member with a demand.
    fn targets(&self) -> Vec<(usize, Budget)> {
        let active: Vec<(usize, f64)> = self
            .members
            .iter()
            .enumerate()
            .filter_map(|(i, (_, m))| m.demand.map(|d| (i, d)))
            .collect();
        let n = active.len() as f64;
        if active.is_empty() {
            return Vec::new();
        }
        let assignable = self.budget.scaled(1.0 - self.reserve);
        let floor = FLOOR_FRACTION / n;
        let total_demand: f64 = active.iter().map(|(_, d)| d).sum();
        let demands: Vec<f64> = active.iter().map(|(_, d)| *d).collect();
        let mut targets: Vec<(usize, Budget)> = active
            .into_iter()
            .map(|(i, d)| {
                let weight = if total_demand > 0.0 {
                    d / total_demand
                } else {
                    1.0 / n
                };
                // floor for everyone, the rest by demand: Σ weights = 1
                let part = floor + (1.0 - FLOOR_FRACTION) * weight;
                (i, assignable.scaled(part))
            })
            .collect();
        // a share of less than a whole token is no share (DENY_ALL on the
        // wire): each member gets one where the budget holds one for each,
        // taken from the larger shares in proportion (Σ unchanged)
        let least = (assignable.burst / n).min(1.0);
        let short: f64 = targets
            .iter()
            .map(|(_, t)| (least - t.burst).max(0.0))
            .sum();
        let spare: f64 = targets
            .iter()
            .map(|(_, t)| (t.burst - least).max(0.0))
            .sum();
        if short > 0.0 && spare > 0.0 {
            let keep = (1.0 - short / spare).max(0.0);
            for (_, t) in &mut targets {
                t.burst = if t.burst <= least {
                    least
                } else {
                    least + (t.burst - least) * keep
                };
            }
        }
        whole_tokens(&mut targets, &demands);
        targets
    }

    /// The assignments to send now, each live for `ttl_micros`: for every
    /// reporting Envoy, its target where the budget allows, else as much as
    /// nobody reserves. An Envoy whose share is unchanged gets it again (the
    /// resend extends its life). Records what it returns as sent.
    pub fn plan(&mut self, now_micros: u64, ttl_micros: u64) -> Vec<(E, Budget)> {
        self.plan_each(now_micros, |_| ttl_micros)
    }

    /// [`Allocation::plan`], each Envoy's assignment live for `ttl_of` it.
    pub fn plan_each(&mut self, now_micros: u64, ttl_of: impl Fn(&E) -> u64) -> Vec<(E, Budget)> {
        self.expire(now_micros);
        let targets = self.targets();
        // Shrinking is always safe; growing only into unreserved budget,
        // counting the shrunk Envoys' live assignments as reserved.
        let reserved = self.reserved(now_micros);
        let mut headroom = Budget {
            burst: (self.budget.burst - reserved.burst).max(0.0),
            rate: (self.budget.rate - reserved.rate).max(0.0),
        };
        // growth wanted beyond what each Envoy already reserves
        let wants: Vec<Budget> = targets
            .iter()
            .map(|(i, t)| {
                let have = self.members[*i].1.reserved();
                Budget {
                    burst: (t.burst - have.burst).max(0.0),
                    rate: (t.rate - have.rate).max(0.0),
                }
            })
            .collect();
        let wanted = wants.iter().fold(Budget::ZERO, |a, w| Budget {
            burst: a.burst + w.burst,
            rate: a.rate + w.rate,
        });
        let fill = Budget {
            burst: if wanted.burst > 0.0 {
                (headroom.burst / wanted.burst).min(1.0)
            } else {
                1.0
            },
            rate: if wanted.rate > 0.0 {
                (headroom.rate / wanted.rate).min(1.0)
            } else {
                1.0
            },
        };
        let mut out = Vec::with_capacity(targets.len());
        for ((i, target), want) in targets.into_iter().zip(wants) {
            let (e, member) = &mut self.members[i];
            let expires_micros = now_micros.saturating_add(ttl_of(e));
            let have = member.reserved();
            let share = Budget {
                burst: target.burst.min(have.burst + want.burst * fill.burst),
                rate: target.rate.min(have.rate + want.rate * fill.rate),
            };
            headroom.burst -= (share.burst - have.burst).max(0.0);
            headroom.rate -= (share.rate - have.rate).max(0.0);
            match member.live.last_mut() {
                // the same again: Envoy only extends its life
                Some(last) if last.share == share => last.expires_micros = expires_micros,
                _ => push_compact(
                    &mut member.live,
                    Grant {
                        share,
                        expires_micros,
                    },
                ),
            }
            out.push((e.clone(), share));
        }
        debug_assert!(headroom.burst > -1e-6 && headroom.rate > -1e-6);
        out
    }

    /// The share last sent to `envoy`, if it has a live one.
    pub fn current(&self, envoy: &E) -> Option<Budget> {
        self.member(envoy).and_then(Member::current)
    }
}

/// Rounds the targets' bursts to whole tokens (what is sent: a share's
/// burst goes out rounded down), handing the tokens the fractions add up
/// to, one each, to the largest fractions (the busier member first on a
/// tie): Σ never grows, and a budget of fewer tokens than members still
/// gives someone a usable token instead of everyone DENY_ALL.
fn whole_tokens(targets: &mut [(usize, Budget)], demands: &[f64]) {
    const EPS: f64 = 1e-9;
    let total: f64 = targets.iter().map(|(_, t)| t.burst).sum();
    let whole: f64 = targets.iter().map(|(_, t)| (t.burst + EPS).floor()).sum();
    let mut left = (total - whole + EPS).floor();
    let mut order: Vec<usize> = (0..targets.len()).collect();
    let fraction = |t: &Budget| t.burst + EPS - (t.burst + EPS).floor();
    order.sort_by(|&a, &b| {
        fraction(&targets[b].1)
            .total_cmp(&fraction(&targets[a].1))
            .then(demands[b].total_cmp(&demands[a]))
    });
    for (_, t) in targets.iter_mut() {
        t.burst = (t.burst + EPS).floor();
    }
    for i in order {
        if left < 1.0 {
            break;
        }
        targets[i].1.burst += 1.0;
        left -= 1.0;
    }
}

/// Pushes onto a vector that grows by half of its length (one at first)
/// instead of doubling from four: most buckets have one member holding one
/// assignment, and a million of them are the state's memory.
pub(crate) fn push_compact<T>(v: &mut Vec<T>, item: T) {
    if v.len() == v.capacity() {
        v.reserve_exact((v.len() / 2).max(1));
    }
    v.push(item);
}

#[cfg(test)]
mod tests;
