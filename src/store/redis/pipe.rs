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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use fred::bytes::BytesMut;
use fred::error::{Error as RedisError, ErrorKind};
use fred::types::config::{Config, ServerConfig, TlsConnector};
use fred::types::{Key, Value};
use redis_protocol::resp2::decode::decode_bytes_mut;
use redis_protocol::resp2::types::BytesFrame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use super::batch::{self, Decision};
use super::resp::{encode, encode_eval, next_reply, Reply};

/// Calls waiting to be written, at most; past it a call fails at once
/// (`Backpressure`) instead of memory growing.
const MAX_QUEUED: usize = 10_000;

/// One write carries at most about this many bytes; more calls wait for
/// the next (a bound on the buffer, not on throughput).
const MAX_WRITE: usize = 256 * 1024;

struct Call {
    command: Command,
    answer: oneshot::Sender<Reply>,
}

/// What a call sends.
enum Command {
    /// A whole command, encoded.
    Whole(Vec<u8>),
    /// A whole command, encoded, sent right after `ASKING` (the node
    /// importing a slot serves the next command for it): the two written
    /// together, `ASKING`'s reply read and dropped.
    Asking(Vec<u8>),
    /// A decision of `bucket.lua`: batched with the others queued beside
    /// it, unless `alone` (sent again after its batch could not take it).
    Decision { decision: Decision, alone: bool },
}

impl Command {
    fn len(&self) -> usize {
        match self {
            Command::Whole(bytes) | Command::Asking(bytes) => bytes.len(),
            Command::Decision { decision, .. } => decision.bytes() + 64,
        }
    }
}

/// What a write's reply answers, in the order written.
enum Waiting {
    One(oneshot::Sender<Reply>),
    /// A batch's decisions, in their order in the call.
    Batch(Vec<oneshot::Sender<Reply>>),
    /// The connection's `SCRIPT LOAD` of the batch script.
    Load,
    /// `ASKING`'s reply, read and dropped.
    Asking,
}

/// Whether a connection's server has taken the batch script.
const BATCH_UNKNOWN: u8 = 0;
const BATCH_LOADED: u8 = 1;
const BATCH_REFUSED: u8 = 2;

/// How the reader reads the next reply.
enum Next {
    One,
    Asking,
    Batch(usize),
    Load,
}

/// Where to connect, and how.
#[derive(Clone)]
pub struct Target {
    host: String,
    port: u16,
    /// `rediss://`: the connector and the name to check.
    tls: Option<(tokio_rustls::TlsConnector, String)>,
    username: Option<String>,
    password: Option<String>,
    connect_timeout: Duration,
}

