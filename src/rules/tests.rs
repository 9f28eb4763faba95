//! Matcher and validation cases.

use std::path::PathBuf;

use super::*;

fn load(yaml: &str) -> Result<RuleSet, ConfigErrors> {
    load_sources(
        vec![(PathBuf::from("rules.yaml"), yaml.to_string())],
        LoadOptions::default(),
    )
}

fn errors(yaml: &str) -> String {
    match load(yaml) {
        Ok(_) => panic!("expected an error for:\n{yaml}"),
        Err(e) => e.to_string(),
    }
}

/// The rule path reached by `entries`, or "-" for none.
fn reach(rules: &RuleSet, domain: &str, entries: &[(&str, &str)]) -> String {
    rules
        .lookup(domain, entries)
        .map(|m| m.rule.path.clone())
        .unwrap_or_else(|| "-".into())
}

const BASIC: &str = r#"
domain: test
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
      - key: subkey1
        value: subvalue1
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key2
    value: value2
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: key2
    value: value3
  - key: wild
    value: foo*
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: wild
    value: f*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: wild
    value: foobar
    rate_limit: {unit: minute, requests_per_unit: 3}
"#;

#[test]
fn exact_then_wildcards_in_file_order_then_default() {
    let r = load(BASIC).expect("valid");
    assert_eq!(reach(&r, "test", &[("key2", "value2")]), "key2_value2");
    assert_eq!(reach(&r, "test", &[("key2", "other")]), "key2");
    assert_eq!(
        reach(&r, "test", &[("key2", "value3")]),
        "-",
        "whitelisted value"
    );
    assert_eq!(reach(&r, "test", &[("wild", "foobar")]), "wild_foobar");
    assert_eq!(reach(&r, "test", &[("wild", "foozle")]), "wild_foo*");
    assert_eq!(reach(&r, "test", &[("wild", "fizz")]), "wild_f*");
    assert_eq!(reach(&r, "test", &[("wild", "zzz")]), "-");
}

#[test]
fn nested_descriptors_need_every_entry() {
    let r = load(BASIC).expect("valid");
    assert_eq!(
        reach(&r, "test", &[("key1", "value1")]),
        "-",
        "no limit on the parent"
    );
    assert_eq!(
        reach(&r, "test", &[("key1", "value1"), ("subkey1", "x")]),
        "key1_value1.subkey1"
    );
    assert_eq!(
        reach(&r, "test", &[("key1", "value1"), ("subkey1", "subvalue1")]),
        "key1_value1.subkey1_subvalue1"
    );
    assert_eq!(
        reach(&r, "test", &[("key1", "other"), ("subkey1", "x")]),
        "-"
    );
    assert_eq!(
        reach(
            &r,
            "test",
            &[("key1", "value1"), ("subkey1", "x"), ("deeper", "y")]
        ),
        "-",
        "an entry past the tree matches nothing"
    );
    assert_eq!(reach(&r, "other-domain", &[("key2", "x")]), "-");
}

#[test]
fn share_threshold_names_the_bucket_by_pattern() {
    let r = load(BASIC).expect("valid");
    let entries = [("wild", "fizz")];
    let m = r.lookup("test", &entries).expect("match");
    assert_eq!(m.values, vec![BucketValue::Shared("f*")]);
    let entries = [("wild", "foozle")];
    let m = r.lookup("test", &entries).expect("match");
    assert_eq!(m.values, vec![BucketValue::Value("foozle")]);
}

#[test]
fn burst_defaults_to_requests_per_unit_and_limits_are_kept_in_order() {
    let r = load(
        r#"
domain: d
descriptors:
  - key: path
    value: /login
    failure_mode: closed
    limits:
      - {unit: second, requests_per_unit: 5, burst: 20, name: login-burst}
      - {unit: hour, requests_per_unit: 300}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 1}
"#,
    )
    .expect("valid");
    let entries = [("path", "/login")];
    let m = r.lookup("d", &entries).expect("match");
    let RuleAction::Limited(limits) = &m.rule.action else {
        panic!("limited")
    };
    assert_eq!(limits.len(), 2);
    assert_eq!(
        (limits[0].burst, limits[0].bucket_id.as_str()),
        (20, "login-burst")
    );
    assert_eq!((limits[1].burst, limits[1].bucket_id.as_str()), (300, "#1"));
    assert_eq!(limits[1].params.unit_secs, 3600);
    assert_eq!(m.rule.failure_mode, Some(FailureMode::Closed));
    let nested = [("path", "/login"), ("user", "u")];
    let m = r.lookup("d", &nested).expect("match");
    assert_eq!(m.rule.failure_mode, Some(FailureMode::Closed), "inherited");
}

