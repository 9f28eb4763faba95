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
    /// Frozen (`SIGSTOP`): the helpers ask only the others.
    pub frozen: bool,
    _guard: ChildGuard,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    pub fn start(primary: u16) -> Self {
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
            frozen: false,
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
        assert!(!self.frozen, "a frozen sentinel is not asked");
        redis_cli(self.port, args)
    }

    /// Freezes the process (`SIGSTOP`): a sentinel that takes connections
    /// and answers nothing. Killed as usual when the set is dropped.
    pub fn freeze(&mut self) {
        let ok = Command::new("kill")
            .args(["-STOP", &self._guard.0.id().to_string()])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill -STOP");
        self.frozen = true;
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

    /// The sentinels that are not frozen.
    pub fn answering(&self) -> impl Iterator<Item = &Sentinel> {
        self.sentinels.iter().filter(|s| !s.frozen)
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
            .answering()
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

/// What traffic saw through a failover, counted by the traffic's task.
#[derive(Default)]
pub struct Seen {
    pub admitted: std::sync::atomic::AtomicU64,
    /// Answered by the failure mode (UNAVAILABLE, or Envoy's 503).
    pub unavailable: std::sync::atomic::AtomicU64,
    /// When the sentinels named the new primary (ms since the run's
    /// epoch; 0: not yet).
    announced_at: std::sync::atomic::AtomicU64,
    /// The first admission at or after `announced_at` (ms since the epoch).
    first_after: std::sync::atomic::AtomicU64,
    pub stop: std::sync::atomic::AtomicBool,
    epoch: std::sync::OnceLock<Instant>,
}

impl Seen {
    pub fn new() -> Self {
        let seen = Self::default();
        let _ = seen.epoch.set(Instant::now());
        seen
    }

    fn since_epoch(&self) -> u64 {
        self.epoch
            .get()
            .map_or(0, |e| e.elapsed().as_millis() as u64)
    }

    pub fn admitted(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        self.admitted.fetch_add(1, SeqCst);
        let announced = self.announced_at.load(SeqCst);
        let now = self.since_epoch();
        if announced > 0 && now >= announced {
            let _ = self.first_after.compare_exchange(0, now, SeqCst, SeqCst);
        }
    }

    pub fn failed(&self) {
        self.unavailable
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn stopped(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// What a failover took, as the traffic saw it.
pub struct Failover {
    /// The new primary's port.
    pub new_port: u16,
    /// From the command (or the kill) until every sentinel named it.
    pub announced_after: Duration,
    /// From the announcement until the new primary ran its first decision.
    pub switched_ms: i64,
    /// From the announcement until the next admission.
    pub resumed_ms: u64,
    /// Admitted from the failover's start to 300 ms after the
    /// announcement: the most writes the old primary can have taken unseen.
    pub in_window: f64,
}

impl SentinelSet {
    /// Waits until every sentinel that answers names a primary other than
    /// the one on `old_port`, and returns its port (polled off the runtime).
    pub async fn named_other_than(&self, old_port: u16) -> u16 {
        let ports: Vec<u16> = self.answering().map(|s| s.port).collect();
        tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let named: Vec<Option<u16>> = ports
                    .iter()
                    .map(|p| {
                        redis_cli(*p, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER])
                            .lines()
                            .nth(1)
                            .and_then(|p| p.trim().parse().ok())
                    })
                    .collect();
                if let Some(Some(port)) = named.first() {
                    if *port != old_port && named.iter().all(|n| *n == Some(*port)) {
                        return *port;
                    }
                }
                assert!(
                    Instant::now() < deadline,
                    "the sentinels never named a new primary: {named:?}"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        })
        .await
        .expect("poll")
    }

    /// Fails the primary over while `seen`'s traffic runs (with `kill`: the
    /// primary killed outright; else `SENTINEL FAILOVER`), and waits until
    /// the sentinels name another primary, decisions reach it and are
    /// admitted again. The replicas catch up first: this blocks the test's
    /// runtime (traffic and service included), so that no write comes
    /// between them having everything and the failover.
    pub async fn fail_over(&mut self, kill: bool, seen: &Seen) -> Failover {
        use std::sync::atomic::Ordering::SeqCst;
        let old = self.primary();
        let old_port = self.servers[old].port;
        self.replicas_caught_up(old);
        let started = Instant::now();
        let admitted_before = seen.admitted.load(SeqCst);
        if kill {
            self.servers[old].kill();
        } else {
            let first = self.answering().next().expect("a sentinel answers");
            let out = first.cli(&["SENTINEL", "FAILOVER", MASTER]);
            assert_eq!(out.trim(), "OK", "SENTINEL FAILOVER: {out}");
        }
        let new_port = self.named_other_than(old_port).await;
        let announced = seen.since_epoch().max(1);
        seen.announced_at.store(announced, SeqCst);
        let announced_after = started.elapsed();
        // the new primary's first script call
        let switched = tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let stats = redis_cli(new_port, &["INFO", "commandstats"]);
                if super::redis::command_calls(&stats, "evalsha")
                    + super::redis::command_calls(&stats, "eval")
                    > 0
                {
                    return Instant::now();
                }
                assert!(
                    Instant::now() < deadline,
                    "decisions never reached the new primary"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
        })
        .await
        .expect("poll");
        let switched_ms = seen
            .epoch
            .get()
            .map_or(0, |e| (switched - *e).as_millis() as i64)
            - announced as i64;
        let deadline = Instant::now() + Duration::from_secs(30);
        while seen.first_after.load(SeqCst) == 0 {
            assert!(
                Instant::now() < deadline,
                "decisions never resumed after the failover"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        Failover {
            new_port,
            announced_after,
            switched_ms,
            resumed_ms: seen.first_after.load(SeqCst) - announced,
            in_window: (seen.admitted.load(SeqCst) - admitted_before) as f64,
        }
    }
}

impl Failover {
    /// Checks the bucket's `tokens` (of `burst`, refilling 1 a day) after
    /// the traffic `seen` stopped, and says what the failover cost.
    /// Without failures, tokens = burst − admitted. Writes the old primary
    /// acknowledged and never replicated are lost, and their tokens spent
    /// again (positive); a call answered by the failure mode that ran anyway
    /// spent a token nobody used (negative, one per such call at most). A
    /// decision sent twice would spend one more than both allow.
    pub fn check_budget(&self, label: &str, seen: &Seen, tokens: f64, burst: f64) {
        use std::sync::atomic::Ordering::SeqCst;
        let admitted = seen.admitted.load(SeqCst) as f64;
        let unavailable = seen.unavailable.load(SeqCst);
        let drift = (tokens - (burst - admitted)).round();
        eprintln!(
            "{label}: new primary named {:?} after the failover began; its first decision {} ms after, an admission {} ms after; \
             {admitted} admitted ({} from the failover's start to 300 ms after the announcement), {unavailable} answered by the failure mode; \
             tokens left minus expected: {drift} (lost writes minus calls that ran unanswered)",
            self.announced_after, self.switched_ms, self.resumed_ms, self.in_window
        );
        assert!(
            drift >= -(unavailable as f64),
            "no more tokens gone than admitted requests plus unanswered calls: {tokens} left after {admitted} admitted"
        );
        assert!(
            drift <= self.in_window,
            "at most the writes between the failover's start and the switch are lost: {drift} of {}",
            self.in_window
        );
    }
}
