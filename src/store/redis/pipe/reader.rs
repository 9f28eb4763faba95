//! A pipelined connection's reader: parses the replies as they come, as
//! many as one read brought, and answers the calls in the order they were
//! written (a batch's replies to its decisions, the batch script's load
//! noted).

use std::sync::atomic::{AtomicU8, Ordering};

use fred::bytes::BytesMut;
use fred::error::{Error as RedisError, ErrorKind};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::oneshot;

use super::pending::{Pending, Waiting, BATCH_LOADED, BATCH_REFUSED, BATCH_UNKNOWN};
use crate::store::redis::batch;
use crate::store::redis::resp::{next_reply, Reply};

/// How the reader reads the next reply.
enum Next {
    One,
    Asking,
    Batch(usize),
    Load,
    Held,
    Wait,
}

/// Reads replies and answers the calls waiting for them, until the
/// connection fails or a reply comes that nothing waits for.
pub(super) async fn read_replies<R: AsyncRead + Unpin>(
    reader: &mut R,
    pending: &Pending,
    script: &AtomicU8,
) -> Result<(), RedisError> {
    let mut buf = BytesMut::with_capacity(16 * 1024);
    // replies of calls with `replication:`, until their write's `WAIT`
    // answers (dropped with the connection: their callers get an error)
    let mut held: Vec<(oneshot::Sender<Reply>, Vec<i64>)> = Vec::new();
    loop {
        let n = reader
            .read_buf(&mut buf)
            .await
            .map_err(|e| RedisError::new(ErrorKind::IO, e.to_string()))?;
        if n == 0 {
            return Err(RedisError::new(
                ErrorKind::IO,
                "Redis closed the connection",
            ));
        }
        while !buf.is_empty() {
            // what the next reply answers decides how it is read
            let next = match pending.lock().front() {
                None => {
                    return Err(RedisError::new(
                        ErrorKind::Protocol,
                        "a Redis reply that no call was waiting for",
                    ))
                }
                Some(Waiting::One(_)) => Next::One,
                Some(Waiting::Batch(answers)) => Next::Batch(answers.len()),
                Some(Waiting::Load) => Next::Load,
                Some(Waiting::Asking) => Next::Asking,
                Some(Waiting::Held(_)) => Next::Held,
                Some(Waiting::Wait) => Next::Wait,
            };
            match next {
                Next::One => {
                    let Some(reply) = next_reply(&mut buf)? else {
                        break;
                    };
                    if let Some(Waiting::One(answer)) = pending.lock().pop_front() {
                        let _ = answer.send(reply);
                    }
                }
                Next::Held => {
                    let Some(reply) = next_reply(&mut buf)? else {
                        break;
                    };
                    if let Some(Waiting::Held(answer)) = pending.lock().pop_front() {
                        match reply {
                            Ok(values) => held.push((answer, values)),
                            // refused or failed: nothing to wait for
                            Err(e) => {
                                let _ = answer.send(Err(e));
                            }
                        }
                    }
                }
                Next::Wait => {
                    let Some(reply) = next_reply(&mut buf)? else {
                        break;
                    };
                    pending.lock().pop_front();
                    let acked = match reply {
                        Ok(values) => values.first().copied().ok_or_else(|| {
                            RedisError::new(ErrorKind::Protocol, "an empty WAIT reply")
                        }),
                        Err(e) => Err(e),
                    };
                    for (answer, mut values) in held.drain(..) {
                        let _ = answer.send(match &acked {
                            Ok(n) => {
                                values.push(*n);
                                Ok(values)
                            }
                            Err(e) => {
                                Err(RedisError::new(e.kind().clone(), e.details().to_string()))
                            }
                        });
                    }
                }
                Next::Asking => {
                    // `+OK`; an error here shows in the command's reply
                    let Some(_) = next_reply(&mut buf)? else {
                        break;
                    };
                    pending.lock().pop_front();
                }
                Next::Load => {
                    let Some(loaded) = batch::next_load(&mut buf)? else {
                        break;
                    };
                    pending.lock().pop_front();
                    if !loaded {
                        tracing::info!("Redis refused the batch script (Redis 7 runs it): decisions go one per call");
                        script.store(BATCH_REFUSED, Ordering::Relaxed);
                    }
                }
                Next::Batch(count) => {
                    let Some(replies) = batch::next_answers(&mut buf, count)? else {
                        break;
                    };
                    if replies
                        .first()
                        .is_some_and(|r| r.as_ref().is_err_and(batch::is_noscript))
                    {
                        // flushed: loaded again before the next batch
                        let _ = script.compare_exchange(
                            BATCH_LOADED,
                            BATCH_UNKNOWN,
                            Ordering::Relaxed,
                            Ordering::Relaxed,
                        );
                    }
                    if let Some(Waiting::Batch(answers)) = pending.lock().pop_front() {
                        for (answer, reply) in answers.into_iter().zip(replies) {
                            let _ = answer.send(reply);
                        }
                    }
                }
            }
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(16 * 1024);
        }
    }
}
