//! `tokenbucket-rls inspect`: the bucket inspector of a running service
//! (its admin port's `/v1/buckets`), and `--reset` (`/v1/buckets/reset`),
//! from a shell. Plain HTTP/1.1 on the admin port (loopback, a port
//! forward): one request, the JSON answer printed.

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
    if let Some(who) = ask.operator {
        request.push_str(&format!(
            "X-Rls-Operator: {}\r\n",
            who.replace(['\r', '\n'], " ")
        ));
    }
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