#[test]
fn scalar_values_are_strings() {
    let r = load("domain: d\ndescriptors:\n  - key: status\n    value: 500\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
        .expect("valid");
    assert_eq!(reach(&r, "d", &[("status", "500")]), "status_500");
}

#[test]
fn validation_errors_name_file_place_and_problem() {
    let cases: &[(&str, &str)] = &[
        ("domain: d\ndescriptors:\n  - key: k\n    ratelimit: {unit: second}\n", "unknown field `ratelimit`"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requestsperunit: 1}\n", "unknown field `requestsperunit`"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n", "unit 'fortnight' is not one of"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 1}\n", "`unit` is missing"),
        ("domain: d\ndescriptors:\n  - value: v\n", "`key` is missing or empty"),
        ("domain: d\ndescriptors:\n  - key: ''\n", "`key` is missing or empty"),
        ("descriptors: []\n", "`domain` is missing or empty"),
        ("domain: ''\ndescriptors: []\n", "`domain` is missing or empty"),
        ("domain: d\ndescriptors:\n", "`descriptors:` is empty"),
        ("domain: d\n", "`descriptors` is missing"),
        ("domain: d\ndescriptors:\n  - key: k\n    value: v\n  - key: k\n    value: v\n", "descriptor k=v: defined twice"),
        ("domain: d\ndescriptors:\n  - key: k\n  - key: k\n", "descriptor k: defined twice"),
        ("domain: d\ndescriptors:\n  - key: k\n    value: a*\n  - key: k\n    value: a*\n", "defined twice"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: day}\n", "`unlimited: true` and also a unit"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 0}\n", "burst is 0"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n    limits: [{unit: second, requests_per_unit: 1}]\n", "cannot both be set"),
        ("domain: d\ndescriptors:\n  - key: k\n    limits: []\n", "`limits` is empty"),
        ("domain: d\ndescriptors:\n  - key: k\n    limits:\n      - {unit: hour, requests_per_unit: 3}\n      - {name: '#0', unit: second, requests_per_unit: 100}\n", "the name '#0' is the bucket id of the unnamed limit at limits[0]"),
        ("domain: d\ndescriptors:\n  - key: k\n    limits: [{unlimited: true}]\n", "belongs in `rate_limit`"),
        ("domain: d\ndescriptors:\n  - key: k\n    limits: [{name: a, unit: second, requests_per_unit: 1}, {name: a, unit: hour, requests_per_unit: 1}]\n", "used by two limits"),
        ("domain: d\ndescriptors:\n  - key: k\n    failure_mode: sometimes\n", "failure_mode 'sometimes' is not one of open, closed, local"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {name: a, unit: second, requests_per_unit: 1, replaces: [{name: a}]}\n", "replaces itself"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: }]}\n", "`name` is missing or empty"),
        ("domain: d\ndescriptors:\n  - key: k\n    overdraft: true\n    lease: {size: 10, ttl: 1s}\n    rate_limit: {unit: second, requests_per_unit: 100}\n", "`overdraft` and `lease` together"),
        ("domain: d\ndescriptors:\n  - key: k\n    overdraft: true\n    rate_limit: {unit: second, requests_per_unit: 0}\n", "`overdraft` with `requests_per_unit: 0`"),
        ("domain: d\ndescriptors:\n  - key: k\n    overdraft: true\n    rate_limit: {unlimited: true}\n", "`overdraft` on an unlimited rule: there is no bucket to charge"),
        ("domain: d\ndescriptors:\n  - key: k\n    overdraft: true\n", "`overdraft` needs a `rate_limit` or `limits`"),
        ("domain: d\ndescriptors:\n  - key: k\n    metadata: [a, b]\n    rate_limit: {unit: second, requests_per_unit: 1}\n", "`metadata` must be a map"),
        ("domain: d\ndescriptors:\n  - a\n  - b\n", "invalid rules file"),
        ("'''\n", "invalid rules file"),
        ("0.25: d\ndescriptors: []\n", "invalid rules file"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: -1}\n", "invalid rules file"),
    ];
    for (yaml, expected) in cases {
        let msg = errors(yaml);
        assert!(msg.starts_with("rules.yaml: "), "names the file: {msg}");
        assert!(
            msg.contains(expected),
            "expected {expected:?} in {msg:?}\nfor:\n{yaml}"
        );
    }
}

#[test]
fn yaml_errors_carry_the_line() {
    let msg = errors("domain: d\ndescriptors:\n  - key: k\n    ratelimit: {unit: second}\n");
    assert!(msg.contains("line 4"), "{msg}");
    // and say that it is the first: the rest of the file waits for it
    assert!(
        msg.contains("the first error only: the rest of this file is checked once it parses"),
        "{msg}"
    );
}

#[test]
fn all_errors_are_reported_not_just_the_first() {
    let msg = errors(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: x}\n  - key: b\n    rate_limit: {unit: y}\n",
    );
    assert!(
        msg.contains("unit 'x'") && msg.contains("unit 'y'"),
        "{msg}"
    );
}

#[test]
fn a_domain_in_two_files_needs_merge_domains() {
    let one = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    let two = "domain: d\ndescriptors:\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    let sources = || {
        vec![
            (PathBuf::from("one.yaml"), one.to_string()),
            (PathBuf::from("two.yaml"), two.to_string()),
        ]
    };
    let err = load_sources(sources(), LoadOptions::default())
        .expect_err("split domain")
        .to_string();
    assert!(
        err.contains("two.yaml") && err.contains("one.yaml") && err.contains("--merge-domains"),
        "{err}"
    );
    let merged = load_sources(
        sources(),
        LoadOptions {
            merge_domains: true,
            ..LoadOptions::default()
        },
    )
    .expect("merged");
    assert_eq!(reach(&merged, "d", &[("a", "x")]), "a");
    assert_eq!(reach(&merged, "d", &[("b", "x")]), "b");
    let clash = load_sources(
        vec![
            (PathBuf::from("one.yaml"), one.to_string()),
            (PathBuf::from("again.yaml"), one.to_string()),
        ],
        LoadOptions {
            merge_domains: true,
            ..LoadOptions::default()
        },
    )
    .expect_err("same key twice across merged files")
    .to_string();
    assert!(
        clash.contains("again.yaml") && clash.contains("defined twice"),
        "{clash}"
    );
}

#[test]
fn an_empty_file_is_rejected_with_one_message() {
    for text in ["", "# nothing yet\n", "---\n"] {
        let err = load_sources(
            vec![(PathBuf::from("empty.yaml"), text.to_string())],
            LoadOptions::default(),
        )
        .expect_err("empty");
        assert_eq!(
            err.to_string(),
            "empty.yaml: the file holds no rules (it is empty, or only comments); give it a `domain:` and `descriptors:`, or remove it",
            "{text:?}"
        );
    }
}

#[test]
fn a_domain_in_two_files_is_reported_once() {
    let rules = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    let err = load_sources(
        vec![
            (PathBuf::from("one.yaml"), rules.to_string()),
            (PathBuf::from("two.yaml"), rules.to_string()),
        ],
        LoadOptions::default(),
    )
    .expect_err("clash");
    assert_eq!(err.0.len(), 1, "{err}");
    assert_eq!(
        err.to_string(),
        "two.yaml: domain 'd' is already defined in one.yaml; a domain lives in one file unless --merge-domains is set"
    );
}

#[test]
fn leases_are_parsed_with_a_default_ttl() {
    let rules = load(
        r#"
domain: d
descriptors:
  - key: hot
    lease: {size: 50, ttl: 250ms}
    rate_limit: {unit: second, requests_per_unit: 1000, burst: 500}
  - key: plain
    lease: {size: 10}
    rate_limit: {unit: minute, requests_per_unit: 10}
"#,
    )
    .expect("valid");
    let lease = |k: &str| {
        rules
            .lookup("d", &[(k, "x")])
            .and_then(|m| m.rule.lease)
            .expect("leased")
    };
    assert_eq!(lease("hot").size, 50);
    assert_eq!(lease("hot").ttl, std::time::Duration::from_millis(250));
    assert_eq!(lease("plain").ttl, std::time::Duration::from_secs(1));
}

