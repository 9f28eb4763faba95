//! Who is being limited: per rule, the descriptor values refused most and
//! admitted most over the last minute and hour ([`crate::hitters`]'s
//! summaries, `k` counters each), for `/v1/hitters` and the admin page.
//!
//! A decision of a rule adds its request's values (`key=value,…`, as the
//! refusal log writes them, the keys of `--refusal-log-hash-keys` hashed
//! before they are kept) to the rule's refused or admitted summaries;
//! a value only allocates when it takes a counter. Memory per rule is
//! bounded whatever the values' cardinality:
//! [`Windows::max_bytes`]`(k)` for each of the two kinds.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::hitters::{Top, Windows};
use crate::labels::RuleId;
use crate::rules::DescriptorEntry;
use crate::shown::ShownValues;

/// One rule's summaries.
struct RuleHitters {
    refused: Windows,
    admitted: Windows,
}

/// Every rule's summaries, by [`RuleId`] index, made at a rule's first
/// decision.
pub struct HeavyHitters {
    /// Counters per summary; 0: none kept.
    k: usize,
    /// Values of some keys kept hashed, never as they came.
    shown: ShownValues,
    rules: ArcSwap<Vec<Option<Arc<Mutex<RuleHitters>>>>>,
}

/// What `/v1/hitters` shows of one rule.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RuleTop {
    pub domain: String,
    pub rule: String,
    pub refused: Top,
    pub admitted: Top,
}

/// One summary as instances share it: its rule, what it counts
/// (`refused` or `admitted`), its window (length and start, seconds), and
/// the summary.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SharedSummary {
    pub k: usize,
    pub total: u64,
    pub counters: Vec<crate::hitters::Hitter>,
}

/// Why a summary read back from Redis was refused (it is untrusted input:
/// anyone who can write to that Redis wrote it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SummaryRefused {
    #[error("longer than a summary of this instance's counters can be")]
    TooLong,
    #[error("not a summary (malformed JSON)")]
    Malformed,
    #[error("more counters than this instance keeps (--heavy-hitters), or none")]
    TooManyCounters,
    #[error("a value longer than a summary keeps")]
    ValueTooLong,
}

impl SummaryRefused {
    /// The reason as a metric label.
    pub fn label(self) -> &'static str {
        match self {
            SummaryRefused::TooLong => "too_long",
            SummaryRefused::Malformed => "malformed",
            SummaryRefused::TooManyCounters => "too_many_counters",
            SummaryRefused::ValueTooLong => "value_too_long",
        }
    }
}

/// Instances' summaries read under one key at most: more are left out.
pub const MAX_SHARED_SUMMARIES: usize = 256;

impl SharedSummary {
    /// The most bytes a summary of `k` counters takes as JSON: each value
    /// at most [`crate::hitters::MAX_VALUE_BYTES`] bytes, 6 bytes each when
    /// escaped, and its counts.
    pub fn max_json_bytes(k: usize) -> usize {
        64 + k * (6 * crate::hitters::MAX_VALUE_BYTES + 96)
    }

    /// `bytes` as a summary, if it is one this instance could have written
    /// with `max_k` counters: its length, `k`, its counters and each value
    /// checked before anything is sized by them.
    pub fn parse(bytes: &[u8], max_k: usize) -> Result<Self, SummaryRefused> {
        if bytes.len() > Self::max_json_bytes(max_k) {
            return Err(SummaryRefused::TooLong);
        }
        let summary: SharedSummary =
            serde_json::from_slice(bytes).map_err(|_| SummaryRefused::Malformed)?;
        if summary.k == 0 || summary.k > max_k || summary.counters.len() > summary.k {
            return Err(SummaryRefused::TooManyCounters);
        }
        if summary
            .counters
            .iter()
            .any(|c| c.value.len() > crate::hitters::MAX_VALUE_BYTES)
        {
            return Err(SummaryRefused::ValueTooLong);
        }
        Ok(summary)
    }
}

/// Where a summary is shared: `<domain>\0<rule>:<kind>:<length>:<start>`.
pub fn shared_key(domain: &str, rule: &str, kind: &str, length: u64, start: u64) -> Vec<u8> {
    format!("{domain}\0{rule}:{kind}:{length}:{start}").into_bytes()
}

/// The kinds of hit a rule's summaries count.
pub const KINDS: [&str; 2] = ["refused", "admitted"];

