//! The Helm chart (`deploy/helm/tokenbucket-rls`, #69), with the real
//! `helm` (3.17, installed by the README's test command) and offline: it
//! lints strictly, every values file of its matrix (`ci/*-values.yaml` and
//! the defaults) renders objects that pass Kubernetes' published schemas
//! (`kubernetes-validate --strict`), a wrong value is refused at render
//! naming it, the defaults render what the kustomize kit holds, its
//! PrometheusRule holds `deploy/prometheus/rules.yaml`'s groups, and the
//! rendered Deployment's variables start the binary to a decision on a real
//! Redis Cluster.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde::Deserialize;
use serde_yaml::Value;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/helm/tokenbucket-rls");

fn helm(args: &[&str]) -> Output {
    Command::new("helm")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("helm did not run ({e}): run the README's test command, which installs it (integration/install-deps.sh)")
        })
}

/// The matrix: the defaults (`None`) and each `ci/*-values.yaml`.
fn matrix() -> Vec<Option<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(Path::new(CHART).join("ci"))
        .expect("ci/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.to_string_lossy().ends_with("-values.yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    std::iter::once(None)
        .chain(files.into_iter().map(Some))
        .collect()
}

/// `helm template` of the chart with `values` and `set`: its documents.
fn render(values: Option<&Path>, set: &[&str]) -> Vec<Value> {
    let mut args = vec!["template", "rls", CHART, "--namespace", "rate-limit"];
    let values = values.map(|v| v.display().to_string());
    if let Some(v) = &values {
        args.extend(["-f", v.as_str()]);
    }
    for s in set {
        args.extend(["--set", s]);
    }
    let out = helm(&args);
    assert!(
        out.status.success(),
        "helm template {values:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_yaml::Deserializer::from_slice(&out.stdout)
        .map(|d| Value::deserialize(d).expect("YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind))
        .unwrap_or_else(|| panic!("a {kind}"))
}

#[test]
fn the_chart_lints_strictly_with_every_values_file() {
    for values in matrix() {
        let mut args = vec!["lint", "--strict", CHART];
        let v = values.as_ref().map(|v| v.display().to_string());
        if let Some(v) = &v {
            args.extend(["-f", v.as_str()]);
        }
        let out = helm(&args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{values:?}: {text}");
        assert!(text.contains("0 chart(s) failed"), "{text}");
    }
}

/// The binary's `--help`, which names each of its variables (`env: RLS_…`).
fn binary_help() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .arg("--help")
        .output()
        .expect("--help");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_rendering_validates_against_the_kubernetes_schemas() {
    let dir = tempfile::tempdir().expect("tempdir");
    let help = binary_help();
    for (i, values) in matrix().into_iter().enumerate() {
        let rendered = render(values.as_deref(), &[]);
        // every RLS_ variable it sets is one the binary reads
        let container = &kind(&rendered, "Deployment")["spec"]["template"]["spec"]["containers"][0];
        for name in env_names(container)
            .iter()
            .filter(|n| n.starts_with("RLS_"))
        {
            assert!(help.contains(&format!("env: {name}")), "{values:?}: {name}");
        }
        let docs: Vec<Value> = rendered
            .into_iter()
            // the Prometheus Operator's kinds have the operator's schemas
            .filter(|d| {
                !d["apiVersion"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("monitoring.coreos.com/"))
            })
            .collect();
        let file = dir.path().join(format!("{i}.yaml"));
        let text: Vec<String> = docs
            .iter()
            .map(|d| serde_yaml::to_string(d).expect("YAML"))
            .collect();
        std::fs::write(&file, text.join("---\n")).expect("write");
        let out = Command::new("kubernetes-validate")
            .arg("--strict")
            .arg(&file)
            .output()
            .expect("kubernetes-validate (installed by the README's test command)");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{values:?}: {said}");
        assert!(!said.contains("WARN"), "{values:?}: {said}");
        let passed = said
            .lines()
            .filter(|l| l.contains("passed for resource"))
            .count();
        assert_eq!(passed, docs.len(), "{values:?}: {said}");
    }
}

#[test]
fn a_wrong_value_is_refused_at_render_naming_it() {
    for (set, named) in [
        ("store.kind=mongo", "store.kind"),
        ("store.redis.url=redis-clustr://x:6379", "store.redis.url"),
        ("ports.grpc=70000", "ports.grpc"),
        ("replicas=3", "replicas"),
        (
            "terminationGracePeriodSeconds=5",
            "terminationGracePeriodSeconds",
        ),
        // a region needs the upstream that keeps the global budgets
        ("region.name=eu", "region"),
    ] {
        let out = helm(&["template", "rls", CHART, "--set", set]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set} rendered");
        assert!(stderr.contains(named), "{set}: {stderr}");
    }
}

/// The kit's (deploy/kubernetes) one document of `kind`.
fn kit(kind: &str) -> Value {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("kit")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).expect("read");
            serde_yaml::Deserializer::from_str(&text)
                .map(|d| Value::deserialize(d).expect("YAML"))
                .collect::<Vec<_>>()
        })
        .find(|d| d["kind"].as_str() == Some(kind))
        .unwrap_or_else(|| panic!("a {kind} in the kit"))
}

fn env_names(container: &Value) -> BTreeSet<String> {
    container["env"]
        .as_sequence()
        .expect("env")
        .iter()
        .map(|e| e["name"].as_str().expect("name").to_string())
        .collect()
}

/// The chart's defaults are the kit's: the same container (ports, probes,
/// security, resources, the variables, and the operator token besides),
/// pod security and grace period, Service ports, NetworkPolicy, autoscaler
/// and disruption budget; the PrometheusRule holds the plain rules file's
/// groups (read from it, one source).
#[test]
fn the_defaults_render_what_the_kit_holds() {
    let docs = render(None, &[]);
    let ours = kind(&docs, "Deployment")["spec"]["template"]["spec"].clone();
    let theirs = kit("Deployment")["spec"]["template"]["spec"].clone();
    let (c, k) = (&ours["containers"][0], &theirs["containers"][0]);
    for field in [
        "ports",
        "readinessProbe",
        "livenessProbe",
        "startupProbe",
        "securityContext",
        "resources",
    ] {
        assert_eq!(c[field], k[field], "container {field}");
    }
    for field in [
        "securityContext",
        "terminationGracePeriodSeconds",
        "automountServiceAccountToken",
    ] {
        assert_eq!(ours[field], theirs[field], "pod {field}");
    }
    let (mine, kits) = (env_names(c), env_names(k));
    let extra: Vec<&String> = mine.difference(&kits).collect();
    assert_eq!(extra, ["RLS_ADMIN_TOKEN_FILE"], "{mine:?} / {kits:?}");
    assert!(kits.is_subset(&mine));
    assert_eq!(
        kind(&docs, "Service")["spec"]["ports"],
        kit("Service")["spec"]["ports"]
    );
    for k in ["HorizontalPodAutoscaler", "PodDisruptionBudget"] {
        let (a, b) = (&kind(&docs, k)["spec"], &kit(k)["spec"]);
        for field in ["minReplicas", "maxReplicas", "maxUnavailable", "metrics"] {
            assert_eq!(a[field], b[field], "{k} {field}");
        }
    }
    let ingress = |v: &Value| {
        v["spec"]["ingress"]
            .as_sequence()
            .expect("ingress")
            .iter()
            .map(|r| r["ports"].clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        ingress(kind(&docs, "NetworkPolicy")),
        ingress(&kit("NetworkPolicy"))
    );
    let plain = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/rules.yaml"),
    )
    .expect("rules.yaml");
    let plain: Value = serde_yaml::from_str(&plain).expect("YAML");
    assert_eq!(
        kind(&docs, "PrometheusRule")["spec"]["groups"],
        plain["groups"]
    );
    // the operator token: made once, 40 characters, mounted as a file
    let secret = kind(&docs, "Secret");
    let token = secret["data"]["token"].as_str().expect("token");
    assert_eq!(token.len(), 56, "base64 of 40 characters: {token}");
}

/// The rendered Deployment's variables are the binary's, and with them
/// (ports and paths moved to the test's, the ConfigMap and the token Secret
/// written as the kubelet mounts them) it starts on a real Redis Cluster
/// and decides; its admin token is the Secret's.
#[tokio::test]
async fn the_rendered_deployment_starts_the_binary_to_a_decision() {
    let cluster = common::redis::RedisCluster::start();
    // (a comma in --set separates values: escaped)
    let url = format!("store.redis.url={}", cluster.url().replace(',', "\\,"));
    let docs = render(None, &[&url]);
    let c = kind(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0].clone();
    let help = binary_help();
    let rules = tempfile::tempdir().expect("tempdir");
    for (name, text) in kind(&docs, "ConfigMap")["data"].as_mapping().expect("data") {
        let name = name.as_str().expect("name");
        std::fs::write(rules.path().join(name), text.as_str().expect("text")).expect("write");
    }
    let secrets = tempfile::tempdir().expect("tempdir");
    let token_b64 = kind(&docs, "Secret")["data"]["token"]
        .as_str()
        .expect("token")
        .to_string();
    let token = String::from_utf8(
        Command::new("base64")
            .arg("-d")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut p| {
                use std::io::Write;
                p.stdin
                    .take()
                    .expect("stdin")
                    .write_all(token_b64.as_bytes())?;
                p.wait_with_output()
            })
            .expect("base64")
            .stdout,
    )
    .expect("utf-8");
    std::fs::write(secrets.path().join("token"), &token).expect("write");
    let (grpc, admin) = (common::free_port(), common::free_port());
    let mut command = common::binary_without_rls_env();
    for e in c["env"].as_sequence().expect("env") {
        let name = e["name"].as_str().expect("name");
        assert!(
            help.contains(&format!("env: {name}")),
            "{name} is not the binary's"
        );
        let value = match name {
            "RLS_GRPC_ADDR" => format!("127.0.0.1:{grpc}"),
            "RLS_ADMIN_ADDR" => format!("127.0.0.1:{admin}"),
            "RLS_PROMETHEUS_ADDR" => format!("127.0.0.1:{}", common::free_port()),
            "RLS_CONFIG" => rules.path().display().to_string(),
            "RLS_ADMIN_TOKEN_FILE" => secrets.path().join("token").display().to_string(),
            _ => e["value"].as_str().expect("a literal value").to_string(),
        };
        command.env(name, value);
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
    // a reset needs the Secret's token (and an operator's header)
    let reset = |bearer: &str| {
        reqwest::Client::new()
            .post(format!(
                "http://127.0.0.1:{admin}/v1/buckets/reset?domain=edge&descriptor=plan%3Dfree%2Capi_key%3Dk"
            ))
            .header("authorization", format!("Bearer {bearer}"))
            .header("x-rls-operator", "1")
            .header("origin", format!("http://127.0.0.1:{admin}"))
            .send()
    };
    assert_eq!(reset("wrong").await.expect("answered").status(), 401);
    assert!(reset(&token).await.expect("answered").status().is_success());
}
