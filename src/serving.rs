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

use std::convert::Infallible;
use std::pin::pin;
use std::sync::Arc;

use anyhow::{Context, Result};
use futures::future::{BoxFuture, Either};
use futures::stream::StreamExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::codegen::Service;
use tonic::service::Routes;

use crate::connection_bounds::{accept_with_backoff, Activity, Counted, CountedBody, IdleWatch};

mod unix;
pub use crate::connection_bounds::{Admitted, ConnectionBounds, Connections};
pub use unix::{bind_unix, unix_incoming, UdsAddress};

/// What gRPC connections over plain TCP answer calls with: the hot method
/// by its path, handed to it directly, and every other path by tonic's
/// routes.
///
/// [`serve_connections`] runs hyper's HTTP/2 connections itself rather
/// than tonic's transport server, whose per-call layers (the connection's
/// addresses copied into every request, a boxed service per call, its own
/// deadline timer, a router's match) cost more than a decision
/// (BENCHMARKS.md, "the gRPC stack per call"). What they did is kept where
/// it matters: a caller's `grpc-timeout` is honoured from the call's first
/// byte (`service::wire`: the body's read, then the store call), and on
/// TLS each call is given its connection's certificates (a region's RLQS
/// stream is named by them). Every listener (TCP, TLS, the Unix socket) is
/// served so, within the same bounds (`connection_bounds`).
#[derive(Clone)]
pub struct GrpcRoutes<M> {
    path: &'static str,
    method: M,
    routes: Routes,
}

impl<M> GrpcRoutes<M> {
    /// `method` answers `path`; `routes` every other path.
    pub fn new(path: &'static str, method: M, routes: Routes) -> Self {
        Self {
            path,
            method,
            routes,
        }
    }
}

/// [`GrpcRoutes`] for one connection: each call counted in the
/// connection's [`Activity`] (open until its answer's body ends, so a
/// stream is open as long as it lasts), and, on TLS, given the
/// connection's certificates (`info`, as tonic's server gives them).
struct ConnectionService<M, I> {
    routes: GrpcRoutes<M>,
    activity: Arc<Activity>,
    info: Option<I>,
}

type RoutesFuture = BoxFuture<'static, Result<Response<Body>, Infallible>>;

impl<M: Method, I: Clone + Send + Sync + 'static> hyper::service::Service<Request<Incoming>>
    for ConnectionService<M, I>
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Counted<Either<M::Future, RoutesFuture>>;

    fn call(&self, mut request: Request<Incoming>) -> Self::Future {
        if let Some(info) = &self.info {
            request.extensions_mut().insert(info.clone());
        }
        // both are always ready (their `poll_ready` answers at once), so
        // a clone is called without asking
        let inner = if request.uri().path() == self.routes.path {
            Either::Left(self.routes.method.clone().call(request))
        } else {
            // a stream's answer: open until its body ends
            let call = self.activity.begin();
            let answer = self.routes.routes.clone().call(request);
            Either::Right(Box::pin(async move {
                let answer = answer.await?;
                Ok(answer.map(|inner| Body::new(CountedBody { inner, _call: call })))
            }) as RoutesFuture)
        };
        Counted {
            inner,
            _call: self.activity.begin(),
        }
    }
}

/// A gRPC method as the serving threads call it: a tower service of
/// hyper's requests that answers every call (its errors are statuses).
pub trait Method:
    Service<
        Request<Incoming>,
        Response = Response<Body>,
        Error = Infallible,
        Future: Send + Unpin + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<M> Method for M where
    M: Service<
            Request<Incoming>,
            Response = Response<Body>,
            Error = Infallible,
            Future: Send + Unpin + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Starts `threads` serving threads and the acceptor that feeds them; each
