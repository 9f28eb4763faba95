//! A bucket's key: its domain and its id's pairs, sorted (a
//! `share_threshold` bucket's with the pattern bits), what a bucket id may
//! hold, and the hash of one.

use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;

use super::{MAX_ID_ENTRIES, MAX_ID_KEY_OR_VALUE_BYTES};

/// A bucket: its domain and its id's pairs, sorted.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketKey {
    pub domain: String,
    pub pairs: Vec<(String, String)>,
    /// 0 for a bucket id as Envoy sent it. For a `share_threshold` bucket,
    /// bit `i` says that `pairs[i]`'s value is the pattern every value it
    /// matches shares (so no id Envoy sends is taken for it).
    pub shared: u64,
}

impl BucketKey {
    pub(super) fn new(domain: &str, id: &BucketId) -> Self {
        let mut pairs: Vec<(String, String)> = id
            .bucket
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        pairs.sort_unstable();
        Self {
            domain: domain.to_owned(),
            pairs,
            shared: 0,
        }
    }

    /// Bytes of its strings (what [`MAX_KEY_BYTES`] counts).
    pub(super) fn bytes(&self) -> usize {
        self.domain.len()
            + self
                .pairs
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
    }

    pub fn id(&self) -> BucketId {
        BucketId {
            bucket: self.pairs.iter().cloned().collect(),
        }
    }
}

/// Whether a bucket id is within the bounds a descriptor has: at least
/// one entry, at most [`MAX_ID_ENTRIES`], keys and values at most
/// [`MAX_ID_KEY_OR_VALUE_BYTES`].
pub(super) fn valid_id(id: &BucketId) -> bool {
    !id.bucket.is_empty()
        && id.bucket.len() <= MAX_ID_ENTRIES
        && id.bucket.iter().all(|(k, v)| {
            k.len() <= MAX_ID_KEY_OR_VALUE_BYTES && v.len() <= MAX_ID_KEY_OR_VALUE_BYTES
        })
}

/// A bucket id's hash, for a carried grant's member tag.
pub(super) fn hash_of(id: &BucketKey) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one(id)
}
