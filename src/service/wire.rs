//! `ShouldRateLimit` on the wire, read leniently: a request whose strings
//! are not UTF-8 is decided, not failed.
//!
//! Envoy copies header bytes into descriptor values as they came, and a
//! header may carry bytes that are not UTF-8 (obs-text). Decoded as
//! protobuf `string`s, such a request fails as a whole (`INTERNAL`), and
//! Envoy's failure mode answers for every limit it carried: with
//! `failure_mode_deny: false`, a client that adds one such byte to a
//! header passes every limit. Here the request's strings are read as
//! bytes (the same wire type): UTF-8 without NUL is itself; anything else
//! is written marked, a NUL first, then each byte that is not part of
//! valid UTF-8 as `\xNN` (its value in hex), a NUL as `\x00` and a
//! backslash as `\\`, so that the descriptor is decided as any other, by
//! a value its sender alone can produce: no text sent as UTF-8 reads the
//! same. Every listener reads `ShouldRateLimit` through this decoder. Rules
//! match the text after the mark (`rules::matcher`), so that `team-*`
//! still meets `team-` and a byte that is not UTF-8.
//!
//! [`RateLimitServer`] serves the method as the generated server does
//! (same path, size limit, no compression, the same statuses for a
//! malformed call), with this decoder, and frames the unary call itself:
//! the request's one message is read from the body's frames as they came
//! (a single frame is not copied), the answer is one frame and its
//! `grpc-status` trailer. tonic's generic unary machinery (a decoding
//! stream with its own buffer, an encoding stream, three boxed futures)
//! cost more per call than the decision itself (BENCHMARKS.md, "the gRPC
//! stack per call").
//!
//! **Layer:** part of `service`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use futures::future::BoxFuture;
use prost::Message;
use tonic::codegen::http;
use tonic::Status;

use super::body::{
    declared_length, timed_out, too_large, ReadBody, RequestMemory, MAX_BODY_WAIT, PREFIX,
    REQUEST_MEMORY,
};

/// The gRPC path of the method.
pub const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// `RateLimitRequest` with its strings as bytes (wire-compatible).
#[derive(Clone, PartialEq, Message)]
struct RawRequest {
    #[prost(bytes = "vec", tag = "1")]
    domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<RawDescriptor>,
    #[prost(uint32, tag = "3")]
    hits_addend: u32,
}

#[derive(Clone, PartialEq, Message)]
struct RawDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<RawEntry>,
    #[prost(message, optional, tag = "2")]
    limit: Option<RateLimitOverride>,
    #[prost(message, optional, tag = "3")]
    hits_addend: Option<UInt64Value>,
    #[prost(bool, tag = "4")]
    is_negative_hits: bool,
}

#[derive(Clone, PartialEq, Message)]
struct RawEntry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// `bytes` as text: itself when UTF-8 without NUL, else [`marked`].
pub fn lenient_text(bytes: Vec<u8>) -> String {
    match String::from_utf8(bytes) {
        Ok(text) if !text.contains('\0') => text,
        Ok(text) => marked(text.as_bytes()),
        Err(e) => marked(&e.into_bytes()),
    }
}

/// A NUL, then `bytes` escaped one to one: `\` as `\\`, NUL as `\x00`,
/// a byte outside valid UTF-8 as `\xNN`. Injective, and never the same
/// as a text without NUL.
fn marked(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() + 8);
    out.push('\0');
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '\0' => out.push_str("\\x00"),
                c => out.push(c),
            }
        }
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02X}");
        }
    }
    out
}

impl From<RawRequest> for RateLimitRequest {
    fn from(raw: RawRequest) -> Self {
        RateLimitRequest {
            domain: lenient_text(raw.domain),
            descriptors: raw
                .descriptors
                .into_iter()
                .map(|d| RateLimitDescriptor {
                    entries: d
                        .entries
                        .into_iter()
                        .map(|e| Entry {
                            key: lenient_text(e.key),
                            value: lenient_text(e.value),
                        })
                        .collect(),
                    limit: d.limit,
                    hits_addend: d.hits_addend,
                    is_negative_hits: d.is_negative_hits,
                })
                .collect(),
            hits_addend: raw.hits_addend,
        }
    }
}

/// `RateLimitService` served with [`LenientCodec`]; other paths are
/// answered `UNIMPLEMENTED`, as the generated server does.
pub struct RateLimitServer<T> {
    inner: Arc<T>,
    max_decoding_message_size: usize,
    memory: Arc<RequestMemory>,
}

impl<T> Clone for RateLimitServer<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            max_decoding_message_size: self.max_decoding_message_size,
            memory: self.memory.clone(),
        }
    }
}

