//! Redis URLs as the docs/run.md spells them, turned into fred's configuration.
//!
//! Ours: `redis://`, `rediss://` (one server) and `redis-cluster://h1:p1,h2:p2`,
//! `rediss-cluster://…` (seed nodes of a cluster), with `user:password@`
//! allowed. fred lists extra cluster seeds as `?node=h:p` parameters instead.
//! And a server on a unix socket: `unix:///path/to/redis.sock` (or
//! `redis+unix://`), with `user:password@` before the path. And a primary
//! found through Redis Sentinel: `redis-sentinel://h1:p1,h2:p2/master-name`
//! (`rediss-sentinel://` for TLS to the sentinels and the servers), with
//! `user:password@` for the servers and `?sentinel_password=…` (and
//! `sentinel_username=…`) for the sentinels.
//!
//! A database other than 0: `redis://host:port/3` (fred reads it),
//! `unix:///path?db=3`, `redis-sentinel://…/master?db=3`; every connection
//! selects it. A Redis Cluster has only database 0, so a cluster URL naming
//! another is refused.

use std::path::PathBuf;

use fred::types::config::{Config, ServerConfig};

/// A host as a socket is opened to it: an IPv6 literal without the
/// brackets a URL writes it in (`[::1]` is `::1`; fred keeps the brackets,
/// which its own resolver needs, and a name lookup of `[::1]` fails:
/// issue 52, `redis://[::1]:6391/2` never connected).
pub fn socket_host(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Parses a Redis URL into fred's configuration; errors say what is wrong.
pub fn parse(url: &str) -> Result<Config, String> {
    const SCHEMES: &str =
        "redis, rediss, redis-cluster, rediss-cluster, redis-sentinel, rediss-sentinel or unix";
    let (scheme, rest) = url.split_once("://").ok_or_else(|| {
        format!(
            "'{}' is not a Redis URL (expected {SCHEMES}://…)",
            redact(url)
        )
    })?;
    if scheme != "unix" && scheme != "redis+unix" {
        unescaped_credentials(url, rest)?;
    }
    match scheme {
        "redis" | "rediss" => single(url, scheme, rest),
        "redis-cluster" | "rediss-cluster" => cluster(url, scheme, rest),
        "redis-sentinel" | "rediss-sentinel" => sentinel(url, scheme, rest),
        "unix" | "redis+unix" => unix(url, rest),
        other => Err(format!(
            "unsupported Redis URL scheme '{other}' (expected {SCHEMES})"
        )),
    }
}

/// Refuses a user or password holding a character a URL must escape in
/// it (`@`, `/`, `?`, `#`), saying which to escape and never a part of it
/// (issue 52: `redis://:p@ss:w/o%rd#?@host` was refused with "the database
/// 'o%rd#' is not a number", a fragment of the password).
fn unescaped_credentials(url: &str, rest: &str) -> Result<(), String> {
    let Some((credentials, _)) = rest.rsplit_once('@') else {
        return Ok(());
    };
    // an `@` in a parameter's value (`?sentinel_password=a@b`), where a
    // URL may hold one unescaped
    if credentials.contains('=') {
        return Ok(());
    }
    if credentials.contains(['@', '/', '?', '#']) {
        return Err(format!(
            "'{}': the user or password holds a character to escape: write @ as %40, / as %2F, ? as %3F and # as %23",
            redact(url)
        ));
    }
    Ok(())
}

/// `redis[s]://[user:password@]host[:port][/db][?db=N]`: one server.
fn single(url: &str, scheme: &str, rest: &str) -> Result<Config, String> {
    // fred reads the path as the database (said here in our words) and
    // drops any parameter it does not know: only db= is read
    let (before, query) = rest.split_once('?').unwrap_or((rest, ""));
    let hosts = before.rsplit_once('@').map_or(before, |(_, hosts)| hosts);
    let mut db = match hosts.split_once('/') {
        Some((_, db)) => database(db.trim_end_matches('/'), url)?,
        None => None,
    };
    for (_, value) in params(query, &["db"], url)? {
        db = one_database(db, value, url)?;
    }
    let mut config = Config::from_url(&format!("{scheme}://{before}"))
        .map_err(|e| format!("invalid Redis URL '{}': {e}", redact(url)))?;
    config.database = db;
    Ok(config)
}

/// `redis[s]-cluster://[user:password@]h1:p1,h2:p2[/0][?node=h3:p3]`: the
/// seed nodes of a cluster.
fn cluster(url: &str, scheme: &str, rest: &str) -> Result<Config, String> {
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), rest),
    };
    let (hosts, query) = match hosts.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (hosts, None),
    };
    let hosts = match hosts.split_once('/') {
        None => hosts,
        Some((hosts, db)) => match database(db.trim_end_matches('/'), url)? {
            None | Some(0) => hosts,
            Some(n) => {
                return Err(format!(
                    "'{}' names database {n}: a Redis Cluster has only database 0",
                    redact(url)
                ))
            }
        },
    };
    let mut seeds = hosts.split(',').map(str::trim).filter(|h| !h.is_empty());
    let first = seeds
        .next()
        .ok_or_else(|| format!("'{}' names no cluster node", redact(url)))?;
    let mut nodes: Vec<String> = seeds.map(|h| format!("node={h}")).collect();
    // fred's own form of more seeds, kept; anything else refused
    for (_, node) in params(query.unwrap_or(""), &["node"], url)? {
        nodes.push(format!("node={node}"));
    }
    let bracketed = nodes.iter().any(|n| n.contains('['));
    let fred_url = if nodes.is_empty() || bracketed {
        format!("{scheme}://{auth}{first}")
    } else {
        format!("{scheme}://{auth}{first}?{}", nodes.join("&"))
    };
    let mut config = Config::from_url(&fred_url)
        .map_err(|e| format!("invalid Redis URL '{}': {e}", redact(url)))?;
    if bracketed {
        // fred reads a `node=` seed as host:port split at its one colon:
        // an IPv6 literal ([::1]:7001) is read here instead
        if let ServerConfig::Clustered { hosts, .. } = &mut config.server {
            for node in &nodes {
                let seed = node.trim_start_matches("node=");
                let (host, port) = seed
                    .rsplit_once(':')
                    .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
                    .filter(|(h, _)| !h.is_empty())
                    .ok_or_else(|| {
                        format!(
                            "'{}': the cluster node '{seed}' is not host:port",
                            redact(url)
                        )
                    })?;
                hosts.push(fred::types::config::Server::new(host, port));
            }
        }
    }
    Ok(config)
}

