//! The Kubernetes kit (`deploy/kubernetes/`, #53 item 2), offline: the
//! manifests validate against Kubernetes' published schemas
//! (`kubernetes-validate`, installed by the README's test command), the
//! kustomization installs every one of them into one namespace, the
//! Deployment's variables are the binary's own and start it (on a real
//! Redis Cluster, on free ports), its probes and the ServiceMonitor name
//! the ports the Service and the binary have, the ConfigMap's rules pass
//! `check-config`, and every metric an alert names is one the service
//! exports.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_yaml::Value;

const KIT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes");

/// Every document of `file` in the kit.
fn documents(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(Path::new(KIT).join(file)).expect(file);
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).expect(file))
        .filter(|v| !v.is_null())
        .collect()
}

/// The kit's one document of `kind` (there is one of each).
fn resource(kind: &str) -> Value {
    manifests()
        .into_iter()
        .flat_map(|f| documents(&f))
        .find(|d| d["kind"].as_str() == Some(kind))
        .unwrap_or_else(|| panic!("a {kind} in the kit"))
}

/// The manifests (every YAML file but the kustomization).
fn manifests() -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(KIT)
        .expect("deploy/kubernetes")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    files.sort();
    files
}

/// The Prometheus Operator's kinds: their schemas are the operator's, not
/// Kubernetes'; checked here by what they name.
const OPERATOR_FILES: &[&str] = &["monitoring.yaml"];

#[test]
fn every_manifest_validates_against_the_kubernetes_schemas() {
    let files: Vec<PathBuf> = manifests()
        .iter()
        .filter(|f| !OPERATOR_FILES.contains(&f.as_str()))
        .map(|f| Path::new(KIT).join(f))
        .collect();
    let out = Command::new("kubernetes-validate")
        .arg("--strict")
        .args(&files)
        .output()
        .unwrap_or_else(|e| {
            panic!("kubernetes-validate did not run ({e}): run the README's test command, which installs it (pip install kubernetes-validate)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    // one line per resource, each passed against a schema
    let kinds = [
        "namespace/",
        "configmap/",
        "deployment/",
        "service/",
        "horizontalpodautoscaler/",
        "poddisruptionbudget/",
        "networkpolicy/",
    ];
    for kind in kinds {
        assert!(
            text.lines()
                .any(|l| l.contains("passed for resource") && l.contains(kind)),
            "{kind} validated: {text}"
        );
    }
    assert!(!text.contains("WARN"), "{text}");
}

/// `kubectl apply -k` installs every manifest, each into the kit's
/// namespace (none names its own).
#[test]
fn the_kustomization_installs_every_manifest_into_one_namespace() {
    let k = documents("kustomization.yaml").remove(0);
    assert_eq!(k["namespace"].as_str(), Some("rate-limit"));
    let listed: BTreeSet<String> = k["resources"]
        .as_sequence()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().expect("a file").to_string())
        .collect();
    let present: BTreeSet<String> = manifests().into_iter().collect();
    assert_eq!(
        listed, present,
        "every manifest listed, every listed one there"
    );
    for file in &present {
        for doc in documents(file) {
            assert!(
                doc["metadata"]["namespace"].is_null(),
                "{file}: {} sets its own namespace",
                doc["kind"].as_str().unwrap_or("?")
            );
        }
    }
    assert_eq!(
        resource("Namespace")["metadata"]["name"].as_str(),
        Some("rate-limit")
    );
}

/// The binary's variables, as its `--help` lists them.
fn binary_variables() -> BTreeSet<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .arg("--help")
        .output()
        .expect("--help");
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    help.split("env: ")
        .skip(1)
        .filter_map(|rest| {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

/// The Deployment's container.
fn container() -> Value {
    resource("Deployment")["spec"]["template"]["spec"]["containers"][0].clone()
}

/// The Deployment's variables, in order.
fn deployment_env() -> Vec<(String, String)> {
    container()["env"]
        .as_sequence()
        .expect("env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().expect("name").to_string(),
                e["value"].as_str().expect("a literal value").to_string(),
            )
        })
        .collect()
}

/// Writes the ConfigMap's files into a directory, as the kubelet mounts it.
fn rules_from_configmap() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = resource("ConfigMap")["data"].clone();
    for (name, text) in data.as_mapping().expect("data") {
        std::fs::write(
            dir.path().join(name.as_str().expect("a file name")),
            text.as_str().expect("the file's text"),
        )
        .expect("write");
    }
    dir
}

#[test]
fn the_configmaps_rules_pass_check_config() {
    let dir = rules_from_configmap();
    let out = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .arg("check-config")
        .arg(dir.path())
        .output()
        .expect("check-config");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("valid (1 file(s), 1 domain(s))"), "{text}");
    // the mount is the directory the Deployment reads
    let env = deployment_env();
    let config = env
        .iter()
        .find(|(k, _)| k == "RLS_CONFIG")
        .expect("RLS_CONFIG");
    let mounts = container()["volumeMounts"].clone();
    assert_eq!(mounts[0]["mountPath"].as_str(), Some(config.1.as_str()));
    let volumes = resource("Deployment")["spec"]["template"]["spec"]["volumes"].clone();
    assert_eq!(
        volumes[0]["configMap"]["name"].as_str(),
        resource("ConfigMap")["metadata"]["name"].as_str()
    );
}