impl<T: RateLimitService> RateLimitServer<T> {
    pub fn new(inner: T, max_decoding_message_size: usize) -> Self {
        Self {
            inner: Arc::new(inner),
            max_decoding_message_size,
            memory: RequestMemory::new(REQUEST_MEMORY),
        }
    }
}

impl<T> tonic::server::NamedService for RateLimitServer<T> {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

impl<T, B> tonic::codegen::Service<http::Request<B>> for RateLimitServer<T>
where
    T: RateLimitService,
    B: http_body::Body + Send + 'static,
    B::Error: std::fmt::Display,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != PATH {
            return Box::pin(async move {
                Ok(Status::unimplemented("").into_http::<tonic::body::Body>())
            });
        }
        let inner = self.inner.clone();
        let max = self.max_decoding_message_size;
        let memory = self.memory.clone();
        Box::pin(async move {
            let answer = match read_request(req, max, &memory).await {
                // (the body's bytes are held until the answer)
                Ok((request, _body)) => inner.should_rate_limit(request).await,
                Err(status) => Err(status),
            };
            Ok(match answer {
                Ok(response) => respond(response),
                Err(status) => status.into_http(),
            })
        })
    }
}

/// The call's one message, read leniently, with the call's metadata (the
/// service reads `grpc-timeout` and a trace's parent from it), and what
/// its body holds of [`RequestMemory`].
async fn read_request<B>(
    req: http::Request<B>,
    max: usize,
    memory: &Arc<RequestMemory>,
) -> Result<(tonic::Request<RateLimitRequest>, ReadBody), Status>
where
    B: http_body::Body,
    B::Error: std::fmt::Display,
{
    if let Some(encoding) = req.headers().get("grpc-encoding") {
        if encoding.as_bytes() != b"identity" {
            let mut status = Status::unimplemented(format!(
                "Content is compressed with `{}` which isn't supported",
                String::from_utf8_lossy(encoding.as_bytes())
            ));
            status.metadata_mut().insert(
                "grpc-accept-encoding",
                tonic::metadata::MetadataValue::from_static("identity"),
            );
            return Err(status);
        }
    }
    let (mut parts, body) = req.into_parts();
    let read = read_in_time(body, max, memory, &mut parts.headers).await?;
    let message = one_message(&read.bytes, max)?;
    let raw = RawRequest::decode(message)
        .map_err(|e| Status::internal(format!("decoding the request: {e}")))?;
    let request = tonic::Request::from_http(http::Request::from_parts(
        parts,
        RateLimitRequest::from(raw),
    ));
    Ok((request, read))
}

/// The body, read within the caller's deadline (`grpc-timeout`, from the
/// call's first byte) or [`MAX_BODY_WAIT`]. A body that came with its
/// headers (every call Envoy makes) is read without a timer; one that did
/// not leaves the decision what is left of the deadline (`headers`'
/// `grpc-timeout` is set to it).
async fn read_in_time<B>(
    body: B,
    max: usize,
    memory: &Arc<RequestMemory>,
    headers: &mut http::HeaderMap,
) -> Result<ReadBody, Status>
where
    B: http_body::Body,
    B::Error: std::fmt::Display,
{
    let mut read = std::pin::pin!(super::body::read_body(body, max, memory));
    if let Poll::Ready(read) = futures::poll!(read.as_mut()) {
        return read;
    }
    let began = std::time::Instant::now();
    let deadline = headers
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(super::request::parse_grpc_timeout);
    let read = tokio::time::timeout(deadline.unwrap_or(MAX_BODY_WAIT), read)
        .await
        .map_err(|_| timed_out())??;
    if let Some(deadline) = deadline {
        let left = deadline.saturating_sub(began.elapsed());
        if let Ok(value) = http::HeaderValue::from_str(&super::request::grpc_timeout_text(left)) {
            headers.insert("grpc-timeout", value);
        }
    }
    Ok(read)
}

/// The first message of a unary call's body. What follows it must be
/// whole messages too, which are not read (tonic's server decoded and
/// dropped them).
fn one_message(bytes: &[u8], max: usize) -> Result<&[u8], Status> {
    if bytes.is_empty() {
        return Err(Status::internal("Missing request message."));
    }
    let (first, mut rest) = next_message(bytes, max)?;
    while !rest.is_empty() {
        rest = next_message(rest, max)?.1;
    }
    Ok(first)
}

/// The message at the start of `bytes`, and what follows it.
fn next_message(bytes: &[u8], max: usize) -> Result<(&[u8], &[u8]), Status> {
    let eof = || Status::internal("Unexpected EOF decoding stream.");
    let (prefix, rest) = bytes.split_first_chunk::<PREFIX>().ok_or_else(eof)?;
    match prefix[0] {
        0 => {}
        1 => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ))
        }
        flag => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {flag} (valid flags are 0 and 1)"
            )))
        }
    }
    let len = declared_length(prefix);
    if len > max {
        return Err(too_large(len, max));
    }
    if rest.len() < len {
        return Err(eof());
    }
    Ok(rest.split_at(len))
}