/// `unix://[user:password@]/path`: one server on a unix socket.
fn unix(url: &str, rest: &str) -> Result<Config, String> {
    let (auth, path) = match rest.split_once('@') {
        Some((auth, path)) => (Some(auth), path),
        None => (None, rest),
    };
    if !path.starts_with('/') {
        return Err(format!(
            "'{}': a unix socket URL names an absolute path, e.g. unix:///var/run/redis/redis.sock",
            redact(url)
        ));
    }
    let (path, db) = match path.split_once('?') {
        None => (path, None),
        Some((path, query)) => match query.strip_prefix("db=") {
            Some(db) if !db.contains('&') => (path, database(db, url)?),
            _ => {
                return Err(format!(
                    "'{}': a unix socket URL takes one parameter, db=N (the database)",
                    redact(url)
                ))
            }
        },
    };
    let (username, password) = match auth {
        None => (None, None),
        Some(auth) => {
            let (user, password) = auth.split_once(':').unwrap_or(("", auth));
            let decode = |s: &str| {
                urlencoding_decode(s)
                    .ok_or_else(|| format!("'{}': a badly escaped user or password", redact(url)))
            };
            (
                (!user.is_empty()).then(|| decode(user)).transpose()?,
                Some(decode(password)?),
            )
        }
    };
    Ok(Config {
        server: ServerConfig::Unix {
            path: PathBuf::from(path),
        },
        username,
        password,
        database: db,
        ..Config::default()
    })
}

