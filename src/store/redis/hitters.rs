//! Heavy hitters shared by the instances on one Redis, so that each
//! instance's admin page shows them all: every instance writes its
//! current minute's and hour's summaries (`telemetry::hitters`), each in a
//! hash of its window (`rls:hitters:<domain>\0<rule>:<kind>:<length>:<start>`,
//! one field per instance, kept two windows), and names its rules in the
//! hash `rls:hitters:rules`; a reader adds up every instance's.

use std::collections::HashMap;
use std::time::Duration;

use fred::bytes::Bytes;
use fred::prelude::*;

use super::reply::store_error;
use super::RedisStore;
use crate::store::StoreError;

/// The hash naming the rules whose summaries are shared (field
/// `<domain>\0<rule>`, value: the Unix second of the last write).
const RULES: &[u8] = b"rls:hitters:rules";

/// One summary to write: its rule (`<domain>\0<rule>`), its key, its
/// value (JSON) and how long it is kept.
pub struct Shared {
    pub rule: Vec<u8>,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub keep: Duration,
}

impl RedisStore {
    /// The client of the primary owning `key`'s slot.
    fn client_of(&self, key: &[u8]) -> Result<Client, StoreError> {
        let slot = fred::util::redis_keyslot(key);
        self.routing
            .read()
            .node_of_slot(slot)
            .map(|n| n.clients.pool.next().clone())
            .ok_or_else(|| {
                StoreError::Connection(format!("no known Redis primary owns slot {slot}"))
            })
    }

    async fn command(
        &self,
        key: &Bytes,
        name: &'static str,
        args: Vec<Value>,
    ) -> Result<Value, StoreError> {
        let client = self.client_of(key)?;
        let mut all = vec![Value::Bytes(key.clone())];
        all.extend(args);
        client
            .with_options(&self.options)
            .custom(
                fred::types::CustomCommand::new_static(name, None, false),
                all,
            )
            .await
            .map_err(store_error)
    }

    /// Writes this instance's (`instance`) summaries: each `(rule, key,
    /// value, keep)` under `rls:hitters:<key>`, kept `keep`.
    pub async fn share_hitters(
        &self,
        instance: &str,
        summaries: &[Shared],
        now_secs: u64,
    ) -> Result<(), StoreError> {
        let index = self.prefixed(Bytes::from_static(RULES));
        for Shared {
            rule: _,
            key,
            value,
            keep,
        } in summaries
        {
            let keep_ms = Value::Integer(i64::try_from(keep.as_millis()).unwrap_or(i64::MAX));
            let mut full = b"rls:hitters:".to_vec();
            full.extend_from_slice(key);
            let full = self.prefixed(Bytes::from(full));
            self.command(
                &full,
                "HSET",
                vec![
                    Value::from(instance),
                    Value::Bytes(Bytes::from(value.clone())),
                ],
            )
            .await?;
            self.command(&full, "PEXPIRE", vec![keep_ms]).await?;
        }
        // each rule named once, however many of its summaries were written
        let mut rules: Vec<&Vec<u8>> = summaries.iter().map(|s| &s.rule).collect();
        rules.sort();
        rules.dedup();
        for rule in &rules {
            self.command(
                &index,
                "HSET",
                vec![
                    Value::Bytes(Bytes::from((*rule).clone())),
                    Value::Integer(i64::try_from(now_secs).unwrap_or(0)),
                ],
            )
            .await?;
        }
        if !rules.is_empty() {
            self.command(&index, "PEXPIRE", vec![Value::Integer(2 * 3_600_000)])
                .await?;
        }
        Ok(())
    }

    /// The rules whose summaries are shared (`<domain>\0<rule>`).
    pub async fn shared_hitter_rules(&self) -> Result<Vec<Vec<u8>>, StoreError> {
        let index = self.prefixed(Bytes::from_static(RULES));
        let reply = self.command(&index, "HKEYS", Vec::new()).await?;
        reply
            .convert::<Vec<Bytes>>()
            .map(|v| v.into_iter().map(|b| b.to_vec()).collect())
            .map_err(store_error)
    }

    /// Every instance's summary under `key`.
    pub async fn shared_hitters(&self, key: &[u8]) -> Result<Vec<Vec<u8>>, StoreError> {
        let mut full = b"rls:hitters:".to_vec();
        full.extend_from_slice(key);
        let full = self.prefixed(Bytes::from(full));
        let reply = self.command(&full, "HVALS", Vec::new()).await?;
        reply
            .convert::<Vec<Bytes>>()
            .map(|v| v.into_iter().map(|b| b.to_vec()).collect())
            .map_err(store_error)
    }
}

/// How often an instance writes its summaries.
pub const SHARE_EVERY: Duration = Duration::from_secs(2);

/// Writes this instance's heavy hitters every [`SHARE_EVERY`] while
/// `instances` counts more than one, until `stopped`, and once more then
/// (what this instance counted since its last write is not lost with it;
/// nothing when they are off: a lone instance's page shows its own). A write that fails is logged at
/// debug level and tried again at the next tick: the page then shows what
/// the others wrote, and this instance's own summaries.
pub fn spawn_sharing(
    redis: std::sync::Arc<RedisStore>,
    metrics: std::sync::Arc<crate::telemetry::Metrics>,
    instance: String,
    instances: crate::instances::Instances,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    metrics.hitters()?;
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(SHARE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // each summary's hits as last written (by its key)
        let mut written: HashMap<Vec<u8>, u64> = HashMap::new();
        let mut last = false;
        while !last {
            last = tokio::select! {
                _ = tick.tick() => false,
                _ = async { stopped.wait_for(|s| *s).await.map(|_| ()) } => true,
            };
            if instances.get() < 2 {
                continue;
            }
            let Some(hitters) = metrics.hitters() else {
                return;
            };
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            // each kept through the window after its own (read as "the
            // one before"), and a little more
            // a summary unchanged since this instance last wrote it (a
            // window that has ended, mostly) is not written again
            let exported = hitters.export();
            let totals: HashMap<Vec<u8>, u64> = exported
                .iter()
                .map(|(_, _, _, key, summary)| (key.clone(), summary.total))
                .collect();
            let summaries: Vec<Shared> = exported
                .into_iter()
                .filter(|(_, _, _, key, summary)| written.get(key) != Some(&summary.total))
                .filter_map(|(domain, rule, length, key, summary)| {
                    let value = serde_json::to_vec(&summary).ok()?;
                    let keep = Duration::from_secs(2 * length + 10);
                    Some(Shared {
                        rule: format!("{domain}\0{rule}").into_bytes(),
                        key,
                        value,
                        keep,
                    })
                })
                .collect();
            match redis.share_hitters(&instance, &summaries, now).await {
                Ok(()) => written = totals,
                Err(e) => {
                    tracing::debug!(error = %e, "heavy hitters not shared this time (Redis did not answer)")
                }
            }
        }
    }))
}
