//! The gRPC listeners' connection gauges (`connection_bounds`): what an
//! operator sizes `--max-connections` by.

use prometheus::core::Collector;
use prometheus::IntGauge;

pub(super) struct ConnectionMetrics {
    open: IntGauge,
    limit: IntGauge,
}

impl ConnectionMetrics {
    pub(super) fn new() -> Self {
        let gauge = |name: &str, help: &str| IntGauge::new(name, help).expect("valid metric");
        Self {
            open: gauge(
                "rls_grpc_connections",
                "gRPC connections open now, every listener together (TLS handshakes included), counted each second",
            ),
            limit: gauge(
                "rls_grpc_connections_limit",
                "--max-connections: past it the next connection waits until one closes",
            ),
        }
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![Box::new(self.open.clone()), Box::new(self.limit.clone())]
    }

    pub(super) fn set(&self, open: usize, limit: usize) {
        self.open.set(i64::try_from(open).unwrap_or(i64::MAX));
        self.limit.set(i64::try_from(limit).unwrap_or(i64::MAX));
    }
}
