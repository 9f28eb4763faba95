//! What a descriptor holds beyond what a check answers, read for the
//! bucket inspector (`/v1/buckets`, `tokenbucket-rls inspect`): each token
//! bucket's debt, the reservations and the slots it holds. Reads only, on
//! the primary owning the descriptor's slot (all its keys share its tag).

use fred::bytes::Bytes;
use fred::prelude::*;
use fred::types::Value;

use super::reply::store_error;
use super::{redis_key, tag_hash, unpack_bucket, RedisStore};
use crate::bucket::{Algorithm, BucketState};
use crate::store::key::{reservations_key, slots_key};
use crate::store::{debt_of, DescriptorBuckets, Held, StoreError};

impl RedisStore {
    pub(super) async fn held_of(&self, descriptor: &DescriptorBuckets) -> Result<Held, StoreError> {
        let hash = tag_hash(&descriptor.tag);
        let reservations = self.prefixed(redis_key(hash, &reservations_key(&descriptor.tag)));
        let client = self.client_for(&reservations)?;
        // the server's clock, as the scripts decide by it
        let time: Vec<String> = client
            .custom(fred::cmd!("TIME"), Vec::<Value>::new())
            .await
            .map_err(store_error)?;
        let now_micros = match time.as_slice() {
            [secs, micros] => secs
                .parse::<u64>()
                .ok()
                .zip(micros.parse::<u64>().ok())
                .map(|(s, us)| s * 1_000_000 + us),
            _ => None,
        }
        .ok_or_else(|| StoreError::Script(format!("TIME answered {time:?}")))?;
        let now_ms = now_micros / 1000;
        let mut debts = Vec::with_capacity(descriptor.buckets.len());
        for b in &descriptor.buckets {
            if b.params.algorithm != Algorithm::TokenBucket || descriptor.ratelimit_key.is_some() {
                debts.push(0);
                continue;
            }
            let key = self.prefixed(redis_key(hash, &b.key));
            // a hash of an earlier version answers WRONGTYPE: no debt shown
            let value: Option<Bytes> = client
                .custom(fred::cmd!("GET"), vec![Value::Bytes(key)])
                .await
                .ok()
                .flatten();
            let debt =
                value
                    .as_deref()
                    .and_then(unpack_bucket)
                    .map_or(0, |(tokens, updated, _)| {
                        let state = BucketState {
                            tokens,
                            updated_micros: updated as u64,
                        };
                        debt_of(b.params.refill(Some(state), now_micros).tokens)
                    });
            debts.push(debt);
        }
        // unsettled reservations and slots: sorted sets of id -> the time
        // (ms) each returns
        let live = |key: Bytes| {
            let client = client.clone();
            async move {
                client
                    .custom::<u64, Value>(
                        fred::cmd!("ZCOUNT"),
                        vec![
                            Value::Bytes(key),
                            Value::from(format!("({now_ms}")),
                            Value::from("+inf"),
                        ],
                    )
                    .await
                    .map_err(store_error)
            }
        };
        let slots = self.prefixed(redis_key(hash, &slots_key(&descriptor.tag)));
        Ok(Held {
            debts,
            reservations: live(reservations).await?,
            slots: live(slots).await?,
        })
    }
}
