//! Connections of their own for each Redis primary, and which primary owns
//! which slot.
//!
//! fred's cluster client keeps one set of connections for the whole cluster
//! and, when one of them breaks, reconnects them all together inside its
//! routing task: while a killed primary is still listed in the topology,
//! that fails over and over, and commands to the healthy primaries wait
//! behind it. So decisions go instead over a [`NodeClients`] per primary
//! (its batched script connections, [`super::pipe`]; a plain, non-cluster
//! fred pool to that one server for the rest; and a client for the
//! breaker's probes): a dead or hung node breaks only its own connections.
//! The cluster client stays, off the hot path, to learn the topology (its
//! cached slot table, read every [`ROUTING_REFRESH`]). It carries no
//! decisions: the redirections (`MOVED`, `ASK`) a primary answers while
//! slots move or after a failover are followed on the primaries' own
//! connections (see `RedisStore::run_once`), because its topology sync
//! sends again whatever was in flight on a connection it drops, and a
//! decision that may have run must never be sent twice.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use fred::prelude::*;
use fred::types::config::{ReconnectPolicy, Server, ServerConfig};
use parking_lot::RwLock;

/// Bound on the Redis clients' own connects and internal commands.
pub const CLIENT_STALL_BOUND: Duration = Duration::from_millis(250);

/// The longest a decision waits for a node its breaker trusts, whatever
/// the caller's deadline.
pub const MAX_PATIENCE: Duration = Duration::from_secs(5);

/// How often the routing is read again from the cluster client's cache.
pub const ROUTING_REFRESH: Duration = Duration::from_millis(250);

/// How often the cluster client is asked to read the topology from the
/// cluster (`CLUSTER SLOTS`). It learns a change by itself when one of its
/// connections breaks or a redirection reaches it; but off the hot path it
/// sees no traffic, and a hung (not dead) primary breaks no connection, so
/// it would never notice that primary's replica taking over.
pub const TOPOLOGY_SYNC: Duration = Duration::from_secs(1);

/// The reconnect policy of every client: at once, then backing off to 250 ms.
fn reconnect_policy() -> ReconnectPolicy {
    ReconnectPolicy::new_exponential(0, 50, 250, 2)
}

/// How clients of one server are built.
#[derive(Clone)]
pub struct ClientRecipe {
    /// The user's configuration (URL, credentials, TLS).
    pub config: Config,
    pub pool_size: usize,
    /// Serving threads, each with a decision connection of its own to
    /// every primary ([`super::pipe::Pipes`]' lanes).
    pub serving_threads: usize,
    /// Decisions one script call carries at most ([`super::batch`]).
    pub batch: usize,
    pub command_timeout: Duration,
}

impl ClientRecipe {
    /// A pool for decisions: bounded connects, a bounded command buffer.
    pub fn pool(&self, config: Config) -> Result<Pool, String> {
        Builder::from_config(config)
            .with_connection_config(|c| {
                // fred reads the topology and connects inside its routing
                // task: while it waits on a hung node, every command of the
                // client waits too. Short bounds keep that stall short.
                c.connection_timeout = CLIENT_STALL_BOUND;
                c.internal_command_timeout = CLIENT_STALL_BOUND;
                c.max_redirections = 5;
                // Bounded: past this, commands fail at once instead of piling up.
                c.max_command_buffer_len = 10_000;
            })
            .with_performance_config(|p| {
                // the longest a decision may wait: each is cut at its own
                // timeout (`--redis-timeout`, or the caller's deadline for a
                // node its breaker trusts) by the store, as fred 10 cuts a
                // command at this default whatever the call's options say
                p.default_command_timeout = self.command_timeout.max(MAX_PATIENCE);
            })
            .set_policy(reconnect_policy())
            .build_pool(self.pool_size.max(1))
            .map_err(|e| format!("cannot configure Redis client: {e}"))
    }

    /// A single client for probes.
    pub fn probe(&self, config: Config) -> Result<Client, String> {
        Builder::from_config(config)
            .with_connection_config(|c| {
                c.connection_timeout = CLIENT_STALL_BOUND;
                c.internal_command_timeout = CLIENT_STALL_BOUND;
            })
            .set_policy(reconnect_policy())
            .build()
            .map_err(|e| format!("cannot configure Redis client: {e}"))
    }

    /// The configuration for one server of a cluster.
    pub fn for_server(&self, server: &Server) -> Config {
        let mut config = self.config.clone();
        config.server = ServerConfig::Centralized {
            server: server.clone(),
        };
        config
    }
}

/// One primary's own connections: decisions on `pool`, probes on `probe`
/// (so that a probe never waits behind queued decisions).
#[derive(Clone)]
pub struct NodeClients {
    pub pool: Pool,
    pub probe: Client,
    /// The decisions' pipelined connections ([`super::pipe`]); `None` where
    /// the server's configuration is not one they can reach (then the
    /// decisions go over `pool`).
    pub pipes: Option<Arc<super::pipe::Pipes>>,
}