/// Every variable the Deployment passes is the binary's; started with them
/// (the Redis URL pointed at a real cluster here, the addresses at free
/// ports, the rules at the ConfigMap's), it is ready on the Redis store, and
/// the probes' paths and the ports the Service and the ServiceMonitor name
/// are the ones it serves.
#[tokio::test]
async fn the_deployment_starts_the_binary_with_what_it_passes() {
    let known = binary_variables();
    assert!(known.contains("RLS_REDIS_URL"), "{known:?}");
    let env = deployment_env();
    for (name, _) in &env {
        assert!(
            known.contains(name),
            "{name} is not one of the binary's variables"
        );
    }
    // ports: the container's, the Service's targets and the addresses
    let c = container();
    let port_of = |name: &str| {
        c["ports"]
            .as_sequence()
            .expect("ports")
            .iter()
            .find(|p| p["name"].as_str() == Some(name))
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("container port {name}"))
    };
    let value = |name: &str| {
        env.iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("{name}"))
    };
    assert!(value("RLS_GRPC_ADDR").ends_with(&format!(":{}", port_of("grpc"))));
    assert!(value("RLS_ADMIN_ADDR").ends_with(&format!(":{}", port_of("http-admin"))));
    for p in resource("Service")["spec"]["ports"]
        .as_sequence()
        .expect("ports")
    {
        let target = p["targetPort"].as_str().expect("a named target");
        port_of(target);
    }
    assert!(value("RLS_PROMETHEUS_ADDR").ends_with(&format!(":{}", port_of("http-metrics"))));
    // #65: monitoring reaches /metrics alone, never the admin port
    let admitted: Vec<u64> = resource("NetworkPolicy")["spec"]["ingress"]
        .as_sequence()
        .expect("ingress")
        .iter()
        .flat_map(|rule| rule["ports"].as_sequence().cloned().unwrap_or_default())
        .filter_map(|p| p["port"].as_u64())
        .collect();
    assert!(admitted.contains(&port_of("http-metrics")), "{admitted:?}");
    assert!(!admitted.contains(&port_of("http-admin")), "{admitted:?}");
    // #66: the pod is given the whole shutdown (the binary's delay and
    // grace, as the Deployment sets them or by default, and 4 s of flushing)
    let seconds = |name: &str, default: u64| {
        env.iter()
            .find(|(k, _)| k == name)
            .map_or(default, |(_, v)| {
                humantime_secs(v).unwrap_or_else(|| panic!("{name}: {v}"))
            })
    };
    let shutdown = seconds("RLS_SHUTDOWN_DELAY", 5) + seconds("RLS_SHUTDOWN_GRACE", 20) + 4;
    let grace_period = resource("Deployment")["spec"]["template"]["spec"]
        ["terminationGracePeriodSeconds"]
        .as_u64()
        .unwrap_or(30);
    assert!(
        grace_period > shutdown,
        "terminationGracePeriodSeconds {grace_period} does not cover the shutdown's {shutdown} s"
    );
    let monitor = resource("ServiceMonitor");
    let scraped = monitor["spec"]["endpoints"][0]["port"]
        .as_str()
        .expect("port");
    assert!(
        resource("Service")["spec"]["ports"]
            .as_sequence()
            .expect("ports")
            .iter()
            .any(|p| p["name"].as_str() == Some(scraped)),
        "the ServiceMonitor scrapes a port the Service has"
    );
    for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
        assert_eq!(
            c[probe]["httpGet"]["port"].as_str(),
            Some("http-admin"),
            "{probe}"
        );
    }

    let cluster = common::redis::RedisCluster::start();
    let rules = rules_from_configmap();
    let (grpc, admin) = (common::free_port(), common::free_port());
    let mut command = common::binary_without_rls_env();
    for (name, v) in &env {
        let v = match name.as_str() {
            "RLS_REDIS_URL" => cluster.url(),
            "RLS_GRPC_ADDR" => format!("127.0.0.1:{grpc}"),
            "RLS_ADMIN_ADDR" => format!("127.0.0.1:{admin}"),
            "RLS_PROMETHEUS_ADDR" => format!("127.0.0.1:{}", common::free_port()),
            "RLS_CONFIG" => rules.path().display().to_string(),
            _ => v.clone(),
        };
        command.env(name, v);
    }
    let _child = common::ChildGuard(
        command
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start the binary"),
    );
    for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
        let path = c[probe]["httpGet"]["path"].as_str().expect("path");
        common::until_ok(&format!("http://127.0.0.1:{admin}{path}"), probe).await;
    }
    let ready = reqwest::get(format!("http://127.0.0.1:{admin}/readyz"))
        .await
        .expect("readyz")
        .text()
        .await
        .expect("body");
    assert!(ready.contains("store redis"), "{ready}");
    // a decision through the gRPC port, from Redis
    let mut client = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .expect("connect");
    let r = client
        .should_rate_limit(common::request(
            "edge",
            vec![common::descriptor(&[("plan", "free"), ("api_key", "k")])],
        ))
        .await
        .expect("answered")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 2, "{r:?}");
}

