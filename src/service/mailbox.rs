//! One RLQS stream's outbox: the assignments not yet written to its Envoy.
//!
//! **The newest per bucket.** An assignment replaces the one before it for
//! the same bucket (Envoy would replace it too), so what waits for a client
//! that does not read is at most one action per bucket it holds, not every
//! message ever planned for it.
//!
//! **Bounded.** At most [`MAX_STREAM_BYTES`] per stream and
//! [`MAX_TOTAL_BYTES`] over all streams; an action past either is dropped
//! and counted by the caller (what Envoy holds then expires, and the split
//! counts it as live until it does). A stream's memory goes with it.
//!
//! **Never late.** An assignment is written with its time to live shortened
//! by how long it waited here beyond [`WAIT_ALLOWANCE_MICROS`], and dropped
//! once that has passed: what Envoy enforces never outlives what the split
//! counts as live (the time to live and [`crate::quota::LIVE_MARGIN_MICROS`]
//! from when it was planned). A time to live in whole seconds stays whole:
//! Envoy 1.40 drops the fraction, so 3 s shortened by a few microseconds
//! of waiting reached it as 2 s, and an assignment refreshed every one to
//! two seconds lapsed between refreshes (Envoy then applied its expired
//! or no-assignment behaviour until the next arrived, issue 56).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::{
    bucket_action, BucketAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse;
use parking_lot::Mutex;
use prost::Message;
use tokio::sync::Notify;
use tonic::Status;

use crate::quota::assignment::{duration, micros_of, MAX_MESSAGE_BYTES};

/// Bytes of actions one stream may have waiting (encoded): one plan for
/// the most buckets a stream holds (20,000) with long ids fits.
pub const MAX_STREAM_BYTES: usize = 8 * 1024 * 1024;
/// Bytes of actions all streams together may have waiting.
pub const MAX_TOTAL_BYTES: usize = 256 * 1024 * 1024;

/// A wait in the outbox this short does not shorten what is written: the
/// split counts an assignment live [`crate::quota::LIVE_MARGIN_MICROS`]
/// (500 ms) past its time to live, half of which is left for the way to
/// Envoy.
pub const WAIT_ALLOWANCE_MICROS: u64 = 250_000;

/// What the writer hands the stream next.
pub type Reply = Result<RateLimitQuotaResponse, Status>;

/// An action waiting, and when it was queued.
struct Queued {
    action: BucketAction,
    queued_micros: u64,
    bytes: usize,
}

#[derive(Default)]
struct Inner {
    /// By the bucket id's canonical text.
    pending: HashMap<String, Queued>,
    bytes: usize,
    /// An error to end the stream with, once what is pending is written.
    error: Option<Status>,
    closed: bool,
}

/// One stream's outbox; see the module's doc.
pub struct Mailbox {
    inner: Mutex<Inner>,
    /// Wakes the writer: something to write, or the end.
    ready: Notify,
    /// Wakes a reporter waiting for room.
    room: Notify,
    /// Bytes waiting in every mailbox.
    total: Arc<AtomicUsize>,
}

/// How a put went.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Put {
    pub queued: usize,
    /// Dropped: past the stream's or the total bound.
    pub dropped: usize,
}

/// A bucket id as one text, whatever the order of its pairs.
fn bucket_name(action: &BucketAction) -> String {
    let mut pairs: Vec<(&String, &String)> = action
        .bucket_id
        .as_ref()
        .map(|id| id.bucket.iter().collect())
        .unwrap_or_default();
    pairs.sort_unstable();
    let mut name = String::new();
    for (k, v) in pairs {
        name.push_str(k);
        name.push('\u{1e}');
        name.push_str(v);
        name.push('\u{1f}');
    }
    name
}

