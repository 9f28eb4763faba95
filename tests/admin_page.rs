//! Who is limited, and why (#54 items 1, 2 and 6): the heavy hitters per
//! rule in `/v1/hitters`, the rules' decisions in `/v1/rules`, the store in
//! `/v1/store`, bad input refused by name, values of chosen keys hashed,
//! the admin pages behind a bearer token while the probes stay open, and
//! the page at `/` loaded by a real browser (Debian's chromium, headless)
//! while one tenant floods: the tenant is on the page within 2 s.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::{client, descriptor, request, rules_dir, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use serde_json::Value;

const RULES: &str = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";

type Client = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<tonic::transport::Channel>;

async fn call(c: &mut Client, tenant: &str) -> i32 {
    c.should_rate_limit(request("api", vec![descriptor(&[("tenant", tenant)])]))
        .await
        .expect("decided")
        .into_inner()
        .overall_code
}

async fn get(url: &str, token: Option<&str>) -> (u16, String) {
    let mut r = reqwest::Client::new().get(url);
    if let Some(t) = token {
        r = r.header("Authorization", format!("Bearer {t}"));
    }
    let r = r.send().await.expect("admin answers");
    let status = r.status().as_u16();
    (status, r.text().await.expect("body"))
}

/// The operator token of the tests that configure one ([`with_token`]);
/// sent by [`json`] always (a port without a token ignores it).
const TOKEN: &str = "operator-token";

/// `args` with `--admin-token-file` holding [`TOKEN`] (kept in `dir`).
fn with_token(
    mut args: tokenbucket_rls::cli::ServeArgs,
    dir: &tempfile::TempDir,
) -> tokenbucket_rls::cli::ServeArgs {
    let file = dir.path().join("admin-token");
    std::fs::write(&file, format!("{TOKEN}\n")).expect("write token");
    args.admin_token_file = Some(file);
    args
}

/// A reset as an operator asks for it: the token and X-Rls-Operator.
async fn operator_reset(url: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(url)
        .header("Authorization", format!("Bearer {TOKEN}"))
        .header("X-Rls-Operator", "oncall")
        .send()
        .await
        .expect("answered")
}

async fn json(url: &str) -> Value {
    let (status, body) = get(url, Some(TOKEN)).await;
    assert_eq!(status, 200, "{url}: {body}");
    serde_json::from_str(&body).expect("JSON")
}

/// 30 calls of `noisy` (2 admitted, 28 refused) and one of each of five
/// other tenants.
async fn flood(c: &mut Client) {
    for i in 0..30 {
        let code = call(c, "noisy").await;
        assert_eq!(code == Code::Ok as i32, i < 2, "call {i}");
    }
    for t in ["a", "b", "c", "d", "e"] {
        assert_eq!(call(c, t).await, Code::Ok as i32);
    }
}

