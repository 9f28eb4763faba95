//! Arbitrary bytes as a `RateLimitRequest` against the memory store and the
//! example rules: the service must answer (a decision or INVALID_ARGUMENT),
//! never panic, and a rejected request must not change any bucket.
#![no_main]

use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tokenbucket_rls::cli::HeaderFormat;
use tokenbucket_rls::clock::MonotonicClock;
use tokenbucket_rls::limiter::Limiter;
use tokenbucket_rls::rules::{load_path, FailureMode, LoadOptions};
use tokenbucket_rls::service::{RateLimitGrpc, ResponseOptions};
use tokenbucket_rls::store::memory::MemoryStore;

fn service() -> &'static (RateLimitGrpc, Arc<MemoryStore<MonotonicClock>>) {
    static SERVICE: OnceLock<(RateLimitGrpc, Arc<MemoryStore<MonotonicClock>>)> = OnceLock::new();
    SERVICE.get_or_init(|| {
        let rules = load_path(
            concat!(env!("CARGO_MANIFEST_DIR"), "/../config").as_ref(),
            LoadOptions::default(),
        )
        .expect("the example rules load");
        let store = Arc::new(MemoryStore::new(MonotonicClock::new()));
        let limiter = Arc::new(Limiter::new(store.clone(), FailureMode::Open, 1, Arc::default()));
        let service = RateLimitGrpc::new(
            Arc::new(ArcSwap::from_pointee(rules.with_generation(1))),
            limiter,
            Arc::default(),
            ResponseOptions {
                rate_limit_headers: Some(HeaderFormat::Draft),
                dynamic_metadata: true,
                ..ResponseOptions::default()
            },
        );
        (service, store)
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(request) = RateLimitRequest::decode(data) else {
        return;
    };
    let (service, store) = service();
    let before = store.len();
    match futures::executor::block_on(service.should_rate_limit(&request, None)) {
        Ok(response) => assert_eq!(response.statuses.len(), request.descriptors.len()),
        Err(status) => {
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
            assert_eq!(store.len(), before, "a rejected request stored nothing");
        }
    }
});
