//! Buckets in Redis or Redis Cluster, one atomic Lua decision per descriptor.
//!
//! Each bucket is a key `rls:{H}:<key>` holding a 24-byte packed value
//! (tokens, last update, expiry set; see [`BucketLayout`]): `H` is a hash of the descriptor's
//! tag, so every bucket of one descriptor lands in one slot and a single
//! `EVALSHA` of `bucket.lua` decides them together with the owning server's
//! clock. The key bytes after the tag are the unambiguous encoding of
//! `limiter::key`. A script missing from the server's cache (`NOSCRIPT`,
//! after `SCRIPT FLUSH` or a failover) is sent once with `EVAL`. A call that
//! timed out or lost its connection is never re-sent, since it may have
//! deducted: the caller's failure policy answers instead. A call answered
//! `TRYAGAIN` (its keys are split between two nodes by a slot migration
//! under way: the script did not run) is sent again after a short wait,
//! within the call's time budget ([`TRYAGAIN_FIRST_WAIT`]). The decisions
//! queued for one primary at one moment share one call ([`batch`]), each
//! decided as if alone.

pub mod batch;
mod counter;
pub mod credentials;
mod forget;
mod held;
pub mod hitters;
mod instances;
mod keys;
pub mod memory;
pub mod nodes;
pub mod pipe;
mod primary_events;
mod reach;
mod redial;
mod redirect;
mod reply;
pub mod resp;
mod script_args;
pub mod sentinel;
mod tls_config;
mod tls_files;
pub mod url;
mod work;

#[cfg(test)]
use self::keys::hex16;
pub use self::keys::{empty_hash_tag, redis_key, slot_of, tag_hash};
use self::redirect::{redirect_of, Redirect, MAX_REDIRECTIONS};
use self::reply::{outcomes, store_error};
use self::tls_config::tls_client_config;
pub use self::work::LuaScript;
use self::work::Work;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fred::bytes::Bytes;
use fred::error::{Error as RedisError, ErrorKind};
use fred::prelude::*;
use fred::types::config::{Options, ServerConfig};
use parking_lot::RwLock;

use self::nodes::{ClientRecipe, NodeClients, Routing};
use super::breaker::Nodes;
use super::{AttemptOutcome, DescriptorBuckets, Store, StoreError};
use crate::attempt::{self, AttemptCall, AttemptMode, AttemptResult, Phase, SlotOutcome};
use crate::bucket::{BucketOutcome, Cost};
use crate::labels::RuleId;
use crate::replication::Replication;
use crate::telemetry::Metrics;

/// The decision script, kept in its own file.
pub const SCRIPT: &str = include_str!("bucket.lua");

/// The lean script of one bucket's decision (its header says which).
pub const ONE_SCRIPT: &str = include_str!("one.lua");

/// A `concurrency` rule's slots (`slots.lua`).
static SLOTS: std::sync::LazyLock<LuaScript> =
    std::sync::LazyLock::new(|| LuaScript::new(include_str!("slots.lua")));

/// The first wait before a call answered `TRYAGAIN` is sent again; each
/// further wait doubles, up to [`TRYAGAIN_MAX_WAIT`], while the call's time
/// budget lasts (a migration moves a slot's keys within milliseconds).
pub const TRYAGAIN_FIRST_WAIT: Duration = Duration::from_millis(2);
pub const TRYAGAIN_MAX_WAIT: Duration = Duration::from_millis(50);
/// Sends of one call at most, whatever its budget.
const TRYAGAIN_MAX_SENDS: u32 = 64;

/// How a bucket is written. Both are read: the script converts as it writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BucketLayout {
    /// One string per bucket, `struct.pack('<ddd', tokens, updated µs,
    /// expiry ms)`: read with one `GET`, written with one `SET … PX`.
    #[default]
    Packed,
    /// The hash (`t`, `u`) of versions before 0.2, written with `HSET` and
    /// `PEXPIRE`: for the first step of a rolling upgrade, while instances
    /// that read only hashes still run.
    Hash,
}

/// Tokens, last update (µs) and expiry (ms, server time; 0: none) of a
/// bucket stored in the packed layout, or `None` for another value.
pub fn unpack_bucket(value: &[u8]) -> Option<(f64, f64, f64)> {
    let field = |i: usize| -> Option<f64> {
        Some(f64::from_le_bytes(
            value.get(8 * i..8 * i + 8)?.try_into().ok()?,
        ))
    };
    (value.len() == 24).then_some(())?;
    Some((field(0)?, field(1)?, field(2)?))
}

