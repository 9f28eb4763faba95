//! A unary call's body, read within bounds (docs/operations.md,
//! "Connections and memory").
//!
//! - The declared length is read from the message's prefix as soon as its
//!   five bytes are here: past the limit, the call is refused then, not
//!   once the whole body has come.
//! - A body that comes in one frame (every call Envoy makes: a few hundred
//!   bytes, a frame is at most 16 KiB) is kept as it came. One in several
//!   frames is gathered into one buffer of exactly the prefix and the
//!   declared length, charged to [`RequestMemory`], which all calls share:
//!   past it, a call is answered RESOURCE_EXHAUSTED at once.
//! - The read is bounded in time: by the caller's `grpc-timeout` from the
//!   call's first byte (answered CANCELLED "Timeout expired", as tonic's
//!   server answers), or by [`MAX_BODY_WAIT`] without one.
//!
//! **Layer:** part of `service`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use tonic::Status;

/// A gRPC message's prefix: a compression flag and a length.
pub const PREFIX: usize = 5;

/// How long a call without a `grpc-timeout` may take to send its body.
pub const MAX_BODY_WAIT: Duration = Duration::from_secs(10);

/// Bytes of request bodies gathered from several frames, every call
/// together (64 MiB): a flood of large or slow bodies is refused, not held.
pub const REQUEST_MEMORY: usize = 64 * 1024 * 1024;

/// What bodies being gathered hold, every call together.
pub struct RequestMemory {
    held: AtomicUsize,
    max: usize,
}

impl RequestMemory {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            held: AtomicUsize::new(0),
            max,
        })
    }

    /// `n` bytes more, if they fit; given back when the charge is dropped.
    fn charge(self: &Arc<Self>, n: usize) -> Result<Charge, Status> {
        let before = self.held.fetch_add(n, Ordering::AcqRel);
        if before.saturating_add(n) > self.max {
            self.held.fetch_sub(n, Ordering::AcqRel);
            return Err(Status::resource_exhausted(format!(
                "the service holds {} MiB of request bodies being read, its limit: try again",
                self.max / (1024 * 1024)
            )));
        }
        Ok(Charge {
            memory: self.clone(),
            n,
        })
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// Bytes of [`RequestMemory`] held by one call's body.
pub struct Charge {
    memory: Arc<RequestMemory>,
    n: usize,
}

impl Charge {
    /// Charged `size` in all, if the rest fits.
    fn grow_to(&mut self, size: usize) -> Result<(), Status> {
        if size > self.n {
            let more = self.memory.charge(size - self.n)?;
            self.n = size;
            std::mem::forget(more);
        }
        Ok(())
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.memory.held.fetch_sub(self.n, Ordering::AcqRel);
    }
}

/// A body's bytes and what they are charged (nothing for one frame).
pub struct ReadBody {
    pub bytes: Bytes,
    pub _charge: Option<Charge>,
}

/// The body's bytes, up to one message of `max` bytes and its prefix (and
/// whole messages after it, within the same bound), as the module says.
pub async fn read_body<B>(
    body: B,
    max: usize,
    memory: &Arc<RequestMemory>,
) -> Result<ReadBody, Status>
where
    B: http_body::Body,
    B::Error: std::fmt::Display,
{
    let mut body = std::pin::pin!(body);
    // the first frame as it came, until a second one comes; then all of
    // them gathered
    let mut only: Option<Bytes> = None;
    let mut gathered: Option<(BytesMut, Charge)> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Status::cancelled(format!("reading the request: {e}")))?;
        let Ok(mut data) = frame.into_data() else {
            continue; // trailers: a unary request's metadata is its headers
        };
        let held = match (&only, &gathered) {
            (Some(first), _) => first.len(),
            (None, Some((buffer, _))) => buffer.len(),
            (None, None) => 0,
        };
        let len = held + data.remaining();
        if len > PREFIX + max {
            return Err(too_large(len - PREFIX, max));
        }
        if let Some((buffer, charge)) = &mut gathered {
            if charge.n < len {
                // a prefix cut across the first frames, known now
                let size = match buffer.first_chunk::<PREFIX>() {
                    Some(prefix) if PREFIX + declared_length(prefix) >= len => {
                        PREFIX + declared_length(prefix)
                    }
                    // whole messages after the first: doubled, within the bound
                    Some(_) => (2 * charge.n).clamp(len, PREFIX + max),
                    None => len,
                };
                charge.grow_to(size)?;
                // (`reserve` may double: moved into one of exactly `size`)
                let mut exact = BytesMut::with_capacity(size);
                exact.extend_from_slice(buffer);
                *buffer = exact;
            }
            buffer.put(data);
        } else if let Some(first) = only.take() {
            let size = gathered_size(&first, &data, len, max)?;
            let mut buffer = BytesMut::with_capacity(size);
            let charge = memory.charge(size)?;
            buffer.extend_from_slice(&first);
            buffer.put(data);
            gathered = Some((buffer, charge));
        } else {
            only = Some(data.copy_to_bytes(data.remaining()));
        }
        let seen = match (&only, &gathered) {
            (Some(first), _) => first.as_ref(),
            (None, Some((buffer, _))) => buffer.as_ref(),
            (None, None) => &[],
        };
        declared_within(seen, max)?;
    }
    Ok(match (only, gathered) {
        (Some(bytes), _) => ReadBody {
            bytes,
            _charge: None,
        },
        (None, Some((buffer, charge))) => ReadBody {
            bytes: buffer.freeze(),
            _charge: Some(charge),
        },
        (None, None) => ReadBody {
            bytes: Bytes::new(),
            _charge: None,
        },
    })
}