/// The `name=value` pairs of `query`, each name one of `known`; any other
/// stops the start naming it (fred would drop it without a word).
fn params<'q>(
    query: &'q str,
    known: &[&str],
    url: &str,
) -> Result<Vec<(&'q str, &'q str)>, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if known.contains(&name) {
                Ok((name, value))
            } else {
                Err(format!(
                    "'{}': unknown parameter '{name}' (this URL takes {})",
                    redact(url),
                    known.join(", ")
                ))
            }
        })
        .collect()
}

/// The database of a URL whose path named `path` and whose `db=` says
/// `value`: one, or a refusal when the two differ.
fn one_database(path: Option<u8>, value: &str, url: &str) -> Result<Option<u8>, String> {
    let asked = database(value, url)?;
    if path.is_some_and(|d| Some(d) != asked) {
        return Err(format!(
            "'{}' names two databases, in its path and in db=",
            redact(url)
        ));
    }
    Ok(asked)
}

/// The database a URL names (`""` when it names none); errors name it.
fn database(text: &str, url: &str) -> Result<Option<u8>, String> {
    if text.is_empty() {
        return Ok(None);
    }
    text.parse::<u8>().map(Some).map_err(|_| {
        format!(
            "'{}': the database '{text}' is not a number from 0 to 255",
            redact(url)
        )
    })
}

/// The port a sentinel listens on when a URL names none.
const SENTINEL_PORT: u16 = 26379;

/// `redis-sentinel://[user:password@]h1:p1[,h2:p2…]/master-name[?sentinel_password=…&sentinel_username=…]`:
/// the sentinels to ask and the master's name; the credentials before `@`
/// are the servers', those in the parameters the sentinels'.
fn sentinel(url: &str, scheme: &str, rest: &str) -> Result<Config, String> {
    let shown = redact(url);
    // Lettuce's form names the master last, `…/db#master`
    let (rest, fragment) = match rest.rsplit_once('#') {
        Some((r, f)) => (r, Some(f)),
        None => (rest, None),
    };
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    let (auth, rest) = match rest.rsplit_once('@') {
        Some((auth, rest)) => (Some(auth), rest),
        None => (None, rest),
    };
    let no_master =
        || format!("'{shown}' names no master: redis-sentinel://host:port,host:port/master-name");
    let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (master, path_db) = match fragment {
        None if path.is_empty() => return Err(no_master()),
        None => (path, None),
        Some(master) => (master, database(path.trim_end_matches('/'), url)?),
    };
    let master = urlencoding_decode(master.trim_end_matches('/'))
        .filter(|m| !m.is_empty() && !m.contains(['/', '?']))
        .ok_or_else(no_master)?;
    let mut sentinels = Vec::new();
    for host in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
        // no port: Sentinel's own, as redis:// defaults to 6379
        let (name, port) = match host.rsplit_once(':') {
            Some((h, p)) if !host.ends_with(']') => (h, p.parse::<u16>().ok().filter(|p| *p > 0)),
            _ => (host, Some(SENTINEL_PORT)),
        };
        let port = port
            .filter(|_| !name.is_empty())
            .ok_or_else(|| format!("'{shown}': the sentinel '{host}' is not host:port"))?;
        sentinels.push((
            name.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port,
        ));
    }
    if sentinels.is_empty() {
        return Err(format!("'{shown}' names no sentinel"));
    }
    let decode = |s: &str| {
        urlencoding_decode(s).ok_or_else(|| format!("'{shown}': a badly escaped user or password"))
    };
    let (username, password) = match auth {
        None => (None, None),
        Some(auth) => {
            let (user, password) = auth.split_once(':').unwrap_or(("", auth));
            (
                (!user.is_empty()).then(|| decode(user)).transpose()?,
                Some(decode(password)?),
            )
        }
    };
    let (mut sentinel_username, mut sentinel_password, mut db) = (None, None, path_db);
    let known = ["sentinel_password", "sentinel_username", "db"];
    for (name, value) in params(query.unwrap_or(""), &known, url)? {
        match name {
            "sentinel_password" => sentinel_password = Some(decode(value)?),
            "sentinel_username" => sentinel_username = Some(decode(value)?),
            _ => db = one_database(db, value, url)?,
        }
    }
    if sentinel_username.is_some() && sentinel_password.is_none() {
        return Err(format!(
            "'{shown}': sentinel_username without sentinel_password"
        ));
    }
    let tls = if scheme == "rediss-sentinel" {
        Some(
            fred::types::config::TlsConnector::default_rustls()
                .map_err(|e| format!("'{shown}': cannot set up TLS: {e}"))?
                .into(),
        )
    } else {
        None
    };
    let mut server = ServerConfig::new_sentinel(sentinels, master);
    if let ServerConfig::Sentinel {
        username: su,
        password: sp,
        ..
    } = &mut server
    {
        (*su, *sp) = (sentinel_username, sentinel_password);
    }
    Ok(Config {
        server,
        username,
        password,
        tls,
        database: db,
        ..Config::default()
    })
}