/// How the store connects.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    pub url: String,
    /// Per decision; must stay below Envoy's rate-limit filter timeout.
    pub timeout: Duration,
    /// Connections (clients) to each primary, shared by all requests; each pipelines.
    pub pool_size: usize,
    /// Serving threads ([`crate::serving`]): each gets a connection of its
    /// own to every primary, on its own runtime (0: none).
    pub serving_threads: usize,
    /// Decisions one script call carries at most (1: each alone;
    /// [`batch`]); `None`: [`batch::DEFAULT_MAX`] on a Redis Cluster, 1 on
    /// a single server (it may be a proxy sharding keys itself, which would
    /// route a batch by its first key; a cluster's primaries refuse keys
    /// of slots they do not hold).
    pub batch: Option<usize>,
    /// For `rediss://`: the CA that signed the servers' certificates
    /// (default: the system's roots).
    pub ca_file: Option<PathBuf>,
    /// For `rediss://` servers that ask for a client certificate.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// How buckets are written.
    pub layout: BucketLayout,
    /// Put in front of every key (`--redis-key-prefix`, envoyproxy/ratelimit's
    /// `CACHE_KEY_PREFIX`), to share a Redis with others; without braces,
    /// which would move the keys' slots.
    pub key_prefix: String,
    /// For `rediss://`: check the servers' certificates against the CA but
    /// not their names.
    pub skip_hostname_verification: bool,
    /// A file holding the password, read again for every new connection
    /// (`--redis-password-file`: credentials that rotate).
    pub password_file: Option<PathBuf>,
    /// The most seconds added at random to the expiry of a window counted
    /// in envoyproxy/ratelimit's keys (its `EXPIRATION_JITTER_MAX_SECONDS`;
    /// 0: none), so that a window's keys do not all expire at once.
    pub expiry_jitter_max_secs: u64,
}

/// Time allowed for the breaker's probe of each server.
const PROBE_TIMEOUT: Duration = Duration::from_millis(250);

/// What the store has learned about its servers, for `/readyz` and logs.
#[derive(Debug, Clone, Default)]
pub struct RedisStatus {
    /// Servers whose `maxmemory-policy` may evict bucket keys.
    pub eviction_warnings: Vec<String>,
    /// Primaries near their `maxmemory`.
    pub memory_warnings: Vec<String>,
}

pub struct RedisStore {
    /// For a cluster: fred's cluster client, off the hot path. It learns
    /// the topology and follows the redirections a primary answers while
    /// slots move (see [`nodes`]).
    cluster: Option<Pool>,
    /// For a cluster: how to connect to a primary a redirection names.
    recipe: Option<ClientRecipe>,
    /// Each primary's own connections, by the slots it owns.
    routing: Arc<RwLock<Arc<Routing>>>,
    /// `bucket.lua`, and `one.lua` for the decisions it takes (unless
    /// [`RedisStore::with_bucket_lua_only`]).
    script: LuaScript,
    one_script: Option<LuaScript>,
    layout: BucketLayout,
    /// [`RedisSettings::key_prefix`].
    key_prefix: Bytes,
    /// [`RedisSettings::expiry_jitter_max_secs`].
    expiry_jitter_max_secs: u64,
    options: Options,
    status: Arc<RwLock<RedisStatus>>,
    /// Where calls sent again after `TRYAGAIN` are counted.
    metrics: Option<Arc<Metrics>>,
    /// For a `redis-sentinel://` URL: the sentinels, asked again at once
    /// when a decision meets `READONLY`.
    sentinels: Option<Arc<sentinel::Sentinels>>,
    /// For one server (`redis://`, `unix://`): its address, dialled again
    /// at once when a decision meets `READONLY` (a failover that pointed
    /// the address elsewhere and left the connections on the demoted one).
    redial: Option<Arc<redial::Redial>>,
}

