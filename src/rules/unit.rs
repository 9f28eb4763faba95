//! Rule units and failure modes: the small enums a rule is made of.

use serde::Serialize;

/// The time unit of a `requests_per_unit` figure, with envoyproxy/ratelimit's lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    pub const NAMES: &'static str = "second, minute, hour, day, week, month, year";

    /// Parses a unit name, case-insensitively (`second`, `SECOND`).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// The name rules write.
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// Units from the shortest.
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    /// Length in seconds; a month is 30 days and a year 365, as in envoyproxy/ratelimit.
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 604_800,
            Unit::Month => 2_592_000,
            Unit::Year => 31_536_000,
        }
    }

    /// The `RateLimitResponse.RateLimit.Unit` wire value.
    pub fn to_proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }

    /// From the wire value; `None` for `UNKNOWN` or anything unassigned.
    pub fn from_proto(v: i32) -> Option<Self> {
        Some(match v {
            1 => Unit::Second,
            2 => Unit::Minute,
            3 => Unit::Hour,
            4 => Unit::Day,
            5 => Unit::Month,
            6 => Unit::Year,
            7 => Unit::Week,
            _ => return None,
        })
    }
}

/// What a rule does when its store cannot decide (docs/architecture.md §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// Admit: the descriptor is OK.
    Open,
    /// Refuse: the whole call fails with UNAVAILABLE.
    Closed,
    /// Decide with an in-process bucket holding this instance's share of the budget.
    Local,
}

impl FailureMode {
    pub const NAMES: &'static str = "open, closed, local";

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "open" => FailureMode::Open,
            "closed" => FailureMode::Closed,
            "local" => FailureMode::Local,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FailureMode::Open => "open",
            FailureMode::Closed => "closed",
            FailureMode::Local => "local",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_round_trip_through_the_wire_values() {
        for u in [
            Unit::Second,
            Unit::Minute,
            Unit::Hour,
            Unit::Day,
            Unit::Week,
            Unit::Month,
            Unit::Year,
        ] {
            assert_eq!(Unit::from_proto(u.to_proto()), Some(u));
        }
        assert_eq!(Unit::from_proto(0), None);
        assert_eq!(Unit::parse("SECOND"), Some(Unit::Second));
        assert_eq!(Unit::parse("foo"), None);
    }
}
