//! Rules over xDS: envoyproxy/ratelimit's `CONFIG_TYPE=GRPC_XDS_SOTW`, as
//! Envoy Gateway deploys it. An ADS state-of-the-world client
//! (`StreamAggregatedResources`, wildcard, type [`TYPE_URL`]) whose every
//! snapshot is validated exactly like rules files (it becomes one file per
//! `RateLimitConfig`, named `xds:<name>`) and swapped in like a reload; an
//! invalid one is NACKed with the errors and the rules in force keep
//! serving. The stream is opened again after a failure, with a backoff.
//!
//! A resource may come as a `RateLimitConfig`, or wrapped in an
//! `envoy.service.discovery.v3.Resource` (go-control-plane wraps resources
//! that have a TTL); a wrapper without a body (a TTL heartbeat) keeps the
//! config of that name from the snapshot in force. The TTL itself is not
//! enforced: a config stays until a snapshot leaves it out. A resource of
//! any other type, or a response whose `type_url` is not ours, is NACKed.
//! A snapshot larger than `--xds-max-message-size` cannot be read: the
//! stream fails, and the log says why at error level.
//!
//! [`rule_set`] is pure (the conversion and validation); [`run`] is the
//! client.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! where rules come from, under `store`; uses `telemetry`, the rules
//! themselves and leaves.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DiscoveryRequest, DiscoveryResponse, Resource,
};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Any, Struct, Value};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use envoy_types::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use futures::StreamExt;
use prost::Message;
use tokio::sync::mpsc;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::rules::schema::{DescriptorDoc, RateLimitDoc, ReplacesDoc, RulesFile};
use crate::rules::SharedRules;
use crate::rules::{load_sources, ConfigError, ConfigErrors, LoadOptions, RuleSet};
use crate::telemetry::Metrics;

/// The resource type envoyproxy/ratelimit subscribes to.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// The wrapper a resource may come in (go-control-plane: one with a TTL).
pub const RESOURCE_TYPE_URL: &str = "type.googleapis.com/envoy.service.discovery.v3.Resource";

/// gRPC's default largest message, and ours unless configured
/// (`--xds-max-message-size`, envoyproxy/ratelimit's
/// `XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES`).
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 4 * 1024 * 1024;

/// Where the rules come from, and how to reach it.
#[derive(Debug, Clone)]
pub struct XdsSettings {
    /// `http://host:port`, or `https://` for TLS.
    pub server: String,
    pub node_id: String,
    /// Sent as the node's metadata (string values).
    pub node_metadata: Vec<(String, String)>,
    /// Sent as gRPC metadata on the stream.
    pub headers: Vec<(String, String)>,
    /// The name the server's certificate must carry, when not the URL's host.
    pub server_name: Option<String>,
    pub ca_file: Option<PathBuf>,
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// The first wait after a failed stream; doubles up to `max_backoff`.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// The largest snapshot (one gRPC message) taken, in bytes.
    pub max_message_size: usize,
}

impl XdsSettings {
    /// Refuses what would not be honoured: a scheme other than `http://`
    /// or `https://`, and TLS settings with a plaintext `http://` URL
    /// (they would be ignored, and the rules come over plaintext).
    pub fn check(&self) -> anyhow::Result<()> {
        let tls = self.server.starts_with("https://");
        if !tls && !self.server.starts_with("http://") {
            anyhow::bail!(
                "--xds-server {}: give http://HOST:PORT, or https://HOST:PORT for TLS",
                self.server
            );
        }
        if !tls {
            let given: Vec<&str> = [
                (self.ca_file.is_some(), "--xds-ca-file"),
                (
                    self.client_cert.is_some(),
                    "--xds-client-cert/--xds-client-key",
                ),
                (self.server_name.is_some(), "--xds-server-name"),
            ]
            .into_iter()
            .filter_map(|(set, name)| set.then_some(name))
            .collect();
            if !given.is_empty() {
                anyhow::bail!(
                    "--xds-server {}: {} given for a plaintext URL; use https:// (or CONFIG_GRPC_XDS_SERVER_USE_TLS=true), or leave them out",
                    self.server,
                    given.join(", ")
                );
            }
        }
        if self.max_message_size == 0 {
            anyhow::bail!("--xds-max-message-size 0: give a size in bytes above 0");
        }
        Ok(())
    }
}

fn unit_name(unit: i32) -> Option<&'static str> {
    Some(match RateLimitUnit::try_from(unit).ok()? {
        RateLimitUnit::Second => "second",
        RateLimitUnit::Minute => "minute",
        RateLimitUnit::Hour => "hour",
        RateLimitUnit::Day => "day",
        RateLimitUnit::Week => "week",
        RateLimitUnit::Month => "month",
        RateLimitUnit::Year => "year",
        RateLimitUnit::Unknown => return None,
    })
}