impl RedisStore {
    /// Connects (waiting a few seconds at most: a Redis that is down at
    /// start-up is the failure policy's business, not a reason not to start),
    /// and checks the servers' eviction policy.
    pub async fn connect(settings: &RedisSettings) -> Result<Self, String> {
        if keys::empty_hash_tag(&settings.key_prefix) {
            return Err(format!(
                "the Redis key prefix {:?} holds an empty hash tag (`{{}}`): Redis Cluster would hash each key whole, putting one descriptor's keys in different slots; use one without it",
                settings.key_prefix
            ));
        }
        let mut config = url::parse(&settings.url)?;
        if let Some(path) = &settings.password_file {
            if config.password.is_some() {
                return Err(format!(
                    "--redis-password-file ({}) and a password in the Redis URL: give one of them",
                    path.display()
                ));
            }
            if matches!(config.server, ServerConfig::Sentinel { .. }) {
                return Err("--redis-password-file is not offered with Sentinel (its sentinels and servers may have passwords of their own): give the password in the URL".into());
            }
            let file = credentials::PasswordFile::new(path, config.username.clone())?;
            config.credential_provider = Some(Arc::new(file));
        }
        if let Some(tls) = tls_client_config(settings)? {
            if config.tls.is_none() {
                return Err("--redis-ca-file, --redis-client-cert and --redis-tls-skip-hostname-verification need a rediss:// or rediss-cluster:// URL".into());
            }
            config.tls = Some(tls.into());
        }
        let recipe = ClientRecipe {
            config: config.clone(),
            pool_size: settings.pool_size,
            serving_threads: settings.serving_threads,
            batch: settings.batch.unwrap_or(match config.server {
                // a primary found through sentinels is a Redis, not a proxy
                ServerConfig::Clustered { .. } | ServerConfig::Sentinel { .. } => {
                    batch::DEFAULT_MAX
                }
                _ => 1,
            }),
            command_timeout: settings.timeout,
        };
        let redacted = url::redact(&settings.url);
        // a look first: a name that does not resolve or a port that refuses
        // is said as such, and the start does not wait seconds for it
        let reached = reach::reach(&config.server).await;
        if let Err(why) = &reached {
            tracing::warn!(url = %redacted, "Redis not reachable at start-up ({why}); failure policies answer until it is, and the connection is retried in the background");
        }
        let wait = if reached.is_ok() {
            Duration::from_secs(5)
        } else {
            Duration::ZERO
        };
        let mut sentinels = None;
        let mut redialled = None;
        let (cluster, routing) = match &config.server {
            ServerConfig::Sentinel { .. } => {
                let (watched, routing) = sentinel::connect(&config, &recipe, &redacted).await?;
                sentinels = Some(watched);
                (None, routing)
            }
            ServerConfig::Clustered { .. } => {
                // one connection per primary is plenty for redirections
                let cluster = ClientRecipe {
                    pool_size: 1,
                    ..recipe.clone()
                }
                .pool(config.clone())?;
                cluster.connect();
                if reached.is_ok() {
                    let connected = tokio::time::timeout(wait, cluster.wait_for_connect()).await;
                    reach::log_connect(&redacted, connected);
                }
                let routing = nodes::reread(cluster.next(), &Routing::default(), &recipe)
                    .await
                    .map(|(routing, _)| routing)
                    .unwrap_or_default();
                (Some(cluster), routing)
            }
            _ => {
                let name: Arc<str> = Arc::from(match &config.server {
                    ServerConfig::Centralized { server } => server.to_string(),
                    ServerConfig::Unix { path } => path.display().to_string(),
                    _ => "redis".to_string(),
                });
                let clients = NodeClients::connect(&recipe, config.clone())?;
                redialled = Some(redial::Redial::new(name.clone(), config.clone()));
                if reached.is_ok() {
                    let connected =
                        tokio::time::timeout(wait, clients.pool.wait_for_connect()).await;
                    reach::log_connect(&redacted, connected);
                    clients.wait(Duration::from_secs(2)).await;
                }
                (None, Routing::single(name, clients))
            }
        };
        let routing = Arc::new(RwLock::new(Arc::new(routing)));
        if let Some(cluster) = &cluster {
            nodes::spawn_refresh(cluster.clone(), recipe.clone(), Arc::downgrade(&routing));
        }
        if let Some(redialled) = &redialled {
            redial::spawn(redialled.clone(), recipe.clone(), Arc::downgrade(&routing));
        }
        if let Some(watched) = &sentinels {
            sentinel::spawn_watch(watched.clone(), recipe.clone(), Arc::downgrade(&routing));
        }
        let store = Self {
            recipe: cluster.is_some().then(|| recipe.clone()),
            cluster,
            routing,
            script: LuaScript::decisions(batch::DecisionScript::Bucket),
            one_script: Some(LuaScript::decisions(batch::DecisionScript::One)),
            layout: settings.layout,
            key_prefix: Bytes::from(settings.key_prefix.clone().into_bytes()),
            expiry_jitter_max_secs: settings.expiry_jitter_max_secs,
            options: Options {
                timeout: Some(settings.timeout),
                // `fail_fast` answers every command that was written when its
                // connection dies with an error, never re-sending it (it may have
                // deducted), and fails at once while disconnected instead of
                // queueing in memory. Further attempts only re-send what did
                // not run: redirections and writes that never left. fred counts
                // every write of a command, and while `redis-cli --cluster
                // reshard` moves slots under load a command can meet ASK, then
                // MOVED, then a routing table that is still stale, several
                // times over (4 attempts were not always enough). The command
                // timeout bounds them all.
                fail_fast: true,
                max_attempts: Some(10),
                ..Options::default()
            },
            status: Arc::default(),
            metrics: None,
            sentinels,
            redial: redialled,
        };
        if reached.is_ok() {
            store.check_eviction_policy().await;
        }
        Ok(store)
    }

