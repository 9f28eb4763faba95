//! Sliding windows: the weighted two-window counter, as pure functions of
//! (parameters, state, now, cost), beside the fixed window's
//! ([`super`]); when it counts nothing any more is
//! [`BucketParams::full_at_micros`]'s.
//!
//! A rule with `algorithm: sliding_window` allows `requests_per_unit` hits
//! in any window of `unit × unit_multiplier` seconds, estimated from two
//! windows aligned to the Unix epoch as a fixed window's are: the count of
//! the window now running, plus the count of the one before weighted by the
//! part of it that a window ending now still covers:
//! `estimate = previous × (1 − elapsed / length) + current`. A hit of cost
//! `c` is admitted when `estimate + c ≤ limit` and then counts in the
//! current window; a refused hit counts nothing (so that a client that
//! keeps asking is let in again at the rate, not locked out). Unlike a fixed
//! window, a full window just ended weighs on the next: no burst of twice
//! the limit across an edge.
//!
//! - A refusal waits until the estimate has room for the hit: while the
//!   window before's weight falls (when the current count leaves room),
//!   else into the next window, where this one's count is the one before.
//! - `duration_until_reset` (the wait until the estimate is 0): to the end
//!   of the next window when this one counted anything, to the end of this
//!   one when only the one before did, else 0.
//! - A check (`hits_addend: 0`) answers as a hit of one would and counts
//!   nothing; a refund (`is_negative_hits`) takes hits off the current
//!   window's count, never below 0, an attempt's give-back
//!   ([`Cost::GiveBack`]) only when the current window counted it; a
//!   charge (`overdraft`) counts whatever the verdict (not on a limit of
//!   0), at most [`MAX_WINDOW_COUNT`].
//! - A clock stepped back into an earlier window (a new Redis primary
//!   whose clock is behind) reads the stored windows as they were at their
//!   start: nothing ages, nothing is forgotten.
//!
//! A bucket's state is [`BucketState`]'s two fields: `updated_micros` the
//! current window's start, `tokens` both counts in one number
//! ([`BucketState::sliding_window`]: exact in a float, as a limit is at
//! most [`crate::bucket::MAX_WINDOW_COUNT`], checked at validation). `store/redis/bucket.lua` has the
//! Lua copy (flag 16), checked row by row against this one by
//! `tests/bucket_cases.rs`.

use crate::bucket::{
    whole_tokens, BucketOutcome, BucketParams, BucketState, Cost, NeverReason, EPSILON,
    MAX_WINDOW_COUNT,
};

const MICROS: u64 = 1_000_000;

/// A bucket's two windows as they stand at a moment.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Windows {
    /// The current window's start (µs).
    start: u64,
    /// The moment they are read at: now, or the start of a stored window
    /// later than now (a clock stepped back).
    at: u64,
    /// The count of the window before.
    previous: f64,
    /// The count of the current window.
    current: f64,
}

/// The window's length in µs (at least a second).
fn length_micros(params: &BucketParams) -> u64 {
    params.unit_secs.max(1) * MICROS
}

impl Windows {
    /// The windows of a bucket in `state` at `now_micros`.
    fn of(params: &BucketParams, state: Option<BucketState>, now_micros: u64) -> Self {
        let length = params.unit_secs.max(1);
        let now_secs = now_micros / MICROS;
        let start = (now_secs - now_secs % length) * MICROS;
        let fresh = Windows {
            start,
            at: now_micros,
            previous: 0.0,
            current: 0.0,
        };
        let Some(s) = state else {
            return fresh;
        };
        let (previous, current) = s.window_counts();
        if s.updated_micros == start {
            Windows {
                previous,
                current,
                ..fresh
            }
        } else if s.updated_micros.saturating_add(length_micros(params)) == start {
            Windows {
                previous: current,
                ..fresh
            }
        } else if s.updated_micros > start {
            Windows {
                start: s.updated_micros,
                at: s.updated_micros,
                previous,
                current,
            }
        } else {
            fresh
        }
    }

    /// The share of the current window gone by, in [0, 1).
    fn elapsed(&self, params: &BucketParams) -> f64 {
        (self.at - self.start) as f64 / length_micros(params) as f64
    }

    /// The hits counted over the window that ends now.
    fn estimate(&self, params: &BucketParams) -> f64 {
        self.previous * (1.0 - self.elapsed(params)) + self.current
    }

