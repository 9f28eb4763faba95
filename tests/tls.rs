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

/// A redis-server that only speaks TLS and requires client certificates.
fn tls_redis(dir: &Path, ca: &Ca) -> (common::ChildGuard, u16) {
    let (cert, key) = ca.issue("redis", true);
    tls_redis_with(dir, ca, &cert, &key)
}

/// As [`tls_redis`], its certificate naming `san` (e.g. `DNS:redis.internal`)
/// instead of localhost and 127.0.0.1.
fn tls_redis_named(dir: &Path, ca: &Ca, san: &str) -> (common::ChildGuard, u16) {
    let (cert, key) = ca.issue_with(
        "redis-named",
        &format!("subjectAltName={san}\nextendedKeyUsage=serverAuth\n"),
        "2",
    );
    tls_redis_with(dir, ca, &cert, &key)
}

fn tls_redis_with(dir: &Path, ca: &Ca, cert: &Path, key: &Path) -> (common::ChildGuard, u16) {
    tls_redis_on(dir, ca, cert, key, common::free_port())
}

/// As [`tls_redis_with`], on `port`.
fn tls_redis_on(
    dir: &Path,
    ca: &Ca,
    cert: &Path,
    key: &Path,
    port: u16,
) -> (common::ChildGuard, u16) {
    let child = std::process::Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .arg("--tls-cert-file")
        .arg(cert)
        .arg("--tls-key-file")
        .arg(key)
        .arg("--tls-ca-cert-file")
        .arg(ca.pem())
        .args(["--save", "", "--appendonly", "no", "--dir"])
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server");
    let guard = common::ChildGuard(child);
    let (client_cert, client_key) = ca.issue("redis-cli", false);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = std::process::Command::new("redis-cli")
            .args([
                "--tls",
                "-h",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "--cacert",
            ])
            .arg(ca.pem())
            .arg("--cert")
            .arg(&client_cert)
            .arg("--key")
            .arg(&client_key)
            .arg("PING")
            .output()
            .expect("redis-cli");
        if String::from_utf8_lossy(&out.stdout).contains("PONG") {
            return (guard, port);
        }
        assert!(Instant::now() < deadline, "TLS redis-server never answered");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn redis_over_tls_with_a_client_certificate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new(dir.path(), "redis");
    let (_redis, port) = tls_redis(dir.path(), &ca);
    let (client_cert, client_key) = ca.issue("rls", false);
    let rules = rules_dir("domain: d\ndescriptors:\n  - key: k\n    failure_mode: closed\n    rate_limit: {unit: minute, requests_per_unit: 5}\n");
    let args = |cert: bool| {
        let mut args = serve_args(rules.path().to_path_buf());
        args.store = tokenbucket_rls::cli::StoreKind::Redis;
        args.redis_url = Some(format!("rediss://127.0.0.1:{port}"));
        args.redis_timeout = Duration::from_millis(500);
        args.redis_ca_file = Some(ca.pem());
        if cert {
            args.redis_client_cert = Some(client_cert.clone());
            args.redis_client_key = Some(client_key.clone());
        }
        args
    };
    let s = server::start(&args(true)).await.expect("start");
    let mut c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    for left in [4, 3] {
        let r = c
            .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
            .await
            .expect("decided in Redis over TLS")
            .into_inner();
        assert_eq!(r.statuses[0].limit_remaining, left);
    }
    // without a client certificate the server refuses the connection: the
    // closed rule cannot be decided
    let s = server::start(&args(false)).await.expect("start");
    let mut c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    let err = c
        .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
        .await
        .expect_err("no TLS session without a client certificate");
    assert_eq!(err.code(), tonic::Code::Unavailable);
    // a CA file with a plaintext URL is a configuration error, said at start
    let mut plain = args(true);
    plain.redis_url = Some(format!("redis://127.0.0.1:{port}"));
    let e = server::start(&plain).await.err().expect("refused");
    assert!(e.to_string().contains("rediss://"), "{e}");
}