    /// Shared view of what the store found about its servers.
    pub fn status(&self) -> Arc<RwLock<RedisStatus>> {
        self.status.clone()
    }

    /// Runs `script` on `node`'s pipelined connections (or its `pool`),
    /// sent once with `EVAL` when the server's script cache is empty
    /// (flush, restart, failover).
    async fn run_on(
        &self,
        script: &LuaScript,
        node: &NodeClients,
        keys: &[Key],
        args: &[Value],
        options: &Options,
        wait: Option<Replication>,
    ) -> Result<Vec<i64>, RedisError> {
        if let Some(pipes) = &node.pipes {
            if let Some(decisions) = script.decisions {
                return pipes.decide(decisions, keys, args, wait).await;
            }
            return pipes.eval(&script.sha, script.body, keys, args).await;
        }
        // boxed: fred's futures are kilobytes, and would make every
        // decision's future (moved when it is boxed) as large
        Box::pin(async {
            let client = node.pool.next().with_options(options);
            let mut reply: Vec<i64> = match client
                .evalsha(&script.sha, keys.to_vec(), args.to_vec())
                .await
            {
                Err(e) if e.details().starts_with("NOSCRIPT") => {
                    client.eval(script.body, keys.to_vec(), args.to_vec()).await
                }
                other => other,
            }?;
            // on the same connection: the replicas' count ends the reply
            if let Some(w) = wait {
                let acked: i64 = client
                    .wait(i64::from(w.replicas), w.timeout_ms() as i64)
                    .await?;
                reply.push(acked);
            }
            Ok(reply)
        })
        .await
    }

