//! Time sources for the token buckets.
//!
//! Bucket math never reads a clock itself: callers pass "now" in microseconds.
//! The memory store uses a [`MonotonicClock`] so that wall-clock jumps (NTP,
//! a VM resumed from suspend) neither mint nor destroy tokens; it reads Unix
//! time once, when made, and counts monotonic time from there, so that fixed
//! windows are aligned to the epoch as Redis's `TIME` aligns them. Tests use
//! a [`ManualClock`] they move by hand.
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

/// Unix time when the clock was created, plus the monotonic time since.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    origin: Instant,
    /// Unix time at `origin`, in µs.
    origin_unix_micros: u64,
}

impl MonotonicClock {
    pub fn new() -> Self {
        let unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        Self {
            origin: Instant::now(),
            // never near "0": a bucket made at start has a real timestamp
            origin_unix_micros: unix.max(3_600_000_000),
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
        self.origin.elapsed().as_micros() as u64 + self.origin_unix_micros
    }
}

/// Unix time now, in milliseconds (the wall clock: for what lives in wall
/// time, such as a retired rule's records).
pub fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
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
