//! What Redis answers, read for the store: a decision script's reply into
//! its buckets' outcomes, and fred's errors into the store's.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! part of `store`; uses `bucket`.

use fred::error::{Error as RedisError, ErrorKind};

use crate::bucket::{BucketOutcome, NeverReason};
use crate::store::StoreError;

pub(super) fn store_error(e: RedisError) -> StoreError {
    match e.kind() {
        ErrorKind::Timeout => StoreError::Timeout,
        ErrorKind::IO
        | ErrorKind::Canceled
        | ErrorKind::Routing
        | ErrorKind::Cluster
        | ErrorKind::Backpressure => StoreError::Connection(e.to_string()),
        _ if e.details().contains("OOM command not allowed") => {
            StoreError::OutOfMemory(e.details().to_string())
        }
        _ => StoreError::Script(e.to_string()),
    }
}

/// Reads the script's reply: `{admitted, then 5 numbers per bucket, taken}`.
pub(super) fn outcomes(reply: &[i64], buckets: usize) -> Result<Vec<BucketOutcome>, StoreError> {
    if reply.len() != 2 + 5 * buckets {
        return Err(StoreError::Script(format!(
            "unexpected script reply of {} values for {buckets} buckets",
            reply.len()
        )));
    }
    let admitted = reply[0] == 1;
    let taken = reply[reply.len() - 1].max(0) as u64;
    Ok(reply[1..reply.len() - 1]
        .chunks_exact(5)
        .map(|c| BucketOutcome {
            admitted,
            remaining: c[0].max(0) as u64,
            retry_after_secs: (c[1] >= 0).then_some(c[1] as u64),
            full_in_secs: c[2].max(0) as u64,
            never: match c[3] {
                1 => Some(NeverReason::ZeroRate),
                2 => Some(NeverReason::CostAboveCapacity),
                _ => None,
            },
            taken,
            forgiven: c[4].max(0) as u64,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_checked() {
        assert!(outcomes(&[1, 5], 1).is_err());
        assert!(outcomes(&[0, 0, 3, 7, 0, 0], 1).is_err());
        let o = outcomes(&[0, 0, 3, 7, 0, 12, 0], 1).expect("valid");
        assert_eq!(o[0].forgiven, 12);
        assert_eq!(o[0].retry_after_secs, Some(3));
        assert!(!o[0].admitted);
    }
}