    /// Counts in `metrics` the calls it sends again (`rls_store_retries_total`)
    /// and, for one primary (a single server, or Sentinel's), what the watch
    /// of which server is the primary sees (`rls_store_primary_events_total`).
    /// Every decision runs `bucket.lua`, one bucket's too (the case tables
    /// check its one-bucket cases so; benchmarks compare).
    pub fn with_bucket_lua_only(mut self) -> Self {
        self.one_script = None;
        self
    }

    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        let slots = [
            self.sentinels.as_ref().map(|s| s.metrics()),
            self.redial.as_ref().map(|r| r.metrics()),
        ];
        for slot in slots.into_iter().flatten() {
            for event in primary_events::PrimaryEvent::ALL {
                metrics.primary_event_series(event.as_str());
            }
            slot.fill(metrics.clone());
        }
        self.metrics = Some(metrics);
        self
    }

    /// Runs `work` as [`RedisStore::run_once`] does; a `TRYAGAIN` answer
    /// (a migration has some of the keys on each side: nothing ran) is
    /// sent again after a wait that doubles, while the call's time budget
    /// (`options.timeout`) has room for the wait and one more try.
    async fn run(
        &self,
        work: Work<'_>,
        slot: u16,
        options: &Options,
    ) -> Result<Vec<i64>, RedisError> {
        let started = tokio::time::Instant::now();
        let retrying = async {
            let mut pause = TRYAGAIN_FIRST_WAIT;
            let mut sends = 1;
            loop {
                match self.run_once(work, slot, options).await {
                    Err(e) if e.details().starts_with("TRYAGAIN") => {
                        let left = options.timeout.map(|t| t.saturating_sub(started.elapsed()));
                        // a pause, and at least as long again for the call
                        let room = left.is_none_or(|l| l > pause * 2);
                        if !room || sends >= TRYAGAIN_MAX_SENDS {
                            return Err(e);
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(TRYAGAIN_MAX_WAIT);
                        sends += 1;
                        if let Some(m) = &self.metrics {
                            m.store_retry("tryagain");
                        }
                    }
                    other => return other,
                }
            }
        };
        // the whole call, sends and redirections included, within its
        // budget: here, as fred 10 cuts a command at the client's default
        // timeout whatever the call's options say
        within(options.timeout, retrying).await
    }

    /// Runs `work` on the connections of the primary owning `slot`,
    /// following the redirections a primary answers while slots move or
    /// after a failover (`MOVED`: to the new owner; `ASK`: to the importing
    /// node, after `ASKING`), on each primary's own connections: never
    /// through fred's cluster client, whose topology sync sends again the
    /// commands in flight on a connection it drops (a decision that may have
    /// run would be spent twice). [`RedisStore::run`] bounds it in time.
    async fn run_once(
        &self,
        work: Work<'_>,
        slot: u16,
        options: &Options,
    ) -> Result<Vec<i64>, RedisError> {
        let node = self
            .routing
            .read()
            .node_of_slot(slot)
            .map(|n| n.clients.clone());
        let mut node = node.ok_or_else(|| {
            RedisError::new(
                ErrorKind::Routing,
                format!("no known Redis primary owns slot {slot}"),
            )
        })?;
        let mut asking = false;
        for _ in 0..=MAX_REDIRECTIONS {
            let result = match work {
                Work::Count(count) => count.run(&node, options, asking).await,
                Work::Script {
                    script,
                    keys,
                    args,
                    wait,
                } if asking => {
                    // boxed, as fred's calls in run_on: rare, and large
                    Box::pin(self.run_asking(script, &node, keys, args, options, wait)).await
                }
                Work::Script {
                    script,
                    keys,
                    args,
                    wait,
                } => self.run_on(script, &node, keys, args, options, wait).await,
            };
            let redirect = match &result {
                Err(e) => {
                    // a demoted primary: the sentinels are asked again, or
                    // the one server's address dialled again, now
                    if e.details().contains("READONLY") {
                        if let Some(sentinels) = &self.sentinels {
                            sentinels.wake();
                        }
                        if let Some(redial) = &self.redial {
                            redial.wake();
                        }
                    }
                    redirect_of(e)
                }
                Ok(_) => None,
            };
            match redirect {
                None => return result,
                Some(Redirect::Moved(addr)) => {
                    node = Box::pin(self.node_clients(&addr)).await?;
                    asking = false;
                }
                Some(Redirect::Ask(addr)) => {
                    node = Box::pin(self.node_clients(&addr)).await?;
                    asking = true;
                }
            }
        }
        Err(RedisError::new(
            ErrorKind::Cluster,
            format!("more than {MAX_REDIRECTIONS} redirections for slot {slot}"),
        ))
    }

    /// Runs `script` after `ASKING` on one connection of `node` (the node
    /// importing the slot serves that one command for it): on its own
    /// connections, or through fred with the decision's `options`. Either
    /// way a call that may have run is never sent again: a connection lost
    /// with it in flight answers an error (before, fred's default options
    /// sent it again, and one request was charged twice).
    async fn run_asking(
        &self,
        script: &LuaScript,
        node: &NodeClients,
        keys: &[Key],
        args: &[Value],
        options: &Options,
        wait: Option<Replication>,
    ) -> Result<Vec<i64>, RedisError> {
        if let Some(pipes) = &node.pipes {
            return pipes
                .eval_asking(&script.sha, script.body, keys, args, wait)
                .await;
        }
        let client = node.pool.next();
        let send = |full: bool| async move {
            let pipeline = client.pipeline();
            // fail_fast, the attempts: as every decision's call
            let queue = pipeline.with_options(options);
            let _: () = queue
                .custom(fred::cmd!("ASKING"), Vec::<Value>::new())
                .await?;
            // EVALSHA|EVAL <sha|body> <numkeys> <keys…> <args…>
            let mut call: Vec<Value> = Vec::with_capacity(2 + keys.len() + args.len());
            call.push(Value::from(if full {
                script.body
            } else {
                script.sha.as_str()
            }));
            call.push(Value::Integer(keys.len() as i64));
            call.extend(
                keys.iter()
                    .map(|k| Value::Bytes(k.as_bytes().to_vec().into())),
            );
            call.extend(args.iter().cloned());
            let command = if full {
                fred::cmd!("EVAL")
            } else {
                fred::cmd!("EVALSHA")
            };
            let _: () = queue.custom(command, call).await?;
            if let Some(w) = wait {
                let _: () = queue
                    .custom(
                        fred::cmd!("WAIT"),
                        vec![
                            Value::Integer(i64::from(w.replicas)),
                            Value::Integer(w.timeout_ms() as i64),
                        ],
                    )
                    .await?;
            }
            let mut replies = pipeline.try_all::<Value>().await;
            let no_reply = || RedisError::new(ErrorKind::Protocol, "no reply");
            let acked = match wait {
                Some(_) => Some(replies.pop().unwrap_or_else(|| Err(no_reply()))?),
                None => None,
            };
            let mut reply = replies
                .pop()
                .unwrap_or_else(|| Err(no_reply()))?
                .convert::<Vec<i64>>()?;
            if let Some(acked) = acked {
                reply.push(acked.convert::<i64>()?);
            }
            Ok::<_, RedisError>(reply)
        };
        match send(false).await {
            Err(e) if e.details().starts_with("NOSCRIPT") => send(true).await,
            other => other,
        }
    }

    /// The decision connections of the primary at `addr` (`host:port`, as
    /// a redirection names it). One the routing does not know yet (a
    /// replica just promoted, a node just added) is connected to now and
    /// joins the routing, whose next reading of the topology keeps or
    /// closes it.
    async fn node_clients(&self, addr: &str) -> Result<NodeClients, RedisError> {
        if let Some(node) = self.routing.read().node(addr) {
            return Ok(node.clients.clone());
        }
        let no_route = || RedisError::new(ErrorKind::Routing, format!("no Redis node {addr}"));
        let recipe = self.recipe.as_ref().ok_or_else(no_route)?;
        let server = nodes::server_named(self.cluster.as_ref().map(|c| c.next()), addr)
            .ok_or_else(no_route)?;
        let clients = {
            let mut routing = self.routing.write();
            match routing.node(addr) {
                Some(node) => node.clients.clone(),
                None => {
                    let clients = NodeClients::connect(recipe, recipe.for_server(&server))
                        .map_err(|e| RedisError::new(ErrorKind::Config, e))?;
                    *routing = Arc::new(routing.with_node(Arc::from(addr), clients.clone()));
                    clients
                }
            }
        };
        clients.wait(nodes::CLIENT_STALL_BOUND).await;
        Ok(clients)
    }

    /// Runs another of the service's scripts (the RLQS ledger's) on the
    /// single key `key`, routed and retried like a decision, waiting up to
    /// `patience` when it is longer than `--redis-timeout`.
    pub async fn run_script(
        &self,
        script: &LuaScript,
        key: Bytes,
        args: &[Value],
        patience: Option<Duration>,
    ) -> Result<Vec<i64>, StoreError> {
        let key = self.prefixed(key);
        let slot = fred::util::redis_keyslot(&key);
        let patient = self.patient(patience);
        let options = patient.as_ref().unwrap_or(&self.options);
        let keys = [Key::from(key)];
        let work = Work::Script {
            script,
            keys: &keys,
            args,
            wait: None,
        };
        self.run(work, slot, options).await.map_err(store_error)
    }

    /// The primary that owns `key`'s slot now (`key` without the
    /// `--redis-key-prefix`, which has no braces and moves no slot).
    pub fn node_of_key(&self, key: &[u8]) -> Arc<str> {
        self.primary_of(fred::util::redis_keyslot(key))
    }

    /// The name of the primary that owns `slot` now (`unrouted`: none).
    fn primary_of(&self, slot: u16) -> Arc<str> {
        self.routing
            .read()
            .node_of_slot(slot)
            .map(|n| n.name.clone())
            .unwrap_or_else(|| Arc::from("unrouted"))
    }
}