/// Redis's TLS files rotate (#53 item 3): the server comes back with a
/// certificate from another CA that also wants client certificates from
/// it, and the service's CA file, client certificate and key are
/// rewritten in place. They are read again for every new connection, so
/// decisions resume on the new server without a restart; read once at
/// start, every handshake would fail (the old CA does not know the new
/// server, the new server not the old client certificate).
#[tokio::test]
async fn redis_tls_files_rewritten_in_place_are_used_by_new_connections() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (old_dir, new_dir) = (dir.path().join("old"), dir.path().join("new"));
    std::fs::create_dir_all(&old_dir).expect("dir");
    std::fs::create_dir_all(&new_dir).expect("dir");
    let (old, new) = (Ca::new(&old_dir, "old"), Ca::new(&new_dir, "new"));
    let (redis, port) = tls_redis(&old_dir, &old);
    // the files the service reads, as a mounted Secret holds them
    let files = dir.path().join("secret");
    std::fs::create_dir_all(&files).expect("dir");
    let (ca_file, cert_file, key_file) = (
        files.join("ca.pem"),
        files.join("tls.crt"),
        files.join("tls.key"),
    );
    let install = |ca: &Ca| {
        let (cert, key) = ca.issue("rls", false);
        std::fs::copy(ca.pem(), &ca_file).expect("ca");
        std::fs::copy(&cert, &cert_file).expect("cert");
        std::fs::copy(&key, &key_file).expect("key");
    };
    install(&old);
    let rules = rules_dir("domain: d\ndescriptors:\n  - key: k\n    failure_mode: closed\n    rate_limit: {unit: minute, requests_per_unit: 5}\n");
    let mut args = serve_args(rules.path().to_path_buf());
    args.store = tokenbucket_rls::cli::StoreKind::Redis;
    args.redis_url = Some(format!("rediss://127.0.0.1:{port}"));
    args.redis_timeout = Duration::from_millis(500);
    args.redis_ca_file = Some(ca_file.clone());
    args.redis_client_cert = Some(cert_file.clone());
    args.redis_client_key = Some(key_file.clone());
    let s = server::start(&args).await.expect("start");
    let mut c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    let decide = |c: &mut RateLimitServiceClient<tonic::transport::Channel>| {
        let mut c = c.clone();
        async move {
            c.should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
                .await
                .map(|r| r.into_inner().statuses[0].limit_remaining)
        }
    };
    assert_eq!(decide(&mut c).await.expect("over TLS"), 4);

    // the rotation: a new server (another CA, no data) on the same port,
    // and the service's files rewritten in place
    drop(redis);
    install(&new);
    let (cert, key) = new.issue("redis", true);
    let _redis = tls_redis_on(&new_dir, &new, &cert, &key, port);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match decide(&mut c).await {
            // the new server's fresh bucket
            Ok(left) => {
                assert_eq!(left, 4);
                break;
            }
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                assert!(
                    Instant::now() < deadline,
                    "decisions never reached the new server: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert_eq!(decide(&mut c).await.expect("over TLS"), 3);
    s.shutdown().await.expect("stop");
}

/// `--tls-client-san` (envoyproxy/ratelimit's GRPC_CLIENT_TLS_SAN): a
/// client certificate from the CA must also carry that DNS SAN; one
/// without it fails the handshake.
#[tokio::test]
async fn mtls_with_a_client_san_refuses_certificates_without_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new(dir.path(), "main");
    let (cert, key) = ca.issue("server", true);
    let (envoy_cert, envoy_key) = ca.issue_with(
        "envoy",
        "subjectAltName=DNS:Envoy.Edge.Test\nextendedKeyUsage=clientAuth\n",
        "2",
    );
    let (other_cert, other_key) = ca.issue_with(
        "other",
        "subjectAltName=DNS:other.edge.test\nextendedKeyUsage=clientAuth\n",
        "2",
    );
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.tls_cert = Some(cert);
    args.tls_key = Some(key);
    args.tls_client_ca = Some(ca.pem());
    args.tls_client_san = Some("envoy.edge.test".to_string());
    let s = server::start(&args).await.expect("server starts");
    assert_eq!(
        call(&s, &ca.pem(), Some((&envoy_cert, &envoy_key))).await,
        Ok(4),
        "the named client (the SAN compared without case)"
    );
    assert!(
        call(&s, &ca.pem(), Some((&other_cert, &other_key)))
            .await
            .is_err(),
        "a certificate of the same CA without the SAN"
    );
    assert!(call(&s, &ca.pem(), None).await.is_err(), "no certificate");
    // a SAN to check without a client CA stops the start
    let mut args = serve_args(rules.path().to_path_buf());
    let (cert, key) = ca.issue("server2", true);
    args.tls_cert = Some(cert);
    args.tls_key = Some(key);
    args.tls_client_san = Some("envoy.edge.test".to_string());
    let e = match server::start(&args).await {
        Ok(_) => panic!("started without a client CA"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("needs a client CA"), "{e}");
}

/// `--tls-client-san` in the other forms a client certificate names its
/// holder: a wildcard DNS SAN covering the name (as Go's check, which
/// envoyproxy/ratelimit uses, takes it), an IP address against the IP
/// SANs, and a URI (a SPIFFE ID, as Istio's and SPIRE's certificates
/// carry) against the URI SANs, exactly. A value that is none of them
/// stops the start naming it.
#[tokio::test]
async fn a_client_san_may_be_a_wildcard_an_address_or_a_uri() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new(dir.path(), "main");
    let client = |leaf: &str, san: &str| {
        ca.issue_with(
            leaf,
            &format!("subjectAltName={san}\nextendedKeyUsage=clientAuth\n"),
            "2",
        )
    };
    let wildcard = client("wildcard", "DNS:*.gw.edge.test");
    let address = client("address", "IP:10.1.2.3");
    let spiffe = client("spiffe", "URI:spiffe://cluster.local/ns/gw/sa/envoy");
    let other = client("other-sa", "URI:spiffe://cluster.local/ns/gw/sa/other");
    let rules = rules_dir(RULES);
    for (san, named, not_named) in [
        ("envoy-1.gw.edge.test", &wildcard, &address),
        ("10.1.2.3", &address, &wildcard),
        ("spiffe://cluster.local/ns/gw/sa/envoy", &spiffe, &other),
    ] {
        let (cert, key) = ca.issue(&format!("server-{}", san.len()), true);
        let mut args = serve_args(rules.path().to_path_buf());
        args.tls_cert = Some(cert);
        args.tls_key = Some(key);
        args.tls_client_ca = Some(ca.pem());
        args.tls_client_san = Some(san.to_string());
        let s = server::start(&args).await.expect("server starts");
        assert!(
            call(&s, &ca.pem(), Some((&named.0, &named.1)))
                .await
                .is_ok(),
            "{san}: the certificate naming it"
        );
        assert!(
            call(&s, &ca.pem(), Some((&not_named.0, &not_named.1)))
                .await
                .is_err(),
            "{san}: a certificate of the same CA naming another"
        );
        s.shutdown().await.expect("stop");
    }
    let (cert, key) = ca.issue("server-bad", true);
    let mut args = serve_args(rules.path().to_path_buf());
    args.tls_cert = Some(cert);
    args.tls_key = Some(key);
    args.tls_client_ca = Some(ca.pem());
    args.tls_client_san = Some("not a name!".to_string());
    let e = match server::start(&args).await {
        Ok(_) => panic!("started with a SAN that is no name"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("--tls-client-san \"not a name!\": not a DNS name, an IP address or a URI"),
        "{e}"
    );
}

/// `--redis-tls-skip-hostname-verification` (envoyproxy/ratelimit's
/// REDIS_TLS_SKIP_HOSTNAME_VERIFICATION): a Redis whose certificate names
/// another host is refused as usual, and taken with the flag, its chain
/// still checked against the CA (a server of another CA stays refused).
#[tokio::test]
async fn redis_tls_may_skip_the_hostname_but_never_the_chain() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new(dir.path(), "redis");
    let (_redis, port) = tls_redis_named(dir.path(), &ca, "DNS:redis.internal");
    let (client_cert, client_key) = ca.issue("rls", false);
    let rules = rules_dir("domain: d\ndescriptors:\n  - key: k\n    failure_mode: closed\n    rate_limit: {unit: minute, requests_per_unit: 5}\n");
    let args = |skip: bool, ca_file: std::path::PathBuf| {
        let mut args = serve_args(rules.path().to_path_buf());
        args.store = tokenbucket_rls::cli::StoreKind::Redis;
        args.redis_url = Some(format!("rediss://127.0.0.1:{port}"));
        args.redis_timeout = Duration::from_millis(500);
        args.redis_ca_file = Some(ca_file);
        args.redis_client_cert = Some(client_cert.clone());
        args.redis_client_key = Some(client_key.clone());
        args.redis_tls_skip_hostname_verification = skip;
        args
    };
    let decide = |s: &RunningServer| {
        let addr = s.grpc_addr;
        async move {
            let mut c = RateLimitServiceClient::connect(format!("http://{addr}"))
                .await
                .expect("connect");
            c.should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
                .await
                .map(|r| r.into_inner().statuses[0].limit_remaining)
                .map_err(|e| e.code())
        }
    };
    // the name 127.0.0.1 is not the certificate's: refused
    let s = server::start(&args(false, ca.pem())).await.expect("start");
    assert_eq!(decide(&s).await, Err(tonic::Code::Unavailable));
    // with the flag: decided in Redis
    let s = server::start(&args(true, ca.pem())).await.expect("start");
    assert_eq!(decide(&s).await, Ok(4));
    // and a CA that did not sign the server is still refused
    let other = Ca::new(dir.path(), "other");
    let s = server::start(&args(true, other.pem()))
        .await
        .expect("start");
    assert_eq!(decide(&s).await, Err(tonic::Code::Unavailable));
}

