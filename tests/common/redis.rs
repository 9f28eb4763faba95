//! Real `redis-server` processes for tests: a standalone server, or a
//! Redis Cluster of 3 primaries + 3 replicas on loopback ports, built with
//! `redis-cli --cluster create`. Every process is killed when the value is
//! dropped, also when a test panics.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::ChildGuard;

/// One `redis-server` process.
pub struct RedisServer {
    pub port: u16,
    pub dir: PathBuf,
    guard: Option<ChildGuard>,
    extra: Vec<String>,
    _tmp: Option<tempfile::TempDir>,
}

fn port_pair_free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
        && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
}

/// A free port below the kernel's ephemeral range (32768 and up), in
/// `lo..hi`: a Redis server is killed and restarted on its port, and a
/// port in the ephemeral range can meanwhile become some outgoing
/// connection's local port (ci12 lost a restarted server so).
///
/// A port is handed out once per test binary: two tests running side by
/// side could otherwise both find one free before either binds it (the
/// RLQS demo's Envoy once found its port taken so).
pub fn free_port_below_ephemeral(lo: u16, hi: u16, free: impl Fn(u16) -> bool) -> u16 {
    use std::hash::{BuildHasher, Hasher};
    static HANDED_OUT: std::sync::Mutex<Option<std::collections::HashSet<u16>>> =
        std::sync::Mutex::new(None);
    let seed = std::collections::hash_map::RandomState::new();
    for i in 0..10_000u64 {
        let mut h = seed.build_hasher();
        h.write_u64(i);
        let p = lo + (h.finish() % u64::from(hi - lo)) as u16;
        let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
        let handed = handed.get_or_insert_with(Default::default);
        if !handed.contains(&p) && free(p) {
            handed.insert(p);
            return p;
        }
    }
    panic!("no free port in {lo}..{hi}");
}

/// A port for a standalone Redis server (see [`free_port_below_ephemeral`]).
pub fn free_redis_port() -> u16 {
    free_port_below_ephemeral(20_000, 32_768, |p| {
        std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()
    })
}

/// A port `p` with `p` and `p + 10000` (the cluster bus) both free, both
/// below the ephemeral range.
pub fn free_cluster_port() -> u16 {
    free_port_below_ephemeral(10_000, 22_768, port_pair_free)
}

