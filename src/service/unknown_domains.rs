//! Domains Envoy asks about that no rule has: said once each in the log,
//! since every such call is admitted and nothing else shows it (a
//! bootstrap of `examples/envoy/` run against the default rules limits
//! nothing). Bounded: at most [`MAX_NAMED`] names are kept, so a client
//! sending a new domain on every call cannot grow it; past that one line
//! says that more came.

use std::collections::HashSet;

use parking_lot::Mutex;

/// Domains named in the log at most.
pub const MAX_NAMED: usize = 64;

#[derive(Debug, Default)]
pub struct UnknownDomains {
    seen: Mutex<(HashSet<String>, bool)>,
}

/// What a call of an unknown domain asks to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// Said before.
    Nothing,
    /// The first call of this domain.
    First,
    /// The first domain past [`MAX_NAMED`]: no more are named.
    TooMany,
}

impl UnknownDomains {
    /// A call for `domain`, which no rule has.
    pub fn note(&self, domain: &str) -> Note {
        let mut seen = self.seen.lock();
        let (names, full) = &mut *seen;
        if names.contains(domain) {
            return Note::Nothing;
        }
        if names.len() >= MAX_NAMED {
            if *full {
                return Note::Nothing;
            }
            *full = true;
            return Note::TooMany;
        }
        names.insert(domain.to_owned());
        Note::First
    }

    /// Logs what a call of `domain` calls for.
    pub fn log(&self, domain: &str) {
        match self.note(domain) {
            Note::Nothing => {}
            Note::First => tracing::warn!(
                domain,
                "a ShouldRateLimit call for a domain no rule has: every call of it is admitted, nothing is limited (are --config / RLS_CONFIG the rules this Envoy asks about? examples/envoy/README.md)"
            ),
            Note::TooMany => tracing::warn!(
                named = MAX_NAMED,
                "calls for more domains no rule has: no more are named"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_unknown_domain_is_said_once_and_the_names_are_bounded() {
        let u = UnknownDomains::default();
        assert_eq!(u.note("llm"), Note::First);
        assert_eq!(u.note("llm"), Note::Nothing);
        for i in 1..MAX_NAMED {
            assert_eq!(u.note(&format!("d{i}")), Note::First);
        }
        assert_eq!(u.note("one-more"), Note::TooMany);
        assert_eq!(u.note("and-another"), Note::Nothing);
        assert_eq!(u.note("llm"), Note::Nothing);
        assert_eq!(u.seen.lock().0.len(), MAX_NAMED);
    }
}