/// `%XX` escapes decoded (a user or password in a URL); `None` for a bad
/// escape or bytes that are not UTF-8.
fn urlencoding_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The URL with any password replaced, for messages and logs.
pub fn redact(url: &str) -> String {
    // a sentinel URL's own password, a parameter
    if let Some((head, query)) = url.split_once('?') {
        if query.contains("sentinel_password=") {
            let query: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some(("sentinel_password", _)) => "sentinel_password=***".to_string(),
                    _ => p.to_string(),
                })
                .collect();
            return format!("{}?{}", redact(head), query.join("&"));
        }
    }
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
    fn unix_socket_urls_name_a_path() {
        let c = parse("unix:///var/run/redis/redis.sock").expect("valid");
        match &c.server {
            ServerConfig::Unix { path } => {
                assert_eq!(path, &PathBuf::from("/var/run/redis/redis.sock"))
            }
            other => panic!("unix, got {other:?}"),
        }
        assert_eq!((c.username, c.password), (None, None));
        let c = parse("redis+unix://user:p%40ss@/tmp/r.sock").expect("valid");
        assert_eq!(
            (c.username.as_deref(), c.password.as_deref()),
            (Some("user"), Some("p@ss"))
        );
        let c = parse("unix://:secret@/tmp/r.sock").expect("valid");
        assert_eq!((c.username, c.password.as_deref()), (None, Some("secret")));
        let e = parse("unix://tmp/r.sock").expect_err("relative");
        assert!(e.contains("absolute path"), "{e}");
        let e = parse("unix:///tmp/r.sock?timeout=2").expect_err("parameters");
        assert!(e.contains("one parameter, db=N"), "{e}");
    }

    #[test]
    fn sentinels_without_a_port_and_lettuces_form() {
        let sentinels = |url: &str| match parse(url).map(|c| (c.server, c.database)) {
            Ok((
                ServerConfig::Sentinel {
                    hosts,
                    service_name,
                    ..
                },
                db,
            )) => (
                hosts
                    .iter()
                    .map(|h| format!("{}:{}", h.host, h.port))
                    .collect::<Vec<_>>(),
                service_name,
                db,
            ),
            other => panic!("{url}: {other:?}"),
        };
        assert_eq!(
            sentinels("redis-sentinel://s0,s1:26380,[::1]/mymaster"),
            (
                vec!["s0:26379".into(), "s1:26380".into(), "::1:26379".into()],
                "mymaster".to_string(),
                None
            )
        );
        assert_eq!(
            sentinels("redis-sentinel://pw@s0,s1/2#mymaster"),
            (
                vec!["s0:26379".into(), "s1:26379".into()],
                "mymaster".to_string(),
                Some(2)
            )
        );
        assert_eq!(
            sentinels("redis-sentinel://s0:1?db=4#m"),
            (vec!["s0:1".into()], "m".to_string(), Some(4))
        );
    }

    #[test]
    fn a_database_is_read_where_each_form_puts_it() {
        let db = |url: &str| parse(url).map(|c| c.database);
        assert_eq!(db("redis://127.0.0.1:6379/3"), Ok(Some(3)));
        assert_eq!(db("rediss://u:p@h:6379/0"), Ok(Some(0)));
        assert_eq!(db("redis://h:6379/"), Ok(None));
        assert_eq!(db("redis://h:6379"), Ok(None));
        assert_eq!(db("unix:///tmp/r.sock?db=2"), Ok(Some(2)));
        assert_eq!(db("unix://:pw@/tmp/r.sock?db=15"), Ok(Some(15)));
        assert_eq!(db("redis-sentinel://h:26379/m?db=4"), Ok(Some(4)));
        assert_eq!(
            db("redis-sentinel://h:26379/m?sentinel_password=s&db=5"),
            Ok(Some(5))
        );
        assert_eq!(db("redis-cluster://h:7000,h:7001/0"), Ok(None));
        assert_eq!(db("redis://h:6379?db=3"), Ok(Some(3)));
        assert_eq!(db("redis://u:p@h:6379/3?db=3"), Ok(Some(3)));
        for (url, said) in [
            ("redis://h:6379/x", "the database 'x' is not a number"),
            ("redis://u:pw@h:6379/256", "the database '256'"),
            ("unix:///tmp/r.sock?db=-1", "the database '-1'"),
            ("unix:///tmp/r.sock?db=1&x=2", "one parameter, db=N"),
            ("redis-sentinel://h:1/m?db=zero", "the database 'zero'"),
            (
                "redis-cluster://h:7000/3",
                "names database 3: a Redis Cluster has only database 0",
            ),
            ("redis-cluster://h:7000,h:7001/2?x=1", "names database 2"),
            (
                "redis-cluster://u:hunter2@h:7000/9",
                "'redis-cluster://u:***@h:7000/9'",
            ),
            ("redis://h:6379/1?db=2", "names two databases"),
            (
                "redis://u:hunter2@h:6379?timeout=5",
                "unknown parameter 'timeout' (this URL takes db)",
            ),
            (
                "rediss://h:6379?sentinelServiceName=m",
                "unknown parameter 'sentinelServiceName'",
            ),
            (
                "redis-cluster://h:7000?db=0",
                "unknown parameter 'db' (this URL takes node)",
            ),
        ] {
            let e = db(url).expect_err(url);
            assert!(e.contains(said), "{url}: {e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn an_unescaped_password_is_refused_without_a_fragment_of_it() {
        for url in [
            "redis://:p@ss:w/o%rd#?@host",
            "redis://user:se/cret@host:6379",
            "rediss://:a?b@host",
            "redis-cluster://:x#y@h1:7000,h2:7000",
            "redis-sentinel://:p@w@s1:26379/mymaster",
        ] {
            let e = parse(url).expect_err(url);
            assert!(e.contains("%40"), "{url}: {e}");
            for fragment in ["ss:w", "o%rd", "se/cret", "cret", "a?b", "x#y", "p@w"] {
                assert!(!e.contains(fragment), "{url}: {e}");
            }
        }
        // escaped, it is a password like any other
        let c = parse("redis://:p%40ss%3Aw%2Fo%25rd%23%3F@host:6379").expect("escaped");
        assert_eq!(c.password.as_deref(), Some("p@ss:w/o%rd#?"));
        // an @ in a parameter's value is no password
        parse("redis-sentinel://s1:26379/mymaster?sentinel_password=a@b").expect("a parameter");
    }

    #[test]
    fn ipv6_literal_seeds_are_read_with_their_brackets() {
        let c = parse("redis-cluster://[::1]:7000,[::1]:7001?node=[::1]:7002").expect("valid");
        match &c.server {
            ServerConfig::Clustered { hosts, .. } => {
                let seeds: Vec<String> = hosts
                    .iter()
                    .map(|h| format!("{}:{}", h.host, h.port))
                    .collect();
                assert_eq!(seeds, ["[::1]:7000", "[::1]:7001", "[::1]:7002"]);
            }
            other => panic!("clustered, got {other:?}"),
        }
        assert_eq!(socket_host("[::1]"), "::1");
        assert_eq!(socket_host("redis.internal"), "redis.internal");
        let e = parse("redis-cluster://[::1]:7000,[::1]").expect_err("no port");
        assert!(e.contains("not host:port"), "{e}");
    }

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
        let c = parse("redis-cluster://127.0.0.1:7000,127.0.0.1:7001?node=127.0.0.1:7002")
            .expect("fred's node= form too");
        match &c.server {
            ServerConfig::Clustered { hosts, .. } => assert_eq!(hosts.len(), 3),
            other => panic!("clustered, got {other:?}"),
        }
        let single = parse("redis-cluster://127.0.0.1:7000").expect("valid");
        assert!(single.server.is_clustered());
    }

    #[test]
    fn sentinel_urls_name_the_sentinels_and_the_master() {
        let c = parse("redis-sentinel://u:p%40ss@127.0.0.1:26379,[::1]:26380/my%20master?sentinel_password=s3&sentinel_username=watch")
            .expect("valid");
        match &c.server {
            ServerConfig::Sentinel {
                hosts,
                service_name,
                username,
                password,
            } => {
                let hosts: Vec<(String, u16)> =
                    hosts.iter().map(|h| (h.host.to_string(), h.port)).collect();
                assert_eq!(
                    hosts,
                    [("127.0.0.1".to_string(), 26379), ("::1".to_string(), 26380)]
                );
                assert_eq!(service_name, "my master");
                assert_eq!(
                    (username.as_deref(), password.as_deref()),
                    (Some("watch"), Some("s3"))
                );
            }
            other => panic!("sentinel, got {other:?}"),
        }
        assert_eq!(
            (c.username.as_deref(), c.password.as_deref()),
            (Some("u"), Some("p@ss"))
        );
        assert!(c.tls.is_none());
        assert!(parse("rediss-sentinel://h:26379/m")
            .expect("valid")
            .tls
            .is_some());
        for (bad, says) in [
            ("redis-sentinel://h:26379", "names no master"),
            ("redis-sentinel://h:26379/", "names no master"),
            ("redis-sentinel:///m", "names no sentinel"),
            ("redis-sentinel://h:x/m", "is not host:port"),
            ("redis-sentinel://:1/m", "is not host:port"),
            ("redis-sentinel://h:1/2#m?db=3", "names no master"),
            ("redis-sentinel://h:1/2?db=3#m", "names two databases"),
            ("redis-sentinel://h:1/x#m", "the database 'x'"),
            ("redis-sentinel://h:1#", "names no master"),
            ("redis-sentinel://h:0/m", "is not host:port"),
            (
                "redis-sentinel://h:1/m?timeout=2",
                "unknown parameter 'timeout'",
            ),
            (
                "redis-sentinel://h:1/m?sentinel_username=x",
                "without sentinel_password",
            ),
        ] {
            let e = parse(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
        let shown = redact("redis-sentinel://u:hunter2@h:1/m?sentinel_password=hunter3");
        assert!(!shown.contains("hunter"), "{shown}");
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

    mod any_input {
        use super::super::{parse, redact};
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Whatever a user writes, an answer and no panic; a password
            /// never shows in a refusal.
            #[test]
            fn any_url_is_read_or_refused(
                scheme in prop::sample::select(vec![
                    "redis", "rediss", "redis-cluster", "rediss-cluster",
                    "redis-sentinel", "rediss-sentinel", "unix", "redis+unix", "http",
                ]),
                rest in "[a-z0-9:@/?&=#%,\\[\\].é_-]{0,40}",
            ) {
                let url = format!("{scheme}://u:hunter2@{rest}");
                if let Err(e) = parse(&url) {
                    prop_assert!(!e.contains("hunter2"), "{e}");
                }
                let _ = parse(&rest);
                let _ = redact(&rest);
            }
        }
    }
}
