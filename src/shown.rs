//! How a request's descriptor values are shown outside the request path
//! (log lines, the heavy hitters on the admin page, in its JSON and in the
//! summaries shared through Redis, `detailed_metric` series): never raw.
//!
//! - **Escaped.** Control characters (C0, DEL, C1), bidirectional and
//!   other invisible format characters are written `\u{…}`, a backslash
//!   `\\`: a value cannot start a line of its own, colour a terminal, or
//!   read backwards on a page ([`escape_into`]).
//! - **Cut per entry.** A value longer than [`SHOWN_VALUE_BYTES`] shows
//!   its start, `…` and 8 hex digits of its digest: two long values that
//!   share a start stay two.
//! - **Pseudonymised**, for the keys an operator names
//!   (`--refusal-log-hash-keys`, `*` for all): `hmac:` and 24 hex digits
//!   (96 bits) of HMAC-SHA-256 under a per-deployment secret
//!   (`--pseudonym-key-file`): the same on every instance that shares the
//!   secret, and not reversible by trying values without it.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses nothing of the crate.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::Arc;

use ring::hmac;

/// A value's bytes shown at most before it is cut.
pub const SHOWN_VALUE_BYTES: usize = 64;

/// What a cut value keeps of its start.
const CUT_KEEPS: usize = 40;

/// Hex digits of a pseudonym (96 bits).
pub const PSEUDONYM_HEX: usize = 24;

/// The shortest secret `--pseudonym-key-file` may hold.
pub const MIN_SECRET_BYTES: usize = 16;

/// Whether `c` is written escaped: a control character, or a format
/// character that changes how text around it reads (bidirectional
/// overrides and isolates, marks, zero-width joiners, the BOM).
fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{061C}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
            | '\u{2060}'..='\u{2069}' | '\u{FEFF}' | '\u{FFF9}'..='\u{FFFB}')
}