#[test]
fn bad_max_values_are_named() {
    let cases = [
        (
            "max_values: 0\n    rate_limit: {unit: second, requests_per_unit: 5}",
            "`max_values: 0`",
        ),
        (
            "max_values: 10\n    rate_limit: {unlimited: true}",
            "`max_values` on an unlimited rule",
        ),
        (
            "max_values: 10",
            "`max_values` needs a `rate_limit` or `limits`",
        ),
        (
            "max_values: many\n    rate_limit: {unit: second, requests_per_unit: 5}",
            "max_values",
        ),
    ];
    for (rule, expected) in cases {
        let yaml = format!("domain: d\ndescriptors:\n  - key: k\n    {rule}\n");
        let e = errors(&yaml);
        assert!(e.contains(expected), "for {rule}: {e}");
        assert!(e.contains("rules.yaml"), "{e}");
    }
    // a key twice on a global rule's path: two descriptors (k=a, k=b) and
    // (k=c, k=b) would be one RLQS bucket id {k: b}
    let e = errors(
        "domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: k\n        scope: global\n        rate_limit: {unit: second, requests_per_unit: 5}\n",
    );
    assert!(e.contains("the key 'k' comes twice"), "{e}");
    assert!(e.contains("rules.yaml"), "{e}");
}

#[test]
fn bad_leases_are_named() {
    let cases = [
        (
            "lease: {ttl: 1s}\n    rate_limit: {unit: second, requests_per_unit: 5}",
            "lease.size is missing or 0",
        ),
        (
            "lease: {size: 6}\n    rate_limit: {unit: second, requests_per_unit: 5}",
            "lease.size 6 is larger than the burst 5 of the limit",
        ),
        (
            "lease: {size: 6}\n    limits: [{name: a, unit: second, requests_per_unit: 50}, {name: b, unit: hour, requests_per_unit: 5}]",
            "burst 5 of limit 'b'",
        ),
        (
            "lease: {size: 2, ttl: soon}\n    rate_limit: {unit: second, requests_per_unit: 5}",
            "lease.ttl 'soon' is not a duration",
        ),
        (
            "lease: {size: 2, ttl: 5m}\n    rate_limit: {unit: second, requests_per_unit: 5}",
            "lease.ttl '5m' is outside 10ms..60s",
        ),
        (
            "lease: {size: 2}\n    rate_limit: {unlimited: true}",
            "`lease` on an unlimited rule",
        ),
        (
            "lease: {size: 2}",
            "`lease` needs a `rate_limit` or `limits`",
        ),
        (
            "lease: {size: 2, ttl: 1s, hot: true}\n    rate_limit: {unit: second, requests_per_unit: 5}",
            "unknown field `hot`",
        ),
    ];
    for (rule, expected) in cases {
        let yaml = format!("domain: d\ndescriptors:\n  - key: k\n    {rule}\n");
        let e = errors(&yaml);
        assert!(e.contains(expected), "for {rule}: {e}");
        assert!(e.contains("rules.yaml"), "{e}");
    }
    // a key twice on a global rule's path: two descriptors (k=a, k=b) and
    // (k=c, k=b) would be one RLQS bucket id {k: b}
    let e = errors(
        "domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: k\n        scope: global\n        rate_limit: {unit: second, requests_per_unit: 5}\n",
    );
    assert!(e.contains("the key 'k' comes twice"), "{e}");
    assert!(e.contains("rules.yaml"), "{e}");
}

/// An RLQS bucket id reaches the rule `ShouldRateLimit` reaches with the
/// same entries as a descriptor, whatever order the id's map gives them:
/// the lookup tries every order the tree allows (it took the
/// alphabetically first key at each level and never backtracked, so
/// `{tenant: small, api_key: k1}` reached no rule beside a top-level
/// `api_key` rule).
#[test]
fn a_bucket_id_reaches_the_rule_its_descriptor_reaches() {
    let rules = load(
        r#"
domain: d
descriptors:
  - key: api_key
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: tenant
    value: small
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 2}
"#,
    )
    .expect("valid");
    let id = [("tenant", "small"), ("api_key", "k1")];
    for entries in [id, [id[1], id[0]]] {
        let path = rules.quota_path("d", &entries).expect("domain");
        assert_eq!(path, vec![("tenant", "small"), ("api_key", "k1")]);
        assert_eq!(reach(&rules, "d", &path), "tenant_small.api_key");
    }
}