impl NodeClients {
    /// Builds and starts connecting (without waiting).
    pub fn connect(recipe: &ClientRecipe, config: Config) -> Result<Self, String> {
        let pipes = super::pipe::Target::of(&config, CLIENT_STALL_BOUND).map(|target| {
            Arc::new(super::pipe::Pipes::connect(
                &target,
                recipe.pool_size,
                recipe.serving_threads,
                recipe.batch,
            ))
        });
        let pool = recipe.pool(config.clone())?;
        let probe = recipe.probe(config)?;
        pool.connect();
        probe.connect();
        Ok(Self { pool, probe, pipes })
    }

    /// Waits (`within` at most) until all are connected.
    pub async fn wait(&self, within: Duration) {
        let _ = tokio::time::timeout(within, async {
            let _ = self.pool.wait_for_connect().await;
            let _ = self.probe.wait_for_connect().await;
            if let Some(pipes) = &self.pipes {
                pipes.wait(within).await;
            }
        })
        .await;
    }

    pub fn connected(&self) -> bool {
        self.probe.is_connected()
            && self.pool.clients().iter().all(|c| c.is_connected())
            && self.pipes.as_ref().is_none_or(|p| p.connected())
    }

    /// Closes both, in the background.
    pub(super) fn close(self) {
        tokio::spawn(async move {
            let _ = self.pool.quit().await;
            let _ = self.probe.quit().await;
        });
    }
}

/// One primary: its name (`host:port`), address and connections.
#[derive(Clone)]
pub struct Node {
    pub name: Arc<str>,
    pub clients: NodeClients,
}

/// Which primary owns which slots, as the cluster client last learned it,
/// with each primary's connections. A single server is one node that owns
/// every slot.
#[derive(Default)]
pub struct Routing {
    /// (first slot, last slot, index into `nodes`), sorted.
    ranges: Vec<(u16, u16, usize)>,
    pub nodes: Vec<Node>,
}

impl Routing {
    /// Puts `next` in place of the routing `shared` holds; the connections
    /// of the nodes it replaces close in the background (a call in flight
    /// on them is answered as it stands, never sent again).
    pub fn replace(shared: &RwLock<Arc<Routing>>, next: Routing) {
        let old = std::mem::replace(&mut *shared.write(), Arc::new(next));
        for node in &old.nodes {
            node.clients.clone().close();
        }
    }

    /// One server for every key.
    pub fn single(name: Arc<str>, clients: NodeClients) -> Self {
        Self {
            ranges: Vec::new(),
            nodes: vec![Node { name, clients }],
        }
    }

    /// The node owning `slot`; `None` for a slot no known primary owns.
    pub fn node_of_slot(&self, slot: u16) -> Option<&Node> {
        if self.ranges.is_empty() {
            return match self.nodes.as_slice() {
                [only] => Some(only),
                _ => None,
            };
        }
        let i = self.ranges.partition_point(|&(_, end, _)| end < slot);
        match self.ranges.get(i) {
            Some(&(start, _, n)) if start <= slot => self.nodes.get(n),
            _ => None,
        }
    }

    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| &*n.name == name)
    }

    /// This routing and one more node that owns no slot yet (one a
    /// redirection named): the next reading of the topology keeps its
    /// connections if it owns slots then, and closes them if not.
    pub fn with_node(&self, name: Arc<str>, clients: NodeClients) -> Self {
        let mut nodes = self.nodes.clone();
        nodes.push(Node { name, clients });
        Self {
            ranges: self.ranges.clone(),
            nodes,
        }
    }

    /// The slots `name` owns, as `a-b,c` ranges (for logs).
    pub fn slots_of(&self, name: &str) -> String {
        let Some(i) = self.nodes.iter().position(|n| &*n.name == name) else {
            return "no slots".into();
        };
        if self.ranges.is_empty() {
            return "every key".into();
        }
        let slots: Vec<String> = self
            .ranges
            .iter()
            .filter(|r| r.2 == i)
            .map(|&(a, b, _)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}-{b}")
                }
            })
            .collect();
        format!("slots {}", slots.join(","))
    }

    /// Whether `state` names the same primaries for the same slots.
    fn matches(&self, state: &[(u16, u16, String)]) -> bool {
        self.ranges.len() == state.len()
            && self
                .ranges
                .iter()
                .zip(state)
                .all(|(&(a, b, n), (sa, sb, name))| {
                    a == *sa && b == *sb && *self.nodes[n].name == **name
                })
    }
}

/// The server at `addr` (`host:port`): as the cluster client knows it
/// (with its TLS name) where it does, else from the address.
pub fn server_named(cluster: Option<&Client>, addr: &str) -> Option<Server> {
    if let Some((_, servers)) = cluster.and_then(slot_table) {
        if let Some(server) = servers.get(addr) {
            return Some(server.clone());
        }
    }
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some(Server::new(host, port.parse::<u16>().ok()?))
}

/// (first slot, last slot, primary's name), sorted.
type SlotTable = Vec<(u16, u16, String)>;