/// The buffer for a body in several frames: the prefix and the declared
/// length once the prefix is known (from the first frame and the second),
/// else what has come (grown as more comes).
fn gathered_size(first: &Bytes, next: &impl Buf, len: usize, max: usize) -> Result<usize, Status> {
    let mut prefix = [0u8; PREFIX];
    let have = first.len().min(PREFIX);
    prefix[..have].copy_from_slice(&first[..have]);
    let more = (PREFIX - have).min(next.chunk().len());
    prefix[have..have + more].copy_from_slice(&next.chunk()[..more]);
    if have + more < PREFIX {
        return Ok(len);
    }
    let declared = declared_length(&prefix);
    if declared > max {
        return Err(too_large(declared, max));
    }
    Ok((PREFIX + declared).max(len))
}

/// Refuses a first message whose prefix declares more than `max`, as soon
/// as the prefix has come.
fn declared_within(seen: &[u8], max: usize) -> Result<(), Status> {
    let Some(prefix) = seen.first_chunk::<PREFIX>() else {
        return Ok(());
    };
    let declared = declared_length(prefix);
    if declared > max {
        return Err(too_large(declared, max));
    }
    Ok(())
}

/// The length a prefix declares.
pub fn declared_length(prefix: &[u8; PREFIX]) -> usize {
    u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize
}

pub fn too_large(len: usize, max: usize) -> Status {
    Status::out_of_range(format!(
        "Error, decoded message length too large: found {len} bytes, the limit is: {max} bytes"
    ))
}