/// Every rule of `config/` and of envoyproxy/ratelimit's own test configs
/// that load: a descriptor path to it, given as a bucket id in that order
/// and reversed, reaches the rule the descriptor reaches.
#[test]
fn every_rule_of_the_shipped_and_peer_configs_is_reached_by_its_bucket_id() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = Vec::new();
    for dir in ["config", "tests/fixtures/envoyproxy-ratelimit/config"] {
        for entry in std::fs::read_dir(root.join(dir)).expect("dir") {
            let path = entry.expect("entry").path();
            if path.extension().is_some_and(|e| e == "yaml") {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut checked = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read");
        let Ok(rules) = load_sources(vec![(file.clone(), text)], LoadOptions::default()) else {
            continue; // the peer's invalid configs
        };
        for domain in rules.domains() {
            for path in domain.root.example_paths() {
                let entries: Vec<(&str, &str)> =
                    path.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let want = reach(&rules, &domain.name, &entries);
                let mut reversed = entries.clone();
                reversed.reverse();
                for id in [&entries, &reversed] {
                    let found = rules.quota_path(&domain.name, id).expect("domain");
                    assert_eq!(
                        reach(&rules, &domain.name, &found),
                        want,
                        "{}: {id:?}",
                        file.display()
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 20, "{checked} rules walked");
}

/// `--usage-domains` marks the rules of matching domains that can hold a
/// debt (limits that refill, no lease); other domains are untouched.
#[test]
fn usage_domains_mark_the_rules_that_can_hold_a_debt() {
    let yaml = |domain: &str| {
        format!(
            "domain: {domain}\ndescriptors:\n  - key: tokens\n    rate_limit: {{unit: minute, requests_per_unit: 1000}}\n  - key: leased\n    lease: {{size: 10, ttl: 1s}}\n    rate_limit: {{unit: second, requests_per_unit: 100}}\n  - key: blocked\n    rate_limit: {{unit: second, requests_per_unit: 0}}\n  - key: free\n    rate_limit: {{unlimited: true}}\n  - key: two\n    limits:\n      - {{unit: second, requests_per_unit: 5}}\n      - {{unit: hour, requests_per_unit: 100, name: hourly}}\n"
        )
    };
    let set = load_sources(
        vec![
            (PathBuf::from("a.yaml"), yaml("gw/llm")),
            (PathBuf::from("b.yaml"), yaml("edge")),
        ],
        LoadOptions {
            usage_domains: DomainPatterns::new(&["gw/*", ""]),
            ..LoadOptions::default()
        },
    )
    .expect("valid");
    let charges = |domain: &str, key: &str| {
        set.lookup(domain, &[(key, "v")][..])
            .expect("a rule")
            .rule
            .usage_charges
    };
    assert!(set.is_usage_domain("gw/llm") && !set.is_usage_domain("edge"));
    assert!(charges("gw/llm", "tokens") && charges("gw/llm", "two"));
    assert!(!charges("gw/llm", "leased") && !charges("gw/llm", "blocked"));
    assert!(!charges("edge", "tokens"));
    assert!(!DomainPatterns::new::<&str>(&[]).matches("gw/llm"));
    assert!(DomainPatterns::new(&["*"]).matches("anything"));
    assert!(!DomainPatterns::new(&["llm"]).matches("llm2"));
}

#[test]
fn a_global_scope_marks_the_rule_and_bad_ones_are_named() {
    let rules = load(
        r#"
domain: d
descriptors:
  - key: api_key
    scope: global
    rate_limit: {unit: second, requests_per_unit: 5, burst: 10}
  - key: plain
    scope: regional
    rate_limit: {unit: second, requests_per_unit: 5}
"#,
    )
    .expect("valid");
    let global = |k: &str| rules.lookup("d", &[(k, "x")]).expect("rule").rule.global;
    assert!(global("api_key"));
    assert!(!global("plain"));

    let cases = [
        (
            "scope: planet\n    rate_limit: {unit: second, requests_per_unit: 5}",
            "scope 'planet' is not one of regional, global",
        ),
        (
            "scope: global\n    rate_limit: {unlimited: true}",
            "`scope: global` on an unlimited rule",
        ),
        ("scope: global", "`scope: global` needs a `rate_limit`"),
        (
            "scope: global\n    limits:\n      - {unit: second, requests_per_unit: 5}\n      - {unit: minute, requests_per_unit: 50}",
            "`scope: global` with 2 limits",
        ),
        (
            "scope: global\n    lease: {size: 2}\n    rate_limit: {unit: second, requests_per_unit: 5}",
            "`scope: global` and `lease` together",
        ),
    ];
    for (rule, expected) in cases {
        let yaml = format!("domain: d\ndescriptors:\n  - key: k\n    {rule}\n");
        let e = errors(&yaml);
        assert!(e.contains(expected), "for {rule}: {e}");
        assert!(e.contains("rules.yaml"), "{e}");
    }
    // a key twice on a global rule's path: two descriptors (k=a, k=b) and
    // (k=c, k=b) would be one RLQS bucket id {k: b}
    let e = errors(
        "domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: k\n        scope: global\n        rate_limit: {unit: second, requests_per_unit: 5}\n",
    );
    assert!(e.contains("the key 'k' comes twice"), "{e}");
    assert!(e.contains("rules.yaml"), "{e}");
}

#[test]
fn attempts_compile_and_their_entries_take_no_part_in_matching() {
    let rules = load(
        r#"
domain: llm
descriptors:
  - key: user
    overdraft: true
    rate_limit: {unit: minute, requests_per_unit: 1000}
    attempts: {key: request_id, ttl: 5m, reserve: 600}
  - key: api
    rate_limit: {unit: minute, requests_per_unit: 10}
    attempts: {key: request_id, ttl: 30s, phase_key: stage}
"#,
    )
    .expect("valid");
    let user = reach(&rules, "llm", &[("user", "a"), ("request_id", "r1")]);
    assert_eq!(user, "user");
    let done = reach(
        &rules,
        "llm",
        &[("user", "a"), ("request_id", "r1"), ("phase", "done")],
    );
    assert_eq!(done, "user");
    assert_eq!(
        reach(&rules, "llm", &[("request_id", "r1"), ("api", "k")]),
        "api"
    );
    let m = rules.lookup("llm", &[("user", "a")]).expect("a rule");
    let a = m.rule.attempts.as_ref().expect("attempts");
    assert_eq!(a.mode, crate::attempt::AttemptMode::Reserve);
    assert_eq!((a.reserve, a.ttl.as_secs()), (Some(600), 300));
    let m = rules.lookup("llm", &[("api", "k")]).expect("a rule");
    let a = m.rule.attempts.as_ref().expect("attempts");
    assert_eq!(a.mode, crate::attempt::AttemptMode::Dedupe);
    assert_eq!(a.phase_key, "stage");
    let mut keys = rules.attempt_keys("llm").to_vec();
    keys.sort();
    assert_eq!(keys, ["phase", "request_id", "stage"]);
    assert!(rules.attempt_keys("other").is_empty());
}

#[test]
fn attempts_that_cannot_apply_are_refused_naming_the_place() {
    let bad = |attempts: &str, extra: &str| {
        errors(&format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: 10}}\n{extra}    attempts: {attempts}\n"
        ))
    };
    let e = bad("{ttl: 1m}", "");
    assert!(e.contains("descriptor k: attempts.key is missing"), "{e}");
    let e = bad("{key: id}", "");
    assert!(e.contains("attempts.ttl is missing"), "{e}");
    let e = bad("{key: id, ttl: 2d}", "");
    assert!(e.contains("attempts.ttl 2days is outside 1s..24h"), "{e}");
    let e = bad("{key: id, ttl: soon}", "");
    assert!(e.contains("attempts.ttl:"), "{e}");
    let e = bad("{key: id, ttl: 1m, reserve: 5}", "");
    assert!(
        e.contains("attempts.reserve without `overdraft: true`"),
        "{e}"
    );
    let e = bad("{key: id, ttl: 1m, reserve: 11}", "    overdraft: true\n");
    assert!(
        e.contains("attempts.reserve 11 is larger than the burst 10"),
        "{e}"
    );
    let e = bad("{key: id, ttl: 1m, reserve: 0}", "    overdraft: true\n");
    assert!(e.contains("attempts.reserve: 0 reserves nothing"), "{e}");
    let e = bad("{key: id, ttl: 1m, phase_key: id}", "");
    assert!(
        e.contains("attempts.phase_key 'id' must be a key of its own"),
        "{e}"
    );
    let e = bad("{key: id, ttl: 1m}", "    lease: {size: 5}\n");
    assert!(e.contains("`attempts` and `lease` together"), "{e}");
    let e = bad("{key: id, ttl: 1m}", "    scope: global\n");
    assert!(e.contains("`attempts` with `scope: global`"), "{e}");
    let e = bad("{key: id, ttl: 1m, ttl_extra: 1}", "");
    assert!(e.contains("unknown field `ttl_extra`"), "{e}");
    // an attempt key that the tree matches on
    let e = errors(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10}\n    attempts: {key: user, ttl: 1m}\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
    );
    assert!(
        e.contains(
            "'user' names attempts (attempts.key or phase_key) and is also a descriptor key"
        ),
        "{e}"
    );
    // unlimited: nothing to charge
    let e = errors(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true}\n    attempts: {key: id, ttl: 1m}\n",
    );
    assert!(e.contains("`attempts` on an unlimited rule"), "{e}");
}