#[tokio::test]
async fn the_json_names_who_is_refused_and_refuses_bad_input() {
    let rules = rules_dir(RULES);
    let s = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("start");
    let mut c = client(&s).await;
    flood(&mut c).await;
    let admin = format!("http://{}", s.admin_addr);

    let h = json(&format!("{admin}/v1/hitters")).await;
    assert_eq!(h["counters"], 16);
    let rule = &h["rules"][0];
    assert_eq!(
        (rule["domain"].as_str(), rule["rule"].as_str()),
        (Some("api"), Some("tenant"))
    );
    // six values under 16 counters: exact, no error
    let refused = &rule["refused"]["minute"];
    assert_eq!(refused.as_array().map(Vec::len), Some(1), "{refused}");
    assert_eq!(refused[0]["value"], "tenant=noisy");
    assert_eq!(
        (refused[0]["count"].as_u64(), refused[0]["error"].as_u64()),
        (Some(28), Some(0))
    );
    assert_eq!(rule["refused"]["hour_hits"], 28);
    let admitted = &rule["admitted"]["minute"];
    assert_eq!(admitted[0]["value"], "tenant=noisy");
    assert_eq!(admitted[0]["count"], 2);
    assert_eq!(rule["admitted"]["minute_hits"], 7);
    // n rows at most
    let one = json(&format!("{admin}/v1/hitters?n=1&domain=api")).await;
    assert_eq!(
        one["rules"][0]["admitted"]["minute"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );

    let r = json(&format!("{admin}/v1/rules")).await;
    let tenant = r["rules"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["rule"] == "tenant"))
        .expect("the rule");
    assert_eq!(
        (tenant["admitted"].as_u64(), tenant["refused"].as_u64()),
        (Some(7), Some(28))
    );
    assert!(tenant["source"]
        .as_str()
        .is_some_and(|p| p.ends_with("rules.yaml")));
    assert_eq!(r["generation"], 1);
    assert!(r["in_force_since"]
        .as_u64()
        .is_some_and(|t| t > 1_700_000_000));

    // for dashboards: the top value's share of the rule's refusals (28 of 28)
    let (_, metrics) = get(&format!("{admin}/metrics"), None).await;
    assert_eq!(
        common::sample(
            &metrics,
            "rls_refusals_top_share{domain=\"api\",rule=\"tenant\"}"
        ),
        Some(1.0),
        "{metrics}"
    );

    let st = json(&format!("{admin}/v1/store")).await;
    assert_eq!(
        (st["store"].as_str(), st["ready"].as_bool()),
        (Some("memory"), Some(true))
    );

    // bad input: a clear 4xx, never a panic
    for (query, status, says) in [
        ("n=0", 400, "n must be"),
        ("n=abc", 400, "n must be"),
        ("n=99999999999999999999999", 400, "n must be"),
        ("bogus=1", 400, "unknown parameter 'bogus'"),
        ("domain=nope", 404, "no domain 'nope'"),
    ] {
        let (got, body) = get(&format!("{admin}/v1/hitters?{query}"), None).await;
        assert_eq!(got, status, "{query}: {body}");
        assert!(body.contains(says), "{query}: {body}");
    }
    let huge = "x".repeat(20_000);
    let (got, body) = get(&format!("{admin}/v1/hitters?domain={huge}"), None).await;
    assert!((400..500).contains(&got), "{got}");
    assert!(body.len() < 1_000, "the value is not echoed whole");
    s.shutdown().await.expect("stop");
}

#[tokio::test]
async fn hashed_keys_never_show_their_values() {
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.refusal_log_hash_keys = vec!["tenant".into()];
    // without a secret, pseudonyms are refused at start: an unkeyed hash
    // of a value is reversed by trying values
    assert!(tokenbucket_rls::server::start(&args).await.is_err());
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("key"), "0123456789abcdef-secret").expect("write");
    args.pseudonym_key_file = Some(dir.path().join("key"));
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let mut c = client(&s).await;
    flood(&mut c).await;
    // the inspector would say whether any value asked is limited: with
    // pseudonyms on and no credential, it is refused
    let (status, _) = get(
        &format!(
            "http://{}/v1/buckets?domain=api&descriptor=tenant%3Dnoisy",
            s.admin_addr
        ),
        None,
    )
    .await;
    assert_eq!(status, 403);
    let (_, body) = get(&format!("http://{}/v1/hitters", s.admin_addr), None).await;
    assert!(!body.contains("noisy"), "{body}");
    let h: Value = serde_json::from_str(&body).expect("JSON");
    let top = &h["rules"][0]["refused"]["minute"][0];
    assert!(
        top["value"]
            .as_str()
            .is_some_and(|v| v.starts_with("tenant=hmac:") && v.len() == "tenant=hmac:".len() + 24),
        "{top}"
    );
    assert_eq!(top["count"], 28);
    s.shutdown().await.expect("stop");
}

