//! One log line per refused request, at most `--refusal-log-rate` a second:
//! a flood of refusals cannot fill a disk, and the lines held back are
//! counted in the next one written. Pure: the caller says what second it is.

use parking_lot::Mutex;

use crate::shown::ShownValues;

#[derive(Debug, Default)]
pub struct RefusalLog {
    per_sec: u32,
    /// How the descriptors' values are shown (some keys' hashed).
    shown: ShownValues,
    /// (the second counted, lines written in it, lines held back since the
    /// last one written).
    state: Mutex<(u64, u32, u64)>,
}

impl RefusalLog {
    /// At most `per_sec` lines a second (0: none).
    pub fn new(per_sec: u32) -> Self {
        Self {
            per_sec,
            shown: ShownValues::default(),
            state: Mutex::default(),
        }
    }

    /// Shows values as `shown` says (escaped, cut, some pseudonymised).
    pub fn showing(mut self, shown: ShownValues) -> Self {
        self.shown = shown;
        self
    }

    /// An entry as its line shows it ([`ShownValues::write`]).
    pub fn show(&self, key: &str, value: &str) -> String {
        self.shown.show(key, value)
    }

    /// A refusal at second `now`: `Some(held back before it)` when its
    /// line may be written, `None` when this second's lines are spent.
    pub fn admit(&self, now: u64) -> Option<u64> {
        if self.per_sec == 0 {
            return None;
        }
        let mut state = self.state.lock();
        let (second, written, held) = &mut *state;
        if *second != now {
            (*second, *written) = (now, 0);
        }
        if *written >= self.per_sec {
            *held += 1;
            return None;
        }
        *written += 1;
        Some(std::mem::take(held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_the_rate_a_second_and_the_rest_counted_in_the_next_line() {
        let log = RefusalLog::new(2);
        assert_eq!(log.admit(10), Some(0));
        assert_eq!(log.admit(10), Some(0));
        for _ in 0..1000 {
            assert_eq!(log.admit(10), None);
        }
        assert_eq!(log.admit(11), Some(1000));
        assert_eq!(log.admit(11), Some(0));
        assert_eq!(log.admit(11), None);
        assert_eq!(log.admit(12), Some(1));
    }

    #[test]
    fn a_rate_of_zero_writes_nothing() {
        let log = RefusalLog::new(0);
        assert_eq!(log.admit(1), None);
        assert_eq!(log.admit(2), None);
    }
}
