//! Whether this replica assigns RLQS buckets without the shared ledger (its
//! steps fail), said where an operator looks: a warning when it starts and
//! at most once a [`LOG_EVERY`] while it lasts, a line when it ends, and a
//! sentence for `/readyz`'s body. The metrics are counted beside it
//! (`rls_quota_buckets_without_ledger`,
//! `rls_quota_assignments_without_ledger_total`). Pure: every call takes
//! the time.

use parking_lot::Mutex;

/// The warning is repeated at most this often while the trouble lasts.
pub const LOG_EVERY_MICROS: u64 = 30_000_000;

#[derive(Debug, Default)]
struct State {
    /// Since when buckets have been assigned without the ledger.
    since: Option<u64>,
    /// How many now.
    buckets: usize,
    /// The last step's error.
    error: String,
    /// When the warning was last written.
    logged: Option<u64>,
}

/// What [`LedgerWatch::now_without`] asks its caller to log.
#[derive(Debug, Clone, PartialEq)]
pub enum Say {
    Nothing,
    /// Buckets are assigned without the ledger (for this many seconds).
    Without {
        buckets: usize,
        secs: u64,
        error: String,
    },
    /// The ledger answers again, after this many seconds without it.
    Back {
        secs: u64,
    },
}

#[derive(Debug, Default)]
pub struct LedgerWatch {
    state: Mutex<State>,
}

impl LedgerWatch {
    /// A step failed with `error`.
    pub fn failed(&self, error: &str) {
        let mut state = self.state.lock();
        if state.error != error {
            state.error = error.to_owned();
        }
    }

    /// After a batch of answers: `buckets` are assigned without the ledger
    /// now. What to log, if anything.
    pub fn now_without(&self, buckets: usize, now_micros: u64) -> Say {
        let mut state = self.state.lock();
        state.buckets = buckets;
        if buckets == 0 {
            state.logged = None;
            return match state.since.take() {
                Some(since) => Say::Back {
                    secs: now_micros.saturating_sub(since) / 1_000_000,
                },
                None => Say::Nothing,
            };
        }
        let since = *state.since.get_or_insert(now_micros);
        let due = state
            .logged
            .is_none_or(|t| now_micros.saturating_sub(t) >= LOG_EVERY_MICROS);
        if !due {
            return Say::Nothing;
        }
        state.logged = Some(now_micros);
        Say::Without {
            buckets,
            secs: now_micros.saturating_sub(since) / 1_000_000,
            error: state.error.clone(),
        }
    }

    /// A sentence for `/readyz` while buckets are assigned without the
    /// ledger.
    pub fn describe(&self, now_micros: u64) -> Option<String> {
        let state = self.state.lock();
        let since = state.since?;
        Some(format!(
            "RLQS: {} bucket(s) assigned without the shared ledger for {} s (its steps fail: {}); each from this replica's last confirmed share, then the budget divided by the replicas known",
            state.buckets,
            now_micros.saturating_sub(since) / 1_000_000,
            state.error
        ))
    }
}

impl Say {
    /// Writes the log line this calls for.
    pub fn log(&self) {
        match self {
            Say::Nothing => {}
            Say::Without {
                buckets,
                secs,
                error,
            } => tracing::warn!(
                buckets,
                for_secs = secs,
                error = %error,
                "RLQS: assigning buckets without the shared ledger (its steps fail): each from this replica's last confirmed share while the ledger keeps it reserved, then the budget divided by the replicas known (docs/rlqs.md)"
            ),
            Say::Back { secs } => tracing::info!(
                after_secs = secs,
                "RLQS: the shared ledger answers again; every bucket is assigned from it"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000;

    #[test]
    fn says_it_once_then_every_thirty_seconds_then_that_it_is_over() {
        let watch = LedgerWatch::default();
        assert_eq!(watch.now_without(0, 0), Say::Nothing);
        assert_eq!(watch.describe(0), None);
        watch.failed("store call timed out");
        assert_eq!(
            watch.now_without(3, 10 * SEC),
            Say::Without {
                buckets: 3,
                secs: 0,
                error: "store call timed out".into()
            }
        );
        for t in 11..40 {
            assert_eq!(watch.now_without(3, t * SEC), Say::Nothing, "at {t} s");
        }
        assert!(matches!(
            watch.now_without(2, 40 * SEC),
            Say::Without {
                buckets: 2,
                secs: 30,
                ..
            }
        ));
        let said = watch.describe(45 * SEC).expect("in trouble");
        assert!(
            said.contains("2 bucket(s)") && said.contains("for 35 s") && said.contains("timed out"),
            "{said}"
        );
        assert_eq!(watch.now_without(0, 50 * SEC), Say::Back { secs: 40 });
        assert_eq!(watch.describe(51 * SEC), None);
        assert_eq!(watch.now_without(0, 52 * SEC), Say::Nothing);
        // a new spell is said at once
        assert!(matches!(
            watch.now_without(1, 60 * SEC),
            Say::Without { secs: 0, .. }
        ));
    }
}
