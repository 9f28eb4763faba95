//! For the memory tests (each its own binary, so that the resident set
//! sees only its own allocations): the resident set, and a one-bucket
//! descriptor of domain `edge`, `api_key=<value>`, as the limiter makes it.

use tokenbucket_rls::bucket::BucketParams;
use tokenbucket_rls::labels::RuleId;
use tokenbucket_rls::limiter::key::{bucket_key, descriptor_tag, KeyOrigin};
use tokenbucket_rls::rules::BucketValue;
use tokenbucket_rls::store::{BucketRef, DescriptorBuckets};

/// Resident set size of this process in bytes, from /proc.
pub fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .expect("rss field")
        .parse()
        .expect("number");
    pages * 4096
}

/// The descriptor `api_key=<value>` of domain `edge`: one bucket of
/// `params`, counted for `rule`.
pub fn api_key(value: &str, params: BucketParams, rule: RuleId) -> DescriptorBuckets {
    let tag = descriptor_tag(
        KeyOrigin::Rule,
        "edge",
        [("api_key", BucketValue::Value(value))].into_iter(),
    );
    DescriptorBuckets {
        buckets: vec![BucketRef {
            key: bucket_key(&tag, "0"),
            params,
            rule,
        }],
        tag,
        replication: None,
        ratelimit_key: None,
    }
}
