use super::*;
use fred::types::config::ServerConfig;

/// Every URL form the service takes reaches the pipes (else decisions
/// would quietly fall back to fred's connections).
#[test]
fn every_url_form_has_a_target() {
    let centralized = |url: &str| {
        let mut config = crate::store::redis::url::parse(url).expect("url");
        if let ServerConfig::Clustered { hosts, .. } = &config.server {
            config.server = ServerConfig::Centralized {
                server: hosts[0].clone(),
            };
        }
        config
    };
    for url in [
        "redis://127.0.0.1:6379",
        "redis://:secret@127.0.0.1:6379",
        "redis://user:secret@127.0.0.1:6379",
        "rediss://redis.example:6380",
        "redis-cluster://127.0.0.1:7000,127.0.0.1:7001",
        "rediss-cluster://u:p@127.0.0.1:7000",
        "unix:///tmp/redis.sock",
        "unix://u:secret@/tmp/redis.sock",
    ] {
        let target = Target::of(&centralized(url), Duration::from_millis(250))
            .unwrap_or_else(|| panic!("{url}: no target"));
        assert_eq!(target.tls.is_some(), url.starts_with("rediss"), "{url}");
        assert_eq!(target.unix.is_some(), url.starts_with("unix"), "{url}");
        assert_eq!(target.password.is_some(), url.contains('@'), "{url}");
    }
    let t = Target::of(
        &centralized("redis://user:secret@127.0.0.1:6379"),
        Duration::ZERO,
    )
    .expect("target");
    assert_eq!(
        (t.username.as_deref(), t.password.as_deref()),
        (Some("user"), Some("secret"))
    );
}
