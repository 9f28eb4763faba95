//! Redis on a unix socket (#40): `unix:///path` (ours) and
//! envoyproxy/ratelimit's `REDIS_SOCKET_TYPE=unix` with `REDIS_URL` the
//! path, against a real redis-server listening on a socket; and a socket
//! that is not there answered by the failure mode, said at start. And gRPC
//! served on a unix socket (`--grpc-uds`): what is already at its path
//! (tests/envoy_e2e.rs has a real Envoy reaching it).

mod common;

use std::time::Duration;

use common::redis::{free_redis_port, RedisServer};
use common::{client, descriptor, request, rules_dir, serve_args};

const RULES: &str = common::redis::FIVE_A_DAY;

#[tokio::test]
async fn decisions_go_to_a_redis_on_a_unix_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("redis.sock");
    let redis = RedisServer::start(
        free_redis_port(),
        &[
            "--unixsocket",
            socket.to_str().expect("utf-8"),
            "--unixsocketperm",
            "700",
        ],
    );
    common::redis::three_decisions_on(format!("unix://{}", socket.display())).await;
    // the bucket is in that Redis, reached through the socket
    let keys = redis.cli(&["DBSIZE"]);
    assert_eq!(keys.trim(), "1", "{keys}");
}

#[tokio::test]
async fn a_socket_that_is_not_there_is_answered_by_the_failure_mode() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.store = tokenbucket_rls::cli::StoreKind::Redis;
    args.redis_url = Some(format!(
        "unix://{}",
        dir.path().join("nobody.sock").display()
    ));
    args.redis_timeout = Duration::from_millis(200);
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let mut c = client(&s).await;
    let e = c
        .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
        .await
        .expect_err("a closed rule without its store");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    s.shutdown().await.expect("stop");
}

/// The binary started with envoyproxy/ratelimit's environment for a Redis
/// sidecar on a socket.
#[tokio::test]
async fn envoyproxy_ratelimits_unix_socket_settings_reach_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("redis.sock");
    let _redis = RedisServer::start(
        free_redis_port(),
        &["--unixsocket", socket.to_str().expect("utf-8")],
    );
    let rules = tempfile::tempdir().expect("tempdir");
    std::fs::write(rules.path().join("config.yaml"), RULES).expect("write");
    let (_child, mut c) = common::ratelimit_binary(
        rules.path(),
        &[
            ("REDIS_SOCKET_TYPE", "unix".to_string()),
            ("REDIS_URL", socket.display().to_string()),
        ],
    )
    .await;
    let r = c
        .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
        .await
        .expect("decided in Redis over the socket")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 4);
}

/// `--grpc-uds` over what is already at the path: a stale socket is
/// replaced, a live one or a file that is not a socket stops the start
/// naming it, a mode past 777 is refused; the socket goes at shutdown.
#[tokio::test]
async fn grpc_on_a_unix_socket_over_what_is_there() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(RULES);
    let socket = dir.path().join("rls.sock");
    let with = |path: &std::path::Path, mode: u32| {
        let mut args = serve_args(rules.path().to_path_buf());
        args.grpc_uds = Some(path.to_path_buf());
        args.grpc_uds_mode = mode;
        args
    };
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
    let s = tokenbucket_rls::server::start(&with(&socket, 0o600))
        .await
        .expect("a stale socket is replaced");
    let mode = std::fs::metadata(&socket)
        .expect("socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    std::os::unix::net::UnixStream::connect(&socket).expect("listening");
    let second = tokenbucket_rls::server::start(&with(&socket, 0o660)).await;
    let e = format!("{:#}", second.err().expect("a live socket stops the start"));
    assert!(e.contains("another process is listening on it"), "{e}");
    s.shutdown().await.expect("stop");
    assert!(!socket.exists(), "the socket is removed at shutdown");

    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, "keep me").expect("write");
    let e = format!(
        "{:#}",
        tokenbucket_rls::server::start(&with(&file, 0o660))
            .await
            .err()
            .expect("a file that is not a socket stops the start")
    );
    assert!(e.contains("a file that is not a socket is there"), "{e}");
    assert_eq!(std::fs::read_to_string(&file).expect("kept"), "keep me");
}

/// `--grpc-uds` in gRPC's and Envoy's other forms: `unix:PATH` listens on
/// PATH (and removes it at shutdown); `@name` is an abstract socket, a
/// second start on a name in use stops naming it.
#[tokio::test]
async fn grpc_on_a_unix_socket_in_other_forms() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = rules_dir(RULES);
    let with = |uds: String| {
        let mut args = serve_args(rules.path().to_path_buf());
        args.grpc_uds = Some(uds.into());
        args
    };
    let socket = dir.path().join("rls.sock");
    let s = tokenbucket_rls::server::start(&with(format!("unix://{}", socket.display())))
        .await
        .expect("unix:// and an absolute path");
    std::os::unix::net::UnixStream::connect(&socket).expect("listening at the path");
    s.shutdown().await.expect("stop");
    assert!(!socket.exists(), "removed at shutdown");

    let name = format!("tokenbucket-rls-unix-socket-test-{}", std::process::id());
    let s = tokenbucket_rls::server::start(&with(format!("@{name}")))
        .await
        .expect("an abstract socket");
    {
        use std::os::linux::net::SocketAddrExt;
        let address =
            std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("name");
        std::os::unix::net::UnixStream::connect_addr(&address).expect("listening on the name");
    }
    let e = format!(
        "{:#}",
        tokenbucket_rls::server::start(&with(format!("unix-abstract:{name}")))
            .await
            .err()
            .expect("the name is taken")
    );
    assert!(e.contains("another process is listening on it"), "{e}");
    s.shutdown().await.expect("stop");
    let e = format!(
        "{:#}",
        tokenbucket_rls::server::start(&with("unix://relative.sock".into()))
            .await
            .err()
            .expect("unix:// needs an absolute path")
    );
    assert!(e.contains("followed by an absolute path"), "{e}");
}
