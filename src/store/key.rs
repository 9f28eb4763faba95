//! Bytes of store keys: every part written with its length in front, so
//! that no two lists of strings encode alike (the limiter's bucket keys and
//! the RLQS ledger's keys both build on it).

/// The key of attempt `id`'s record on the descriptor of `tag`, in both
/// stores: `a`, then each with its length in front. A bucket's key starts
/// with its tag's version byte (1), so no attempt id, however made, names
/// a bucket.
pub fn attempt_key(tag: &[u8], id: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(tag.len() + id.len() + 8);
    key.push(b'a');
    put(&mut key, tag);
    put(&mut key, id);
    key
}

/// The part of an [`attempt_key`] that names its descriptor (`a` and the
/// tag, with its length): what every record of one descriptor shares.
pub fn attempt_key_descriptor(key: &[u8]) -> &[u8] {
    let (mut len, mut shift, mut at) = (0usize, 0u32, 1usize);
    while let Some(&b) = key.get(at) {
        at += 1;
        len |= usize::from(b & 0x7f) << shift.min(63);
        if b & 0x80 == 0 || shift >= 63 {
            break;
        }
        shift += 7;
    }
    &key[..at.saturating_add(len).min(key.len())]
}

/// The key of the slots of the descriptor of `tag` (a `concurrency`
/// rule's), in both stores: `s`, then the tag with its length in front.
pub fn slots_key(tag: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(tag.len() + 4);
    key.push(b's');
    put(&mut key, tag);
    key
}

/// The key of the unsettled reservations of the descriptor of `tag` (on
/// Redis: a sorted set of attempt id -> expiry): `r`, then the tag with its
/// length in front.
pub fn reservations_key(tag: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(tag.len() + 4);
    key.push(b'r');
    put(&mut key, tag);
    key
}

/// Writes `bytes` with its length in front (LEB128), so that no two lists
/// of strings encode alike.
pub fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    let mut n = bytes.len() as u64;
    loop {
        let low = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(low);
            break;
        }
        out.push(low | 0x80);
    }
    out.extend_from_slice(bytes);
}

/// `bytes` as text: printable ASCII as it is, every other byte (and `\\`)
/// as `\xNN`, as redis-cli shows a binary key.
pub fn escaped(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() + 8);
    for &b in bytes {
        if (0x20..0x7f).contains(&b) && b != b'\\' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_keys_are_shown_escaped() {
        assert_eq!(
            escaped(b"rls:{ab}:\x01r\x04edge"),
            "rls:{ab}:\\x01r\\x04edge"
        );
        assert_eq!(escaped(b"a\\b"), "a\\x5cb");
    }

    #[test]
    fn an_attempt_keys_descriptor_part_is_every_record_of_that_descriptors() {
        let long_tag = vec![7u8; 300]; // a two-byte length
        for tag in [b"t".to_vec(), long_tag] {
            let a = attempt_key(&tag, b"id-1");
            let b = attempt_key(&tag, &[9u8; 200]);
            assert_eq!(attempt_key_descriptor(&a), attempt_key_descriptor(&b));
            let mut whole = attempt_key(&tag, b"");
            whole.pop(); // the empty id's length
            assert_eq!(attempt_key_descriptor(&a), &whole[..]);
        }
        assert_ne!(
            attempt_key_descriptor(&attempt_key(b"t1", b"x")),
            attempt_key_descriptor(&attempt_key(b"t2", b"x"))
        );
        // malformed bytes give a part, never a panic
        for junk in [&b""[..], b"a", b"a\xff\xff", b"a\x05ab"] {
            let _ = attempt_key_descriptor(junk);
        }
    }
}
