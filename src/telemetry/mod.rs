//! Telemetry beside the request path: Prometheus metrics, logs and traces.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under the rule sources; uses `decision`, `rules` and leaves: what the
//! rooms above count reaches it as their labels and numbers.

pub mod hitters;
pub mod metrics;
pub mod ratelimit_stats;
pub mod statsd;

pub use metrics::Metrics;
pub mod tracing;
