//! Pipelined script calls to one Redis server, batched across concurrent
//! requests: the decision path's own connection.
//!
//! fred writes and flushes every `EVALSHA` on its own (its `should_flush`
//! holds for scripts), so each decision costs the service a write syscall
//! and Redis a read, however many decisions are waiting. Here a writer task
//! takes every call queued since it last woke, encodes them into one buffer
//! and sends it in one write; a reader task parses the replies as they come,
//! as many as one read brought, and answers the calls in the order they
//! were written. Redis reads many commands per syscall and answers them in
//! one write, at moderate load as well as under a flood.
//!
//! Nothing is ever sent twice: when the connection fails, every call
//! written and not yet answered gets a connection error (it may have run),
//! calls not yet written fail the same way, and the connection is made again
//! in the background (at once, then backing off to 250 ms); calls made
//! while it is down fail at once, as fred's `fail_fast` did. A call's time
//! limit is its caller's (`RedisStore::run`).
//!
//! **Rooms.** This file: the connections of one server ([`Pipes`]: which
//! one a call takes, lanes per serving thread) and each one's driver
//! (connect, serve, fail what was pending, connect again). Below it:
//! [`connect`] (where and how to connect, `AUTH`), [`writer`] (one write
//! per wake, the batches), [`reader`] (replies answered in order) and
//! [`pending`] (what the replies answer, shared by the two).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use fred::error::{Error as RedisError, ErrorKind};
use fred::types::{Key, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot};

use self::connect::open;
pub use self::connect::Target;
pub(super) use self::connect::{open as open_connection, request, requests, Io};
use self::pending::{fail_all, lost, Pending, BATCH_UNKNOWN};
use self::reader::read_replies;
use self::writer::{write_calls, Call, Command};
use super::batch::{self, Decision, DecisionScript};
use super::resp::{decimal, encode, encode_eval, Reply};
use crate::replication::Replication;

mod connect;
mod pending;
mod reader;
mod writer;

/// Calls waiting to be written, at most; past it a call fails at once
/// (`Backpressure`) instead of memory growing.
const MAX_QUEUED: usize = 10_000;

/// Calls waiting on a connection past which the next call goes to the
/// next connection: it is behind (Redis or the network is slow to take
/// what it writes), or a burst is larger than a write carries.
const SPILL: usize = 512;

/// A few pipelined connections to one server, filled in order: a call goes
/// to the first connection that is up and not behind, so that at ordinary
/// loads every call waits in one queue and goes out in the largest writes
/// (round-robin split each batch as many ways as there were connections;
/// BENCHMARKS.md). The others take the overflow, and the calls of a
/// connection that is down.
///
/// A call made on one of [`crate::serving`]'s threads goes first to that
/// thread's own connection (its lane), made on the thread's runtime at its
/// first call: written, read and answered there, the call never wakes
/// another thread. Until the lane is up, and while it is behind or down,
/// the thread's calls go to the shared connections.
pub struct Pipes {
    target: Target,
    /// Decisions one call carries at most (1: each alone).
    batch: usize,
    pipes: Vec<Pipe>,
    /// One per serving thread, made on that thread's first call.
    lanes: Box<[OnceLock<Pipe>]>,
    /// The calls of rules with `replication:`, each write followed by a
    /// `WAIT` that blocks the connection until the replicas answer: on a
    /// connection of their own, so that no other decision queues behind
    /// it. Made at the first such call, on `runtime`.
    durable: OnceLock<Pipe>,
    runtime: tokio::runtime::Handle,
}

/// How long the first call of a rule with `replication:` waits for its
/// connection to be made; then, as on every connection, a call made while
/// it is down fails at once.
const DURABLE_FIRST_CONNECT: Duration = Duration::from_millis(500);

