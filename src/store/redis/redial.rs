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
//! **Layer:** store (the Redis store's rooms). Uses the nodes' connections
//! and `ROLE`; builds [`Routing`].

use std::sync::{Arc, Weak};
use std::time::Duration;

use fred::types::config::Config;
use parking_lot::RwLock;
use tokio::sync::Notify;

use super::nodes::{role, ClientRecipe, NodeClients, Routing, CLIENT_STALL_BOUND};

/// How soon the address is tried again while it reaches no primary...
pub const REDIAL_RETRY: Duration = Duration::from_millis(100);
/// ...and at most, the wait doubling each time.
pub const REDIAL_RETRY_MAX: Duration = Duration::from_millis(500);

/// The single server's address, to dial again when it was demoted.
pub struct Redial {
    /// The server as the URL names it (`host:port`, or a socket's path).
    name: Arc<str>,
    config: Config,
    wake: Notify,
}

impl Redial {
    pub fn new(name: Arc<str>, config: Config) -> Arc<Self> {
        Arc::new(Self {
            name,
            config,
            wake: Notify::new(),
        })
    }

    /// A decision met `READONLY`: the server is no longer a primary.
    pub fn wake(&self) {
        self.wake.notify_one();
    }
}

/// Waits for [`Redial::wake`] while the routing lives; then dials the
/// address until it reaches a primary, and moves the routing there.
pub fn spawn(redial: Arc<Redial>, recipe: ClientRecipe, routing: Weak<RwLock<Arc<Routing>>>) {
    tokio::spawn(async move {
        loop {
            // woken, or a look every second whether the store is still there
            let woken = tokio::select! {
                () = redial.wake.notified() => true,
                () = tokio::time::sleep(Duration::from_secs(1)) => false,
            };
            if routing.strong_count() == 0 {
                return;
            }
            if !woken {
                continue;
            }
            tracing::warn!(
                server = %redial.name,
                "Redis answered READONLY: the server is no longer a primary; dialling its address again"
            );
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
