//! How a request's descriptor values are shown outside the request path
//! (the refusal log, the heavy hitters on the admin page and in its JSON):
//! as they came, or, for the keys an operator names
//! (`--refusal-log-hash-keys`, `*` for all), as `sha1:<first 12 hex>` of
//! the value: the same on every instance, never the value itself.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses nothing of the crate.

/// Which keys' values are shown hashed.
#[derive(Debug, Clone, Default)]
pub struct ShownValues {
    hashed: Vec<String>,
}

impl ShownValues {
    /// The values of `keys` hashed (`*`: every key's; blanks ignored).
    pub fn hashing(keys: &[String]) -> Self {
        Self {
            hashed: keys
                .iter()
                .map(|k| k.trim().to_string())
                .filter(|k| !k.is_empty())
                .collect(),
        }
    }

    fn hashes(&self, key: &str) -> bool {
        !self.hashed.is_empty() && self.hashed.iter().any(|k| k == "*" || k == key)
    }

    /// Writes `key=value`, or `key=sha1:<12 hex>` for a key whose values
    /// are hashed, to `out`.
    pub fn write(&self, out: &mut String, key: &str, value: &str) {
        out.push_str(key);
        out.push('=');
        if self.hashes(key) {
            let digest = sha1_smol::Sha1::from(value).digest().to_string();
            out.push_str("sha1:");
            out.push_str(&digest[..12]);
        } else {
            out.push_str(value);
        }
    }

    /// `key=value` as [`ShownValues::write`] writes it.
    pub fn show(&self, key: &str, value: &str) -> String {
        let mut out = String::with_capacity(key.len() + value.len() + 8);
        self.write(&mut out, key, value);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_keys_are_hashed_the_same_everywhere() {
        let shown = ShownValues::hashing(&["user_id".into(), " ".into()]);
        assert_eq!(shown.show("plan", "gold"), "plan=gold");
        let hashed = shown.show("user_id", "alice");
        assert!(hashed.starts_with("user_id=sha1:"), "{hashed}");
        assert_eq!(hashed.len(), "user_id=sha1:".len() + 12);
        assert_eq!(
            hashed,
            ShownValues::hashing(&["user_id".into()]).show("user_id", "alice")
        );
        assert!(!hashed.contains("alice"));
        let all = ShownValues::hashing(&["*".into()]);
        assert!(all.show("plan", "gold").starts_with("plan=sha1:"));
    }
}
