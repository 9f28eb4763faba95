//! The token-bucket arithmetic, as pure functions of (parameters, state, now, cost).
//!
//! A bucket holds up to `capacity` (B) tokens and refills continuously at
//! `r = tokens_per_unit / unit` tokens per second:
//! `tokens = min(B, tokens + r * elapsed)`. A request of cost `c` is admitted
//! when `tokens >= c` and then deducts `c`; otherwise it is rejected and told to
//! retry after `ceil((c - tokens) / r)` seconds. `r = 0` rejects everything and
//! `c > B` can never be admitted: both with no retry time. A refund adds
//! tokens back, never beyond B. A charge (usage accounting, a rule's
//! `overdraft`) is never refused: it deducts `c` even from a bucket that
//! does not hold it, down to `-B` at most (a debt the refill repays), and is
//! answered as a spend would be, with the wait counted from after it. A
//! charge never raises a balance: one already below `-B` (a reload lowered
//! B) stays where it is.
//!
//! This file is the one Rust copy of the arithmetic; `store/redis/bucket.lua`
//! is the other, and the shared case table in `tests/bucket_cases.rs` checks
//! that both give the same answers. Time is in microseconds and never goes
//! backwards as far as a bucket is concerned: an earlier "now" adds no tokens.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses only the calendar's periods (a bucket's parameter).

/// Tolerance for float comparisons, so that 0.1 s at 10/s refills exactly one token.
pub const EPSILON: f64 = 1e-9;

use crate::calendar::Periods;

/// The parameters of one bucket, straight from a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BucketParams {
    /// B: the most tokens the bucket holds (the burst).
    pub capacity: u64,
    /// Tokens added per `unit_secs`.
    pub tokens_per_unit: u64,
    /// Length of the rule's unit in seconds (1 for `second`, 60 for `minute`, …).
    pub unit_secs: u64,
    /// On an `overdraft` rule, the most debt a charge may leave (`max_debt`);
    /// `None`: one burst (B).
    pub max_debt: Option<u64>,
    /// How the bucket counts: a token bucket, or a fixed window
    /// ([`crate::window`]).
    pub algorithm: Algorithm,
    /// For a calendar period ([`Algorithm::CalendarWindow`]): the period
    /// holding now and the one after it, as the limiter found them at the
    /// decision; `None` for every other bucket.
    pub period: Option<Periods>,
}

/// How a rule counts (`algorithm:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Refills continuously (this file).
    #[default]
    TokenBucket,
    /// envoyproxy/ratelimit's: `requests_per_unit` hits per window aligned
    /// to the epoch, every hit counted ([`crate::window`]).
    FixedWindow,
    /// The weighted two-window counter: `requests_per_unit` admitted hits
    /// in any window's length, estimated ([`crate::window::sliding`]).
    SlidingWindow,
    /// A budget per calendar period in a time zone (a limit's `calendar:`,
    /// never named as an `algorithm`): admitted hits and charges counted
    /// until the period ends ([`crate::window::decide`]).
    CalendarWindow,
}

impl Algorithm {
    /// Every algorithm a rule's `algorithm:` (or `--algorithm`) may name,
    /// in the order their names are listed.
    pub const ALL: [Algorithm; 3] = [
        Algorithm::TokenBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
    ];

    /// Its name in rules, flags and `/config`.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::CalendarWindow => "calendar",
        }
    }

    /// The algorithm a rule or a flag names; `None`: no such one.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The names, for a message: "token_bucket, fixed_window, sliding_window".
    pub fn names() -> String {
        Self::ALL.map(Algorithm::name).join(", ")
    }
}

/// What a bucket remembers between decisions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketState {
    /// Tokens in the bucket at `updated_micros`, possibly fractional.
    pub tokens: f64,
    /// When `tokens` was last computed.
    pub updated_micros: u64,
}

