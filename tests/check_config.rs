//! `tokenbucket-rls check-config` against envoyproxy/ratelimit's own config
//! fixtures: every file must give the result listed in
//! `tests/fixtures/envoyproxy-ratelimit/EXPECTATIONS.md`, which this test
//! reads, so the table and the test cannot drift apart.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/envoyproxy-ratelimit"
);

fn check_config(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .arg("check-config")
        .args(args)
        .output()
        .expect("run tokenbucket-rls")
}

/// (file pattern, expected validity) rows of the EXPECTATIONS.md table.
fn expectations() -> Vec<(String, bool)> {
    let text = std::fs::read_to_string(Path::new(FIXTURES).join("EXPECTATIONS.md"))
        .expect("EXPECTATIONS.md");
    text.lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            match cells.as_slice() {
                ["", file, "valid", ..] => Some((file.to_string(), true)),
                ["", file, "invalid", ..] => Some((file.to_string(), false)),
                _ => None,
            }
        })
        .collect()
}

/// Expands `dir/*.yaml` rows; plain rows name one file.
fn files_of(pattern: &str) -> Vec<PathBuf> {
    match pattern.split_once("/*") {
        Some((dir, ext)) => {
            let mut files: Vec<PathBuf> = std::fs::read_dir(Path::new(FIXTURES).join(dir))
                .expect("fixture dir")
                .map(|e| e.expect("entry").path())
                .filter(|p| p.to_string_lossy().ends_with(ext))
                .collect();
            files.sort();
            files
        }
        None => vec![Path::new(FIXTURES).join(pattern)],
    }
}

