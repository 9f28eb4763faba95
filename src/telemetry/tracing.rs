//! Logs and traces.
//!
//! Logs go through `tracing` to stderr, human-readable or JSON
//! (`--log-format`), filtered by `RUST_LOG` (default [`DEFAULT_LOG_FILTER`]),
//! coloured only when stderr is a terminal: one line per
//! start, reload, failure-policy change and error, nothing per request.
//!
//! Traces: with `--otlp-endpoint`, spans of the [`SPAN_TARGET`] target (one
//! per `ShouldRateLimit`, a child per store call) are exported over OTLP/gRPC
//! by a batch processor. Only the OpenTelemetry layer is interested in that
//! target, so without an endpoint those span callsites are disabled and cost
//! a relaxed load each.

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::{Context, Result};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use tracing::Level;
use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

/// Logs kept when `RUST_LOG` is unset: ours at info; the Redis client's own
/// at error only, since its warnings while Redis is down repeat what the
/// breaker's one line says.
pub const DEFAULT_LOG_FILTER: &str = "info,fred=error";

/// The target of request spans, which only the trace exporter listens to.
pub const SPAN_TARGET: &str = "rls_trace";

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Keeps the trace exporter alive; flushes it when dropped.
pub struct TracingGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// The OTLP/gRPC exporter for `endpoint`, batching spans for at most a second.
pub fn tracer_provider(endpoint: &str) -> Result<SdkTracerProvider> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(5))
        .build()
        .with_context(|| format!("cannot set up the OTLP exporter for {endpoint}"))?;
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(Duration::from_secs(1))
                .with_max_queue_size(8192)
                .build(),
        )
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("tokenbucket-rls")
                .build(),
        )
        .build())
}

/// Installs the global subscriber: logs, plus traces when `otlp_endpoint` is set.
/// Must be called inside the Tokio runtime (the exporter uses it).
pub fn init(format: LogFormat, otlp_endpoint: Option<&str>) -> Result<TracingGuard> {
    // Both filters are static (per target and level), so every callsite that
    // no layer wants, such as h2's trace-level spans or our request spans
    // without an exporter, is disabled once instead of being checked (and its
    // span allocated) on every call.
    let logs_filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG_FILTER))
        .add_directive(
            format!("{SPAN_TARGET}=off")
                .parse()
                .context("span filter")?,
        );
    let logs = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(logs_filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(logs_filter)
            .boxed(),
    };
    let (traces, provider) = match otlp_endpoint {
        Some(endpoint) => {
            let provider = tracer_provider(endpoint)?;
            let layer = tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("tokenbucket-rls"))
                .with_filter(Targets::new().with_target(SPAN_TARGET, Level::INFO));
            (Some(layer), Some(provider))
        }
        None => (None, None),
    };
    // No `Option` layer for absent traces: a `None` layer answers
    // "always interested" for every callsite, which would have the registry
    // build every span (h2's and ours) on every request for nothing.
    match traces {
        Some(traces) => Registry::default().with(logs).with(traces).try_init(),
        None => Registry::default().with(logs).try_init(),
    }
    .context("cannot install the log subscriber")?;
    Ok(TracingGuard { provider })
}

/// Reads W3C `traceparent`/`tracestate` from gRPC metadata.
struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// The caller's trace context (Envoy's span), to continue its trace.
pub fn remote_context(metadata: &tonic::metadata::MetadataMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&MetadataExtractor(metadata))
}