/// Summaries of one kind and window shared by several instances (this
/// one's too), added up: the `n` largest, then the counts of `also` not
/// among them, and the hits counted.
pub fn merge_shared(
    summaries: &[SharedSummary],
    n: usize,
    also: &[crate::hitters::Hitter],
) -> (Vec<crate::hitters::Hitter>, u64) {
    let parts: Vec<crate::hitters::SpaceSaving> = summaries
        .iter()
        .map(|s| crate::hitters::SpaceSaving::from_parts(s.k, s.total, s.counters.clone()))
        .collect();
    let hits = parts.iter().map(|p| p.total()).fold(0, u64::saturating_add);
    (crate::hitters::merged_with(&parts, n, also), hits)
}

thread_local! {
    /// A decision's values, written here before they are looked up.
    static VALUES: RefCell<String> = RefCell::new(String::with_capacity(128));
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl HeavyHitters {
    /// Summaries of `k` counters, the values of `shown`'s keys hashed.
    pub fn new(k: usize, shown: ShownValues) -> Self {
        Self {
            k,
            shown,
            rules: ArcSwap::from_pointee(Vec::new()),
        }
    }

    /// Counters per summary (0: off).
    pub fn counters(&self) -> usize {
        self.k
    }

    /// Adds one decision of `rule` on `entries`.
    pub fn record<E: DescriptorEntry>(&self, rule: RuleId, entries: &[E], admitted: bool) {
        if self.k == 0 {
            return;
        }
        let hitters = self.of(rule);
        let now = now_secs();
        VALUES.with(|buf| {
            let mut value = buf.borrow_mut();
            value.clear();
            for (i, e) in entries.iter().enumerate() {
                if i > 0 {
                    value.push(',');
                }
                self.shown.write(&mut value, e.key(), e.value());
            }
            let mut h = hitters.lock();
            let kind = if admitted {
                &mut h.admitted
            } else {
                &mut h.refused
            };
            kind.add(&value, 1, now);
        });
    }

    fn of(&self, rule: RuleId) -> Arc<Mutex<RuleHitters>> {
        if let Some(Some(h)) = self.rules.load().get(rule.index()) {
            return h.clone();
        }
        let made = Arc::new(Mutex::new(RuleHitters {
            refused: Windows::new(self.k),
            admitted: Windows::new(self.k),
        }));
        let mut kept = made.clone();
        self.rules.rcu(|table| {
            let mut table = Vec::clone(table);
            if table.len() <= rule.index() {
                table.resize(rule.index() + 1, None);
            }
            match &table[rule.index()] {
                // another thread made it first: that one stays
                Some(existing) => kept = existing.clone(),
                None => table[rule.index()] = Some(made.clone()),
            }
            table
        });
        kept
    }

    /// Every rule's current minute and hour summaries, to share: (domain,
    /// rule, the window's length in seconds, the key to share each under,
    /// the summary).
    pub fn export(&self) -> Vec<(String, String, u64, Vec<u8>, SharedSummary)> {
        let now = now_secs();
        let table = self.rules.load();
        let mut out = Vec::new();
        for (i, h) in table.iter().enumerate() {
            let (Some(h), Some(id)) = (h, RuleId::from_index(i)) else {
                continue;
            };
            let (domain, rule) = id.labels();
            let mut h = h.lock();
            for kind in KINDS {
                let windows = if kind == "refused" {
                    &mut h.refused
                } else {
                    &mut h.admitted
                };
                for (length, start, summary) in windows.shareable(now) {
                    if summary.total() == 0 {
                        continue;
                    }
                    out.push((
                        domain.to_string(),
                        rule.to_string(),
                        length,
                        shared_key(&domain, &rule, kind, length, start),
                        SharedSummary {
                            k: summary.k(),
                            total: summary.total(),
                            counters: summary.top(),
                        },
                    ));
                }
            }
        }
        out
    }

    /// The `n` largest of every rule that has decided, refused first
    /// (most refusals in the last minute first).
    pub fn top(&self, n: usize) -> Vec<RuleTop> {
        let now = now_secs();
        let table = self.rules.load();
        let mut out: Vec<RuleTop> = table
            .iter()
            .enumerate()
            .filter_map(|(i, h)| {
                let h = h.as_ref()?;
                let mut h = h.lock();
                let id = RuleId::from_index(i)?;
                let (domain, rule) = id.labels();
                Some(RuleTop {
                    domain: domain.to_string(),
                    rule: rule.to_string(),
                    refused: h.refused.top(now, n),
                    admitted: h.admitted.top(now, n),
                })
            })
            .collect();
        sort_tops(&mut out);
        out
    }
}

/// Most refusals in the last minute first, then most admissions, then by
/// name.
pub fn sort_tops(tops: &mut [RuleTop]) {
    tops.sort_by(|a, b| {
        b.refused
            .minute_hits
            .cmp(&a.refused.minute_hits)
            .then_with(|| b.admitted.minute_hits.cmp(&a.admitted.minute_hits))
            .then_with(|| (&a.domain, &a.rule).cmp(&(&b.domain, &b.rule)))
    });
}

/// The heavy hitters every instance shared (`fetch(key)`: every
/// instance's summary under a key of [`shared_key`]), added up per rule in
/// `rules` (`<domain>\0<rule>`): the last minute's and hour's, at
/// `now_secs`. Every key is asked for at once (one pipeline); each summary
/// is checked against `max_k` (this instance's counters) before it is
/// used, and `refused` hears of each one that is not.
pub async fn shared_tops<F, Fut, E>(
    rules: &[Vec<u8>],
    now_secs: u64,
    n: usize,
    max_k: usize,
    fetch: F,
    refused: impl Fn(SummaryRefused),
) -> Result<Vec<RuleTop>, E>
where
    F: Fn(Vec<u8>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<Vec<u8>>, E>>,
{
    let named: Vec<(String, String)> = rules
        .iter()
        .filter_map(|name| {
            let name = String::from_utf8_lossy(name);
            let (domain, rule) = name.split_once('\0')?;
            Some((domain.to_string(), rule.to_string()))
        })
        .collect();
    // per rule, kind, window length: the keys of the window and the one before
    let mut keys = Vec::new();
    for (domain, rule) in &named {
        for kind in KINDS {
            for length in [60u64, 3600] {
                let start = now_secs - now_secs % length;
                for s in [start, start.saturating_sub(length)] {
                    keys.push(shared_key(domain, rule, kind, length, s));
                }
            }
        }
    }
    let replies = futures::future::join_all(keys.into_iter().map(&fetch)).await;
    let mut replies = replies.into_iter();
    let mut out = Vec::new();
    for (domain, rule) in named {
        let mut tops = Vec::new();
        for _kind in KINDS {
            let mut read = || {
                let mut summaries = Vec::new();
                for _ in 0..2 {
                    let Some(reply) = replies.next() else { break };
                    for v in reply?.iter().take(MAX_SHARED_SUMMARIES) {
                        match SharedSummary::parse(v, max_k) {
                            Ok(doc) => summaries.push(doc),
                            Err(why) => refused(why),
                        }
                    }
                }
                Ok(summaries)
            };
            let minute_summaries = read()?;
            let hour_summaries = read()?;
            let (minute, minute_hits) = merge_shared(&minute_summaries, n, &[]);
            let (hour, hour_hits) = merge_shared(&hour_summaries, n, &minute);
            tops.push(Top {
                minute,
                minute_hits,
                hour,
                hour_hits,
            });
        }
        let [refused, admitted]: [Top; 2] = match tops.try_into() {
            Ok(t) => t,
            Err(_) => continue,
        };
        out.push(RuleTop {
            domain,
            rule,
            refused,
            admitted,
        });
    }
    sort_tops(&mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// #65 item 8: twenty users behind one long first entry are twenty
    /// rows, not one: each entry is cut on its own.
    #[test]
    fn users_behind_a_long_first_entry_stay_apart() {
        let hitters = HeavyHitters::new(64, ShownValues::default());
        let rule = RuleId::of("hitters-test", "path_user");
        let path = format!("/api/{}", "x".repeat(1100));
        for u in 0..20 {
            let user = format!("user-{u}");
            for _ in 0..=u {
                hitters.record(
                    rule,
                    &[("path", path.as_str()), ("user", user.as_str())],
                    false,
                );
            }
        }
        let top = hitters.top(100);
        let refused = &top
            .iter()
            .find(|t| t.domain == "hitters-test")
            .expect("the rule")
            .refused;
        assert_eq!(refused.minute.len(), 20);
        assert_eq!(refused.minute[0].count, 20);
        assert!(
            refused.minute[0].value.ends_with(",user=user-19"),
            "{}",
            refused.minute[0].value
        );
        assert!(refused.minute.iter().all(|h| h.error == 0));
    }
}
