//! The answer for one descriptor: what the limiter decided ([`Verdict`],
//! [`Decision`], the [`ShownLimit`] Envoy is told of). Read by the faces
//! and counted by telemetry, so it lives below both (the limiter makes it,
//! `crate::limiter` names it too).
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `telemetry`; uses `rules`.

use std::sync::Arc;

use crate::rules::{Rule, Unit};

/// What happened to one descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Admitted by its buckets.
    Ok,
    OverLimit,
    /// Over the limit, but the rule is in shadow mode: answered OK.
    Shadow,
    /// Over the limit, but the rule is in quota mode: answered OK and reported.
    QuotaExceeded,
    Unlimited,
    /// No rule applies (or its only limits were replaced).
    NoRule,
    /// The store failed and the rule fails open: answered OK.
    FailedOpen,
}

impl Verdict {
    /// The `result` label of `rls_decisions_total`.
    pub fn result_label(self) -> &'static str {
        match self {
            Verdict::Ok | Verdict::FailedOpen => "ok",
            Verdict::OverLimit | Verdict::QuotaExceeded => "over_limit",
            Verdict::Shadow => "shadow",
            Verdict::Unlimited => "unlimited",
            Verdict::NoRule => "no_rule",
        }
    }

    pub fn is_over_limit(self) -> bool {
        self == Verdict::OverLimit
    }
}

/// The limit reported back to Envoy as `current_limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShownLimit {
    pub name: String,
    pub requests_per_unit: u32,
    pub unit: Unit,
    /// B: the most tokens its bucket holds.
    pub burst: u64,
}

/// The answer for one descriptor.
#[derive(Debug, Clone)]
pub struct Decision {
    pub verdict: Verdict,
    pub limit: Option<ShownLimit>,
    /// Whole tokens left in the deciding bucket.
    pub remaining: u64,
    /// OVER_LIMIT: seconds until a retry can pass (`None`: never, e.g. r = 0);
    /// OK: seconds until the bucket is full again.
    pub reset_secs: Option<u64>,
    /// The rule that decided, for metrics and logs.
    pub rule: Option<Arc<Rule>>,
}

impl Decision {
    pub(crate) fn without_limit(verdict: Verdict, rule: Option<Arc<Rule>>) -> Self {
        Self {
            verdict,
            limit: None,
            remaining: 0,
            reset_secs: None,
            rule,
        }
    }
}
