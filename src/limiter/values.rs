//! Which descriptors of a `max_values` rule have buckets of their own.
//!
//! A rule with a key and no value makes one bucket per distinct value, and
//! values come from requests. `max_values: N` bounds that: the first N
//! distinct descriptors of the rule (their tags: every entry's value) have
//! their own buckets; while N are held, a new one is decided by the rule's
//! single overflow bucket, with the rule's own numbers, so all unknown
//! values together get one client's budget. A descriptor is held while it
//! has requests: one idle for longer than its buckets take to fill from
//! empty is let go (its buckets are full again by then, and forgotten), so
//! its place goes to the next new value. Pure, with the time passed in; the
//! limiter keeps one [`RuleValues`] per rule under a lock.

use std::collections::HashMap;

/// Sweeps for idle descriptors at most this often (µs): a rule held full by
/// live values does not pay a scan per request.
const SWEEP_EVERY_MICROS: u64 = 100_000;

/// The descriptors of one rule that have buckets of their own.
#[derive(Debug, Default)]
pub struct RuleValues {
    /// tag → time of its last request (µs)
    held: HashMap<Box<[u8]>, u64>,
    last_sweep: u64,
}

impl RuleValues {
    /// Whether the descriptor `tag` is decided by buckets of its own: it is
    /// held already, or fewer than `max` are (then it is held from now on).
    /// A descriptor with no request for `idle_micros` is let go.
    pub fn admit(&mut self, tag: &[u8], max: usize, idle_micros: u64, now: u64) -> bool {
        if let Some(last) = self.held.get_mut(tag) {
            *last = now;
            return true;
        }
        if self.held.len() >= max && now.saturating_sub(self.last_sweep) >= SWEEP_EVERY_MICROS {
            self.last_sweep = now;
            self.held
                .retain(|_, last| now.saturating_sub(*last) <= idle_micros);
        }
        if self.held.len() < max {
            self.held.insert(tag.into(), now);
            return true;
        }
        false
    }

    /// Descriptors held now.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000;

    #[test]
    fn the_first_n_are_held_and_the_rest_overflow() {
        let mut v = RuleValues::default();
        for tag in [b"a", b"b", b"c"] {
            assert!(v.admit(tag, 3, 10 * SEC, SEC));
        }
        assert!(!v.admit(b"d", 3, 10 * SEC, SEC));
        assert!(!v.admit(b"e", 3, 10 * SEC, 2 * SEC));
        assert!(v.admit(b"a", 3, 10 * SEC, 2 * SEC), "held ones keep theirs");
        assert_eq!(v.len(), 3);
    }

    #[test]
    fn an_idle_one_is_let_go_and_its_place_taken() {
        let mut v = RuleValues::default();
        assert!(v.admit(b"a", 2, 10 * SEC, SEC));
        assert!(v.admit(b"b", 2, 10 * SEC, SEC));
        assert!(v.admit(b"a", 2, 10 * SEC, 5 * SEC), "a active at 5 s");
        assert!(
            !v.admit(b"c", 2, 10 * SEC, 11 * SEC),
            "b idle 10 s: not yet"
        );
        assert!(v.admit(b"c", 2, 10 * SEC, 12 * SEC), "b idle 11 s: let go");
        assert!(v.admit(b"a", 2, 10 * SEC, 12 * SEC), "a is still held");
        assert!(
            !v.admit(b"b", 2, 10 * SEC, 12 * SEC),
            "b is new now, and full"
        );
    }

    #[test]
    fn a_full_rule_sweeps_at_most_every_100_ms() {
        let mut v = RuleValues::default();
        assert!(v.admit(b"a", 1, SEC, 0));
        assert!(!v.admit(b"b", 1, SEC, SEC), "a not idle long enough");
        // a is idle past its time 1 µs later, but the last sweep was just now
        assert!(!v.admit(b"b", 1, SEC, SEC + 1));
        assert!(v.admit(b"b", 1, SEC, SEC + SWEEP_EVERY_MICROS));
    }
}