    /// The state to store.
    fn state(&self) -> BucketState {
        BucketState::sliding_window(self.previous, self.current, self.start)
    }

    /// Whole seconds until a hit of `needed` fits, for one that does not
    /// now (`needed` ≤ the limit).
    fn wait_secs(&self, params: &BucketParams, needed: f64) -> u64 {
        let limit = params.tokens_per_unit as f64;
        let length = length_micros(params) as f64;
        let until = if self.current + needed <= limit + EPSILON {
            // the window before's weight falls until it leaves room
            self.start as f64 + (1.0 - (limit - self.current - needed) / self.previous) * length
        } else {
            // in the next window this one's count is the one before
            self.start as f64 + length + (1.0 - (limit - needed) / self.current) * length
        };
        let secs = ((until - self.at as f64) / 1e6 - EPSILON).ceil();
        secs.max(1.0) as u64
    }

    /// Whole seconds until the estimate is 0.
    fn empty_in_secs(&self, params: &BucketParams) -> u64 {
        let length = length_micros(params);
        let end = if self.current > 0.0 {
            self.start + 2 * length
        } else if self.previous > 0.0 {
            self.start + length
        } else {
            return 0;
        };
        (end - self.at).div_ceil(MICROS)
    }
}

/// Decides `cost` against sliding-window buckets; returns the states to
/// store (changed only when admitted) and one outcome per bucket.
pub fn decide(
    params: &[BucketParams],
    states: &[Option<BucketState>],
    now_micros: u64,
    cost: Cost,
) -> (Vec<BucketState>, Vec<BucketOutcome>) {
    let needed = cost.needed() as f64;
    // what an admitted call adds to the current count (a lease is refused
    // at validation; a charge counts what it needs)
    let counted = match cost {
        Cost::Refund(_) | Cost::GiveBack { .. } => cost.deducted() as f64,
        Cost::Check => 0.0,
        _ => needed,
    };
    let mut windows: Vec<Windows> = params
        .iter()
        .zip(states)
        .map(|(p, s)| Windows::of(p, *s, now_micros))
        .collect();
    let verdicts: Vec<Result<(), Option<NeverReason>>> = params
        .iter()
        .zip(&windows)
        .map(|(p, w)| {
            if needed == 0.0 && counted <= 0.0 {
                // a refund (or a hit of nothing) is answered OK whatever the rule
                Ok(())
            } else if p.tokens_per_unit == 0 {
                Err(Some(NeverReason::ZeroRate))
            } else if needed > p.tokens_per_unit as f64 {
                Err(Some(NeverReason::CostAboveCapacity))
            } else if w.estimate(p) + needed <= p.tokens_per_unit as f64 + EPSILON {
                Ok(())
            } else {
                Err(None)
            }
        })
        .collect();
    let admitted = verdicts.iter().all(Result::is_ok);
    // a charge (`overdraft`) counts whatever the verdict, except where
    // nothing could ever be admitted (a limit of 0)
    let charge =
        matches!(cost, Cost::Charge(_)) && !verdicts.contains(&Err(Some(NeverReason::ZeroRate)));
    if admitted || charge {
        for (w, p) in windows.iter_mut().zip(params) {
            // an attempt's give-back only to the window that counted it
            let end = w.start + length_micros(p);
            if counted >= 0.0 || cost.gives_back_to(w.start, end) {
                w.current = (w.current + counted).clamp(0.0, MAX_WINDOW_COUNT as f64);
            }
        }
    }
    let outcomes = params
        .iter()
        .zip(&windows)
        .zip(&verdicts)
        .map(|((p, w), verdict)| {
            let (retry_after_secs, never) = match verdict {
                Ok(()) => (None, None),
                Err(Some(reason)) => (None, Some(*reason)),
                Err(None) => (Some(w.wait_secs(p, needed)), None),
            };
            BucketOutcome {
                admitted,
                remaining: whole_tokens(p.tokens_per_unit as f64 - w.estimate(p)),
                retry_after_secs,
                full_in_secs: w.empty_in_secs(p),
                never,
                taken: if admitted || charge {
                    counted.max(0.0) as u64
                } else {
                    0
                },
                forgiven: 0,
                window_count: None,
            }
        })
        .collect();
    (windows.iter().map(Windows::state).collect(), outcomes)
}

#[cfg(test)]
mod tests;