impl Pipes {
    /// `count` connections to `target`, connecting in the background, and
    /// room for a lane on each of `lanes` serving threads; each call of a
    /// decision carries up to `batch` of them ([`batch`]).
    pub fn connect(target: &Target, count: usize, lanes: usize, batch: usize) -> Self {
        let batch = batch.max(1);
        Self {
            target: target.clone(),
            batch,
            pipes: (0..count.max(1))
                .map(|_| Pipe::connect(target.clone(), batch))
                .collect(),
            lanes: (0..lanes).map(|_| OnceLock::new()).collect(),
            durable: OnceLock::new(),
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// The connection of rules with `replication:` (see [`Pipes::durable`]),
    /// made now if it is the first call, and waited for while it connects.
    async fn durable(&self) -> &Pipe {
        let mut made = false;
        let pipe = self.durable.get_or_init(|| {
            made = true;
            let _runtime = self.runtime.enter();
            Pipe::connect(self.target.clone(), 1)
        });
        if made {
            let deadline = tokio::time::Instant::now() + DURABLE_FIRST_CONNECT;
            while !pipe.up.load(Ordering::Relaxed) && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        pipe
    }

    /// This serving thread's lane when it is up and not behind; else the
    /// first shared connection that is up with fewer than [`SPILL`] calls
    /// waiting; else the one up with the fewest waiting; else the first
    /// (which answers that it is down).
    fn pick(&self) -> &Pipe {
        if let Some(lane) = crate::background::serving_thread().and_then(|i| self.lanes.get(i)) {
            // spawned on this thread's runtime: the first call made here
            let pipe = lane.get_or_init(|| Pipe::connect(self.target.clone(), self.batch));
            if pipe.up.load(Ordering::Relaxed) && pipe.waiting() < SPILL {
                return pipe;
            }
        }
        let mut least: Option<(&Pipe, usize)> = None;
        for pipe in &self.pipes {
            if !pipe.up.load(Ordering::Relaxed) {
                continue;
            }
            let waiting = pipe.waiting();
            if waiting < SPILL {
                return pipe;
            }
            if least.is_none_or(|(_, w)| waiting < w) {
                least = Some((pipe, waiting));
            }
        }
        least.map_or(&self.pipes[0], |(pipe, _)| pipe)
    }

    /// Runs `EVALSHA sha keys args` (or `EVAL body …` when the server does
    /// not have the script yet) on the next connection.
    pub async fn eval(&self, sha: &str, body: &str, keys: &[Key], args: &[Value]) -> Reply {
        let pipe = self.pick();
        let command = encode_eval("EVALSHA", sha, keys, args)?;
        match pipe.call(Command::Whole(command), None).await {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                pipe.call(Command::Whole(encode_eval("EVAL", body, keys, args)?), None)
                    .await
            }
            other => other,
        }
    }

    /// Runs `EVALSHA sha keys args` (or `EVAL body …`, as [`Pipes::eval`])
    /// after `ASKING`, on the next connection: where an `ASK` redirection
    /// sent it. Never sent again once written: a connection lost with it
    /// in flight answers an error, as every call here.
    /// With `wait`, as [`Pipes::decide`] says.
    pub async fn eval_asking(
        &self,
        sha: &str,
        body: &str,
        keys: &[Key],
        args: &[Value],
        wait: Option<Replication>,
    ) -> Reply {
        let pipe = match wait {
            Some(_) => self.durable().await,
            None => self.pick(),
        };
        let command = encode_eval("EVALSHA", sha, keys, args)?;
        match pipe.call(Command::Asking(command), wait).await {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                pipe.call(
                    Command::Asking(encode_eval("EVAL", body, keys, args)?),
                    wait,
                )
                .await
            }
            other => other,
        }
    }

    /// envoyproxy/ratelimit's count on the next connection: `INCRBY key
    /// by` and `EXPIRE key expire_secs` queued together, so written in
    /// one write, in that order (each after `ASKING` when `asking`); the
    /// reply is `INCRBY`'s count.
    pub async fn count(&self, key: &[u8], by: i64, expire_secs: i64, asking: bool) -> Reply {
        let pipe = self.pick();
        let command = |name: &[u8], n: i64| {
            let bytes = encode([name, key, decimal(n, &mut [0; 20])].into_iter());
            if asking {
                Command::Asking(bytes)
            } else {
                Command::Whole(bytes)
            }
        };
        let (counted, _expired) = futures::future::join(
            pipe.call(command(b"INCRBY", by), None),
            pipe.call(command(b"EXPIRE", expire_secs), None),
        )
        .await;
        counted
    }

    /// Runs one decision (its `keys` and group of `args`) in a batch of
    /// `bucket.lua` with the decisions queued beside it, or alone with
    /// `script`: sent again alone when its batch could not take it, and
    /// with `EVAL` when the server does not have the script.
    ///
    /// With `wait` (a rule's `replication:`): alone, on the durable
    /// connection, its write followed by `WAIT`; its reply ends with the
    /// number of replicas that acknowledged (the caller judges it).
    pub async fn decide(
        &self,
        script: DecisionScript,
        keys: &[Key],
        args: &[Value],
        wait: Option<Replication>,
    ) -> Reply {
        let pipe = match wait {
            Some(_) => self.durable().await,
            None => self.pick(),
        };
        let mut alone = wait.is_some();
        loop {
            let decision = Decision::new(script, keys, args)?;
            match pipe.call(Command::Decision { decision, alone }, wait).await {
                Err(e) if batch::is_again_alone(&e) && !alone => alone = true,
                Err(e) if e.details().starts_with("NOSCRIPT") => {
                    let body = batch::scripts().of(script).1;
                    let command = encode_eval("EVAL", body, keys, args)?;
                    return pipe.call(Command::Whole(command), wait).await;
                }
                other => return other,
            }
        }
    }

    /// Writes made on these connections so far, lanes included (each
    /// carries every call queued when it was made).
    pub fn writes(&self) -> usize {
        self.pipes
            .iter()
            .chain(self.lanes.iter().filter_map(OnceLock::get))
            .map(|p| p.writes.load(Ordering::Relaxed))
            .sum()
    }

    /// Writes made on each shared connection so far.
    #[cfg(test)]
    fn writes_each(&self) -> Vec<usize> {
        self.pipes
            .iter()
            .map(|p| p.writes.load(Ordering::Relaxed))
            .collect()
    }

    /// Writes made on each serving thread's lane so far (0: none made).
    #[cfg(test)]
    fn lane_writes(&self) -> Vec<usize> {
        self.lanes
            .iter()
            .map(|l| l.get().map_or(0, |p| p.writes.load(Ordering::Relaxed)))
            .collect()
    }

    /// Whether every shared connection is up (lanes come and go with
    /// their threads' calls; a lane that is down sends its calls here).
    pub fn connected(&self) -> bool {
        self.pipes.iter().all(|p| p.up.load(Ordering::Relaxed))
    }

    /// Waits until every connection is up, or `within` passes.
    pub async fn wait(&self, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        while !self.connected() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// One connection: a queue to its driver task, and whether it is up.
struct Pipe {
    queue: mpsc::Sender<Call>,
    up: Arc<AtomicBool>,
    /// Writes made, however many calls each carried.
    writes: Arc<AtomicUsize>,
}

impl Pipe {
    /// Calls queued and not yet taken by the writer.
    fn waiting(&self) -> usize {
        self.queue.max_capacity() - self.queue.capacity()
    }

    fn connect(target: Target, batch: usize) -> Self {
        let (queue, calls) = mpsc::channel(MAX_QUEUED);
        let up = Arc::new(AtomicBool::new(false));
        let writes = Arc::new(AtomicUsize::new(0));
        tokio::spawn(drive(target, calls, up.clone(), writes.clone(), batch));
        Self { queue, up, writes }
    }

    /// `wait`: the call's write is followed by `WAIT` ([`writer`]).
    async fn call(&self, command: Command, wait: Option<Replication>) -> Reply {
        if !self.up.load(Ordering::Relaxed) {
            return Err(RedisError::new(
                ErrorKind::IO,
                "not connected to Redis (reconnecting)",
            ));
        }
        let (answer, reply) = oneshot::channel();
        self.queue
            .try_send(Call {
                command,
                answer,
                wait,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => RedisError::new(
                    ErrorKind::Backpressure,
                    "too many Redis calls waiting to be written",
                ),
                mpsc::error::TrySendError::Closed(_) => {
                    RedisError::new(ErrorKind::Canceled, "the Redis connection is closed")
                }
            })?;
        reply.await.unwrap_or_else(|_| Err(lost()))
    }
}

/// Connects, serves until the connection fails, fails what was pending,
/// and connects again, until the [`Pipe`] is dropped.
async fn drive(
    target: Target,
    mut calls: mpsc::Receiver<Call>,
    up: Arc<AtomicBool>,
    writes: Arc<AtomicUsize>,
    batch: usize,
) {
    let mut backoff = Duration::ZERO;
    loop {
        match open(&target).await {
            Ok(stream) => {
                up.store(true, Ordering::Relaxed);
                backoff = Duration::ZERO;
                serve(stream, &mut calls, &writes, batch).await;
            }
            Err(e) => {
                tracing::debug!(host = %target.host, port = target.port, error = %e, "Redis connect failed")
            }
        }
        up.store(false, Ordering::Relaxed);
        // what was queued while the connection failed was not written:
        // answered at once, as calls made while it is down are
        while let Ok(call) = calls.try_recv() {
            let _ = call.answer.send(Err(RedisError::new(
                ErrorKind::IO,
                "the Redis connection failed before the call was written",
            )));
        }
        if calls.is_closed() {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).clamp(Duration::from_millis(50), Duration::from_millis(250));
    }
}

/// Writes what is queued and answers what is read, until either side fails
/// or the queue closes; then answers every call written and not yet
/// answered with a connection error. The decisions of one write go out in
/// batches of up to `batch` ([`batch`]).
async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    calls: &mut mpsc::Receiver<Call>,
    writes: &AtomicUsize,
    batch: usize,
) {
    let (mut reader, mut writer) = tokio::io::split(stream);
    // what the calls written wait for, in order
    let pending = Pending::default();
    // whether this server has the batch script (loaded again after a
    // NOSCRIPT: a flush, a restart behind a proxy)
    let script = AtomicU8::new(BATCH_UNKNOWN);
    let ended: Result<(), RedisError> = tokio::select! {
        r = write_calls(&mut writer, calls, &pending, &script, writes, batch) => r,
        r = read_replies(&mut reader, &pending, &script) => r,
    };
    if let Err(e) = ended {
        tracing::debug!(error = %e, "Redis connection ended");
    }
    fail_all(&pending);
}

#[cfg(test)]
mod target_tests;

/// Against a stand-in server on loopback: what goes out in one write, the
/// order of answers, and a connection lost with calls in flight.
#[cfg(test)]
mod wire_tests;