fn policy_doc(p: &RateLimitPolicy) -> RateLimitDoc {
    RateLimitDoc {
        name: Some(p.name.clone()).filter(|n| !n.is_empty()),
        // an unknown unit stays unset: validation names it
        unit: if p.unlimited {
            None
        } else {
            Some(unit_name(p.unit).unwrap_or("unknown").to_string())
        },
        requests_per_unit: (!p.unlimited).then_some(p.requests_per_unit),
        // not in the RateLimitPolicy message this service reads
        // (envoyproxy/ratelimit's): one unit
        unit_multiplier: None,
        // nor a calendar: xDS limits count as token buckets
        calendar: None,
        burst: None,
        unlimited: p.unlimited,
        replaces: (!p.replaces.is_empty()).then(|| {
            p.replaces
                .iter()
                .map(|r| ReplacesDoc {
                    name: Some(r.name.clone()),
                })
                .collect()
        }),
    }
}

fn descriptor_doc(d: &RateLimitDescriptor) -> DescriptorDoc {
    DescriptorDoc {
        key: Some(d.key.clone()),
        value: Some(d.value.clone()).filter(|v| !v.is_empty()),
        rate_limit: d.rate_limit.as_ref().map(policy_doc),
        descriptors: (!d.descriptors.is_empty())
            .then(|| d.descriptors.iter().map(descriptor_doc).collect()),
        shadow_mode: d.shadow_mode,
        quota_mode: d.quota_mode,
        detailed_metric: d.detailed_metric,
        metadata: d.metadata.as_ref().map(crate::pb_struct::yaml_from_struct),
        ..Default::default()
    }
}

/// The rules of one snapshot: each config as a rules file `xds:<name>`,
/// validated as files are (every error, with its place).
pub fn rule_set(configs: &[RateLimitConfig], opts: LoadOptions) -> Result<RuleSet, ConfigErrors> {
    let mut sources = Vec::with_capacity(configs.len());
    for (i, c) in configs.iter().enumerate() {
        let name = if c.name.is_empty() {
            format!("xds:#{i}")
        } else {
            format!("xds:{}", c.name)
        };
        let file = RulesFile {
            domain: Some(c.domain.clone()),
            descriptors: Some(Some(c.descriptors.iter().map(descriptor_doc).collect())),
        };
        let text = serde_yaml::to_string(&file).map_err(|e| {
            ConfigErrors(vec![ConfigError::new(
                std::path::Path::new(&name),
                format!("cannot read the snapshot: {e}"),
            )])
        })?;
        sources.push((PathBuf::from(name), text));
    }
    load_sources(sources, opts)
}

/// One request of the stream: the version in force, the nonce answered,
/// and the errors of a rejected snapshot (a NACK).
fn request(node: &Node, version: &str, nonce: &str, error: Option<String>) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: version.to_string(),
        node: Some(node.clone()),
        type_url: TYPE_URL.to_string(),
        response_nonce: nonce.to_string(),
        error_detail: error.map(|message| RpcStatus {
            // INVALID_ARGUMENT
            code: 3,
            message,
            details: Vec::new(),
        }),
        ..Default::default()
    }
}

async fn channel(s: &XdsSettings) -> anyhow::Result<Channel> {
    let mut endpoint =
        Endpoint::from_shared(s.server.clone())?.connect_timeout(Duration::from_secs(5));
    if s.server.starts_with("https://") {
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &s.ca_file {
            tls = tls.ca_certificate(Certificate::from_pem(std::fs::read(ca)?));
        }
        if let Some((cert, key)) = &s.client_cert {
            tls = tls.identity(Identity::from_pem(
                std::fs::read(cert)?,
                std::fs::read(key)?,
            ));
        }
        if let Some(name) = &s.server_name {
            tls = tls.domain_name(name.clone());
        }
        endpoint = endpoint.tls_config(tls)?;
    }
    Ok(endpoint.connect().await?)
}