#[test]
fn a_concurrency_rule_compiles_with_its_attempts_and_nothing_else() {
    let rules = load(
        "domain: d\ndescriptors:\n  - key: user\n    concurrency: 3\n    attempts: {key: request_id, ttl: 1m}\n",
    )
    .expect("valid");
    let m = rules.lookup("d", &[("user", "a")]).expect("a rule");
    assert!(matches!(m.rule.action, RuleAction::Concurrency { max: 3 }));
    assert_eq!(
        m.rule.attempts.as_ref().map(|a| a.mode),
        Some(crate::attempt::AttemptMode::Slot)
    );
    let bad = |extra: &str| {
        errors(&format!(
            "domain: d\ndescriptors:\n  - key: user\n    concurrency: 3\n{extra}"
        ))
    };
    let e = bad("");
    assert!(
        e.contains("descriptor user: `concurrency` needs `attempts:"),
        "{e}"
    );
    let with = |more: &str| bad(&format!("    attempts: {{key: id, ttl: 1m}}\n{more}"));
    let e = with("    rate_limit: {unit: minute, requests_per_unit: 10}\n");
    assert!(
        e.contains("`concurrency` with `rate_limit` or `limits`"),
        "{e}"
    );
    let e = with("    overdraft: true\n");
    assert!(e.contains("`concurrency` and `overdraft` together"), "{e}");
    let e = with("    max_values: 5\n");
    assert!(e.contains("`concurrency` and `max_values` together"), "{e}");
    let e = errors("domain: d\ndescriptors:\n  - key: user\n    concurrency: 0\n    attempts: {key: id, ttl: 1m}\n");
    assert!(
        e.contains("`concurrency: 0` would refuse every request"),
        "{e}"
    );
    let e = errors("domain: d\ndescriptors:\n  - key: user\n    concurrency: 2\n    attempts: {key: id, ttl: 1m, reserve: 4}\n");
    assert!(
        e.contains("attempts.reserve on a `concurrency` rule"),
        "{e}"
    );
    let e = errors("domain: d\ndescriptors:\n  - key: user\n    concurrency: 2\n    lease: {size: 1}\n    attempts: {key: id, ttl: 1m}\n");
    assert!(e.contains("`concurrency` and `lease` together"), "{e}");
}

#[test]
fn max_debt_bounds_an_overdraft_rules_charges_and_needs_overdraft() {
    let rules = load(
        "domain: d\ndescriptors:\n  - key: user\n    overdraft: true\n    max_debt: 50\n    limits:\n      - {unit: minute, requests_per_unit: 100}\n      - {unit: hour, requests_per_unit: 1000, name: hourly}\n",
    )
    .expect("valid");
    let m = rules.lookup("d", &[("user", "a")]).expect("a rule");
    let RuleAction::Limited(limits) = &m.rule.action else {
        panic!("limited");
    };
    assert!(limits.iter().all(|l| l.params.max_debt == Some(50)));
    let e = errors("domain: d\ndescriptors:\n  - key: user\n    max_debt: 50\n    rate_limit: {unit: minute, requests_per_unit: 100}\n");
    assert!(
        e.contains("descriptor user: `max_debt` without `overdraft: true`"),
        "{e}"
    );
}

#[test]
fn a_window_of_several_units() {
    let r = load("domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, unit_multiplier: 30, requests_per_unit: 3}\n  - key: team\n    limits:\n      - {unit: minute, unit_multiplier: 10, requests_per_unit: 100, name: ten}\n      - {unit: day, requests_per_unit: 1000}\n")
        .expect("valid");
    let limits = |entries: &[(&str, &str)]| {
        let m = r.lookup("d", entries).expect("match");
        match &m.rule.action {
            RuleAction::Limited(limits) => limits
                .iter()
                .map(|l| {
                    (
                        l.unit_multiplier,
                        l.window_secs,
                        l.params.unit_secs,
                        l.burst,
                    )
                })
                .collect::<Vec<_>>(),
            _ => panic!("limited"),
        }
    };
    assert_eq!(limits(&[("user", "u")]), [(30, 30, 30, 3)]);
    assert_eq!(
        limits(&[("team", "t")]),
        [(10, 600, 600, 100), (1, 86_400, 86_400, 1000)]
    );
}

#[test]
fn windows_of_no_length_or_past_a_year_are_refused_naming_the_place() {
    let e = errors("domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, unit_multiplier: 0, requests_per_unit: 3}\n");
    assert!(
        e.contains("rules.yaml") && e.contains("user") && e.contains("unit_multiplier is 0"),
        "{e}"
    );
    let e = errors("domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: year, unit_multiplier: 2, requests_per_unit: 3}\n");
    assert!(
        e.contains("unit_multiplier 2 makes a window of 63072000 s (2 × year), longer than a year"),
        "{e}"
    );
    let e = errors("domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: day, unit_multiplier: 366, requests_per_unit: 3}\n");
    assert!(e.contains("longer than a year"), "{e}");
    load("domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: day, unit_multiplier: 365, requests_per_unit: 3}\n")
        .expect("a year to the day");
    let e = errors("domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, unit_multiplier: -1, requests_per_unit: 3}\n");
    assert!(e.contains("unit_multiplier"), "{e}");
}

#[test]
fn a_fixed_window_rule() {
    let r = load("domain: d\ndescriptors:\n  - key: user\n    algorithm: fixed_window\n    limits:\n      - {unit: minute, requests_per_unit: 3}\n      - {unit: hour, requests_per_unit: 100, name: hourly}\n  - key: team\n    algorithm: token_bucket\n    rate_limit: {unit: minute, requests_per_unit: 3}\n")
        .expect("valid");
    let limits = |entries: &[(&str, &str)]| {
        let m = r.lookup("d", entries).expect("match");
        match &m.rule.action {
            RuleAction::Limited(limits) => limits
                .iter()
                .map(|l| (l.params.algorithm, l.bucket_id.clone()))
                .collect::<Vec<_>>(),
            _ => panic!("limited"),
        }
    };
    use crate::bucket::Algorithm;
    assert_eq!(
        limits(&[("user", "u")]),
        [
            (Algorithm::FixedWindow, "#0~fixed".to_string()),
            (Algorithm::FixedWindow, "hourly~fixed".to_string())
        ]
    );
    assert_eq!(
        limits(&[("team", "t")]),
        [(Algorithm::TokenBucket, "0".to_string())]
    );
}