/// The most hits a sliding window counts per window (2^26 − 1), so that
/// both of its counts fit one float exactly (see
/// [`BucketState::window_counts`]).
pub const MAX_WINDOW_COUNT: u64 = (1 << 26) - 1;
/// Where the window before's count starts in a sliding window's `tokens`.
const WINDOW_SHIFT: f64 = (1u64 << 26) as f64;

impl BucketState {
    /// A sliding window's state: `tokens` packs the window before's count
    /// and the current one's (`previous × 2^26 + current`, each at most
    /// [`MAX_WINDOW_COUNT`]), `updated_micros` is the current window's start.
    pub fn sliding_window(previous: f64, current: f64, start_micros: u64) -> Self {
        let bound = MAX_WINDOW_COUNT as f64;
        BucketState {
            tokens: previous.clamp(0.0, bound) * WINDOW_SHIFT + current.clamp(0.0, bound),
            updated_micros: start_micros,
        }
    }

    /// A sliding window's two counts: (the window before's, the current one's).
    pub fn window_counts(&self) -> (f64, f64) {
        let previous = (self.tokens / WINDOW_SHIFT).floor();
        (previous, self.tokens - previous * WINDOW_SHIFT)
    }
}

/// How much a request spends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cost {
    /// Spend this many tokens when admitted.
    Spend(u64),
    /// Answer as if spending one token, but deduct nothing (`hits_addend: 0`).
    Check,
    /// Give tokens back (Envoy's `is_negative_hits`: an operation turned out
    /// cheaper than charged); always answered OK, never above B.
    Refund(u64),
    /// Give back what an attempt's start took at `taken_micros` (a
    /// reservation's unused part, a withdrawn start): a refund for a token
    /// bucket; a window or calendar period takes it off its count only
    /// while the window that counted it is the current one (a window since
    /// begun never counted it: giving it there would admit more than the
    /// limit).
    GiveBack { tokens: u64, taken_micros: u64 },
    /// Charge usage on an `overdraft` rule: always deducted, down to `-B`
    /// at most (a balance already below it stays); answered OK when the buckets held it, else OVER_LIMIT with
    /// the time until they hold it again (after this charge).
    Charge(u64),
    /// Take a lease: admitted when `needed` tokens are there, and then takes
    /// as many whole tokens as every bucket holds, up to `up_to` (at least
    /// `needed`). [`BucketOutcome::taken`] says how many.
    Lease { needed: u64, up_to: u64 },
}

/// The largest cost (and refund) the arithmetic sees: 2^53, exact as a
/// float in both Rust and Lua and far above any bucket (a burst is a u32).
/// A larger `hits_addend` is saturated to it, so that it is rejected as
/// above capacity in both stores instead of wrapping around on the way to
/// Redis's integers.
pub const MAX_COST: u64 = 1 << 53;

impl Cost {
    /// Tokens that must be present for the request to be admitted.
    pub fn needed(self) -> u64 {
        match self {
            Cost::Spend(n) | Cost::Charge(n) => n,
            Cost::Check => 1,
            Cost::Refund(_) | Cost::GiveBack { .. } => 0,
            Cost::Lease { needed, .. } => needed,
        }
        .min(MAX_COST)
    }

    /// Tokens taken out of the bucket when admitted; negative for a refund;
    /// for a lease, the most it may take. More than [`Cost::needed`] only for
    /// a lease (the Lua script tells a lease apart by exactly that).
    pub fn deducted(self) -> i64 {
        // MAX_COST fits an i64 with room to spare.
        let signed = |n: u64| n.min(MAX_COST) as i64;
        match self {
            Cost::Spend(n) | Cost::Charge(n) => signed(n),
            Cost::Check => 0,
            Cost::Refund(n) | Cost::GiveBack { tokens: n, .. } => -signed(n),
            Cost::Lease { needed, up_to } => signed(up_to.max(needed)),
        }
    }

