//! An operator's reset of a descriptor's buckets (`/v1/buckets/reset`,
//! `tokenbucket-rls inspect --reset`): their keys deleted on the primaries
//! that own them, and the names of the keys shown by the inspector.

use fred::bytes::Bytes;
use fred::prelude::*;

use super::reply::store_error;
use super::{redis_key, tag_hash, RedisStore};
use crate::store::key::escaped;
use crate::store::{DescriptorBuckets, StoreError};

impl RedisStore {
    /// Every key `descriptor`'s buckets are kept in now: the store's own
    /// (`rls:{H}:…`), or the current window's in envoyproxy/ratelimit's
    /// layout; the prefix in front.
    pub(super) fn keys_of(&self, descriptor: &DescriptorBuckets) -> Vec<Bytes> {
        if let Some(key) = self.counted_key_now(descriptor) {
            return vec![key];
        }
        let hash = tag_hash(&descriptor.tag);
        descriptor
            .buckets
            .iter()
            .map(|b| self.prefixed(redis_key(hash, &b.key)))
            .collect()
    }

    /// A client of the primary owning `key`'s slot now, with the store's
    /// options (an operator's calls: off the decisions' connections).
    pub(super) fn client_for(
        &self,
        key: &[u8],
    ) -> Result<fred::clients::WithOptions<fred::clients::Client>, StoreError> {
        let slot = fred::util::redis_keyslot(key);
        self.routing
            .read()
            .node_of_slot(slot)
            .map(|n| n.clients.pool.next().clone().with_options(&self.options))
            .ok_or_else(|| {
                StoreError::Connection(format!("no known Redis primary owns slot {slot}"))
            })
    }

    /// Deletes `descriptor`'s keys, each on the primary owning its slot;
    /// how many there were.
    pub(super) async fn forget_keys(
        &self,
        descriptor: &DescriptorBuckets,
    ) -> Result<u64, StoreError> {
        let mut removed = 0;
        for key in self.keys_of(descriptor) {
            let n: u64 = self
                .client_for(&key)?
                .custom(fred::cmd!("DEL"), vec![Value::Bytes(key)])
                .await
                .map_err(store_error)?;
            removed += n;
        }
        Ok(removed)
    }

    /// The keys' names as redis-cli shows them.
    pub(super) fn key_names_of(&self, descriptor: &DescriptorBuckets) -> Vec<String> {
        self.keys_of(descriptor)
            .iter()
            .map(|k| escaped(k))
            .collect()
    }
}
