//! The shared ledger of RLQS buckets in Redis (or Redis Cluster): one hash
//! per bucket, stepped by `ledger.lua` with one `EVALSHA`, on the store's
//! connections and through the same breakers as the decisions. See
//! [`super::ledger`] for what a step does.
//!
//! **Its own time budget.** A step is off every request's path, and its
//! answer is of use for seconds (the share it returns stays reserved about
//! one assignment's life past the step), so it waits up to
//! [`STEP_PATIENCE`] for a node its breaker trusts, not `--redis-timeout`
//! (50 ms by default: a decision's budget on Envoy's path). With that
//! budget, on a 2-core box that Envoys under load keep busy, nearly every
//! step timed out: a woken process waited 50-250 ms, at times seconds, to
//! run (`/proc/<pid>/schedstat`), so the answers came back late, the
//! assignments lapsed and Envoy admitted everything (issue 56). A node
//! whose breaker is open fails a step at once.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fred::bytes::Bytes;
use fred::prelude::Value;

use super::allocation::Budget;
use super::ledger::{shared_from_reply, Demand, Held, Member, QuotaLedger, Shared, StepArgs};
use super::BucketKey;
use crate::store::breaker::Breakers;
use crate::store::key::put;
use crate::store::redis::{redis_key, tag_hash, LuaScript, RedisStore};
use crate::store::StoreError;

/// The step script, kept in its own file.
pub const SCRIPT: &str = include_str!("ledger.lua");

/// The longest a step waits for its answer from a node its breaker trusts
/// (a suspect node: `--redis-timeout`). About the time between two steps
/// of a bucket ([`super::SHARED_REFRESH_MICROS`]): an answer this late
/// still leaves seconds of the share it returns to assign.
pub const STEP_PATIENCE: Duration = Duration::from_secs(1);

pub struct RedisLedger {
    store: Arc<Breakers<RedisStore>>,
    script: LuaScript,
}

impl RedisLedger {
    pub fn new(store: Arc<Breakers<RedisStore>>) -> Self {
        Self {
            store,
            script: LuaScript::new(SCRIPT),
        }
    }
}

/// `rls:{<hash>}:quota\x01<domain><key><value>…`, each string with its
/// length in front: the bucket's hash, in the slot of its own name. (The
/// strings were joined with NUL, so `{a: "b\0c\0d"}` and `{a: b, c: d}`
/// shared a ledger; the `\x01` marks the new layout.) A `share_threshold`
/// bucket is `quota\x02<mask>…` (its [`BucketKey::shared`] bits, then the
/// same), so a pattern never shares a ledger with an id sending it as a value.
pub fn ledger_key(key: &BucketKey) -> Bytes {
    let mut name = Vec::with_capacity(64);
    if key.shared == 0 {
        name.extend_from_slice(b"quota\x01");
    } else {
        name.extend_from_slice(b"quota\x02");
        put(&mut name, &key.shared.to_le_bytes());
    }
    put(&mut name, key.domain.as_bytes());
    for (k, v) in &key.pairs {
        put(&mut name, k.as_bytes());
        put(&mut name, v.as_bytes());
    }
    redis_key(tag_hash(&name), &name)
}

/// The script's ARGV for one step.
pub fn script_args(member: Member, args: StepArgs) -> Vec<Value> {
    let mut out = Vec::with_capacity(14);
    out.push(Value::from(member.field()));
    out.extend(args.argv().into_iter().map(Value::Integer));
    out
}

#[async_trait]
impl QuotaLedger for RedisLedger {
    async fn step(
        &self,
        key: &BucketKey,
        member: Member,
        demand: Option<Demand>,
        held: Option<Held>,
        budget: Budget,
        ttl_ms: i64,
    ) -> Result<Shared, StoreError> {
        let args = script_args(member, StepArgs::new(demand, budget, ttl_ms).holding(held));
        let key = ledger_key(key);
        let redis = self.store.inner();
        let reply = self
            .store
            .guard_node(redis.node_of_key(&key), Some(STEP_PATIENCE), |patience| {
                redis.run_script(&self.script, key.clone(), &args, patience)
            })
            .await?;
        shared_from_reply(&reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(pairs: &[(&str, &str)]) -> BucketKey {
        BucketKey {
            domain: "edge".into(),
            pairs: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            shared: 0,
        }
    }

    /// Two different bucket ids never share a ledger, whatever bytes their
    /// values hold (NUL-joined, these two did).
    #[test]
    fn ids_whose_strings_join_alike_have_their_own_ledgers() {
        assert_ne!(
            ledger_key(&key(&[("a", "b\0c\0d")])),
            ledger_key(&key(&[("a", "b"), ("c", "d")]))
        );
        assert_ne!(
            ledger_key(&key(&[("ab", "c")])),
            ledger_key(&key(&[("a", "bc")]))
        );
        assert_eq!(
            ledger_key(&key(&[("a", "b")])),
            ledger_key(&key(&[("a", "b")]))
        );
        let pattern = BucketKey {
            shared: 1,
            ..key(&[("a", "b*")])
        };
        assert_ne!(ledger_key(&pattern), ledger_key(&key(&[("a", "b*")])));
    }
}
