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
//!
//! **Cost.** While a rule is full, each new value looks at the next
//! [`SWEEP_STEP`] held ones (a cursor going round them) and lets the idle
//! ones go: constant work per request, never a pass over every held value
//! under the lock (that pass took 2.2 ms at 1,000,000 held values, every
//! 100 ms of a flood). A flood sweeps the whole set within
//! `held / SWEEP_STEP` new values; an idle value's place is free by then.

use indexmap::IndexMap;

/// Held descriptors one new value looks at while the rule is full.
pub const SWEEP_STEP: usize = 64;

/// The descriptors of one rule that have buckets of their own.
#[derive(Debug, Default)]
pub struct RuleValues {
    /// tag → time of its last request (µs), in an order the sweep walks.
    held: IndexMap<Box<[u8]>, u64>,
    /// Where the sweep goes on.
    cursor: usize,
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
        if self.held.len() >= max {
            self.sweep(idle_micros, now);
        }
        if self.held.len() < max {
            self.held.insert(tag.into(), now);
            return true;
        }
        false
    }

    /// Looks at the next [`SWEEP_STEP`] held descriptors, letting the idle
    /// ones go.
    fn sweep(&mut self, idle_micros: u64, now: u64) {
        for _ in 0..SWEEP_STEP {
            if self.cursor >= self.held.len() {
                if self.held.is_empty() {
                    return;
                }
                self.cursor = 0;
            }
            let idle = self
                .held
                .get_index(self.cursor)
                .is_some_and(|(_, last)| now.saturating_sub(*last) > idle_micros);
            if idle {
                // the last one moves here: looked at next
                self.held.swap_remove_index(self.cursor);
            } else {
                self.cursor += 1;
            }
        }
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
    fn a_new_value_against_a_full_rule_looks_at_a_few_held_ones() {
        let max = 4 * SWEEP_STEP;
        let mut v = RuleValues::default();
        for i in 0..max {
            assert!(v.admit(format!("{i}").as_bytes(), max, SEC, 0));
        }
        // all idle at 2 s; the first new value frees SWEEP_STEP of them
        // (and takes one of those places), not all
        assert!(v.admit(b"new-0", max, SEC, 2 * SEC));
        assert_eq!(v.len(), max - SWEEP_STEP + 1);
        // one kept busy is never let go, however often the sweep passes
        let mut v = RuleValues::default();
        assert!(v.admit(b"busy", 2, SEC, 0));
        assert!(v.admit(b"idle", 2, SEC, 0));
        for t in 1..=100 {
            assert!(v.admit(b"busy", 2, SEC, t * SEC / 10));
            let _ = v.admit(format!("new-{t}").as_bytes(), 2, SEC, t * SEC / 10);
        }
        assert!(v.admit(b"busy", 2, SEC, 11 * SEC), "held all along");
    }
}

#[cfg(test)]
mod measure {
    use super::*;

    /// `cargo test --release --lib limiter::values::measure -- --ignored --nocapture`:
    /// a full rule of 1,000,000 held values and a flood of new ones.
    #[test]
    #[ignore]
    fn a_flood_against_a_full_rule() {
        const MAX: usize = 1_000_000;
        const IDLE: u64 = 3_600_000_000;
        let mut v = RuleValues::default();
        for i in 0..MAX {
            v.admit(format!("held-{i}").as_bytes(), MAX, IDLE, 1);
        }
        let tags: Vec<Vec<u8>> = (0..200_000)
            .map(|i| format!("new-{i}").into_bytes())
            .collect();
        let mut worst = std::time::Duration::ZERO;
        let started = std::time::Instant::now();
        // 200,000 new values over 10 s of clock (20,000 a second)
        for (i, tag) in tags.iter().enumerate() {
            let t = std::time::Instant::now();
            v.admit(tag, MAX, IDLE, 2 + i as u64 * 50);
            worst = worst.max(t.elapsed());
        }
        let total = started.elapsed();
        eprintln!(
            "200000 new values against 1000000 held: {:.0} ns per admit, worst {:?}",
            total.as_nanos() as f64 / 200_000.0,
            worst
        );
    }
}
