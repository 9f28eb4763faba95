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

/// Reads the script's reply: `{admitted, then 5 numbers per bucket, taken}`;
/// a bucket's fifth number is what a charge forgave, or, for a fixed
/// window (`fixed_window`), the window's count after the hit.
pub(super) fn outcomes(
    reply: &[i64],
    buckets: usize,
    fixed_window: bool,
) -> Result<Vec<BucketOutcome>, StoreError> {
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
            forgiven: if fixed_window { 0 } else { c[4].max(0) as u64 },
            window_count: fixed_window.then_some(c[4].max(0) as u64),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_checked() {
        assert!(outcomes(&[1, 5], 1, false).is_err());
        assert!(outcomes(&[0, 0, 3, 7, 0, 0], 1, false).is_err());
        let o = outcomes(&[0, 0, 3, 7, 0, 12, 0], 1, false).expect("valid");
        assert_eq!((o[0].forgiven, o[0].window_count), (12, None));
        let fixed = outcomes(&[0, 0, 3, 7, 0, 12, 0], 1, true).expect("valid");
        assert_eq!((fixed[0].forgiven, fixed[0].window_count), (0, Some(12)));
        assert_eq!(o[0].retry_after_secs, Some(3));
        assert!(!o[0].admitted);
    }
}
