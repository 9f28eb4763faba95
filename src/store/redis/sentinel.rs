//! Redis Sentinel: which server is the primary of a named master, asked of
//! the sentinels, checked with `ROLE`, and followed through failovers.
//!
//! A `redis-sentinel://` URL names the sentinels and the master. At start
//! and then every [`SENTINEL_REFRESH`] (or at once when a decision meets a
//! `READONLY` answer: [`Sentinels::wake`]), every sentinel is asked
//! `SENTINEL GET-MASTER-ADDR-BY-NAME` and `SENTINEL MASTER` (for the
//! master's configuration epoch, which each failover raises), in one round
//! trip, all sentinels at once, until all answered or more than half of
//! them name one address ([`settled`]: a hung sentinel is not waited for).
//! The address most of those that answer name is taken, a tie going to the
//! one named with the newest configuration epoch, then to the lowest
//! address: never to the sentinels' order in the URL, so that instances
//! given the sentinels in different orders follow one primary (issue 52:
//! two instances, a stale sentinel first in one URL and last in the other,
//! followed two servers and admitted twice the budget). It is taken only
//! if that server says it is a primary (`ROLE`: asked of a new one, and of
//! the one decisions go to while the sentinels disagree), so a sentinel
//! that has not yet seen a failover, or that disagrees with the others,
//! cannot send decisions to a replica. A disagreement is logged and
//! counted when it begins (`rls_store_primary_events_total{event=
//! "sentinels_disagree"}`). When the primary changes, the routing's one node
//! is replaced by connections to the new primary and the old ones close:
//! decisions in flight on them are answered as they stand (an error if
//! the connection goes first), never sent again.
//!
//! What the sentinels said is read by [`agree`], pure; the asking (one
//! connection kept per sentinel, within [`CLIENT_STALL_BOUND`]) and the
//! watch are the I/O around it.
//!
//! **Layer:** store (the Redis store's rooms). Uses the pipes' connect
//! (TCP, TLS, `AUTH`) and the RESP wire; builds [`nodes::Routing`].

use std::sync::{Arc, Weak};
use std::time::Duration;

use fred::types::config::{Config, Server, ServerConfig};
use parking_lot::RwLock;
use redis_protocol::resp2::types::BytesFrame;
use tokio::sync::{Mutex, Notify};

use super::nodes::{role, ClientRecipe, NodeClients, Routing, CLIENT_STALL_BOUND};
use super::pipe::{open_connection, requests, Io, Target};
use super::primary_events::{MetricsSlot, PrimaryEvent};

/// How long a sentinel that did not answer the last time is waited for.
pub const SUSPECT_BOUND: Duration = Duration::from_millis(25);

/// How often the sentinels are asked again.
pub const SENTINEL_REFRESH: Duration = Duration::from_millis(100);

/// What one sentinel said about the master.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Said {
    /// The primary's address, and the master's configuration epoch as this
    /// sentinel knows it (`None`: it did not say).
    Primary(String, u16, Option<u64>),
    /// No master of that name (a nil reply).
    Unknown,
    /// No answer: why.
    Failed(String),
}

/// An address the sentinels named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub host: String,
    pub port: u16,
    /// How many sentinels named it.
    pub votes: usize,
    /// The newest configuration epoch it was named with.
    pub epoch: Option<u64>,
}

impl Candidate {
    pub fn is(&self, host: &str, port: u16) -> bool {
        self.host == host && self.port == port
    }
}

impl std::fmt::Display for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{} (named by {}", self.host, self.port, self.votes)?;
        match self.epoch {
            Some(epoch) => write!(f, ", epoch {epoch})"),
            None => write!(f, ")"),
        }
    }
}

/// What the sentinels said together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreement {
    /// The addresses named, best first: the most named, then the newest
    /// epoch, then the lowest address (never the sentinels' order).
    pub candidates: Vec<Candidate>,
    /// The sentinels that know no master of that name.
    pub unknown: Vec<String>,
    /// The sentinels that did not answer, and why.
    pub failed: Vec<(String, String)>,
}

impl Agreement {
    /// Sentinels answered, and none named a primary: the name is wrong.
    pub fn unknown_master(&self) -> bool {
        self.candidates.is_empty() && !self.unknown.is_empty()
    }

    /// Several addresses named.
    pub fn disagree(&self) -> bool {
        self.candidates.len() > 1
    }
}

