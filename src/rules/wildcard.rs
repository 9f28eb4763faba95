//! `*` patterns in descriptor values: `*` matches any run of characters,
//! including none, anywhere in the value (`foo*`, `bar*b`, `svc*ep*rpc`).

/// A compiled value pattern: the literal pieces between the stars.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wildcard {
    pattern: String,
    parts: Vec<String>,
}

impl Wildcard {
    /// `None` when `value` has no `*` and so is an exact value.
    pub fn parse(value: &str) -> Option<Self> {
        if !value.contains('*') {
            return None;
        }
        Some(Self {
            pattern: value.to_string(),
            parts: value.split('*').map(str::to_string).collect(),
        })
    }

    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    pub fn matches(&self, value: &str) -> bool {
        // parts.len() >= 2 because the pattern holds at least one '*'.
        let (first, rest) = match self.parts.split_first() {
            Some(split) => split,
            None => return false,
        };
        let (last, middle) = match rest.split_last() {
            Some(split) => split,
            None => return false,
        };
        if value.len() < first.len() + last.len()
            || !value.starts_with(first.as_str())
            || !value.ends_with(last.as_str())
        {
            return false;
        }
        let mut rest = &value[first.len()..value.len() - last.len()];
        for part in middle {
            match rest.find(part.as_str()) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::Wildcard;

    fn m(p: &str, v: &str) -> bool {
        Wildcard::parse(p).expect("pattern").matches(v)
    }

    #[test]
    fn exact_values_are_not_patterns() {
        assert!(Wildcard::parse("foo").is_none());
    }

    #[test]
    fn trailing_middle_and_multiple_stars() {
        assert!(m("foo*", "foo"));
        assert!(m("foo*", "foobar"));
        assert!(!m("foo*", "fo"));
        assert!(m("bar*b", "barb"));
        assert!(m("bar*b", "bar-xyz-b"));
        assert!(!m("bar*b", "bar-xyz-c"));
        assert!(m("foo*bar*baz", "foo1bar2baz"));
        assert!(m("foo*bar*baz", "foobarbaz"));
        assert!(!m("foo*bar*baz", "foo1baz"));
        assert!(m("*", ""));
        assert!(m("*x", "x"));
        assert!(!m("ab*ba", "aba"), "prefix and suffix may not overlap");
        assert!(m("/api*v1", "/api/users/v1"));
    }
}
