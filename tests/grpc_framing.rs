//! ShouldRateLimit's framing, frame by frame: a raw HTTP/2 client (the h2
//! crate) sends what Envoy and other gRPC clients may send (a message cut
//! across DATA frames, a compressed flag, an encoding we do not speak, a
//! body cut short, none at all) to the serving threads, which frame the
//! unary call themselves (`service::wire`), and reads the answer's
//! headers, body and trailers as they came. Each malformed call must be
//! answered with the status tonic's own server gave it, and the connection
//! must go on serving.

mod common;

use bytes::Bytes;
use common::{descriptor, request, rules_dir, serve_args};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use prost::Message;
use tokenbucket_rls::server;

const RULES: &str = "domain: api\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 60, burst: 5}\n";
const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// What came back for one call.
struct Answer {
    headers: tonic::codegen::http::HeaderMap,
    body: Vec<u8>,
    trailers: Option<tonic::codegen::http::HeaderMap>,
}

impl Answer {
    /// `grpc-status`, from the trailers or (trailers-only) the headers.
    fn status(&self) -> String {
        let from = |m: &tonic::codegen::http::HeaderMap| {
            m.get("grpc-status")
                .map(|v| v.to_str().expect("ascii").to_string())
        };
        self.trailers
            .as_ref()
            .and_then(from)
            .or_else(|| from(&self.headers))
            .expect("a grpc-status")
    }

    /// `grpc-message`, percent-decoded.
    fn message(&self) -> String {
        let from = |m: &tonic::codegen::http::HeaderMap| {
            m.get("grpc-message").map(|v| v.as_bytes().to_vec())
        };
        let raw = self
            .trailers
            .as_ref()
            .and_then(from)
            .or_else(|| from(&self.headers))
            .unwrap_or_default();
        let mut out = Vec::with_capacity(raw.len());
        let mut i = 0;
        while i < raw.len() {
            match (raw[i], raw.get(i + 1..i + 3)) {
                (b'%', Some(hex)) => {
                    let hex = std::str::from_utf8(hex).expect("ascii");
                    out.push(u8::from_str_radix(hex, 16).expect("hex"));
                    i += 3;
                }
                (b, _) => {
                    out.push(b);
                    i += 1;
                }
            }
        }
        String::from_utf8(out).expect("utf-8")
    }

    fn response(&self) -> RateLimitResponse {
        assert_eq!(self.status(), "0", "{}", self.message());
        assert_eq!(self.body[0], 0, "not compressed");
        let len = u32::from_be_bytes(self.body[1..5].try_into().expect("prefix")) as usize;
        assert_eq!(self.body.len(), 5 + len, "one message");
        RateLimitResponse::decode(&self.body[5..]).expect("decodes")
    }
}