/// Reads the sentinels' answers.
pub fn agree(said: &[(String, Said)]) -> Agreement {
    let mut candidates: Vec<Candidate> = Vec::new();
    let (mut unknown, mut failed) = (Vec::new(), Vec::new());
    for (sentinel, answer) in said {
        match answer {
            Said::Primary(host, port, epoch) => {
                match candidates.iter_mut().find(|c| c.is(host, *port)) {
                    Some(c) => {
                        c.votes += 1;
                        c.epoch = c.epoch.max(*epoch);
                    }
                    None => candidates.push(Candidate {
                        host: host.clone(),
                        port: *port,
                        votes: 1,
                        epoch: *epoch,
                    }),
                }
            }
            Said::Unknown => unknown.push(sentinel.clone()),
            Said::Failed(why) => failed.push((sentinel.clone(), why.clone())),
        }
    }
    // the same order whatever order the sentinels were asked in
    candidates.sort_by(|a, b| {
        b.votes
            .cmp(&a.votes)
            .then(b.epoch.cmp(&a.epoch))
            .then_with(|| (&a.host, a.port).cmp(&(&b.host, b.port)))
    });
    Agreement {
        candidates,
        unknown,
        failed,
    }
}

/// Whether the answers so far settle the question for `total` sentinels:
/// one address named by more than half of them, which the rest cannot
/// outvote (so a hung sentinel is not waited for).
pub fn settled(said: &[(String, Said)], total: usize) -> bool {
    let address = |answer: &Said| match answer {
        Said::Primary(host, port, _) => Some((host.clone(), *port)),
        _ => None,
    };
    said.iter().any(|(_, answer)| {
        address(answer).is_some_and(|named| {
            said.iter()
                .filter(|(_, other)| address(other).as_ref() == Some(&named))
                .count()
                * 2
                > total
        })
    })
}

/// One sentinel: where it is, and the connection kept to it.
struct Sentinel {
    name: String,
    target: Target,
    connection: Mutex<Option<Box<dyn Io>>>,
    /// It did not answer the last time it was asked (or was not waited
    /// for): asked within [`SUSPECT_BOUND`], so that a hung sentinel does
    /// not hold up a round whose other answers disagree.
    suspect: std::sync::atomic::AtomicBool,
}

impl Sentinel {
    /// `SENTINEL GET-MASTER-ADDR-BY-NAME master` and `SENTINEL MASTER
    /// master` (its configuration epoch), in one write, within the stall
    /// bound.
    /// The kept connection is taken out while the question is out and put
    /// back only with its answer read: an ask given up half way (the others
    /// settled it, [`settled`]) or failed drops it, and no later ask reads
    /// an old reply.
    async fn ask(&self, master: &str) -> Said {
        use std::sync::atomic::Ordering::Relaxed;
        let mut kept = self.connection.lock().await;
        let connection = kept.take();
        // suspect until it answers: also when this ask is given up half
        // way, the others having settled it
        let bound = if self.suspect.swap(true, Relaxed) {
            SUSPECT_BOUND
        } else {
            CLIENT_STALL_BOUND
        };
        let asked = tokio::time::timeout(bound, async {
            let mut io = match connection {
                Some(io) => io,
                None => open_connection(&self.target)
                    .await
                    .map_err(|e| e.to_string())?,
            };
            let address: [&[u8]; 3] = [b"SENTINEL", b"GET-MASTER-ADDR-BY-NAME", master.as_bytes()];
            let config: [&[u8]; 3] = [b"SENTINEL", b"MASTER", master.as_bytes()];
            let frames = requests(&mut io, &[&address, &config])
                .await
                .map_err(|e| e.to_string())?;
            Ok((io, frames))
        })
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {bound:?}")));
        let said = match asked {
            Ok((io, frames)) => {
                let said = match frames.as_slice() {
                    [address, config] => match said_of(address) {
                        Said::Primary(host, port, _) => Said::Primary(host, port, epoch_of(config)),
                        other => other,
                    },
                    _ => Said::Failed("fewer replies than questions".into()),
                };
                if !matches!(said, Said::Failed(_)) {
                    *kept = Some(io);
                }
                said
            }
            Err(why) => Said::Failed(why),
        };
        self.suspect.store(matches!(said, Said::Failed(_)), Relaxed);
        said
    }
}

