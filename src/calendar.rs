//! Calendar periods: a day, week, month or year as a named time zone's
//! calendar has it, from an anchor (the first day of a week, a billing
//! day of a month, the first day of a year), as pure functions of an
//! instant.
//!
//! A period starts at the first moment of its first day in the zone
//! (midnight, or the first time that exists when a daylight-saving change
//! skips midnight) and ends where the next one starts: a day of 23 or 25
//! hours across a daylight-saving change, a month of 28 to 31 days. An
//! anchor past a month's last day (the 31st in February, the 29th of
//! February in a common year) starts that month's period on its last day.
//!
//! Time zones are IANA names, read from the time-zone database compiled
//! into the binary (jiff's bundled copy), so that every instance, whatever
//! its host's `/usr/share/zoneinfo`, finds the same boundaries.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses nothing of the crate.

use std::fmt;

use jiff::civil::{Date, Weekday};
use jiff::tz::TimeZone;
use jiff::Timestamp;

/// Which calendar period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeriodUnit {
    Day,
    Week,
    Month,
    Year,
}

/// Where a period starts within its unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anchor {
    /// A day starts at midnight.
    Midnight,
    /// A week starts on this day.
    Weekday(Weekday),
    /// A month starts on this day of it (1–31; past its end: its last day).
    DayOfMonth(i8),
    /// A year starts on this month (1–12) and day (1–31, as above).
    MonthDay(i8, i8),
}

/// A calendar period in a time zone: what a rule's `calendar:` says.
#[derive(Clone)]
pub struct Calendar {
    unit: PeriodUnit,
    anchor: Anchor,
    /// Periods of this many units (`unit_multiplier`), counted from the
    /// Unix epoch's: days from 1970-01-01, weeks from the one holding it,
    /// months from January (3: quarters), years from year 0.
    every: u32,
    zone: TimeZone,
    zone_name: String,
}

impl fmt::Debug for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.unit {
            PeriodUnit::Day => "day",
            PeriodUnit::Week => "week",
            PeriodUnit::Month => "month",
            PeriodUnit::Year => "year",
        };
        if self.every > 1 {
            write!(f, "{} calendar {unit}s in {}", self.every, self.zone_name)?;
        } else {
            write!(f, "a calendar {unit} in {}", self.zone_name)?;
        }
        match self.anchor {
            Anchor::Midnight => Ok(()),
            Anchor::Weekday(w) => write!(f, " from {}", weekday_name(w)),
            Anchor::DayOfMonth(d) => write!(f, " from day {d}"),
            Anchor::MonthDay(m, d) => write!(f, " from {m:02}-{d:02}"),
        }
    }
}

impl PartialEq for Calendar {
    fn eq(&self, other: &Self) -> bool {
        self.unit == other.unit
            && self.anchor == other.anchor
            && self.every == other.every
            && self.zone_name == other.zone_name
    }
}

/// The start and end (Unix seconds) of a period and of the one after it:
/// what a store needs to count in the period holding its own clock's now,
/// when that clock is a little ahead of the one that computed them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Periods {
    pub start: i64,
    pub end: i64,
    pub next_end: i64,
}

const WEEKDAYS: [(&str, Weekday); 7] = [
    ("monday", Weekday::Monday),
    ("tuesday", Weekday::Tuesday),
    ("wednesday", Weekday::Wednesday),
    ("thursday", Weekday::Thursday),
    ("friday", Weekday::Friday),
    ("saturday", Weekday::Saturday),
    ("sunday", Weekday::Sunday),
];

fn weekday_name(w: Weekday) -> &'static str {
    WEEKDAYS
        .iter()
        .find(|(_, d)| *d == w)
        .map_or("monday", |(n, _)| n)
}

