use super::*;

/// Unix seconds of an RFC 3339 instant.
fn at(s: &str) -> i64 {
    s.parse::<Timestamp>().expect("an instant").as_second()
}

fn cal(unit: &str, zone: &str, starts: Option<&str>) -> Calendar {
    Calendar::parse(unit, zone, starts).expect("a calendar")
}

#[test]
fn a_month_in_new_york_starts_at_its_midnight() {
    let month = cal("month", "America/New_York", None);
    assert_eq!(
        month.periods_at(at("2026-12-05T12:00:00Z")),
        Periods {
            start: at("2026-12-01T00:00:00-05:00"),
            end: at("2027-01-01T00:00:00-05:00"),
            next_end: at("2027-02-01T00:00:00-05:00"),
        }
    );
    // the last second of November there is still November, in UTC December
    let last = at("2026-12-01T04:59:59Z");
    assert_eq!(month.periods_at(last).end, at("2026-12-01T00:00:00-05:00"));
    assert_eq!(
        month.periods_at(last + 1).start,
        at("2026-12-01T00:00:00-05:00")
    );
    // a summer month starts at midnight EDT (-4)
    assert_eq!(
        month.periods_at(at("2026-07-15T00:00:00Z")).start,
        at("2026-07-01T00:00:00-04:00")
    );
}

#[test]
fn daylight_saving_days_have_23_and_25_hours() {
    let day = cal("day", "America/New_York", None);
    let spring = day.periods_at(at("2026-03-08T12:00:00-04:00"));
    assert_eq!(spring.end - spring.start, 23 * 3600);
    let autumn = day.periods_at(at("2026-11-01T12:00:00-05:00"));
    assert_eq!(autumn.end - autumn.start, 25 * 3600);
    // and the month holding one is that much shorter than 31 days
    let march = cal("month", "America/New_York", None).periods_at(at("2026-03-20T00:00:00Z"));
    assert_eq!(march.end - march.start, 31 * 86_400 - 3600);
}

#[test]
fn a_midnight_that_does_not_exist_starts_the_day_at_the_first_time_that_does() {
    // Brazil moved its clocks from 00:00 to 01:00 on 2018-11-04
    let day = cal("day", "America/Sao_Paulo", None);
    let p = day.periods_at(at("2018-11-04T12:00:00-02:00"));
    assert_eq!(p.start, at("2018-11-04T01:00:00-02:00"));
    assert_eq!(p.end - p.start, 23 * 3600);
}

#[test]
fn months_have_28_to_31_days_and_february_29_exists_in_leap_years() {
    let utc = cal("month", "UTC", None);
    let days = |s: &str| {
        let p = utc.periods_at(at(s));
        (p.end - p.start) / 86_400
    };
    assert_eq!(days("2027-02-10T00:00:00Z"), 28);
    assert_eq!(days("2028-02-29T23:59:59Z"), 29);
    assert_eq!(days("2026-04-30T00:00:00Z"), 30);
    assert_eq!(days("2026-12-31T23:59:59Z"), 31);
}

#[test]
fn a_billing_day_past_a_months_end_starts_on_its_last_day() {
    let billing = cal("month", "UTC", Some("31"));
    // from January 31st to February's last day, then to March 31st
    let january = billing.periods_at(at("2027-02-10T00:00:00Z"));
    assert_eq!(january.start, at("2027-01-31T00:00:00Z"));
    assert_eq!(january.end, at("2027-02-28T00:00:00Z"));
    assert_eq!(january.next_end, at("2027-03-31T00:00:00Z"));
    assert_eq!(
        billing.periods_at(at("2028-02-29T10:00:00Z")).start,
        at("2028-02-29T00:00:00Z"),
        "a leap year's February ends on the 29th"
    );
    // the 15th: the period holding the 3rd began on the 15th before
    let fifteenth = cal("month", "Europe/Berlin", Some("15"));
    let p = fifteenth.periods_at(at("2026-12-03T00:00:00Z"));
    assert_eq!(p.start, at("2026-11-15T00:00:00+01:00"));
    assert_eq!(p.end, at("2026-12-15T00:00:00+01:00"));
}