#[tokio::test]
async fn a_bearer_token_guards_the_pages_and_not_the_probes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("token");
    std::fs::write(&file, "first-token\n").expect("write");
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.admin_token_file = Some(file.clone());
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let admin = format!("http://{}", s.admin_addr);
    for open in [
        "/healthz",
        "/readyz",
        "/healthcheck",
        "/metrics",
        "/",
        "/page.js",
    ] {
        assert_eq!(get(&format!("{admin}{open}"), None).await.0, 200, "{open}");
    }
    for guarded in ["/v1/hitters", "/v1/rules", "/v1/store", "/config"] {
        let url = format!("{admin}{guarded}");
        assert_eq!(get(&url, None).await.0, 401, "{guarded}");
        assert_eq!(get(&url, Some("wrong")).await.0, 401, "{guarded}");
        assert_eq!(get(&url, Some("first-token")).await.0, 200, "{guarded}");
    }
    // a rotated Secret applies at once
    std::fs::write(&file, "second-token\n").expect("rotate");
    assert_eq!(
        get(&format!("{admin}/v1/rules"), Some("first-token"))
            .await
            .0,
        401
    );
    assert_eq!(
        get(&format!("{admin}/v1/rules"), Some("second-token"))
            .await
            .0,
        200
    );
    s.shutdown().await.expect("stop");
}

