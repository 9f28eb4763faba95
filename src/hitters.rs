//! Heavy hitters: the descriptor values a rule refused (or admitted) most,
//! kept in a summary of fixed size whatever the values' cardinality.
//!
//! [`SpaceSaving`] is Metwally, Agrawal and El Abbadi's Space-Saving
//! (2005) with `k` counters: a value seen is counted in its counter; a new
//! value, once all `k` are taken, takes the counter of the smallest count
//! `m`, starting from `m` (its `error`, what it may not have had). So a
//! reported count is at most `error` above the value's true count, and
//! `error ≤ N / k` (N: the hits counted in the summary); every value whose
//! true count is above N / k is in the summary. Values are cut at
//! [`MAX_VALUE_BYTES`], so a summary holds at most `k` × that many bytes
//! of values.
//!
//! [`Windows`] keeps a summary for the current minute and the one before,
//! and for the current hour and the one before (tumbling windows of the
//! clock the caller passes): "the last minute" is read from both minutes'
//! summaries added up (between one and two minutes of hits), "the last
//! hour" likewise.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses nothing of the crate.

use std::collections::HashMap;

/// A value's bytes kept at most (cut at a character boundary): a
/// descriptor's entries as `crate::shown` writes them, each cut at 64
/// bytes, so that a few entries fit whole.
pub const MAX_VALUE_BYTES: usize = 256;

/// Counters a summary keeps unless told otherwise.
pub const DEFAULT_COUNTERS: usize = 16;

/// One value and its count, at most `error` above the truth.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hitter {
    pub value: String,
    pub count: u64,
    pub error: u64,
}

/// Space-Saving with at most `k` counters (see the module's text).
#[derive(Debug, Clone)]
pub struct SpaceSaving {
    k: usize,
    counters: Vec<Hitter>,
    /// Where each value's counter is in `counters`.
    at: HashMap<Box<str>, usize>,
    /// Hits counted, all values together.
    total: u64,
}

impl SpaceSaving {
    pub fn new(k: usize) -> Self {
        let k = k.max(1);
        Self {
            k,
            counters: Vec::with_capacity(k),
            at: HashMap::with_capacity(k),
            total: 0,
        }
    }

    /// Counts `weight` hits of `value`.
    pub fn add(&mut self, value: &str, weight: u64) {
        self.total = self.total.saturating_add(weight);
        let value = cut(value);
        if let Some(&i) = self.at.get(value) {
            let c = &mut self.counters[i];
            c.count = c.count.saturating_add(weight);
            return;
        }
        if self.counters.len() < self.k {
            self.at.insert(value.into(), self.counters.len());
            self.counters.push(Hitter {
                value: value.to_string(),
                count: weight,
                error: 0,
            });
            return;
        }
        // the smallest counter goes to the new value, its count the error
        let Some((i, min)) = self
            .counters
            .iter()
            .enumerate()
            .map(|(i, c)| (i, c.count))
            .min_by_key(|(_, count)| *count)
        else {
            return;
        };
        let old = std::mem::replace(
            &mut self.counters[i],
            Hitter {
                value: value.to_string(),
                count: min.saturating_add(weight),
                error: min,
            },
        );
        self.at.remove(old.value.as_str());
        self.at.insert(value.into(), i);
    }

    /// Hits counted, all values together.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Counters per summary.
    pub fn k(&self) -> usize {
        self.k
    }

    /// A summary as another instance sent it: `k`, its hits, its
    /// counters (at most `k` kept, values cut as [`SpaceSaving::add`]
    /// cuts them; a value given twice is counted once).
    pub fn from_parts(k: usize, total: u64, counters: Vec<Hitter>) -> Self {
        let mut s = Self::new(k);
        s.total = total;
        for c in counters.into_iter().take(s.k) {
            let value = cut(&c.value).to_string();
            if s.at.contains_key(value.as_str()) {
                continue;
            }
            s.at.insert(value.as_str().into(), s.counters.len());
            s.counters.push(Hitter { value, ..c });
        }
        s
    }