/// `rediss-sentinel://` (#40): a sentinel and a primary that both speak only
/// TLS and ask for client certificates; the service finds the primary
/// through the sentinel over TLS (the same CA file and client certificate
/// for both), checks its role over TLS, and decides there.
#[tokio::test]
async fn a_primary_found_through_a_sentinel_over_tls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new(dir.path(), "redis");
    let (_redis, primary) = tls_redis(dir.path(), &ca);
    let (cert, key) = ca.issue("redis", true);
    let (sentinel_cert, sentinel_key) = ca.issue("sentinel-client", false);
    let sentinel_port = common::free_port();
    let sentinel_dir = dir.path().join("sentinel");
    std::fs::create_dir_all(&sentinel_dir).expect("dir");
    let conf = sentinel_dir.join("sentinel.conf");
    std::fs::write(
        &conf,
        format!(
            "port 0\ntls-port {sentinel_port}\nbind 127.0.0.1\ndir {}\n\
             tls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
             tls-client-cert-file {}\ntls-client-key-file {}\ntls-replication yes\n\
             sentinel monitor mymaster 127.0.0.1 {primary} 1\n",
            sentinel_dir.display(),
            cert.display(),
            key.display(),
            ca.pem().display(),
            sentinel_cert.display(),
            sentinel_key.display(),
        ),
    )
    .expect("sentinel.conf");
    let _sentinel = common::ChildGuard(
        std::process::Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server --sentinel"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", sentinel_port)).is_err() {
        assert!(Instant::now() < deadline, "the sentinel never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (client_cert, client_key) = ca.issue("rls", false);
    let rules = rules_dir("domain: d\ndescriptors:\n  - key: k\n    failure_mode: closed\n    rate_limit: {unit: minute, requests_per_unit: 5}\n");
    let mut args = serve_args(rules.path().to_path_buf());
    args.store = tokenbucket_rls::cli::StoreKind::Redis;
    args.redis_url = Some(format!(
        "rediss-sentinel://127.0.0.1:{sentinel_port}/mymaster"
    ));
    args.redis_timeout = Duration::from_millis(500);
    args.redis_ca_file = Some(ca.pem());
    args.redis_client_cert = Some(client_cert);
    args.redis_client_key = Some(client_key);
    let s = server::start(&args).await.expect("start");
    let mut c = RateLimitServiceClient::connect(format!("http://{}", s.grpc_addr))
        .await
        .expect("connect");
    for left in [4, 3] {
        let r = c
            .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
            .await
            .expect("decided on the primary the sentinel named, over TLS")
            .into_inner();
        assert_eq!(r.statuses[0].limit_remaining, left);
    }
    s.shutdown().await.expect("stop");
}

/// `GET path` over HTTPS to the admin port, trusting `ca`, presenting
/// `identity` if given: the status code (an error: no TLS connection).
async fn admin_get(
    server: &RunningServer,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    path: &str,
) -> Result<u16, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).expect("ca") {
        roots.add(cert.expect("ca cert")).expect("root");
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
    let mut config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                CertificateDer::pem_file_iter(cert)
                    .expect("cert")
                    .map(|c| c.expect("cert"))
                    .collect(),
                PrivateKeyDer::from_pem_file(key).expect("key"),
            )
            .expect("identity"),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = tokio::net::TcpStream::connect(server.admin_addr)
        .await
        .map_err(|e| e.to_string())?;
    let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
        .map_err(|e| e.to_string())?;
    tls.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut reply = Vec::new();
    // a refused handshake (TLS 1.3 checks the client's certificate after
    // the client's side is done) shows here
    tls.read_to_end(&mut reply)
        .await
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&reply);
    text.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("no status line: {text:?}"))
}