#[test]
fn what_a_fixed_window_cannot_honour_is_refused_naming_the_place() {
    let rule = |extra: &str, limit: &str| {
        format!("domain: d\ndescriptors:\n  - key: user\n    algorithm: fixed_window\n{extra}    rate_limit: {limit}\n")
    };
    for (extra, limit, says) in [
        (
            "",
            "{unit: minute, requests_per_unit: 3, burst: 10}",
            "has no burst",
        ),
        (
            "    overdraft: true\n    max_debt: 2\n",
            "{unit: minute, requests_per_unit: 3}",
            "`max_debt`",
        ),
        (
            "    lease: {size: 2}\n",
            "{unit: minute, requests_per_unit: 3}",
            "`lease`",
        ),
        (
            "    scope: global\n",
            "{unit: minute, requests_per_unit: 3}",
            "`scope: global`",
        ),
        ("", "{unlimited: true}", "no limit to count"),
    ] {
        let e = errors(&rule(extra, limit));
        assert!(
            e.contains("rules.yaml") && e.contains("user") && e.contains(says),
            "{extra}{limit}: {e}"
        );
    }
    let e = errors("domain: d\ndescriptors:\n  - key: user\n    algorithm: sliding\n    rate_limit: {unit: minute, requests_per_unit: 3}\n");
    assert!(
        e.contains("algorithm 'sliding' is not one of token_bucket, fixed_window"),
        "{e}"
    );
}

#[test]
fn the_default_algorithm_counts_the_rules_that_name_none() {
    use crate::bucket::Algorithm;
    let fixed = LoadOptions {
        default_algorithm: Algorithm::FixedWindow,
        ..LoadOptions::default()
    };
    let yaml = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 3}\n  - key: team\n    algorithm: token_bucket\n    rate_limit: {unit: minute, requests_per_unit: 3, burst: 10}\n  - key: internal\n    rate_limit: {unlimited: true}\n  - key: parent\n    descriptors:\n      - key: child\n        rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let r = load_sources(
        vec![(PathBuf::from("rules.yaml"), yaml.to_string())],
        fixed.clone(),
    )
    .expect("valid");
    let algorithm =
        |entries: &[(&str, &str)]| match &r.lookup("d", entries).expect("match").rule.action {
            RuleAction::Limited(limits) => Some(limits[0].params.algorithm),
            _ => None,
        };
    assert_eq!(algorithm(&[("user", "u")]), Some(Algorithm::FixedWindow));
    assert_eq!(algorithm(&[("team", "t")]), Some(Algorithm::TokenBucket));
    assert_eq!(algorithm(&[("internal", "i")]), None);
    assert_eq!(
        algorithm(&[("parent", "p"), ("child", "c")]),
        Some(Algorithm::FixedWindow)
    );
    // what the default cannot honour is named, with the way out
    let e = load_sources(
        vec![(
            PathBuf::from("rules.yaml"),
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 3, burst: 10}\n".to_string(),
        )],
        fixed,
    )
    .expect_err("a burst under the fixed-window default")
    .to_string();
    assert!(
        e.contains("user")
            && e.contains("has no burst")
            && e.contains("--algorithm fixed_window")
            && e.contains("`algorithm: token_bucket`"),
        "{e}"
    );
    // and the token bucket stays the default
    assert_eq!(
        LoadOptions::default().default_algorithm,
        Algorithm::TokenBucket
    );
}

/// Under a fixed-window default, a usage domain's rules (charged into
/// debt) stay token buckets; a window of one limit, with nothing
/// envoyproxy/ratelimit has no key for, counts in its keys.
#[test]
fn windows_of_one_limit_count_in_envoyproxy_ratelimits_keys() {
    use crate::bucket::Algorithm;
    let yaml = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 3}\n  - key: two\n    limits:\n      - {unit: minute, requests_per_unit: 3}\n      - {unit: hour, requests_per_unit: 30, name: hourly}\n  - key: retried\n    attempts: {key: attempt, ttl: 5m}\n    rate_limit: {unit: minute, requests_per_unit: 3}\n  - key: capped\n    max_values: 10\n    rate_limit: {unit: minute, requests_per_unit: 3}\n  - key: bucket\n    algorithm: token_bucket\n    rate_limit: {unit: minute, requests_per_unit: 3}\n  - key: parent\n    descriptors:\n      - key: child\n        rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let r = load_sources(
        vec![
            (PathBuf::from("a.yaml"), yaml.to_string()),
            (
                PathBuf::from("b.yaml"),
                yaml.replace("domain: d", "domain: llm"),
            ),
        ],
        LoadOptions {
            default_algorithm: Algorithm::FixedWindow,
            usage_domains: DomainPatterns::new(&["llm"]),
            ..LoadOptions::default()
        },
    )
    .expect("valid");
    let rule = |domain: &str, entries: &[(&str, &str)]| {
        r.lookup(domain, entries).expect("match").rule.clone()
    };
    let counted = |entries: &[(&str, &str)]| rule("d", entries).ratelimit_keys;
    assert!(counted(&[("user", "u")]));
    assert!(counted(&[("parent", "p"), ("child", "c")]));
    assert!(!counted(&[("two", "t")]));
    assert!(!counted(&[("retried", "r")]));
    assert!(!counted(&[("capped", "c")]));
    assert!(!counted(&[("bucket", "b")]));
    // a usage domain: token buckets, charged into debt
    let llm = rule("llm", &[("user", "u")]);
    assert!(llm.usage_charges && !llm.ratelimit_keys);
    let RuleAction::Limited(limits) = &llm.action else {
        panic!("limited")
    };
    assert_eq!(limits[0].params.algorithm, Algorithm::TokenBucket);
}

