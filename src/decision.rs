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
    /// Over a quota-mode limit while another quota-mode descriptor of the
    /// request has room: its status says OVER_LIMIT, the request passes
    /// ([`settle_quotas`]).
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
    /// The window `requests_per_unit` is per, in seconds: the unit's
    /// length, times the rule's `unit_multiplier`.
    pub window_secs: u64,
    /// B: the most tokens its bucket holds.
    pub burst: u64,
}

impl ShownLimit {
    /// The rate as Envoy's `RateLimit` can carry it (a count per one
    /// unit, no multiplier): as the rule says when its window is one unit;
    /// else the same rate per the shortest unit, from the rule's own up,
    /// in which it is a whole number ("3 per 30 s" is 6 per minute); else
    /// per the longest unit whose count fits, rounded down (the closest
    /// a whole count comes: "5 per 13 s" is 12,129,230 a year).
    pub fn on_the_wire(&self) -> (u32, Unit) {
        if self.window_secs == self.unit.seconds() || self.window_secs == 0 {
            return (self.requests_per_unit, self.unit);
        }
        let rate = u128::from(self.requests_per_unit);
        let window = u128::from(self.window_secs);
        for unit in Unit::ALL.into_iter().filter(|u| *u >= self.unit) {
            let scaled = rate * u128::from(unit.seconds());
            if scaled % window == 0 {
                if let Ok(n) = u32::try_from(scaled / window) {
                    return (n, unit);
                }
            }
        }
        Unit::ALL
            .into_iter()
            .rev()
            .filter(|u| *u >= self.unit)
            .find_map(|unit| {
                let n = u32::try_from(rate * u128::from(unit.seconds()) / window).ok()?;
                Some((n, unit))
            })
            .unwrap_or((u32::MAX, self.unit))
    }
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
    /// A fixed window's count after this hit (the deciding bucket's), for
    /// envoyproxy/ratelimit's near/over statistics; `None` otherwise.
    pub window_count: Option<u64>,
}

impl Decision {
    pub(crate) fn without_limit(verdict: Verdict, rule: Option<Arc<Rule>>) -> Self {
        Self {
            verdict,
            limit: None,
            remaining: 0,
            reset_secs: None,
            rule,
            window_count: None,
        }
    }
}

/// envoyproxy/ratelimit's quota mode (its `service/ratelimit.go`): a
/// descriptor over a quota-mode limit refuses nothing alone, and the
/// request is refused once *every* quota-mode descriptor in it is over
/// (none left with room). Those are then over the limit. With `all_quota`
/// (`--quota-mode`, its `QUOTA_MODE`) every descriptor is one, first
/// turned from over the limit to over its quota, a descriptor of no rule
/// included (it has room), an unlimited one never. A shadow-mode limit
/// over is not over here either, as there.
pub fn settle_quotas(decisions: &mut [&mut Decision], all_quota: bool) {
    if all_quota {
        for d in decisions.iter_mut() {
            if d.verdict == Verdict::OverLimit {
                d.verdict = Verdict::QuotaExceeded;
            }
        }
    }
    let is_quota = |d: &Decision| match d.verdict {
        Verdict::Unlimited => false,
        Verdict::QuotaExceeded => true,
        Verdict::NoRule => all_quota,
        _ => all_quota || d.rule.as_ref().is_some_and(|r| r.quota_mode),
    };
    let mut quotas = decisions.iter().filter(|d| is_quota(d)).peekable();
    if quotas.peek().is_none() || !quotas.all(|d| d.verdict == Verdict::QuotaExceeded) {
        return;
    }
    for d in decisions.iter_mut() {
        if d.verdict == Verdict::QuotaExceeded {
            d.verdict = Verdict::OverLimit;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(rpu: u32, unit: Unit, window_secs: u64) -> (u32, Unit) {
        ShownLimit {
            name: String::new(),
            requests_per_unit: rpu,
            unit,
            window_secs,
            burst: u64::from(rpu),
        }
        .on_the_wire()
    }

    fn decision(verdict: Verdict) -> Decision {
        Decision::without_limit(verdict, None)
    }

    fn settled(verdicts: &[Verdict], all_quota: bool) -> Vec<Verdict> {
        let mut ds: Vec<Decision> = verdicts.iter().map(|v| decision(*v)).collect();
        settle_quotas(&mut ds.iter_mut().collect::<Vec<_>>(), all_quota);
        ds.iter().map(|d| d.verdict).collect()
    }

    /// `--quota-mode` (its `TestServiceGlobalQuotaMode`): every descriptor
    /// a quota; one of no rule has room, an unlimited one is none.
    #[test]
    fn under_global_quota_mode_a_request_is_refused_once_all_are_over() {
        use Verdict::*;
        assert_eq!(
            settled(&[OverLimit, OverLimit], true),
            [OverLimit, OverLimit]
        );
        assert_eq!(settled(&[OverLimit, Ok], true), [QuotaExceeded, Ok]);
        assert_eq!(settled(&[OverLimit, NoRule], true), [QuotaExceeded, NoRule]);
        assert_eq!(
            settled(&[OverLimit, Unlimited], true),
            [OverLimit, Unlimited]
        );
        assert_eq!(settled(&[Shadow, OverLimit], true), [Shadow, QuotaExceeded]);
        // without it, a descriptor of no rule is no quota
        assert_eq!(
            settled(&[QuotaExceeded, NoRule], false),
            [OverLimit, NoRule]
        );
        assert_eq!(settled(&[OverLimit, Ok], false), [OverLimit, Ok]);
    }

    #[test]
    fn a_window_of_several_units_goes_on_the_wire_as_the_same_rate() {
        // one unit: as written, even where a shorter unit would do
        assert_eq!(shown(120, Unit::Minute, 60), (120, Unit::Minute));
        // 3 per 30 s is 6 a minute; 100 per 10 min is 10 a minute; 7
        // per 10 min is 42 an hour
        assert_eq!(shown(3, Unit::Second, 30), (6, Unit::Minute));
        assert_eq!(shown(100, Unit::Minute, 600), (10, Unit::Minute));
        assert_eq!(shown(7, Unit::Minute, 600), (42, Unit::Hour));
        // 4 per 2 s is 2 a second
        assert_eq!(shown(4, Unit::Second, 2), (2, Unit::Second));
        // 5 per 7 s: a whole number first in a week
        assert_eq!(shown(5, Unit::Second, 7), (432_000, Unit::Week));
        // 5 per 13 s: never whole; per year, rounded down
        assert_eq!(shown(5, Unit::Second, 13), (12_129_230, Unit::Year));
        assert_eq!(shown(0, Unit::Second, 30), (0, Unit::Second));
    }
}