/// connection is served with `service` within `bounds`. The returned task
/// ends when every thread has drained after `stop`.
pub fn start<M: Method>(
    listener: TcpListener,
    threads: usize,
    service: GrpcRoutes<M>,
    bounds: ConnectionBounds,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<Result<()>>> {
    let main = Handle::current();
    let mut senders = Vec::with_capacity(threads);
    let mut finished = Vec::with_capacity(threads);
    for i in 0..threads {
        let (tx, rx) = mpsc::unbounded_channel::<Admitted<std::net::TcpStream>>();
        let (done_tx, done_rx) = oneshot::channel();
        let service = service.clone();
        let main = main.clone();
        let stop = stop.clone();
        let bounds = bounds.clone();
        std::thread::Builder::new()
            .name(format!("rls-serve-{i}"))
            .spawn(move || {
                crate::background::mark_serving_thread(i);
                let _ = done_tx.send(serve_thread(main, rx, service, bounds, stop));
            })
            .context("cannot start a serving thread")?;
        senders.push(tx);
        finished.push(done_rx);
    }
    let acceptor = tokio::spawn(accept(listener, senders, bounds, stop));
    Ok(tokio::spawn(async move {
        acceptor.await.context("acceptor panicked")?;
        for done in finished {
            done.await
                .context("a serving thread ended without an answer")?
                .context("a serving thread failed")?;
        }
        Ok(())
    }))
}

/// Accepts until stopped, each connection once a slot is free, handing
/// them round-robin; dropping the listener closes the port, dropping the
/// senders ends each thread's stream.
async fn accept(
    listener: TcpListener,
    senders: Vec<mpsc::UnboundedSender<Admitted<std::net::TcpStream>>>,
    bounds: ConnectionBounds,
    mut stop: watch::Receiver<bool>,
) {
    let mut next = 0usize;
    loop {
        let admitted = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            admitted = accept_tcp(&listener, &bounds) => admitted,
        };
        let Ok(admitted) = admitted.map(|s| s.into_std()) else {
            continue; // (cannot fail for an open socket)
        };
        let _ = senders[next % senders.len()].send(admitted);
        next = next.wrapping_add(1);
    }
}

/// The next TCP connection within `bounds` (a slot first), with Nagle off.
async fn accept_tcp(listener: &TcpListener, bounds: &ConnectionBounds) -> Admitted<TcpStream> {
    let slot = bounds.slot().await;
    let (io, _) = accept_with_backoff("gRPC", || listener.accept()).await;
    let _ = io.set_nodelay(true);
    Admitted { io, slot }
}

/// The connections `listener` accepts within `bounds`, for
/// [`serve_connections`] on the shared runtime (`--serving-threads 0`).
pub fn tcp_incoming(listener: TcpListener, bounds: ConnectionBounds) -> Connections<TcpStream> {
    Box::pin(futures::stream::unfold(
        (listener, bounds),
        |(listener, bounds)| async move {
            let admitted = accept_tcp(&listener, &bounds).await;
            Some((admitted, (listener, bounds)))
        },
    ))
}

/// One serving thread: a current-thread runtime serving what it is handed.
fn serve_thread<M: Method>(
    main: Handle,
    mut connections: mpsc::UnboundedReceiver<Admitted<std::net::TcpStream>>,
    service: GrpcRoutes<M>,
    bounds: ConnectionBounds,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    crate::background::run_on(main);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a serving thread's runtime")?;
    runtime.block_on(async move {
        let incoming: Connections<TcpStream> = Box::pin(
            futures::stream::poll_fn(move |cx| connections.poll_recv(cx)).filter_map(
                |admitted| async move {
                    admitted
                        .map(|stream| {
                            stream.set_nonblocking(true)?;
                            TcpStream::from_std(stream)
                        })
                        .ok()
                },
            ),
        );
        let stopped: BoxFuture<'static, ()> = Box::pin(async move {
            let _ = stop.wait_for(|s| *s).await;
        });
        serve_connections(incoming, service, &bounds, None, stopped).await;
    });
    Ok(())
}

