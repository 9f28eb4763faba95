//! A pipelined connection's writer: takes every call queued since it last
//! woke, encodes them into one buffer (decisions in batches of the batch
//! script) and sends it in one write, recording what each reply will
//! answer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use fred::error::{Error as RedisError, ErrorKind};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::pending::{Pending, Waiting, BATCH_LOADED, BATCH_REFUSED, BATCH_UNKNOWN};
use crate::replication::Replication;
use crate::store::redis::batch::{self, Decision};
use crate::store::redis::resp::Reply;

/// One write carries at most about this many bytes; more calls wait for
/// the next (a bound on the buffer, not on throughput).
const MAX_WRITE: usize = 256 * 1024;

/// A call queued for the writer, and where its reply goes.
pub(super) struct Call {
    pub(super) command: Command,
    pub(super) answer: oneshot::Sender<Reply>,
    /// A rule's `replication:`: never batched, and the write it goes in
    /// ends with `WAIT`, whose count its reply gets at its end.
    pub(super) wait: Option<Replication>,
}

/// What a call sends.
pub(super) enum Command {
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

/// Writes what is queued until the queue closes or a write fails; the
/// decisions of one write go out in batches of up to `batch` ([`batch`]).
pub(super) async fn write_calls<W: AsyncWrite + Unpin>(
    writer: &mut W,
    calls: &mut mpsc::Receiver<Call>,
    pending: &Pending,
    script: &AtomicU8,
    writes: &AtomicUsize,
    batch: usize,
) -> Result<(), RedisError> {
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
        // the most replicas and the longest timeout of the calls with
        // `replication:` in this write: one `WAIT` after them all
        let mut wait: Option<Replication> = None;
        {
            let mut waiting = pending.lock();
            let batching = batch > 1 && script.load(Ordering::Relaxed) != BATCH_REFUSED;
            for call in taken.drain(..) {
                if call.answer.is_closed() {
                    // its caller is gone (its deadline passed, and the
                    // failure mode answered): never written, never spent
                    continue;
                }
                if let Some(w) = call.wait {
                    write_held(&mut buf, &mut waiting, call.command, call.answer);
                    wait = Some(wait.map_or(w, |before: Replication| Replication {
                        replicas: before.replicas.max(w.replicas),
                        timeout: before.timeout.max(w.timeout),
                    }));
                    continue;
                }
                match call.command {
                    Command::Decision {
                        decision,
                        alone: false,
                    } if batching => {
                        group.push((decision, call.answer));
                        if group.len() == batch {
                            put_group(&mut buf, &mut waiting, &mut group, script);
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
            put_group(&mut buf, &mut waiting, &mut group, script);
            if let Some(w) = wait.take() {
                put_wait(&mut buf, w);
                waiting.push_back(Waiting::Wait);
            }
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

/// A call whose reply waits for the write's `WAIT`: written alone (a
/// decision never batched), its reply held by the reader until then.
fn write_held(
    buf: &mut Vec<u8>,
    waiting: &mut VecDeque<Waiting>,
    command: Command,
    answer: oneshot::Sender<Reply>,
) {
    match command {
        Command::Decision { decision, .. } => batch::write_one(buf, &decision),
        Command::Whole(bytes) => buf.extend_from_slice(&bytes),
        Command::Asking(bytes) => {
            buf.extend_from_slice(ASKING);
            waiting.push_back(Waiting::Asking);
            buf.extend_from_slice(&bytes);
        }
    }
    waiting.push_back(Waiting::Held(answer));
}

/// `WAIT <replicas> <timeout ms>`, encoded: answered with how many
/// replicas acknowledged every write made before it on this connection.
fn put_wait(buf: &mut Vec<u8>, w: Replication) {
    let replicas = w.replicas.to_string();
    let timeout = w.timeout_ms().to_string();
    buf.extend_from_slice(b"*3\r\n$4\r\nWAIT\r\n");
    for arg in [replicas, timeout] {
        buf.extend_from_slice(format!("${}\r\n{arg}\r\n", arg.len()).as_bytes());
    }
}

/// `ASKING`, encoded.
const ASKING: &[u8] = b"*1\r\n$6\r\nASKING\r\n";
