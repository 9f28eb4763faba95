//! Several decisions in one script call: the decisions a connection finds
//! queued for its server when it writes go out as one `EVALSHA` of
//! `bucket.lua`, each decided as if alone (see the script's header), so
//! that Redis pays a command's fixed cost (reading it, setting the script
//! up, the reply) once per batch instead of once per decision
//! (BENCHMARKS.md, "decisions batched into one script call").
//!
//! A batch declares only its first decision's keys (a call may declare one
//! slot), so it runs as `#!lua flags=allow-cross-slot-keys`: Redis 7. A
//! connection loads that script before its first batch; where the load
//! fails (Redis 6, an ACL without `SCRIPT`), it sends every decision alone,
//! as before. A batch the server refused without running it (`MOVED`,
//! `NOSCRIPT`, `BUSY` …) and a decision answered `{-1}` (its keys are not
//! this server's now) are sent again alone, where the redirection is
//! followed; a batch that failed while running is answered with its error
//! and never sent again, as a decision before the failure may have spent.

use std::sync::LazyLock;

use fred::bytes::BytesMut;
use fred::error::{Error as RedisError, ErrorKind};
use fred::types::{Key, Value};

use redis_protocol::resp2::decode::decode;

use super::resp::{
    decimal, integers, line, next_reply, put_arg, put_bulk, put_header, reply_of, Reply,
};

/// Decisions one call carries at most, unless configured
/// (`--redis-batch`): at about 10 µs of Redis per decision, a batch holds
/// the server for 0.2 ms at most.
pub const DEFAULT_MAX: usize = 16;

/// The most `--redis-batch` may be.
pub const MAX: usize = 64;

/// The script a decision runs when it is sent alone; batched, every
/// decision runs `bucket.lua` (which takes every kind's arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionScript {
    /// `bucket.lua`: every decision.
    Bucket,
    /// `one.lua`: one bucket's decision, not an attempt's (its header).
    One,
}

/// The single-decision scripts and the batch one (`bucket.lua`, behind the
/// flag that lets it reach undeclared keys).
pub struct Scripts {
    pub single_sha: String,
    pub single_body: &'static str,
    batch_sha: String,
    batch_body: &'static str,
    one_sha: String,
    one_body: &'static str,
}

impl Scripts {
    /// `script`'s SHA-1 and body.
    pub fn of(&self, script: DecisionScript) -> (&str, &'static str) {
        match script {
            DecisionScript::Bucket => (&self.single_sha, self.single_body),
            DecisionScript::One => (&self.one_sha, self.one_body),
        }
    }
}

/// `bucket.lua`, alone and as a batch, and `one.lua`.
pub fn scripts() -> &'static Scripts {
    static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| {
        let sha = |body: &str| sha1_smol::Sha1::from(body).digest().to_string();
        Scripts {
            single_sha: sha(super::SCRIPT),
            single_body: super::SCRIPT,
            batch_sha: sha(BATCH_SCRIPT),
            batch_body: BATCH_SCRIPT,
            one_sha: sha(super::ONE_SCRIPT),
            one_body: super::ONE_SCRIPT,
        }
    });
    &SCRIPTS
}

const BATCH_SCRIPT: &str = concat!(
    "#!lua flags=allow-cross-slot-keys\n",
    include_str!("bucket.lua")
);

/// One decision's part of a call, encoded once: its keys and its group of
/// arguments (bucket count first), as RESP bulk strings.
pub struct Decision {
    /// What it runs when sent alone.
    script: DecisionScript,
    keys: Vec<u8>,
    key_count: usize,
    args: Vec<u8>,
    arg_count: usize,
}

impl Decision {
    /// `keys` and `args` as `bucket.lua` takes one decision's, to run
    /// `script` when sent alone.
    pub fn new(script: DecisionScript, keys: &[Key], args: &[Value]) -> Result<Self, RedisError> {
        let mut encoded_keys =
            Vec::with_capacity(keys.iter().map(|k| k.as_bytes().len() + 8).sum());
        for k in keys {
            put_bulk(&mut encoded_keys, k.as_bytes());
        }
        let mut encoded_args = Vec::with_capacity(args.len() * 16);
        for a in args {
            put_arg(&mut encoded_args, a)?;
        }
        Ok(Self {
            script,
            keys: encoded_keys,
            key_count: keys.len(),
            args: encoded_args,
            arg_count: args.len(),
        })
    }

