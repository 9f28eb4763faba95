//! Time sources for the token buckets.
//!
//! Bucket math never reads a clock itself: callers pass "now" in microseconds.
//! The memory store uses a [`MonotonicClock`] so that wall-clock jumps (NTP,
//! a VM resumed from suspend) neither mint nor destroy tokens; tests use a
//! [`ManualClock`] they move by hand.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses nothing of the crate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A source of "now" in microseconds since an arbitrary, fixed origin.
pub trait Clock: Send + Sync + 'static {
    fn now_micros(&self) -> u64;
}

/// Monotonic time since the clock was created.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_micros(&self) -> u64 {
        // Offset by one hour so that "0" never means "the origin": a bucket
        // created at start-up has a real timestamp like any other.
        self.origin.elapsed().as_micros() as u64 + 3_600_000_000
    }
}

/// A clock that only moves when told to; for tests.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    pub fn new(start_micros: u64) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start_micros)),
        }
    }

    pub fn advance_micros(&self, micros: u64) {
        self.now.fetch_add(micros, Ordering::SeqCst);
    }

    pub fn advance_secs_f64(&self, secs: f64) {
        self.advance_micros((secs * 1e6).round() as u64);
    }

    /// Sets the time, also backwards (to test that going back adds nothing).
    pub fn set_micros(&self, micros: u64) {
        self.now.store(micros, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_micros(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}
