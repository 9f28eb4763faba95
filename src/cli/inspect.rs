//! `tokenbucket-rls inspect`: the bucket inspector of a running service
//! (its admin port's `/v1/buckets`), and `--reset` (`/v1/buckets/reset`),
//! from a shell. Plain HTTP/1.1 on the admin port (loopback, a port
//! forward): one request, the JSON answer printed. With `--redis-url` and
//! `--config`, straight against Redis ([`on_redis`]): the same answer, no
//! service needed.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

/// What `inspect` asks.
pub struct Inspect<'a> {
    /// `http://host:port` of the admin port.
    pub admin: &'a str,
    pub domain: &'a str,
    pub descriptor: &'a str,
    pub reset: bool,
    pub token_file: Option<&'a Path>,
    /// Who asks, for the service's log of a reset.
    pub operator: Option<&'a str>,
}

/// `text` percent-encoded for a query string.
fn encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Asks the service; the status and the body, or why it could not.
pub fn run(ask: &Inspect<'_>) -> Result<(u16, String), String> {
    let rest = ask.admin.strip_prefix("http://").ok_or_else(|| {
        format!(
            "--admin {}: give the admin port as http://host:port (https is not served there)",
            ask.admin
        )
    })?;
    let host = rest.trim_end_matches('/');
    if host.contains('/') || host.is_empty() {
        return Err(format!(
            "--admin {}: give http://host:port, no path",
            ask.admin
        ));
    }
    let token = match ask.token_file {
        None => None,
        Some(file) => Some(
            std::fs::read_to_string(file)
                .map_err(|e| format!("--token-file {}: {e}", file.display()))?
                .trim()
                .to_string(),
        ),
    };
    let (method, path) = if ask.reset {
        ("POST", "/v1/buckets/reset")
    } else {
        ("GET", "/v1/buckets")
    };
    let mut request = format!(
        "{method} {path}?domain={}&descriptor={} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: tokenbucket-rls-inspect\r\nConnection: close\r\nContent-Length: 0\r\n",
        encoded(ask.domain),
        encoded(ask.descriptor)
    );
    if let Some(t) = token {
        request.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    // a reset names its operator (the service refuses one that does not):
    // --operator, else the user running this
    let who = ask
        .operator
        .map(str::to_string)
        .or_else(|| std::env::var("USER").ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| "tokenbucket-rls-inspect".into());
    request.push_str(&format!(
        "X-Rls-Operator: {}\r\n",
        who.replace(|c: char| c.is_control(), " ")
    ));
    request.push_str("\r\n");
    let mut stream =
        TcpStream::connect(host).map_err(|e| format!("cannot reach {}: {e}", ask.admin))?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("{}: {e}", ask.admin))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .map_err(|e| format!("{}: {e}", ask.admin))?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{}: not an HTTP answer", ask.admin))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("{}: not an HTTP answer", ask.admin))?;
    Ok((status, body.to_string()))
}

/// What `inspect --redis-url` asks.
pub struct OnRedis<'a> {
    pub redis_url: &'a str,
    pub config: &'a Path,
    pub key_prefix: &'a str,
    pub password_file: Option<&'a Path>,
    pub algorithm: crate::bucket::Algorithm,
    pub domain: &'a str,
    pub descriptor: &'a str,
    pub reset: bool,
    /// Who asks, for the log line of a reset (on standard error).
    pub operator: Option<&'a str>,
}

/// The inspector's answer, or a reset, read from Redis itself with the
/// rules of `--config` (what `/v1/buckets` answers, as a status and JSON);
/// why not, when the rules or Redis cannot be used.
pub async fn on_redis(ask: &OnRedis<'_>) -> Result<(u16, String), String> {
    use std::sync::Arc;

    use crate::limiter::Limiter;
    use crate::rules::{load_path, FailureMode, LoadOptions};
    use crate::store::redis::{BucketLayout, RedisSettings, RedisStore};
    use crate::store::Store;

    let opts = LoadOptions {
        default_algorithm: ask.algorithm,
        ..LoadOptions::default()
    };
    let rules = load_path(ask.config, opts).map_err(|errors| {
        let lines: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        format!("--config {}: {}", ask.config.display(), lines.join("; "))
    })?;
    let entries = crate::limiter::parse_descriptor(ask.descriptor)
        .map_err(|e| format!("--descriptor {}: {e}", ask.descriptor))?;
    if !rules.has_domain(ask.domain) {
        return Ok((404, serde_json::json!({ "error": format!("no domain '{}' in {}", ask.domain, ask.config.display()) }).to_string()));
    }
    let store = RedisStore::connect(&RedisSettings {
        url: ask.redis_url.to_string(),
        timeout: Duration::from_secs(2),
        pool_size: 1,
        serving_threads: 0,
        batch: None,
        ca_file: None,
        client_cert: None,
        layout: BucketLayout::Packed,
        key_prefix: ask.key_prefix.to_string(),
        skip_hostname_verification: false,
        password_file: ask.password_file.map(Path::to_path_buf),
        expiry_jitter_max_secs: 0,
    })
    .await
    .map_err(|e| format!("--redis-url {}: {e}", ask.redis_url))?;
    // a check that Redis cannot answer would be answered by a failure
    // mode: refuse instead
    if !store.reachable() {
        return Err(format!(
            "--redis-url {}: Redis does not answer",
            ask.redis_url
        ));
    }
    let limiter = Limiter::new(Arc::new(store), FailureMode::Closed, 1, Arc::default());
    let borrowed: Vec<(&str, &str)> = entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let Some((rule, buckets)) = limiter.buckets_of(&rules, ask.domain, &borrowed) else {
        return Ok((
            404,
            serde_json::json!({ "error": "no rule with a limit matches this descriptor" })
                .to_string(),
        ));
    };
    if ask.reset {
        let removed = limiter
            .store()
            .forget(&buckets)
            .await
            .map_err(|e| format!("--redis-url {}: {e}", ask.redis_url))?;
        eprintln!(
            "buckets reset by an operator: domain {} rule {} descriptor {} removed {removed} by {}",
            ask.domain,
            rule.label(),
            ask.descriptor,
            ask.operator.unwrap_or("unknown")
        );
        let answer = serde_json::json!({
            "domain": ask.domain,
            "rule": rule.label(),
            "removed": removed,
            "keys": limiter.store().key_names(&buckets),
        });
        return Ok((200, answer.to_string()));
    }
    match limiter
        .inspection(&rules, ask.domain, &entries, &rule, &buckets)
        .await
    {
        Ok(answer) => Ok((
            200,
            serde_json::to_string_pretty(&answer).unwrap_or_default(),
        )),
        Err((status, answer)) => Ok((status, answer.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_encoded_for_a_query() {
        assert_eq!(
            encoded("tenant=acme,user=a b"),
            "tenant%3Dacme%2Cuser%3Da%20b"
        );
    }

    #[test]
    fn the_admin_address_is_http() {
        let ask = |admin| Inspect {
            admin,
            domain: "d",
            descriptor: "k=v",
            reset: false,
            token_file: None,
            operator: None,
        };
        assert!(run(&ask("https://x:1"))
            .unwrap_err()
            .contains("http://host:port"));
        assert!(run(&ask("http://x:1/v1")).unwrap_err().contains("no path"));
    }
}