/// Serves each of `connections` as HTTP/2 (as tonic's server does, with
/// hyper's defaults, less the `date` header gRPC has no use for) within
/// `bounds` until `stopped`; then tells each connection to finish
/// (GOAWAY: the calls in flight are answered) and returns when all have
/// closed. `info` gives each call its connection's
/// [`tonic::transport::server::Connected::connect_info`] (TLS: the
/// client's certificates). Each serving thread runs one; without serving
/// threads, the shared runtime runs one for each listener.
pub async fn serve_connections<M, IO>(
    mut connections: Connections<IO>,
    service: GrpcRoutes<M>,
    bounds: &ConnectionBounds,
    info: Option<fn(&IO) -> IO::ConnectInfo>,
    stopped: BoxFuture<'static, ()>,
) where
    M: Method,
    IO: AsyncRead + AsyncWrite + tonic::transport::server::Connected + Send + Unpin + 'static,
{
    let http2 = http2_settings(bounds);
    // each connection holds a receiver: all are gone when all have closed
    let (drain, draining) = watch::channel(false);
    let mut stopped = pin!(stopped);
    loop {
        let admitted = tokio::select! {
            _ = &mut stopped => break,
            next = connections.next() => match next {
                Some(admitted) => admitted,
                None => break,
            },
        };
        let activity = Arc::new(Activity::default());
        let per_connection = ConnectionService {
            routes: service.clone(),
            activity: activity.clone(),
            info: info.map(|f| f(&admitted.io)),
        };
        let Admitted { io, slot } = admitted;
        let connection = http2.serve_connection(TokioIo::new(io), per_connection);
        let idle = bounds.idle_timeout.map(|t| IdleWatch::new(activity, t));
        tokio::spawn(serve_one(connection, idle, draining.clone(), slot));
    }
    drop(connections);
    let _ = drain.send(true);
    drop(draining);
    drain.closed().await;
}

/// hyper's HTTP/2 server within `bounds`: its streams, keepalive, and
/// flow-control windows that bound what a peer may send unread.
fn http2_settings(bounds: &ConnectionBounds) -> hyper::server::conn::http2::Builder<TokioExecutor> {
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .max_concurrent_streams(bounds.max_streams)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_header_list_size(MAX_HEADER_LIST)
        .keep_alive_interval(bounds.keepalive_interval)
        .keep_alive_timeout(bounds.keepalive_timeout)
        .auto_date_header(false);
    http2
}

/// What one call may send before its body is read (a whole
/// `ShouldRateLimit` is a few hundred bytes).
pub const STREAM_WINDOW: u32 = 64 * 1024;
/// What one connection's calls together may send unread.
pub const CONNECTION_WINDOW: u32 = 256 * 1024;
/// One call's headers, decoded (hyper's default, said here).
pub const MAX_HEADER_LIST: u32 = 16 * 1024;

/// One connection until it ends: told to finish (GOAWAY) when the serving
/// stops or when it has been idle for its timeout; its slot is given back
/// when it is gone.
async fn serve_one<M, IO, I>(
    connection: HttpConnection<M, IO, I>,
    mut idle: Option<IdleWatch>,
    mut draining: watch::Receiver<bool>,
    _slot: tokio::sync::OwnedSemaphorePermit,
) where
    M: Method,
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    I: Clone + Send + Sync + 'static,
{
    let mut connection = pin!(connection);
    let finished = loop {
        let look = async {
            match &idle {
                Some(watch) => tokio::time::sleep(watch.every).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            finished = connection.as_mut() => break finished,
            // (set once, to true, when the serving stops)
            _ = draining.changed() => {
                connection.as_mut().graceful_shutdown();
                break connection.await;
            }
            _ = look => {
                if idle.as_mut().is_some_and(IdleWatch::look) {
                    connection.as_mut().graceful_shutdown();
                    break connection.await;
                }
            }
        }
    };
    if let Err(e) = finished {
        tracing::debug!(error = %e, "a gRPC connection ended");
    }
}

type HttpConnection<M, IO, I> =
    hyper::server::conn::http2::Connection<TokioIo<IO>, ConnectionService<M, I>, TokioExecutor>;
