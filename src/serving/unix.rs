//! gRPC on a unix socket (`--grpc-uds`): where it listens (a file, or a
//! Linux abstract name, in the forms gRPC, Envoy and Go write them), the
//! listener over what is already at the path, and its connections for
//! tonic. Served on the main runtime, not the serving threads.
//!
//! **Layer:** part of `serving`.

use anyhow::{Context, Result};

/// Where `--grpc-uds` listens: a file, or a name in Linux's abstract
/// namespace (no file, no permissions: any process in the network
/// namespace may connect, as Envoy's and Go's `@name`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UdsAddress {
    Path(std::path::PathBuf),
    Abstract(String),
}

impl UdsAddress {
    /// `PATH`, gRPC's `unix:PATH` and `unix:///ABSOLUTE_PATH`, or an
    /// abstract name: `@NAME` (Envoy's `pipe` path and Go's) or gRPC's
    /// `unix-abstract:NAME`. Errors name the argument.
    pub fn parse(arg: &std::path::Path) -> Result<Self> {
        let Some(text) = arg.to_str() else {
            return Ok(Self::Path(arg.to_path_buf()));
        };
        let empty = || anyhow::anyhow!("--grpc-uds {text:?}: names no socket");
        if let Some(name) = text.strip_prefix("unix-abstract:") {
            return (!name.is_empty())
                .then(|| Self::Abstract(name.to_string()))
                .ok_or_else(empty);
        }
        let path = match text.strip_prefix("unix://") {
            Some(path) if !path.starts_with('/') => anyhow::bail!(
                "--grpc-uds {text:?}: unix:// is followed by an absolute path (unix:///var/run/rls.sock), or write unix:{path}"
            ),
            Some(path) => path,
            None => text.strip_prefix("unix:").unwrap_or(text),
        };
        match path.strip_prefix('@') {
            Some("") => Err(empty()),
            Some(name) => Ok(Self::Abstract(name.to_string())),
            None if path.is_empty() => Err(empty()),
            None => Ok(Self::Path(path.into())),
        }
    }
}

impl std::fmt::Display for UdsAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Path(path) => write!(f, "{}", path.display()),
            Self::Abstract(name) => write!(f, "@{name}"),
        }
    }
}

/// `--grpc-uds`: a unix socket at `address`; a file gets permissions
/// `mode`. A socket file nobody listens on (left by a process that was
/// killed) is replaced; a live one, or a file that is not a socket, stops
/// the start. An abstract name in use stops the start.
pub fn bind_unix(address: &UdsAddress, mode: u32) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let path = match address {
        UdsAddress::Path(path) => path,
        UdsAddress::Abstract(name) => return bind_abstract(name),
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            anyhow::bail!(
                "--grpc-uds {}: a file that is not a socket is there; remove it or choose another path",
                path.display()
            );
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!(
                "--grpc-uds {}: another process is listening on it",
                path.display()
            );
        }
        std::fs::remove_file(path).with_context(|| {
            format!(
                "--grpc-uds {}: cannot remove the stale socket",
                path.display()
            )
        })?;
    }
    let listener = tokio::net::UnixListener::bind(path).with_context(|| {
        format!(
            "cannot listen for gRPC on the unix socket {}",
            path.display()
        )
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).with_context(|| {
        format!(
            "--grpc-uds {}: cannot set its mode {mode:o}",
            path.display()
        )
    })?;
    Ok(listener)
}

/// A listener on the abstract name `name` (Linux).
#[cfg(target_os = "linux")]
fn bind_abstract(name: &str) -> Result<tokio::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
        .with_context(|| format!("--grpc-uds @{name}: not an abstract socket name"))?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&address).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            anyhow::anyhow!("--grpc-uds @{name}: another process is listening on it")
        } else {
            anyhow::anyhow!("cannot listen for gRPC on the abstract socket @{name}: {e}")
        }
    })?;
    listener
        .set_nonblocking(true)
        .context("--grpc-uds: cannot make the socket non-blocking")?;
    tracing::warn!("--grpc-uds @{name} is an abstract socket: it has no file and no permissions, so any process in this network namespace may connect (--grpc-uds-mode does not apply); give a path to limit who may");
    tokio::net::UnixListener::from_std(listener)
        .with_context(|| format!("cannot listen for gRPC on the abstract socket @{name}"))
}

#[cfg(not(target_os = "linux"))]
fn bind_abstract(name: &str) -> Result<tokio::net::UnixListener> {
    anyhow::bail!("--grpc-uds @{name}: abstract sockets are Linux's; give a path")
}

/// The connections `listener` accepts within `bounds`, for
/// [`super::serve_connections`] (a failed accept is logged and skipped, as
/// on TCP; out of descriptors, it backs off).
pub fn unix_incoming(
    listener: tokio::net::UnixListener,
    bounds: crate::connection_bounds::ConnectionBounds,
) -> crate::connection_bounds::Connections<tokio::net::UnixStream> {
    Box::pin(futures::stream::unfold(
        (listener, bounds),
        |(listener, bounds)| async move {
            let slot = bounds.slot().await;
            let (io, _) = crate::connection_bounds::accept_with_backoff("gRPC unix socket", || {
                listener.accept()
            })
            .await;
            Some((
                crate::connection_bounds::Admitted { io, slot },
                (listener, bounds),
            ))
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::UdsAddress;
    use std::path::{Path, PathBuf};

    #[test]
    fn socket_addresses_in_the_forms_users_write() {
        let parse = |s: &str| UdsAddress::parse(Path::new(s)).map_err(|e| e.to_string());
        let path = |p: &str| Ok(UdsAddress::Path(PathBuf::from(p)));
        let abs = |n: &str| Ok(UdsAddress::Abstract(n.to_string()));
        assert_eq!(parse("/run/rls.sock"), path("/run/rls.sock"));
        assert_eq!(parse("rls.sock"), path("rls.sock"));
        assert_eq!(parse("unix:///run/rls.sock"), path("/run/rls.sock"));
        assert_eq!(parse("unix:/run/rls.sock"), path("/run/rls.sock"));
        assert_eq!(parse("unix:rls.sock"), path("rls.sock"));
        assert_eq!(parse("@rls"), abs("rls"));
        assert_eq!(parse("unix:@rls"), abs("rls"));
        assert_eq!(parse("unix-abstract:rls"), abs("rls"));
        for (bad, said) in [
            ("unix://run/rls.sock", "followed by an absolute path"),
            ("@", "names no socket"),
            ("unix:", "names no socket"),
            ("unix-abstract:", "names no socket"),
        ] {
            let e = parse(bad).expect_err(bad);
            assert!(e.contains(said), "{bad}: {e}");
        }
        assert_eq!(UdsAddress::Abstract("rls".into()).to_string(), "@rls");
    }
}
