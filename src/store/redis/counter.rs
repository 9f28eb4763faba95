//! Fixed windows counted as envoyproxy/ratelimit counts them, in its keys
//! and with its operations (its `src/redis/fixed_cache_impl.go`): `INCRBY
//! key hits` and `EXPIRE key <window length + jitter>`, pipelined, in
//! `prefix` + `domain_key_value_…_` + the window's start (Unix seconds, by
//! this service's clock, as that service's). No script: a decision costs
//! Redis two plain commands, and an instance of either service on the same
//! Redis counts the same budget (a rolling swap, a rollback).
//!
//! The count after the hit is all the decision needs: the verdict and the
//! answer are [`crate::window::decide`]'s, from the count before it (every
//! hit counts, the refused ones too, as there). A check (`hits_addend: 0`)
//! and a refund count 0 (`INCRBY key 0`, as there). Rules that need more
//! than a count (an attempt's record, a `WAIT`) are never counted here
//! ([`crate::rules::Rule::counts_in_ratelimit_keys`]).

use std::hash::BuildHasher;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fred::bytes::Bytes;
use fred::error::{Error as RedisError, ErrorKind};
use fred::prelude::*;
use fred::types::config::Options;

use super::nodes::NodeClients;
use super::reply::store_error;
use super::{RedisStore, Work};
use crate::bucket::{BucketOutcome, BucketState, Cost};
use crate::store::{DescriptorBuckets, StoreError};
use crate::window;

/// One count: `INCRBY key by`, then `EXPIRE key expire_secs`.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Count {
    pub(super) key: Bytes,
    pub(super) by: i64,
    pub(super) expire_secs: i64,
}

impl Count {
    /// Sends the two commands to `node` (each after `ASKING` when
    /// `asking`: the node importing the key's slot serves it); the count
    /// after `INCRBY`.
    pub(super) async fn run(
        &self,
        node: &NodeClients,
        options: &Options,
        asking: bool,
    ) -> Result<Vec<i64>, RedisError> {
        if let Some(pipes) = &node.pipes {
            return pipes
                .count(&self.key, self.by, self.expire_secs, asking)
                .await;
        }
        // boxed: fred's futures are kilobytes
        Box::pin(async {
            let client = node.pool.next();
            let pipeline = client.pipeline();
            let queue = pipeline.with_options(options);
            for (name, args) in [("INCRBY", self.by), ("EXPIRE", self.expire_secs)] {
                if asking {
                    let _: () = queue
                        .custom(fred::cmd!("ASKING"), Vec::<Value>::new())
                        .await?;
                }
                let command = fred::types::CustomCommand::new_static(name, None, false);
                let _: () = queue
                    .custom(
                        command,
                        vec![Value::Bytes(self.key.clone()), Value::Integer(args)],
                    )
                    .await?;
            }
            let replies = pipeline.try_all::<Value>().await;
            // INCRBY's reply: the second of four after ASKING, else the first
            let at = usize::from(asking);
            let count = replies
                .into_iter()
                .nth(at)
                .unwrap_or_else(|| Err(RedisError::new(ErrorKind::Protocol, "no reply")))?;
            Ok(vec![count.convert::<i64>()?])
        })
        .await
    }
}

/// `key` (envoyproxy/ratelimit's, without the prefix) and the window's
/// start in Unix seconds: the key it counts that window in.
pub(super) fn window_key(key: &[u8], start_secs: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 12);
    out.extend_from_slice(key);
    out.extend_from_slice(start_secs.to_string().as_bytes());
    out
}

/// A number of seconds in `[0, max)` at random (`max` 0: 0), as
/// envoyproxy/ratelimit's `Int63n`; not for secrets.
fn jitter(max: u64) -> u64 {
    if max == 0 {
        return 0;
    }
    std::collections::hash_map::RandomState::new().hash_one(max) % max
}

/// Now by this service's clock, in µs since the epoch (the window's start
/// is its, as envoyproxy/ratelimit's is).
fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_micros() as u64
}