/// The answer as a unary gRPC response: its metadata and content type, one
/// frame, then `grpc-status: 0`.
fn respond(response: tonic::Response<RateLimitResponse>) -> http::Response<tonic::body::Body> {
    let (metadata, message, _) = response.into_parts();
    let len = message.encoded_len();
    let mut frame = BytesMut::with_capacity(PREFIX + len);
    frame.put_u8(0);
    frame.put_u32(len as u32);
    // cannot fail: the buffer holds `len` bytes more
    let _ = message.encode(&mut frame);
    let mut answer = http::Response::new(tonic::body::Body::new(UnaryBody {
        message: Some(frame.freeze()),
        trailers: true,
    }));
    *answer.headers_mut() = metadata.into_headers();
    answer.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    answer
}

/// A unary answer's body: its message, then the OK status as trailers.
struct UnaryBody {
    message: Option<Bytes>,
    trailers: bool,
}

impl http_body::Body for UnaryBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if let Some(message) = self.message.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(message))));
        }
        if std::mem::take(&mut self.trailers) {
            let mut trailers = http::HeaderMap::with_capacity(1);
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            return Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.message.is_none() && !self.trailers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_that_is_not_utf8_keeps_every_byte_apart() {
        assert_eq!(lenient_text(b"alice".to_vec()), "alice");
        assert_eq!(lenient_text("zoë".as_bytes().to_vec()), "zoë");
        assert_eq!(lenient_text(b"a\xffb".to_vec()), "\0a\\xFFb");
        assert_eq!(lenient_text(b"\xc3".to_vec()), "\0\\xC3", "a cut sequence");
        assert_ne!(
            lenient_text(b"\xfe".to_vec()),
            lenient_text(b"\xff".to_vec())
        );
    }

    #[test]
    fn no_text_reads_as_a_byte_it_does_not_hold() {
        // the raw byte and the text that spells its escape stay apart
        let raw = lenient_text(b"team-\xfe".to_vec());
        let typed = lenient_text(b"team-\\xFE".to_vec());
        assert_ne!(raw, typed);
        assert_eq!(typed, "team-\\xFE", "UTF-8 without NUL is itself");
        // marked forms are escaped one to one
        assert_ne!(
            lenient_text(b"\\\xfe".to_vec()),
            lenient_text(b"\\\\xFE\xff".to_vec())
        );
        assert_ne!(
            lenient_text(b"a\0".to_vec()),
            lenient_text(b"a\\x00\xff".to_vec())
        );
        // a NUL in text sent as UTF-8 is marked too
        assert_eq!(lenient_text(b"a\0b".to_vec()), "\0a\\x00b");
    }

    fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    #[test]
    fn a_body_gives_its_first_message_when_all_of_it_is_whole_messages() {
        fn code(r: Result<&[u8], Status>) -> Result<&[u8], tonic::Code> {
            r.map_err(|s| s.code())
        }
        assert_eq!(code(one_message(&framed(0, b"abc"), 10)), Ok(&b"abc"[..]));
        assert_eq!(code(one_message(&framed(0, b""), 10)), Ok(&b""[..]));
        let two = [framed(0, b"abc"), framed(0, b"de")].concat();
        assert_eq!(code(one_message(&two, 10)), Ok(&b"abc"[..]));
        for bad in [
            vec![],
            vec![0, 0, 0],
            framed(0, b"abc")[..7].to_vec(),
            [framed(0, b"abc"), vec![0, 0]].concat(),
            [framed(0, b"abc"), framed(1, b"x")].concat(),
            framed(1, b"abc"),
            framed(2, b"abc"),
        ] {
            assert_eq!(
                code(one_message(&bad, 10)),
                Err(tonic::Code::Internal),
                "{bad:?}"
            );
        }
        assert_eq!(
            code(one_message(&framed(0, b"abc"), 2)),
            Err(tonic::Code::OutOfRange)
        );
        let over = [framed(0, b"a"), framed(0, b"abc")].concat();
        assert_eq!(code(one_message(&over, 2)), Err(tonic::Code::OutOfRange));
    }

    #[test]
    fn a_request_decodes_as_the_generated_type_does() {
        let request = RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                limit: Some(RateLimitOverride {
                    requests_per_unit: 3,
                    unit: 2,
                }),
                hits_addend: Some(UInt64Value { value: 7 }),
                is_negative_hits: true,
            }],
            hits_addend: 4,
        };
        let raw = RawRequest::decode(request.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(RateLimitRequest::from(raw), request);
    }
}