/// Keeps the rules in step with the xDS server until the process ends:
/// a stream that fails or ends is opened again after a wait that doubles
/// from `settings.backoff` up to `settings.max_backoff` (back to the first
/// after a stream that delivered a snapshot).
pub async fn run(
    settings: XdsSettings,
    opts: LoadOptions,
    rules: SharedRules,
    metrics: Arc<Metrics>,
) {
    let node = Node {
        id: settings.node_id.clone(),
        metadata: (!settings.node_metadata.is_empty()).then(|| Struct {
            fields: settings
                .node_metadata
                .iter()
                .map(|(k, v)| {
                    let value = Value {
                        kind: Some(Kind::StringValue(v.clone())),
                    };
                    (k.clone(), value)
                })
                .collect(),
        }),
        ..Default::default()
    };
    // the version in force, sent with every request, and its configs by
    // name (a TTL heartbeat keeps one)
    let mut version = String::new();
    let mut in_force = InForce::default();
    let mut backoff = settings.backoff;
    loop {
        let before = version.clone();
        let stream = XdsStream {
            settings: &settings,
            node: &node,
            opts: &opts,
            rules: &rules,
            metrics: &metrics,
        };
        match stream.run(&mut version, &mut in_force).await {
            Ok(()) => {
                tracing::info!(server = %settings.server, "xDS stream ended; opening it again")
            }
            Err(e) => match e.downcast_ref::<tonic::Status>() {
                Some(status) if status.code() == tonic::Code::OutOfRange => {
                    tracing::error!(server = %settings.server, limit = settings.max_message_size, error = %status.message(), "xDS snapshot refused: larger than --xds-max-message-size (XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES); the rules in force keep serving")
                }
                _ => {
                    tracing::warn!(server = %settings.server, error = %e, "xDS stream failed; the rules in force keep serving")
                }
            },
        }
        if version != before {
            backoff = settings.backoff;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(settings.max_backoff);
    }
}

/// The requests sent on `rx`, as the stream's outbound half.
fn outbound(
    rx: mpsc::Receiver<DiscoveryRequest>,
) -> impl futures::Stream<Item = DiscoveryRequest> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
}

/// The configs of the snapshot in force, by name.
type InForce = std::collections::HashMap<String, RateLimitConfig>;

/// What one stream works with.
struct XdsStream<'a> {
    settings: &'a XdsSettings,
    node: &'a Node,
    opts: &'a LoadOptions,
    rules: &'a SharedRules,
    metrics: &'a Metrics,
}

impl XdsStream<'_> {
    /// Opens the stream and applies (ACKs) or NACKs each snapshot until it
    /// ends or fails.
    async fn run(&self, version: &mut String, in_force: &mut InForce) -> anyhow::Result<()> {
        let Self {
            settings,
            node,
            opts,
            rules,
            metrics,
        } = self;
        let mut client = AggregatedDiscoveryServiceClient::new(channel(settings).await?)
            .max_decoding_message_size(settings.max_message_size);
        let (tx, rx) = mpsc::channel::<DiscoveryRequest>(4);
        tx.send(request(node, version, "", None)).await?;
        let mut call = tonic::Request::new(outbound(rx));
        for (name, value) in &settings.headers {
            let key =
                tonic::metadata::MetadataKey::from_bytes(name.to_ascii_lowercase().as_bytes())?;
            call.metadata_mut().insert(key, value.parse()?);
        }
        let mut responses = client.stream_aggregated_resources(call).await?.into_inner();
        while let Some(response) = responses.next().await {
            let response: DiscoveryResponse = response?;
            let answer = match apply(&response, in_force, opts, rules, metrics) {
                Ok(configs) => {
                    *version = response.version_info.clone();
                    *in_force = configs;
                    None
                }
                Err(errors) => Some(errors),
            };
            tx.send(request(node, version, &response.nonce, answer))
                .await?;
        }
        Ok(())
    }
}

/// The configs of a response: each resource a `RateLimitConfig`, or one
/// wrapped in a `Resource` (without a body: the one of that name in
/// force); anything else is an error naming it.
fn configs_of(
    response: &DiscoveryResponse,
    in_force: &InForce,
) -> Result<Vec<RateLimitConfig>, String> {
    if !response.type_url.is_empty() && response.type_url != TYPE_URL {
        return Err(format!(
            "the response's type_url {} is not {TYPE_URL}",
            response.type_url
        ));
    }
    let decode = |any: &Any, i: usize| -> Result<RateLimitConfig, String> {
        if any.type_url != TYPE_URL {
            return Err(format!(
                "resource #{i} is a {}, not a {TYPE_URL}",
                if any.type_url.is_empty() {
                    "resource without a type_url"
                } else {
                    &any.type_url
                }
            ));
        }
        RateLimitConfig::decode(any.value.as_slice())
            .map_err(|e| format!("resource #{i} is not a RateLimitConfig: {e}"))
    };
    response
        .resources
        .iter()
        .enumerate()
        .map(|(i, r)| {
            if r.type_url != RESOURCE_TYPE_URL {
                return decode(r, i);
            }
            let wrapper = Resource::decode(r.value.as_slice())
                .map_err(|e| format!("resource #{i} is not a Resource: {e}"))?;
            match &wrapper.resource {
                Some(any) => decode(any, i),
                // a TTL heartbeat: the config keeps its body
                None => in_force.get(&wrapper.name).cloned().ok_or_else(|| {
                    format!(
                        "resource #{i} ({}) has no body, and no config of that name is in force",
                        wrapper.name
                    )
                }),
            }
        })
        .collect()
}

