//! A lean `ShouldRateLimit` client over HTTP/2 directly (the `h2` crate),
//! so that the load generator costs its host little per request: no tower
//! buffer task and no task per call as tonic's `Channel` has, the request
//! encoded into one buffer, and the answer decoded from the body as it
//! comes. Its cost per request is part of rls-bench's report
//! (`client_cpu_us`).

use anyhow::{bail, Context, Result};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use h2::client::SendRequest;
use prost::Message;
use tonic::codegen::http::{Request, Uri};
use tonic::codegen::Bytes;

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// One HTTP/2 connection to the service; clones share it.
#[derive(Clone)]
pub struct Client {
    send: SendRequest<Bytes>,
    uri: Uri,
}

impl Client {
    /// Connects to `target` (`http://host:port`).
    pub async fn connect(target: &str) -> Result<Self> {
        let base: Uri = target.parse().context("invalid --target")?;
        if base.scheme_str() != Some("http") {
            bail!("--target {target}: only http:// is supported");
        }
        let authority = base
            .authority()
            .context("--target names no host:port")?
            .clone();
        let tcp = tokio::net::TcpStream::connect(authority.as_str())
            .await
            .with_context(|| format!("cannot connect to {target}"))?;
        tcp.set_nodelay(true)?;
        let (send, connection) = h2::client::Builder::new()
            .initial_window_size(1 << 20)
            .initial_connection_window_size(1 << 24)
            .handshake::<_, Bytes>(tcp)
            .await
            .with_context(|| format!("HTTP/2 handshake with {target}"))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let uri = Uri::builder()
            .scheme("http")
            .authority(authority)
            .path_and_query(PATH)
            .build()?;
        Ok(Self { send, uri })
    }

    /// One call; an error is the transport's or a non-OK `grpc-status`.
    pub async fn should_rate_limit(&mut self, req: &RateLimitRequest) -> Result<RateLimitResponse> {
        // gRPC framing: no compression, then the length, then the message
        let len = req.encoded_len();
        let mut body = Vec::with_capacity(5 + len);
        body.push(0);
        body.extend_from_slice(&(len as u32).to_be_bytes());
        req.encode(&mut body)?;
        let request = Request::post(self.uri.clone())
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())?;
        let mut send = self.send.clone().ready().await?;
        let (response, mut stream) = send.send_request(request, false)?;
        stream.send_data(Bytes::from(body), true)?;
        let response = response.await?;
        if response.status() != 200 {
            bail!("HTTP status {}", response.status());
        }
        // a trailers-only answer (an error) has its status in the headers
        let early = response
            .headers()
            .get("grpc-status")
            .map(|v| v.as_bytes().to_vec());
        let mut recv = response.into_body();
        let mut message = Vec::new();
        while let Some(chunk) = recv.data().await {
            let chunk = chunk?;
            let _ = recv.flow_control().release_capacity(chunk.len());
            message.extend_from_slice(&chunk);
        }
        let trailers = recv.trailers().await?;
        let status = trailers
            .as_ref()
            .and_then(|t| t.get("grpc-status"))
            .map(|v| v.as_bytes().to_vec())
            .or(early);
        match status.as_deref() {
            Some(b"0") => {}
            Some(code) => bail!("grpc-status {}", String::from_utf8_lossy(code)),
            None => bail!("no grpc-status"),
        }
        if message.len() < 5 {
            bail!("an answer without a message");
        }
        Ok(RateLimitResponse::decode(&message[5..])?)
    }
}
