//! One Redis behind an address that fails over by pointing somewhere else
//! (a Kubernetes Service, a DNS name, a proxy, a managed Redis's primary
//! endpoint), followed through a failover.
//!
//! A primary demoted in such a failover keeps the connections it had, and
//! answers every write on them `READONLY` (envoyproxy/ratelimit #1191: there,
//! until the process restarts). Here the first decision that meets
//! `READONLY` ([`Redial::wake`]; it ran nothing, and is answered by its
//! rule's failure mode, never sent again) has the address dialled again at
//! once: once the server it reaches now says it is a primary (`ROLE`, on a
//! connection of its own; an address that cannot say, a proxy refusing
//! `ROLE`, is taken as it is), the routing's one node is replaced by fresh
//! connections to it and the old ones close. While the address still
//! reaches a replica (or nothing), it is tried again after [`REDIAL_RETRY`],
//! the wait doubling up to [`REDIAL_RETRY_MAX`] (an address that names a
//! replica for good, a mistake, costs two connections a second).
//!
//! A demoted primary configured `replica-read-only no` answers no write
//! `READONLY`: it takes them, and they are lost (issue 52: 9,994 admitted,
//! 3,723 counted on the new primary, nothing said). So the server the
//! connections are on is also asked `ROLE` every [`ROLE_CHECK`], on the
//! probe's connection (made with the decisions' ones, never behind them);
//! one that says it is a replica is left as on `READONLY`, logged and
//! counted (`rls_store_primary_events_total{event="demoted"}`). What it
//! took in between is bounded by the calls of one [`ROLE_CHECK`].
//!
//! **Layer:** store (the Redis store's rooms). Uses the nodes' connections
//! and `ROLE`; builds [`Routing`].

use std::sync::{Arc, Weak};
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::ClientLike;
use fred::types::config::{Config, Options};
use fred::types::Value;
use parking_lot::RwLock;
use tokio::sync::Notify;

use super::nodes::{role, ClientRecipe, NodeClients, Routing, CLIENT_STALL_BOUND};
use super::primary_events::{MetricsSlot, PrimaryEvent};

/// How soon the address is tried again while it reaches no primary...
pub const REDIAL_RETRY: Duration = Duration::from_millis(100);
/// ...and at most, the wait doubling each time.
pub const REDIAL_RETRY_MAX: Duration = Duration::from_millis(500);

/// How often the server the connections are on is asked its role.
pub const ROLE_CHECK: Duration = Duration::from_millis(500);

/// The single server's address, to dial again when it was demoted.
pub struct Redial {
    /// The server as the URL names it (`host:port`, or a socket's path).
    name: Arc<str>,
    config: Config,
    wake: Notify,
    metrics: MetricsSlot,
}

impl Redial {
    pub fn new(name: Arc<str>, config: Config) -> Arc<Self> {
        Arc::new(Self {
            name,
            config,
            wake: Notify::new(),
            metrics: MetricsSlot::default(),
        })
    }

    /// Where demotions found and moves are counted.
    pub fn metrics(&self) -> &MetricsSlot {
        &self.metrics
    }

    /// A decision met `READONLY`: the server is no longer a primary.
    pub fn wake(&self) {
        self.wake.notify_one();
    }
}

/// Waits for [`Redial::wake`], or for the server the connections are on
/// to say it is a replica, while the routing lives; then dials the address
/// until it reaches a primary, and moves the routing there.
pub fn spawn(redial: Arc<Redial>, recipe: ClientRecipe, routing: Weak<RwLock<Arc<Routing>>>) {
    tokio::spawn(async move {
        loop {
            let woken = tokio::select! {
                () = redial.wake.notified() => true,
                () = tokio::time::sleep(ROLE_CHECK) => false,
            };
            let Some(shared) = routing.upgrade() else {
                return;
            };
            if woken {
                drop(shared);
                tracing::warn!(
                    server = %redial.name,
                    "Redis answered READONLY: the server is no longer a primary; dialling its address again"
                );
            } else {
                let probe = shared.read().nodes.first().map(|n| n.clients.probe.clone());
                drop(shared);
                let Some(role) = demoted(probe).await else {
                    continue;
                };
                redial.metrics.count(PrimaryEvent::Demoted);
                tracing::warn!(
                    server = %redial.name,
                    "Redis: the server the connections are on says it is a {role} (ROLE) and still takes writes (replica-read-only no), which no primary will see; dialling its address again"
                );
            }
            let mut said = String::new();
            let mut wait = REDIAL_RETRY;
            loop {
                // what is said once the address is connected to again: a
                // primary, or a proxy (twemproxy) that cannot say, for which
                // fresh connections through it are the most it can be given
                let reached = match role(&redial.config).await {
                    Ok(Some(role)) if role == "master" => {
                        Ok("its address reaches a primary again; decisions go there")
                    }
                    Ok(None) => {
                        Ok("the address does not say its role (a proxy?); connected to it again")
                    }
                    Ok(Some(role)) => Err(format!("the address still reaches a {role}")),
                    Err(e) => Err(e),
                };
                let why = match reached {
                    Ok(news) => match move_to(&redial, &recipe, &routing).await {
                        Ok(()) => {
                            redial.metrics.count(PrimaryEvent::Moved);
                            tracing::warn!(server = %redial.name, "Redis: {news}");
                            break;
                        }
                        Err(e) => e,
                    },
                    Err(why) => why,
                };
                if why != said {
                    tracing::warn!(server = %redial.name, "Redis: no primary yet: {why}");
                    said = why;
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(REDIAL_RETRY_MAX);
                if routing.strong_count() == 0 {
                    return;
                }
            }
            // READONLY answers from the old connections, still arriving
            // after the move, are not a new failover
            tokio::time::sleep(REDIAL_RETRY).await;
            let _ = tokio::time::timeout(Duration::ZERO, redial.wake.notified()).await;
        }
    });
}

/// The role the server `probe` is connected to says it has, when that is
/// not a primary's; `None` for a primary, no probe, or no answer (a proxy
/// refusing `ROLE` cannot say, and the decisions' own answers tell then).
async fn demoted(probe: Option<Client>) -> Option<String> {
    let probe = probe?;
    if !probe.is_connected() {
        return None;
    }
    let opts = Options {
        timeout: Some(CLIENT_STALL_BOUND),
        fail_fast: true,
        max_attempts: Some(1),
        ..Options::default()
    };
    let reply: Value = probe
        .with_options(&opts)
        .custom(fred::cmd!("ROLE"), Vec::<Value>::new())
        .await
        .ok()?;
    let Value::Array(parts) = reply else {
        return None;
    };
    let role = parts.first()?.as_string()?;
    (role != "master").then_some(role)
}

/// Fresh connections to the address in place of the routing's node; the
/// old ones close.
async fn move_to(
    redial: &Redial,
    recipe: &ClientRecipe,
    routing: &Weak<RwLock<Arc<Routing>>>,
) -> Result<(), String> {
    let clients = NodeClients::connect(recipe, redial.config.clone())?;
    clients.wait(CLIENT_STALL_BOUND).await;
    if let Some(shared) = routing.upgrade() {
        Routing::replace(&shared, Routing::single(redial.name.clone(), clients));
    }
    Ok(())
}