/// A sentinel's reply read.
fn said_of(frame: &BytesFrame) -> Said {
    match frame {
        BytesFrame::Null => Said::Unknown,
        BytesFrame::Array(parts) => match parts.as_slice() {
            [BytesFrame::BulkString(host), BytesFrame::BulkString(port)] => {
                let host = String::from_utf8_lossy(host).to_string();
                match std::str::from_utf8(port).ok().and_then(|p| p.parse().ok()) {
                    Some(port) => Said::Primary(host, port, None),
                    None => Said::Failed(format!("a port that is not a number: {port:?}")),
                }
            }
            [] => Said::Unknown,
            _ => Said::Failed("an address that is not [host, port]".into()),
        },
        BytesFrame::Error(e) => Said::Failed(e.to_string()),
        other => Said::Failed(format!("an unexpected reply: {other:?}")),
    }
}

/// The master's configuration epoch in a `SENTINEL MASTER` reply (a flat
/// list of fields and values); `None` where the reply does not say (an
/// error: a sentinel ACL allowing only `GET-MASTER-ADDR-BY-NAME`).
fn epoch_of(frame: &BytesFrame) -> Option<u64> {
    let BytesFrame::Array(parts) = frame else {
        return None;
    };
    parts.chunks(2).find_map(|pair| match pair {
        [BytesFrame::BulkString(k), BytesFrame::BulkString(v)] if &k[..] == b"config-epoch" => {
            std::str::from_utf8(v).ok()?.parse().ok()
        }
        _ => None,
    })
}

/// The sentinels of one master.
pub struct Sentinels {
    master: String,
    sentinels: Vec<Sentinel>,
    /// Asks the watch to look again now.
    wake: Arc<Notify>,
    /// Where what the watch sees is counted, once the server has metrics.
    metrics: MetricsSlot,
}

impl Sentinels {
    /// The sentinels a `redis-sentinel://` configuration names; `None` for
    /// any other configuration.
    pub fn of(config: &Config) -> Option<Self> {
        let ServerConfig::Sentinel {
            hosts,
            service_name,
            username,
            password,
        } = &config.server
        else {
            return None;
        };
        let sentinels = hosts
            .iter()
            .filter_map(|server| {
                let mut own = config.clone();
                own.server = ServerConfig::Centralized {
                    server: server.clone(),
                };
                (own.username, own.password) = (username.clone(), password.clone());
                // a sentinel has no databases to select
                own.database = None;
                Some(Sentinel {
                    name: format!("{}:{}", server.host, server.port),
                    target: Target::of(&own, CLIENT_STALL_BOUND)?,
                    connection: Mutex::new(None),
                    suspect: Default::default(),
                })
            })
            .collect();
        Some(Self {
            master: service_name.clone(),
            sentinels,
            wake: Arc::new(Notify::new()),
            metrics: MetricsSlot::default(),
        })
    }

    pub fn master(&self) -> &str {
        &self.master
    }

    /// Where the watch counts disagreements and moves.
    pub fn metrics(&self) -> &MetricsSlot {
        &self.metrics
    }

    /// Asks the watch to ask the sentinels again now (a decision met
    /// `READONLY`: its server is no longer the primary).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// What every sentinel says, asked together.
    /// Asks every sentinel at once, until all answered or the answers so
    /// far are [`settled`]; then reads them in the URL's order.
    pub async fn ask(&self) -> Agreement {
        use futures::StreamExt;
        let mut asking: futures::stream::FuturesUnordered<_> = self
            .sentinels
            .iter()
            .enumerate()
            .map(|(i, s)| async move { (i, s.name.clone(), s.ask(&self.master).await) })
            .collect();
        // the answers in the URL's order, and where each came from
        let (mut order, mut said) = (Vec::new(), Vec::new());
        while let Some((i, name, answer)) = asking.next().await {
            let at = order.partition_point(|&j| j < i);
            order.insert(at, i);
            said.insert(at, (name, answer));
            if settled(&said, self.sentinels.len()) {
                break;
            }
        }
        agree(&said)
    }