    /// The counters, largest count first (ties by value).
    pub fn top(&self) -> Vec<Hitter> {
        let mut all = self.counters.clone();
        sort(&mut all);
        all
    }
}

/// `value` cut at [`MAX_VALUE_BYTES`], at a character boundary.
fn cut(value: &str) -> &str {
    if value.len() <= MAX_VALUE_BYTES {
        return value;
    }
    let mut end = MAX_VALUE_BYTES;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

fn sort(all: &mut [Hitter]) {
    all.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.value.cmp(&b.value)));
}

/// Summaries added up: each value's counts and errors summed (a value
/// missing from one summary may have had up to that summary's smallest
/// count there: that is added to its error), the largest `n` first.
pub fn merged<'a>(summaries: impl IntoIterator<Item = &'a SpaceSaving>, n: usize) -> Vec<Hitter> {
    let summaries: Vec<&SpaceSaving> = summaries.into_iter().collect();
    let mut all: HashMap<&str, Hitter> = HashMap::new();
    for s in &summaries {
        for c in &s.counters {
            let e = all.entry(c.value.as_str()).or_insert_with(|| Hitter {
                value: c.value.clone(),
                count: 0,
                error: 0,
            });
            e.count = e.count.saturating_add(c.count);
            e.error = e.error.saturating_add(c.error);
        }
    }
    for s in &summaries {
        if s.counters.len() < s.k {
            continue; // not full: a value it lacks had no hit there
        }
        let least = s.counters.iter().map(|c| c.count).min().unwrap_or(0);
        for (value, h) in all.iter_mut() {
            if !s.at.contains_key(*value) {
                h.count = h.count.saturating_add(least);
                h.error = h.error.saturating_add(least);
            }
        }
    }
    let mut out: Vec<Hitter> = all.into_values().collect();
    sort(&mut out);
    out.truncate(n);
    out
}

/// [`merged`]'s `n` largest, then the counts of each of `also` (values
/// shown elsewhere: the last minute's beside the hour's) not among them:
/// as the summaries hold it, or, where none holds it, at most the
/// smallest count of each full summary (all of it error).
pub fn merged_with<'a>(
    summaries: impl IntoIterator<Item = &'a SpaceSaving>,
    n: usize,
    also: &[Hitter],
) -> Vec<Hitter> {
    let summaries: Vec<&SpaceSaving> = summaries.into_iter().collect();
    let all = merged(summaries.iter().copied(), usize::MAX);
    let mut out: Vec<Hitter> = all.iter().take(n).cloned().collect();
    let least: u64 = summaries
        .iter()
        .filter(|s| s.counters.len() >= s.k)
        .map(|s| s.counters.iter().map(|c| c.count).min().unwrap_or(0))
        .fold(0, u64::saturating_add);
    let by_value: HashMap<&str, &Hitter> = all.iter().map(|h| (h.value.as_str(), h)).collect();
    let mut shown: std::collections::HashSet<String> =
        out.iter().map(|h| h.value.clone()).collect();
    for value in also.iter().map(|h| h.value.as_str()) {
        if !shown.insert(value.to_string()) {
            continue;
        }
        out.push(by_value.get(value).map_or_else(
            || Hitter {
                value: value.to_string(),
                count: least,
                error: least,
            },
            |h| (*h).clone(),
        ));
    }
    out
}

/// One tumbling window's summary and the one before it.
#[derive(Debug, Clone)]
struct Pair {
    length_secs: u64,
    /// The current window's start (seconds of the caller's clock).
    start: u64,
    current: SpaceSaving,
    previous: SpaceSaving,
}

impl Pair {
    fn new(length_secs: u64, k: usize) -> Self {
        Self {
            length_secs,
            start: 0,
            current: SpaceSaving::new(k),
            previous: SpaceSaving::new(k),
        }
    }

    /// Moves the windows on to the one holding `now_secs`.
    fn roll(&mut self, now_secs: u64) {
        let start = now_secs - now_secs % self.length_secs;
        if start <= self.start {
            return;
        }
        let k = self.current.k;
        if start == self.start + self.length_secs {
            self.previous = std::mem::replace(&mut self.current, SpaceSaving::new(k));
        } else {
            self.previous = SpaceSaving::new(k);
            self.current = SpaceSaving::new(k);
        }
        self.start = start;
    }

