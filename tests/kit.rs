//! The kit users meet first: the docker-compose topology (checked as data,
//! since no container engine runs here), the Istio manifests, the Dockerfile's
//! promises, and `integration/demo.sh`, the same topology as local
//! processes, run end to end.

mod common;

use std::path::Path;
use std::process::Command;

use common::free_port;
use common::redis::free_cluster_port;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn yaml(path: &str) -> serde_yaml::Value {
    let text = std::fs::read_to_string(Path::new(ROOT).join(path)).expect(path);
    serde_yaml::from_str(&text).expect(path)
}

#[test]
fn compose_has_the_whole_topology() {
    let compose = yaml("docker-compose.yml");
    let services = compose["services"].as_mapping().expect("services");
    let names: Vec<&str> = services.keys().filter_map(|k| k.as_str()).collect();
    for expected in [
        "redis-1",
        "redis-2",
        "redis-3",
        "redis-4",
        "redis-5",
        "redis-6",
        "redis-cluster-init",
        "rls-1",
        "rls-2",
        "upstream",
        "envoy",
    ] {
        assert!(names.contains(&expected), "service {expected} in {names:?}");
    }
    for i in 1..=6 {
        let cmd = format!(
            "{:?}",
            compose["services"][format!("redis-{i}").as_str()]["command"]
        );
        assert!(
            cmd.contains("--cluster-enabled") && cmd.contains("noeviction"),
            "redis-{i}: {cmd}"
        );
    }
    let init = format!("{:?}", compose["services"]["redis-cluster-init"]["command"]);
    assert!(init.contains("--cluster-replicas 1"), "{init}");
    for rls in ["rls-1", "rls-2"] {
        let s = &compose["services"][rls];
        assert_eq!(
            s["build"].as_str(),
            Some("."),
            "{rls} builds the Dockerfile"
        );
        assert_eq!(s["environment"]["RLS_STORE"].as_str(), Some("redis"));
        assert!(s["environment"]["RLS_REDIS_URL"]
            .as_str()
            .is_some_and(|u| u.starts_with("redis-cluster://")));
        assert_eq!(s["environment"]["RLS_INSTANCES"].as_str(), Some("2"));
        let volumes = format!("{:?}", s["volumes"]);
        assert!(
            volumes.contains("./config:/srv/tokenbucket-rls/config"),
            "{rls} mounts the rules: {volumes}"
        );
        assert!(format!("{:?}", s["depends_on"]).contains("service_completed_successfully"));
    }
    let envoy = &compose["services"]["envoy"];
    let volumes = format!("{:?}", envoy["volumes"]);
    assert!(
        volumes.contains("./examples/envoy/compose.yaml:/etc/envoy/envoy.yaml"),
        "{volumes}"
    );
    assert!(Path::new(ROOT)
        .join("examples/envoy/compose.yaml")
        .is_file());
    assert!(format!("{:?}", envoy["ports"]).contains("10000:10000"));
    // the bootstrap it mounts reaches both instances and the upstream by name
    let bootstrap = std::fs::read_to_string(Path::new(ROOT).join("examples/envoy/compose.yaml"))
        .expect("bootstrap");
    for name in ["address: rls-1", "address: rls-2", "address: upstream"] {
        assert!(bootstrap.contains(name), "{name}");
    }
}

#[test]
fn the_dockerfile_builds_both_binaries_and_runs_as_non_root() {
    let text = std::fs::read_to_string(Path::new(ROOT).join("Dockerfile")).expect("Dockerfile");
    assert!(text.contains("cargo build --release --locked --bins"));
    // rules where the default `config` resolves, and no RLS_* variable set
    // by the image: envoyproxy/ratelimit's environment must not be shadowed
    assert!(text.contains("WORKDIR /srv/tokenbucket-rls"));
    assert!(text.contains("COPY config/ /srv/tokenbucket-rls/config/"));
    assert!(
        !text
            .lines()
            .any(|l| l.trim_start().starts_with("ENV") || l.contains("RLS_CONFIG=")),
        "no ENV in the image"
    );
    // the command Deployments written for envoyproxy/ratelimit run, as nobody
    assert!(text.contains("ln -s /usr/local/bin/tokenbucket-rls /bin/ratelimit"));
    assert!(text.contains("USER 65534:65534"));
    assert!(text.contains("EXPOSE 8081 8080"));
    let user = text
        .lines()
        .find(|l| l.starts_with("USER "))
        .expect("a USER line");
    assert!(!user.contains("root") && !user.contains(" 0"), "{user}");
    // the build stage copies what cargo needs and nothing ignored
    let copies: Vec<&str> = text.lines().filter(|l| l.starts_with("COPY ")).collect();
    for path in ["Cargo.toml", "Cargo.lock", "src", "config/"] {
        assert!(
            copies.iter().any(|l| l
                .split_whitespace()
                .any(|w| w.trim_end_matches('/') == path.trim_end_matches('/'))),
            "copies {path}: {copies:?}"
        );
        assert!(Path::new(ROOT).join(path).exists());
    }
}

