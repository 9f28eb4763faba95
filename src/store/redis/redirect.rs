//! Where a primary sends a call for a slot it does not serve (`MOVED`,
//! `ASK`), read from its error, and how many such answers a call follows.

use fred::error::{Error as RedisError, ErrorKind};

/// Redirections one call follows at most (a slot moving under load can
/// send a call on more than once: ASK, then MOVED, then a stale owner).
pub(super) const MAX_REDIRECTIONS: usize = 5;

/// Where a primary sends a call for a slot it does not serve; the call did
/// not run there.
#[derive(Debug, PartialEq)]
pub(super) enum Redirect {
    /// `MOVED <slot> <addr>`: the slot lives there now.
    Moved(String),
    /// `ASK <slot> <addr>`: the slot is moving there; ask it this once.
    Ask(String),
}

pub(super) fn redirect_of(e: &RedisError) -> Option<Redirect> {
    if *e.kind() != ErrorKind::Cluster {
        return None;
    }
    let mut parts = e.details().split_whitespace();
    let (kind, _slot, addr) = (parts.next()?, parts.next()?, parts.next()?);
    match kind {
        "MOVED" => Some(Redirect::Moved(addr.to_string())),
        "ASK" => Some(Redirect::Ask(addr.to_string())),
        _ => None,
    }
}