/// Every metric an alert names, with a histogram's `_bucket` taken back to
/// its name.
fn alert_metrics() -> BTreeSet<String> {
    let rules = resource("PrometheusRule");
    let mut names = BTreeSet::new();
    for group in rules["spec"]["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            assert!(rule["alert"].as_str().is_some(), "{rule:?}");
            let expr = rule["expr"].as_str().expect("expr");
            let mut rest = expr;
            while let Some(at) = rest.find("rls_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
                let base = name
                    .strip_suffix("_bucket")
                    .or_else(|| name.strip_suffix("_count"))
                    .or_else(|| name.strip_suffix("_sum"))
                    .unwrap_or(&name);
                names.insert(base.to_string());
            }
        }
    }
    names
}

/// The plain Prometheus rules file (deploy/prometheus/rules.yaml, for a
/// Prometheus without the Operator) holds the kit's PrometheusRule's
/// groups, rule for rule: one set of alerts, two packagings.
#[test]
fn the_plain_rules_file_holds_the_kits_alerts() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/rules.yaml");
    let text = std::fs::read_to_string(&path).expect("deploy/prometheus/rules.yaml");
    let plain: Value = serde_yaml::from_str(&text).expect("valid YAML");
    let kit = resource("PrometheusRule");
    assert_eq!(plain["groups"], kit["spec"]["groups"]);
    let alerts: Vec<&str> = plain["groups"][0]["rules"]
        .as_sequence()
        .expect("rules")
        .iter()
        .filter_map(|r| r["alert"].as_str())
        .collect();
    assert!(
        alerts.contains(&"RateLimitOneValueTakesTheRefusals") && alerts.len() >= 6,
        "{alerts:?}"
    );
    // every expression is PromQL (promtool's parser's grammar)
    for rule in plain["groups"][0]["rules"].as_sequence().expect("rules") {
        let expr = rule["expr"].as_str().expect("expr");
        if let Err(e) = promql_parser::parser::parse(expr) {
            panic!(
                "{}: '{expr}' is not PromQL: {e}",
                rule["alert"].as_str().unwrap_or("?")
            );
        }
    }
    assert!(
        promql_parser::parser::parse("sum(rate(rls_decisions_total[5m]) >").is_err(),
        "the parser refuses what is not PromQL"
    );
}