#[test]
fn a_sliding_window_rule_counts_so_and_refuses_what_it_cannot_honour() {
    use crate::bucket::{Algorithm, MAX_WINDOW_COUNT};
    let rule = |extra: &str, limit: &str| {
        format!("domain: d\ndescriptors:\n  - key: user\n    algorithm: sliding_window\n{extra}    rate_limit: {limit}\n")
    };
    let r = load_sources(
        vec![(
            PathBuf::from("rules.yaml"),
            rule(
                "",
                "{unit: second, unit_multiplier: 30, requests_per_unit: 3}",
            ),
        )],
        LoadOptions::default(),
    )
    .expect("valid");
    match &r.lookup("d", &[("user", "u")]).expect("match").rule.action {
        RuleAction::Limited(limits) => {
            assert_eq!(limits[0].params.algorithm, Algorithm::SlidingWindow);
            assert_eq!(limits[0].params.unit_secs, 30);
            assert_eq!(limits[0].bucket_id, "0~sliding");
        }
        _ => panic!("limited"),
    }
    let most = MAX_WINDOW_COUNT;
    for (extra, limit, says) in [
        (
            String::new(),
            "{unit: minute, requests_per_unit: 3, burst: 10}".to_string(),
            "has no burst".to_string(),
        ),
        (
            "    overdraft: true\n    max_debt: 2\n".to_string(),
            "{unit: minute, requests_per_unit: 3}".to_string(),
            "`algorithm: sliding_window` with `max_debt`".to_string(),
        ),
        (
            "    lease: {size: 2}\n".to_string(),
            "{unit: minute, requests_per_unit: 3}".to_string(),
            "`lease`".to_string(),
        ),
        (
            String::new(),
            format!("{{unit: minute, requests_per_unit: {}}}", most + 1),
            format!("counts at most {most} per window"),
        ),
    ] {
        let e = errors(&rule(&extra, &limit));
        assert!(
            e.contains("rules.yaml") && e.contains("user") && e.contains(&says),
            "{extra}{limit}: {e}"
        );
    }
    // the most it counts is a limit like any other
    assert!(load_sources(
        vec![(
            PathBuf::from("rules.yaml"),
            rule("", &format!("{{unit: minute, requests_per_unit: {most}}}")),
        )],
        LoadOptions::default(),
    )
    .is_ok());
    // and the service-wide default may be it
    let e = load_sources(
        vec![(
            PathBuf::from("rules.yaml"),
            "domain: d\ndescriptors:\n  - key: user\n    lease: {size: 2}\n    rate_limit: {unit: minute, requests_per_unit: 3}\n".to_string(),
        )],
        LoadOptions {
            default_algorithm: Algorithm::SlidingWindow,
            ..LoadOptions::default()
        },
    )
    .expect_err("a lease under the sliding default")
    .to_string();
    assert!(e.contains("--algorithm sliding_window"), "{e}");
}

#[test]
fn windows_take_attempts_and_reservations() {
    use crate::attempt::AttemptMode;
    use crate::bucket::Algorithm;
    for algorithm in ["fixed_window", "sliding_window"] {
        for (extra, mode) in [
            ("", AttemptMode::Dedupe),
            (
                "    overdraft: true\n    attempts: {key: request_id, ttl: 5m, reserve: 2}\n",
                AttemptMode::Reserve,
            ),
        ] {
            let extra = if extra.is_empty() {
                "    attempts: {key: request_id, ttl: 5m}\n"
            } else {
                extra
            };
            let yaml = format!(
                "domain: d\ndescriptors:\n  - key: user\n    algorithm: {algorithm}\n{extra}    rate_limit: {{unit: minute, requests_per_unit: 3}}\n"
            );
            let r = load_sources(
                vec![(PathBuf::from("rules.yaml"), yaml)],
                LoadOptions::default(),
            )
            .unwrap_or_else(|e| panic!("{algorithm} {mode:?}: {e}"));
            let rule = &r.lookup("d", &[("user", "u")]).expect("match").rule;
            assert_eq!(rule.attempts.as_ref().map(|a| a.mode), Some(mode));
            match &rule.action {
                RuleAction::Limited(limits) => assert_ne!(
                    limits[0].params.algorithm,
                    Algorithm::TokenBucket,
                    "{algorithm}"
                ),
                _ => panic!("limited"),
            }
        }
    }
}

#[test]
fn a_calendar_limit_counts_in_its_periods_and_refuses_what_it_cannot_honour() {
    use crate::bucket::Algorithm;
    let rule = |extra: &str, limit: &str| {
        format!("domain: d\ndescriptors:\n  - key: tenant\n{extra}    rate_limit: {limit}\n")
    };
    let yaml = rule(
        "    overdraft: true\n",
        "{unit: month, requests_per_unit: 1000000, calendar: {time_zone: America/New_York, starts: 15}}",
    );
    let r = load_sources(
        vec![(PathBuf::from("rules.yaml"), yaml)],
        LoadOptions {
            // the service's default does not touch a calendar limit
            default_algorithm: Algorithm::FixedWindow,
            ..LoadOptions::default()
        },
    )
    .expect("valid");
    match &r
        .lookup("d", &[("tenant", "t")])
        .expect("match")
        .rule
        .action
    {
        RuleAction::Limited(limits) => {
            let l = &limits[0];
            assert_eq!(l.params.algorithm, Algorithm::CalendarWindow);
            assert_eq!(l.bucket_id, "0~calendar");
            let c = l.calendar.as_ref().expect("a calendar");
            assert_eq!(
                c.calendar().to_string(),
                "a calendar month in America/New_York from day 15"
            );
            // 2026-12-05T12:00Z: the period began on November 15th, 00:00 EST
            let params = l.params_at(1_796_472_000, 0);
            let p = params.period.expect("periods");
            assert_eq!(p.start, 1_794_718_800);
            // an offset moves the periods as the stores' clocks see them
            let shifted = l
                .params_at(1_796_472_000 + 100, 100)
                .period
                .expect("periods");
            assert_eq!(shifted.start, p.start - 100);
            assert_eq!(
                serde_json::to_value(l).expect("json")["calendar"],
                "a calendar month in America/New_York from day 15"
            );
        }
        _ => panic!("limited"),
    }
    let cal = |c: &str| format!("{{unit: month, requests_per_unit: 10, calendar: {c}}}");
    for (extra, limit, says) in [
        (
            "",
            cal("{time_zone: America/Gotham}"),
            "not a time zone of the IANA database",
        ),
        ("", cal("{starts: 1}"), "calendar has no time_zone"),
        ("", cal("{time_zone: UTC, starts: 32}"), "1 to 31"),
        (
            "",
            cal("{time_zone: UTC, zone: UTC}"),
            "unknown field `zone`",
        ),
        (
            "",
            "{unit: hour, requests_per_unit: 10, calendar: {time_zone: UTC}}".to_string(),
            "a day, week, month or year",
        ),
        (
            "",
            "{unit: year, unit_multiplier: 2, requests_per_unit: 10, calendar: {time_zone: UTC}}"
                .to_string(),
            "longer than a year",
        ),
        (
            "",
            "{unit: day, requests_per_unit: 10, burst: 20, calendar: {time_zone: UTC}}".to_string(),
            "has no burst",
        ),
        (
            "    algorithm: sliding_window\n",
            cal("{time_zone: UTC}"),
            "`algorithm: sliding_window` with a calendar limit",
        ),
        ("    lease: {size: 2}\n", cal("{time_zone: UTC}"), "`lease`"),
        ("    max_debt: 5\n", cal("{time_zone: UTC}"), "`max_debt`"),
    ] {
        let e = errors(&rule(extra, &limit));
        assert!(
            e.contains("rules.yaml")
                && (e.contains("tenant") || e.contains("descriptors[0].rate_limit.calendar"))
                && e.contains(says),
            "{extra}{limit}: {e}"
        );
    }
    // a run of units: a quarter
    let quarter = load("domain: d\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: month, unit_multiplier: 3, requests_per_unit: 10, calendar: {time_zone: UTC}}\n")
        .expect("a quarter");
    match &quarter
        .lookup("d", &[("tenant", "t")])
        .expect("match")
        .rule
        .action
    {
        RuleAction::Limited(limits) => assert_eq!(
            limits[0]
                .calendar
                .as_ref()
                .map(|c| c.calendar().to_string()),
            Some("3 calendar months in UTC from day 1".to_string())
        ),
        _ => panic!("limited"),
    }
    let mixed = "domain: d\ndescriptors:\n  - key: tenant\n    limits:\n      - {unit: second, requests_per_unit: 5}\n      - {unit: month, requests_per_unit: 10, calendar: {time_zone: UTC}}\n";
    let e = errors(mixed);
    assert!(e.contains("a descriptor of its own"), "{e}");
}

