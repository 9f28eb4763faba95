//! #65: nobody turns the limiter against itself. An operator's reset is
//! closed by default and needs a credential, a named operator and this
//! origin (a page of another origin in a real browser resets nothing);
//! a `Host` of another name reads nothing (DNS rebinding); the page comes
//! with security headers; a value padded past 1 KiB still meets its
//! wildcard rule; a summary poisoned in Redis is refused, counted, and
//! the instance stays up.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{client, descriptor, request, rules_dir, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;

const RULES: &str = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";

type Client = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<tonic::transport::Channel>;

async fn call(c: &mut Client, key: &str, value: &str) -> i32 {
    c.should_rate_limit(request("api", vec![descriptor(&[(key, value)])]))
        .await
        .expect("decided")
        .into_inner()
        .overall_code
}

fn resets(metrics: &str) -> f64 {
    common::sample(
        metrics,
        "rls_bucket_resets_total{domain=\"api\",rule=\"tenant\"}",
    )
    .unwrap_or(0.0)
}

async fn text(url: &str) -> String {
    reqwest::get(url)
        .await
        .expect("answered")
        .text()
        .await
        .expect("body")
}

/// By default (no credential configured) a reset is refused whoever asks,
/// and a web page of another origin, open in a real browser, resets
/// nothing, by form or by `fetch`.
#[tokio::test]
async fn a_reset_is_closed_by_default_and_no_other_page_makes_one() {
    let rules = rules_dir(RULES);
    let s = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("start");
    let mut c = client(&s).await;
    for _ in 0..3 {
        let _ = call(&mut c, "tenant", "locked").await;
    }
    assert_eq!(
        call(&mut c, "tenant", "locked").await,
        Code::OverLimit as i32
    );
    let admin = format!("http://{}", s.admin_addr);
    let reset = format!("{admin}/v1/buckets/reset?domain=api&descriptor=tenant%3Dlocked");
    let r = reqwest::Client::new()
        .post(&reset)
        .header("X-Rls-Operator", "mallory")
        .send()
        .await
        .expect("answered");
    assert_eq!(r.status().as_u16(), 403);
    assert!(r.text().await.expect("body").contains("--admin-token-file"));

    // the attacker's page, on another origin (another port)
    let site = tempfile::tempdir().expect("site");
    std::fs::write(
        site.path().join("index.html"),
        format!(
            r#"<!doctype html><html><body>
<form id="f" method="POST" action="{reset}"></form>
<script>
fetch("{reset}", {{method: "POST", mode: "no-cors"}}).catch(() => {{}});
fetch("{reset}", {{method: "POST", headers: {{"X-Rls-Operator": "x"}}}}).catch(() => {{}});
document.getElementById("f").submit();
</script></body></html>"#
        ),
    )
    .expect("write page");
    let port = common::free_port();
    let mut server = Command::new("python3")
        .args([
            "-m",
            "http.server",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .current_dir(site.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("python3 serves the page");
    common::listening(port).await;
    let profile = tempfile::tempdir().expect("profile");
    let args = vec![
        "--headless".to_string(),
        "--no-sandbox".into(),
        "--disable-gpu".into(),
        "--virtual-time-budget=3000".into(),
        format!("--user-data-dir={}", profile.path().display()),
        "--dump-dom".into(),
        format!("http://127.0.0.1:{port}/index.html"),
    ];
    let out = tokio::task::spawn_blocking(move || Command::new("chromium").args(&args).output())
        .await
        .expect("joined")
        .expect("chromium runs (integration/install-deps.sh installs it)");
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metrics = text(&format!("{admin}/metrics")).await;
    assert_eq!(resets(&metrics), 0.0, "no reset happened");
    assert_eq!(
        call(&mut c, "tenant", "locked").await,
        Code::OverLimit as i32,
        "still locked out"
    );

    // the page: security headers; guarded paths answer no foreign Host
    let page = reqwest::get(format!("{admin}/")).await.expect("page");
    let h = page.headers();
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert_eq!(h["x-frame-options"], "DENY");
    let csp = h["content-security-policy"].to_str().expect("ascii");
    assert!(
        csp.contains("frame-ancestors 'none'") && csp.contains("script-src 'self'"),
        "{csp}"
    );
    let rebound = reqwest::Client::new()
        .get(format!("{admin}/v1/hitters"))
        .header("Host", "attacker.example")
        .send()
        .await
        .expect("answered");
    assert_eq!(rebound.status().as_u16(), 421);
    s.shutdown().await.expect("stop");
}

/// With a token configured: the token, an operator's name and this origin
/// are all needed; then the reset is made and logged with that name.
#[tokio::test]
async fn a_reset_needs_the_token_an_operator_and_this_origin() {
    let rules = rules_dir(RULES);
    let dir = tempfile::tempdir().expect("tempdir");
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").expect("write");
    let mut args = serve_args(rules.path().to_path_buf());
    args.admin_token_file = Some(token.clone());
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let mut c = client(&s).await;
    for _ in 0..3 {
        let _ = call(&mut c, "tenant", "locked").await;
    }
    let admin = format!("http://{}", s.admin_addr);
    let reset = format!("{admin}/v1/buckets/reset?domain=api&descriptor=tenant%3Dlocked");
    let post = |headers: &[(&str, String)]| {
        let mut r = reqwest::Client::new().post(&reset);
        for (k, v) in headers {
            r = r.header(*k, v.clone());
        }
        async move { r.send().await.expect("answered").status().as_u16() }
    };
    let bearer = ("Authorization", "bearer s3cret".to_string());
    let operator = ("X-Rls-Operator", "oncall".to_string());
    assert_eq!(post(std::slice::from_ref(&operator)).await, 401, "no token");
    assert_eq!(
        post(std::slice::from_ref(&bearer)).await,
        403,
        "no operator named"
    );
    let foreign = ("Origin", "http://attacker.example".to_string());
    assert_eq!(
        post(&[bearer.clone(), operator.clone(), foreign]).await,
        403,
        "another origin"
    );
    // the scheme in lower case is the same scheme (RFC 9110)
    assert_eq!(post(&[bearer, operator]).await, 200);
    assert_eq!(resets(&text(&format!("{admin}/metrics")).await), 1.0);
    assert_eq!(call(&mut c, "tenant", "locked").await, Code::Ok as i32);
    // a token file that vanishes: refused without naming the file
    std::fs::remove_file(&token).expect("remove");
    let r = reqwest::Client::new()
        .get(format!("{admin}/v1/rules"))
        .send()
        .await
        .expect("answered");
    assert_eq!(r.status().as_u16(), 503);
    let body = r.text().await.expect("body");
    assert!(!body.contains(token.to_str().expect("utf-8")), "{body}");
    s.shutdown().await.expect("stop");
    // and one missing at start stops the start, naming it
    let err = tokenbucket_rls::server::start(&args)
        .await
        .err()
        .expect("refused");
    assert!(format!("{err:#}").contains("--admin-token-file"), "{err:#}");
}

/// A value padded past 1 KiB still meets `team-*` (matching sees the whole
/// value; only its key is a digest), and each padded value has its own
/// bucket.
#[tokio::test]
async fn a_padded_value_does_not_escape_its_wildcard_rule() {
    let rules = rules_dir(
        "domain: api\ndescriptors:\n  - key: team\n    value: \"team-*\"\n    rate_limit: {unit: hour, requests_per_unit: 3}\n",
    );
    let s = tokenbucket_rls::server::start(&serve_args(rules.path().to_path_buf()))
        .await
        .expect("start");
    let mut c = client(&s).await;
    let padded = format!("team-{}", "a".repeat(1100));
    let mut admitted = 0;
    for _ in 0..5 {
        admitted += u32::from(call(&mut c, "team", &padded).await == Code::Ok as i32);
    }
    assert_eq!(admitted, 3, "the rule allows 3");
    let other = format!("team-{}b", "a".repeat(1100));
    assert_eq!(
        call(&mut c, "team", &other).await,
        Code::Ok as i32,
        "its own bucket"
    );
    s.shutdown().await.expect("stop");
}

/// A heavy-hitter summary written into the shared Redis by anyone, sized
/// to make a reader allocate terabytes, is refused and counted; the
/// instance answers and stays up.
#[tokio::test]
async fn a_poisoned_summary_in_redis_is_refused_and_the_instance_stays_up() {
    let redis = common::redis::RedisServer::standalone();
    let rules = rules_dir(RULES);
    let s = common::start_on_redis(&redis.url(), &rules, Duration::from_secs(1)).await;
    let mut c = client(&s).await;
    for _ in 0..3 {
        let _ = call(&mut c, "tenant", "someone").await;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let poison = r#"{"k":1000000000000,"total":1,"counters":[]}"#;
    use fred::prelude::*;
    let raw = Builder::from_config(Config::from_url(&redis.url()).expect("url"))
        .build()
        .expect("client");
    raw.init().await.expect("raw client connects");
    let hset = |key: String, field: &'static str, value: String| {
        let raw = raw.clone();
        async move {
            let _: i64 = raw
                .custom(fred::cmd!("HSET"), vec![key, field.to_string(), value])
                .await
                .expect("HSET");
        }
    };
    hset("rls:hitters:rules".into(), "api\0tenant", now.to_string()).await;
    for length in [60, 3600] {
        let start = now - now % length;
        for s in [start, start - length, start + length] {
            for kind in ["refused", "admitted"] {
                let key = format!("rls:hitters:api\0tenant:{kind}:{length}:{s}");
                hset(key, "evil", poison.to_string()).await;
            }
        }
    }
    let admin = format!("http://{}", s.admin_addr);
    let r = reqwest::get(format!("{admin}/v1/hitters"))
        .await
        .expect("the instance answers");
    assert_eq!(r.status().as_u16(), 200);
    let metrics = text(&format!("{admin}/metrics")).await;
    let refused = common::sample(
        &metrics,
        "rls_untrusted_input_refused_total{reason=\"too_many_counters\",source=\"hitters\"}",
    );
    assert!(refused.is_some_and(|n| n >= 1.0), "{metrics}");
    assert_eq!(call(&mut c, "tenant", "another").await, Code::Ok as i32);
    s.shutdown().await.expect("stop");
}

/// #65 item 7: a read stays small whatever the values: `n` at most 100
/// (101 is refused by name), values shown cut at 64 bytes each, so that
/// one rule's answer of 2,000 distinct 1 KiB values at the most counters
/// (`--heavy-hitters 256`) stays under 100 KB.
#[tokio::test]
async fn a_read_of_the_heavy_hitters_is_bounded() {
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.heavy_hitters = 256;
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let mut c = client(&s).await;
    for i in 0..2000 {
        let value = format!("{i:04}-{}", "v".repeat(1020));
        let _ = call(&mut c, "tenant", &value).await;
    }
    let admin = format!("http://{}", s.admin_addr);
    let r = reqwest::get(format!("{admin}/v1/hitters?n=101"))
        .await
        .expect("answered");
    assert_eq!(r.status().as_u16(), 400);
    let body = text(&format!("{admin}/v1/hitters?n=100")).await;
    let h: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let admitted = h["rules"][0]["admitted"]["minute"]
        .as_array()
        .expect("rows");
    assert_eq!(admitted.len(), 100);
    assert!(
        admitted.iter().all(|row| row["value"]
            .as_str()
            .is_some_and(|v| v.len() < 80 && v.contains('…'))),
        "each value cut: {}",
        admitted[0]
    );
    assert!(body.len() < 100_000, "{} bytes", body.len());
    eprintln!(
        "/v1/hitters?n=100, one rule of 2,000 values at K=256: {} bytes",
        body.len()
    );
    s.shutdown().await.expect("stop");
}