    /// Whether this cost gives back to the window `[start, end)` (µs): a
    /// plain refund does (to the window now running), an attempt's
    /// give-back only when that window counted it.
    pub fn gives_back_to(self, start: u64, end: u64) -> bool {
        match self {
            Cost::GiveBack { taken_micros, .. } => (start..end).contains(&taken_micros),
            _ => true,
        }
    }
}

/// The answer of one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketOutcome {
    pub admitted: bool,
    /// Whole tokens left after this decision.
    pub remaining: u64,
    /// For a rejection that waiting can cure: whole seconds until it would be admitted.
    pub retry_after_secs: Option<u64>,
    /// Whole seconds until the bucket is full again (0 when full).
    pub full_in_secs: u64,
    /// Why a rejection can never be cured by waiting, if that is the case.
    pub never: Option<NeverReason>,
    /// Tokens this decision took from the bucket (0 when rejected, for a
    /// check and for a refund); for a lease, the tokens granted; for a
    /// charge, what it deducted (also when answered OVER_LIMIT).
    pub taken: u64,
    /// Tokens a charge could not take because the debt bound stopped it
    /// (`max_debt`, else one burst), to the nearest whole: forgiven, and
    /// counted.
    pub forgiven: u64,
    /// A fixed window's count after this hit (every hit counts, refused
    /// ones too), for envoyproxy/ratelimit's split of a weighted hit
    /// between its near_limit and over_limit statistics; `None` for every
    /// other algorithm.
    pub window_count: Option<u64>,
}

/// A rejection no amount of waiting fixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeverReason {
    /// `requests_per_unit: 0`: the rule blocks everything.
    ZeroRate,
    /// The cost is larger than the bucket can ever hold.
    CostAboveCapacity,
}

impl BucketParams {
    /// Refill rate in tokens per second.
    pub fn rate_per_sec(&self) -> f64 {
        if self.unit_secs == 0 {
            return 0.0;
        }
        self.tokens_per_unit as f64 / self.unit_secs as f64
    }

    /// Tokens added over `elapsed_micros`; the same expression as the Lua script.
    fn refill_amount(&self, elapsed_micros: u64) -> f64 {
        elapsed_micros as f64 * self.tokens_per_unit as f64 / (self.unit_secs as f64 * 1e6)
    }

    /// The state brought up to `now`: a missing bucket is full; time that went
    /// backwards adds nothing and does not move the timestamp back.
    pub fn refill(&self, state: Option<BucketState>, now_micros: u64) -> BucketState {
        let capacity = self.capacity as f64;
        match state {
            None => BucketState {
                tokens: capacity,
                updated_micros: now_micros,
            },
            Some(s) if now_micros <= s.updated_micros => BucketState {
                tokens: s.tokens.min(capacity),
                updated_micros: s.updated_micros,
            },
            Some(s) => BucketState {
                tokens: (s.tokens + self.refill_amount(now_micros - s.updated_micros))
                    .min(capacity),
                updated_micros: now_micros,
            },
        }
    }

    /// Whether `cost` fits into a bucket holding `tokens` (already refilled).
    fn verdict(&self, tokens: f64, cost: Cost) -> Result<(), Rejection> {
        if let Cost::Refund(_) | Cost::GiveBack { .. } = cost {
            // a refund is answered OK whatever the rule, `requests_per_unit: 0` too
            return Ok(());
        }
        if self.tokens_per_unit == 0 || self.unit_secs == 0 {
            return Err(Rejection::Never(NeverReason::ZeroRate));
        }
        let needed = cost.needed();
        if needed > self.capacity {
            return Err(Rejection::Never(NeverReason::CostAboveCapacity));
        }
        if tokens + EPSILON >= needed as f64 {
            Ok(())
        } else {
            let secs = ((needed as f64 - tokens) / self.rate_per_sec() - EPSILON).ceil();
            Err(Rejection::Wait(secs.max(1.0) as u64))
        }
    }

