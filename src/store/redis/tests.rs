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