impl RedisStore {
    /// One decision's call of `bucket.lua` (of an attempt when `attempt`
    /// says so: its record's key and its numbers added), its raw reply.
    async fn decide_call(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        attempt: Option<&AttemptCall>,
        patience: Option<Duration>,
    ) -> Result<Vec<i64>, StoreError> {
        let hash = tag_hash(&descriptor.tag);
        let mut keys: Vec<Key> = descriptor
            .buckets
            .iter()
            .map(|b| Key::from(self.prefixed(redis_key(hash, &b.key))))
            .collect();
        if let Some(call) = attempt {
            let record = super::key::attempt_key(&descriptor.tag, &call.id);
            keys.push(Key::from(self.prefixed(redis_key(hash, &record))));
            if call.mode == AttemptMode::Reserve {
                let pending = super::key::reservations_key(&descriptor.tag);
                keys.push(Key::from(self.prefixed(redis_key(hash, &pending))));
            }
        }
        let args = script_args::decision(descriptor, cost, attempt, self.layout);
        let wait = descriptor.replication;
        // a rule with `replication:` waits for its replicas besides the call
        let patience = match wait {
            Some(w) => {
                let usual = self.options.timeout.unwrap_or(Duration::ZERO) + w.timeout;
                Some(patience.map_or(usual, |p| p.max(usual)))
            }
            None => patience,
        };
        let patient = self.patient(patience);
        let options = patient.as_ref().unwrap_or(&self.options);
        let script = match &self.one_script {
            Some(one) if script_args::fits_one_script(descriptor, attempt, self.layout) => one,
            _ => &self.script,
        };
        let work = Work::Script {
            script,
            keys: &keys,
            args: &args,
            wait,
        };
        let mut reply = self
            .run(work, self.slot_of_hash(hash), options)
            .await
            .map_err(store_error)?;
        if let Some(w) = wait {
            let acked = reply
                .pop()
                .ok_or_else(|| StoreError::Script("a reply without WAIT's count".into()))?;
            let admitted = reply.first() == Some(&1);
            if admitted && !w.holds(acked) {
                return Err(StoreError::NotReplicated(format!(
                    "{acked} of {} replicas acknowledged the admission within {}",
                    w.replicas,
                    humantime::format_duration(w.timeout)
                )));
            }
        }
        Ok(reply)
    }