/// #54 item 6: the admin port over HTTPS with a client CA. What shows or
/// changes state (`/v1/…`, `/config`) needs a certificate the CA
/// signed; the probes and `/metrics` answer any client (a kubelet has no
/// certificate); a stranger's certificate fails the handshake; plain HTTP
/// gets no answer.
#[tokio::test]
async fn the_admin_port_needs_a_client_certificate_except_for_probes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new(dir.path(), "main");
    let (cert, key) = ca.issue("server", true);
    let (client_cert, client_key) = ca.issue("operator", false);
    let stranger = Ca::new(dir.path(), "stranger");
    let (bad_cert, bad_key) = stranger.issue("intruder", false);
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.admin_tls_cert = Some(cert.clone());
    args.admin_tls_key = Some(key.clone());
    args.admin_tls_client_ca = Some(ca.pem());
    let s = server::start(&args).await.expect("server starts");
    let operator = Some((client_cert.as_path(), client_key.as_path()));
    for path in ["/v1/rules", "/v1/store", "/config", "/v1/hitters"] {
        assert_eq!(
            admin_get(&s, &ca.pem(), operator, path).await,
            Ok(200),
            "{path}"
        );
        assert_eq!(
            admin_get(&s, &ca.pem(), None, path).await,
            Ok(403),
            "{path}"
        );
    }
    // the page's static shell holds no values (it reads them from /v1/…)
    for path in [
        "/healthz",
        "/readyz",
        "/healthcheck",
        "/metrics",
        "/",
        "/page.js",
    ] {
        assert_eq!(
            admin_get(&s, &ca.pem(), None, path).await,
            Ok(200),
            "{path}"
        );
    }
    assert!(
        admin_get(&s, &ca.pem(), Some((&bad_cert, &bad_key)), "/v1/rules")
            .await
            .is_err(),
        "a stranger's certificate is refused"
    );
    let plain = reqwest::get(format!("http://{}/healthz", s.admin_addr)).await;
    assert!(
        plain.is_err() || !plain.expect("reply").status().is_success(),
        "plain HTTP"
    );
    s.shutdown().await.expect("stop");
}
