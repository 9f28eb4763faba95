//! Telemetry beside the request path: Prometheus metrics, logs and traces.

pub mod metrics;

pub use metrics::Metrics;
pub mod tracing;
