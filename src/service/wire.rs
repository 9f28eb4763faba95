//! `ShouldRateLimit` on the wire, read leniently: a request whose strings
//! are not UTF-8 is decided, not failed.
//!
//! Envoy copies header bytes into descriptor values as they came, and a
//! header may carry bytes that are not UTF-8 (obs-text). Decoded as
//! protobuf `string`s, such a request fails as a whole (`INTERNAL`), and
//! Envoy's failure mode answers for every limit it carried: with
//! `failure_mode_deny: false`, a client that adds one such byte to a
//! header passes every limit. Here the request's strings are read as
//! bytes (the same wire type) and each byte that is not part of valid
//! UTF-8 is written `\xNN` (its value in hex), so that the descriptor is
//! decided as any other, by a value its sender alone can produce.
//!
//! [`RateLimitServer`] serves the method as the generated server does
//! (same path, sizes and compression), with this decoder.
//!
//! **Layer:** part of `service`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use futures::future::BoxFuture;
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http;
use tonic::Status;

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

/// `bytes` as text: itself when UTF-8, else each invalid byte as `\xNN`.
pub fn lenient_text(bytes: Vec<u8>) -> String {
    match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            let bytes = e.into_bytes();
            let mut out = String::with_capacity(bytes.len() + 8);
            for chunk in bytes.utf8_chunks() {
                out.push_str(chunk.valid());
                for b in chunk.invalid() {
                    let _ = write!(out, "\\x{b:02X}");
                }
            }
            out
        }
    }
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

/// Decodes requests leniently ([`RawRequest`]), encodes answers as prost.
#[derive(Debug, Clone, Copy, Default)]
pub struct LenientCodec;

#[derive(Debug, Clone, Copy, Default)]
pub struct ResponseEncoder;

#[derive(Debug, Clone, Copy, Default)]
pub struct LenientDecoder;

impl Codec for LenientCodec {
    type Encode = RateLimitResponse;
    type Decode = RateLimitRequest;
    type Encoder = ResponseEncoder;
    type Decoder = LenientDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        ResponseEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        LenientDecoder
    }
}

impl Encoder for ResponseEncoder {
    type Item = RateLimitResponse;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(format!("encoding the answer: {e}")))
    }
}

impl Decoder for LenientDecoder {
    type Item = RateLimitRequest;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        RawRequest::decode(src)
            .map(|raw| Some(raw.into()))
            .map_err(|e| Status::internal(format!("decoding the request: {e}")))
    }
}

/// `RateLimitService` served with [`LenientCodec`]; other paths are
/// answered `UNIMPLEMENTED`, as the generated server does.
pub struct RateLimitServer<T> {
    inner: Arc<T>,
    max_decoding_message_size: usize,
}

impl<T> Clone for RateLimitServer<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            max_decoding_message_size: self.max_decoding_message_size,
        }
    }
}

impl<T: RateLimitService> RateLimitServer<T> {
    pub fn new(inner: T, max_decoding_message_size: usize) -> Self {
        Self {
            inner: Arc::new(inner),
            max_decoding_message_size,
        }
    }
}

impl<T> tonic::server::NamedService for RateLimitServer<T> {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

struct Method<T>(Arc<T>);

impl<T: RateLimitService> tonic::server::UnaryService<RateLimitRequest> for Method<T> {
    type Response = RateLimitResponse;
    type Future = BoxFuture<'static, Result<tonic::Response<RateLimitResponse>, Status>>;

    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move { inner.should_rate_limit(request).await })
    }
}

impl<T, B> tonic::codegen::Service<http::Request<B>> for RateLimitServer<T>
where
    T: RateLimitService,
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
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
        let method = Method(self.inner.clone());
        let max = self.max_decoding_message_size;
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(LenientCodec)
                .apply_max_message_size_config(Some(max), None);
            Ok(grpc.unary(method, req).await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_that_is_not_utf8_keeps_every_byte_apart() {
        assert_eq!(lenient_text(b"alice".to_vec()), "alice");
        assert_eq!(lenient_text("zoë".as_bytes().to_vec()), "zoë");
        assert_eq!(lenient_text(b"a\xffb".to_vec()), "a\\xFFb");
        assert_eq!(lenient_text(b"\xc3".to_vec()), "\\xC3", "a cut sequence");
        assert_ne!(
            lenient_text(b"\xfe".to_vec()),
            lenient_text(b"\xff".to_vec())
        );
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