/// The slot table in the cluster client's cache, with the primaries'
/// addresses; `None` before it has learned one.
fn slot_table(cluster: &Client) -> Option<(SlotTable, HashMap<String, Server>)> {
    let state = cluster.cached_cluster_state()?;
    let mut servers = HashMap::new();
    let mut table: SlotTable = state
        .slots()
        .iter()
        .map(|range| {
            let name = range.primary.to_string();
            servers.insert(name.clone(), range.primary.clone());
            (range.start, range.end, name)
        })
        .collect();
    table.sort();
    Some((table, servers))
}

/// A new routing from the cluster client's slot table, reusing the
/// connections of primaries already known and connecting to new ones
/// (waiting [`CLIENT_STALL_BOUND`] at most, all at once). Returns `None`
/// while nothing changed (or nothing is known yet).
pub async fn reread(
    cluster: &Client,
    current: &Routing,
    recipe: &ClientRecipe,
) -> Option<(Routing, Vec<NodeClients>)> {
    let (table, servers) = slot_table(cluster)?;
    if current.matches(&table) {
        return None;
    }
    let mut known: HashMap<&str, &NodeClients> = current
        .nodes
        .iter()
        .map(|n| (&*n.name, &n.clients))
        .collect();
    let mut nodes: Vec<Node> = Vec::new();
    let mut fresh = Vec::new();
    let mut ranges = Vec::with_capacity(table.len());
    for (start, end, name) in &table {
        let i = match nodes.iter().position(|n| &*n.name == name.as_str()) {
            Some(i) => i,
            None => {
                let clients = match known.remove(name.as_str()) {
                    Some(c) => c.clone(),
                    None => {
                        let server = servers.get(name)?;
                        match NodeClients::connect(recipe, recipe.for_server(server)) {
                            Ok(c) => {
                                fresh.push(c.clone());
                                c
                            }
                            Err(e) => {
                                tracing::warn!(node = %name, error = %e, "cannot connect to Redis primary");
                                return None;
                            }
                        }
                    }
                };
                nodes.push(Node {
                    name: Arc::from(name.as_str()),
                    clients,
                });
                nodes.len() - 1
            }
        };
        ranges.push((*start, *end, i));
    }
    futures::future::join_all(fresh.iter().map(|c| c.wait(CLIENT_STALL_BOUND))).await;
    let gone = known.into_values().cloned().collect();
    Some((Routing { ranges, nodes }, gone))
}

/// Reads the cluster client's topology every [`ROUTING_REFRESH`] until the
/// store is gone, connecting to new primaries and closing the connections
/// of former ones; has the client read it from the cluster every
/// [`TOPOLOGY_SYNC`].
pub fn spawn_refresh(cluster: Pool, recipe: ClientRecipe, routing: Weak<RwLock<Arc<Routing>>>) {
    let syncing = cluster.clone();
    let alive = routing.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(TOPOLOGY_SYNC);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while alive.strong_count() > 0 {
            tick.tick().await;
            // bounded: a sync that meets a hung node waits on it
            let _ = tokio::time::timeout(TOPOLOGY_SYNC, syncing.next().sync_cluster()).await;
        }
    });
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(ROUTING_REFRESH);
        loop {
            tick.tick().await;
            let Some(shared) = routing.upgrade() else {
                return;
            };
            let current = shared.read().clone();
            drop(shared);
            if let Some((next, gone)) = reread(cluster.next(), &current, &recipe).await {
                let Some(shared) = routing.upgrade() else {
                    return;
                };
                *shared.write() = Arc::new(next);
                for clients in gone {
                    clients.close();
                }
            }
        }
    });
}

/// What the one server of `config` says it is (`ROLE`: "master", "slave",
/// …), asked on a connection of its own within [`CLIENT_STALL_BOUND`];
/// `Ok(None)` when it answers that it does not know `ROLE` (a proxy such
/// as twemproxy); `Err` when it does not answer.
pub async fn role(config: &Config) -> Result<Option<String>, String> {
    use super::pipe::{open_connection, request, Target};
    use redis_protocol::resp2::types::BytesFrame;
    let target =
        Target::of(config, CLIENT_STALL_BOUND).ok_or("a TLS set-up the connections cannot use")?;
    let asked = tokio::time::timeout(CLIENT_STALL_BOUND, async {
        let mut io = open_connection(&target).await.map_err(|e| e.to_string())?;
        request(&mut io, &[b"ROLE"])
            .await
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|_| Err(format!("no answer within {CLIENT_STALL_BOUND:?}")))?;
    match asked {
        BytesFrame::Array(parts) => match parts.first() {
            Some(BytesFrame::BulkString(role)) => {
                Ok(Some(String::from_utf8_lossy(role).to_string()))
            }
            _ => Err("an empty ROLE reply".into()),
        },
        BytesFrame::Error(_) => Ok(None),
        other => Err(format!("an unexpected ROLE reply: {other:?}")),
    }
}