impl Calendar {
    /// A calendar period from a rule's words: the unit (`day`, `week`,
    /// `month`, `year`), the IANA zone, and the anchor as written
    /// (`starts:`: a weekday for a week, a day of the month 1–31 for a
    /// month, `MM-DD` for a year, nothing for a day). The error says what
    /// is wrong, for the loader to name its place.
    pub fn parse(unit: &str, zone: &str, starts: Option<&str>) -> Result<Self, String> {
        let unit = match unit {
            "day" => PeriodUnit::Day,
            "week" => PeriodUnit::Week,
            "month" => PeriodUnit::Month,
            "year" => PeriodUnit::Year,
            other => {
                return Err(format!(
                    "a calendar period is a day, week, month or year, not a {other}"
                ))
            }
        };
        let tz = TimeZone::get(zone).map_err(|_| {
            format!("time_zone '{zone}' is not a time zone of the IANA database (e.g. America/New_York, Europe/Berlin, UTC)")
        })?;
        let anchor = match (unit, starts) {
            (PeriodUnit::Day, None) => Anchor::Midnight,
            (PeriodUnit::Day, Some(s)) => {
                return Err(format!(
                    "starts '{s}' on a calendar day: a day starts at midnight and takes no anchor"
                ))
            }
            (PeriodUnit::Week, None) => Anchor::Weekday(Weekday::Monday),
            (PeriodUnit::Week, Some(s)) => {
                let lower = s.to_ascii_lowercase();
                let w = WEEKDAYS
                    .iter()
                    .find(|(n, _)| *n == lower)
                    .map(|(_, w)| *w)
                    .ok_or_else(|| {
                        format!("starts '{s}' on a calendar week: name a weekday, monday to sunday")
                    })?;
                Anchor::Weekday(w)
            }
            (PeriodUnit::Month, None) => Anchor::DayOfMonth(1),
            (PeriodUnit::Month, Some(s)) => match day_number(s) {
                Some(d) if (1..=31).contains(&d) => Anchor::DayOfMonth(d),
                _ => {
                    return Err(format!(
                        "starts '{s}' on a calendar month: a day of the month, 1 to 31 (past a month's end, its last day)"
                    ))
                }
            },
            (PeriodUnit::Year, None) => Anchor::MonthDay(1, 1),
            (PeriodUnit::Year, Some(s)) => {
                let parsed = s
                    .split_once('-')
                    .and_then(|(m, d)| Some((day_number(m)?, day_number(d)?)))
                    // a date of a leap year: 02-29 is a day that exists
                    .filter(|(m, d)| Date::new(2024, *m, *d).is_ok());
                let Some((m, d)) = parsed else {
                    return Err(format!(
                        "starts '{s}' on a calendar year: a month and day, MM-DD (e.g. 04-01)"
                    ));
                };
                Anchor::MonthDay(m, d)
            }
        };
        Ok(Calendar {
            unit,
            anchor,
            every: 1,
            zone: tz,
            zone_name: zone.to_string(),
        })
    }

    /// The same calendar in periods of `n` units (`unit_multiplier`; 0 is 1).
    pub fn every(mut self, n: u32) -> Self {
        self.every = n.max(1);
        self
    }

    /// The period's unit.
    pub fn unit(&self) -> PeriodUnit {
        self.unit
    }

    /// An instant as the zone's clock shows it (RFC 3339 with its offset
    /// and the zone's name).
    pub fn show(&self, unix_secs: i64) -> String {
        Timestamp::from_second(unix_secs)
            .map(|t| t.to_zoned_datetime(self.zone.clone()).to_string())
            .unwrap_or_else(|_| unix_secs.to_string())
    }

    /// The period holding `unix_secs` and the one after it.
    pub fn periods_at(&self, unix_secs: i64) -> Periods {
        let today = Timestamp::from_second(unix_secs)
            .unwrap_or(Timestamp::UNIX_EPOCH)
            .to_zoned_datetime(self.zone.clone())
            .date();
        let first = self.first_day(today);
        let second = self.next_first_day(first);
        let third = self.next_first_day(second);
        Periods {
            start: self.start_of(first),
            end: self.start_of(second),
            next_end: self.start_of(third),
        }
    }

    /// The first instant of `day` in the zone (midnight, or the first
    /// time that exists when a change skips it).
    fn start_of(&self, day: Date) -> i64 {
        day.to_zoned_datetime(self.zone.clone())
            .and_then(|z| z.start_of_day())
            .map_or(0, |z| z.timestamp().as_second())
    }

    /// The first day of the period holding `day`: that of the one-unit
    /// period holding it, moved back to where a run of `every` of them
    /// starts.
    fn first_day(&self, day: Date) -> Date {
        let one = self.first_day_of_one(day);
        let n = i64::from(self.every);
        if n == 1 {
            return one;
        }
        match self.anchor {
            Anchor::Midnight => days_before(one, epoch_days(one).rem_euclid(n)),
            Anchor::Weekday(_) => {
                let first_week = self.first_day_of_one(EPOCH);
                let weeks = (epoch_days(one) - epoch_days(first_week)).div_euclid(7);
                days_before(one, 7 * weeks.rem_euclid(n))
            }
            Anchor::DayOfMonth(d) => {
                let month = i64::from(one.year()) * 12 + i64::from(one.month()) - 1;
                let (y, m) = month_of(month - month.rem_euclid(n));
                on(y, m, d)
            }
            Anchor::MonthDay(m, d) => {
                let year = i64::from(one.year());
                on((year - year.rem_euclid(n)) as i16, m, d)
            }
        }
    }