#[test]
fn every_peer_fixture_gives_the_expected_result() {
    let rows = expectations();
    assert!(rows.len() >= 20, "the table was read: {rows:?}");
    let mut checked = 0;
    for (pattern, valid) in rows {
        let files = files_of(&pattern);
        assert!(!files.is_empty(), "{pattern} names files");
        for file in files {
            let out = check_config(&[file.to_str().expect("utf-8 path")]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert_eq!(out.status.success(), valid, "{}: {stdout}", file.display());
            if !valid {
                let name = file.file_name().and_then(|n| n.to_str()).expect("name");
                for line in stdout.lines() {
                    assert!(line.contains(name), "every error names the file: {line}");
                }
                assert!(!stdout.trim().is_empty(), "{name}: says what is wrong");
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 42, "all 42 fixture files were checked");
}

#[test]
fn a_domain_split_over_two_files_needs_merge_domains() {
    let dir = tempfile::tempdir().expect("tempdir");
    for name in ["merge_domain_key1.yaml", "merge_domain_key2.yaml"] {
        std::fs::copy(
            Path::new(FIXTURES).join("config").join(name),
            dir.path().join(name),
        )
        .expect("copy");
    }
    let path = dir.path().to_str().expect("utf-8 path");
    let out = check_config(&[path]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.contains("merge_domain_key1.yaml") && stdout.contains("merge_domain_key2.yaml"),
        "names both files: {stdout}"
    );
    let out = check_config(&[path, "--merge-domains"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn errors_carry_lines_and_places() {
    let out = check_config(&[&format!("{FIXTURES}/config/misspelled_key.yaml")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("unknown field `ratelimit`") && stdout.contains("line 5"),
        "{stdout}"
    );
    let out = check_config(&[&format!("{FIXTURES}/config/bad_limit_unit.yaml")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("key1=value1") && stdout.contains("'foo'"),
        "{stdout}"
    );
}

#[test]
fn the_shipped_config_directory_is_valid() {
    let out = check_config(&[concat!(env!("CARGO_MANIFEST_DIR"), "/config")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_missing_path_is_an_error_naming_it() {
    let out = check_config(&["/nonexistent/rules"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("/nonexistent/rules"));
}

/// `check-config --rlqs` prints what RLQS assigns the buckets of each rule,
/// the bucket id keys that reach it, and where RLQS differs from
/// ShouldRateLimit.
#[test]
fn rlqs_mapping_is_printed_with_its_notes() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("r.yaml"),
        r#"
domain: edge
descriptors:
  - key: tenant
    value: acme
    failure_mode: local
    descriptors:
      - key: api_key
        limits:
          - {unit: second, requests_per_unit: 100, burst: 200}
          - {unit: hour, requests_per_unit: 3600}
        lease: {size: 10, ttl: 1s}
  - key: tenant
    value: free
    failure_mode: closed
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: internal
    rate_limit: {unlimited: true}
  - key: path
    value: "/api/*"
    share_threshold: true
    rate_limit: {unit: second, requests_per_unit: 10, burst: 10}
"#,
    )
    .expect("write");
    let out = check_config(&["--rlqs", dir.path().to_str().expect("utf-8")]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("rlqs:")).collect();
    assert_eq!(
        lines,
        [
            "rlqs: domain edge, bucket_id keys {internal} -> internal: ALLOW_ALL",
            "rlqs:   expired_assignment_behavior: as the server's --failure-mode (open: ALLOW_ALL, closed: DENY_ALL)",
            "rlqs: domain edge, bucket_id keys {path} -> path_/api/*: split between Envoys: burst 10, 10/s",
            "rlqs:   expired_assignment_behavior: as the server's --failure-mode (open: ALLOW_ALL, closed: DENY_ALL)",
            "rlqs:   note: share_threshold: every bucket id whose 'path' matches '/api/*' spends one budget, split between the (Envoy, bucket id) pairs reporting them (at most 4096)",
            "rlqs: domain edge, bucket_id keys {tenant, api_key} -> tenant_acme.api_key: split between Envoys: burst 3600, 1/s",
            "rlqs:   expired_assignment_behavior: fallback_rate_limit: {token_bucket: ...} of 1/N of burst 3600 and of 1/s (N: the Envoys)",
            "rlqs:   note: 2 limits: RLQS splits the one with the lowest rate only",
            "rlqs:   note: lease: applies to ShouldRateLimit only (RLQS splits the budget between Envoys itself)",
            "rlqs: domain edge, bucket_id keys {tenant} -> tenant_free: DENY_ALL",
            "rlqs:   expired_assignment_behavior: fallback_rate_limit: {blanket_rule: DENY_ALL}",
        ],
        "{text}"
    );
    // without --rlqs: the one summary line
    let out = check_config(&[dir.path().to_str().expect("utf-8")]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
}

/// The rules the project ships are valid: `config/` (what the first
/// command serves), `examples/bench/` (what the benchmarks and
/// `rls-bench --domain bench` need) and `examples/llm/` (the usage-based
/// walkthrough).
#[test]
fn the_shipped_rules_are_valid() {
    for dir in [
        "config",
        "examples/bench",
        "examples/llm",
        "examples/concurrency",
    ] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        let out = check_config(&[path.to_str().expect("utf-8")]);
        assert!(
            out.status.success(),
            "{dir}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// `check-config` says what each rule with `attempts:` does with them.
#[test]
fn check_config_says_what_each_rule_does_with_attempts() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = check_config(&[root.join("examples/llm").to_str().expect("utf-8")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("attempts: domain llm, rule reserving_user: reservations: a start reserves its own hits_addend, else 600, refused unless held; the done call settles the difference; unsettled after 5m: kept as spent (attempt entry 'request_id', done when 'phase' is 'done')"),
        "{text}"
    );
    assert!(
        !text.contains("rule user:"),
        "rules without attempts say nothing: {text}"
    );
    let out = check_config(&[root.join("examples/concurrency").to_str().expect("utf-8")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("attempts: domain streams, rule user: at most 3 in flight per value: a start takes a slot, the done call releases it, a slot not released returns after 10m"),
        "{text}"
    );
}

/// A migration that asks for envoyproxy/ratelimit's fixed windows for every
/// rule (`--algorithm fixed_window`, #41), or sliding ones, loads every one
/// of its own valid fixtures the same, and refuses the invalid ones as before; a burst (ours,
/// not theirs) is named with the way out.
#[test]
fn the_peer_fixtures_load_under_a_window_default() {
    for algorithm in ["fixed_window", "sliding_window"] {
        for (pattern, valid) in expectations() {
            for file in files_of(&pattern) {
                let out =
                    check_config(&[file.to_str().expect("utf-8 path"), "--algorithm", algorithm]);
                let stdout = String::from_utf8_lossy(&out.stdout);
                assert_eq!(
                    out.status.success(),
                    valid,
                    "{} under {algorithm}: {stdout}",
                    file.display()
                );
            }
        }
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rules.yaml");
    std::fs::write(
        &rules,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 3, burst: 9}\n",
    )
    .expect("write");
    let out = check_config(&[
        rules.to_str().expect("utf-8"),
        "--algorithm",
        "fixed_window",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.contains("has no burst") && stdout.contains("`algorithm: token_bucket`"),
        "{stdout}"
    );
    let out = check_config(&[rules.to_str().expect("utf-8"), "--algorithm", "sliding"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("not one of token_bucket, fixed_window, sliding_window"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A calendar limit (#41): `check-config` says what it counts and which
/// period runs now, `--rlqs` what RLQS makes of it, and a zone that is not
/// one is refused naming the file, the rule and the field.
#[test]
fn check_config_shows_calendar_periods_and_refuses_an_unknown_zone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rules.yaml");
    std::fs::write(
        &rules,
        "domain: billing\ndescriptors:\n  - key: tenant\n    overdraft: true\n    rate_limit: {unit: month, requests_per_unit: 1000000, calendar: {time_zone: America/New_York, starts: 15}}\n",
    )
    .expect("write");
    let out = check_config(&[rules.to_str().expect("utf-8"), "--rlqs"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("calendar: domain billing, rule tenant: 1000000 a calendar month in America/New_York from day 15, admitted hits and charges counted; now from ")
            && stdout.contains("-15T00:00:00-0")
            && stdout.contains("[America/New_York]"),
        "{stdout}"
    );
    assert!(
        stdout.contains("note: calendar: RLQS's token buckets have no windows or calendar periods"),
        "{stdout}"
    );
    std::fs::write(
        &rules,
        "domain: billing\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: month, requests_per_unit: 10, calendar: {time_zone: US/Gotham}}\n",
    )
    .expect("write");
    let out = check_config(&[rules.to_str().expect("utf-8")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.contains("rules.yaml")
            && stdout.contains("tenant")
            && stdout.contains(
                "calendar: time_zone 'US/Gotham' is not a time zone of the IANA database"
            ),
        "{stdout}"
    );
}

/// A rule with `replication:` (#52 item 1): `check-config` says what an
/// admission waits for; a timeout past the bound is refused naming the
/// file, the rule and the value.
#[test]
fn check_config_shows_replication_and_refuses_a_timeout_too_long() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rules.yaml");
    std::fs::write(
        &rules,
        "domain: paid\ndescriptors:\n  - key: api_key\n    failure_mode: closed\n    replication: {replicas: 2, timeout: 80ms}\n    rate_limit: {unit: second, requests_per_unit: 10}\n",
    )
    .expect("write");
    let out = check_config(&[rules.to_str().expect("utf-8")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("replication: domain paid, rule api_key: an admission is answered once 2 replica(s) of the Redis primary hold it (WAIT, up to 80ms; then the rule's failure mode)"),
        "{stdout}"
    );
    std::fs::write(
        &rules,
        "domain: paid\ndescriptors:\n  - key: api_key\n    replication: {replicas: 2, timeout: 5s}\n    rate_limit: {unit: second, requests_per_unit: 10}\n",
    )
    .expect("write");
    let out = check_config(&[rules.to_str().expect("utf-8")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.contains("rules.yaml")
            && stdout.contains("api_key")
            && stdout.contains("replication.timeout '5s' is longer than 1s"),
        "{stdout}"
    );
}

/// Under envoyproxy/ratelimit's environment (`--ratelimit-rules`, which it
/// sets) every fixture loads or fails as there: as above, but for
/// `duplicate_domain.yaml`, a domain whose `descriptors:` is null, which
/// loads alone there too (its test fails it beside `basic_config.yaml`,
/// for the domain defined twice: so here).
#[test]
fn every_peer_fixture_loads_or_fails_as_there_under_its_rules() {
    let mut checked = 0;
    for (pattern, valid) in expectations() {
        for file in files_of(&pattern) {
            let path = file.to_str().expect("utf-8 path");
            let out = check_config(&["--ratelimit-rules", path]);
            let alone_there = path.ends_with("duplicate_domain.yaml");
            assert_eq!(out.status.success(), valid || alone_there, "{path}");
            checked += 1;
        }
    }
    assert_eq!(checked, 42);
    let both = tempfile::tempdir().expect("tempdir");
    for name in ["basic_config.yaml", "duplicate_domain.yaml"] {
        let from = Path::new(FIXTURES).join("config").join(name);
        std::fs::copy(from, both.path().join(name)).expect("copy");
    }
    let out = check_config(&["--ratelimit-rules", both.path().to_str().expect("utf-8")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.contains("duplicate_domain.yaml: domain 'test-domain' is already defined"),
        "{stdout}"
    );
}

/// Files envoyproxy/ratelimit loads that this service refuses by default
/// (a file cut short looks like the first two): under its rules they load
/// as there, and a warning says what is ignored; `share_threshold` without
/// a `*`, which it refuses, is refused either way.
#[test]
fn what_it_loads_loads_under_its_rules_with_a_warning() {
    let cases = [
        ("null", "domain: a\ndescriptors:\n", "`descriptors` is null or missing"),
        ("missing", "domain: b\n", "`descriptors` is null or missing"),
        (
            "unlimited",
            "domain: c\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, requests_per_unit: 5}\n",
            "requests_per_unit 5 beside `unlimited: true` is ignored",
        ),
        (
            "two",
            "domain: d\ndescriptors: []\n---\ndomain: e\ndescriptors: []\n",
            "1 YAML document(s) after the first are ignored",
        ),
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, text, warning) in cases {
        let file = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&file, text).expect("write");
        let path = file.to_str().expect("utf-8");
        let strict = check_config(&[path]);
        assert!(!strict.status.success(), "{name}: refused by default");
        let theirs = check_config(&["--ratelimit-rules", path]);
        let stderr = String::from_utf8_lossy(&theirs.stderr);
        assert!(theirs.status.success(), "{name}: {stderr}");
        assert!(
            stderr.contains(&format!("warning: {path}: ")) && stderr.contains(warning),
            "{name}: {stderr}"
        );
    }
    // with a unit beside `unlimited`, refused there and here alike
    let file = dir.path().join("unit.yaml");
    std::fs::write(
        &file,
        "domain: f\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: day}\n",
    )
    .expect("write");
    let path = file.to_str().expect("utf-8");
    assert!(!check_config(&["--ratelimit-rules", path]).status.success());
    let file = dir.path().join("share.yaml");
    std::fs::write(
        &file,
        "domain: g\ndescriptors:\n  - key: k\n    value: v\n    share_threshold: true\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    )
    .expect("write");
    let path = file.to_str().expect("utf-8");
    for args in [vec![path], vec!["--ratelimit-rules", path]] {
        let out = check_config(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success());
        assert!(
            stdout.contains("`share_threshold: true` needs a value with `*`"),
            "{stdout}"
        );
    }
}
