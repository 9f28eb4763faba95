//! What no client can pile up: the bounds every gRPC connection is taken
//! and served under (docs/operations.md, "Connections and memory").
//!
//! - **A gate** ([`ConnectionBounds::gate`]): a connection is accepted only
//!   with a free slot of `--max-connections`, every listener together (a
//!   TLS handshake holds one too); past it the listener waits, as tokio's
//!   mini-redis does, and the kernel's backlog holds the next.
//! - **Accept errors back off** ([`accept_pause`]): out of descriptors
//!   (EMFILE, ENFILE) or memory, an acceptor that tried again at once would
//!   spin a core; it waits 100 ms. A connection reset before it was
//!   accepted is simply skipped.
//! - **Idle connections close** ([`Activity`]): a connection with no call
//!   open and none begun for `--idle-timeout` gets a GOAWAY.
//!
//! HTTP/2 keepalive (a PING after `--http2-keepalive-interval` of silence,
//! the connection closed if it is not answered within
//! `--http2-keepalive-timeout`) and the flow-control windows are hyper's,
//! set in `serving::serve_connections`.
//!
//! **Layer** (docs/architecture.md, "Layers"): a leaf; `serving` and `tls`
//! (both listeners take connections within the bounds) look down to it.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The bounds gRPC connections are served under; one for the process,
/// shared by every listener and serving thread.
#[derive(Clone)]
pub struct ConnectionBounds {
    /// Free slots of `--max-connections`.
    pub gate: Arc<Semaphore>,
    /// Calls one connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS).
    pub max_streams: u32,
    /// `--idle-timeout`; `None`: never.
    pub idle_timeout: Option<Duration>,
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
}

impl ConnectionBounds {
    pub fn new(
        max_connections: usize,
        max_streams: u32,
        idle_timeout: Duration,
        keepalive: (Duration, Duration),
    ) -> Self {
        Self {
            gate: Arc::new(Semaphore::new(max_connections)),
            max_streams,
            idle_timeout: (!idle_timeout.is_zero()).then_some(idle_timeout),
            keepalive_interval: keepalive.0,
            keepalive_timeout: keepalive.1,
        }
    }

    /// A slot for one more connection, once one is free.
    pub async fn slot(&self) -> OwnedSemaphorePermit {
        match self.gate.clone().acquire_owned().await {
            Ok(permit) => permit,
            // the gate is never closed
            Err(_) => std::future::pending().await,
        }
    }
}

/// The connections one server is given, each holding its slot.
pub type Connections<IO> = futures::stream::BoxStream<'static, Admitted<IO>>;

/// A connection taken within the bounds: its slot is given back when the
/// connection is dropped.
pub struct Admitted<IO> {
    pub io: IO,
    pub slot: OwnedSemaphorePermit,
}

impl<IO> Admitted<IO> {
    /// The same slot, for the connection in another form.
    pub fn map<T>(self, f: impl FnOnce(IO) -> io::Result<T>) -> io::Result<Admitted<T>> {
        Ok(Admitted {
            io: f(self.io)?,
            slot: self.slot,
        })
    }
}

/// How long an acceptor waits after `error` before it accepts again: out
/// of descriptors or memory, 100 ms (trying again at once spins a core
/// while nothing frees); anything else concerns that one connection only.
pub fn accept_pause(error: &io::Error) -> Option<Duration> {
    const EMFILE: i32 = 24;
    const ENFILE: i32 = 23;
    const ENOBUFS: i32 = 105;
    const ENOMEM: i32 = 12;
    match error.raw_os_error() {
        Some(EMFILE | ENFILE | ENOBUFS | ENOMEM) => Some(Duration::from_millis(100)),
        _ if error.kind() == io::ErrorKind::OutOfMemory => Some(Duration::from_millis(100)),
        _ => None,
    }
}