    /// Whole seconds until a bucket holding `tokens` is full.
    fn full_in_secs(&self, tokens: f64) -> u64 {
        let missing = self.capacity as f64 - tokens;
        let rate = self.rate_per_sec();
        if missing <= EPSILON || rate <= 0.0 {
            0
        } else {
            (missing / rate - EPSILON).ceil().max(0.0) as u64
        }
    }

    /// When a bucket in `state` will be full again; after that it can be
    /// forgotten, because a missing bucket is a full one. `None`: never refills.
    pub fn full_at_micros(&self, state: &BucketState) -> Option<u64> {
        match self.algorithm {
            // a window's count is forgotten when the window ends
            // (`updated_micros` is its start)
            Algorithm::FixedWindow => {
                return Some(
                    state
                        .updated_micros
                        .saturating_add(self.unit_secs.max(1).saturating_mul(1_000_000)),
                )
            }
            // it counts nothing two windows after the current one's start
            // if that one counted, else one window after
            Algorithm::SlidingWindow => {
                let (previous, current) = state.window_counts();
                let windows = if current > 0.0 {
                    2
                } else {
                    u64::from(previous > 0.0)
                };
                return Some(state.updated_micros.saturating_add(
                    windows.saturating_mul(self.unit_secs.max(1).saturating_mul(1_000_000)),
                ));
            }
            // a period's count is forgotten when the period ends
            // (`updated_micros` is its start; one the periods do not know
            // is over)
            Algorithm::CalendarWindow => {
                let micros = |secs: i64| u64::try_from(secs).unwrap_or(0).saturating_mul(1_000_000);
                let start = state.updated_micros;
                return Some(match self.period {
                    Some(p) if start == micros(p.start) => micros(p.end),
                    Some(p) if start == micros(p.end) => micros(p.next_end),
                    _ => start,
                });
            }
            Algorithm::TokenBucket => {}
        }
        let missing = self.capacity as f64 - state.tokens;
        if missing <= EPSILON {
            return Some(state.updated_micros);
        }
        if self.tokens_per_unit == 0 || self.unit_secs == 0 {
            return None;
        }
        let micros = (missing * self.unit_secs as f64 * 1e6 / self.tokens_per_unit as f64).ceil();
        Some(state.updated_micros.saturating_add(micros as u64))
    }

    /// How long an empty bucket takes to fill; `u64::MAX`: never.
    pub fn micros_from_empty_to_full(&self) -> u64 {
        let empty = BucketState {
            tokens: 0.0,
            updated_micros: 0,
        };
        self.full_at_micros(&empty).unwrap_or(u64::MAX)
    }
}

enum Rejection {
    Wait(u64),
    Never(NeverReason),
}

/// Whole tokens (or hits) in `tokens`, rounded down within [`EPSILON`],
/// never below 0.
pub fn whole_tokens(tokens: f64) -> u64 {
    (tokens + EPSILON).floor().max(0.0) as u64
}

