//! Hot reload: watch the config path and swap in new rules atomically.
//!
//! Filesystem events (notify) on the config directory and its parent, plus a
//! rescan every second as a safety net, trigger a reload after a short quiet
//! period. A reload happens only when the rule files' contents changed (a
//! fingerprint over names and bytes), loads everything, and swaps the whole
//! [`RuleSet`] in one pointer store: requests see the old rules or the new
//! ones, never a mix. A change that does not load (a syntax error, a file
//! caught half-written, every rule file gone) is rejected whole and logged
//! once; the old rules keep serving. SIGHUP forces a reload.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use parking_lot::Mutex;

use super::{load_path, rule_files, ConfigErrors, LoadOptions, RuleSet};
use crate::service::SharedRules;
use crate::telemetry::Metrics;

/// How long the files must be quiet before a reload (an editor's burst of
/// events, a `cp` of several files, a ConfigMap swap).
const QUIET: Duration = Duration::from_millis(250);
/// Rescan interval, for changes no event reported.
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
    merge_domains: bool,
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
        merge_domains: bool,
        rules: SharedRules,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let applied = fingerprint(&path).ok();
        metrics.set_generation(rules.load().generation());
        Arc::new(Self {
            path,
            merge_domains,
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
            return ReloadOutcome::Unchanged;
        }
        if !force && current.is_some() && current == *self.rejected.lock() {
            return ReloadOutcome::Unchanged; // already reported
        }
        let result = print.and_then(|_| self.load());
        match result {
            Ok(set) => {
                let generation = self.rules.load().generation() + 1;
                let domains = set.domains().count();
                self.rules.store(Arc::new(set.with_generation(generation)));
                *self.applied.lock() = current;
                *self.rejected.lock() = None;
                self.metrics.config_reload(true, generation);
                tracing::info!(generation, domains, path = %self.path.display(), "rules reloaded");
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
            return Err(ConfigErrors(vec![super::ConfigError::new(
                &self.path,
                "no rule files left; keeping the current rules (an empty rules path is only accepted at start-up)",
            )]));
        }
        load_path(
            &self.path,
            LoadOptions {
                merge_domains: self.merge_domains,
                allow_empty_files: false,
            },
        )
    }

    /// Watches the config path and reloads on changes and on SIGHUP, until
    /// the process ends. The watching task owns the OS watcher.
    pub fn spawn(self: &Arc<Self>) -> anyhow::Result<()> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let mut watcher =
            notify::recommended_watcher(move |_event: notify::Result<notify::Event>| {
                let _ = tx.send(());
            })?;
        // The directory (or the file's directory) for edits, new, removed and
        // renamed files and ConfigMap `..data` swaps; its parent for the
        // directory itself being replaced.
        let dir = if self.path.is_dir() {
            self.path.clone()
        } else {
            self.path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("."))
        };
        let dir = if dir.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            dir
        };
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
        if let Some(parent) = dir
            .canonicalize()
            .ok()
            .and_then(|d| d.parent().map(Path::to_path_buf))
        {
            let _ = watcher.watch(&parent, RecursiveMode::NonRecursive);
        }

        let this = self.clone();
        tokio::spawn(async move {
            let mut rescan = tokio::time::interval(RESCAN);
            rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut hangup = hangup_signal();
            let mut watched_dir = dir_identity(&dir);
            loop {
                tokio::select! {
                    event = rx.recv() => {
                        if event.is_none() {
                            return;
                        }
                        // Wait for the burst to end.
                        loop {
                            match tokio::time::timeout(QUIET, rx.recv()).await {
                                Ok(Some(())) => continue,
                                Ok(None) => return,
                                Err(_) => break,
                            }
                        }
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
                return Err(ConfigErrors(vec![super::ConfigError::new(
                    &file,
                    format!("cannot read: {e}"),
                )]))
            }
        }
    }
    Ok(h.finish())
}
