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

use anyhow::{Context, Result};
use futures::future::{BoxFuture, Either};
use futures::stream::{BoxStream, StreamExt};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::codegen::Service;
use tonic::service::Routes;

mod unix;
pub use unix::{bind_unix, unix_incoming, UdsAddress};

/// The connections one serving thread is given.
pub type Connections = BoxStream<'static, Result<TcpStream, std::io::Error>>;

/// What gRPC connections over plain TCP answer calls with: the hot method
/// by its path, handed to it directly, and every other path by tonic's
/// routes.
///
/// [`serve_connections`] runs hyper's HTTP/2 connections itself rather
/// than tonic's transport server, whose per-call layers (the connection's
/// addresses copied into every request, a boxed service per call, its own
/// deadline timer, a router's match) cost more than a decision
/// (BENCHMARKS.md, "the gRPC stack per call"). What they did is kept where
/// it matters: a caller's `grpc-timeout` is honoured by the service itself
/// (it caps the store call; the caller cancels its stream at the deadline,
/// which drops the call). The TLS listener (a region's RLQS stream is
/// named by the client certificate tonic's server puts in each request)
/// and the Unix socket keep tonic's server.
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

impl<M: Method> hyper::service::Service<Request<Incoming>> for GrpcRoutes<M> {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Either<M::Future, <Routes as Service<Request<Incoming>>>::Future>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        // both are always ready (their `poll_ready` answers at once), so
        // a clone is called without asking
        if request.uri().path() == self.path {
            Either::Left(self.method.clone().call(request))
        } else {
            Either::Right(self.routes.clone().call(request))
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
        Future: Send + 'static,
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
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Starts `threads` serving threads and the acceptor that feeds them; each
/// connection is served with `service`, at most `max_streams` calls at a
/// time. The returned task ends when every thread has drained after `stop`.
pub fn start<M: Method>(
    listener: TcpListener,
    threads: usize,
    service: GrpcRoutes<M>,
    max_streams: u32,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<Result<()>>> {
    let main = Handle::current();
    let mut senders = Vec::with_capacity(threads);
    let mut finished = Vec::with_capacity(threads);
    for i in 0..threads {
        let (tx, rx) = mpsc::unbounded_channel::<std::net::TcpStream>();
        let (done_tx, done_rx) = oneshot::channel();
        let service = service.clone();
        let main = main.clone();
        let stop = stop.clone();
        std::thread::Builder::new()
            .name(format!("rls-serve-{i}"))
            .spawn(move || {
                crate::background::mark_serving_thread(i);
                let _ = done_tx.send(serve_thread(main, rx, service, max_streams, stop));
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
                .context("a serving thread failed")?;
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
fn serve_thread<M: Method>(
    main: Handle,
    mut connections: mpsc::UnboundedReceiver<std::net::TcpStream>,
    service: GrpcRoutes<M>,
    max_streams: u32,
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
        serve_connections(incoming, service, max_streams, stopped).await;
    });
    Ok(())
}

/// Serves each of `connections` as HTTP/2 (as tonic's server does, with
/// hyper's defaults, less the `date` header gRPC has no use for) until
/// `stopped`; then tells each connection to finish (GOAWAY: the calls in
/// flight are answered) and returns when all have closed. Each serving
/// thread runs one; without serving threads, the shared runtime runs one
/// for the listener.
pub async fn serve_connections<M: Method>(
    mut connections: Connections,
    service: GrpcRoutes<M>,
    max_streams: u32,
    stopped: BoxFuture<'static, ()>,
) {
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .max_concurrent_streams(max_streams)
        .auto_date_header(false);
    // each connection holds a receiver: all are gone when all have closed
    let (drain, draining) = watch::channel(false);
    let mut stopped = pin!(stopped);
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => break,
            next = connections.next() => match next {
                Some(Ok(stream)) => stream,
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "cannot take a gRPC connection");
                    continue;
                }
                None => break,
            },
        };
        let connection = http2.serve_connection(TokioIo::new(stream), service.clone());
        let mut draining = draining.clone();
        tokio::spawn(async move {
            let mut connection = pin!(connection);
            let finished = tokio::select! {
                finished = connection.as_mut() => finished,
                // (set once, to true, when the serving stops)
                _ = draining.changed() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = finished {
                tracing::debug!(error = %e, "a gRPC connection ended");
            }
        });
    }
    drop(connections);
    let _ = drain.send(true);
    drop(draining);
    drain.closed().await;
}
