//! What the watches of a single primary see, counted: the sentinels
//! disagreeing, decisions moved to another primary, and a server the
//! connections are on saying it is a replica
//! (`rls_store_primary_events_total{event}`).
//!
//! The watches start with the store, before the server hands it its
//! metrics ([`super::RedisStore::with_metrics`]); they count through a
//! slot filled then. What happens before that (at start-up) is logged only.
//!
//! **Layer:** store (the Redis store's rooms). Uses the telemetry leaf.

use std::sync::{Arc, OnceLock};

use crate::telemetry::Metrics;

/// Something a watch saw about which server is the primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrimaryEvent {
    /// The sentinels began to name different servers.
    SentinelsDisagree,
    /// Decisions moved to another primary.
    Moved,
    /// The server the connections are on says it is a replica (`ROLE`),
    /// while it still takes writes (`replica-read-only no`: no `READONLY`
    /// answer would tell).
    Demoted,
}

impl PrimaryEvent {
    pub const ALL: [PrimaryEvent; 3] = [Self::SentinelsDisagree, Self::Moved, Self::Demoted];

    /// The metric's `event` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SentinelsDisagree => "sentinels_disagree",
            Self::Moved => "moved",
            Self::Demoted => "demoted",
        }
    }
}

/// The server's metrics, once it has handed them over.
#[derive(Clone, Default)]
pub struct MetricsSlot(Arc<OnceLock<Arc<Metrics>>>);

impl MetricsSlot {
    pub fn fill(&self, metrics: Arc<Metrics>) {
        let _ = self.0.set(metrics);
    }

    /// Counts `event`; false while there are no metrics to count it in.
    pub fn count(&self, event: PrimaryEvent) -> bool {
        match self.0.get() {
            Some(m) => {
                m.primary_event(event.as_str());
                true
            }
            None => false,
        }
    }
}