/// Accepts with `accept` until it gives a connection, backing off on
/// errors that concern every connection ([`accept_pause`]); `listener`
/// names it in the warning.
pub async fn accept_with_backoff<T, F, Fut>(listener: &str, mut accept: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = io::Result<T>>,
{
    loop {
        match accept().await {
            Ok(conn) => return conn,
            Err(e) => match accept_pause(&e) {
                Some(pause) => {
                    warn_at_most_each_second(listener, &e);
                    tokio::time::sleep(pause).await;
                }
                None => {
                    tracing::debug!(error = %e, listener, "a connection failed before it was accepted")
                }
            },
        }
    }
}

/// The warning for an acceptor out of descriptors, at most once a second
/// (it is tried ten times a second while it lasts).
fn warn_at_most_each_second(listener: &str, error: &io::Error) {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST.swap(now, Ordering::Relaxed) != now {
        tracing::warn!(error = %error, listener, "cannot accept connections (out of file descriptors or memory): trying again every 100 ms; raise the descriptor limit or lower --max-connections");
    }
}

/// One connection's calls: how many are open, how many have begun.
#[derive(Default)]
pub struct Activity {
    open: AtomicU32,
    begun: AtomicU64,
}

impl Activity {
    /// A call begins; it is open until the guard is dropped.
    pub fn begin(self: &Arc<Self>) -> CallGuard {
        self.open.fetch_add(1, Ordering::Relaxed);
        self.begun.fetch_add(1, Ordering::Relaxed);
        CallGuard(self.clone())
    }
}

/// An open call of a connection's [`Activity`].
pub struct CallGuard(Arc<Activity>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether a connection has been idle for its timeout, looked at every
/// quarter of it: idle when four looks in a row saw no call open and none
/// begun (so after the timeout, and at most a quarter more).
pub struct IdleWatch {
    activity: Arc<Activity>,
    pub every: Duration,
    quiet_looks: u32,
    begun_at_last_look: u64,
}

impl IdleWatch {
    pub fn new(activity: Arc<Activity>, timeout: Duration) -> Self {
        Self {
            activity,
            every: timeout / 4,
            quiet_looks: 0,
            begun_at_last_look: 0,
        }
    }

    /// One look: true once the connection has been idle for the timeout.
    pub fn look(&mut self) -> bool {
        let begun = self.activity.begun.load(Ordering::Relaxed);
        let open = self.activity.open.load(Ordering::Relaxed);
        if open == 0 && begun == self.begun_at_last_look {
            self.quiet_looks += 1;
        } else {
            self.quiet_looks = 0;
            self.begun_at_last_look = begun;
        }
        self.quiet_looks >= 4
    }
}

/// A future that holds a call open (its [`CallGuard`]) until it is done
/// or dropped.
pub struct Counted<F> {
    pub inner: F,
    pub _call: CallGuard,
}

impl<F: std::future::Future + Unpin> std::future::Future for Counted<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        Pin::new(&mut self.inner).poll(cx)
    }
}

/// A response body that holds its call open until it is dropped (a
/// stream's answer lasts as long as the stream).
pub struct CountedBody {
    pub inner: tonic::body::Body,
    pub _call: CallGuard,
}

impl http_body::Body for CountedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_connection_is_found_after_four_quiet_looks() {
        let activity = Arc::new(Activity::default());
        let mut watch = IdleWatch::new(activity.clone(), Duration::from_secs(4));
        assert_eq!(watch.every, Duration::from_secs(1));
        assert!(!watch.look() && !watch.look() && !watch.look());
        assert!(watch.look(), "four quiet looks: idle");
    }

    #[test]
    fn an_open_call_or_a_new_one_keeps_it() {
        let activity = Arc::new(Activity::default());
        let mut watch = IdleWatch::new(activity.clone(), Duration::from_secs(4));
        let call = activity.begin();
        for _ in 0..8 {
            assert!(!watch.look(), "a call open (a stream) is not idle");
        }
        drop(call);
        assert!(!watch.look() && !watch.look() && !watch.look());
        assert!(watch.look(), "four quiet looks since the call ended");
        drop(activity.begin());
        assert!(!watch.look(), "a call begun and ended between looks");
    }

    #[test]
    fn out_of_descriptors_backs_off_and_a_reset_does_not() {
        assert_eq!(
            accept_pause(&io::Error::from_raw_os_error(24)),
            Some(Duration::from_millis(100))
        );
        assert_eq!(
            accept_pause(&io::Error::from_raw_os_error(23)),
            Some(Duration::from_millis(100))
        );
        assert_eq!(accept_pause(&io::Error::from_raw_os_error(103)), None);
        assert_eq!(
            accept_pause(&io::Error::from(io::ErrorKind::ConnectionReset)),
            None
        );
    }

    #[tokio::test]
    async fn the_gate_gives_a_slot_back_when_a_connection_closes() {
        let bounds = ConnectionBounds::new(
            1,
            8,
            Duration::ZERO,
            (Duration::from_secs(1), Duration::from_secs(1)),
        );
        assert!(bounds.idle_timeout.is_none(), "0s: never");
        let first = bounds.slot().await;
        let waiting = tokio::time::timeout(Duration::from_millis(50), bounds.slot()).await;
        assert!(waiting.is_err(), "no second slot while the first is held");
        drop(first);
        let _second = tokio::time::timeout(Duration::from_millis(50), bounds.slot())
            .await
            .expect("the slot came back");
    }
}
