//! The attempts' metrics: calls of attempts by what happened to them
//! (`rls_attempts_total{domain, rule, result}`; the results are
//! [`crate::attempt::AttemptResult`]'s labels), and the tokens a debt
//! bound forgave usage charges (`rls_debt_forgiven_tokens_total`), and
//! what refused requests gave back (`rls_given_back_total`).

use prometheus::{IntCounterVec, Opts};

use crate::labels::RuleId;

/// Counters of [`crate::attempt`].
pub(super) struct AttemptMetrics {
    pub(super) attempts: IntCounterVec,
    /// Tokens charges could not take for a debt bound.
    pub(super) forgiven: IntCounterVec,
    /// Descriptors of refused requests given back what they took.
    pub(super) given_back: IntCounterVec,
}

impl AttemptMetrics {
    pub(super) fn new() -> Self {
        Self {
            attempts: IntCounterVec::new(
                Opts::new(
                    "rls_attempts_total",
                    "Calls of attempts on rules with `attempts:`, by result: first, repeat (answered as before, nothing charged), settled, late (settled after the ttl), unknown (a done call with no record: charged in full), full (no room to remember it), expired (a reservation never settled: kept as spent), no_id (no attempt entry), released (a done call gave back its slot), not_held (a done call found no slot: its start was refused, or the slot had returned), reused (a live attempt's start repeated past max_repeats: refused)",
                ),
                &["domain", "rule", "result"],
            )
            .expect("valid metric"),
            forgiven: IntCounterVec::new(
                Opts::new(
                    "rls_debt_forgiven_tokens_total",
                    "Tokens usage charges could not take because the rule's debt bound (max_debt, else one burst) stopped them, summed over the rule's limits",
                ),
                &["domain", "rule"],
            )
            .expect("valid metric"),
            given_back: IntCounterVec::new(
                Opts::new(
                    "rls_given_back_total",
                    "Descriptors given back what they took (tokens, a reservation, a slot), by the rule that took it, reason (refused: the request was answered OVER_LIMIT; late: the answer came after the caller's deadline, or an attempt's start timed out) and result: ok; unanswered (sent, no answer in time: it may still have run); failed (not sent, or refused: it stays spent). Never re-sent",
                ),
                &["domain", "rule", "reason", "result"],
            )
            .expect("valid metric"),
        }
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.attempts.clone()),
            Box::new(self.forgiven.clone()),
            Box::new(self.given_back.clone()),
        ]
    }

    /// `n` calls of `rule`'s attempts ended as `result`.
    pub(super) fn count(&self, rule: RuleId, result: &str, n: u64) {
        let (domain, rule) = rule.labels();
        self.attempts
            .with_label_values(&[&domain, &rule, result])
            .inc_by(n);
    }
}