impl RedisStore {
    /// The key, with the prefix, that `descriptor` counts in at
    /// `now_micros`; `None` for a descriptor of the store's own layout.
    fn counted_key(&self, descriptor: &DescriptorBuckets, now_micros: u64) -> Option<Bytes> {
        let key = descriptor.ratelimit_key.as_deref()?;
        let bucket = descriptor.buckets.first()?;
        let (start, _) = window::window_of(&bucket.params, now_micros);
        Some(self.prefixed(Bytes::from(window_key(key, start / 1_000_000))))
    }

    /// The key, with the prefix, that `descriptor` counts in now; `None`
    /// for a descriptor of the store's own layout.
    pub(super) fn counted_key_now(&self, descriptor: &DescriptorBuckets) -> Option<Bytes> {
        self.counted_key(descriptor, now_micros())
    }

    /// The slot `descriptor` counts in now, for a descriptor counted in
    /// envoyproxy/ratelimit's keys (its breaker's node).
    pub(super) fn counted_slot(&self, descriptor: &DescriptorBuckets) -> Option<u16> {
        self.counted_key(descriptor, now_micros())
            .map(|k| fred::util::redis_keyslot(&k))
    }

    /// Decides `cost` on `descriptor`'s one fixed window, counted in
    /// envoyproxy/ratelimit's `key`.
    pub(super) async fn decide_counted(
        &self,
        descriptor: &DescriptorBuckets,
        key: &[u8],
        cost: Cost,
        patience: Option<Duration>,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        let [bucket] = descriptor.buckets.as_slice() else {
            return Err(StoreError::Script(format!(
                "a window counted in envoyproxy/ratelimit's keys has one limit, not {}",
                descriptor.buckets.len()
            )));
        };
        let by = match cost {
            Cost::Spend(n) | Cost::Charge(n) => n,
            Cost::Check | Cost::Refund(_) => 0,
            Cost::GiveBack { .. } | Cost::Lease { .. } => {
                return Err(StoreError::Script(format!(
                    "{cost:?} on a window counted in envoyproxy/ratelimit's keys"
                )))
            }
        };
        let by = i64::try_from(by).unwrap_or(i64::MAX);
        let now = now_micros();
        let (start, _) = window::window_of(&bucket.params, now);
        let full = self.prefixed(Bytes::from(window_key(key, start / 1_000_000)));
        let slot = fred::util::redis_keyslot(&full);
        let length = bucket.params.unit_secs.max(1);
        let count = Count {
            key: full,
            by,
            expire_secs: i64::try_from(length + jitter(self.expiry_jitter_max_secs))
                .unwrap_or(i64::MAX),
        };
        let patient = self.patient(patience);
        let options = patient.as_ref().unwrap_or(&self.options);
        let reply = self
            .run(Work::Count(&count), slot, options)
            .await
            .map_err(store_error)?;
        let after = *reply
            .first()
            .ok_or_else(|| StoreError::Script("INCRBY answered no count".into()))?;
        // (a count taken below 0 by hand is a count of none)
        let before = after.saturating_sub(by).max(0);
        let state = BucketState {
            tokens: before as f64,
            updated_micros: start,
        };
        let (_, outcomes) = window::decide(
            std::slice::from_ref(&bucket.params),
            &[Some(state)],
            now,
            cost,
        );
        Ok(outcomes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_key_ends_with_its_start() {
        assert_eq!(
            window_key(b"domain_key_value_", 1234),
            b"domain_key_value_1234"
        );
        assert_eq!(window_key(b"d_", 0), b"d_0");
    }

    #[test]
    fn jitter_stays_below_its_bound() {
        assert_eq!(jitter(0), 0);
        for _ in 0..1000 {
            assert!(jitter(7) < 7);
        }
        // not one value every time
        let seen: std::collections::HashSet<u64> = (0..1000).map(|_| jitter(1000)).collect();
        assert!(seen.len() > 100, "{}", seen.len());
    }
}