    /// The `n` largest, then the counts of `also` not among them
    /// ([`merged_with`]), and the hits counted.
    fn top(&mut self, now_secs: u64, n: usize, also: &[Hitter]) -> (Vec<Hitter>, u64) {
        self.roll(now_secs);
        let total = self.current.total() + self.previous.total();
        (merged_with([&self.current, &self.previous], n, also), total)
    }
}

/// The last minute's and the last hour's summaries of one kind of hit.
#[derive(Debug, Clone)]
pub struct Windows {
    minute: Pair,
    hour: Pair,
}

/// What [`Windows::top`] reads: the largest counts of the last minute and
/// of the last hour, and the hits counted in each; `hour` goes on with the
/// hour's counts of the minute's values that are not among its largest,
/// so that each value shown for the minute has its hour beside it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Top {
    pub minute: Vec<Hitter>,
    pub minute_hits: u64,
    pub hour: Vec<Hitter>,
    pub hour_hits: u64,
}

impl Windows {
    pub fn new(k: usize) -> Self {
        Self {
            minute: Pair::new(60, k),
            hour: Pair::new(3600, k),
        }
    }

    /// Counts `weight` hits of `value` at `now_secs`.
    pub fn add(&mut self, value: &str, weight: u64, now_secs: u64) {
        for pair in [&mut self.minute, &mut self.hour] {
            pair.roll(now_secs);
            pair.current.add(value, weight);
        }
    }

    /// The summaries at `now_secs` (the current minute and the one before,
    /// the current hour and the one before), each with its window's length
    /// and start (seconds), to share with other instances: the window
    /// before too, so that what it counted after the last share is not
    /// lost when it ends.
    pub fn shareable(&mut self, now_secs: u64) -> [(u64, u64, &SpaceSaving); 4] {
        self.minute.roll(now_secs);
        self.hour.roll(now_secs);
        let (m, h) = (&self.minute, &self.hour);
        [
            (60, m.start, &m.current),
            (60, m.start.saturating_sub(60), &m.previous),
            (3600, h.start, &h.current),
            (3600, h.start.saturating_sub(3600), &h.previous),
        ]
    }

    /// The `n` largest of the last minute and hour at `now_secs`.
    pub fn top(&mut self, now_secs: u64, n: usize) -> Top {
        let (minute, minute_hits) = self.minute.top(now_secs, n, &[]);
        let (hour, hour_hits) = self.hour.top(now_secs, n, &minute);
        Top {
            minute,
            minute_hits,
            hour,
            hour_hits,
        }
    }