    /// Bytes it adds to a write.
    pub fn bytes(&self) -> usize {
        self.keys.len() + self.args.len()
    }
}

/// `EVALSHA <its script> <n> <keys> <args>`: one decision alone.
pub fn write_one(out: &mut Vec<u8>, d: &Decision) {
    put_header(out, b'*', 3 + d.key_count + d.arg_count);
    put_bulk(out, b"EVALSHA");
    put_bulk(out, scripts().of(d.script).0.as_bytes());
    put_bulk(out, decimal(d.key_count as i64, &mut [0; 20]));
    out.extend_from_slice(&d.keys);
    out.extend_from_slice(&d.args);
}

/// `EVALSHA <batch> <n₁> <keys₁> <args₁> <args₂> <keys₂> …`: several.
pub fn write_batch(out: &mut Vec<u8>, batch: &[Decision]) {
    let Some(first) = batch.first() else { return };
    let parts: usize = batch.iter().map(|d| d.key_count + d.arg_count).sum();
    put_header(out, b'*', 3 + parts);
    put_bulk(out, b"EVALSHA");
    put_bulk(out, scripts().batch_sha.as_bytes());
    put_bulk(out, decimal(first.key_count as i64, &mut [0; 20]));
    out.extend_from_slice(&first.keys);
    out.extend_from_slice(&first.args);
    for d in &batch[1..] {
        out.extend_from_slice(&d.args);
        out.extend_from_slice(&d.keys);
    }
}

/// `SCRIPT LOAD <batch script>`, written before a connection's first batch.
pub fn write_load(out: &mut Vec<u8>) {
    put_header(out, b'*', 3);
    put_bulk(out, b"SCRIPT");
    put_bulk(out, b"LOAD");
    put_bulk(out, scripts().batch_body.as_bytes());
}

/// The reply to [`write_load`], taken off `buf`: whether the server took
/// the script; `None` while incomplete.
pub fn next_load(buf: &mut BytesMut) -> Result<Option<bool>, RedisError> {
    // a SHA-1 in a bulk string, or an error: either way one line, or two
    let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    match buf.first() {
        Some(b'-') => {
            let _ = buf.split_to(end + 2);
            Ok(Some(false))
        }
        Some(b'$') => {
            let Some(Some((len, body))) = line(buf, 1) else {
                return Err(protocol("a SCRIPT LOAD reply"));
            };
            let Ok(len) = usize::try_from(len) else {
                return Err(protocol("a SCRIPT LOAD reply"));
            };
            if buf.len() < body + len + 2 {
                return Ok(None);
            }
            let _ = buf.split_to(body + len + 2);
            Ok(Some(true))
        }
        _ => Err(protocol("a SCRIPT LOAD reply")),
    }
}

/// The reply to a batch of `count` decisions, taken off `buf`: each
/// decision's answer, in order; `None` while incomplete.
pub fn next_answers(buf: &mut BytesMut, count: usize) -> Result<Option<Vec<Reply>>, RedisError> {
    if buf.first() != Some(&b'*') {
        // the whole call refused or failed
        return Ok(next_reply(buf)?.map(|reply| match reply {
            Ok(_) => (0..count)
                .map(|_| Err(protocol("a batch's reply")))
                .collect(),
            Err(e) => answers_to_failed_batch(&e, count),
        }));
    }
    let Some(header) = line(buf, 1) else {
        return Err(protocol("a batch's reply"));
    };
    let Some((n, mut at)) = header else {
        return Ok(None);
    };
    if usize::try_from(n).ok() != Some(count) {
        return Err(protocol(&format!("a batch of {count} answered with {n}")));
    }
    let mut answers = Vec::with_capacity(count);
    for _ in 0..count {
        let Some(rest) = buf.get(at..) else {
            return Ok(None);
        };
        match integers(rest) {
            // not an array of short integers: read it whole, whatever it is
            None => match decode(rest) {
                Ok(Some((frame, used))) => {
                    answers.push(reply_of(frame.into_bytes_frame()));
                    at += used;
                }
                Ok(None) => return Ok(None),
                Err(e) => return Err(protocol(&format!("an answer in a batch's reply: {e}"))),
            },
            Some(None) => return Ok(None),
            Some(Some((values, used))) => {
                answers.push(if values == [-1] {
                    Err(again_alone("its keys are not this server's now"))
                } else {
                    Ok(values)
                });
                at += used;
            }
        }
    }
    let _ = buf.split_to(at);
    Ok(Some(answers))
}