#[test]
fn weeks_start_on_their_anchor_day_and_years_on_theirs() {
    // 2026-12-05 is a Saturday
    let monday = cal("week", "UTC", None);
    let p = monday.periods_at(at("2026-12-05T10:00:00Z"));
    assert_eq!(
        (p.start, p.end),
        (at("2026-11-30T00:00:00Z"), at("2026-12-07T00:00:00Z"))
    );
    let sunday = cal("week", "Asia/Tokyo", Some("Sunday"));
    assert_eq!(
        sunday.periods_at(at("2026-12-05T10:00:00Z")).start,
        at("2026-11-29T00:00:00+09:00")
    );
    // a Saturday week starts today
    let saturday = cal("week", "UTC", Some("saturday"));
    assert_eq!(
        saturday.periods_at(at("2026-12-05T00:00:00Z")).start,
        at("2026-12-05T00:00:00Z")
    );
    let fiscal = cal("year", "UTC", Some("04-01"));
    let p = fiscal.periods_at(at("2027-02-01T00:00:00Z"));
    assert_eq!(
        (p.start, p.end),
        (at("2026-04-01T00:00:00Z"), at("2027-04-01T00:00:00Z"))
    );
    let leap = cal("year", "UTC", Some("02-29"));
    let p = leap.periods_at(at("2027-06-01T00:00:00Z"));
    assert_eq!(
        (p.start, p.end, p.next_end),
        (
            at("2027-02-28T00:00:00Z"),
            at("2028-02-29T00:00:00Z"),
            at("2029-02-28T00:00:00Z")
        ),
        "the 29th of February, on the 28th in a common year"
    );
}

#[test]
fn what_is_not_a_calendar_is_refused_saying_why() {
    for (unit, zone, starts, says) in [
        (
            "month",
            "America/Gotham",
            None,
            "not a time zone of the IANA database",
        ),
        ("hour", "UTC", None, "a day, week, month or year"),
        ("month", "UTC", Some("32"), "1 to 31"),
        ("month", "UTC", Some("0"), "1 to 31"),
        ("week", "UTC", Some("funday"), "monday to sunday"),
        ("year", "UTC", Some("02-30"), "MM-DD"),
        ("year", "UTC", Some("13-01"), "MM-DD"),
        ("day", "UTC", Some("06:00"), "takes no anchor"),
        // signs and spaces are not digits (issue 52: `+4-+1` was April 1)
        ("year", "UTC", Some("+4-+1"), "MM-DD"),
        ("year", "UTC", Some("04- 1"), "MM-DD"),
        ("month", "UTC", Some("+15"), "1 to 31"),
        ("month", "UTC", Some("015"), "1 to 31"),
    ] {
        let e = Calendar::parse(unit, zone, starts).expect_err("refused");
        assert!(e.contains(says), "{unit} {zone} {starts:?}: {e}");
    }
    assert_eq!(
        cal("month", "America/New_York", Some("15")).to_string(),
        "a calendar month in America/New_York from day 15"
    );
    // one digit or two
    let _ = cal("year", "UTC", Some("4-1"));
    let _ = cal("year", "UTC", Some("04-01"));
}

#[test]
fn runs_of_units_are_counted_from_the_epochs() {
    // quarters: three months from January
    let quarter = cal("month", "America/New_York", None).every(3);
    let p = quarter.periods_at(at("2026-12-05T12:00:00Z"));
    assert_eq!(
        (p.start, p.end, p.next_end),
        (
            at("2026-10-01T00:00:00-04:00"),
            at("2027-01-01T00:00:00-05:00"),
            at("2027-04-01T00:00:00-04:00")
        )
    );
    // half years from a billing day: from the 15th of January and July
    let half = cal("month", "UTC", Some("15")).every(6);
    let p = half.periods_at(at("2026-07-14T23:59:59Z"));
    assert_eq!(
        (p.start, p.end),
        (at("2026-01-15T00:00:00Z"), at("2026-07-15T00:00:00Z"))
    );
    // fortnights from the week holding 1970-01-01 (Monday 1969-12-29)
    let fortnight = cal("week", "UTC", None).every(2);
    let p = fortnight.periods_at(at("2026-12-05T10:00:00Z"));
    assert_eq!(
        (p.start, p.end),
        (at("2026-11-30T00:00:00Z"), at("2026-12-14T00:00:00Z"))
    );
    assert_eq!(
        fortnight.periods_at(at("2026-12-13T23:59:59Z")).start,
        p.start,
        "the whole fortnight is one period"
    );
    // seven days from 1970-01-01, across a daylight-saving change: 7 days
    // less an hour
    let week_of_days = cal("day", "Europe/Berlin", None).every(7);
    let p = week_of_days.periods_at(at("2026-03-29T12:00:00+02:00"));
    assert_eq!((p.end - p.start) % 86_400, 86_400 - 3600);
    assert_eq!((p.end - p.start) / 86_400, 6);
    assert_eq!(
        cal("month", "America/New_York", Some("15"))
            .every(3)
            .to_string(),
        "3 calendar months in America/New_York from day 15"
    );
}
