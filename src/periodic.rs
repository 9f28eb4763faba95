//! Background work on a timer, for as long as its owner lives.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`): a
//! leaf: uses nothing of the crate.

use std::sync::{Arc, Weak};
use std::time::Duration;

/// Runs `work` on `owner` every `every` (a late tick is not caught up with a
/// burst) until the owner is dropped. Needs a tokio runtime.
pub fn spawn_every<T: Send + Sync + 'static>(
    owner: &Arc<T>,
    every: Duration,
    work: impl Fn(&Arc<T>) + Send + 'static,
) {
    let weak: Weak<T> = Arc::downgrade(owner);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match weak.upgrade() {
                Some(owner) => work(&owner),
                None => return,
            }
        }
    });
}