/// What each decision of a batch answered `e` as a whole gets: sent again
/// alone when the server ran nothing, else `e` (some may have spent).
fn answers_to_failed_batch(e: &RedisError, count: usize) -> Vec<Reply> {
    let answer = if ran_nothing(e) {
        again_alone(e.details())
    } else {
        e.clone()
    };
    vec![Err(answer); count]
}

/// Whether a call answered `e` was refused before it ran: a redirection, a
/// script the server does not have, a server busy, loading, read-only or
/// out of memory, a cluster that is down.
fn ran_nothing(e: &RedisError) -> bool {
    const REFUSED: [&str; 12] = [
        "MOVED ",
        "ASK ",
        "TRYAGAIN",
        "CROSSSLOT",
        "CLUSTERDOWN",
        "NOSCRIPT",
        "BUSY",
        "LOADING",
        "READONLY",
        "MASTERDOWN",
        "OOM ",
        "NOREPLICAS",
    ];
    REFUSED.iter().any(|p| e.details().starts_with(p))
}

const AGAIN_ALONE: &str = "BATCH-AGAIN-ALONE";

/// The answer of a decision to be sent again alone.
fn again_alone(why: &str) -> RedisError {
    RedisError::new(ErrorKind::Unknown, format!("{AGAIN_ALONE} {why}"))
}

/// Whether `e` asks for its decision to be sent again alone.
pub fn is_again_alone(e: &RedisError) -> bool {
    e.details().starts_with(AGAIN_ALONE)
}

/// Whether `e` says the server lacks the script (a batch's: load it again).
pub fn is_noscript(e: &RedisError) -> bool {
    e.details()
        .strip_prefix(AGAIN_ALONE)
        .is_some_and(|why| why.trim_start().starts_with("NOSCRIPT"))
}

