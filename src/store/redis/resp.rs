//! The RESP wire, both ways: script calls written as RESP arrays, and
//! replies read back (a script's array of integers read directly, anything
//! else through a generic decoder). No connections here: [`super::pipe`]
//! holds those, [`super::batch`] builds the batch calls from these parts.

use fred::bytes::BytesMut;
use fred::error::{Error as RedisError, ErrorKind};
use fred::types::{Key, Value};
use redis_protocol::resp2::decode::decode_bytes_mut;
use redis_protocol::resp2::types::BytesFrame;

/// A script call's reply: the integers it returned, or the server's error.
pub type Reply = Result<Vec<i64>, RedisError>;

/// The next whole reply in `buf`, taken off it; `None` while it is
/// incomplete. A script's usual answer, an array of integers, is read here
/// directly (a generic RESP parser builds a frame per element first, a
/// third of the reader's time); anything else goes through
/// [`decode_bytes_mut`] and [`reply_of`].
pub(super) fn next_reply(buf: &mut BytesMut) -> Result<Option<Reply>, RedisError> {
    match integers(buf) {
        Some(Some((values, used))) => {
            let _ = buf.split_to(used);
            Ok(Some(Ok(values)))
        }
        Some(None) => Ok(None),
        None => match decode_bytes_mut(buf) {
            Ok(Some((frame, _, _))) => Ok(Some(reply_of(frame))),
            Ok(None) => Ok(None),
            Err(e) => Err(RedisError::new(ErrorKind::Protocol, e.to_string())),
        },
    }
}

/// A decimal ending in `\r\n` at `at`: the number and where the next
/// line starts; `Some(None)` when the line is not all there yet.
pub(super) fn line(buf: &[u8], at: usize) -> Option<Option<(i64, usize)>> {
    let rest = buf.get(at..)?;
    let (negative, digits) = match rest.first() {
        None => return Some(None),
        Some(b'-') => (true, &rest[1..]),
        Some(_) => (false, rest),
    };
    let mut n: i64 = 0;
    for (i, &b) in digits.iter().enumerate() {
        match b {
            b'0'..=b'9' if i < 18 => n = n * 10 + i64::from(b - b'0'),
            b'\r' if i > 0 => {
                return match digits.get(i + 1) {
                    None => Some(None),
                    Some(b'\n') => {
                        let end = at + usize::from(negative) + i + 2;
                        Some(Some((if negative { -n } else { n }, end)))
                    }
                    Some(_) => None,
                };
            }
            // longer than 18 digits, or not a number: the generic path
            _ => return None,
        }
    }
    Some(None)
}

/// `*<n>\r\n` and `n` times `:<i64>\r\n` at the start of `buf`: the
/// integers and the bytes they took; `Some(None)` when `buf` holds only the
/// start of such an array; `None` for anything else.
pub(super) fn integers(buf: &[u8]) -> Option<Option<(Vec<i64>, usize)>> {
    match buf.first() {
        None => return Some(None),
        Some(b'*') => {}
        Some(_) => return None,
    }
    let Some((count, mut at)) = line(buf, 1)? else {
        return Some(None);
    };
    // any length (a descriptor of many limits answers 4 integers a limit),
    // not a null array; room for a usual answer at first
    let Ok(count) = usize::try_from(count) else {
        return None;
    };
    let mut values = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        match buf.get(at) {
            None => return Some(None),
            Some(b':') => {}
            Some(_) => return None,
        }
        let Some((value, next)) = line(buf, at + 1)? else {
            return Some(None);
        };
        values.push(value);
        at = next;
    }
    Some(Some((values, at)))
}

/// A script's reply: an array of integers, or the server's error (`MOVED`
/// and `ASK` as cluster errors, the rest with the server's text).
pub(super) fn reply_of(frame: BytesFrame) -> Reply {
    match frame {
        BytesFrame::Array(items) => items
            .into_iter()
            .map(|item| match item {
                BytesFrame::Integer(i) => Ok(i),
                other => Err(RedisError::new(
                    ErrorKind::Parse,
                    format!("a script reply holds a non-integer: {other:?}"),
                )),
            })
            .collect(),
        // `WAIT`'s count
        BytesFrame::Integer(i) => Ok(vec![i]),
        BytesFrame::Error(e) => {
            let text = e.to_string();
            let kind = if text.starts_with("MOVED ") || text.starts_with("ASK ") {
                ErrorKind::Cluster
            } else {
                ErrorKind::Unknown
            };
            Err(RedisError::new(kind, text))
        }
        other => Err(RedisError::new(
            ErrorKind::Parse,
            format!("unexpected script reply: {other:?}"),
        )),
    }
}

/// `EVALSHA|EVAL <sha|body> <numkeys> <keys…> <args…>` as a RESP array,
/// written into one buffer (no allocation per argument).
pub(super) fn encode_eval(
    command: &str,
    script: &str,
    keys: &[Key],
    args: &[Value],
) -> Result<Vec<u8>, RedisError> {
    let size = 64
        + script.len()
        + keys.iter().map(|k| k.as_bytes().len() + 16).sum::<usize>()
        + args.len() * 32;
    let mut out = Vec::with_capacity(size);
    put_header(&mut out, b'*', 3 + keys.len() + args.len());
    put_bulk(&mut out, command.as_bytes());
    put_bulk(&mut out, script.as_bytes());
    put_bulk(&mut out, decimal(keys.len() as i64, &mut [0; 20]));
    for k in keys {
        put_bulk(&mut out, k.as_bytes());
    }
    for a in args {
        put_arg(&mut out, a)?;
    }
    Ok(out)
}

