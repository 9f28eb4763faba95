//! The instances sharing this Redis count themselves: each announces its
//! id in one sorted set with a time to live (`instances.lua`), and reads
//! how many announcements have not lapsed ([`crate::instances`]).

use std::sync::LazyLock;
use std::time::Duration;

use fred::bytes::Bytes;
use fred::types::Value;

use super::{LuaScript, RedisStore};
use crate::store::StoreError;

static SCRIPT: LazyLock<LuaScript> =
    LazyLock::new(|| LuaScript::new(include_str!("instances.lua")));

/// The sorted set's key (behind `--redis-key-prefix`: instances with
/// another prefix count apart, as their budgets are apart).
const KEY: &[u8] = b"rls:instances";

impl RedisStore {
    /// Announces instance `id` for `ttl` (zero: withdraws it) and returns
    /// how many instances' announcements have not lapsed, this one's
    /// included.
    pub async fn announce(&self, id: &str, ttl: Duration) -> Result<u32, StoreError> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let reply = self
            .run_script(
                &SCRIPT,
                Bytes::from_static(KEY),
                &[Value::from(id), Value::Integer(ttl_ms)],
                None,
            )
            .await?;
        match reply[..] {
            [n] => Ok(u32::try_from(n).unwrap_or(u32::MAX)),
            _ => Err(StoreError::Script(format!(
                "an instances count of {} values",
                reply.len()
            ))),
        }
    }
}