    /// Bytes this keeps at most: four summaries of `k` counters, each
    /// value at most [`MAX_VALUE_BYTES`] (kept twice: the counter and the
    /// index), and their bookkeeping.
    pub fn max_bytes(k: usize) -> usize {
        4 * k * (2 * MAX_VALUE_BYTES + 96)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_keeps_the_heavy_values_within_its_bound() {
        // N / k = 13,500 / 16 = 843: both heavy values are above it, so
        // both must be there
        let k = 16;
        let mut s = SpaceSaving::new(k);
        // two heavy values among 10,000 distinct light ones
        for i in 0..10_000u32 {
            s.add(&format!("light-{i}"), 1);
            if i % 4 == 0 {
                s.add("heavy-a", 1);
            }
            if i % 10 == 0 {
                s.add("heavy-b", 1);
            }
        }
        let n = s.total();
        assert_eq!(n, 10_000 + 2_500 + 1_000);
        let top = s.top();
        assert_eq!(top.len(), k, "never more than k counters");
        assert_eq!(top[0].value, "heavy-a");
        assert!(top.iter().any(|h| h.value == "heavy-b"));
        for h in &top {
            let truth = match h.value.as_str() {
                "heavy-a" => 2_500,
                "heavy-b" => 1_000,
                _ => 1,
            };
            // over by at most its error, and the error at most N / k
            assert!(h.count >= truth && h.count - truth <= h.error, "{h:?}");
            assert!(h.error <= n / k as u64, "{h:?}");
        }
    }

    #[test]
    fn values_are_cut_at_the_bound() {
        let mut s = SpaceSaving::new(2);
        let long = "é".repeat(200);
        s.add(&long, 1);
        s.add(&long, 1);
        let top = s.top();
        assert_eq!(top.len(), 1);
        assert!(top[0].value.len() <= MAX_VALUE_BYTES);
        assert_eq!(top[0].count, 2);
    }

    #[test]
    fn summaries_add_up() {
        let mut a = SpaceSaving::new(2);
        let mut b = SpaceSaving::new(2);
        a.add("x", 5);
        a.add("y", 1);
        b.add("x", 2);
        b.add("z", 3);
        let m = merged([&a, &b], 10);
        assert_eq!(
            m[0],
            Hitter {
                value: "x".into(),
                count: 7,
                error: 0
            }
        );
        // y may have had up to b's least (2) in b, z up to a's least (1)
        assert!(m.contains(&Hitter {
            value: "z".into(),
            count: 4,
            error: 1
        }));
        assert!(m.contains(&Hitter {
            value: "y".into(),
            count: 3,
            error: 2
        }));
    }

    #[test]
    fn a_summary_sent_whole_reads_back_the_same() {
        let mut a = SpaceSaving::new(2);
        for v in ["x", "x", "y", "z"] {
            a.add(v, 1);
        }
        let b = SpaceSaving::from_parts(a.k(), a.total(), a.top());
        assert_eq!((b.total(), b.top()), (a.total(), a.top()));
        assert_eq!(merged([&a, &b], 10)[0].count, 4);
    }

    #[test]
    fn the_window_before_is_shared_too() {
        let mut w = Windows::new(4);
        w.add("a", 3, 110);
        // the minute ends before the next share: its count is still sent
        let shared = w.shareable(125);
        let totals: Vec<(u64, u64, u64)> =
            shared.iter().map(|(l, s, x)| (*l, *s, x.total())).collect();
        assert_eq!(
            totals,
            [(60, 120, 0), (60, 60, 3), (3600, 0, 3), (3600, 0, 0)]
        );
    }

    #[test]
    fn windows_tumble_by_the_callers_clock() {
        let mut w = Windows::new(4);
        w.add("a", 3, 120);
        w.add("b", 1, 150);
        let top = w.top(150, 10);
        assert_eq!(top.minute_hits, 4);
        assert_eq!(top.minute[0].value, "a");
        // the next minute: the one before still counts
        w.add("b", 5, 185);
        let top = w.top(185, 10);
        assert_eq!(top.minute_hits, 9);
        assert_eq!(
            top.minute[0],
            Hitter {
                value: "b".into(),
                count: 6,
                error: 0
            }
        );
        // two minutes on: only the new minute, the hour keeps all
        w.add("c", 1, 300);
        let top = w.top(300, 10);
        assert_eq!(top.minute_hits, 1);
        assert_eq!(top.hour_hits, 10);
        // an idle hour and more: nothing
        let top = w.top(3600 * 3, 10);
        assert_eq!((top.minute_hits, top.hour_hits), (0, 0));
        assert!(top.hour.is_empty());
    }

    /// #65 item 8: a value shown for the minute has its hour beside it,
    /// asked of the hour's summaries, even when it is not among the hour's
    /// largest.
    #[test]
    fn the_hour_of_each_minute_value_is_asked_for() {
        let mut w = Windows::new(16);
        // an hour of other values, heavier than the one refused now
        for i in 0..10 {
            w.add(&format!("old-{i}"), 100, 0);
        }
        w.add("now", 20, 3000);
        let top = w.top(3000, 3);
        assert_eq!(top.minute[0].value, "now");
        let hour: Vec<&str> = top.hour.iter().map(|h| h.value.as_str()).collect();
        assert_eq!(hour.len(), 4, "3 largest and the minute's own: {hour:?}");
        let now = top
            .hour
            .iter()
            .find(|h| h.value == "now")
            .expect("asked for");
        assert_eq!((now.count, now.error), (20, 0));
    }
}