/// A script argument as a bulk string: an integer in decimal, a string or
/// bytes as they are.
pub(super) fn put_arg(out: &mut Vec<u8>, arg: &Value) -> Result<(), RedisError> {
    match arg {
        Value::Integer(i) => put_bulk(out, decimal(*i, &mut [0; 20])),
        Value::String(s) => put_bulk(out, s.as_bytes()),
        Value::Bytes(b) => put_bulk(out, b),
        other => {
            return Err(RedisError::new(
                ErrorKind::InvalidArgument,
                format!("a script argument of an unsupported type: {other:?}"),
            ))
        }
    }
    Ok(())
}

/// RESP: an array of bulk strings.
pub(super) fn encode<'a>(parts: impl ExactSizeIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + parts.len() * 24);
    put_header(&mut out, b'*', parts.len());
    for p in parts {
        put_bulk(&mut out, p);
    }
    out
}

/// `<kind><n>\r\n`.
pub(super) fn put_header(out: &mut Vec<u8>, kind: u8, n: usize) {
    out.push(kind);
    out.extend_from_slice(decimal(n as i64, &mut [0; 20]));
    out.extend_from_slice(b"\r\n");
}

/// `$<len>\r\n<bytes>\r\n`.
pub(super) fn put_bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    put_header(out, b'$', bytes.len());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// `i` in decimal, in `buf`.
pub(super) fn decimal(i: i64, buf: &mut [u8; 20]) -> &[u8] {
    let mut n = i.unsigned_abs();
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    if i < 0 {
        at -= 1;
        buf[at] = b'-';
    }
    &buf[at..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals() {
        for i in [0, 7, -5, 10, 12345, -9_876_543_210, i64::MAX, i64::MIN] {
            assert_eq!(decimal(i, &mut [0; 20]), i.to_string().as_bytes(), "{i}");
        }
    }

    #[test]
    fn commands_are_resp_arrays() {
        let keys = [Key::from("k1")];
        let args = [Value::Integer(-5), Value::from("x")];
        let bytes = encode_eval("EVALSHA", "abc", &keys, &args).expect("encoded");
        assert_eq!(
            bytes,
            b"*6\r\n$7\r\nEVALSHA\r\n$3\r\nabc\r\n$1\r\n1\r\n$2\r\nk1\r\n$2\r\n-5\r\n$1\r\nx\r\n"
        );
    }

    #[test]
    fn replies_become_integers_or_errors() {
        let mut buf = BytesMut::from(
            &b"*2\r\n:1\r\n:-3\r\n-MOVED 12 127.0.0.1:7001\r\n-NOSCRIPT No matching script\r\n"[..],
        );
        let mut next = || next_reply(&mut buf).expect("valid").expect("a reply");
        assert_eq!(next().expect("ints"), vec![1, -3]);
        let moved = next().expect_err("moved");
        assert_eq!(*moved.kind(), ErrorKind::Cluster);
        assert_eq!(moved.details(), "MOVED 12 127.0.0.1:7001");
        let noscript = next().expect_err("noscript");
        assert!(noscript.details().starts_with("NOSCRIPT"));
    }

    /// Replies arrive in pieces: a reply cut anywhere waits for the rest,
    /// whatever path reads it, and the next one starts where it ended.
    #[test]
    fn replies_cut_anywhere_are_read_whole() {
        let wire: &[u8] =
            b"*6\r\n:1\r\n:-12\r\n:-1\r\n:0\r\n:0\r\n:9007199254740993\r\n-ERR x\r\n*0\r\n*2\r\n:1\r\n$1\r\nx\r\n*1\r\n:1234567890123456789\r\n";
        let expected = |replies: Vec<Reply>| {
            assert_eq!(replies.len(), 5, "{replies:?}");
            assert_eq!(
                replies[0].as_ref().expect("ints"),
                &vec![1, -12, -1, 0, 0, 9_007_199_254_740_993]
            );
            assert_eq!(replies[1].as_ref().expect_err("error").details(), "ERR x");
            assert_eq!(replies[2].as_ref().expect("empty"), &Vec::<i64>::new());
            assert_eq!(
                *replies[3].as_ref().expect_err("a bulk string").kind(),
                ErrorKind::Parse
            );
            // 19 digits: read by the generic parser, same value
            assert_eq!(
                replies[4].as_ref().expect("ints"),
                &vec![1_234_567_890_123_456_789]
            );
        };
        for cut in 0..=wire.len() {
            let mut buf = BytesMut::from(&wire[..cut]);
            let mut replies = Vec::new();
            while let Some(r) = next_reply(&mut buf).expect("valid") {
                replies.push(r);
            }
            buf.extend_from_slice(&wire[cut..]);
            while let Some(r) = next_reply(&mut buf).expect("valid") {
                replies.push(r);
            }
            assert!(buf.is_empty(), "cut at {cut}: {buf:?} left");
            expected(replies);
        }
    }
}
