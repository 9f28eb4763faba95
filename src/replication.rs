//! A rule's `replication:` (Redis store): an admission is answered only once
//! this many replicas of the primary hold it (`WAIT` after the decision, on
//! its connection), so that a promotion loses none. A leaf: the rules
//! compile it, the stores honour it, the limiter carries it between.

use std::time::Duration;

/// `replication: {replicas: 2, timeout: 50ms}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Replication {
    /// Replicas that must hold the decision's writes before an admission
    /// is answered.
    pub replicas: u32,
    /// How long the primary waits for them; then the rule's failure mode
    /// answers.
    #[serde(serialize_with = "as_humantime")]
    pub timeout: Duration,
}

/// The most replicas a rule may ask for (Redis counts them in an int; a
/// set with more replicas than this is not one we were shown).
pub const MAX_REPLICAS: u32 = 16;
/// The longest `timeout`: a decision waits for it on a request's path.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1);

impl Replication {
    /// Whether a decision's writes, acknowledged by `acked` replicas, may be
    /// answered as an admission.
    pub fn holds(&self, acked: i64) -> bool {
        acked >= i64::from(self.replicas)
    }

    /// The `WAIT` timeout, in whole milliseconds (at least 1: `WAIT n 0`
    /// would wait for ever).
    pub fn timeout_ms(&self) -> u64 {
        u64::try_from(self.timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

fn as_humantime<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_duration(*d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_admission_holds_once_enough_replicas_acknowledged() {
        let r = Replication {
            replicas: 2,
            timeout: Duration::from_millis(50),
        };
        assert!(!r.holds(0));
        assert!(!r.holds(1));
        assert!(r.holds(2));
        assert!(r.holds(3));
        assert!(!r.holds(-1));
    }

    #[test]
    fn the_wait_never_asks_for_ever() {
        let r = Replication {
            replicas: 1,
            timeout: Duration::from_micros(100),
        };
        assert_eq!(r.timeout_ms(), 1);
        let r = Replication {
            replicas: 1,
            timeout: Duration::from_millis(75),
        };
        assert_eq!(r.timeout_ms(), 75);
    }
}
