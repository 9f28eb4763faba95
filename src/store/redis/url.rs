//! Redis URLs as the docs/run.md spells them, turned into fred's configuration.
//!
//! Ours: `redis://`, `rediss://` (one server) and `redis-cluster://h1:p1,h2:p2`,
//! `rediss-cluster://…` (seed nodes of a cluster), with `user:password@`
//! allowed. fred lists extra cluster seeds as `?node=h:p` parameters instead.

use fred::types::config::Config;

/// Parses a Redis URL into fred's configuration; errors say what is wrong.
pub fn parse(url: &str) -> Result<Config, String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| format!("'{}' is not a Redis URL (expected redis://, rediss://, redis-cluster:// or rediss-cluster://)", redact(url)))?;
    let fred_url = match scheme {
        "redis" | "rediss" => url.to_string(),
        "redis-cluster" | "rediss-cluster" => {
            let (auth, hosts) = match rest.rsplit_once('@') {
                Some((auth, hosts)) => (format!("{auth}@"), hosts),
                None => (String::new(), rest),
            };
            let (hosts, query) = match hosts.split_once('?') {
                Some((h, q)) => (h, Some(q)),
                None => (hosts, None),
            };
            let hosts = hosts.trim_end_matches('/');
            let mut seeds = hosts.split(',').map(str::trim).filter(|h| !h.is_empty());
            let first = seeds
                .next()
                .ok_or_else(|| format!("'{}' names no cluster node", redact(url)))?;
            let mut params: Vec<String> = seeds.map(|h| format!("node={h}")).collect();
            if let Some(q) = query {
                params.push(q.to_string());
            }
            if params.is_empty() {
                format!("{scheme}://{auth}{first}")
            } else {
                format!("{scheme}://{auth}{first}?{}", params.join("&"))
            }
        }
        other => {
            return Err(format!(
                "unsupported Redis URL scheme '{other}' (expected redis, rediss, redis-cluster or rediss-cluster)"
            ))
        }
    };
    Config::from_url(&fred_url).map_err(|e| format!("invalid Redis URL '{}': {e}", redact(url)))
}

/// The URL with any password replaced, for messages and logs.
pub fn redact(url: &str) -> String {
    match (url.split_once("://"), url.rfind('@')) {
        (Some((scheme, rest)), Some(_)) => {
            let (auth, hosts) = rest.rsplit_once('@').unwrap_or(("", rest));
            let user = auth.split_once(':').map_or(auth, |(u, _)| u);
            format!("{scheme}://{user}:***@{hosts}")
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fred::types::config::ServerConfig;

    #[test]
    fn cluster_seed_lists_become_fred_nodes() {
        let c = parse("redis-cluster://u:p@127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002")
            .expect("valid");
        match &c.server {
            ServerConfig::Clustered { hosts, .. } => assert_eq!(hosts.len(), 3),
            other => panic!("clustered, got {other:?}"),
        }
        assert_eq!(c.username.as_deref(), Some("u"));
        assert_eq!(c.password.as_deref(), Some("p"));
        let single = parse("redis-cluster://127.0.0.1:7000").expect("valid");
        assert!(single.server.is_clustered());
    }

    #[test]
    fn standalone_urls_pass_through() {
        let c = parse("redis://rls:secret@127.0.0.1:6390").expect("valid");
        assert!(!c.server.is_clustered());
        assert_eq!(c.username.as_deref(), Some("rls"));
    }

    #[test]
    fn bad_urls_are_explained_without_the_password() {
        let e = parse("http://u:hunter2@h:1").expect_err("bad scheme");
        assert!(e.contains("unsupported Redis URL scheme 'http'"), "{e}");
        let e = parse("hunter2").expect_err("no scheme");
        assert!(!e.contains("hunter2@"), "{e}");
        let e = parse("redis-cluster://u:hunter2@").expect_err("no hosts");
        assert!(!e.contains("hunter2"), "{e}");
    }
}
