//! A test ADS server (xDS, state of the world) with TLS: the test pushes
//! `RateLimitConfig` snapshots and reads what the client answers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use futures::Stream;
use parking_lot::Mutex;
use prost::Message;
use tokenbucket_rls::sources::xds::TYPE_URL;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::{Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

type Responses = mpsc::UnboundedReceiver<Result<DiscoveryResponse, Status>>;

/// The test's ADS server: every request it gets goes to `requests`; each
/// stream answers from the responses the test pushes.
pub struct Ads {
    requests: mpsc::UnboundedSender<DiscoveryRequest>,
    responses: Arc<Mutex<Option<Responses>>>,
    /// The gRPC metadata of the last stream opened.
    headers: Arc<Mutex<Option<tonic::metadata::MetadataMap>>>,
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream =
        std::pin::Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;
    type DeltaAggregatedResourcesStream =
        std::pin::Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        *self.headers.lock() = Some(request.metadata().clone());
        let mut inbound = request.into_inner();
        let requests = self.requests.clone();
        tokio::spawn(async move {
            while let Ok(Some(r)) = inbound.message().await {
                let _ = requests.send(r);
            }
        });
        let rx = self
            .responses
            .lock()
            .take()
            .ok_or_else(|| Status::unavailable("one stream at a time"))?;
        let out =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        Ok(Response::new(Box::pin(out)))
    }

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented("state of the world only"))
    }
}

/// A running ADS server: push responses, read requests, stop it.
pub struct AdsServer {
    push: mpsc::UnboundedSender<Result<DiscoveryResponse, Status>>,
    requests: mpsc::UnboundedReceiver<DiscoveryRequest>,
    stop: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
    /// The gRPC metadata of the last stream the client opened.
    pub headers: Arc<Mutex<Option<tonic::metadata::MetadataMap>>>,
}

impl AdsServer {
    pub async fn start(addr: SocketAddr, tls: ServerTlsConfig) -> Self {
        let (push, responses) = mpsc::unbounded_channel();
        let (requests_tx, requests) = mpsc::unbounded_channel();
        let headers = Arc::new(Mutex::new(None));
        let ads = Ads {
            requests: requests_tx,
            responses: Arc::new(Mutex::new(Some(responses))),
            headers: headers.clone(),
        };
        let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
        let (stop, stopped) = oneshot::channel::<()>();
        let server = Server::builder()
            .tls_config(tls)
            .expect("tls")
            .add_service(AggregatedDiscoveryServiceServer::new(ads))
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                async {
                    let _ = stopped.await;
                },
            );
        let done = tokio::spawn(async move {
            let _ = server.await;
        });
        Self {
            push,
            requests,
            stop: Some(stop),
            done,
            headers,
        }
    }

    /// The next request the client sends (within 20 s).
    pub async fn next_request(&mut self) -> DiscoveryRequest {
        tokio::time::timeout(Duration::from_secs(20), self.requests.recv())
            .await
            .expect("a request within 20 s")
            .expect("the server runs")
    }

    /// Pushes a snapshot and returns the client's answer to it.
    pub async fn snapshot(
        &mut self,
        version: &str,
        nonce: &str,
        configs: &[RateLimitConfig],
    ) -> DiscoveryRequest {
        let resources = configs
            .iter()
            .map(|c| Any {
                type_url: TYPE_URL.into(),
                value: c.encode_to_vec(),
            })
            .collect();
        self.push
            .send(Ok(DiscoveryResponse {
                version_info: version.into(),
                resources,
                type_url: TYPE_URL.into(),
                nonce: nonce.into(),
                ..Default::default()
            }))
            .expect("stream open");
        loop {
            let r = self.next_request().await;
            if r.response_nonce == nonce {
                return r;
            }
        }
    }

    /// Pushes `response` as it is, and returns the client's answer to
    /// its nonce.
    pub async fn push(&mut self, response: DiscoveryResponse) -> DiscoveryRequest {
        let nonce = response.nonce.clone();
        self.push.send(Ok(response)).expect("stream open");
        loop {
            let r = self.next_request().await;
            if r.response_nonce == nonce {
                return r;
            }
        }
    }

    /// Pushes `response` and returns the next request the client sends,
    /// whatever it answers.
    pub async fn push_then_next(&mut self, response: DiscoveryResponse) -> DiscoveryRequest {
        self.push.send(Ok(response)).expect("stream open");
        self.next_request().await
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.done.abort();
        let _ = self.done.await;
    }
}

/// A snapshot shaped like Envoy Gateway's translator output: per route, per
/// rule, per match, `requests_per_unit` a minute.
pub fn eg_config(rules: &[(&str, u32)], unit: RateLimitUnit) -> RateLimitConfig {
    RateLimitConfig {
        name: "default/eg/http".into(),
        domain: "default/eg/http".into(),
        descriptors: vec![RateLimitDescriptor {
            key: "first-route".into(),
            value: "first-route".into(),
            descriptors: rules
                .iter()
                .map(|(m, rpu)| RateLimitDescriptor {
                    key: m.to_string(),
                    value: m.to_string(),
                    rate_limit: Some(RateLimitPolicy {
                        unit: unit as i32,
                        requests_per_unit: *rpu,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
    }
}
