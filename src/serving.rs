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

mod unix;
pub use unix::{bind_unix, unix_incoming, UdsAddress};

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