    /// The options of a call that may wait `patience` when it is longer
    /// than `--redis-timeout` (`None`: the usual ones).
    fn patient(&self, patience: Option<Duration>) -> Option<Options> {
        patience
            .filter(|p| Some(*p) > self.options.timeout)
            .map(|p| Options {
                timeout: Some(p),
                ..self.options.clone()
            })
    }
}

/// `call`, cut at `limit` (a timeout error then): fred 10 cuts a command
/// at the client's default timeout whatever the call's options say. Not an
/// `async fn`, which would hold `call` twice (before and inside the timeout).
fn within<T>(
    limit: Option<Duration>,
    call: impl std::future::Future<Output = Result<T, RedisError>>,
) -> impl std::future::Future<Output = Result<T, RedisError>> {
    use futures::future::{Either, FutureExt};
    match limit {
        Some(limit) => Either::Left(tokio::time::timeout(limit, call).map(|timed| {
            timed.unwrap_or_else(|_| Err(RedisError::new(ErrorKind::Timeout, "Request timed out.")))
        })),
        None => Either::Right(call),
    }
}

#[async_trait]
impl Nodes for RedisStore {
    fn node_of(&self, descriptor: &DescriptorBuckets) -> Arc<str> {
        if let Some(slot) = self.counted_slot(descriptor) {
            return self.primary_of(slot);
        }
        self.primary_of(self.slot_of_hash(tag_hash(&descriptor.tag)))
    }

    /// PING `node` on its probe client's own connection, fail fast, within
    /// [`PROBE_TIMEOUT`].
    async fn probe(&self, node: &str) -> Result<(), StoreError> {
        let Some(probe) = self
            .routing
            .read()
            .node(node)
            .map(|n| n.clients.probe.clone())
        else {
            return Err(StoreError::Connection(format!(
                "{node} is not a primary now"
            )));
        };
        let opts = Options {
            timeout: Some(PROBE_TIMEOUT),
            fail_fast: true,
            max_attempts: Some(1),
            ..Options::default()
        };
        let result: Result<String, _> = probe.with_options(&opts).ping(None).await;
        result.map(|_| ()).map_err(store_error)
    }

    fn is_current(&self, node: &str) -> bool {
        self.routing.read().node(node).is_some()
    }