/// Sends `frames` as the call's DATA frames (the last ends the stream),
/// with `extra` headers beside gRPC's own.
async fn call(
    client: &mut h2::client::SendRequest<Bytes>,
    path: &str,
    extra: &[(&'static str, &'static str)],
    frames: Vec<Vec<u8>>,
) -> Answer {
    let mut builder = tonic::codegen::http::Request::builder()
        .method("POST")
        .uri(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in extra {
        builder = builder.header(*name, *value);
    }
    let ready = client.clone().ready().await.expect("ready");
    *client = ready;
    let (response, mut stream) = client
        .send_request(builder.body(()).expect("request"), frames.is_empty())
        .expect("sends");
    let n = frames.len();
    for (i, frame) in frames.into_iter().enumerate() {
        stream
            .send_data(Bytes::from(frame), i + 1 == n)
            .expect("data");
    }
    let response = response.await.expect("answered");
    let (parts, mut body) = response.into_parts();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("chunk");
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await.expect("trailers");
    assert_eq!(parts.status, 200);
    Answer {
        headers: parts.headers,
        body: bytes,
        trailers,
    }
}

/// A gRPC message: flag, length, bytes.
fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

fn one_call(value: &str) -> Vec<u8> {
    request("api", vec![descriptor(&[("k", value)])]).encode_to_vec()
}

#[tokio::test]
async fn malformed_calls_are_answered_as_tonic_answered_them_and_the_connection_goes_on() {
    framing_on(None).await;
}

/// The same on the shared runtime (`--serving-threads 0`), which serves
/// its connections with the same code.
#[tokio::test]
async fn the_shared_runtime_frames_calls_the_same_way() {
    framing_on(Some(0)).await;
}

async fn framing_on(serving_threads: Option<usize>) {
    let rules = rules_dir(RULES);
    let mut args = serve_args(rules.path().to_path_buf());
    args.serving_threads = serving_threads;
    let server = server::start(&args).await.expect("server starts");
    let tcp = tokio::net::TcpStream::connect(server.grpc_addr)
        .await
        .expect("connects");
    let (mut client, connection) = h2::client::handshake(tcp).await.expect("handshake");
    tokio::spawn(connection);

    // a plain call: the answer's headers, one message, grpc-status 0
    let plain = call(&mut client, PATH, &[], vec![framed(0, &one_call("a"))]).await;
    assert_eq!(
        plain.headers.get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/grpc"[..])
    );
    assert!(plain.headers.get("date").is_none(), "no date header");
    let r = plain.response();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 4);

    // the same message cut into one-byte DATA frames: the same decision
    let bytes = framed(0, &one_call("a"));
    let cut = bytes.iter().map(|b| vec![*b]).collect();
    let r = call(&mut client, PATH, &[], cut).await.response();
    assert_eq!(
        r.statuses[0].limit_remaining, 3,
        "the same bucket, spent again"
    );

    // an identity encoding named is no encoding
    let r = call(
        &mut client,
        PATH,
        &[("grpc-encoding", "identity")],
        vec![framed(0, &one_call("a"))],
    )
    .await
    .response();
    assert_eq!(r.statuses[0].limit_remaining, 2);

    // an encoding we do not speak: UNIMPLEMENTED, naming what we accept
    let gzip = call(
        &mut client,
        PATH,
        &[("grpc-encoding", "gzip")],
        vec![framed(1, b"\x1f\x8b")],
    )
    .await;
    assert_eq!(gzip.status(), "12", "{}", gzip.message());
    assert!(gzip.message().contains("gzip"), "{}", gzip.message());
    assert_eq!(
        gzip.headers
            .get("grpc-accept-encoding")
            .map(|v| v.as_bytes()),
        Some(&b"identity"[..])
    );

    // the compressed flag with no encoding named: INTERNAL (gRPC's spec)
    let flagged = call(&mut client, PATH, &[], vec![framed(1, &one_call("a"))]).await;
    assert_eq!(flagged.status(), "13");
    assert!(
        flagged.message().contains("compressed-flag"),
        "{}",
        flagged.message()
    );

    // a flag that is neither 0 nor 1
    let odd = call(&mut client, PATH, &[], vec![framed(7, &one_call("a"))]).await;
    assert_eq!(odd.status(), "13", "{}", odd.message());

    // no message at all, a prefix alone, a message cut short
    let none = call(&mut client, PATH, &[], vec![]).await;
    assert_eq!(none.status(), "13");
    assert!(
        none.message().contains("Missing request message"),
        "{}",
        none.message()
    );
    let prefix = call(&mut client, PATH, &[], vec![vec![0, 0, 0]]).await;
    assert_eq!(prefix.status(), "13", "{}", prefix.message());
    let mut short = framed(0, &one_call("a"));
    short.truncate(short.len() - 2);
    let short = call(&mut client, PATH, &[], vec![short]).await;
    assert_eq!(short.status(), "13", "{}", short.message());

    // a message whose bytes are not a request
    let garbage = call(&mut client, PATH, &[], vec![framed(0, b"\xff\xff\xff")]).await;
    assert_eq!(garbage.status(), "13");
    assert!(
        garbage.message().contains("decoding the request"),
        "{}",
        garbage.message()
    );

    // a length past the limit, refused from the prefix alone
    let mut huge = vec![0u8];
    huge.extend_from_slice(&(8u32 << 20).to_be_bytes());
    let huge = call(&mut client, PATH, &[], vec![huge]).await;
    assert_eq!(huge.status(), "11", "{}", huge.message());
    // and a body past the limit, refused once it passes it
    let big = call(&mut client, PATH, &[], vec![vec![0u8; (1 << 20) + 64]]).await;
    assert_eq!(big.status(), "11", "{}", big.message());

    // another method of the service, and a service we do not serve
    for path in [
        "/envoy.service.ratelimit.v3.RateLimitService/Other",
        "/some.Service/Method",
    ] {
        let other = call(&mut client, path, &[], vec![framed(0, b"")]).await;
        assert_eq!(other.status(), "12", "{path}");
    }

    // nothing above was decided: the bucket holds what three calls left
    let r = call(&mut client, PATH, &[], vec![framed(0, &one_call("a"))])
        .await
        .response();
    assert_eq!(r.statuses[0].limit_remaining, 1);
    server.shutdown().await.expect("stops");
}
