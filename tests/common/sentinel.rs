//! A Redis Sentinel deployment on loopback for tests: a primary, two
//! replicas and three sentinels (`redis-server … --sentinel`, quorum 2,
//! a primary down after 1 s), every process killed when the value drops.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::redis::{free_redis_port, redis_cli, RedisServer};
use super::ChildGuard;

/// The master's name the sentinels monitor.
pub const MASTER: &str = "mymaster";

/// One sentinel process.
pub struct Sentinel {
    pub port: u16,
    _guard: ChildGuard,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    fn start(primary: u16) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_redis_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\n\
                 sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds {MASTER} 1000\n\
                 sentinel failover-timeout {MASTER} 4000\n\
                 sentinel parallel-syncs {MASTER} 2\n",
                dir.path().display()
            ),
        )
        .expect("write sentinel.conf");
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server --sentinel");
        let sentinel = Self {
            port,
            _guard: ChildGuard(child),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while sentinel.cli(&["PING"]).trim() != "PONG" {
            assert!(
                Instant::now() < deadline,
                "sentinel on {port} never answered"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        sentinel
    }

    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }

    /// A field of `SENTINEL MASTER mymaster` (e.g. `num-slaves`).
    fn master_field(&self, field: &str) -> Option<String> {
        let out = self.cli(&["SENTINEL", "MASTER", MASTER]);
        let lines: Vec<&str> = out.lines().map(str::trim).collect();
        lines
            .chunks(2)
            .find(|kv| kv.first() == Some(&field))
            .and_then(|kv| kv.get(1))
            .map(|v| v.to_string())
    }

    /// The port of the primary this sentinel names.
    pub fn primary_port(&self) -> Option<u16> {
        let out = self.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER]);
        out.lines().nth(1).and_then(|p| p.trim().parse().ok())
    }
}

/// A primary, two replicas, three sentinels.
pub struct SentinelSet {
    /// The data servers; `servers[0]` is the first primary.
    pub servers: Vec<RedisServer>,
    pub sentinels: Vec<Sentinel>,
}

impl SentinelSet {
    /// Starts it and waits until every sentinel knows both replicas and the
    /// other two sentinels (so that a failover can be agreed).
    pub fn start() -> Self {
        let primary = RedisServer::standalone();
        let p = primary.port.to_string();
        let mut servers = vec![primary];
        for _ in 0..2 {
            servers.push(RedisServer::start(
                free_redis_port(),
                &["--replicaof", "127.0.0.1", &p],
            ));
        }
        let sentinels: Vec<Sentinel> = (0..3).map(|_| Sentinel::start(servers[0].port)).collect();
        let set = Self { servers, sentinels };
        set.wait_settled();
        set
    }

    /// Every sentinel sees two replicas and two other sentinels, and names
    /// one primary.
    pub fn wait_settled(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let settled = self.sentinels.iter().all(|s| {
                s.master_field("num-slaves").as_deref() == Some("2")
                    && s.master_field("num-other-sentinels").as_deref() == Some("2")
                    && s.master_field("flags").as_deref() == Some("master")
            });
            let named: Vec<Option<u16>> =
                self.sentinels.iter().map(Sentinel::primary_port).collect();
            if settled && named.windows(2).all(|w| w[0] == w[1]) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the sentinels never settled: {:?}",
                self.sentinels[0].cli(&["SENTINEL", "MASTER", MASTER])
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis-sentinel://` naming the three sentinels and `master`.
    pub fn url_for(&self, master: &str) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis-sentinel://{}/{master}", hosts.join(","))
    }

    pub fn url(&self) -> String {
        self.url_for(MASTER)
    }

    /// The index in `servers` of the primary the first sentinel that
    /// answers names.
    pub fn primary(&self) -> usize {
        let port = self
            .sentinels
            .iter()
            .find_map(Sentinel::primary_port)
            .expect("a sentinel names the primary");
        self.servers
            .iter()
            .position(|s| s.port == port)
            .expect("the primary is one of the servers")
    }

    /// Waits until every replica of the primary `i` has all it wrote.
    pub fn replicas_caught_up(&self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let info = self.servers[i].cli(&["INFO", "replication"]);
            let offset = info
                .lines()
                .find_map(|l| l.strip_prefix("master_repl_offset:"))
                .and_then(|v| v.trim().parse::<u64>().ok());
            let replicas: Vec<u64> = info
                .lines()
                .filter(|l| l.starts_with("slave"))
                .filter_map(|l| l.split(',').find_map(|kv| kv.strip_prefix("offset=")))
                .filter_map(|v| v.trim().parse().ok())
                .collect();
            if offset.is_some()
                && !replicas.is_empty()
                && replicas.iter().all(|r| Some(*r) == offset)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the replicas did not catch up: {info}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
