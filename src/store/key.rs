//! Bytes of store keys: every part written with its length in front, so
//! that no two lists of strings encode alike (the limiter's bucket keys and
//! the RLQS ledger's keys both build on it).

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