    /// The primary: the first candidate that says it is one (`current`,
    /// the primary decisions already go to, is not asked again while the
    /// sentinels agree: a demoted one answers `READONLY`, which wakes the
    /// watch); else why none is.
    pub async fn primary(
        &self,
        recipe: &ClientRecipe,
        current: Option<&str>,
    ) -> Result<(Server, Agreement), NoPrimary> {
        let agreement = self.ask().await;
        if agreement.unknown_master() {
            return Err(NoPrimary {
                why: format!(
                    "the sentinels {} know no master named '{}'",
                    agreement.unknown.join(", "),
                    self.master
                ),
                unknown_master: true,
            });
        }
        let mut why = Vec::new();
        for candidate in &agreement.candidates {
            let (host, port) = (&candidate.host, &candidate.port);
            let server = Server::new(host.as_str(), *port);
            if !agreement.disagree() && current == Some(format!("{host}:{port}").as_str()) {
                return Ok((server, agreement));
            }
            match role(&recipe.for_server(&server)).await {
                Ok(Some(role)) if role == "master" => return Ok((server, agreement)),
                Ok(Some(role)) => why.push(format!("{host}:{port} is a {role}")),
                Ok(None) => why.push(format!("{host}:{port} does not say its role (ROLE)")),
                Err(e) => why.push(role_refused(host, *port, &e.to_string())),
            }
        }
        for (sentinel, e) in &agreement.failed {
            why.push(format!("sentinel {sentinel}: {e}"));
        }
        if why.is_empty() {
            why.push("no sentinel named one".into());
        }
        Err(NoPrimary {
            why: format!("no primary for '{}': {}", self.master, why.join("; ")),
            unknown_master: false,
        })
    }
}

/// Why asking `host:port` its role failed, in words: an ACL user denied
/// `ROLE` is named as such (issue 52: it never found a primary, and said
/// only the server's error).
fn role_refused(host: &str, port: u16, error: &str) -> String {
    if error.contains("NOPERM") {
        format!(
            "{host}:{port} refused ROLE to this user ({error}): Sentinel mode asks each server ROLE before following it; allow it (ACL SETUSER <user> +role)"
        )
    } else {
        format!("{host}:{port}: {error}")
    }
}

/// Why no primary was found.
#[derive(Debug)]
pub struct NoPrimary {
    pub why: String,
    /// The sentinels that answered know no master of that name.
    pub unknown_master: bool,
}

/// The routing of one primary found through the sentinels.
pub fn routing_of(recipe: &ClientRecipe, server: &Server) -> Result<Routing, String> {
    let clients = NodeClients::connect(recipe, recipe.for_server(server))?;
    Ok(Routing::single(
        Arc::from(format!("{}:{}", server.host, server.port)),
        clients,
    ))
}

/// The sentinels of `config` (a `redis-sentinel://` URL) and the routing
/// to the primary they name now. A master no sentinel knows stops the
/// start (a wrong name, not an outage); sentinels or a primary that do not
/// answer leave the routing empty (the rules' failure modes answer) until
/// the watch finds the primary.
pub async fn connect(
    config: &Config,
    recipe: &ClientRecipe,
    shown: &str,
) -> Result<(Arc<Sentinels>, Routing), String> {
    let sentinels = Sentinels::of(config)
        .filter(|s| !s.sentinels.is_empty())
        .ok_or_else(|| format!("'{shown}': no sentinel the connections can reach"))?;
    let routing = match sentinels.primary(recipe, None).await {
        Ok((server, agreement)) => {
            let routing = routing_of(recipe, &server)?;
            routing.nodes[0].clients.wait(Duration::from_secs(2)).await;
            tracing::info!(
                master = %sentinels.master,
                primary = %routing.nodes[0].name,
                named_by = agreement
                    .candidates
                    .iter()
                    .find(|c| c.is(&server.host, server.port))
                    .map_or(0, |c| c.votes),
                "Redis Sentinel: primary found"
            );
            routing
        }
        Err(e) if e.unknown_master => return Err(format!("'{shown}': {}", e.why)),
        Err(e) => {
            tracing::warn!(url = %shown, "Redis Sentinel: {} at start-up; failure policies answer until a primary is found (asked again every {SENTINEL_REFRESH:?})", e.why);
            Routing::default()
        }
    };
    Ok((Arc::new(sentinels), routing))
}