/// Validates a snapshot and swaps it in, as a reload: its configs by name;
/// the errors otherwise.
fn apply(
    response: &DiscoveryResponse,
    in_force: &InForce,
    opts: &LoadOptions,
    rules: &SharedRules,
    metrics: &Metrics,
) -> Result<InForce, String> {
    let current = rules.load().generation();
    let configs = configs_of(response, in_force);
    let set = configs.and_then(|c| {
        rule_set(&c, opts.clone())
            .map(|set| (set, c))
            .map_err(|e| e.to_string())
    });
    match set {
        Ok((set, configs)) => {
            let generation = current + 1;
            let domains = set.domains().count();
            let set = set
                .with_generation(generation)
                .succeeding(&rules.load(), crate::clock::unix_millis());
            rules.store(Arc::new(set));
            metrics.config_reload(true, generation);
            tracing::info!(generation, domains, version = %response.version_info, "rules from xDS applied");
            Ok(configs.into_iter().map(|c| (c.name.clone(), c)).collect())
        }
        Err(errors) => {
            metrics.config_reload(false, current);
            tracing::error!(version = %response.version_info, "rules from xDS rejected, previous rules keep serving: {errors}");
            Err(errors)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::ratelimit::config::ratelimit::v3::RateLimitReplace;

    fn config(name: &str, unit: RateLimitUnit) -> RateLimitConfig {
        RateLimitConfig {
            name: name.into(),
            domain: "default/eg/http".into(),
            descriptors: vec![RateLimitDescriptor {
                key: "first-route".into(),
                value: "first-route".into(),
                descriptors: vec![RateLimitDescriptor {
                    key: "rule-0-match-0".into(),
                    value: "rule-0-match-0".into(),
                    rate_limit: Some(RateLimitPolicy {
                        unit: unit as i32,
                        requests_per_unit: 3,
                        name: "per-route".into(),
                        replaces: vec![RateLimitReplace { name: "old".into() }],
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }],
        }
    }

    /// Envoy Gateway's translator output becomes the rules a file with the
    /// same tree would give.
    #[test]
    fn a_snapshot_is_rules_as_a_file_would_give() {
        let set = rule_set(
            &[config("eg", RateLimitUnit::Minute)],
            LoadOptions::default(),
        )
        .expect("valid");
        let entries = [
            ("first-route", "first-route"),
            ("rule-0-match-0", "rule-0-match-0"),
        ];
        let found = set.lookup("default/eg/http", &entries).expect("a rule");
        assert_eq!(found.rule.label(), "per-route");
        assert_eq!(set.files()[0].path, PathBuf::from("xds:eg"));
    }

    /// `quota_mode` and `metadata` (envoyproxy/ratelimit's proto fields 7
    /// and 8) reach the rule.
    #[test]
    fn quota_mode_and_metadata_come_through() {
        let mut c = config("eg", RateLimitUnit::Minute);
        let leaf = &mut c.descriptors[0].descriptors[0];
        leaf.quota_mode = true;
        leaf.metadata = Some(crate::pb_struct::struct_from_yaml(
            &serde_yaml::from_str("service_with_quota: {name: service_2}").expect("yaml"),
        ));
        let set = rule_set(&[c], LoadOptions::default()).expect("valid");
        let entries = [
            ("first-route", "first-route"),
            ("rule-0-match-0", "rule-0-match-0"),
        ];
        let rule = set
            .lookup("default/eg/http", &entries)
            .expect("a rule")
            .rule;
        assert!(rule.quota_mode);
        let want: serde_yaml::Value =
            serde_yaml::from_str("service_with_quota: {name: service_2}").expect("yaml");
        assert_eq!(
            rule.metadata
                .as_ref()
                .map(crate::pb_struct::yaml_from_struct),
            Some(want)
        );
    }

    #[test]
    fn an_invalid_snapshot_names_the_config_and_the_place() {
        let err = rule_set(
            &[config("eg", RateLimitUnit::Unknown)],
            LoadOptions::default(),
        )
        .expect_err("no unit");
        let text = err.to_string();
        assert!(text.contains("xds:eg"), "{text}");
        assert!(text.contains("unit"), "{text}");
    }
}
