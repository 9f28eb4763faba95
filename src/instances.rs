//! How many instances of the service share the store: the `local` failure
//! mode gives each 1/N of a budget, and RLQS without a shared ledger splits
//! 1/N. Given by `--instances`, or counted by the instances themselves in
//! the Redis store (each announces itself with a time to live; the last
//! count is kept while the store does not answer). A leaf: one number,
//! shared by whoever reads it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often an instance announces itself in the Redis store.
pub const ANNOUNCE_EVERY: Duration = Duration::from_secs(2);
/// How long an announcement counts: an instance that stopped (or cannot
/// reach the store) drops out of the count this long after its last one.
pub const ANNOUNCE_TTL: Duration = Duration::from_secs(10);

/// The most instances a count read from Redis may say: anyone who can
/// write to that Redis can add members to the set, and a count of a
/// million would cut every `local` share to nothing. A count above this is
/// refused (the last count stands), counted and logged.
pub const MAX_COUNTED_INSTANCES: u32 = 1024;

/// A count read back from the store, if it is one this service could have
/// written ([`MAX_COUNTED_INSTANCES`] at most). Pure.
pub fn plausible(n: u32) -> Option<u32> {
    (n <= MAX_COUNTED_INSTANCES).then_some(n.max(1))
}

/// The number of instances, read where a share is computed; cheap to clone
/// (every clone reads the same number).
#[derive(Debug, Clone)]
pub struct Instances {
    count: Arc<AtomicU32>,
}

impl Instances {
    /// `n` instances (at least 1).
    pub fn new(n: u32) -> Self {
        Self {
            count: Arc::new(AtomicU32::new(n.max(1))),
        }
    }

    /// The number now (at least 1).
    pub fn get(&self) -> u32 {
        self.count.load(Ordering::Relaxed).max(1)
    }

    /// Sets the number (at least 1); returns the one it replaces.
    pub fn set(&self, n: u32) -> u32 {
        self.count.swap(n.max(1), Ordering::Relaxed)
    }
}

impl Default for Instances {
    /// One: this instance alone.
    fn default() -> Self {
        Self::new(1)
    }
}

impl From<u32> for Instances {
    fn from(n: u32) -> Self {
        Self::new(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_past_any_fleet_is_refused() {
        assert_eq!(plausible(0), Some(1));
        assert_eq!(plausible(3), Some(3));
        assert_eq!(
            plausible(MAX_COUNTED_INSTANCES),
            Some(MAX_COUNTED_INSTANCES)
        );
        assert_eq!(plausible(1_000_000), None);
    }

    #[test]
    fn every_clone_reads_the_count_and_it_is_never_zero() {
        let a = Instances::new(3);
        let b = a.clone();
        assert_eq!(b.get(), 3);
        assert_eq!(a.set(5), 3);
        assert_eq!(b.get(), 5);
        a.set(0);
        assert_eq!(b.get(), 1);
        assert_eq!(Instances::from(0).get(), 1);
    }
}
