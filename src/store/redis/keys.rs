//! Where a bucket lives in Redis: its key (`rls:{<hash tag>}:…`), the
//! fixed hash of a descriptor's tag, and the slot that follows from it.

use fred::bytes::Bytes;

use super::RedisStore;

/// The slot of a descriptor whose tag hashes to `tag_hash`.
pub fn slot_of(tag_hash: u64) -> u16 {
    fred::util::redis_keyslot(&hex16(tag_hash))
}

/// `rls:{<16 hex digits>}:<key>`: the braces hold the slot's hash tag.
pub fn redis_key(tag_hash: u64, key: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(key.len() + 24);
    out.extend_from_slice(b"rls:{");
    out.extend_from_slice(&hex16(tag_hash));
    out.extend_from_slice(b"}:");
    out.extend_from_slice(key);
    Bytes::from(out)
}

/// The slot of `rls:{<hash>}:…` keys behind `prefix`: Redis hashes the
/// first `{…}` of a key, which may begin in the prefix and then holds the
/// prefix's part and (if it does not close there) ours up to our `}`; the
/// rest of the key never counts.
pub fn slot_behind(prefix: &[u8], tag_hash: u64) -> u16 {
    let mut key = Vec::with_capacity(prefix.len() + 22);
    key.extend_from_slice(prefix);
    key.extend_from_slice(b"rls:{");
    key.extend_from_slice(&hex16(tag_hash));
    key.push(b'}');
    fred::util::redis_keyslot(&key)
}

/// Whether `prefix`'s first `{` is closed at once (`{}`): Redis then
/// hashes each key whole, so one descriptor's keys would not share a slot.
pub fn empty_hash_tag(prefix: &str) -> bool {
    prefix
        .find('{')
        .is_some_and(|at| prefix[at + 1..].starts_with('}'))
}

/// `n` as 16 lower-case hex digits (`format!("{n:016x}")` without the
/// formatting machinery: this is on every decision's path).
pub(super) fn hex16(n: u64) -> [u8; 16] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 16];
    for (i, digit) in out.iter_mut().enumerate() {
        *digit = DIGITS[((n >> (60 - 4 * i)) & 0xf) as usize];
    }
    out
}

/// FNV-1a: a fixed hash, so that every instance (whatever its Rust version)
/// puts a descriptor's buckets in the same slot.
pub fn tag_hash(tag: &[u8]) -> u64 {
    tag.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl RedisStore {
    /// The slot of a descriptor's keys (their tag hashing to `hash`): the
    /// hash tag's, or, behind a prefix holding a brace (envoyproxy/ratelimit's
    /// `CACHE_KEY_PREFIX` may), the one Redis finds from the prefix on.
    pub(super) fn slot_of_hash(&self, hash: u64) -> u16 {
        if !self.key_prefix.contains(&b'{') {
            return slot_of(hash);
        }
        slot_behind(&self.key_prefix, hash)
    }

    /// `key` behind the `--redis-key-prefix` (the slot: [`Self::slot_of_hash`]).
    pub(super) fn prefixed(&self, key: Bytes) -> Bytes {
        if self.key_prefix.is_empty() {
            return key;
        }
        let mut out = Vec::with_capacity(self.key_prefix.len() + key.len());
        out.extend_from_slice(&self.key_prefix);
        out.extend_from_slice(&key);
        Bytes::from(out)
    }
}