impl Target {
    /// The one server of `config` (a centralized configuration, as each
    /// primary's is); `None` for anything else, or TLS other than rustls.
    pub fn of(config: &Config, connect_timeout: Duration) -> Option<Self> {
        let ServerConfig::Centralized { server } = &config.server else {
            return None;
        };
        let tls = match &config.tls {
            None => None,
            Some(tls) => match &tls.connector {
                TlsConnector::Rustls(connector) => {
                    let name = server
                        .tls_server_name
                        .as_ref()
                        .map_or_else(|| server.host.to_string(), |n| n.to_string());
                    Some((connector.clone(), name))
                }
                #[allow(unreachable_patterns)]
                _ => return None,
            },
        };
        Some(Self {
            host: server.host.to_string(),
            port: server.port,
            tls,
            username: config.username.clone(),
            password: config.password.clone(),
            connect_timeout,
        })
    }
}

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
}

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
        }
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
        match pipe.call(Command::Whole(command)).await {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                pipe.call(Command::Whole(encode_eval("EVAL", body, keys, args)?))
                    .await
            }
            other => other,
        }
    }

    /// Runs `EVALSHA sha keys args` (or `EVAL body …`, as [`Pipes::eval`])
    /// after `ASKING`, on the next connection: where an `ASK` redirection
    /// sent it. Never sent again once written: a connection lost with it
    /// in flight answers an error, as every call here.
    pub async fn eval_asking(&self, sha: &str, body: &str, keys: &[Key], args: &[Value]) -> Reply {
        let pipe = self.pick();
        let command = encode_eval("EVALSHA", sha, keys, args)?;
        match pipe.call(Command::Asking(command)).await {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                pipe.call(Command::Asking(encode_eval("EVAL", body, keys, args)?))
                    .await
            }
            other => other,
        }
    }

    /// Runs `bucket.lua` for one decision (its `keys` and group of `args`),
    /// in a batch with the decisions queued beside it: sent again alone
    /// when its batch could not take it, and with `EVAL` when the server
    /// does not have the script.
    pub async fn decide(&self, keys: &[Key], args: &[Value]) -> Reply {
        let pipe = self.pick();
        let mut alone = false;
        loop {
            let decision = Decision::new(keys, args)?;
            match pipe.call(Command::Decision { decision, alone }).await {
                Err(e) if batch::is_again_alone(&e) && !alone => alone = true,
                Err(e) if e.details().starts_with("NOSCRIPT") => {
                    let body = batch::scripts().single_body;
                    let command = encode_eval("EVAL", body, keys, args)?;
                    return pipe.call(Command::Whole(command)).await;
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

    async fn call(&self, command: Command) -> Reply {
        if !self.up.load(Ordering::Relaxed) {
            return Err(RedisError::new(
                ErrorKind::IO,
                "not connected to Redis (reconnecting)",
            ));
        }
        let (answer, reply) = oneshot::channel();
        self.queue
            .try_send(Call { command, answer })
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

/// A connection's byte stream: TCP, or TLS over it.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A connection to `target`, authenticated, within its connect timeout.
async fn open(target: &Target) -> Result<Box<dyn Io>, RedisError> {
    let io = |e: std::io::Error| RedisError::new(ErrorKind::IO, e.to_string());
    let connect = async {
        let tcp = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .map_err(io)?;
        tcp.set_nodelay(true).map_err(io)?;
        let mut stream: Box<dyn Io> = match &target.tls {
            None => Box::new(tcp),
            Some((connector, name)) => {
                let name = rustls::pki_types::ServerName::try_from(name.clone())
                    .map_err(|e| RedisError::new(ErrorKind::Tls, e.to_string()))?;
                Box::new(connector.connect(name, tcp).await.map_err(io)?)
            }
        };
        if let Some(password) = &target.password {
            let mut auth = vec![b"AUTH".to_vec()];
            if let Some(user) = &target.username {
                auth.push(user.as_bytes().to_vec());
            }
            auth.push(password.as_bytes().to_vec());
            let command = encode(auth.iter().map(Vec::as_slice));
            handshake(&mut stream, &command).await?;
        }
        Ok(stream)
    };
    tokio::time::timeout(target.connect_timeout, connect)
        .await
        .unwrap_or_else(|_| {
            Err(RedisError::new(
                ErrorKind::Timeout,
                "Redis connect timed out",
            ))
        })
}

/// Sends `command` and expects `+OK`.
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    command: &[u8],
) -> Result<(), RedisError> {
    let io = |e: std::io::Error| RedisError::new(ErrorKind::IO, e.to_string());
    stream.write_all(command).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let mut buf = BytesMut::with_capacity(256);
    loop {
        if stream.read_buf(&mut buf).await.map_err(io)? == 0 {
            return Err(RedisError::new(
                ErrorKind::IO,
                "Redis closed the connection",
            ));
        }
        match decode_bytes_mut(&mut buf) {
            Ok(Some((BytesFrame::SimpleString(_), _, _))) => return Ok(()),
            Ok(Some((BytesFrame::Error(e), _, _))) => {
                return Err(RedisError::new(ErrorKind::Auth, e.to_string()))
            }
            Ok(Some(_)) => {
                return Err(RedisError::new(
                    ErrorKind::Protocol,
                    "unexpected reply to AUTH",
                ))
            }
            Ok(None) => {}
            Err(e) => return Err(RedisError::new(ErrorKind::Protocol, e.to_string())),
        }
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
    let pending = parking_lot::Mutex::new(VecDeque::<Waiting>::new());
    // whether this server has the batch script (loaded again after a
    // NOSCRIPT: a flush, a restart behind a proxy)
    let script = AtomicU8::new(BATCH_UNKNOWN);
    let write = async {
        let mut buf = Vec::with_capacity(16 * 1024);
        let mut taken: Vec<Call> = Vec::new();
        let mut group: Vec<(Decision, oneshot::Sender<Reply>)> = Vec::new();
        while let Some(first) = calls.recv().await {
            // let the requests running beside this one queue their calls
            // too: they go out in this write. Twice: the requests a gRPC
            // connection's task hands out in one turn reach the store in
            // the next, so one yield took a fraction of them (primaries'
            // reads per decision at the fleet shape 0.056 with one, 0.032
            // with two; waiting for the queue to stop growing took fewer,
            // as it grows only in the turn after; BENCHMARKS.md)
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
            let mut size = first.command.len();
            taken.push(first);
            // everything else already queued goes in the same write
            while size < MAX_WRITE {
                let Ok(call) = calls.try_recv() else { break };
                size += call.command.len();
                taken.push(call);
            }
            buf.clear();
            {
                let mut waiting = pending.lock();
                let batching = batch > 1 && script.load(Ordering::Relaxed) != BATCH_REFUSED;
                for call in taken.drain(..) {
                    if call.answer.is_closed() {
                        // its caller is gone (its deadline passed, and the
                        // failure mode answered): never written, never spent
                        continue;
                    }
                    match call.command {
                        Command::Decision {
                            decision,
                            alone: false,
                        } if batching => {
                            group.push((decision, call.answer));
                            if group.len() == batch {
                                put_group(&mut buf, &mut waiting, &mut group, &script);
                            }
                        }
                        Command::Decision { decision, .. } => {
                            batch::write_one(&mut buf, &decision);
                            waiting.push_back(Waiting::One(call.answer));
                        }
                        Command::Whole(bytes) => {
                            buf.extend_from_slice(&bytes);
                            waiting.push_back(Waiting::One(call.answer));
                        }
                        Command::Asking(bytes) => {
                            buf.extend_from_slice(ASKING);
                            waiting.push_back(Waiting::Asking);
                            buf.extend_from_slice(&bytes);
                            waiting.push_back(Waiting::One(call.answer));
                        }
                    }
                }
                put_group(&mut buf, &mut waiting, &mut group, &script);
            }
            writes.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = async {
                writer.write_all(&buf).await?;
                writer.flush().await
            }
            .await
            {
                return Err(RedisError::new(ErrorKind::IO, e.to_string()));
            }
        }
        Ok(())
    };
    let read = async {
        let mut buf = BytesMut::with_capacity(16 * 1024);
        loop {
            let n = reader
                .read_buf(&mut buf)
                .await
                .map_err(|e| RedisError::new(ErrorKind::IO, e.to_string()))?;
            if n == 0 {
                return Err(RedisError::new(
                    ErrorKind::IO,
                    "Redis closed the connection",
                ));
            }
            while !buf.is_empty() {
                // what the next reply answers decides how it is read
                let next = match pending.lock().front() {
                    None => {
                        return Err(RedisError::new(
                            ErrorKind::Protocol,
                            "a Redis reply that no call was waiting for",
                        ))
                    }
                    Some(Waiting::One(_)) => Next::One,
                    Some(Waiting::Batch(answers)) => Next::Batch(answers.len()),
                    Some(Waiting::Load) => Next::Load,
                    Some(Waiting::Asking) => Next::Asking,
                };
                match next {
                    Next::One => {
                        let Some(reply) = next_reply(&mut buf)? else {
                            break;
                        };
                        if let Some(Waiting::One(answer)) = pending.lock().pop_front() {
                            let _ = answer.send(reply);
                        }
                    }
                    Next::Asking => {
                        // `+OK`; an error here shows in the command's reply
                        let Some(_) = next_reply(&mut buf)? else {
                            break;
                        };
                        pending.lock().pop_front();
                    }
                    Next::Load => {
                        let Some(loaded) = batch::next_load(&mut buf)? else {
                            break;
                        };
                        pending.lock().pop_front();
                        if !loaded {
                            tracing::info!("Redis refused the batch script (Redis 7 runs it): decisions go one per call");
                            script.store(BATCH_REFUSED, Ordering::Relaxed);
                        }
                    }
                    Next::Batch(count) => {
                        let Some(replies) = batch::next_answers(&mut buf, count)? else {
                            break;
                        };
                        if replies
                            .first()
                            .is_some_and(|r| r.as_ref().is_err_and(batch::is_noscript))
                        {
                            // flushed: loaded again before the next batch
                            let _ = script.compare_exchange(
                                BATCH_LOADED,
                                BATCH_UNKNOWN,
                                Ordering::Relaxed,
                                Ordering::Relaxed,
                            );
                        }
                        if let Some(Waiting::Batch(answers)) = pending.lock().pop_front() {
                            for (answer, reply) in answers.into_iter().zip(replies) {
                                let _ = answer.send(reply);
                            }
                        }
                    }
                }
            }
            if buf.capacity() - buf.len() < 4096 {
                buf.reserve(16 * 1024);
            }
        }
    };
    let ended: Result<(), RedisError> = tokio::select! {
        r = write => r,
        r = read => r,
    };
    if let Err(e) = ended {
        tracing::debug!(error = %e, "Redis connection ended");
    }
    for waiting in std::mem::take(&mut *pending.lock()) {
        match waiting {
            Waiting::One(answer) => {
                let _ = answer.send(Err(lost()));
            }
            Waiting::Batch(answers) => {
                for answer in answers {
                    let _ = answer.send(Err(lost()));
                }
            }
            Waiting::Load | Waiting::Asking => {}
        }
    }
}

/// Writes the decisions in `group` as one call (preceded by the batch
/// script's load, the first time), or alone when there is one, and empties
/// it.
fn put_group(
    buf: &mut Vec<u8>,
    waiting: &mut VecDeque<Waiting>,
    group: &mut Vec<(Decision, oneshot::Sender<Reply>)>,
    script: &AtomicU8,
) {
    match group.len() {
        0 => return,
        1 => {
            let (decision, answer) = group.remove(0);
            batch::write_one(buf, &decision);
            waiting.push_back(Waiting::One(answer));
            return;
        }
        _ => {}
    }
    if script.load(Ordering::Relaxed) == BATCH_UNKNOWN {
        // ahead of the batch on the same connection: run first
        batch::write_load(buf);
        waiting.push_back(Waiting::Load);
        script.store(BATCH_LOADED, Ordering::Relaxed);
    }
    let (decisions, answers): (Vec<Decision>, Vec<_>) = group.drain(..).unzip();
    batch::write_batch(buf, &decisions);
    waiting.push_back(Waiting::Batch(answers));
}

/// `ASKING`, encoded.
const ASKING: &[u8] = b"*1\r\n$6\r\nASKING\r\n";

/// A call written on a connection that failed before its reply came.
fn lost() -> RedisError {
    RedisError::new(
        ErrorKind::IO,
        "the Redis connection was lost before the reply (the call may have run)",
    )
}

#[cfg(test)]
mod target_tests;

/// Against a stand-in server on loopback: what goes out in one write, the
/// order of answers, and a connection lost with calls in flight.
#[cfg(test)]
mod wire_tests;
