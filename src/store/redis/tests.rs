//! The store's keys and redirections, without a server.

use super::*;

#[test]
fn keys_of_one_descriptor_share_a_slot() {
    let h = tag_hash(b"some descriptor");
    let a = redis_key(h, b"some descriptor#0");
    let b = redis_key(h, b"some descriptor#1");
    assert_ne!(a, b);
    assert_eq!(fred::util::redis_keyslot(&a), fred::util::redis_keyslot(&b));
    // braces in the request's bytes do not move the tag
    let c = redis_key(h, b"{x}#0");
    assert_eq!(fred::util::redis_keyslot(&a), fred::util::redis_keyslot(&c));
}

/// envoyproxy/ratelimit's `CACHE_KEY_PREFIX` may hold a brace: a
/// descriptor's keys then go to the slot Redis finds for the whole key
/// (the prefix's hash tag, or one that begins there and ends in ours), and
/// an empty `{}`, which would scatter them, is told apart.
#[test]
fn a_prefix_with_a_brace_moves_the_slot_where_redis_finds_it() {
    let h = tag_hash(b"some descriptor");
    let full = |prefix: &str, rest: &[u8]| {
        let mut key = prefix.as_bytes().to_vec();
        key.extend_from_slice(&redis_key(h, rest));
        fred::util::redis_keyslot(&key)
    };
    for prefix in ["", "rl:", "{rl}:", "a{", "}{x", "a{b}c{d}"] {
        let slot = keys::slot_behind(prefix.as_bytes(), h);
        assert_eq!(slot, full(prefix, b"#0"), "{prefix}");
        assert_eq!(slot, full(prefix, b"other#1"), "{prefix}");
    }
    assert_eq!(keys::slot_behind(b"", h), slot_of(h));
    assert_eq!(
        keys::slot_behind(b"{rl}:", h),
        fred::util::redis_keyslot(b"rl")
    );
    for (prefix, empty) in [
        ("{}", true),
        ("x{}y", true),
        ("{rl}", false),
        ("}{}", true),
        ("a", false),
    ] {
        assert_eq!(keys::empty_hash_tag(prefix), empty, "{prefix}");
    }
}

#[test]
fn hex16_is_the_formatted_hash() {
    for n in [
        0,
        1,
        0xabc,
        u64::MAX,
        0x0123_4567_89ab_cdef,
        0xcbf2_9ce4_8422_2325,
    ] {
        assert_eq!(hex16(n).as_slice(), format!("{n:016x}").as_bytes());
    }
    assert_eq!(&redis_key(0xabc, b"k")[..], b"rls:{0000000000000abc}:k");
}

#[test]
fn tag_hash_is_fixed() {
    assert_eq!(tag_hash(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(tag_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
}

#[test]
fn redirections_name_where_to_go() {
    let moved = RedisError::new(ErrorKind::Cluster, "MOVED 3999 127.0.0.1:6381");
    let ask = RedisError::new(ErrorKind::Cluster, "ASK 3999 [::1]:7000");
    assert_eq!(
        redirect_of(&moved),
        Some(Redirect::Moved("127.0.0.1:6381".into()))
    );
    assert_eq!(redirect_of(&ask), Some(Redirect::Ask("[::1]:7000".into())));
    let down = RedisError::new(ErrorKind::Cluster, "CLUSTERDOWN The cluster is down");
    assert_eq!(redirect_of(&down), None);
    let tryagain = RedisError::new(ErrorKind::Unknown, "TRYAGAIN Multiple keys request");
    assert_eq!(redirect_of(&tryagain), None);
}