#[tokio::test]
async fn every_metric_an_alert_names_is_exported() {
    let names = alert_metrics();
    assert!(names.len() >= 5, "{names:?}");
    // the service's own list: what /metrics declares (# TYPE), once every
    // family has a series (a decision of each kind is not needed: families
    // with labels are declared by their first series, so the source's
    // registrations are read too)
    let rules = common::rules_dir("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n");
    let server = tokenbucket_rls::server::start(&common::serve_args(rules.path().to_path_buf()))
        .await
        .expect("server starts");
    let text = server.metrics.render();
    let declared: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let source = telemetry_source(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src/telemetry"));
    for name in &names {
        assert!(
            declared.contains(name.as_str()) || source.contains(&format!("\"{name}\"")),
            "alert metric {name} is not one the service exports"
        );
    }
    server.shutdown().await.expect("stop");
}

/// The text of every file under `dir` (the metrics' registrations).
fn telemetry_source(dir: &Path) -> String {
    let mut text = String::new();
    for entry in std::fs::read_dir(dir).expect("src/telemetry").flatten() {
        let path = entry.path();
        if path.is_dir() {
            text.push_str(&telemetry_source(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            text.push_str(&std::fs::read_to_string(&path).expect("source"));
        }
    }
    text
}

/// The documents of `path` under the repository.
fn repo_documents(path: &str) -> Vec<Value> {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).expect(path);
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).expect(path))
        .filter(|v| !v.is_null())
        .collect()
}

/// `kubectl apply -k examples/istio` installs the kit with a Redis of its
/// own: the overlay takes the kit into the same namespace, its Redis
/// validates against the schemas and carries the label the kit's
/// NetworkPolicy lets the service reach, and its patch points the kit's
/// container (by the kit's names) at that Redis's Service and port with a
/// variable the binary reads.
#[test]
fn the_istio_example_installs_from_the_kit_with_its_redis() {
    let k = repo_documents("examples/istio/kustomization.yaml").remove(0);
    assert_eq!(k["namespace"].as_str(), Some("rate-limit"));
    let resources: Vec<&str> = k["resources"]
        .as_sequence()
        .expect("resources")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(resources, ["../../deploy/kubernetes", "redis.yaml"]);
    let patch_file = k["patches"][0]["path"].as_str().expect("a patch");

    let out = Command::new("kubernetes-validate")
        .arg("--strict")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/istio/redis.yaml"))
        .output()
        .expect("kubernetes-validate (the README's test command installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success() && !text.contains("WARN"), "{text}");

    let redis = repo_documents("examples/istio/redis.yaml");
    let deployment = redis
        .iter()
        .find(|d| d["kind"].as_str() == Some("Deployment"))
        .expect("a Redis Deployment");
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let egress = &resource("NetworkPolicy")["spec"]["egress"];
    let allowed = egress
        .as_sequence()
        .expect("egress")
        .iter()
        .filter_map(|rule| rule["to"][0]["podSelector"]["matchLabels"].as_mapping())
        .next()
        .expect("a rule to the Redis pods");
    for (key, value) in allowed {
        assert_eq!(&labels[key], value, "the Redis pods carry {key:?}");
    }
    let service = redis
        .iter()
        .find(|d| d["kind"].as_str() == Some("Service"))
        .expect("a Redis Service");
    let name = service["metadata"]["name"].as_str().expect("name");
    let port = service["spec"]["ports"][0]["port"].as_u64().expect("port");

    let patch = repo_documents(&format!("examples/istio/{patch_file}")).remove(0);
    assert_eq!(patch["kind"], resource("Deployment")["kind"]);
    assert_eq!(
        patch["metadata"]["name"],
        resource("Deployment")["metadata"]["name"]
    );
    let patched = &patch["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(patched["name"], container()["name"]);
    let known = binary_variables();
    let env = patched["env"].as_sequence().expect("env");
    for e in env {
        assert!(known.contains(e["name"].as_str().expect("name")), "{e:?}");
    }
    let url = env
        .iter()
        .find(|e| e["name"].as_str() == Some("RLS_REDIS_URL"))
        .and_then(|e| e["value"].as_str())
        .expect("RLS_REDIS_URL");
    assert_eq!(url, format!("redis://{name}:{port}"));
}

/// Whole seconds of a duration as the binary takes it (`5s`, `1m`).
fn humantime_secs(text: &str) -> Option<u64> {
    let (n, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = n.parse().ok()?;
    match unit {
        "s" => Some(n),
        "m" => Some(n * 60),
        _ => None,
    }
}
