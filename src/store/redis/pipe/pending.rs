//! What a pipelined connection's calls wait for, in the order they were
//! written: the state its writer ([`super::writer`]) appends to and its
//! reader ([`super::reader`]) takes from, and the error a call gets when the
//! connection is lost with it in flight.

use std::collections::VecDeque;

use fred::error::{Error as RedisError, ErrorKind};
use tokio::sync::oneshot;

use crate::store::redis::resp::Reply;

/// The replies the calls written wait for, in order.
pub(super) type Pending = parking_lot::Mutex<VecDeque<Waiting>>;

/// What a write's reply answers, in the order written.
pub(super) enum Waiting {
    One(oneshot::Sender<Reply>),
    /// A batch's decisions, in their order in the call.
    Batch(Vec<oneshot::Sender<Reply>>),
    /// The connection's `SCRIPT LOAD` of the batch script.
    Load,
    /// `ASKING`'s reply, read and dropped.
    Asking,
    /// A call of a rule with `replication:`: its reply is held until the
    /// write's [`Waiting::Wait`] answers.
    Held(oneshot::Sender<Reply>),
    /// The write's `WAIT`: its count is added at the end of every held
    /// reply, which is then answered.
    Wait,
}

/// Whether a connection's server has taken the batch script.
pub(super) const BATCH_UNKNOWN: u8 = 0;
pub(super) const BATCH_LOADED: u8 = 1;
pub(super) const BATCH_REFUSED: u8 = 2;

/// A call written on a connection that failed before its reply came.
pub(super) fn lost() -> RedisError {
    RedisError::new(
        ErrorKind::IO,
        "the Redis connection was lost before the reply (the call may have run)",
    )
}

/// The connection ended: every call written and not yet answered gets
/// [`lost`] (it may have run).
pub(super) fn fail_all(pending: &Pending) {
    for waiting in std::mem::take(&mut *pending.lock()) {
        match waiting {
            Waiting::One(answer) | Waiting::Held(answer) => {
                let _ = answer.send(Err(lost()));
            }
            Waiting::Batch(answers) => {
                for answer in answers {
                    let _ = answer.send(Err(lost()));
                }
            }
            Waiting::Load | Waiting::Asking | Waiting::Wait => {}
        }
    }
}
