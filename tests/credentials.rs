//! Credentials that rotate (#53 item 3): the Redis password read from a
//! file (`--redis-password-file`) again for every new connection, against a
//! real redis-server whose password changes while the service decides: the
//! default user's (`CONFIG SET requirepass`) and an ACL user's (`ACL
//! SETUSER`, the new password added before the old one goes, as a Secret's
//! rotation does). The connections the server drops authenticate again
//! with the newest password; no admitted decision is lost or counted twice.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::redis::{RedisCluster, RedisServer};
use common::{client, descriptor, request, rules_dir, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

const BURST: f64 = 100_000.0;

/// `redis-cli` on `port` with the default user's password `pass`: its output.
fn cli_as(port: u16, pass: &str, args: &[&str]) -> String {
    let port = port.to_string();
    let mut all = vec!["-p", &port, "-a", pass, "--no-auth-warning"];
    all.extend_from_slice(args);
    let out = std::process::Command::new("redis-cli")
        .args(&all)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Replaces the file as a Secret's mount does: a new file renamed over it.
fn rotate(path: &Path, password: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, format!("{password}\n")).expect("write");
    std::fs::rename(&next, path).expect("rename");
}

async fn decided(c: &mut RateLimitServiceClient<Channel>) -> Result<(), tonic::Status> {
    let r = c
        .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
        .await?
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    Ok(())
}

/// Decides until a call is admitted again after a rotation (the dropped
/// connections back with the new password), at most 20 s; the calls the
/// failure mode answered meanwhile.
async fn decided_again(c: &mut RateLimitServiceClient<Channel>) -> u64 {
    let changed = Instant::now();
    let mut refused = 0u64;
    loop {
        match decided(c).await {
            Ok(()) => return refused,
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                assert!(
                    changed.elapsed() < Duration::from_secs(20),
                    "never decided again after the rotation ({refused} answered by the failure mode)"
                );
                refused += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Tokens left in `k=v`'s bucket, read with `url`'s credentials.
async fn tokens(url: &str) -> f64 {
    use fred::prelude::*;
    let config = tokenbucket_rls::store::redis::url::parse(url).expect("url");
    let raw = Builder::from_config(config).build().expect("client");
    raw.init().await.expect("raw client connects");
    let key = common::redis::bucket_key_in("d", &[("k", "v")], "0");
    common::redis::stored_bucket(&raw, &key)
        .await
        .expect("the bucket is there")
        .0
}

/// Starts the service on `server` as `user` (none: the default user) with
/// the password in a file holding `first`; decides, has `change` rotate the
/// server's password to `second` (and the file), decides until the dropped
/// connections are back, then checks every admitted decision was counted
/// once.
async fn rotation(
    server: &RedisServer,
    user: Option<&str>,
    first: &str,
    second: &str,
    change: impl FnOnce(&Path),
) {
    let at = user.map_or(String::new(), |u| format!("{u}@"));
    let url = format!("redis://{at}127.0.0.1:{}", server.port);
    let read = format!(
        "redis://{}:{second}@127.0.0.1:{}",
        user.unwrap_or(""),
        server.port
    );
    rotation_at(&url, &read, first, change).await;
}

/// [`rotation`] on the Redis at `url` (its user, no password), the
/// bucket read afterwards through `read` (the new password in it).
async fn rotation_at(url: &str, read: &str, first: &str, change: impl FnOnce(&Path)) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("redis-password");
    rotate(&file, first);
    let rules = rules_dir(&format!(
        "domain: d\ndescriptors:\n  - key: k\n    failure_mode: closed\n    rate_limit: {{unit: day, requests_per_unit: 1, burst: {BURST}}}\n"
    ));
    let mut args = serve_args(rules.path().to_path_buf());
    args.store = tokenbucket_rls::cli::StoreKind::Redis;
    args.redis_url = Some(url.to_string());
    args.redis_password_file = Some(file.clone());
    args.redis_timeout = Duration::from_millis(500);
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let mut c = client(&s).await;
    let mut admitted = 0u64;
    for _ in 0..50 {
        decided(&mut c)
            .await
            .expect("decided with the first password");
        admitted += 1;
    }
    change(&file);
    // the connections the server dropped come back with the new password
    let changed = Instant::now();
    let refused = decided_again(&mut c).await;
    admitted += 1;
    for _ in 0..50 {
        decided(&mut c)
            .await
            .expect("decided with the new password");
        admitted += 1;
    }
    eprintln!(
        "rotation: decided again {:?} after it, {refused} calls answered by the failure mode in between",
        changed.elapsed()
    );
    let left = tokens(read).await;
    assert_eq!(left.round(), BURST - admitted as f64, "each decision once");
    s.shutdown().await.expect("stop");
}

#[tokio::test]
async fn a_rotated_requirepass_is_read_from_the_file() {
    let server = RedisServer::standalone();
    assert!(server
        .cli(&["CONFIG", "SET", "requirepass", "old-pass"])
        .contains("OK"));
    let port = server.port;
    rotation(&server, None, "old-pass", "new-pass", |file| {
        let cli = |pass: &str, args: &[&str]| cli_as(port, pass, args);
        assert!(cli("old-pass", &["CONFIG", "SET", "requirepass", "new-pass"]).contains("OK"));
        rotate(file, "new-pass");
        // every connection of the old password goes (as a restart or a
        // failover would drop them); they come back with the new one
        let killed = cli("new-pass", &["CLIENT", "KILL", "TYPE", "normal"]);
        assert!(
            killed.trim().parse::<u32>().is_ok_and(|n| n >= 1),
            "the service's connections dropped: {killed}"
        );
    })
    .await;
}

#[tokio::test]
async fn an_acl_users_rotated_password_is_read_from_the_file() {
    let server = RedisServer::standalone();
    assert!(server
        .cli(&["ACL", "SETUSER", "rls", "on", ">first", "~*", "+@all"])
        .contains("OK"));
    rotation(&server, Some("rls"), "first", "second", |file| {
        // a Secret's rotation: the new password added, the file replaced,
        // then the old password removed and its connections dropped
        assert!(server
            .cli(&["ACL", "SETUSER", "rls", ">second"])
            .contains("OK"));
        rotate(file, "second");
        assert!(server
            .cli(&["ACL", "SETUSER", "rls", "<first"])
            .contains("OK"));
        let killed = server.cli(&["CLIENT", "KILL", "USER", "rls"]);
        assert!(
            killed.trim().parse::<u32>().is_ok_and(|n| n >= 1),
            "the service's connections dropped: {killed}"
        );
    })
    .await;
}

/// On a Redis Cluster (3 primaries, 3 replicas): an ACL user's password
/// rotated on every node as a Secret's rotation does; the topology client
/// and each primary's connections authenticate again from the file, and
/// every admitted decision is counted once.
#[tokio::test]
async fn a_rotated_password_on_a_redis_cluster_is_read_from_the_file() {
    let cluster = RedisCluster::start();
    let all =
        |args: &[&str]| -> Vec<String> { cluster.nodes.iter().map(|n| n.cli(args)).collect() };
    for out in all(&["ACL", "SETUSER", "rls", "on", ">first", "~*", "+@all"]) {
        assert!(out.contains("OK"), "{out}");
    }
    let hosts: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let url = format!("redis-cluster://rls@{}", hosts.join(","));
    let read = format!("redis-cluster://rls:second@{}", hosts.join(","));
    rotation_at(&url, &read, "first", |file| {
        for out in all(&["ACL", "SETUSER", "rls", ">second"]) {
            assert!(out.contains("OK"), "{out}");
        }
        rotate(file, "second");
        for out in all(&["ACL", "SETUSER", "rls", "<first"]) {
            assert!(out.contains("OK"), "{out}");
        }
        let killed: u32 = all(&["CLIENT", "KILL", "USER", "rls"])
            .iter()
            .map(|k| k.trim().parse::<u32>().unwrap_or(0))
            .sum();
        assert!(killed >= 3, "the service's connections dropped: {killed}");
    })
    .await;
}

/// The file and a password in the URL, or a file that holds none, stop
/// the start naming the file, never its content.
#[tokio::test]
async fn a_password_file_beside_a_password_or_empty_stops_the_start() {
    let server = RedisServer::standalone();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("redis-password");
    std::fs::write(&file, "in-the-file\n").expect("write");
    let rules = rules_dir(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requests_per_unit: 1}\n",
    );
    let start = |url: String| {
        let mut args = serve_args(rules.path().to_path_buf());
        args.store = tokenbucket_rls::cli::StoreKind::Redis;
        args.redis_url = Some(url);
        args.redis_password_file = Some(file.clone());
        async move {
            match tokenbucket_rls::server::start(&args).await {
                Ok(_) => panic!("must not start"),
                Err(e) => format!("{e:#}"),
            }
        }
    };
    let e = start(format!("redis://:in-the-url@127.0.0.1:{}", server.port)).await;
    assert!(
        e.contains("--redis-password-file") && e.contains("give one"),
        "{e}"
    );
    assert!(
        !e.contains("in-the-file") && !e.contains("in-the-url"),
        "{e}"
    );
    std::fs::write(&file, "").expect("write");
    let e = start(format!("redis://127.0.0.1:{}", server.port)).await;
    assert!(
        e.contains("is empty") && e.contains("redis-password"),
        "{e}"
    );
}

/// The per-second Redis (`--redis-persecond-url`) has a password file of
/// its own (`--redis-persecond-password-file`): its password rotates while
/// the main Redis needs none, and per-second decisions go on with the new
/// one, none counted twice (the bucket refills 1 a second, so what is left
/// is the burst less those admitted, plus at most the seconds passed).
#[tokio::test]
async fn the_per_second_redis_rotates_its_own_password_file() {
    let main = RedisServer::standalone();
    let per_second = RedisServer::standalone();
    assert!(per_second
        .cli(&["CONFIG", "SET", "requirepass", "old-pass"])
        .contains("OK"));
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("persecond-password");
    rotate(&file, "old-pass");
    let rules = rules_dir(&format!(
        "domain: d\ndescriptors:\n  - key: k\n    failure_mode: closed\n    rate_limit: {{unit: second, requests_per_unit: 1, burst: {BURST}}}\n"
    ));
    let mut args = serve_args(rules.path().to_path_buf());
    args.store = tokenbucket_rls::cli::StoreKind::Redis;
    args.redis_url = Some(main.url());
    args.redis_persecond_url = Some(per_second.url());
    args.redis_persecond_password_file = Some(file.clone());
    args.redis_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let mut c = client(&s).await;
    let mut admitted = 0u64;
    for _ in 0..20 {
        decided(&mut c)
            .await
            .expect("decided with the first password");
        admitted += 1;
    }
    let cli = |pass: &str, args: &[&str]| cli_as(per_second.port, pass, args);
    assert!(cli("old-pass", &["CONFIG", "SET", "requirepass", "new-pass"]).contains("OK"));
    rotate(&file, "new-pass");
    cli("new-pass", &["CLIENT", "KILL", "TYPE", "normal"]);
    decided_again(&mut c).await;
    admitted += 1;
    for _ in 0..20 {
        decided(&mut c)
            .await
            .expect("decided with the new password");
        admitted += 1;
    }
    let left = tokens(&format!("redis://:new-pass@127.0.0.1:{}", per_second.port)).await;
    let expected = BURST - admitted as f64;
    assert!(
        left >= expected - 0.5 && left <= expected + started.elapsed().as_secs_f64() + 1.0,
        "each per-second decision once: {left} left after {admitted} admitted"
    );
    assert_eq!(
        main.cli(&["DBSIZE"]).trim(),
        "0",
        "nothing in the main Redis"
    );
    s.shutdown().await.expect("stop");
}