impl Mailbox {
    /// An empty outbox counting its bytes in `total` too.
    pub fn new(total: Arc<AtomicUsize>) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            ready: Notify::new(),
            room: Notify::new(),
            total,
        }
    }

    /// Queues `actions` at `now_micros`, each replacing what waits for its
    /// bucket; past the bounds an action is dropped.
    pub fn put(&self, actions: Vec<BucketAction>, now_micros: u64) -> Put {
        let mut put = Put::default();
        {
            let mut inner = self.inner.lock();
            if inner.closed {
                return put;
            }
            for action in actions {
                let bytes = action.encoded_len() + 8;
                let name = bucket_name(&action);
                let before = inner.pending.get(&name).map_or(0, |q| q.bytes);
                let grows = bytes.saturating_sub(before);
                if grows > 0
                    && (inner.bytes + grows > MAX_STREAM_BYTES
                        || self.total.load(Ordering::Relaxed) + grows > MAX_TOTAL_BYTES)
                {
                    put.dropped += 1;
                    continue;
                }
                inner.bytes = inner.bytes + bytes - before;
                self.total.fetch_add(bytes, Ordering::Relaxed);
                self.total.fetch_sub(before, Ordering::Relaxed);
                inner.pending.insert(
                    name,
                    Queued {
                        action,
                        queued_micros: now_micros,
                        bytes,
                    },
                );
                put.queued += 1;
            }
        }
        if put.queued > 0 {
            self.ready.notify_one();
        }
        put
    }

    /// Bytes waiting.
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }

    /// Waits while more than half the stream's bound waits to be written
    /// (a reporter's next report is read only then: HTTP/2 flow control
    /// holds a client that does not read).
    pub async fn wait_for_room(&self) {
        loop {
            let notified = self.room.notified();
            {
                let inner = self.inner.lock();
                if inner.closed || inner.bytes <= MAX_STREAM_BYTES / 2 {
                    return;
                }
            }
            notified.await;
        }
    }

    /// Ends the stream with `status` once what is pending is written.
    pub fn fail(&self, status: Status) {
        self.inner.lock().error = Some(status);
        self.ready.notify_one();
    }

    /// Ends the stream now: what is pending is dropped.
    pub fn close(&self) {
        {
            let mut inner = self.inner.lock();
            inner.closed = true;
            self.total.fetch_sub(inner.bytes, Ordering::Relaxed);
            inner.bytes = 0;
            inner.pending = HashMap::new();
        }
        self.ready.notify_one();
        self.room.notify_waiters();
    }

    /// What to write at `now_micros`: every action waiting (up to a
    /// message's bound), assignments' times to live shortened by their
    /// wait and those whose time has passed dropped (their count in the
    /// second place); `None` while nothing waits.
    pub fn take(&self, now_micros: u64) -> (Option<RateLimitQuotaResponse>, usize) {
        let mut inner = self.inner.lock();
        let mut message = RateLimitQuotaResponse::default();
        let mut size = 0;
        let mut expired = 0;
        let names: Vec<String> = inner.pending.keys().cloned().collect();
        for name in names {
            if size >= MAX_MESSAGE_BYTES && !message.bucket_action.is_empty() {
                break;
            }
            let Some(mut q) = inner.pending.remove(&name) else {
                continue;
            };
            inner.bytes -= q.bytes;
            self.total.fetch_sub(q.bytes, Ordering::Relaxed);
            let waited = now_micros.saturating_sub(q.queued_micros);
            if let Some(bucket_action::BucketAction::QuotaAssignmentAction(a)) =
                &mut q.action.bucket_action
            {
                let sent = a.assignment_time_to_live.unwrap_or_default();
                if waited > WAIT_ALLOWANCE_MICROS {
                    let mut left = micros_of(&sent).saturating_sub(waited - WAIT_ALLOWANCE_MICROS);
                    if sent.nanos == 0 {
                        // Envoy's whole seconds: rounded down, never up
                        left -= left % 1_000_000;
                    }
                    if left == 0 {
                        expired += 1;
                        continue;
                    }
                    a.assignment_time_to_live = Some(duration(left));
                }
            }
            size += q.bytes;
            message.bucket_action.push(q.action);
        }
        drop(inner);
        self.room.notify_waiters();
        (
            (!message.bucket_action.is_empty()).then_some(message),
            expired,
        )
    }

    /// The next thing to write: a message, the error that ends the stream,
    /// or `None` once closed. `now` tells the time; `expired` counts
    /// assignments dropped for having waited past their time to live.
    pub async fn next(&self, now: impl Fn() -> u64, expired: impl Fn(usize)) -> Option<Reply> {
        loop {
            let notified = self.ready.notified();
            let (message, dropped) = self.take(now());
            if dropped > 0 {
                expired(dropped);
            }
            if let Some(message) = message {
                return Some(Ok(message));
            }
            {
                let mut inner = self.inner.lock();
                if let Some(status) = inner.error.take() {
                    inner.closed = true;
                    return Some(Err(status));
                }
                if inner.closed {
                    return None;
                }
            }
            notified.await;
        }
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        self.total
            .fetch_sub(self.inner.get_mut().bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;
    use envoy_types::pb::google::protobuf::Duration as PbDuration;

    const S: u64 = 1_000_000;

    fn assign(key: &str, tokens: u32, ttl_secs: i64) -> BucketAction {
        let strategy = crate::quota::token_bucket(crate::quota::allocation::Budget {
            burst: f64::from(tokens),
            rate: f64::from(tokens),
        });
        BucketAction {
            bucket_id: Some(BucketId {
                bucket: [("k".to_string(), key.to_string())].into_iter().collect(),
            }),
            bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(
                bucket_action::QuotaAssignmentAction {
                    assignment_time_to_live: Some(PbDuration {
                        seconds: ttl_secs,
                        nanos: 0,
                    }),
                    rate_limit_strategy: Some(
                        envoy_types::pb::envoy::r#type::v3::RateLimitStrategy {
                            strategy: Some(strategy),
                        },
                    ),
                },
            )),
        }
    }

    fn ttl_of(a: &BucketAction) -> u64 {
        match &a.bucket_action {
            Some(bucket_action::BucketAction::QuotaAssignmentAction(q)) => {
                q.assignment_time_to_live.as_ref().map_or(0, micros_of)
            }
            _ => 0,
        }
    }

    /// A client that does not read holds one action per bucket, the newest.
    #[test]
    fn the_newest_action_per_bucket_waits() {
        let total = Arc::new(AtomicUsize::new(0));
        let m = Mailbox::new(total.clone());
        for round in 0..100 {
            m.put(vec![assign("a", round, 15), assign("b", round, 15)], S);
        }
        let one = assign("a", 99, 15).encoded_len() + 8;
        assert!(m.bytes() <= 2 * (one + 4), "{} bytes", m.bytes());
        assert_eq!(total.load(Ordering::Relaxed), m.bytes());
        let (message, expired) = m.take(S);
        let message = message.expect("two actions");
        assert_eq!((message.bucket_action.len(), expired), (2, 0));
        assert_eq!(m.bytes(), 0);
        assert_eq!(total.load(Ordering::Relaxed), 0);
    }

    /// An assignment that waited is sent with what is left of its time to
    /// live, in whole seconds, or not at all.
    #[test]
    fn an_assignment_is_sent_with_what_is_left_of_its_time_to_live() {
        let m = Mailbox::new(Arc::default());
        m.put(vec![assign("a", 5, 15)], S);
        m.put(vec![assign("b", 5, 3)], S);
        let (message, expired) = m.take(5 * S);
        let message = message.expect("one left");
        assert_eq!(expired, 1, "b waited past its 3 s");
        assert_eq!(message.bucket_action.len(), 1);
        // 4 s waited, 250 ms of it allowed: 11.25 s left, 11 whole
        assert_eq!(ttl_of(&message.bucket_action[0]), 11 * S);
    }

    /// A wait within the allowance keeps the whole time to live: 3 s
    /// shortened by microseconds reached Envoy as 2 s (it drops fractions).
    #[test]
    fn a_short_wait_keeps_the_whole_seconds() {
        let m = Mailbox::new(Arc::default());
        m.put(vec![assign("a", 5, 3)], S);
        let (message, _) = m.take(S + 40);
        let a = &message.expect("sent").bucket_action[0];
        assert_eq!(ttl_of(a), 3 * S);
        m.put(vec![assign("a", 5, 3)], S);
        let (message, _) = m.take(S + WAIT_ALLOWANCE_MICROS + 1);
        assert_eq!(ttl_of(&message.expect("sent").bucket_action[0]), 2 * S);
    }

    /// Past the stream's bound, actions for new buckets are dropped.
    #[test]
    fn a_stream_holds_at_most_its_bound() {
        let total = Arc::new(AtomicUsize::new(0));
        let m = Mailbox::new(total.clone());
        let mut dropped = 0;
        for i in 0..300_000 {
            dropped += m.put(vec![assign(&format!("key-{i}"), 5, 15)], S).dropped;
        }
        assert!(m.bytes() <= MAX_STREAM_BYTES);
        assert!(dropped > 0);
        drop(m);
        assert_eq!(total.load(Ordering::Relaxed), 0, "given back");
    }
}