/// The page in a real browser: chromium loads `/` while `noisy` floods,
/// its script given 2 s (virtual time) to read `/v1/…`; the tenant is in
/// the page's DOM. A screenshot is kept in the target directory.
#[tokio::test]
async fn a_flooded_tenant_appears_on_the_page_in_a_browser() {
    let rules = rules_dir(RULES);
    let s = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("start");
    let mut c = client(&s).await;
    for t in ["quiet-1", "quiet-2"] {
        assert_eq!(call(&mut c, t).await, Code::Ok as i32);
    }
    let flooding = tokio::spawn({
        let mut c = c.clone();
        async move {
            loop {
                let _ = call(&mut c, "noisy").await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    let url = format!("http://{}/", s.admin_addr);
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("admin-page.png");
    let browser = |extra: &[&str]| {
        let profile = tempfile::tempdir().expect("profile");
        let mut args = vec![
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--virtual-time-budget=2000".into(),
            "--window-size=1200,900".into(),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        args.push(url.clone());
        let out = tokio::task::spawn_blocking(move || {
            let out = Command::new("chromium").args(&args).output();
            drop(profile);
            out
        });
        async move {
            out.await
                .expect("joined")
                .expect("chromium runs (integration/install-deps.sh installs it)")
        }
    };
    let dom = browser(&["--dump-dom"]).await;
    let dom = String::from_utf8_lossy(&dom.stdout);
    let shot_arg = format!("--screenshot={}", shot.display());
    let _ = browser(&[&shot_arg]).await;
    flooding.abort();
    eprintln!("admin page screenshot: {}", shot.display());
    assert!(dom.contains("Refused most"), "the page: {dom}");
    assert!(
        dom.contains("tenant=noisy"),
        "the flooded tenant on the page within 2 s: {dom}"
    );
    assert!(dom.contains("ready: "), "the store's health: {dom}");
    s.shutdown().await.expect("stop");
}

/// `tokenbucket-rls inspect` against `admin` for `tenant=locked`, with
/// `extra` flags: whether it succeeded, and what it printed.
async fn inspect_cli(admin: &str, extra: &[&str]) -> (bool, String) {
    let mut args: Vec<String> = [
        "inspect",
        "--admin",
        admin,
        "--domain",
        "api",
        "--descriptor",
        "tenant=locked",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.extend(extra.iter().map(|a| a.to_string()));
    tokio::task::spawn_blocking(move || {
        let out = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
            .args(&args)
            .env_remove("RLS_ADMIN_TOKEN_FILE")
            .output()
            .expect("run inspect");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    })
    .await
    .expect("joined")
}

/// The bucket inspector spends nothing, and a reset (over the CLI, as an
/// operator runs it) gives a locked-out tenant its budget back, counted.
#[tokio::test]
async fn the_inspector_spends_nothing_and_a_reset_gives_the_budget_back() {
    let rules = rules_dir(RULES);
    let dir = tempfile::tempdir().expect("tempdir");
    let args = with_token(serve_args(rules.path().to_path_buf()), &dir);
    let token_file = dir.path().join("admin-token");
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let mut c = client(&s).await;
    for _ in 0..2 {
        assert_eq!(call(&mut c, "locked").await, Code::Ok as i32);
    }
    let admin = format!("http://{}", s.admin_addr);
    let inspect = format!("{admin}/v1/buckets?domain=api&descriptor=tenant%3Dlocked");
    for _ in 0..3 {
        let b = json(&inspect).await;
        assert_eq!(
            (b["rule"].as_str(), b["next"].as_str()),
            (Some("tenant"), Some("over_limit"))
        );
        assert_eq!(b["remaining"], 0);
        assert!(
            b["reset_secs"]
                .as_u64()
                .is_some_and(|s| (1..=1800).contains(&s)),
            "{b}"
        );
        assert_eq!(b["keys"].as_array().map(Vec::len), Some(1));
    }
    let fresh = json(&format!(
        "{admin}/v1/buckets?domain=api&descriptor=tenant%3Dnew"
    ))
    .await;
    assert_eq!(
        (fresh["next"].as_str(), fresh["remaining"].as_u64()),
        (Some("ok"), Some(2))
    );
    // the CLI, as an operator runs it
    let token_file = token_file.to_str().expect("utf-8 path");
    let (ok, out) = inspect_cli(&admin, &["--token-file", token_file]).await;
    assert!(ok && out.contains("\"over_limit\""), "{out}");
    let (ok, out) = inspect_cli(
        &admin,
        &["--reset", "--operator", "alice", "--token-file", token_file],
    )
    .await;
    assert!(ok && out.contains("\"removed\":1"), "{out}");
    assert_eq!(
        call(&mut c, "locked").await,
        Code::Ok as i32,
        "the budget is back"
    );
    let (_, metrics) = get(&format!("{admin}/metrics"), None).await;
    assert_eq!(
        common::sample(
            &metrics,
            "rls_bucket_resets_total{domain=\"api\",rule=\"tenant\"}"
        ),
        Some(1.0)
    );
    // bad input
    for (query, status) in [
        ("domain=api&descriptor=tenant", 400),
        ("domain=api", 400),
        ("domain=nope&descriptor=tenant%3Dx", 404),
        ("domain=api&descriptor=other%3Dx", 404),
    ] {
        let (got, body) = get(&format!("{admin}/v1/buckets?{query}"), Some(TOKEN)).await;
        assert_eq!(got, status, "{query}: {body}");
    }
    let refused = operator_reset(&format!(
        "{admin}/v1/buckets/reset?domain=api&descriptor=other%3Dx"
    ))
    .await;
    assert_eq!(refused.status().as_u16(), 404);
    s.shutdown().await.expect("stop");
}

/// On Redis: the keys shown are the store's (a fixed window's in
/// envoyproxy/ratelimit's layout, a token bucket's own), and a reset
/// deletes them.
#[tokio::test]
async fn a_reset_on_redis_deletes_the_keys_it_shows() {
    let redis = common::redis::RedisServer::standalone();
    let rules = rules_dir("domain: api\ndescriptors:\n  - key: tenant\n    algorithm: fixed_window\n    rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 2}\n");
    let dir = tempfile::tempdir().expect("tempdir");
    let args = with_token(
        common::redis_args(&redis.url(), &rules, Duration::from_secs(1)),
        &dir,
    );
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let mut c = client(&s).await;
    let admin = format!("http://{}", s.admin_addr);
    for (key, value) in [("tenant", "t1"), ("user", "u1")] {
        for _ in 0..3 {
            let _ = c
                .should_rate_limit(request("api", vec![descriptor(&[(key, value)])]))
                .await
                .expect("decided");
        }
        let b = json(&format!(
            "{admin}/v1/buckets?domain=api&descriptor={key}%3D{value}"
        ))
        .await;
        assert_eq!(b["next"], "over_limit", "{b}");
        let shown = b["keys"][0].as_str().expect("a key").to_string();
        if key == "tenant" {
            assert!(shown.starts_with("api_tenant_t1_"), "{shown}");
            assert_eq!(redis.cli(&["GET", &shown]).trim(), "3");
        } else {
            assert!(shown.starts_with("rls:{"), "{shown}");
        }
        let r = operator_reset(&format!(
            "{admin}/v1/buckets/reset?domain=api&descriptor={key}%3D{value}"
        ))
        .await;
        let body: Value = serde_json::from_str(&r.text().await.expect("body")).expect("JSON");
        assert_eq!(body["removed"], 1, "{body}");
        let b = json(&format!(
            "{admin}/v1/buckets?domain=api&descriptor={key}%3D{value}"
        ))
        .await;
        assert_eq!(
            (b["next"].as_str(), b["remaining"].as_u64()),
            (Some("ok"), Some(2)),
            "{b}"
        );
    }
    s.shutdown().await.expect("stop");
}

/// Two instances on one Redis: each one's page shows the heavy hitters of
/// both, added up (each writes its summaries every 2 s while the
/// instances count more than one).
#[tokio::test]
async fn instances_on_one_redis_show_each_others_heavy_hitters() {
    let redis = common::redis::RedisServer::standalone();
    let rules = rules_dir(RULES);
    // counting themselves: two, so each shares its summaries
    let mut args = common::redis_args(&redis.url(), &rules, Duration::from_secs(1));
    args.instances = None;
    let a = tokenbucket_rls::server::start(&args).await.expect("start");
    let b = tokenbucket_rls::server::start(&args).await.expect("start");
    let (mut ca, mut cb) = (client(&a).await, client(&b).await);
    for _ in 0..30 {
        let _ = call(&mut ca, "noisy").await;
    }
    for _ in 0..5 {
        let _ = call(&mut cb, "other").await;
    }
    let refused = |h: &Value, value: &str| {
        h["rules"][0]["refused"]["minute"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["value"] == value))
            .and_then(|x| x["count"].as_u64())
    };
    for s in [&a, &b] {
        let url = format!("http://{}/v1/hitters", s.admin_addr);
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            let h = json(&url).await;
            if refused(&h, "tenant=noisy") == Some(28) && refused(&h, "tenant=other") == Some(3) {
                assert!(
                    h["instances"]
                        .as_str()
                        .is_some_and(|i| i.starts_with("all")),
                    "{h}"
                );
                assert_eq!(h["rules"][0]["refused"]["minute_hits"], 31, "{h}");
                assert_eq!(h["rules"][0]["admitted"]["minute_hits"], 4, "{h}");
                break;
            }
            assert!(std::time::Instant::now() < deadline, "never merged: {h}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    a.shutdown().await.expect("stop");
    b.shutdown().await.expect("stop");
}

/// #54 item 2: RLQS streams on the page's JSON when they run. No stream:
/// nothing open; an Envoy's stream reporting one bucket: one stream in its
/// domain, one bucket, one pair; not a region, not a global tier.
#[tokio::test]
async fn rlqs_streams_and_regions_have_their_json() {
    let rules = rules_dir(
        "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 10}\n",
    );
    let s = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("start");
    let admin = format!("http://{}", s.admin_addr);
    let quiet = json(&format!("{admin}/v1/rlqs")).await;
    assert_eq!(quiet["running"], true);
    assert_eq!(
        (quiet["streams"].as_u64(), quiet["buckets"].as_u64()),
        (Some(0), Some(0))
    );
    let (_keep_open, mut assignments) =
        common::rlqs::report(&format!("http://{}", s.grpc_addr), "alice", 3).await;
    tokio::time::timeout(Duration::from_secs(5), assignments.message())
        .await
        .expect("an assignment")
        .expect("ok")
        .expect("open");
    let open = json(&format!("{admin}/v1/rlqs")).await;
    assert_eq!(open["streams"], 1, "{open}");
    assert_eq!(
        open["streams_by_domain"],
        serde_json::json!([{"domain": "d", "streams": 1}])
    );
    assert_eq!(
        (open["buckets"].as_u64(), open["pairs"].as_u64()),
        (Some(1), Some(1)),
        "{open}"
    );
    assert_eq!(open["ledger"], false);
    let regions = json(&format!("{admin}/v1/regions")).await;
    assert_eq!(
        regions,
        serde_json::json!({"region": null, "global_tier": null})
    );
    // they take no parameters: one given is a 400 naming it
    for path in ["/v1/rlqs", "/v1/regions"] {
        let (status, body) = get(&format!("{admin}{path}?domain=d"), None).await;
        assert_eq!(status, 400, "{path}: {body}");
        assert!(body.contains("unknown parameter 'domain'"), "{body}");
    }
    s.shutdown().await.expect("stop");
}

/// #54 item 3: the inspector shows what a check cannot: a token bucket's
/// debt (an overdraft charged past empty), the reservations a descriptor
/// holds, a `concurrency` rule's slots; on both stores, and reading
/// changes nothing.
#[tokio::test]
async fn the_inspector_shows_debts_reservations_and_slots_on_both_stores() {
    const LLM: &str = r#"
domain: llm
descriptors:
  - key: user
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 1000, burst: 1000, name: llm-tokens}
    attempts: {key: request_id, ttl: 1m, reserve: 600}
  - key: tenant
    overdraft: true
    rate_limit: {unit: day, requests_per_unit: 100, burst: 100, name: tenant-tokens}
  - key: streams
    concurrency: 3
    attempts: {key: request_id, ttl: 1m}
"#;
    let redis = common::redis::RedisServer::standalone();
    for on_redis in [false, true] {
        let rules = rules_dir(LLM);
        let mut args = serve_args(rules.path().to_path_buf());
        if on_redis {
            args.store = tokenbucket_rls::cli::StoreKind::Redis;
            args.redis_url = Some(redis.url());
        }
        let s = tokenbucket_rls::server::start(&args).await.expect("start");
        let mut c = client(&s).await;
        let send = |entries: Vec<(&'static str, &'static str)>, hits: Option<u64>| {
            let mut d = descriptor(&entries);
            d.hits_addend =
                hits.map(|value| envoy_types::pb::google::protobuf::UInt64Value { value });
            request("llm", vec![d])
        };
        // 130 charged to a bucket of 100: 30 owed
        c.should_rate_limit(send(vec![("tenant", "t")], Some(130)))
            .await
            .expect("charged");
        // one reservation of 600 started, not settled
        let r = c
            .should_rate_limit(send(vec![("user", "u"), ("request_id", "r1")], None))
            .await
            .expect("reserved")
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        // two slots of three taken
        for id in ["a", "b"] {
            let r = c
                .should_rate_limit(send(vec![("streams", "s"), ("request_id", id)], None))
                .await
                .expect("slot")
                .into_inner();
            assert_eq!(r.overall_code, Code::Ok as i32, "slot {id}");
        }
        let admin = format!("http://{}/v1/buckets?domain=llm&descriptor=", s.admin_addr);
        for _ in 0..2 {
            let tenant = json(&format!("{admin}tenant%3Dt")).await;
            assert_eq!(
                tenant["limits"][0]["debt"], 30,
                "redis {on_redis}: {tenant}"
            );
            assert_eq!(tenant["next"], "over_limit", "{tenant}");
            let user = json(&format!("{admin}user%3Du")).await;
            assert_eq!(user["reservations"], 1, "redis {on_redis}: {user}");
            assert_eq!(user["limits"][0]["debt"], 0, "{user}");
            assert_eq!(user["remaining"], 400, "{user}");
            let streams = json(&format!("{admin}streams%3Ds")).await;
            assert_eq!(streams["slots"], 2, "redis {on_redis}: {streams}");
            assert_eq!(streams["limits"][0]["max_slots"], 3, "{streams}");
            assert_eq!(streams["next"], "ok", "{streams}");
        }
        s.shutdown().await.expect("stop");
    }
}

/// #54 item 3: `tokenbucket-rls inspect --redis-url … --config …` reads
/// Redis itself, no service asked: the answer the service's `/v1/buckets`
/// gives (same keys, same verdict), and `--reset` gives the budget back.
#[tokio::test]
async fn the_cli_inspects_and_resets_straight_against_redis() {
    let redis = common::redis::RedisServer::standalone();
    let rules = rules_dir(RULES);
    let s = common::start_on_redis(&redis.url(), &rules, Duration::from_secs(1)).await;
    let mut c = client(&s).await;
    for _ in 0..3 {
        call(&mut c, "locked").await;
    }
    let served = json(&format!(
        "http://{}/v1/buckets?domain=api&descriptor=tenant%3Dlocked",
        s.admin_addr
    ))
    .await;
    assert_eq!(served["next"], "over_limit", "{served}");
    let config = rules.path().to_string_lossy().to_string();
    let direct = |tenant: &'static str, extra: &'static [&'static str]| {
        let mut args = vec![
            "inspect".to_string(),
            "--redis-url".into(),
            redis.url(),
            "--config".into(),
            config.clone(),
            "--domain".into(),
            "api".into(),
            "--descriptor".into(),
            format!("tenant={tenant}"),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        // a wrong address for --admin: only Redis is read
        args.extend(["--admin".to_string(), "http://127.0.0.1:9".to_string()]);
        async move {
            tokio::task::spawn_blocking(move || {
                let out = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
                    .args(&args)
                    .output()
                    .expect("run inspect");
                (
                    out.status.success(),
                    String::from_utf8_lossy(&out.stdout).to_string(),
                    String::from_utf8_lossy(&out.stderr).to_string(),
                )
            })
            .await
            .expect("joined")
        }
    };
    let (ok, out, err) = direct("locked", &[]).await;
    assert!(ok, "{out}{err}");
    let read: Value = serde_json::from_str(&out).expect("JSON");
    for field in ["rule", "next", "remaining", "keys", "limits"] {
        assert_eq!(
            read[field], served[field],
            "{field}: {read} against {served}"
        );
    }
    // reading spends nothing: three reads of a fresh tenant, its 2 left
    for _ in 0..3 {
        let (ok, out, err) = direct("fresh", &[]).await;
        assert!(ok, "{out}{err}");
        let read: Value = serde_json::from_str(&out).expect("JSON");
        assert_eq!(
            (read["next"].as_str(), read["remaining"].as_u64()),
            (Some("ok"), Some(2)),
            "{read}"
        );
    }
    let (ok, out, err) = direct("locked", &["--reset", "--operator", "oncall"]).await;
    assert!(ok, "{out}{err}");
    let reset: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(reset["removed"], 1, "{reset}");
    assert!(err.contains("by oncall"), "{err}");
    assert_eq!(
        call(&mut c, "locked").await,
        Code::Ok as i32,
        "the budget is back"
    );
    // a descriptor no rule limits, a domain not in the rules: 404 and a
    // failed exit
    let out = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .args([
            "inspect",
            "--redis-url",
            &redis.url(),
            "--config",
            &config,
            "--domain",
            "nope",
            "--descriptor",
            "tenant=x",
        ])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("no domain 'nope'"));
    s.shutdown().await.expect("stop");
}
