//! Telemetry beside the request path: Prometheus metrics, logs and traces.

pub mod metrics;
pub mod ratelimit_stats;

pub use metrics::Metrics;
pub mod tracing;