    fn describe(&self, node: &str) -> String {
        self.routing.read().slots_of(node)
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn decide(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        self.decide_patiently(descriptor, cost, None).await
    }

    /// Waits up to `patience` when it is longer than `--redis-timeout` (the
    /// breaker passes it only for a node it trusts).
    async fn decide_patiently(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        patience: Option<Duration>,
    ) -> Result<Vec<BucketOutcome>, StoreError> {
        if let Some(key) = &descriptor.ratelimit_key {
            return self.decide_counted(descriptor, key, cost, patience).await;
        }
        let reply = self.decide_call(descriptor, cost, None, patience).await?;
        outcomes(
            &reply,
            descriptor.buckets.len(),
            script_args::answers_window_counts(descriptor),
        )
    }

    /// The record is a key in the descriptor's slot, read and written by
    /// the same script call as its buckets (a batch's included).
    async fn decide_attempt(
        &self,
        descriptor: &DescriptorBuckets,
        cost: Cost,
        call: &AttemptCall,
        patience: Option<Duration>,
    ) -> Result<AttemptOutcome, StoreError> {
        // a reservation's done call carries what was used, as a charge the
        // script turns into the settlement
        let cost = match (call.mode, call.phase) {
            (AttemptMode::Reserve, Phase::Done) => Cost::Charge(attempt::used_of(cost)),
            _ => cost,
        };
        let reply = self
            .decide_call(descriptor, cost, Some(call), patience)
            .await?;
        let [reply @ .., code, expired] = &reply[..] else {
            return Err(StoreError::Script("a short script reply".into()));
        };
        let result = match code {
            0 => AttemptResult::First,
            1 => AttemptResult::Repeat,
            2 => AttemptResult::Settled,
            3 => AttemptResult::Late,
            4 => AttemptResult::Unknown,
            5 => AttemptResult::Reused,
            other => {
                return Err(StoreError::Script(format!(
                    "an attempt's result {other} in the script reply"
                )))
            }
        };
        Ok(AttemptOutcome {
            outcomes: outcomes(
                reply,
                descriptor.buckets.len(),
                script_args::answers_window_counts(descriptor),
            )?,
            result,
            expired: (*expired).max(0) as u64,
        })
    }

    /// The slots are a sorted set in the descriptor's slot (`slots.lua`).
    async fn decide_slot(
        &self,
        descriptor: &DescriptorBuckets,
        max: u64,
        call: &AttemptCall,
        _rule: RuleId,
        patience: Option<Duration>,
    ) -> Result<SlotOutcome, StoreError> {
        let hash = tag_hash(&descriptor.tag);
        let key = self.prefixed(redis_key(hash, &super::key::slots_key(&descriptor.tag)));
        let args = [
            // a withdrawal of a slot is its release
            Value::Integer(i64::from(call.phase != Phase::Start)),
            Value::Bytes(Bytes::from(call.id.clone())),
            Value::Integer(i64::try_from(max).unwrap_or(i64::MAX)),
            Value::Integer(
                i64::try_from(call.ttl_micros / 1000)
                    .unwrap_or(i64::MAX)
                    .max(1),
            ),
            Value::Integer(i64::from(call.max_repeats)),
        ];
        let keys = [Key::from(key)];
        let work = Work::Script {
            script: &SLOTS,
            keys: &keys,
            args: &args,
            wait: None,
        };
        let patient = self.patient(patience);
        let reply = self
            .run(
                work,
                self.slot_of_hash(hash),
                patient.as_ref().unwrap_or(&self.options),
            )
            .await
            .map_err(store_error)?;
        let [admitted, in_flight, result, expired] = reply[..] else {
            return Err(StoreError::Script(format!(
                "unexpected slots reply of {} values",
                reply.len()
            )));
        };
        Ok(SlotOutcome {
            admitted: admitted == 1,
            in_flight: in_flight.max(0) as u64,
            result: match result {
                1 => AttemptResult::Repeat,
                4 => AttemptResult::NotHeld,
                5 => AttemptResult::Released,
                6 => AttemptResult::Reused,
                _ => AttemptResult::First,
            },
            expired: expired.max(0) as u64,
        })
    }

    async fn forget(&self, descriptor: &DescriptorBuckets) -> Result<u64, StoreError> {
        self.forget_keys(descriptor).await
    }

    async fn held(&self, descriptor: &DescriptorBuckets) -> Result<super::Held, StoreError> {
        self.held_of(descriptor).await
    }

    fn key_names(&self, descriptor: &DescriptorBuckets) -> Vec<String> {
        self.key_names_of(descriptor)
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn reachable(&self) -> bool {
        let routing = self.routing.read();
        !routing.nodes.is_empty() && routing.nodes.iter().all(|n| n.clients.connected())
    }

    fn warnings(&self) -> Vec<String> {
        let status = self.status.read();
        status
            .eviction_warnings
            .iter()
            .chain(&status.memory_warnings)
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests;