/// A reload that takes `attempts:` off a rule keeps them retired for two
/// ttls (their records' life), their keys passed over in matching; a rule
/// that takes them back, or a tree that matches on the keys, drops them.
#[test]
fn a_reload_keeps_removed_attempts_retired_while_their_records_live() {
    let with = "domain: llm\ndescriptors:\n  - key: user\n    overdraft: true\n    rate_limit: {unit: day, requests_per_unit: 10}\n    attempts: {key: request_id, ttl: 1m, reserve: 5}\n";
    let without = "domain: llm\ndescriptors:\n  - key: user\n    overdraft: true\n    rate_limit: {unit: day, requests_per_unit: 10}\n";
    let old = load(with).expect("valid");
    let now = 1_000_000;
    let new = load(without).expect("valid").succeeding(&old, now);
    let retired = new
        .retired_attempts("llm", "user", now + 119_999)
        .expect("retired");
    assert_eq!((retired.reserve, retired.ttl.as_secs()), (Some(5), 60));
    assert!(
        new.retired_attempts("llm", "user", now + 120_000).is_none(),
        "2 x ttl"
    );
    assert_eq!(
        reach(
            &new,
            "llm",
            &[("user", "a"), ("request_id", "r"), ("phase", "done")]
        ),
        "user",
        "its keys still passed over"
    );
    // carried by the next reload while live, dropped once past
    let next = load(without).expect("valid").succeeding(&new, now + 60_000);
    assert!(next.retired_attempts("llm", "user", now + 60_001).is_some());
    let later = load(without)
        .expect("valid")
        .succeeding(&next, now + 120_000);
    assert!(later
        .retired_attempts("llm", "user", now + 120_000)
        .is_none());
    // attempts back: nothing retired
    let back = load(with).expect("valid").succeeding(&new, now + 1);
    assert!(back.retired_attempts("llm", "user", now + 2).is_none());
    // a tree that now matches on request_id keeps no retired keys
    let matching = "domain: llm\ndescriptors:\n  - key: user\n    overdraft: true\n    rate_limit: {unit: day, requests_per_unit: 10}\n  - key: request_id\n    rate_limit: {unit: day, requests_per_unit: 10}\n";
    let m = load(matching).expect("valid").succeeding(&old, now);
    assert!(m.retired_attempts("llm", "user", now).is_none());
    assert!(m.attempt_keys("llm").is_empty());
}

#[test]
fn replication_is_parsed_with_a_default_timeout() {
    let rules = load(
        r#"
domain: d
descriptors:
  - key: paid
    replication: {replicas: 2, timeout: 80ms}
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: plain
    replication: {replicas: 1}
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: none
    rate_limit: {unit: minute, requests_per_unit: 10}
"#,
    )
    .expect("valid");
    let replication = |k: &str| {
        rules
            .lookup("d", &[(k, "x")])
            .and_then(|m| m.rule.replication)
    };
    let paid = replication("paid").expect("paid");
    assert_eq!(
        (paid.replicas, paid.timeout),
        (2, std::time::Duration::from_millis(80))
    );
    let plain = replication("plain").expect("plain");
    assert_eq!(
        (plain.replicas, plain.timeout),
        (1, std::time::Duration::from_millis(50))
    );
    assert_eq!(replication("none"), None);
}

#[test]
fn bad_replication_is_named() {
    let rule = |replication: &str, rest: &str| {
        format!("domain: d\ndescriptors:\n  - key: k\n    replication: {replication}\n{rest}")
    };
    let limit = "    rate_limit: {unit: second, requests_per_unit: 10}\n";
    let cases = [
        (
            rule("{timeout: 50ms}", limit),
            "replication.replicas is missing or 0",
        ),
        (
            rule("{replicas: 0}", limit),
            "replication.replicas is missing or 0",
        ),
        (
            rule("{replicas: 17}", limit),
            "replication.replicas 17 is more than 16",
        ),
        (
            rule("{replicas: 1, timeout: 0s}", limit),
            "replication.timeout '0s' is 0",
        ),
        (
            rule("{replicas: 1, timeout: 2s}", limit),
            "replication.timeout '2s' is longer than 1s",
        ),
        (
            rule("{replicas: 1, timeout: soon}", limit),
            "replication.timeout 'soon' is not a duration",
        ),
        (
            rule("{replicas: 1, wait: 1s}", limit),
            "unknown field `wait`",
        ),
        (
            rule("{replicas: 1}", ""),
            "`replication` needs a `rate_limit` or `limits`",
        ),
        (
            rule("{replicas: 1}", "    rate_limit: {unlimited: true}\n"),
            "`replication` on an unlimited rule: there is no bucket in Redis to replicate",
        ),
        (
            rule("{replicas: 1}", &format!("    lease: {{size: 5}}\n{limit}")),
            "`replication` and `lease` together",
        ),
        (
            rule("{replicas: 1}", &format!("    scope: global\n{limit}")),
            "`replication` with `scope: global`",
        ),
        (
            rule(
                "{replicas: 1}",
                "    concurrency: 3\n    attempts: {key: id, ttl: 1m}\n",
            ),
            "`replication` on a `concurrency` rule",
        ),
    ];
    for (yaml, expected) in cases {
        let msg = errors(&yaml);
        assert!(msg.starts_with("rules.yaml: "), "names the file: {msg}");
        assert!(
            msg.contains(expected),
            "{yaml}\nwanted {expected:?}\ngot {msg}"
        );
    }
}
