//! Store keys for buckets, unambiguous whatever bytes requests carry.
//!
//! Every component is written with its length in front, and each entry says
//! whether its value is the request's own or a shared `*` pattern, so no two
//! different descriptor paths produce the same bytes: not `a_b` + `c` versus
//! `a` + `b_c`, not `{`/`}`/`:` in values, not empty values. A value longer
//! than [`MAX_KEY_OR_VALUE_BYTES`] is held by its digest, marked as one (so
//! that no value sent as text shares its bucket). The descriptor
//! part (the tag) is shared by all buckets of one descriptor; each bucket then
//! appends its own id.

use crate::rules::{bounded_value, BucketValue, MAX_KEY_OR_VALUE_BYTES};
pub use crate::store::key::put;

/// Where a descriptor's buckets come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOrigin {
    /// Buckets of a configured rule.
    Rule,
    /// The limit Envoy sent in the request (`RateLimitDescriptor.limit`).
    Override,
    /// The shared bucket of a `max_values` rule's overflow.
    Overflow,
}

const VERSION: u8 = 1;

/// The tag shared by all buckets of one descriptor.
pub fn descriptor_tag<'a>(
    origin: KeyOrigin,
    domain: &str,
    entries: impl Iterator<Item = (&'a str, BucketValue<'a>)>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.push(VERSION);
    out.push(match origin {
        KeyOrigin::Rule => b'r',
        KeyOrigin::Override => b'o',
        KeyOrigin::Overflow => b'f',
    });
    put(&mut out, domain.as_bytes());
    for (key, value) in entries {
        put(&mut out, key.as_bytes());
        match value {
            BucketValue::Value(v) if v.len() > MAX_KEY_OR_VALUE_BYTES => {
                out.push(b'd');
                put(&mut out, &sha1_smol::Sha1::from(v).digest().bytes());
            }
            BucketValue::Value(v) => {
                out.push(b'v');
                put(&mut out, v.as_bytes());
            }
            BucketValue::Shared(p) => {
                out.push(b's');
                put(&mut out, p.as_bytes());
            }
        }
    }
    out
}

/// The key of one bucket: the descriptor tag, an end mark, the bucket's id.
pub fn bucket_key(tag: &[u8], bucket_id: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(tag.len() + bucket_id.len() + 2);
    out.extend_from_slice(tag);
    out.push(b'#');
    put(&mut out, bucket_id.as_bytes());
    out
}

/// envoyproxy/ratelimit's key of a descriptor (its `cache_key.go`), less
/// the key prefix and the window's start that the Redis store adds:
/// `domain_`, then `key_value_` for each of the request's entries, a
/// `share_threshold` pattern in place of the value it matched. Its bytes
/// are that service's, look-alikes included (`a_b` + `c` and `a` + `b_c`
/// share a key there too), so that both count in one key.
pub fn ratelimit_key<'a>(
    domain: &str,
    entries: impl Iterator<Item = (&'a str, BucketValue<'a>)>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(domain.as_bytes());
    out.push(b'_');
    for (key, value) in entries {
        out.extend_from_slice(key.as_bytes());
        out.push(b'_');
        let (BucketValue::Value(v) | BucketValue::Shared(v)) = value;
        out.extend_from_slice(bounded_value(v).as_bytes());
        out.push(b'_');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn key(domain: &str, entries: &[(&str, BucketValue<'_>)], id: &str) -> Vec<u8> {
        let tag = descriptor_tag(KeyOrigin::Rule, domain, entries.iter().copied());
        bucket_key(&tag, id)
    }

    #[test]
    fn look_alike_descriptors_get_distinct_keys() {
        use BucketValue::{Shared, Value};
        let cases: Vec<Vec<u8>> = vec![
            key("d", &[("a_b", Value("c"))], "0"),
            key("d", &[("a", Value("b_c"))], "0"),
            key("d_a", &[("b", Value("c"))], "0"),
            key("d", &[("a", Value("b")), ("c", Value(""))], "0"),
            key("d", &[("a", Value("")), ("b", Value("c"))], "0"),
            key("d", &[("a", Value("b:c"))], "0"),
            key("d", &[("a:b", Value("c"))], "0"),
            key("d", &[("a", Value("{b}"))], "0"),
            key("d", &[("a", Value("b"))], "0#"),
            key("d", &[("a", Value("b#"))], "0"),
            key("d", &[("a", Shared("b*"))], "0"),
            key("d", &[("a", Value("b*"))], "0"),
            key("d", &[("ü", Value("ß"))], "0"),
            key("d", &[("u", Value("ß"))], "0"),
            key("", &[("d", Value("a"))], "0"),
            key("d", &[], "a"),
        ];
        let distinct: HashSet<_> = cases.iter().collect();
        assert_eq!(distinct.len(), cases.len());
        let over = bucket_key(
            &descriptor_tag(KeyOrigin::Override, "d", [("a", Value("b"))].into_iter()),
            "0",
        );
        assert!(!cases.contains(&over));
    }

    #[test]
    fn ratelimit_keys_are_envoyproxy_ratelimits() {
        use BucketValue::{Shared, Value};
        // as its cache_key_test.go and fixed_cache_impl_test.go show them
        // (the store adds the prefix and the window's start)
        let key = ratelimit_key("domain", [("key", Value("value"))].into_iter());
        assert_eq!(key, b"domain_key_value_");
        let key = ratelimit_key(
            "domain",
            [("key2", Value("value2")), ("subkey2", Value("subvalue2"))].into_iter(),
        );
        assert_eq!(key, b"domain_key2_value2_subkey2_subvalue2_");
        let key = ratelimit_key("d", [("files", Shared("files/*"))].into_iter());
        assert_eq!(key, b"d_files_files/*_");
        assert_eq!(ratelimit_key("d", std::iter::empty()), b"d_");
    }

    #[test]
    fn long_components_use_multi_byte_lengths() {
        let long = "x".repeat(300);
        let a = key("d", &[(long.as_str(), BucketValue::Value(""))], "0");
        let b = key("d", &[(&long[..299], BucketValue::Value("x"))], "0");
        assert_ne!(a, b);
    }
}
