//! Telemetry beside the request path: Prometheus metrics, logs and traces.

pub mod metrics;
pub mod ratelimit_stats;
pub mod statsd;

pub use metrics::Metrics;
pub mod tracing;