/// The Istio example's EnvoyFilter calls the kit's Service (its install
/// from the kit is checked in tests/kubernetes.rs).
#[test]
fn istio_envoyfilter_points_at_the_kits_service() {
    let filter = yaml("examples/istio/envoyfilter.yaml");
    assert_eq!(filter["kind"].as_str(), Some("EnvoyFilter"));
    let patches = format!("{filter:?}");
    assert!(patches.contains("outbound|8081||tokenbucket-rls.rate-limit.svc.cluster.local"));
    assert!(patches.contains("envoy.filters.http.ratelimit"));
}

/// The AI Gateway token budget: the metadata key AI Gateway writes is the
/// one the policy charges from, checked at request time with a cost of 0.
#[test]
fn the_llm_token_budget_example_is_consistent() {
    let text = std::fs::read_to_string(
        Path::new(ROOT).join("examples/envoy-gateway/llm-token-budget.yaml"),
    )
    .expect("example");
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("a YAML document"))
        .collect();
    let of = |kind: &str| {
        docs.iter()
            .find(|d| d["kind"].as_str() == Some(kind))
            .unwrap_or_else(|| panic!("a {kind}"))
    };
    let route = of("AIGatewayRoute");
    let key = route["spec"]["llmRequestCosts"][0]["metadataKey"]
        .as_str()
        .expect("metadataKey");
    let policy = of("BackendTrafficPolicy");
    assert_eq!(
        policy["spec"]["targetRefs"][0]["name"], route["metadata"]["name"],
        "the policy targets the route's HTTPRoute"
    );
    let cost = &policy["spec"]["rateLimit"]["global"]["rules"][0]["cost"];
    assert_eq!(cost["request"]["number"].as_u64(), Some(0), "a check");
    let from = &cost["response"]["metadata"];
    assert_eq!(from["namespace"].as_str(), Some("io.envoy.ai_gateway"));
    assert_eq!(from["key"].as_str(), Some(key));
}

#[test]
fn the_demo_runs_end_to_end() {
    let redis_base = free_cluster_port();
    let (edge, upstream, admin) = (free_port(), free_port(), free_port());
    let (rls1, rls2) = (pair(), pair());
    let out = Command::new("bash")
        .arg(Path::new(ROOT).join("integration/demo.sh"))
        .arg("--check")
        .current_dir(ROOT)
        .env("RLS_BIN", env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .env("EDGE_PORT", edge.to_string())
        .env("UPSTREAM_PORT", upstream.to_string())
        .env("ENVOY_ADMIN_PORT", admin.to_string())
        .env("RLS_PORT_1", rls1.to_string())
        .env("RLS_PORT_2", rls2.to_string())
        .env("REDIS_BASE", redis_base_for_six(redis_base).to_string())
        .output()
        .expect("run demo.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("200 200 200 200 200 429 429"), "{stdout}");
    // 10 a minute: one token every 6 s, so 6 right after the burst is
    // spent, less when the seven calls took a second or more (a busy box)
    let retry_after = stdout
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("retry-after: ")
                .map(str::to_string)
        })
        .and_then(|v| v.trim().parse::<u64>().ok());
    assert!(
        retry_after.is_some_and(|s| (1..=6).contains(&s)),
        "{stdout}"
    );
    assert!(stdout.contains("demo check: ok"));
}

/// `demo.sh --rlqs --check`: two Envoys, one on each instance, split one
/// gold key's budget through the shared ledger in the Redis Cluster; the
/// script asserts the pair admits within burst + rate × time, both admit
/// and refuse, and each instance holds one RLQS stream.
#[test]
fn the_rlqs_demo_runs_end_to_end() {
    let redis_base = free_cluster_port();
    let ports: Vec<u16> = (0..6).map(|_| free_port()).collect();
    let (rls1, rls2) = (pair(), pair());
    let out = Command::new("bash")
        .arg(Path::new(ROOT).join("integration/demo.sh"))
        .args(["--rlqs", "--check"])
        .current_dir(ROOT)
        .env("RLS_BIN", env!("CARGO_BIN_EXE_tokenbucket-rls"))
        .env("EDGE_PORT", ports[0].to_string())
        .env("UPSTREAM_PORT", ports[1].to_string())
        .env("ENVOY_ADMIN_PORT", ports[2].to_string())
        .env("EDGE_PORT_2", ports[3].to_string())
        .env("UPSTREAM_PORT_2", ports[4].to_string())
        .env("ENVOY_ADMIN_PORT_2", ports[5].to_string())
        .env("RLS_PORT_1", rls1.to_string())
        .env("RLS_PORT_2", rls2.to_string())
        .env("REDIS_BASE", redis_base_for_six(redis_base).to_string())
        .output()
        .expect("run demo.sh --rlqs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("together: "), "{stdout}");
    assert!(stdout.contains("demo check: ok"));
}

/// A port p with p + 1 free too (gRPC and admin).
fn pair() -> u16 {
    loop {
        let p = free_port();
        if p < 65_000 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
}

/// A base port with six consecutive free ports (and their cluster bus ports).
fn redis_base_for_six(first: u16) -> u16 {
    let free = |p: u16| {
        std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok()
    };
    let mut base = first;
    loop {
        if base < 55_000 && (base..base + 6).all(free) {
            return base;
        }
        base = free_cluster_port();
    }
}