    /// The first day of the one-unit period holding `day`.
    fn first_day_of_one(&self, day: Date) -> Date {
        match self.anchor {
            Anchor::Midnight => day,
            Anchor::Weekday(w) => {
                let back = (day.weekday().to_monday_zero_offset() - w.to_monday_zero_offset())
                    .rem_euclid(7);
                day.checked_sub(jiff::Span::new().days(back)).unwrap_or(day)
            }
            Anchor::DayOfMonth(d) => {
                let this = on(day.year(), day.month(), d);
                if this <= day {
                    this
                } else {
                    let (y, m) = month_before(day.year(), day.month());
                    on(y, m, d)
                }
            }
            Anchor::MonthDay(m, d) => {
                let this = on(day.year(), m, d);
                if this <= day {
                    this
                } else {
                    on(day.year() - 1, m, d)
                }
            }
        }
    }

    /// The first day of the period after the one starting on `first`.
    fn next_first_day(&self, first: Date) -> Date {
        let n = i64::from(self.every);
        match self.anchor {
            Anchor::Midnight => days_after(first, n),
            Anchor::Weekday(_) => days_after(first, 7 * n),
            Anchor::DayOfMonth(d) => {
                let month = i64::from(first.year()) * 12 + i64::from(first.month()) - 1;
                let (y, m) = month_of(month + n);
                on(y, m, d)
            }
            Anchor::MonthDay(m, d) => on((i64::from(first.year()) + n) as i16, m, d),
        }
    }
}

/// A rule's calendar with the periods it last computed, so that a decision
/// within them costs a load instead of a time-zone calculation.
#[derive(Debug)]
pub struct CalendarPeriods {
    calendar: Calendar,
    last: arc_swap::ArcSwap<Periods>,
}

impl CalendarPeriods {
    pub fn new(calendar: Calendar) -> Self {
        Self {
            last: arc_swap::ArcSwap::from_pointee(calendar.periods_at(0)),
            calendar,
        }
    }

    pub fn calendar(&self) -> &Calendar {
        &self.calendar
    }

    /// The period holding `unix_secs` and the one after it.
    pub fn periods_at(&self, unix_secs: i64) -> Periods {
        let last = **self.last.load();
        if (last.start..last.end).contains(&unix_secs) {
            return last;
        }
        let now = self.calendar.periods_at(unix_secs);
        self.last.store(std::sync::Arc::new(now));
        now
    }
}

impl Periods {
    /// The same periods `secs` earlier: where a clock that reads `secs`
    /// ahead of the stores' sees them (`--calendar-clock-offset`).
    pub fn earlier_by(self, secs: i64) -> Periods {
        Periods {
            start: self.start - secs,
            end: self.end - secs,
            next_end: self.next_end - secs,
        }
    }

    /// The window holding `now_micros` by a store's clock, as (its start,
    /// its end) in µs: the first period, or the second once the first has
    /// ended (a store's clock a little ahead of the one that computed them;
    /// one behind counts in the first period already).
    pub fn window_at(&self, now_micros: u64) -> (u64, u64) {
        let micros = |secs: i64| u64::try_from(secs).unwrap_or(0).saturating_mul(1_000_000);
        if now_micros >= micros(self.end) {
            (micros(self.end), micros(self.next_end))
        } else {
            (micros(self.start), micros(self.end))
        }
    }
}

/// A month's or a day's number as written in `starts:`: one or two ASCII
/// digits, nothing else (`+4-+1` was read as April 1).
fn day_number(s: &str) -> Option<i8> {
    (!s.is_empty() && s.len() <= 2 && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

/// The Unix epoch's date, where runs of days and weeks are counted from.
const EPOCH: Date = jiff::civil::date(1970, 1, 1);

/// Days from 1970-01-01 to `day` (negative before it).
fn epoch_days(day: Date) -> i64 {
    day.to_zoned_datetime(TimeZone::UTC)
        .map_or(0, |z| z.timestamp().as_second().div_euclid(86_400))
}

fn days_before(day: Date, n: i64) -> Date {
    day.checked_sub(jiff::Span::new().days(n)).unwrap_or(day)
}

fn days_after(day: Date, n: i64) -> Date {
    day.checked_add(jiff::Span::new().days(n)).unwrap_or(day)
}

/// The (year, month) of a count of months from January of year 0.
fn month_of(months: i64) -> (i16, i8) {
    (
        months.div_euclid(12) as i16,
        (months.rem_euclid(12) + 1) as i8,
    )
}

fn month_before(year: i16, month: i8) -> (i16, i8) {
    if month == 1 {
        (year - 1, 12)
    } else {
        (year, month - 1)
    }
}

/// Day `d` of a month, or its last day when it has fewer.
fn on(year: i16, month: i8, d: i8) -> Date {
    let first = Date::new(year, month, 1).unwrap_or_default();
    Date::new(year, month, d.min(first.days_in_month())).unwrap_or(first)
}

#[cfg(test)]
mod tests;
