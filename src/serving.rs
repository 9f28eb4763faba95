//! Serving threads: gRPC connections served one thread per core, the way
//! Envoy runs its workers, so that a connection's calls never hop threads.
//!
//! One acceptor task (on the main runtime) accepts connections and hands
//! them round-robin to `n` threads, each running a current-thread tokio
//! runtime that serves the connections it was given until the stop signal,
//! then drains them. Everything else (admin HTTP, reloads, sweepers, the
//! Redis client's connections) stays on the main runtime; work a call
//! starts that must outlive the call (a lease's store calls, a breaker's
//! probe) goes there through [`crate::background::spawn`], so a serving thread's
//! runtime holds nothing but its connections.
//!
//! A store may keep connections of its own on each serving thread
//! ([`crate::background::serving_thread`] says which thread a call runs on): the Redis store's
//! pipelined connections do, so that a decision's store call is written,
//! read and answered on the thread that serves its gRPC call.
//!
//! Why: a multi-thread runtime lets any worker pick up any task, and on a
//! busy machine wake-ups across threads and work stealing cost more than
//! the decision itself (BENCHMARKS.md, CPU per decision). Round-robin at
//! accept (rather than `SO_REUSEPORT`, where the kernel hashes connections
//! to listeners) keeps a few long-lived Envoy connections spread evenly.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `cli`; uses only `background`.

use std::sync::Arc;

use anyhow::{Context, Result};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

/// The connections one serving thread is given.
pub type Connections = BoxStream<'static, Result<TcpStream, std::io::Error>>;

/// Serves `connections` until `stopped` resolves (a tonic router's
/// `serve_with_incoming_shutdown`), on the serving thread.
pub type ServeFn = Arc<
    dyn Fn(
            Connections,
            BoxFuture<'static, ()>,
        ) -> BoxFuture<'static, Result<(), tonic::transport::Error>>
        + Send
        + Sync,
>;

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
    tokio::net::UnixListener::from_std(listener)
        .with_context(|| format!("cannot listen for gRPC on the abstract socket @{name}"))
}

#[cfg(not(target_os = "linux"))]
fn bind_abstract(name: &str) -> Result<tokio::net::UnixListener> {
    anyhow::bail!("--grpc-uds @{name}: abstract sockets are Linux's; give a path")
}

/// The connections `listener` accepts, for tonic (a failed accept is
/// logged and skipped, as on TCP).
pub fn unix_incoming(
    listener: tokio::net::UnixListener,
) -> impl futures::Stream<Item = Result<tokio::net::UnixStream, std::io::Error>> {
    futures::stream::unfold(listener, |listener| async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => return Some((Ok(stream), listener)),
                Err(e) => {
                    tracing::debug!(error = %e, "cannot accept a gRPC connection on the unix socket");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            }
        }
    })
}

/// Starts `threads` serving threads and the acceptor that feeds them.
/// The returned task ends when every thread has drained after `stop`.
pub fn start(
    listener: TcpListener,
    threads: usize,
    serve: ServeFn,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<Result<()>>> {
    let main = Handle::current();
    let mut senders = Vec::with_capacity(threads);
    let mut finished = Vec::with_capacity(threads);
    for i in 0..threads {
        let (tx, rx) = mpsc::unbounded_channel::<std::net::TcpStream>();
        let (done_tx, done_rx) = oneshot::channel();
        let serve = serve.clone();
        let main = main.clone();
        let stop = stop.clone();
        std::thread::Builder::new()
            .name(format!("rls-serve-{i}"))
            .spawn(move || {
                crate::background::mark_serving_thread(i);
                let _ = done_tx.send(serve_thread(main, rx, serve, stop));
            })
            .context("cannot start a serving thread")?;
        senders.push(tx);
        finished.push(done_rx);
    }
    let acceptor = tokio::spawn(accept(listener, senders, stop));
    Ok(tokio::spawn(async move {
        acceptor.await.context("acceptor panicked")?;
        for done in finished {
            done.await
                .context("a serving thread ended without an answer")?
                .context("gRPC server failed")?;
        }
        Ok(())
    }))
}

/// Accepts until stopped, handing connections round-robin; dropping the
/// listener closes the port, dropping the senders ends each thread's stream.
async fn accept(
    listener: TcpListener,
    senders: Vec<mpsc::UnboundedSender<std::net::TcpStream>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut next = 0usize;
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted.and_then(|(s, _)| {
            s.set_nodelay(true)?;
            s.into_std()
        }) {
            Ok(stream) => stream,
            Err(e) => {
                // a connection reset before it was accepted, or out of
                // descriptors: not a reason to stop serving
                tracing::debug!(error = %e, "cannot accept a gRPC connection");
                continue;
            }
        };
        let _ = senders[next % senders.len()].send(stream);
        next = next.wrapping_add(1);
    }
}

/// One serving thread: a current-thread runtime serving what it is handed.
fn serve_thread(
    main: Handle,
    mut connections: mpsc::UnboundedReceiver<std::net::TcpStream>,
    serve: ServeFn,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    crate::background::run_on(main);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a serving thread's runtime")?;
    runtime.block_on(async move {
        let incoming: Connections = Box::pin(futures::stream::poll_fn(move |cx| {
            connections.poll_recv(cx).map(|next| {
                next.map(|stream| {
                    stream.set_nonblocking(true)?;
                    TcpStream::from_std(stream)
                })
            })
        }));
        let stopped: BoxFuture<'static, ()> = Box::pin(async move {
            let _ = stop.wait_for(|s| *s).await;
        });
        serve(incoming, stopped).await
    })?;
    Ok(())
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
