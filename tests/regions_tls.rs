//! Regions across real networks (#44): the link from a region to the global
//! tier over TLS, and a region that can only speak for itself. A global tier
//! (the binary, its own process) serving TLS and requiring client
//! certificates, regions (the binary, processes of their own) each showing a
//! certificate that names it (DNS SAN `<region>.regions.test`), all made by
//! the test with `openssl`. Loopback only; every load loop is bounded.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::tls::Ca;
use common::{descriptor, free_port, listening, request, rules_dir, sample, ChildGuard};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const RULES: &str = r#"
domain: world
descriptors:
  - key: api
    scope: global
    failure_mode: local
    rate_limit: {unit: second, requests_per_unit: 30, burst: 60}
"#;

async fn metrics(admin: u16) -> String {
    reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text")
}

/// A region process: its admin and gRPC ports.
struct Region {
    _process: ChildGuard,
    admin: u16,
    grpc: u16,
}

/// Starts region `name` (one of 3) against the global tier on `tier`, with
/// the client certificate `cert` (cert, key) when given.
async fn region(
    rules: &Path,
    tier: u16,
    ca: &Path,
    name: &str,
    cert: Option<&(PathBuf, PathBuf)>,
) -> Region {
    let (grpc, admin) = (free_port(), free_port());
    let mut command = common::binary_without_rls_env();
    command
        .arg("--config")
        .arg(rules)
        .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--admin-addr", &format!("127.0.0.1:{admin}")])
        .args(["--quota-upstream", &format!("https://localhost:{tier}")])
        .arg("--quota-upstream-ca-file")
        .arg(ca)
        .args(["--region", name, "--regions", "3"])
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some((pem, key)) = cert {
        command
            .arg("--quota-upstream-client-cert")
            .arg(pem)
            .arg("--quota-upstream-client-key")
            .arg(key);
    }
    let process = ChildGuard(command.spawn().expect("region starts"));
    listening(grpc).await;
    Region {
        _process: process,
        admin,
        grpc,
    }
}

/// Sends a request to `region` every 20 ms for `secs`: its demand.
async fn demand(region: &Region, secs: u64) {
    let mut c = RateLimitServiceClient::connect(format!("http://127.0.0.1:{}", region.grpc))
        .await
        .expect("connect");
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        let _ = c
            .should_rate_limit(request("world", vec![descriptor(&[("api", "k")])]))
            .await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Assignments the region received from the global tier so far.
async fn assignments(region: &Region) -> f64 {
    sample(&metrics(region.admin).await, "rls_region_assignments_total").unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn regions_over_mtls_speak_only_for_themselves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new(dir.path(), "regions");
    let rogue = Ca::new(dir.path(), "rogue");
    let (tier_pem, tier_key) = ca.issue("tier", true);
    let eu_cert = ca.issue_region("eu", "eu", "2");
    let us_cert = ca.issue_region("us", "us", "2");
    let rogue_cert = rogue.issue_region("ap-rogue", "ap", "2");
    let expired_cert = ca.issue_region("ap", "ap", "0");
    let rules = rules_dir(RULES);

    let (grpc, admin) = (free_port(), free_port());
    let tier_log = dir.path().join("tier.log");
    let tier = ChildGuard(
        common::binary_without_rls_env()
            .arg("--config")
            .arg(rules.path())
            .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
            .args(["--admin-addr", &format!("127.0.0.1:{admin}")])
            .arg("--tls-cert")
            .arg(&tier_pem)
            .arg("--tls-key")
            .arg(&tier_key)
            .arg("--tls-client-ca")
            .arg(ca.pem())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&tier_log).expect("log file"))
            .spawn()
            .expect("global tier starts"),
    );
    listening(grpc).await;

    // two regions with their own certificates: split as before
    let eu = region(rules.path(), grpc, &ca.pem(), "eu", Some(&eu_cert)).await;
    let us = region(rules.path(), grpc, &ca.pem(), "us", Some(&us_cert)).await;
    // a region claiming to be ap with eu's certificate; one with ap's
    // from another CA; one with none; one whose certificate has expired
    let spy = region(rules.path(), grpc, &ca.pem(), "ap", Some(&eu_cert)).await;
    let forged = region(rules.path(), grpc, &ca.pem(), "ap", Some(&rogue_cert)).await;
    let anonymous = region(rules.path(), grpc, &ca.pem(), "ap", None).await;
    // (a second, and the certificate made with -days 0 has expired)
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let expired = region(rules.path(), grpc, &ca.pem(), "ap", Some(&expired_cert)).await;
    futures::future::join_all(
        [&eu, &us, &spy, &forged, &anonymous, &expired].map(|r| demand(r, 4)),
    )
    .await;
    for (name, r) in [("eu", &eu), ("us", &us)] {
        let m = metrics(r.admin).await;
        assert!(
            sample(&m, "rls_region_assignments_total").unwrap_or(0.0) >= 1.0,
            "{name} got no share: {m}"
        );
        assert_eq!(sample(&m, "rls_region_upstream_up"), Some(1.0), "{name}");
    }
    for (what, r) in [
        ("another region's certificate", &spy),
        ("another CA's certificate", &forged),
        ("no certificate", &anonymous),
        ("an expired certificate", &expired),
    ] {
        assert_eq!(
            assignments(r).await,
            0.0,
            "a region with {what} got a share"
        );
        assert_eq!(
            sample(&metrics(r.admin).await, "rls_region_upstream_up"),
            Some(0.0),
            "a region with {what}"
        );
    }
    let tier_metrics = metrics(admin).await;
    assert!(
        sample(
            &tier_metrics,
            "rls_region_streams_refused_total{reason=\"certificate\"}"
        )
        .unwrap_or(0.0)
            >= 1.0,
        "the spy was refused and counted: {tier_metrics}"
    );
    // the refused never reported: only eu's and us's demand was split
    let log = std::fs::read_to_string(&tier_log).expect("tier log");
    assert!(
        log.contains("region stream refused") && log.contains("region=ap"),
        "{log}"
    );
    assert!(
        log.contains("TLS handshake refused") && log.contains("certificate expired"),
        "an expired certificate is named in the log: {log}"
    );

    // ap's certificate renewed on disk: picked up without a restart
    ca.issue_region("ap", "ap", "2");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        demand(&expired, 1).await;
        if assignments(&expired).await >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the renewed certificate was never used: {}",
            metrics(expired.admin).await
        );
    }
    drop(tier);
}