fn protocol(what: &str) -> RedisError {
    RedisError::new(ErrorKind::Protocol, format!("unexpected {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(keys: &[&str], args: &[i64]) -> Decision {
        let keys: Vec<Key> = keys.iter().map(|k| Key::from(*k)).collect();
        let args: Vec<Value> = args.iter().map(|a| Value::Integer(*a)).collect();
        Decision::new(DecisionScript::Bucket, &keys, &args).expect("encoded")
    }

    /// The first decision's keys are declared; each later one's follow its
    /// arguments, where the script looks for them.
    #[test]
    fn a_batch_declares_its_first_decisions_keys_only() {
        let one = decision(&["a"], &[1, 1]);
        let two = decision(&["b", "c"], &[2, 7]);
        let mut out = Vec::new();
        write_batch(&mut out, &[one, two]);
        let sha = &scripts().batch_sha;
        let expected = format!(
            "*10\r\n$7\r\nEVALSHA\r\n$40\r\n{sha}\r\n$1\r\n1\r\n$1\r\na\r\n$1\r\n1\r\n$1\r\n1\r\n\
             $1\r\n2\r\n$1\r\n7\r\n$1\r\nb\r\n$1\r\nc\r\n"
        );
        assert_eq!(String::from_utf8(out).expect("text"), expected);

        let mut out = Vec::new();
        write_one(&mut out, &decision(&["a"], &[1, -1]));
        let sha = &scripts().single_sha;
        let expected = format!(
            "*6\r\n$7\r\nEVALSHA\r\n$40\r\n{sha}\r\n$1\r\n1\r\n$1\r\na\r\n$1\r\n1\r\n$2\r\n-1\r\n"
        );
        assert_eq!(String::from_utf8(out).expect("text"), expected);
        assert_ne!(scripts().single_sha, scripts().batch_sha);
    }

    /// A batch's reply read whole however it is cut; `{-1}` sends its
    /// decision again alone.
    #[test]
    fn a_batchs_answers_cut_anywhere_are_read_whole() {
        let wire: &[u8] = b"*3\r\n*6\r\n:1\r\n:4\r\n:-1\r\n:1\r\n:0\r\n:1\r\n*1\r\n:-1\r\n*6\r\n:0\r\n:0\r\n:3\r\n:5\r\n:0\r\n:0\r\n";
        for cut in 0..wire.len() {
            let mut buf = BytesMut::from(&wire[..cut]);
            assert!(
                next_answers(&mut buf, 3).expect("valid").is_none(),
                "cut at {cut}"
            );
            buf.extend_from_slice(&wire[cut..]);
            let answers = next_answers(&mut buf, 3).expect("valid").expect("whole");
            assert!(buf.is_empty());
            assert_eq!(
                answers[0].as_ref().expect("answer"),
                &vec![1, 4, -1, 1, 0, 1]
            );
            assert!(is_again_alone(answers[1].as_ref().expect_err("not here")));
            assert_eq!(
                answers[2].as_ref().expect("answer"),
                &vec![0, 0, 3, 5, 0, 0]
            );
        }
        let mut buf = BytesMut::from(&b"*2\r\n*1\r\n:1\r\n"[..]);
        assert!(
            next_answers(&mut buf, 3).is_err(),
            "a count that is not the batch's"
        );
    }

    /// Answers of any length (a descriptor of 16 or 64 limits answers 66 or
    /// 258 integers) beside short ones, and one that is not all short
    /// integers, are read whole however the reply is cut.
    #[test]
    fn long_answers_in_a_batch_are_read_whole() {
        let answer = |n: usize| -> (Vec<i64>, String) {
            let values: Vec<i64> = (0..n as i64).collect();
            let wire = values.iter().fold(format!("*{n}\r\n"), |mut w, v| {
                w.push_str(&format!(":{v}\r\n"));
                w
            });
            (values, wire)
        };
        let parts = [answer(6), answer(66), answer(258), answer(6)];
        let mut wire = format!("*{}\r\n", parts.len() + 1);
        for (_, w) in &parts {
            wire.push_str(w);
        }
        // an integer of 19 digits, past the short reader
        wire.push_str("*2\r\n:1\r\n:1234567890123456789\r\n");
        let wire = wire.into_bytes();
        for cut in 0..wire.len() {
            let mut buf = BytesMut::from(&wire[..cut]);
            assert!(
                next_answers(&mut buf, 5).expect("valid").is_none(),
                "cut at {cut}"
            );
            buf.extend_from_slice(&wire[cut..]);
            let answers = next_answers(&mut buf, 5).expect("valid").expect("whole");
            assert!(buf.is_empty());
            for (a, (values, _)) in answers.iter().zip(&parts) {
                assert_eq!(a.as_ref().expect("answer"), values);
            }
            assert_eq!(
                answers[4].as_ref().expect("answer"),
                &vec![1, 1_234_567_890_123_456_789]
            );
        }
    }

    /// A batch refused whole before it ran is sent again alone; one that
    /// failed while running (a decision may have spent) is not.
    #[test]
    fn a_batch_refused_whole_is_sent_again_only_when_nothing_ran() {
        for (wire, again) in [
            (&b"-MOVED 12 127.0.0.1:7001\r\n"[..], true),
            (b"-NOSCRIPT No matching script\r\n", true),
            (b"-BUSY Redis is busy running a script\r\n", true),
            (
                b"-OOM command not allowed when used memory > 'maxmemory'.\r\n",
                true,
            ),
            (
                b"-ERR user_script:1: Script attempted to access nonexistent global\r\n",
                false,
            ),
        ] {
            let mut buf = BytesMut::from(wire);
            let answers = next_answers(&mut buf, 2).expect("valid").expect("whole");
            assert_eq!(answers.len(), 2);
            for a in &answers {
                let e = a.as_ref().expect_err("refused");
                assert_eq!(is_again_alone(e), again, "{wire:?}: {e:?}");
            }
        }
        let mut buf = BytesMut::from(&b"-NOSCRIPT No matching script\r\n"[..]);
        let answers = next_answers(&mut buf, 2).expect("valid").expect("whole");
        assert!(answers.iter().all(|a| a.as_ref().is_err_and(is_noscript)));
    }

    #[test]
    fn a_script_load_is_taken_or_refused() {
        let sha = format!("$40\r\n{}\r\n", scripts().batch_sha);
        for cut in 0..sha.len() {
            let mut buf = BytesMut::from(&sha.as_bytes()[..cut]);
            assert_eq!(next_load(&mut buf).expect("valid"), None, "cut at {cut}");
        }
        let mut buf = BytesMut::from(format!("{sha}-ERR Error compiling script\r\n").as_bytes());
        assert_eq!(next_load(&mut buf).expect("valid"), Some(true));
        assert_eq!(next_load(&mut buf).expect("valid"), Some(false));
        assert!(buf.is_empty());
    }
}
