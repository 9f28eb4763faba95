//! Hot reload: watch the config path and swap in new rules atomically.
//!
//! Filesystem events (notify) on the config directory and its parent, plus a
//! rescan every second as a safety net, trigger a reload after a short quiet
//! period, at most a second after the first event ([`crate::rules::watch`] decides
//! which events count and when). A reload happens only when the rule files' contents changed (a
//! fingerprint over names and bytes), loads everything, and swaps the whole
//! [`RuleSet`] in one pointer store: requests see the old rules or the new
//! ones, never a mix. A change that does not load (a syntax error, a file
//! caught half-written, every rule file gone) is rejected whole and logged
//! once; the old rules keep serving. SIGHUP forces a reload.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! where rules come from, under `store`; uses `telemetry` and the rules
//! themselves.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use notify::{RecursiveMode, Watcher};
use parking_lot::Mutex;

use crate::rules::watch::{Debounce, RulesPath};
use crate::rules::SharedRules;
use crate::rules::{load_path, rule_files, ConfigErrors, LoadOptions, RuleSet};
use crate::telemetry::Metrics;

/// Rescan interval, for changes no event reported; it runs on its own
/// schedule whatever the event stream does.
const RESCAN: Duration = Duration::from_secs(1);

/// What one reload attempt did.
#[derive(Debug, PartialEq, Eq)]
pub enum ReloadOutcome {
    Unchanged,
    Applied { generation: u64 },
    Rejected,
}

pub struct Reloader {
    path: PathBuf,
    opts: LoadOptions,
    rules: SharedRules,
    /// Fingerprint of the files behind the live rules.
    applied: Mutex<Option<u64>>,
    /// Fingerprint of the last rejected files, so an error is logged once.
    rejected: Mutex<Option<u64>>,
    metrics: Arc<Metrics>,
}

impl Reloader {
    /// `rules` holds what was loaded at start-up from `path`.
    pub fn new(
        path: PathBuf,
        opts: LoadOptions,
        rules: SharedRules,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let applied = fingerprint(&path).ok();
        metrics.set_generation(rules.load().generation());
        Arc::new(Self {
            path,
            opts,
            rules,
            applied: Mutex::new(applied),
            rejected: Mutex::new(None),
            metrics,
        })
    }

    /// Loads the rules again if their files changed (or always, with `force`).
    pub fn reload(&self, force: bool) -> ReloadOutcome {
        let print = fingerprint(&self.path);
        let current = print.as_ref().ok().copied();
        if !force && current.is_some() && current == *self.applied.lock() {
            if self.rejected.lock().take().is_some() {
                // The last line logged was the rejection: say it is over.
                tracing::info!(path = %self.path.display(), "rules on disk are valid again, the same as the rules being served");
            }
            return ReloadOutcome::Unchanged;
        }
        if !force && current.is_some() && current == *self.rejected.lock() {
            return ReloadOutcome::Unchanged; // already reported
        }
        let result = print.and_then(|_| self.load());
        match result {
            Ok(set) => {
                set.say_warnings();
                let generation = self.rules.load().generation() + 1;
                let domains = set.domains().count();
                let set = set
                    .with_generation(generation)
                    .succeeding(&self.rules.load(), crate::clock::unix_millis());
                self.rules.store(Arc::new(set));
                *self.applied.lock() = current;
                let after_rejection = self.rejected.lock().take().is_some();
                self.metrics.config_reload(true, generation);
                if after_rejection {
                    tracing::info!(generation, domains, path = %self.path.display(), "rules on disk are valid again; reloaded");
                } else {
                    tracing::info!(generation, domains, path = %self.path.display(), "rules reloaded");
                }
                ReloadOutcome::Applied { generation }
            }
            Err(errors) => {
                *self.rejected.lock() = current;
                self.metrics
                    .config_reload(false, self.rules.load().generation());
                for e in errors.iter() {
                    tracing::error!(file = %e.file.display(), "rules change rejected, previous rules keep serving: {}", e.message);
                }
                ReloadOutcome::Rejected
            }
        }
    }

    fn load(&self) -> Result<RuleSet, ConfigErrors> {
        if rule_files(&self.path)?.is_empty() && !self.rules.load().files().is_empty() {
            return Err(ConfigErrors(vec![crate::rules::ConfigError::new(
                &self.path,
                "no rule files left; keeping the current rules (an empty rules path is only accepted at start-up)",
            )]));
        }
        load_path(&self.path, self.opts.clone())
    }

    /// Watches the config path and reloads on changes and on SIGHUP, until
    /// the process ends. The watching task owns the OS watcher.
    pub fn spawn(self: &Arc<Self>) -> anyhow::Result<()> {
        let target = RulesPath::new(&self.path);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let filter = target.clone();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // Events about other files never reach the reload task.
                if event.map_or(true, |e| filter.concerns_any(e.paths.iter())) {
                    let _ = tx.send(());
                }
            })?;
        let dir = target.dir().to_path_buf();
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
        if let Some(parent) = target.parent() {
            let _ = watcher.watch(&parent, RecursiveMode::NonRecursive);
        }

        let this = self.clone();
        tokio::spawn(async move {
            let mut rescan = tokio::time::interval(RESCAN);
            rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut hangup = hangup_signal();
            let mut watched_dir = dir_identity(&dir);
            let mut debounce = Debounce::default();
            loop {
                // One select over everything: neither events nor their
                // debounce can hold back the rescan, and the debounce itself
                // ends at most MAX_WAIT after the first event.
                let due = debounce.due();
                tokio::select! {
                    event = rx.recv() => match event {
                        Some(()) => debounce.event(Instant::now()),
                        None => return,
                    },
                    _ = sleep_until(due), if due.is_some() => {
                        debounce.clear();
                        this.reload(false);
                    }
                    _ = rescan.tick() => {
                        // A replaced directory is a new inode: watch it anew.
                        let now = dir_identity(&dir);
                        if now != watched_dir {
                            watched_dir = now;
                            let _ = watcher.unwatch(&dir);
                            let _ = watcher.watch(&dir, RecursiveMode::NonRecursive);
                        }
                        this.reload(false);
                    }
                    _ = hangup.recv() => {
                        tracing::info!("SIGHUP: reloading rules");
                        this.reload(true);
                    }
                }
            }
        });
        Ok(())
    }
}

async fn sleep_until(due: Option<Instant>) {
    if let Some(due) = due {
        tokio::time::sleep_until(due.into()).await;
    }
}

#[cfg(unix)]
fn dir_identity(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn dir_identity(dir: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(dir).ok().map(|_| (0, 0))
}

#[cfg(unix)]
fn hangup_signal() -> tokio::sync::mpsc::UnboundedReceiver<()> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    if let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                if tx.send(()).is_err() {
                    return;
                }
            }
        });
    }
    rx
}

#[cfg(not(unix))]
fn hangup_signal() -> tokio::sync::mpsc::UnboundedReceiver<()> {
    tokio::sync::mpsc::unbounded_channel().1
}

/// A hash of the rule files' names and contents.
fn fingerprint(path: &Path) -> Result<u64, ConfigErrors> {
    let mut h = DefaultHasher::new();
    for file in rule_files(path)? {
        file.hash(&mut h);
        match std::fs::read(&file) {
            Ok(bytes) => bytes.hash(&mut h),
            Err(e) => {
                return Err(ConfigErrors(vec![crate::rules::ConfigError::new(
                    &file,
                    format!("cannot read: {e}"),
                )]))
            }
        }
    }
    Ok(h.finish())
}
