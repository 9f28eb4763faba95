//! Whether the Redis servers answer at start-up, said in words: a name
//! that does not resolve, a port that refuses, a server that does not
//! answer (so the start neither waits seconds for a connection that cannot
//! come nor blames a later command), and how the first connection went.

use std::time::Duration;

use fred::types::config::ServerConfig;

/// Whether any server of `server` takes a TCP connection within a second;
/// else why not, in words: its name does not resolve, it refuses, or it
/// does not answer.
pub async fn reach(server: &ServerConfig) -> Result<(), String> {
    let servers: Vec<(String, u16)> = match server {
        ServerConfig::Centralized { server } => vec![(server.host.to_string(), server.port)],
        ServerConfig::Clustered { hosts, .. } => {
            hosts.iter().map(|h| (h.host.to_string(), h.port)).collect()
        }
        ServerConfig::Unix { path } => return reach_socket(path).await,
        // the sentinels: whether any answers
        ServerConfig::Sentinel { hosts, .. } => {
            hosts.iter().map(|h| (h.host.to_string(), h.port)).collect()
        }
    };
    let mut why = Vec::new();
    for (host, port) in servers {
        let addrs = match tokio::net::lookup_host((super::url::socket_host(&host), port)).await {
            Ok(addrs) => addrs.collect::<Vec<_>>(),
            Err(e) => {
                why.push(format!("{host}:{port}: the name does not resolve ({e})"));
                continue;
            }
        };
        for addr in addrs {
            match tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr))
                .await
            {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    why.push(format!("{host}:{port} ({addr}) refused the connection"))
                }
                Ok(Err(e)) => why.push(format!("{host}:{port} ({addr}): {e}")),
                Err(_) => why.push(format!("{host}:{port} ({addr}) did not answer within 1 s")),
            }
        }
    }
    Err(why.join("; "))
}

/// Whether the unix socket at `path` takes a connection within a second;
/// else why not: no such file, not a socket, nobody listening.
async fn reach_socket(path: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::FileTypeExt;
    let shown = path.display();
    match std::fs::metadata(path) {
        Err(e) => return Err(format!("{shown}: {e}")),
        Ok(m) if !m.file_type().is_socket() => return Err(format!("{shown} is not a unix socket")),
        Ok(_) => {}
    }
    match tokio::time::timeout(
        Duration::from_secs(1),
        tokio::net::UnixStream::connect(path),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("{shown}: {e}")),
        Err(_) => Err(format!("{shown} did not answer within 1 s")),
    }
}

pub fn log_connect<E: std::fmt::Display>(
    url: &str,
    connected: Result<Result<(), E>, tokio::time::error::Elapsed>,
) {
    match connected {
        Ok(Ok(())) => tracing::info!(url = %url, "connected to Redis"),
        Ok(Err(e)) => {
            tracing::warn!(url = %url, error = %e, "Redis not reachable at start-up; failure policies answer until it is")
        }
        Err(_) => {
            tracing::warn!(url = %url, "Redis not reachable within 5 s at start-up; failure policies answer until it is")
        }
    }
}