impl RedisServer {
    /// Starts a server with `extra` arguments (e.g. `--cluster-enabled yes`).
    pub fn start(port: u16, extra: &[&str]) -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut server = Self {
            port,
            dir: tmp.path().to_path_buf(),
            guard: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            _tmp: Some(tmp),
        };
        server.spawn();
        server
    }

    pub fn standalone() -> Self {
        Self::start(free_redis_port(), &[])
    }

    fn spawn(&mut self) {
        assert!(
            Command::new("redis-server")
                .arg("--version")
                .output()
                .is_ok(),
            "redis-server is not installed: run the README's test command (it installs it)"
        );
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(["--maxmemory-policy", "noeviction"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.guard = Some(ChildGuard(child));
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.cli(&["PING"]).trim() != "PONG" {
            assert!(
                Instant::now() < deadline,
                "redis-server on {} never answered",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `redis-cli` against this server; returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }

    pub fn kill(&mut self) {
        self.guard = None;
    }

    /// Starts the server again on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Starts a blank server on the same port: no data, a new cluster identity.
    pub fn restart_blank(&mut self) {
        self.kill();
        for entry in std::fs::read_dir(&self.dir).expect("data dir").flatten() {
            let _ = std::fs::remove_file(entry.path());
        }
        self.spawn();
    }

    /// Freezes (`SIGSTOP`) or thaws (`SIGCONT`) the process: a hung server.
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([signal, &self.pid().to_string()])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill {signal}");
    }

    pub fn pid(&self) -> u32 {
        self.guard.as_ref().map(|g| g.0.id()).expect("running")
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
}

/// A Redis Cluster: 3 primaries, each with one replica.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        let cluster = Self::spawn_nodes();
        cluster.create();
        cluster
    }

    /// Every node killed and started blank on the same ports, then a new
    /// cluster created over them: same addresses, new node ids, no data.
    pub fn recreate(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
        for node in &mut self.nodes {
            node.restart_blank();
        }
        self.create();
    }

    pub fn kill_all(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
    }

    fn spawn_nodes() -> Self {
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| {
                RedisServer::start(
                    free_cluster_port(),
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "1000",
                        // Redis 7 waits 5 s before a diskless full sync; a replica
                        // that never synced refuses to take over.
                        "--repl-diskless-sync-delay",
                        "0",
                    ],
                )
            })
            .collect();
        Self { nodes }
    }

    fn create(&self) {
        let addrs: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        self.wait_ok();
    }

    /// Waits until every node reports `cluster_state:ok` and 3 replicas are in sync.
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let all_ok = self
                .live()
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            let replicas = self
                .live()
                .filter(|n| {
                    let info = n.cli(&["INFO", "replication"]);
                    info.contains("role:slave") && info.contains("master_link_status:up")
                })
                .count();
            if all_ok && replicas >= 3 {
                return;
            }
            assert!(Instant::now() < deadline, "cluster never became ok");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn live(&self) -> impl Iterator<Item = &RedisServer> {
        self.nodes.iter().filter(|n| n.guard.is_some())
    }

    /// `redis-cluster://h:p,h:p,…` with every node as a seed.
    pub fn url(&self) -> String {
        format!("redis-cluster://{}", self.seeds())
    }

    /// Every node as `h:p`, comma-separated (envoyproxy/ratelimit's
    /// `REDIS_URL` with `REDIS_TYPE=cluster`).
    pub fn seeds(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        hosts.join(",")
    }

    /// `redis-cli -c` against the first node: it follows MOVED, as a
    /// cluster client does.
    pub fn cli(&self, args: &[&str]) -> String {
        let mut all = vec!["-c"];
        all.extend_from_slice(args);
        redis_cli(self.nodes[0].port, &all)
    }

    /// Nodes that are primaries right now.
    pub fn primaries(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i].guard.is_some() && self.nodes[i].cli(&["ROLE"]).starts_with("master")
            })
            .collect()
    }

    /// A primary other than node `not`.
    pub fn other_primary(&self, not: usize) -> usize {
        *self
            .primaries()
            .iter()
            .find(|&&p| p != not)
            .expect("another primary")
    }

    /// The replica of primary `i`.
    pub fn replica_of(&self, i: usize) -> usize {
        let port = format!("master_port:{}", self.nodes[i].port);
        (0..self.nodes.len())
            .find(|&r| {
                self.nodes[r].guard.is_some()
                    && self.nodes[r].cli(&["INFO", "replication"]).contains(&port)
            })
            .expect("a replica")
    }

    /// Sets a configuration value on every live node.
    pub fn config_set_all(&self, name: &str, value: &str) {
        for n in self.live() {
            let out = n.cli(&["CONFIG", "SET", name, value]);
            assert!(out.contains("OK"), "CONFIG SET {name} {value}: {out}");
        }
    }

    /// The cluster node id of node `i`.
    pub fn node_id(&self, i: usize) -> String {
        self.nodes[i].cli(&["CLUSTER", "MYID"]).trim().to_string()
    }

    /// The primary owning each of the 16384 slots now, read once (asking
    /// per slot would block on a node that is stopped later).
    pub fn slot_owners(&self) -> Vec<usize> {
        let mut owners = vec![usize::MAX; 16384];
        for i in self.primaries() {
            let id = self.node_id(i);
            let nodes = self.nodes[i].cli(&["CLUSTER", "NODES"]);
            for line in nodes.lines().filter(|l| l.starts_with(&id)) {
                for range in line.split_whitespace().skip(8) {
                    let (lo, hi) = match range.split_once('-') {
                        Some((a, b)) => (a.parse::<usize>(), b.parse::<usize>()),
                        None => (range.parse::<usize>(), range.parse::<usize>()),
                    };
                    if let (Ok(lo), Ok(hi)) = (lo, hi) {
                        owners[lo..=hi.min(16383)].fill(i);
                    }
                }
            }
        }
        owners
    }

    /// The node that owns `slot` as primary.
    pub fn owner_of_slot(&self, slot: u16) -> usize {
        let owner = self.slot_owners()[usize::from(slot)];
        assert_ne!(owner, usize::MAX, "no primary owns slot {slot}");
        owner
    }
}

