//! gRPC over TLS and mTLS with certificates from files, reloaded on change.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::tls::Ca;
use common::{descriptor, request, rules_dir, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tokenbucket_rls::server::{self, RunningServer};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const RULES: &str =
    "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";

async fn start(
    dir: &Path,
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> (RunningServer, tempfile::TempDir) {
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.tls_cert = Some(cert.to_path_buf());
    args.tls_key = Some(key.to_path_buf());
    args.tls_client_ca = client_ca.map(Path::to_path_buf);
    let _ = dir;
    (
        server::start(&args).await.expect("server starts with TLS"),
        rules,
    )
}

/// Calls ShouldRateLimit over TLS trusting `ca`, presenting `identity` if given.
async fn call(
    server: &RunningServer,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<u32, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(ca).expect("ca")))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(
            std::fs::read(cert).expect("cert"),
            std::fs::read(key).expect("key"),
        ));
    }
    let channel = Channel::from_shared(format!("https://localhost:{}", server.grpc_addr.port()))
        .expect("url")
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let mut client = RateLimitServiceClient::new(channel);
    let r = client
        .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(r.into_inner().statuses[0].limit_remaining)
}

#[tokio::test]
async fn tls_serves_and_plaintext_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new(dir.path(), "main");
    let (cert, key) = ca.issue("server", true);
    let (s, _rules) = start(dir.path(), &cert, &key, None).await;
    assert_eq!(call(&s, &ca.pem(), None).await, Ok(4));
    let plain =
        RateLimitServiceClient::connect(format!("http://127.0.0.1:{}", s.grpc_addr.port())).await;
    let refused = match plain {
        Err(_) => true,
        Ok(mut c) => c
            .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
            .await
            .is_err(),
    };
    assert!(refused, "a plaintext client gets nowhere");
    let other = Ca::new(dir.path(), "other");
    assert!(
        call(&s, &other.pem(), None).await.is_err(),
        "a client that does not trust the CA refuses"
    );
}

#[tokio::test]
async fn mtls_requires_a_client_certificate_from_the_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new(dir.path(), "main");
    let (cert, key) = ca.issue("server", true);
    let (client_cert, client_key) = ca.issue("client", false);
    let stranger = Ca::new(dir.path(), "stranger");
    let (bad_cert, bad_key) = stranger.issue("intruder", false);
    let (s, _rules) = start(dir.path(), &cert, &key, Some(&ca.pem())).await;
    assert!(
        call(&s, &ca.pem(), None).await.is_err(),
        "no client certificate"
    );
    assert!(
        call(&s, &ca.pem(), Some((&bad_cert, &bad_key)))
            .await
            .is_err(),
        "a stranger's certificate"
    );
    assert_eq!(
        call(&s, &ca.pem(), Some((&client_cert, &client_key))).await,
        Ok(4)
    );
}

#[tokio::test]
async fn a_renewed_certificate_is_used_without_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let old = Ca::new(dir.path(), "old");
    let new = Ca::new(dir.path(), "new");
    let (old_cert, old_key) = old.issue("server-old", true);
    let (new_cert, new_key) = new.issue("server-new", true);
    let live_cert = dir.path().join("tls.crt");
    let live_key = dir.path().join("tls.key");
    std::fs::copy(&old_cert, &live_cert).expect("copy");
    std::fs::copy(&old_key, &live_key).expect("copy");
    let (s, _rules) = start(dir.path(), &live_cert, &live_key, None).await;
    assert!(call(&s, &old.pem(), None).await.is_ok());
    assert!(call(&s, &new.pem(), None).await.is_err());
    // a broken renewal is ignored: the old certificate keeps serving
    std::fs::write(&live_key, "not a key").expect("write");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        call(&s, &old.pem(), None).await.is_ok(),
        "still the old certificate"
    );
    // the real renewal
    std::fs::copy(&new_key, &live_key).expect("copy");
    std::fs::copy(&new_cert, &live_cert).expect("copy");
    let deadline = Instant::now() + Duration::from_secs(10);
    while call(&s, &new.pem(), None).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the new certificate was never used"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        call(&s, &old.pem(), None).await.is_err(),
        "new connections get the new certificate"
    );
}
