//! What a call runs on the primary owning its slot: a script (the
//! decisions' `bucket.lua`, batched, or another of the service's), or
//! envoyproxy/ratelimit's count of a fixed window.

use fred::types::{Key, Value};

use super::{batch, counter};
use crate::replication::Replication;

/// What a call runs on the primary owning its slot.
#[derive(Clone, Copy)]
pub(super) enum Work<'a> {
    /// A script (`bucket.lua`'s decisions batched), its write followed by
    /// `WAIT` for a rule's `replication:`.
    Script {
        script: &'a LuaScript,
        keys: &'a [Key],
        args: &'a [Value],
        wait: Option<Replication>,
    },
    /// envoyproxy/ratelimit's count of a fixed window ([`counter`]).
    Count(&'a counter::Count),
}

/// A Lua script and its SHA-1, for `EVALSHA`.
#[derive(Debug, Clone)]
pub struct LuaScript {
    pub(super) body: &'static str,
    pub(super) sha: String,
    /// A decision script (`bucket.lua`, `one.lua`), whose calls the
    /// pipelined connections batch.
    pub(super) decisions: Option<batch::DecisionScript>,
}

impl LuaScript {
    pub fn new(body: &'static str) -> Self {
        Self {
            body,
            sha: sha1_smol::Sha1::from(body).digest().to_string(),
            decisions: None,
        }
    }

    /// A decision script.
    pub(super) fn decisions(script: batch::DecisionScript) -> Self {
        let (sha, body) = batch::scripts().of(script);
        Self {
            body,
            sha: sha.to_owned(),
            decisions: Some(script),
        }
    }
}