/// What answers a call whose body did not come within its deadline.
pub fn timed_out() -> Status {
    Status::cancelled("Timeout expired")
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;

    type Frames = StreamBody<
        futures::stream::Iter<
            std::vec::IntoIter<Result<http_body::Frame<Bytes>, std::convert::Infallible>>,
        >,
    >;

    fn frames(parts: Vec<Vec<u8>>) -> Frames {
        let frames: Vec<_> = parts
            .into_iter()
            .map(|p| Ok(http_body::Frame::data(Bytes::from(p))))
            .collect();
        StreamBody::new(futures::stream::iter(frames))
    }

    fn prefix(len: u32) -> Vec<u8> {
        let mut p = vec![0];
        p.extend_from_slice(&len.to_be_bytes());
        p
    }

    #[tokio::test]
    async fn one_frame_is_kept_as_it_came_and_charges_nothing() {
        let memory = RequestMemory::new(1024);
        let mut body = prefix(3);
        body.extend_from_slice(b"abc");
        let read = read_body(frames(vec![body.clone()]), 100, &memory)
            .await
            .map_err(|s| s.code())
            .expect("read");
        assert_eq!(read.bytes.as_ref(), &body[..]);
        assert!(read._charge.is_none());
        assert_eq!(memory.held(), 0);
    }

    #[tokio::test]
    async fn frames_are_gathered_into_exactly_the_declared_size() {
        let memory = RequestMemory::new(1024);
        let parts = vec![prefix(10), b"01234".to_vec(), b"56789".to_vec()];
        let read = read_body(frames(parts), 100, &memory)
            .await
            .map_err(|s| s.code())
            .expect("read");
        assert_eq!(&read.bytes[PREFIX..], b"0123456789");
        assert_eq!(memory.held(), PREFIX + 10, "charged while held");
        drop(read);
        assert_eq!(memory.held(), 0, "given back");
    }

    #[tokio::test]
    async fn a_declared_length_past_the_limit_is_refused_at_its_prefix() {
        let memory = RequestMemory::new(1 << 20);
        // the prefix alone, then a frame that never comes: refused at once
        use futures::StreamExt;
        type Frame = Result<http_body::Frame<Bytes>, std::convert::Infallible>;
        let first: Frame = Ok(http_body::Frame::data(Bytes::from(prefix(1000))));
        let body = StreamBody::new(
            futures::stream::iter(vec![first]).chain(futures::stream::pending::<Frame>()),
        );
        let refused = tokio::time::timeout(Duration::from_secs(5), read_body(body, 100, &memory))
            .await
            .expect("refused without waiting for the body");
        assert_eq!(
            refused.err().map(|s| s.code()),
            Some(tonic::Code::OutOfRange)
        );
    }

    #[tokio::test]
    async fn a_body_is_read_across_its_frames_up_to_the_limit() {
        let memory = RequestMemory::new(1024);
        let read = |parts: Vec<&[u8]>, max| {
            let memory = memory.clone();
            let parts: Vec<Vec<u8>> = parts.into_iter().map(<[u8]>::to_vec).collect();
            async move {
                read_body(frames(parts), max, &memory)
                    .await
                    .map(|r| r.bytes)
                    .map_err(|s| s.code())
            }
        };
        let one = read(vec![b"\0\0\0\0\x02ab"], 10).await;
        assert_eq!(one.as_deref(), Ok(&b"\0\0\0\0\x02ab"[..]));
        let cut = read(vec![b"\0\0", b"\0\0\x02", b"a", b"b"], 10).await;
        assert_eq!(
            cut.as_deref(),
            Ok(&b"\0\0\0\0\x02ab"[..]),
            "a prefix cut in two"
        );
        assert_eq!(read(vec![], 10).await.map(|b| b.len()), Ok(0));
        let over = read(vec![b"\0\0\0\0\x03", b"abc"], 2).await;
        assert_eq!(over, Err(tonic::Code::OutOfRange));
    }

    #[tokio::test]
    async fn bodies_past_the_shared_memory_are_refused_at_once() {
        let memory = RequestMemory::new(30);
        let held = read_body(frames(vec![prefix(20), vec![7; 20]]), 100, &memory)
            .await
            .map_err(|s| s.code())
            .expect("the first fits");
        assert_eq!(memory.held(), 25);
        let refused = read_body(frames(vec![prefix(20), vec![7; 20]]), 100, &memory).await;
        assert_eq!(
            refused.err().map(|s| s.code()),
            Some(tonic::Code::ResourceExhausted)
        );
        drop(held);
        assert!(
            read_body(frames(vec![prefix(20), vec![7; 20]]), 100, &memory)
                .await
                .is_ok()
        );
    }
}