/// Asks the sentinels every [`SENTINEL_REFRESH`] (or when woken) while the
/// routing lives, and moves it to the primary they name when it changes.
pub fn spawn_watch(
    sentinels: Arc<Sentinels>,
    recipe: ClientRecipe,
    routing: Weak<RwLock<Arc<Routing>>>,
) {
    tokio::spawn(async move {
        // what was last said of a failure, said again only when it changes
        let mut last_problem = String::new();
        // the sentinels disagreed at the last look: a disagreement is
        // counted when it begins
        let mut disagreed = false;
        loop {
            tokio::select! {
                () = tokio::time::sleep(SENTINEL_REFRESH) => {}
                () = sentinels.wake.notified() => {}
            }
            let Some(shared) = routing.upgrade() else {
                return;
            };
            let current = shared.read().nodes.first().map(|n| n.name.clone());
            drop(shared);
            let problem = match sentinels.primary(&recipe, current.as_deref()).await {
                Ok((server, agreement)) => {
                    let name = format!("{}:{}", server.host, server.port);
                    let mut problem = String::new();
                    // (counted once there are metrics to count it in)
                    let mut counted = disagreed;
                    if agreement.disagree() {
                        if !disagreed {
                            counted = sentinels.metrics.count(PrimaryEvent::SentinelsDisagree);
                        }
                        problem = format!(
                            "the sentinels of '{}' disagree: {}; following {name}, which says it is the primary (ROLE)",
                            sentinels.master,
                            agreement
                                .candidates
                                .iter()
                                .map(Candidate::to_string)
                                .collect::<Vec<_>>()
                                .join(", ")
                        );
                    }
                    disagreed = agreement.disagree() && counted;
                    if current.as_deref() != Some(name.as_str()) {
                        match routing_of(&recipe, &server) {
                            Ok(next) => {
                                let Some(shared) = routing.upgrade() else {
                                    return;
                                };
                                next.nodes[0].clients.wait(CLIENT_STALL_BOUND).await;
                                Routing::replace(&shared, next);
                                sentinels.metrics.count(PrimaryEvent::Moved);
                                tracing::warn!(
                                    master = %sentinels.master,
                                    primary = %name,
                                    was = current.as_deref().unwrap_or("none"),
                                    "Redis Sentinel: the primary changed; decisions go to the new one"
                                );
                            }
                            Err(e) => problem = e,
                        }
                    }
                    problem
                }
                Err(e) => e.why,
            };
            if problem != last_problem {
                if !problem.is_empty() {
                    tracing::warn!(master = %sentinels.master, "Redis Sentinel: {problem}");
                }
                last_problem = problem;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(host: &str, port: u16) -> Said {
        Said::Primary(host.into(), port, None)
    }

    fn named_at(host: &str, port: u16, epoch: u64) -> Said {
        Said::Primary(host.into(), port, Some(epoch))
    }

    fn best(said: &[(&str, Said)]) -> (String, u16) {
        let said: Vec<(String, Said)> = said
            .iter()
            .map(|(s, a)| (s.to_string(), a.clone()))
            .collect();
        let a = agree(&said);
        (a.candidates[0].host.clone(), a.candidates[0].port)
    }

    #[test]
    fn a_user_denied_role_is_named_as_such() {
        let why = role_refused(
            "10.0.0.1",
            6379,
            "NOPERM User rls has no permissions to run the 'role' command",
        );
        assert!(why.contains("refused ROLE to this user"), "{why}");
        assert!(why.contains("+role"), "{why}");
        assert_eq!(
            role_refused("10.0.0.1", 6379, "IO error"),
            "10.0.0.1:6379: IO error"
        );
    }

    #[test]
    fn the_address_most_sentinels_name_comes_first() {
        let a = agree(&[
            ("s1".into(), named("10.0.0.1", 6379)),
            ("s2".into(), named("10.0.0.2", 6379)),
            ("s3".into(), named("10.0.0.2", 6379)),
        ]);
        let named: Vec<(&str, u16, usize)> = a
            .candidates
            .iter()
            .map(|c| (c.host.as_str(), c.port, c.votes))
            .collect();
        assert_eq!(named, [("10.0.0.2", 6379, 2), ("10.0.0.1", 6379, 1)]);
        assert!(a.disagree());
        assert!(!a.unknown_master());
    }

    #[test]
    fn more_than_half_of_all_sentinels_settle_it() {
        let a = || named("a", 1);
        let said = |answers: &[Said]| -> Vec<(String, Said)> {
            answers
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("s{i}"), s.clone()))
                .collect()
        };
        assert!(settled(&said(&[a(), a()]), 3));
        assert!(!settled(&said(&[a()]), 3));
        assert!(!settled(&said(&[a(), named("b", 1)]), 3));
        assert!(
            !settled(&said(&[a(), a()]), 4),
            "two of four can be outvoted"
        );
        assert!(settled(&said(&[a()]), 1));
        // no primary named settles nothing: an unknown master is heard out
        assert!(!settled(&said(&[Said::Unknown, Said::Unknown]), 3));
        let failed = || Said::Failed("x".into());
        assert!(!settled(&said(&[failed(), failed()]), 3));
    }

    /// Issue 52: two instances given a stale sentinel and a current one in
    /// opposite orders followed two primaries. A tie goes to the newest
    /// configuration epoch, whatever the order.
    #[test]
    fn a_tie_goes_to_the_newest_epoch_whatever_the_sentinels_order() {
        let stale = ("stale", named_at("10.0.0.9", 6379, 0));
        let current = ("s2", named_at("10.0.0.2", 6379, 3));
        let expected = ("10.0.0.2".to_string(), 6379);
        assert_eq!(best(&[stale.clone(), current.clone()]), expected);
        assert_eq!(best(&[current, stale]), expected);
    }

    /// With no epoch to tell them apart, the lowest address: the same for
    /// every instance, never the first sentinel of each one's URL.
    #[test]
    fn a_tie_without_epochs_goes_to_the_lowest_address() {
        let a = ("s1", named("10.0.0.9", 6379));
        let b = ("s2", named("10.0.0.2", 6380));
        let failed = ("s3", Said::Failed("refused".into()));
        let expected = ("10.0.0.2".to_string(), 6380);
        assert_eq!(best(&[a.clone(), b.clone(), failed.clone()]), expected);
        assert_eq!(best(&[b, failed, a]), expected);
    }

    /// Votes come first: a lone sentinel with a newer epoch does not
    /// outvote two that agree (the ROLE check guards the rest).
    #[test]
    fn more_votes_win_over_a_newer_epoch() {
        let got = best(&[
            ("s1", named_at("a", 1, 7)),
            ("s2", named_at("b", 1, 6)),
            ("s3", named_at("b", 1, 6)),
        ]);
        assert_eq!(got, ("b".to_string(), 1));
    }

    #[test]
    fn an_address_named_with_several_epochs_keeps_the_newest() {
        let a = agree(&[
            ("s1".into(), named_at("a", 1, 2)),
            ("s2".into(), named_at("a", 1, 5)),
            ("s3".into(), named("a", 1)),
        ]);
        assert_eq!(a.candidates.len(), 1);
        assert_eq!((a.candidates[0].votes, a.candidates[0].epoch), (3, Some(5)));
        assert!(!a.disagree());
        assert!(
            settled(
                &[
                    ("s1".into(), named_at("a", 1, 2)),
                    ("s2".into(), named_at("a", 1, 5)),
                ],
                3
            ),
            "one address named by two of three, epochs aside"
        );
    }

    #[test]
    fn the_epoch_is_read_from_sentinel_master() {
        use fred::bytes::Bytes;
        let bulk = |s: &str| BytesFrame::BulkString(Bytes::from(s.to_string()));
        let reply = BytesFrame::Array(
            [
                "name",
                "mymaster",
                "ip",
                "127.0.0.1",
                "config-epoch",
                "4",
                "flags",
                "master",
            ]
            .iter()
            .map(|s| bulk(s))
            .collect(),
        );
        assert_eq!(epoch_of(&reply), Some(4));
        assert_eq!(epoch_of(&BytesFrame::Error("NOPERM".into())), None);
        assert_eq!(
            epoch_of(&BytesFrame::Array(vec![bulk("config-epoch"), bulk("x")])),
            None
        );
    }

    #[test]
    fn an_unknown_master_is_told_from_no_answer() {
        let unknown = agree(&[
            ("s1".into(), Said::Unknown),
            ("s2".into(), Said::Failed("refused".into())),
        ]);
        assert!(unknown.unknown_master());
        let silent = agree(&[("s1".into(), Said::Failed("refused".into()))]);
        assert!(!silent.unknown_master());
        // one sentinel that knows it is enough
        let known = agree(&[("s1".into(), Said::Unknown), ("s2".into(), named("a", 1))]);
        assert!(!known.unknown_master());
    }

    #[test]
    fn replies_are_read() {
        use fred::bytes::Bytes;
        let bulk = |s: &str| BytesFrame::BulkString(Bytes::from(s.to_string()));
        assert_eq!(
            said_of(&BytesFrame::Array(vec![bulk("127.0.0.1"), bulk("6380")])),
            named("127.0.0.1", 6380)
        );
        assert_eq!(said_of(&BytesFrame::Null), Said::Unknown);
        assert!(matches!(
            said_of(&BytesFrame::Array(vec![bulk("h"), bulk("x")])),
            Said::Failed(_)
        ));
        assert!(matches!(
            said_of(&BytesFrame::Error("NOAUTH".into())),
            Said::Failed(_)
        ));
    }
}