/// Decides one request against several buckets together (a descriptor with
/// `limits`): it is admitted only if every bucket admits it, and then every
/// bucket pays; if any rejects, none is charged.
///
/// `states[i]` is bucket `i`'s stored state (`None` for a bucket never seen or
/// forgotten). Returns the states to store and one outcome per bucket.
pub fn decide(
    params: &[BucketParams],
    states: &[Option<BucketState>],
    now_micros: u64,
    cost: Cost,
) -> (Vec<BucketState>, Vec<BucketOutcome>) {
    debug_assert_eq!(params.len(), states.len());
    let mut refilled: Vec<BucketState> = params
        .iter()
        .zip(states)
        .map(|(p, s)| p.refill(*s, now_micros))
        .collect();
    let verdicts: Vec<Result<(), Rejection>> = params
        .iter()
        .zip(&refilled)
        .map(|(p, s)| p.verdict(s.tokens, cost))
        .collect();
    let admitted = verdicts.iter().all(Result::is_ok);
    // a charge is deducted whatever the verdict, except where nothing can
    // ever refill (rate 0: no debt could be repaid)
    let charge = matches!(cost, Cost::Charge(_));
    let applies = admitted
        || (charge
            && !verdicts
                .iter()
                .any(|v| matches!(v, Err(Rejection::Never(NeverReason::ZeroRate)))));
    let deducted = match cost {
        Cost::Lease { needed, up_to } => {
            let available = refilled
                .iter()
                .map(|s| whole_tokens(s.tokens))
                .min()
                .unwrap_or(0);
            available.min(up_to).max(needed) as f64
        }
        other => other.deducted() as f64,
    };
    let mut forgiven = vec![0; params.len()];
    if applies {
        for ((state, p), forgiven) in refilled.iter_mut().zip(params).zip(&mut forgiven) {
            let capacity = p.capacity as f64;
            // a charge may go into debt, down to -B (or -max_debt), and
            // never raises a balance already below that (a reload lowered
            // B); nothing else goes below where the bucket is (a refund
            // into a debt repays part of it)
            let floor = if charge {
                (-(p.max_debt.unwrap_or(p.capacity) as f64)).min(state.tokens)
            } else {
                state.tokens.min(0.0)
            };
            let wanted = state.tokens - deducted;
            if wanted < floor {
                // rounded: a microsecond's refill must not change it
                *forgiven = (floor - wanted + 0.5).floor() as u64;
            }
            state.tokens = wanted.clamp(floor, capacity);
        }
    }
    let taken = if applies { deducted.max(0.0) as u64 } else { 0 };
    let outcomes = params
        .iter()
        .zip(&refilled)
        .zip(verdicts)
        .zip(forgiven)
        .map(|(((p, s), verdict), forgiven)| {
            let (retry_after_secs, never) = match verdict {
                // a charge answered OVER_LIMIT was deducted: its wait is
                // until the bucket holds it again from where it is now
                _ if charge && applies && !admitted => match p.verdict(s.tokens, cost) {
                    Err(Rejection::Wait(secs)) => (Some(secs), None),
                    Err(Rejection::Never(reason)) => (None, Some(reason)),
                    Ok(()) => (None, None),
                },
                Ok(()) => (None, None),
                Err(Rejection::Wait(secs)) => (Some(secs), None),
                Err(Rejection::Never(reason)) => (None, Some(reason)),
            };
            BucketOutcome {
                admitted,
                remaining: if never == Some(NeverReason::ZeroRate) {
                    0
                } else {
                    whole_tokens(s.tokens)
                },
                retry_after_secs: if admitted { None } else { retry_after_secs },
                full_in_secs: p.full_in_secs(s.tokens),
                never,
                taken,
                forgiven,
                window_count: None,
            }
        })
        .collect();
    (refilled, outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000;

    fn per_second(capacity: u64, rate: u64) -> BucketParams {
        BucketParams {
            capacity,
            tokens_per_unit: rate,
            unit_secs: 1,
            max_debt: None,
            algorithm: Default::default(),
            period: None,
        }
    }

    fn one(
        p: BucketParams,
        s: Option<BucketState>,
        now: u64,
        cost: Cost,
    ) -> (BucketState, BucketOutcome) {
        let (states, outcomes) = decide(&[p], &[s], now, cost);
        (states[0], outcomes[0])
    }

    /// The audit's LLM case (#26): 1,000 tokens, 1,000 a minute; a check at
    /// request time, the usage charged when the response is done.
    #[test]
    fn a_charge_goes_into_debt_and_the_check_waits_until_it_is_repaid() {
        let p = BucketParams {
            capacity: 1000,
            tokens_per_unit: 1000,
            unit_secs: 60,
            max_debt: None,
            algorithm: Default::default(),
            period: None,
        };
        let (s, o) = one(p, None, SEC, Cost::Check);
        assert!(o.admitted);
        let (s, o) = one(p, Some(s), SEC, Cost::Charge(600));
        assert!(o.admitted);
        assert_eq!((o.remaining, o.taken, s.tokens), (400, 600, 400.0));
        let (s, o) = one(p, Some(s), SEC, Cost::Check);
        assert!(o.admitted, "400 left: the next chat may start");
        // it used 600 of the 400 left: charged all the same
        let (s, o) = one(p, Some(s), SEC, Cost::Charge(600));
        assert!(!o.admitted);
        assert_eq!((o.remaining, o.taken, s.tokens), (0, 600, -200.0));
        assert_eq!(o.retry_after_secs, Some(48), "800 to go at 1000/min");
        // the next chat waits until the debt is repaid and a token is back
        let (s, o) = one(p, Some(s), SEC, Cost::Check);
        assert!(!o.admitted);
        assert_eq!(o.retry_after_secs, Some(13), "201 tokens at 16.7/s");
        assert_eq!(o.full_in_secs, 72, "1200 to go");
        let (_, o) = one(p, Some(s), 14 * SEC, Cost::Check);
        assert!(o.admitted, "repaid 13 s later");
        // the debt stops at minus the burst
        let (s, o) = one(p, Some(s), SEC, Cost::Charge(5000));
        assert_eq!((s.tokens, o.taken), (-1000.0, 5000));
        assert_eq!(o.never, Some(NeverReason::CostAboveCapacity));
        // a plain spend never goes into debt
        let (s2, o) = one(p, Some(s), SEC, Cost::Spend(1));
        assert!(!o.admitted);
        assert_eq!((s2.tokens, o.taken), (-1000.0, 0));
        // a refund repays part of a debt, and no more
        let (s3, o) = one(p, Some(s), SEC, Cost::Refund(150));
        assert!(o.admitted);
        assert_eq!(s3.tokens, -850.0);
    }

    /// A reload lowered B from 100 to 10 while the bucket owed 98: the next
    /// charge adds to the debt instead of forgiving all of it below -10.
    #[test]
    fn a_charge_never_raises_a_balance_below_minus_the_burst() {
        let lowered = BucketParams {
            capacity: 10,
            tokens_per_unit: 10,
            unit_secs: 60,
            max_debt: None,
            algorithm: Default::default(),
            period: None,
        };
        let owing = BucketState {
            tokens: -98.0,
            updated_micros: SEC,
        };
        let (s, o) = one(lowered, Some(owing), SEC, Cost::Charge(1));
        assert!(!o.admitted);
        assert_eq!(s.tokens, -98.0, "not forgiven down to -10");
        assert_eq!(o.taken, 1);
        let (s, _) = one(lowered, Some(s), SEC, Cost::Refund(5));
        assert_eq!(s.tokens, -93.0, "a refund still repays");
    }

    #[test]
    fn new_bucket_starts_full_and_spends() {
        let (s, o) = one(per_second(10, 1), None, SEC, Cost::Spend(3));
        assert!(o.admitted);
        assert_eq!(o.remaining, 7);
        assert_eq!(s.tokens, 7.0);
        assert_eq!(o.full_in_secs, 3);
    }

    #[test]
    fn a_lease_takes_what_is_there_up_to_its_size() {
        let lease = |needed, up_to| Cost::Lease { needed, up_to };
        let p = per_second(100, 10);
        let (s, o) = one(p, None, SEC, lease(1, 30));
        assert!(o.admitted);
        assert_eq!((o.taken, o.remaining, s.tokens), (30, 70, 70.0));
        let low = Some(BucketState {
            tokens: 4.5,
            updated_micros: SEC,
        });
        let (s, o) = one(p, low, SEC, lease(1, 30));
        assert_eq!((o.taken, o.remaining), (4, 0));
        assert!((s.tokens - 0.5).abs() < 1e-9, "the fraction stays");
        let (_, o) = one(p, low, SEC, lease(5, 30));
        assert!(!o.admitted);
        assert_eq!((o.taken, o.retry_after_secs), (0, Some(1)));
        // spending reports what it took; checks and refunds take nothing
        assert_eq!(one(p, None, SEC, Cost::Spend(3)).1.taken, 3);
        assert_eq!(one(p, None, SEC, Cost::Check).1.taken, 0);
        assert_eq!(one(p, low, SEC, Cost::Refund(2)).1.taken, 0);
    }

    #[test]
    fn drains_then_rejects_with_retry_after() {
        let p = per_second(5, 2);
        let mut state = None;
        for i in 0..5 {
            let (s, o) = one(p, state, SEC, Cost::Spend(1));
            assert!(o.admitted, "request {i}");
            state = Some(s);
        }
        let (_, o) = one(p, state, SEC, Cost::Spend(1));
        assert!(!o.admitted);
        assert_eq!(o.remaining, 0);
        // one token at 2/s takes 0.5 s: rounded up to whole seconds
        assert_eq!(o.retry_after_secs, Some(1));
        let (_, o) = one(p, state, SEC, Cost::Spend(5));
        assert_eq!(o.retry_after_secs, Some(3)); // 5 tokens at 2/s = 2.5 s
    }

    #[test]
    fn refill_is_capped_at_capacity() {
        let p = per_second(10, 100);
        let start = Some(BucketState {
            tokens: 0.0,
            updated_micros: SEC,
        });
        let s = p.refill(start, SEC + 60 * SEC);
        assert_eq!(s.tokens, 10.0);
        let s = p.refill(start, SEC + SEC / 20); // 50 ms at 100/s
        assert!((s.tokens - 5.0).abs() < 1e-9);
    }

    #[test]
    fn fractional_tokens_accumulate() {
        let p = per_second(1, 10);
        let empty = Some(BucketState {
            tokens: 0.0,
            updated_micros: 0,
        });
        let (_, o) = one(p, empty, SEC / 20, Cost::Spend(1));
        assert!(!o.admitted, "0.5 token is not enough");
        let (_, o) = one(p, empty, SEC / 10, Cost::Spend(1));
        assert!(o.admitted, "0.1 s at 10/s is exactly one token");
    }

    #[test]
    fn cost_above_capacity_is_never_admitted() {
        let (s, o) = one(per_second(5, 5), None, SEC, Cost::Spend(6));
        assert!(!o.admitted);
        assert_eq!(o.retry_after_secs, None);
        assert_eq!(o.never, Some(NeverReason::CostAboveCapacity));
        assert_eq!(s.tokens, 5.0, "nothing deducted");
        assert_eq!(o.remaining, 5);
    }

    #[test]
    fn zero_rate_rejects_everything_without_retry() {
        let p = BucketParams {
            capacity: 0,
            tokens_per_unit: 0,
            unit_secs: 1,
            max_debt: None,
            algorithm: Default::default(),
            period: None,
        };
        let (_, o) = one(p, None, SEC, Cost::Spend(1));
        assert!(!o.admitted);
        assert_eq!(o.retry_after_secs, None);
        assert_eq!(o.never, Some(NeverReason::ZeroRate));
        let with_burst = BucketParams { capacity: 10, ..p };
        let (_, o) = one(with_burst, None, SEC, Cost::Spend(1));
        assert!(!o.admitted, "r = 0 rejects even with a burst");
        assert_eq!(o.remaining, 0);
    }

    #[test]
    fn time_going_backwards_adds_nothing() {
        let p = per_second(10, 10);
        let state = Some(BucketState {
            tokens: 2.0,
            updated_micros: 100 * SEC,
        });
        let s = p.refill(state, 50 * SEC);
        assert_eq!(s.tokens, 2.0);
        assert_eq!(s.updated_micros, 100 * SEC, "timestamp never moves back");
        // and the refill afterwards counts from the later time only
        let s = p.refill(Some(s), 100 * SEC + SEC / 10);
        assert!((s.tokens - 3.0).abs() < 1e-9);
    }

    #[test]
    fn check_deducts_nothing_but_answers() {
        let p = per_second(2, 1);
        let (s, o) = one(p, None, SEC, Cost::Check);
        assert!(o.admitted);
        assert_eq!(s.tokens, 2.0);
        let empty = Some(BucketState {
            tokens: 0.2,
            updated_micros: SEC,
        });
        let (_, o) = one(p, empty, SEC, Cost::Check);
        assert!(!o.admitted);
        assert_eq!(o.retry_after_secs, Some(1));
    }

    #[test]
    fn several_buckets_all_or_nothing() {
        let burst = per_second(5, 5);
        let hourly = BucketParams {
            capacity: 2,
            tokens_per_unit: 2,
            unit_secs: 3600,
            max_debt: None,
            algorithm: Default::default(),
            period: None,
        };
        let params = [burst, hourly];
        let (states, outcomes) = decide(&params, &[None, None], SEC, Cost::Spend(2));
        assert!(outcomes.iter().all(|o| o.admitted));
        let stored: Vec<_> = states.into_iter().map(Some).collect();
        let (after, outcomes) = decide(&params, &stored, SEC, Cost::Spend(1));
        assert!(outcomes.iter().all(|o| !o.admitted), "hourly is empty");
        assert_eq!(after[0].tokens, 3.0, "the burst bucket was not charged");
        assert_eq!(outcomes[1].retry_after_secs, Some(1800));
        assert_eq!(outcomes[0].retry_after_secs, None, "burst bucket had room");
    }

    #[test]
    fn refunds_add_tokens_up_to_the_capacity() {
        let p = per_second(10, 1);
        let spent = Some(BucketState {
            tokens: 3.0,
            updated_micros: SEC,
        });
        let (s, o) = one(p, spent, SEC, Cost::Refund(4));
        assert!(o.admitted);
        assert_eq!((s.tokens, o.remaining), (7.0, 7));
        let (s, _) = one(p, spent, SEC, Cost::Refund(50));
        assert_eq!(s.tokens, 10.0, "never above B");
        let (s, o) = one(p, None, SEC, Cost::Refund(5));
        assert_eq!(
            (s.tokens, o.remaining),
            (10.0, 10),
            "a missing bucket is already full"
        );
    }

    /// A refund is answered OK on a `requests_per_unit: 0` rule too (it
    /// was OVER_LIMIT): nothing refills there, so nothing changes.
    #[test]
    fn a_refund_on_a_rule_of_rate_0_is_answered_ok() {
        let zero = BucketParams {
            capacity: 0,
            tokens_per_unit: 0,
            unit_secs: 1,
            max_debt: None,
            algorithm: Default::default(),
            period: None,
        };
        let (_, o) = one(zero, None, SEC, Cost::Refund(3));
        assert!(o.admitted);
        assert_eq!((o.never, o.retry_after_secs), (None, None));
        let (_, o) = one(zero, None, SEC, Cost::Spend(1));
        assert_eq!(o.never, Some(NeverReason::ZeroRate));
    }

    #[test]
    fn full_at_tells_when_a_bucket_can_be_forgotten() {
        let p = per_second(10, 2);
        let s = BucketState {
            tokens: 4.0,
            updated_micros: SEC,
        };
        assert_eq!(p.full_at_micros(&s), Some(4 * SEC));
        let zero = BucketParams {
            tokens_per_unit: 0,
            ..p
        };
        assert_eq!(zero.full_at_micros(&s), None);
    }

    #[test]
    fn long_units_use_exact_lengths() {
        let yearly = BucketParams {
            capacity: 365,
            tokens_per_unit: 365,
            unit_secs: 365 * 86_400,
            max_debt: None,
            algorithm: Default::default(),
            period: None,
        };
        let empty = Some(BucketState {
            tokens: 0.0,
            updated_micros: 0,
        });
        let s = yearly.refill(empty, 86_400 * SEC);
        assert!((s.tokens - 1.0).abs() < 1e-9, "one day refills one token");
    }
}