/// Writes `s` to `out` with [`hidden`] characters as `\u{…}` and `\` as
/// `\\` (so that an escape in the output was never typed by a client).
pub fn escape_into(out: &mut String, s: &str) {
    // the usual value: printable ASCII, written as it is
    if s.bytes().all(|b| (0x20..0x7f).contains(&b) && b != b'\\') {
        out.push_str(s);
        return;
    }
    for c in s.chars() {
        if c == '\\' {
            out.push_str("\\\\");
        } else if hidden(c) {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
}

/// `s` as [`escape_into`] writes it (borrowed when nothing changes).
pub fn escaped(s: &str) -> Cow<'_, str> {
    if !s.chars().any(|c| c == '\\' || hidden(c)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    escape_into(&mut out, s);
    Cow::Owned(out)
}

/// `s` cut at `max` bytes or fewer, at a character boundary.
pub fn cut_at(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Which keys' values are shown pseudonymised, and the secret.
#[derive(Debug, Clone, Default)]
pub struct ShownValues {
    hashed: Vec<String>,
    secret: Option<Arc<hmac::Key>>,
}

impl ShownValues {
    /// The values of `keys` pseudonymised under `secret` (`*`: every
    /// key's; blanks ignored). Keys without a secret are refused: a hash
    /// without one is reversed by trying values.
    pub fn hashing(keys: &[String], secret: Option<&[u8]>) -> Result<Self, String> {
        let hashed: Vec<String> = keys
            .iter()
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .collect();
        let secret = match secret {
            Some(s) if s.len() < MIN_SECRET_BYTES => {
                return Err(format!(
                    "--pseudonym-key-file holds {} bytes; at least {MIN_SECRET_BYTES} are needed (e.g. `head -c 32 /dev/urandom > FILE`)",
                    s.len()
                ))
            }
            Some(s) => Some(Arc::new(hmac::Key::new(hmac::HMAC_SHA256, s))),
            None if !hashed.is_empty() => {
                return Err("--refusal-log-hash-keys needs --pseudonym-key-file: a secret file shared by the instances (an unkeyed hash of a value is reversed by trying values)".into())
            }
            None => None,
        };
        Ok(Self { hashed, secret })
    }

    fn hashes(&self, key: &str) -> bool {
        !self.hashed.is_empty() && self.hashed.iter().any(|k| k == "*" || k == key)
    }

    /// Whether any key's values are pseudonymised.
    pub fn pseudonymises(&self) -> bool {
        !self.hashed.is_empty()
    }

    /// `hex` digits of `value`'s digest: keyed when a secret is set.
    fn digest_hex(&self, value: &str, hex: usize) -> String {
        let mut out = String::with_capacity(hex);
        let mut put = |bytes: &[u8]| {
            for b in bytes.iter().take(hex.div_ceil(2)) {
                let _ = write!(out, "{b:02x}");
            }
        };
        match &self.secret {
            Some(key) => put(hmac::sign(key, value.as_bytes()).as_ref()),
            None => put(&sha1_smol::Sha1::from(value).digest().bytes()),
        }
        out.truncate(hex);
        out
    }

    /// Writes `key=value` to `out`: the key and value escaped, a long
    /// value cut (its start, `…`, 8 hex of its digest), a pseudonymised
    /// key's value as `hmac:<24 hex>`.
    pub fn write(&self, out: &mut String, key: &str, value: &str) {
        escape_into(out, cut_at(key, SHOWN_VALUE_BYTES));
        out.push('=');
        self.write_value(out, key, value);
    }

    /// Writes `value` (of `key`) as [`ShownValues::write`] shows it.
    pub fn write_value(&self, out: &mut String, key: &str, value: &str) {
        if self.hashes(key) {
            out.push_str("hmac:");
            out.push_str(&self.digest_hex(value, PSEUDONYM_HEX));
        } else if value.len() > SHOWN_VALUE_BYTES {
            escape_into(out, cut_at(value, CUT_KEEPS));
            out.push('…');
            out.push_str(&self.digest_hex(value, 8));
        } else {
            escape_into(out, value);
        }
    }

    /// `key=value` as [`ShownValues::write`] writes it.
    pub fn show(&self, key: &str, value: &str) -> String {
        let mut out = String::with_capacity(key.len() + value.len().min(80) + 8);
        self.write(&mut out, key, value);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123";

    #[test]
    fn named_keys_are_pseudonymised_the_same_under_one_secret() {
        let shown =
            ShownValues::hashing(&["user_id".into(), " ".into()], Some(SECRET)).expect("secret");
        assert_eq!(shown.show("plan", "gold"), "plan=gold");
        let hashed = shown.show("user_id", "alice");
        assert!(hashed.starts_with("user_id=hmac:"), "{hashed}");
        assert_eq!(hashed.len(), "user_id=hmac:".len() + PSEUDONYM_HEX);
        let again = ShownValues::hashing(&["user_id".into()], Some(SECRET)).expect("secret");
        assert_eq!(hashed, again.show("user_id", "alice"));
        assert!(!hashed.contains("alice"));
        // another secret, another pseudonym: guessing needs the secret
        let other =
            ShownValues::hashing(&["user_id".into()], Some(b"another secret of 20")).expect("s");
        assert_ne!(hashed, other.show("user_id", "alice"));
        let all = ShownValues::hashing(&["*".into()], Some(SECRET)).expect("secret");
        assert!(all.show("plan", "gold").starts_with("plan=hmac:"));
    }

    #[test]
    fn pseudonyms_need_a_secret_of_sixteen_bytes() {
        assert!(ShownValues::hashing(&["user_id".into()], None).is_err());
        assert!(ShownValues::hashing(&["user_id".into()], Some(b"short")).is_err());
        assert!(ShownValues::hashing(&[], None).is_ok());
    }

    #[test]
    fn control_and_bidi_characters_are_shown_escaped() {
        let shown = ShownValues::default();
        assert_eq!(
            shown.show("user", "a\nINFO forged\u{1b}[31m\0\u{7}"),
            "user=a\\u{a}INFO forged\\u{1b}[31m\\u{0}\\u{7}"
        );
        assert_eq!(
            shown.show("user", "admin\u{202e}1337-resu"),
            "user=admin\\u{202e}1337-resu"
        );
        // a typed escape is not an escape
        assert_eq!(shown.show("user", "\\u{a}"), "user=\\\\u{a}");
        assert_eq!(escaped("plain"), Cow::Borrowed("plain"));
    }

    #[test]
    fn long_values_are_cut_each_and_stay_apart() {
        let shown = ShownValues::default();
        let long = "x".repeat(200);
        let a = shown.show("path", &format!("{long}/alice"));
        let b = shown.show("path", &format!("{long}/bob"));
        assert_ne!(a, b);
        assert!(a.len() < "path=".len() + SHOWN_VALUE_BYTES, "{a}");
        assert!(
            a.starts_with(&format!("path={}…", &long[..CUT_KEEPS])),
            "{a}"
        );
        // a multi-byte character at the cut is kept whole or left out
        let s = shown.show("k", &"é".repeat(100));
        assert!(s.contains('…'), "{s}");
    }
}