/// A bucket as Redis holds it, in either layout: (tokens, last update µs).
#[allow(dead_code)] // not every test binary reads buckets
pub async fn stored_bucket(client: &fred::clients::Client, key: &[u8]) -> Option<(f64, f64)> {
    use fred::prelude::*;
    let key = fred::types::Key::from(key);
    let kind: String = client.r#type(key.clone()).await.expect("TYPE");
    match kind.as_str() {
        "string" => {
            let value: fred::bytes::Bytes = client.get(key).await.expect("GET");
            let (t, u, _) = tokenbucket_rls::store::redis::unpack_bucket(&value)
                .unwrap_or_else(|| panic!("not a packed bucket: {value:?}"));
            Some((t, u))
        }
        "hash" => {
            let state: Vec<Option<String>> =
                client.hmget(key, vec!["t", "u"]).await.expect("HMGET");
            let number = |s: &Option<String>| s.as_deref().and_then(|v| v.parse::<f64>().ok());
            Some((number(&state[0])?, number(&state[1])?))
        }
        _ => None,
    }
}

/// Calls of `command` (`evalsha`, `eval` …) in a server's `INFO
/// commandstats` text; 0 when it has served none.
#[allow(dead_code)] // not every test binary counts commands
pub fn command_calls(commandstats: &str, command: &str) -> u64 {
    let prefix = format!("cmdstat_{command}:");
    commandstats
        .lines()
        .find(|l| l.starts_with(&prefix))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
}

/// The Redis key of bucket `id` of the descriptor `entries` in `domain`,
/// as the store names it (no key prefix).
#[allow(dead_code)] // not every test binary reads buckets
pub fn bucket_key_in(domain: &str, entries: &[(&str, &str)], id: &str) -> fred::bytes::Bytes {
    use tokenbucket_rls::limiter::key::{bucket_key, descriptor_tag, KeyOrigin};
    use tokenbucket_rls::rules::BucketValue;
    use tokenbucket_rls::store::redis::{redis_key, tag_hash};
    let tag = descriptor_tag(
        KeyOrigin::Rule,
        domain,
        entries.iter().map(|(k, v)| (*k, BucketValue::Value(v))),
    );
    redis_key(tag_hash(&tag), &bucket_key(&tag, id))
}

/// Tokens left in the bucket `id` of the descriptor `entries` in `domain`,
/// read on the standalone server at `port`.
#[allow(dead_code)] // not every test binary reads buckets
pub async fn tokens_on(port: u16, domain: &str, entries: &[(&str, &str)], id: &str) -> f64 {
    stored_tokens_on(port, domain, entries, id)
        .await
        .expect("the bucket is there")
}

/// [`tokens_on`], `None` where the bucket is not stored (a full bucket
/// may be dropped).
#[allow(dead_code)] // not every test binary reads buckets
pub async fn stored_tokens_on(
    port: u16,
    domain: &str,
    entries: &[(&str, &str)],
    id: &str,
) -> Option<f64> {
    use fred::prelude::*;
    let config = tokenbucket_rls::store::redis::url::parse(&format!("redis://127.0.0.1:{port}"))
        .expect("url");
    let raw = Builder::from_config(config).build().expect("client");
    raw.init().await.expect("raw client connects");
    stored_bucket(&raw, &bucket_key_in(domain, entries, id))
        .await
        .map(|b| b.0)
}

/// Rules of one closed rule of 5 a day, for [`three_decisions_on`].
pub const FIVE_A_DAY: &str = "domain: d\ndescriptors:\n  - key: k\n    failure_mode: closed\n    rate_limit: {unit: day, requests_per_unit: 5}\n";

/// Starts the service on the Redis at `url` with [`FIVE_A_DAY`], makes
/// three decisions of `k=v` (4, 3 and 2 left, all from Redis) and stops it.
pub async fn three_decisions_on(url: String) {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    let rules = super::rules_dir(FIVE_A_DAY);
    let mut args = super::serve_args(rules.path().to_path_buf());
    args.store = tokenbucket_rls::cli::StoreKind::Redis;
    args.redis_url = Some(url);
    args.redis_timeout = Duration::from_millis(500);
    let s = tokenbucket_rls::server::start(&args).await.expect("start");
    let mut c = super::client(&s).await;
    for left in [4, 3, 2] {
        let r = c
            .should_rate_limit(super::request("d", vec![super::descriptor(&[("k", "v")])]))
            .await
            .expect("decided")
            .into_inner();
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (Code::Ok as i32, left)
        );
    }
    s.shutdown().await.expect("stop");
}
